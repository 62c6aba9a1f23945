"""The runtime doctor (rules TT2xx): each rule on a model that has the pitfall and on one
that does not, the caller's objects left untouched, and bad input as one-line errors."""

from __future__ import annotations

import json
import re
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.doctor import runtime
from torch_tricks.doctor.runtime import check_model
from torch_tricks.errors import UserError
from torch_tricks.models import get_model
from torch_tricks.train.optim import build_optimizer, param_groups


def check(*args, **kwargs):
    """check_model without the memory-growth steps (its gc scans cost ~0.3 s a step here)."""
    return check_model(*args, steps=1, **kwargs)


def rules_of(report, rule=None):
    return [f for f in report.findings if rule is None or f.rule == rule]


def paths(report, rule):
    return sorted(f.path for f in rules_of(report, rule))


# -- models ---------------------------------------------------------------------------------

class MLP(nn.Module):
    """Clean: dims multiples of 8, functional ReLU, every layer used."""

    def __init__(self, d_in=16, hidden=32, d_out=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class ConvBN(nn.Module):
    """Conv -> BN -> ReLU(inplace) -> pool -> fc; clean at a batch of 8."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x = self.act(self.bn(self.conv(x)))
        return self.fc(x.mean((2, 3)))


class Buggy(nn.Module):
    """A plain-list block, an unused layer and a log_softmax head."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.blocks = [nn.Linear(32, 32)]
        self.unused = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        x = torch.relu(self.fc1(x))
        for block in self.blocks:
            x = torch.relu(block(x))
        return F.log_softmax(self.head(x), dim=1)


class Head(nn.Module):
    """MLP whose output goes through ``post`` (log_softmax, softmax, sigmoid or nothing)."""

    def __init__(self, post, d_out=8):
        super().__init__()
        self.body = MLP(16, 32, d_out)
        self.post = post

    def forward(self, x):
        return self.post(self.body(x))


X16 = lambda n=8: torch.randn(n, 16)  # noqa: E731
IMG = lambda n=8: torch.randn(n, 3, 8, 8)  # noqa: E731


# -- registry -------------------------------------------------------------------------------

def test_rules_are_registered_with_sources_and_fixes():
    ids = [r.id for r in runtime.RULES]
    assert ids == [f"TT2{i:02d}" for i in range(1, 17)]
    for r in runtime.RULES:
        assert r.kind == "runtime"
        assert re.match(r"^[A-Z]\d*", r.source) and "seeds/" in r.source, r.id
        assert "Fix" in r.explanation or "fix" in r.explanation.lower(), r.id
    assert {r.severity for r in runtime.RULES if r.id in ("TT205", "TT206")} == {"info"}
    assert len({r.name for r in runtime.RULES}) == len(runtime.RULES)


# -- precision on a real model --------------------------------------------------------------

def test_resnet18_with_proper_setup_has_no_findings():
    model = get_model("resnet18")
    opt = build_optimizer(model, "adamw", weight_decay=0.05)  # AdamW on param_groups, fused step
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    report = check_model(model, torch.randn(8, 3, 32, 32), nn.CrossEntropyLoss(), opt, steps=2)
    assert report.completed and report.steps_run == 4
    assert report.findings == [], [(f.rule, f.path, f.message) for f in report.findings]
    assert report.ok
    assert report.memory is not None and not report.memory["leaking"]
    assert report.target.startswith("generated class indices (8,)")
    assert report.parameters_without_grad == []
    assert min(report.batchnorm_batch.values()) == 8


def test_buggy_model_reports_plain_list_unused_layer_and_log_softmax_head():
    model = Buggy()
    opt = torch.optim.AdamW(param_groups(model, 0.01))
    report = check(model, X16(), nn.CrossEntropyLoss(), opt)
    got = {(f.rule, f.path) for f in report.findings}
    assert ("TT203", "blocks") in got
    assert ("TT201", "unused") in got
    assert ("TT207", "(model)") in got
    pairing = rules_of(report, "TT207")[0]
    assert "log-probabilities" in pairing.message and pairing.severity == "warning"
    unused = rules_of(report, "TT201")[0]
    assert unused.extra["params"] == ["unused.weight", "unused.bias"]
    assert "weight_decay=0.01" in unused.message  # the optimizer still decays unused.weight
    assert not report.ok


# -- TT201 unused parameters ------------------------------------------------------------------

def test_unused_parameters_without_optimizer_and_used_ones():
    report = check(Buggy(), X16())
    (f,) = rules_of(report, "TT201")
    assert f.path == "unused" and "weight_decay" not in f.message
    assert report.parameters_without_grad == ["unused.weight", "unused.bias"]
    assert rules_of(check(MLP(), X16()), "TT201") == []


def test_a_detached_output_means_no_parameter_gets_a_gradient():
    class Detached(MLP):
        def forward(self, x):
            return super().forward(x).detach() + x.new_zeros(()).requires_grad_()

    (f,) = rules_of(check(Detached(), X16()), "TT201")
    assert f.path == "(model)" and "no trainable parameter" in f.message


# -- TT202 weight decay on bias / norm --------------------------------------------------------

def test_weight_decay_on_bias_and_norm_is_reported_per_group():
    model = ConvBN()
    report = check(model, IMG(), nn.CrossEntropyLoss(), torch.optim.AdamW(model.parameters(), weight_decay=0.01))
    (f,) = rules_of(report, "TT202")
    assert f.path == "optimizer.param_groups[0]"
    assert f.extra["params"] == ["bn.weight", "bn.bias", "fc.bias"]
    for opt in (torch.optim.AdamW(param_groups(model, 0.01)), torch.optim.SGD(model.parameters(), lr=0.1)):
        assert rules_of(check(model, IMG(), nn.CrossEntropyLoss(), opt), "TT202") == []


# -- TT203 unregistered modules ---------------------------------------------------------------

def test_modules_and_parameters_in_plain_containers():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)
            self.heads = {"a": nn.Linear(8, 8)}
            self.scales = [nn.Parameter(torch.ones(8))]
            self.acts = [nn.ReLU()]  # parameter-free: harmless
            self.alias = [self.fc]  # registered elsewhere: harmless

        def forward(self, x):
            x = self.acts[0](self.alias[0](x))
            return self.heads["a"](x) * self.scales[0]

    report = check(Holder(), X16())
    assert paths(report, "TT203") == ["heads", "scales"]
    heads = next(f for f in rules_of(report, "TT203") if f.path == "heads")
    assert "nn.ModuleDict" in heads.message and heads.extra["parameters"] == 72
    assert rules_of(check(MLP(), X16()), "TT203") == []


