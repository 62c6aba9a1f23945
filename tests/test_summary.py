"""Counts checked against independent references: hand formulas and module hooks."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_tricks.errors import UserError
from torch_tricks.inspect.summarize import ForwardError, summary
from torch_tricks.models import get_model


def hook_macs(model: nn.Module, x: torch.Tensor) -> int:
    """Reference MACs from module hooks: conv = out.numel * (Cin/groups) * k, linear = out.numel * in."""
    total = 0

    def hook(m, inp, out):
        nonlocal total
        if isinstance(m, nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1]
            total += out.numel() * (m.in_channels // m.groups) * k
        elif isinstance(m, nn.Linear):
            total += out.numel() * m.in_features

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    model.eval()
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return total


def test_resnet50_params_and_macs():
    s = summary(get_model("resnet50"), torch.randn(1, 3, 224, 224))
    assert s.totals["params"] == 25_557_032
    assert abs(s.totals["macs"] - 4.1e9) / 4.1e9 < 0.01
    assert s.totals["flops"] == 2 * s.totals["macs"]


@pytest.mark.parametrize("name,shape", [("resnet18", (1, 3, 64, 64)), ("mobilenet_v2", (1, 3, 96, 96)),
                                        ("resnet9", (2, 3, 32, 32)), ("mlp", (3, 784))])
def test_conv_linear_models_match_hook_reference(name, shape):
    model = get_model(name)
    x = torch.randn(shape)
    s = summary(model, x)
    assert s.totals["macs"] == hook_macs(model, x)


class Functional(nn.Module):
    """Attention written with functional ops, a dict output, and a shared module used twice."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.shared = nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x)
        scores = q @ x.transpose(-1, -2)  # (B, T, T): B*T*T*16 MACs
        mixed = torch.einsum("bij,bjd->bid", scores.softmax(-1), x)  # B*T*T*16
        att = F.scaled_dot_product_attention(q[:, None], x[:, None], x[:, None])[:, 0]  # 2*B*T*T*16
        return {"out": self.shared(self.shared(mixed + att)), "scores": (scores,)}


def test_functional_ops_counted_and_attributed_to_enclosing_module():
    B, T, D = 2, 5, 16
    m = Functional()
    s = summary(m, torch.randn(B, T, D))
    linear = 3 * B * T * D * D
    functional = 4 * B * T * T * D
    assert s.totals["macs"] == linear + functional
    assert s.by_operator["attention"] == 2 * B * T * T * D
    rows = {r.name: r for r in s.all_rows}
    assert rows[""].macs == linear + functional  # functional ops live in the root's forward
    assert rows["shared"].calls == 2 and rows["shared"].macs == 2 * B * T * D * D
    assert rows["shared"].params == 16 * 16 + 16  # counted once although called twice
    assert s.totals["params"] == 2 * (16 * 16 + 16)
    assert rows[""].output_shapes == {"out": (B, T, D), "scores": ((B, T, T),)}


def test_lstm_counts_recurrent_matmuls():
    lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True, bidirectional=True)
    B, T = 3, 7
    s = summary(lstm, torch.randn(B, T, 32))
    expected = 4 * 64 * (32 + 64) * 2 * B * T + 4 * 64 * (128 + 64) * 2 * B * T
    assert s.totals["macs"] == expected
    assert s.by_operator == {"rnn": expected}


def test_gru_packed_sequence_counts_real_steps_only():
    gru = nn.GRU(8, 16)
    seqs = [torch.randn(n, 8) for n in (5, 3, 2)]
    packed = nn.utils.rnn.pack_sequence(seqs)
    s = summary(gru, packed)
    assert s.totals["macs"] == 3 * 16 * (8 + 16) * (5 + 3 + 2)


def test_transformer_encoder_counted_under_no_grad_fast_path():
    d, heads, ff, B, T = 64, 4, 128, 2, 16
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, ff, batch_first=True), 2)
    before = torch.backends.mha.get_fastpath_enabled()
    s = summary(enc, torch.randn(B, T, d))
    per_layer = B * T * (3 * d * d + d * d + 2 * d * ff) + 2 * B * T * T * d
    assert s.totals["macs"] == 2 * per_layer
    assert torch.backends.mha.get_fastpath_enabled() == before
    assert s.totals["params"] == sum(p.numel() for p in enc.parameters())


def test_bilinear_cells_and_direct_attention():
    s = summary(nn.Bilinear(4, 5, 6), (torch.randn(2, 4), torch.randn(2, 5)))
    assert s.totals["macs"] == 2 * 6 * 4 * 5
    cell = summary(nn.LSTMCell(6, 10), torch.randn(3, 6))
    assert cell.by_operator == {"rnn": 3 * 4 * 10 * (6 + 10)}

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(64, 4)

        def forward(self, x):
            return self.mha(x, x, x)[0]  # need_weights=True: explicit bmm, not SDPA

    L, B, E = 32, 1, 64
    mha = summary(Wrap(), torch.randn(L, B, E))
    assert mha.by_operator == {"attention": 2 * B * L * L * E, "linear/matmul": 4 * L * B * E * E}


