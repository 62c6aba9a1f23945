"""Issue 37, two tiers: the hygiene rules (TT110, TT111, TT116, TT120, TT121, TT131) report by default only the
findings shown to matter where they fire, every finding with --select hygiene (or the rule's id); each rule's
condition with a case where it holds and a look-alike where it does not."""

from __future__ import annotations

import pytest

from torch_tricks.doctor import get_rule, list_rules
from torch_tricks.doctor.static import lint_source

HYGIENE_RULES = {"TT110", "TT111", "TT116", "TT120", "TT121", "TT131"}

# the same load, twice: once where the file shows it matters, once where it does not
CASES = {
    "TT111": (
        # a whole pickled module: fails under torch >= 2.6's weights_only=True default
        "import torch\nmodel = torch.load('model.pt')\nmodel.eval()\nout = model(x)\n",
        # a state_dict: loads the same under either default
        "import torch\nnet.load_state_dict(torch.load('w.pt', map_location='cpu'))\n",
    ),
    "TT110": (
        # the file saves the weights of a model it moves to the GPU: a CPU-only machine loads GPU tensors
        "import torch\nnet = Net().cuda()\ntorch.save(net.state_dict(), 'w.pt')\n"
        "net.load_state_dict(torch.load('w.pt', weights_only=True))\n",
        # saved from the CPU
        "import torch\nnet = Net().cuda()\nnet.cpu()\ntorch.save(net.state_dict(), 'w.pt')\n"
        "net.load_state_dict(torch.load('w.pt', weights_only=True))\n",
    ),
    "TT131": (
        # the step's only sync, and it only feeds a running sum
        "import torch\nmodel = model.cuda()\nfor x, y in loader:\n    x, y = x.cuda(), y.cuda()\n"
        "    loss = crit(model(x), y)\n    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
        "    total += loss.item()\n",
        # the loop prints the loss every step anyway: one more read costs nothing
        "import torch\nmodel = model.cuda()\nfor x, y in loader:\n    x, y = x.cuda(), y.cuda()\n"
        "    loss = crit(model(x), y)\n    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
        "    total += loss.item()\n    print(loss.item())\n",
    ),
    "TT121": (
        # a torchvision image dataset: every item is decoded and transformed
        "import torch\nimport torchvision\nds = torchvision.datasets.ImageFolder('train', transform=t)\n"
        "loader = torch.utils.data.DataLoader(ds, batch_size=32)\nfor x, y in loader:\n"
        "    loss = crit(model(x), y)\n    loss.backward()\n",
        # tokenized ids already in memory (a dataset of this file indexing a list)
        "import torch\nclass Ids(torch.utils.data.Dataset):\n    def __getitem__(self, i):\n        return self.ids[i]\n"
        "    def __len__(self):\n        return len(self.ids)\n"
        "loader = torch.utils.data.DataLoader(Ids(), batch_size=32)\nfor x in loader:\n"
        "    loss = model(x).sum()\n    loss.backward()\n",
    ),
}


def _rules(findings) -> set[str]:
    return {f.rule for f in findings}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_a_hygiene_rule_reports_by_default_only_where_it_matters(rule):
    matters, look_alike = CASES[rule]
    assert rule in _rules(lint_source(matters))
    assert rule not in _rules(lint_source(look_alike))
    assert rule in _rules(lint_source(look_alike, select=["hygiene"]))  # the tier in full
    assert rule in _rules(lint_source(look_alike, select=[rule]))  # named by id: in full


def test_eval_without_no_grad_is_left_out_of_test_code_by_default():
    src = "import torch\nmodel.eval()\nout = model(x)\n"
    assert "TT116" in _rules(lint_source(src, "train.py"))
    for path in ("tests/test_model.py", "pkg/tests/helpers.py", "test_model.py", "model_test.py"):
        assert "TT116" not in _rules(lint_source(src, path)), path
        assert "TT116" in _rules(lint_source(src, path, select=["hygiene"]))


def test_pin_memory_is_hygiene_only():
    src = ("import torch\nloader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=4)\n"
           "for x, y in loader:\n    x = x.cuda()\n    loss = model(x).sum()\n    loss.backward()\n")
    assert "TT120" not in _rules(lint_source(src))
    assert "TT120" in _rules(lint_source(src, select=["hygiene"]))


def test_every_rule_has_a_tier_and_the_hygiene_ones_say_why():
    tiers = {r.id: r.tier for r in list_rules()}
    assert {rid for rid, t in tiers.items() if t == "hygiene"} == HYGIENE_RULES
    assert set(tiers.values()) == {"default", "hygiene"}
    for rid in HYGIENE_RULES:
        assert "by default" in get_rule(rid).tier_why or "--select hygiene" in get_rule(rid).tier_why


def test_the_cli_lists_and_explains_the_tier(capsys):
    from torch_tricks.cli import main

    assert main(["doctor", "--list"]) == 0
    out = capsys.readouterr().out
    assert "tier" in out.splitlines()[0] and "hygiene" in out
    assert main(["doctor", "--explain", "TT131"]) == 0
    out = capsys.readouterr().out
    assert "hygiene tier" in out and "Tier: hygiene." in out and "--select hygiene" in out
    assert main(["doctor", "--explain", "TT113"]) == 0
    assert "Tier: default." in capsys.readouterr().out


def test_the_summary_counts_what_the_hygiene_tier_left_out(capsys, tmp_path):
    import json

    from torch_tricks.cli import main

    path = tmp_path / "m.py"
    path.write_text("import torch\nstate = torch.load('w.pt')\n")  # TT110 and TT111, nothing shown to matter
    assert main(["doctor", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and "no findings in 1 file(s)" in err and "2 more of the hygiene tier" in err
    assert main(["doctor", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hygiene_left_out"] == 2
    assert main(["doctor", str(path), "--select", "hygiene"]) == 1  # TT111 is a warning
    assert "more of the hygiene tier" not in capsys.readouterr().err