def test_dropout_in_a_plain_list_is_reported_for_its_mode():
    class DropList(MLP):
        def __init__(self):
            super().__init__()
            self.drops = [nn.Dropout(0.5)]

    (f,) = rules_of(check(DropList(), X16()), "TT203")
    assert "train()/eval() does not reach" in f.message


# -- TT204 BatchNorm batch --------------------------------------------------------------------

def test_batchnorm_with_a_small_per_device_batch():
    report = check(ConvBN(), IMG(4), nn.CrossEntropyLoss())
    (f,) = rules_of(report, "TT204")
    assert f.path == "bn" and f.extra == {"modules": ["bn"], "batch": 4}
    assert report.batchnorm_batch == {"bn": 4}
    assert rules_of(check(ConvBN(), IMG(8), nn.CrossEntropyLoss()), "TT204") == []


def test_frozen_batchnorm_in_eval_is_neither_small_batch_nor_mode_mismatch():
    model = ConvBN()
    model.bn.eval()
    model.bn.requires_grad_(False)
    report = check(model, IMG(2), nn.CrossEntropyLoss())
    assert rules_of(report, "TT204") == [] and rules_of(report, "TT208") == []


# -- TT205 inplace activations ----------------------------------------------------------------

def test_activation_that_could_be_inplace_only_where_safe():
    seq = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(288, 8))
    report = check(seq, IMG())
    (f,) = rules_of(report, "TT205")
    assert f.path == "2" and f.severity == "info"
    assert seq[2].inplace is False  # the caller's model is not switched

    class Residual(nn.Module):  # the ReLU's input is also read by the residual add
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)
            self.act = nn.ReLU()

        def forward(self, x):
            h = self.fc(x)
            return self.act(h) + h

    assert rules_of(check(Residual(), X16()), "TT205") == []
    assert rules_of(check(ConvBN(), IMG()), "TT205") == []  # already inplace