def test_builtin_transformer_and_lstm_include_attention_and_rnn():
    t = summary(get_model("transformer"), torch.randint(0, 1000, (1, 128)))
    assert t.by_operator["attention"] > 0 and t.by_operator["linear/matmul"] > 0
    l = summary(get_model("lstm"), torch.randint(0, 1000, (1, 64)))
    assert l.by_operator["rnn"] > 0.9 * l.totals["macs"]


def test_memory_access_cost_of_a_linear_layer():
    lin = nn.Linear(10, 20)
    s = summary(lin, torch.randn(4, 10))
    elem = 4
    assert s.totals["mac_bytes"] == elem * (4 * 10 + 20 * 10 + 20 + 4 * 20)
    assert s.totals["activation_bytes"] == 4 * 20 * elem


def test_views_cost_nothing_and_pointwise_bytes_are_tracked():
    class M(nn.Module):
        def forward(self, x):
            return torch.relu(x.view(-1).t() if x.dim() == 1 else x.view(-1))

    x = torch.randn(100)
    s = summary(M(), x)
    assert s.totals["mac_bytes"] == 2 * 100 * 4  # relu reads and writes; views are free
    assert s.totals["pointwise_bytes"] == s.totals["mac_bytes"]


def test_frozen_parameters_are_reported_apart():
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m[0].requires_grad_(False)
    s = summary(m, torch.randn(1, 4))
    assert s.totals["frozen_params"] == 20 and s.totals["trainable_params"] == 10
    assert s.rows[0].frozen == 20 and s.rows[0].trainable == 0


def test_depth_limits_rows_and_mode_is_restored():
    m = get_model("resnet9")
    m.train()
    s = summary(m, torch.randn(1, 3, 32, 32), depth=1)
    assert s.rows and all(r.depth == 1 for r in s.rows)
    assert len(s.all_rows) > len(s.rows)
    assert m.training
    assert summary(m, torch.randn(1, 3, 32, 32), depth=0).rows == []


def test_forward_error_names_module_and_shape():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(16, 8, 3))
    with pytest.raises(ForwardError) as err:
        summary(m, torch.randn(1, 3, 10, 10))
    msg = str(err.value)
    assert "module '2' (Conv2d)" in msg and "(1, 8, 8, 8)" in msg and "\n" not in msg
    assert isinstance(err.value, UserError)


def test_to_dict_is_json_serialisable():
    import json

    s = summary(get_model("small_cnn"), torch.randn(2, 1, 8, 8))
    d = json.loads(json.dumps(s.to_dict()))
    assert d["totals"]["params"] == s.totals["params"]
    assert "conventions" in d and d["rows"]


# -- keyword inputs (a dict): what a transformers model takes ----------------------------------------

class MaskedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 4)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        return self.fc(h)


def test_keyword_inputs_count_the_same_as_positional_ones():
    ids, mask = torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    named = summary(MaskedMLP(), {"input_ids": ids, "attention_mask": mask})
    positional = summary(MaskedMLP(), (ids, mask))
    assert named.totals == positional.totals and named.totals["macs"] == 2 * 8 * 16 * 4
    assert named.inputs == "input_ids=(2, 8) int64, attention_mask=(2, 8) int64"
    assert positional.inputs == "(2, 8) int64, (2, 8) int64"
    mixed = summary(MaskedMLP(), ids, kwargs={"attention_mask": mask})  # positional plus keyword
    assert mixed.totals == positional.totals and mixed.inputs == "(2, 8) int64, attention_mask=(2, 8) int64"


def test_a_forward_failing_on_keyword_inputs_names_them():
    with pytest.raises(ForwardError) as err:
        summary(MaskedMLP(), {"input_ids": torch.randint(0, 50, (2, 8)), "attention_mask": torch.ones(2, 5)})
    assert "input_ids=(2, 8) int64, attention_mask=(2, 5) float32" in str(err.value)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_transformers_model_with_named_inputs_has_the_macs_and_params_of_the_positional_run(family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64, use_cache=False))
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128, vocab_size=1000,
            max_position_embeddings=64))
    ids = torch.randint(0, 1000, (2, 32))
    named = summary(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    positional = summary(model, ids)
    assert named.totals["macs"] == positional.totals["macs"] > 0
    assert named.totals["params"] == positional.totals["params"] == sum(p.numel() for p in model.parameters())
    assert named.inputs.startswith("input_ids=(2, 32) int64")


def test_negative_depth_is_a_user_error():
    with pytest.raises(UserError, match="depth must be >= 0"):
        summary(nn.Linear(2, 2), torch.randn(1, 2), depth=-1)


@pytest.mark.parametrize("argv,advice", [([], True), (["--depth", "1", "--no-advice"], False)])
def test_to_text_is_what_the_cli_prints(capsys, argv, advice):
    from torch_tricks.cli import main
    from torch_tricks.inspect.advisor import advise
    from torch_tricks.inspect.inputs import make_inputs, parse_input_specs
    from torch_tricks.models import model_spec

    assert main(["summary", "--model", "small_cnn", *argv]) == 0
    printed = capsys.readouterr().out
    spec = model_spec("small_cnn").default_input
    s = summary(get_model("small_cnn"), make_inputs(parse_input_specs(spec), 1), depth=1 if argv else 3)
    assert printed == s.to_text("small_cnn", advise(s) if advice else []) + "\n"
    assert ("advice (" in printed) == advice
    assert s.to_text().startswith(f"{s.model}: input {s.inputs}\n")  # the model's class by default