# -- TT206 dims -------------------------------------------------------------------------------

def test_dims_not_multiple_of_8_except_data_fixed_ones():
    seq = nn.Sequential(nn.Linear(13, 20), nn.ReLU(), nn.Linear(20, 3))
    report = check(seq, torch.randn(8, 13))
    found = {f.path: f.extra["dims"] for f in rules_of(report, "TT206")}
    assert found == {"0": {"out_features": 20}, "2": {"in_features": 20}}  # not 13 (input) nor 3 (classes)
    assert rules_of(check(MLP(), X16()), "TT206") == []


# -- TT207 output / loss pairing --------------------------------------------------------------

@pytest.mark.parametrize(
    "post, loss_fn, kind, severity",
    [
        (nn.LogSoftmax(dim=1), nn.CrossEntropyLoss(), "log-probabilities", "warning"),
        (nn.Softmax(dim=1), nn.CrossEntropyLoss(), "probabilities", "error"),
        (nn.Identity(), nn.NLLLoss(), "raw logits", "error"),
        (nn.Softmax(dim=1), F.nll_loss, "probabilities", "error"),
        (nn.Sigmoid(), nn.BCEWithLogitsLoss(), "probabilities (sigmoid output)", "error"),
        (nn.Identity(), nn.CrossEntropyLoss(), None, None),
        (nn.LogSoftmax(dim=1), nn.NLLLoss(), None, None),
        (nn.Identity(), nn.BCEWithLogitsLoss(), None, None),
        (nn.Sigmoid(), nn.BCELoss(), None, None),
    ],
)
def test_output_loss_pairing(post, loss_fn, kind, severity):
    report = check_model(Head(post), X16(), loss_fn, steps=1)
    found = rules_of(report, "TT207")
    if kind is None:
        assert found == [] and report.completed
    else:
        (f,) = found
        assert f.extra["input_kind"].startswith(kind) and f.severity == severity
        assert f.path == "post"


def test_pairing_seen_through_a_wrapped_loss():
    loss_fn = lambda out, y: F.cross_entropy(out.softmax(1), y)  # noqa: E731
    (f,) = rules_of(check_model(MLP(), X16(), loss_fn, steps=1), "TT207")
    assert f.path == "(loss)" and "probabilities" in f.message


def test_logits_fed_to_bce_are_reported_and_stop_the_step():
    report = check(Head(nn.Identity()), X16(), nn.BCELoss())
    (f,) = rules_of(report, "TT207")
    assert f.severity == "error" and "outside [0, 1]" in f.message and f.path == "post"
    assert not report.completed and "BCELoss" in report.error
    assert "unused-parameters" in report.skipped and report.steps_run == 0


# -- TT208 train/eval mode --------------------------------------------------------------------

class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_submodule_in_the_other_mode():
    model = DropNet()
    model.drop.eval()
    (f,) = rules_of(check(model, X16()), "TT208")
    assert f.path == "drop" and "Dropout is off" in f.message

    model = DropNet().eval()
    model.drop.train()
    report = check(model, X16())
    (f,) = rules_of(report, "TT208")
    assert f.path == "drop" and "still drops" in f.message
    assert any("eval mode" in n for n in report.notes)
    assert model.training is False and model.drop.training is True  # modes untouched

    assert rules_of(check(DropNet(), X16()), "TT208") == []
    assert rules_of(check(DropNet().eval(), X16()), "TT208") == []


# -- TT209 randomness in eval -----------------------------------------------------------------

class FunctionalDropout(nn.Module):
    def __init__(self, pass_training):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.pass_training = pass_training

    def forward(self, x):
        x = self.fc(x)
        if self.pass_training:
            return F.dropout(x, 0.5, training=self.training)
        return F.dropout(x, 0.5)


def test_random_output_in_eval():
    model = nn.Sequential(OrderedDict(block=FunctionalDropout(False), out=nn.Linear(16, 8)))
    (f,) = rules_of(check(model, X16()), "TT209")
    assert f.path == "block"
    model = nn.Sequential(OrderedDict(block=FunctionalDropout(True), out=nn.Linear(16, 8)))
    assert rules_of(check(model, X16()), "TT209") == []


# -- TT210 non-finite values ------------------------------------------------------------------

class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class Zero(nn.Module):
    def forward(self, x):
        return x * 0


class Norm(nn.Module):
    def forward(self, x):
        return torch.sqrt((x**2).sum(1, keepdim=True))  # gradient NaN at 0


def test_non_finite_forward_names_the_first_producing_module():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(16, 16), log=Log(), out=nn.Linear(16, 8)))
    (f,) = rules_of(check_model(model, X16(), steps=1), "TT210")
    assert f.path == "log" and f.extra["stage"] == "forward"


def test_non_finite_gradient_names_the_module_whose_backward_makes_it():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(16, 16), zero=Zero(), norm=Norm()))
    report = check_model(model, X16(), steps=1)
    (f,) = rules_of(report, "TT210")
    assert f.path == "norm" and f.extra["stage"] == "backward"
    assert f.extra["params"] == ["fc.weight", "fc.bias"]


def test_non_finite_input_and_loss():
    x = X16()
    x[0, 0] = float("nan")
    (f,) = rules_of(check_model(MLP(), x, steps=1), "TT210")
    assert f.path == "(input)"
    loss_fn = lambda out, y: (out - out).abs().log().mean()  # noqa: E731
    (f,) = rules_of(check_model(MLP(), X16(), loss_fn, steps=1), "TT210")
    assert f.path == "(loss)"
    assert rules_of(check_model(MLP(), X16(), nn.CrossEntropyLoss(), steps=1), "TT210") == []


# -- TT211 memory growth ----------------------------------------------------------------------

class Caching(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.history = []

    def forward(self, x):
        y = self.fc(x)
        self.history.append(y)  # keeps every step's output and graph
        return y


class KeepingLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, out, target):
        loss = F.cross_entropy(out, target)
        self.seen.append(loss)
        return loss


def test_memory_growth_from_a_caching_module():
    model = Caching()
    report = check_model(model, torch.randn(16, 64), steps=2)
    (f,) = rules_of(report, "TT211")
    assert f.path == "history" and report.memory["leaking"]
    assert model.history == []  # the caller's model did not cache anything


def test_memory_growth_from_a_loss_that_keeps_losses():
    loss_fn = KeepingLoss()
    report = check_model(MLP(), X16(), loss_fn)  # the default steps=3
    (f,) = rules_of(report, "TT211")
    assert f.path == "loss_fn.seen"
    assert loss_fn.seen == []  # the check used a copy of the loss
    clean = check_model(MLP(), X16(), nn.CrossEntropyLoss(), steps=2)
    assert rules_of(clean, "TT211") == [] and clean.memory["leaking"] is False


def test_one_step_skips_the_memory_check():
    report = check_model(MLP(), X16(), steps=1)
    assert report.memory is None and "memory-growth" in report.skipped and report.steps_run == 1


# -- TT212 Adam + L2, TT213 parameters missing from the optimizer -----------------------------

def test_adam_with_coupled_weight_decay():
    model = MLP()
    (f,) = rules_of(check(model, X16(), optimizer=torch.optim.Adam(model.parameters(), weight_decay=1e-4)), "TT212")
    assert f.severity == "warning" and "AdamW" in f.message
    assert rules_of(check(model, X16(), optimizer=torch.optim.AdamW(model.parameters())), "TT212") == []
    assert rules_of(check(model, X16(), optimizer=torch.optim.Adam(model.parameters())), "TT212") == []


def test_trainable_parameters_missing_from_the_optimizer():
    model = MLP()
    report = check(model, X16(), optimizer=torch.optim.SGD(model.fc2.parameters(), lr=0.1))
    (f,) = rules_of(report, "TT213")
    assert f.path == "fc1" and f.extra["params"] == ["fc1.weight", "fc1.bias"]
    model.fc1.requires_grad_(False)  # frozen on purpose: fine
    assert rules_of(check(model, X16(), optimizer=torch.optim.SGD(model.fc2.parameters(), lr=0.1)), "TT213") == []


# -- the caller's objects are untouched -------------------------------------------------------

def test_model_optimizer_batch_and_rng_are_unchanged():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)
            self.bn = nn.BatchNorm2d(8)
            self.drop = nn.Dropout(0.2)
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            x.relu_()  # writes into its input
            return self.fc(self.drop(self.bn(self.conv(x))).mean((2, 3)))

    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = IMG()
    model(x.clone()).sum().backward()
    opt.step()  # the optimizer has state, the parameters have gradients
    model.drop.eval()

    params = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt_state = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in s.items()}
                 for k, s in opt.state_dict()["state"].items()}
    groups = [{k: v for k, v in g.items()} for g in opt.state_dict()["param_groups"]]
    modes = [m.training for m in model.modules()]
    batch = x.clone()
    rng = torch.get_rng_state()

    def loss_fn(out, y):  # closes over the caller's model: its L2 term reaches the caller's params
        return F.cross_entropy(out, y) + 1e-4 * sum(p.pow(2).sum() for p in model.parameters())

    report = check_model(model, x, loss_fn, opt, steps=2)
    assert report.completed and report.steps_run == 4

    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters())
    after = opt.state_dict()
    assert after["param_groups"] == groups
    for k, s in after["state"].items():
        for n, v in s.items():
            assert torch.equal(v, opt_state[k][n]) if torch.is_tensor(v) else v == opt_state[k][n]
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(x, batch)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert opt.param_groups[0]["params"][0] is model.conv.weight


# -- bad input --------------------------------------------------------------------------------

def test_wrong_input_shape_is_one_line_naming_the_shapes():
    model = nn.Sequential(OrderedDict(fc=nn.Linear(16, 8), out=nn.Linear(8, 8)))
    with pytest.raises(UserError) as info:
        check_model(model, torch.randn(4, 10), nn.CrossEntropyLoss())
    msg = str(info.value)
    assert "\n" not in msg
    assert "(4, 10)" in msg and "'fc'" in msg and "in_features=16" in msg

    with pytest.raises(UserError, match="BatchNorm in training needs a batch of 2 or more"):
        check(ConvBN(), torch.randn(1, 3, 1, 1))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(model="not a model"), "nn.Module"),
        (dict(steps=0), "steps"),
        (dict(batch=torch.randn(0, 16)), "at least one sample"),
        (dict(batch="text"), "no tensor"),
        (dict(loss_fn=42), "callable"),
        (dict(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)), "none of the model's parameters"),
        (dict(device="tpu9"), "unknown device"),
    ],
)
def test_bad_arguments(kwargs, needle):
    args = dict(model=MLP(), batch=X16())
    args.update(kwargs)
    with pytest.raises(UserError, match=needle) as info:
        check_model(args.pop("model"), args.pop("batch"), **args)
    assert "\n" not in str(info.value)


def test_frozen_model_and_failing_loss():
    with pytest.raises(UserError, match="no trainable parameters"):
        check_model(MLP().requires_grad_(False), X16())
    with pytest.raises(UserError, match="loss_fn failed") as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the broadcast before failing
        check_model(MLP(), X16(), nn.MSELoss(), target=torch.randn(3))
    assert "\n" not in str(info.value)


# -- targets and the report -------------------------------------------------------------------

def test_targets_given_generated_or_not_needed():
    y = torch.randint(0, 8, (8,))
    assert check_model(MLP(), X16(), nn.CrossEntropyLoss(), target=y, steps=1).target.startswith("given (8,) int64")
    assert check_model(MLP(), X16(), nn.BCEWithLogitsLoss(), steps=1).target.startswith("generated 0/1 labels")
    assert check_model(MLP(), X16(), nn.MSELoss(), steps=1).target.startswith("generated random values (8, 8)")
    one_arg = check_model(MLP(), X16(), lambda out: out.pow(2).mean(), steps=1)
    assert one_arg.target.startswith("none") and one_arg.completed


def test_several_and_nested_inputs():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x, extra):
            return self.a(x) + self.b(extra["side"])

    x, side = X16(), torch.randn(8, 8)
    report = check(TwoInputs(), (x, {"side": side}), nn.CrossEntropyLoss())
    assert report.completed and report.findings == []
    assert report.inputs == "(8, 16) float32, dict"


def test_report_as_dict_is_json():
    report = check(Buggy(), X16(), nn.CrossEntropyLoss())
    d = json.loads(json.dumps(report.to_dict()))
    assert d["ok"] is False and d["counts"]["error"] == 1
    assert {f["rule"] for f in d["findings"]} >= {"TT201", "TT203", "TT207"}
    assert d["findings"][0]["severity"] == "error"  # most severe first


# -- keyword inputs and loss names ---------------------------------------------------------------

class TokenLM(nn.Module):
    """A tiny causal-LM-shaped model: keyword inputs, a dict output with logits (B, T, V)."""

    def __init__(self, vocab=16, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return out


def _tokens(batch=8, seq=6):
    ids = torch.randint(0, 16, (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_keyword_inputs_run_as_keyword_arguments_and_are_left_untouched():
    batch = _tokens()
    before = {k: v.clone() for k, v in batch.items()}
    report = check(TokenLM(), batch, "auto")
    assert report.completed and report.inputs == "input_ids=(8, 6) int64, attention_mask=(8, 6) int64"
    assert report.outputs == "(8, 6, 16) float32"
    assert report.loss_fn == "cross-entropy"
    assert report.target == "generated next-token targets (8, 6) from the input ids"
    assert 0 < report.loss < 2 * torch.log(torch.tensor(16.0)).item()  # near log(vocab) at init
    assert all(torch.equal(batch[k], before[k]) for k in batch)


def test_auto_uses_the_models_own_loss_when_it_has_one():
    batch = {**_tokens(), "labels": _tokens()["input_ids"]}
    report = check(TokenLM(), batch, "auto")
    assert report.completed and report.loss_fn == "the model's own loss" and report.target.startswith("none")


def test_auto_on_a_tensor_output_is_the_cross_entropy_of_before():
    model, x = MLP(), X16()
    auto = check(model, x, "auto")
    explicit = check(model, x, nn.CrossEntropyLoss())
    assert auto.loss_fn == "cross-entropy" and explicit.loss_fn == "CrossEntropyLoss"
    assert auto.target == explicit.target and auto.target.startswith("generated class indices (8,)")
    assert auto.loss == pytest.approx(explicit.loss)
    log_softmax = check(Buggy(), X16(), "ce")  # the TT207 watch sees the named loss too
    assert [f.path for f in rules_of(log_softmax, "TT207")] == ["(model)"]


@pytest.mark.parametrize("kind, name", [("ce", "cross-entropy"), ("cross-entropy", "cross-entropy"),
                                        ("nll", "nll"), ("mse", "mse"), ("bce-with-logits", "bce-with-logits"),
                                        ("none", "none")])
def test_loss_names_on_a_structured_output(kind, name):
    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            return {"hidden": x, "logits": self.fc(x)}

    report = check(DictOut(), X16(), kind)
    assert report.completed and report.loss_fn == name and report.loss is not None


def test_bad_loss_names_and_outputs_without_a_prediction():
    with pytest.raises(UserError, match="unknown loss 'hinge'"):
        check(MLP(), X16(), "hinge")

    class Argmax(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            return self.fc(x).argmax(-1)

    with pytest.raises(UserError, match="no floating-point tensor") as err:
        check(Argmax(), X16(), "auto")
    assert "\n" not in str(err.value)


def test_a_transformers_model_with_named_inputs():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=100,
        max_position_embeddings=16))
    ids = torch.randint(0, 100, (8, 12))
    report = check(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "auto")
    assert report.completed and report.loss_fn == "cross-entropy"
    assert report.outputs.startswith("(8, 12, 100) float32")
    assert rules_of(report, "TT207") == [] and rules_of(report, "TT210") == []


# -- target broadcasting (TT214) ------------------------------------------------------------------

class Regressor(nn.Module):
    """One output per sample: (N, 1)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc(x)


def test_a_target_that_broadcasts_against_the_prediction_is_reported():
    report = check(Regressor(), X16(), "mse", target=torch.randn(8))
    found = rules_of(report, "TT214")
    assert [f.path for f in found] == ["(loss)"] and found[0].severity == "error"
    assert found[0].extra == {"prediction": [8, 1], "target": [8], "broadcast": [8, 8]}
    assert "(8, 8)" in found[0].message
    assert report.completed


def test_a_target_of_the_prediction_shape_is_not_reported():
    assert rules_of(check(Regressor(), X16(), "mse", target=torch.randn(8, 1)), "TT214") == []
    assert rules_of(check(Regressor(), X16(), nn.L1Loss(), target=torch.randn(8, 1)), "TT214") == []
    assert rules_of(check(MLP(), X16(), nn.MSELoss()), "TT214") == []  # generated target: the output's shape


def test_target_broadcast_seen_through_a_loss_function_and_other_warnings_pass_through():
    def loss_fn(out, target):
        warnings.warn("a warning of the caller's own", UserWarning)
        return F.smooth_l1_loss(out, target)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check(Regressor(), X16(), loss_fn, target=torch.randn(8))
    assert [f.path for f in rules_of(report, "TT214")] == ["(loss)"]
    messages = [str(w.message) for w in caught]
    assert "a warning of the caller's own" in messages
    assert not any("target size" in m for m in messages)  # reported as a finding instead


def test_findings_count_is_the_line_the_report_and_the_lint_share():
    from torch_tricks.doctor.registry import Finding, findings_count

    found = [Finding("TT201", "m", severity=s) for s in ("info", "warning", "error", "warning", "info")]
    assert findings_count([]) == "no findings"
    assert findings_count(found) == "5 findings (1 error, 2 warnings, 2 info)"
    assert findings_count(found[2:3]) == "1 finding (1 error)"


def test_to_text_says_what_ran_each_finding_and_what_was_not_checked():
    """to_text is what `torch-tricks doctor --model` prints (tests/test_doctor_cli.py checks the very text)."""
    from torch_tricks.doctor.registry import findings_count

    report = check_model(Buggy(), X16(), nn.CrossEntropyLoss(), steps=1)
    lines = report.to_text("buggy").splitlines()
    assert lines[0] == f"buggy: inputs {report.inputs}, outputs {report.outputs}, target {report.target}"
    assert lines[1] == f"loss (CrossEntropyLoss) {report.loss:.4g}, {report.steps_run} training step(s) on cpu, " \
                       "plain SGD steps"
    assert lines[2] == "" and [line.split()[0] for line in lines[3:6]] == [f.rule for f in report.findings]
    assert lines[6] == findings_count(report.findings) == "3 findings (1 error, 2 warnings)"
    assert "not checked: memory-growth: steps=1: at least 2 steps are needed to see a trend" in lines
    kept = [f for f in report.findings if f.rule != "TT201"]
    text = report.to_text("buggy", "adamw", kept)
    assert "optimizer adamw" in text and "TT201" not in text and findings_count(kept) in text.splitlines()
