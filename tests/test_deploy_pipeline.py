"""optimize(): deploy steps chained by name on a copy, each checked; results saved and loaded back.

Small models and inputs so the file stays fast on shared cores; only one chain compiles
a PT2E int8 model (small_cnn), the rest use eager / FX / ONNX Runtime. No timing
assertions beyond "a latency was measured" (shared cores); speed is benchmarks/deploy.py's job.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from _deploy_utils import randomize_bn, same_state, state_copy

from torch_tricks.deploy.fuse import count_batchnorm
from torch_tricks.deploy.pipeline import OptimizeResult, list_steps, load_optimized, optimize
from torch_tricks.deploy.quantize import _import_torchao_pt2e
from torch_tricks.errors import UserError
from torch_tricks.models import get_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: on shared, loaded cores two OpenMP threads stall each other far
    more than they help on these small inputs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_mode_model(name: str, **kw) -> nn.Module:
    """A built-in model with random BN statistics, left in train mode (optimize must not switch it)."""
    return randomize_bn(get_model(name, **kw)).train()


def _out(model, x):
    with torch.inference_mode():
        out = model(x)
    return out.float() if isinstance(out, torch.Tensor) else torch.as_tensor(out).float()


def test_list_steps_has_one_line_descriptions():
    steps = list_steps()
    assert list(steps)[:3] == ["fuse", "reparam", "prune"]
    for name in ("int8", "int8-dynamic", "fp16", "bf16", "onnx", "onnx-int8"):
        assert name in steps
    assert all(d and "\n" not in d for d in steps.values())


def test_fuse_chain_on_resnet18_is_exact_leaves_input_alone_and_saves(tmp_path):
    model = _train_mode_model("resnet18")
    before = state_copy(model)
    x = torch.randn(4, 3, 32, 32)
    messages: list[str] = []
    res = optimize(model, "fuse", x, measure=False, progress=messages.append)
    assert same_state(model, before) and model.training and all(m.training for m in model.modules())
    assert messages == ["[1/1] fuse"]
    step = res.steps[0]
    assert step.backend == "fx" and step.changed and step.within_tolerance and step.status == "ok"
    assert (step.coverage.changed, step.coverage.total, step.coverage.kept) == (20, 20, {})
    assert step.notes[0] == "folded 20 of 20 BatchNorm layers into the conv/linear before them"
    assert step.agreement.max_rel_diff <= 1e-4 and count_batchnorm(res.model) == 0
    assert step.latency_s == {} and not res.measured
    assert step.params < res.original.params and step.size_bytes < res.original.size_bytes

    assert res.save_format == "torch.export" and res.suggested_suffix == ".pt2"
    info = res.save(tmp_path / "fused.pt2")
    assert info.format == "torch.export" and info.verify_max_abs_diff == 0.0
    assert info.size_bytes == (tmp_path / "fused.pt2").stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["fused.pt2"]  # no temporary left behind
    loaded = load_optimized(info.path)
    x2 = torch.randn(2, 3, 32, 32)  # another batch size: the batch dim was exported dynamic
    assert torch.allclose(_out(loaded, x2), _out(res.model, x2), atol=1e-5)


def test_reparam_then_fuse_on_repvgg_measures_latency():
    model = _train_mode_model("repvgg", width_mult=0.25)
    before = state_copy(model)
    x = torch.randn(4, 3, 32, 32)
    res = optimize(model, ["reparam", "fuse"], x, batches=(1, 4), repeats=2, warmup=1)
    assert same_state(model, before) and model.training
    reparam, fuse = res.steps
    assert reparam.changed and reparam.within_tolerance and reparam.details["block_types"] == ["RepVGGBlock"]
    assert reparam.step_agreement.max_rel_diff <= 1e-4
    assert not fuse.changed and fuse.status == "no change"  # the fold took every BN
    assert fuse.notes[0].startswith("folded 0 of 0 BatchNorm layers")
    for r in (res.original, reparam, fuse):
        assert set(r.latency_s) == {1, 4} and all(t > 0 for t in r.latency_s.values())
    assert res.original.speedup == {1: 1.0, 4: 1.0} and reparam.speedup[1] > 0

    headers, rows = res.table_rows()
    assert headers[:2] == ["step", "backend"] and "bs4 x" in headers
    assert len(rows) == 3 and all(len(r) == len(headers) for r in rows)
    assert rows[2][0] == "fuse (no-op)" and rows[2][-1] == "no change" and rows[1][-1] == "ok"
    assert rows[1][headers.index("changed")] == "-"  # reparam gives no count
    assert rows[2][headers.index("changed")] == "0/0" and headers[-1] == "status"
    assert res.to_text().splitlines()[-1] == ("verified: every step within its tolerance against the model before "
                                              "it; fuse changed nothing (see the notes)")
    assert "reparam" in res.format_table()
    d = json.loads(json.dumps(res.to_dict()))
    assert d["steps"][0]["step"] == "reparam" and d["steps"][0]["latency_s"]["4"] > 0
    assert "model" not in d["steps"][0]


def test_prune_to_half_the_macs_then_fuse_on_resnet18():
    model = _train_mode_model("resnet18")
    x = torch.randn(2, 3, 32, 32)
    res = optimize(model, "prune,fuse", x, measure=False)
    prune, fuse = res.steps
    assert prune.step == "prune" and prune.details["target_macs"] == 0.5
    assert abs(prune.details["mac_ratio"] - 0.5) < 0.1
    assert prune.params < 0.75 * res.original.params and prune.tolerance is None and prune.status == "-"
    assert prune.coverage.changed == prune.coverage.total == 20  # every conv of ResNet-18 lost channels
    assert fuse.within_tolerance and fuse.step_agreement.max_rel_diff <= 1e-4
    assert res.final is fuse and res.ok

    by_share = optimize(model, "prune:0.25", x, measure=False).steps[0]
    assert by_share.details["amount"] == 0.25 and by_share.details["target_macs"] is None


def test_int8_static_small_cnn_calibrates_saves_and_loads(tmp_path):
    model = _train_mode_model("small_cnn")
    before = state_copy(model)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(32, 1, 8, 8, generator=gen)
    loader = [(torch.randn(32, 1, 8, 8, generator=gen), torch.zeros(32)) for _ in range(3)]  # (x, y) pairs
    res = optimize(model, "fuse,int8", x, calib=loader, measure=False)
    assert same_state(model, before) and model.training
    step = res.steps[-1]
    expected = "pt2e" if _import_torchao_pt2e() is not None else "fx"
    assert step.backend == expected and res.calibration.startswith("3 batches (96 samples)")
    assert step.tolerance and step.within_tolerance, step.step_agreement
    assert step.status == "ok" and (step.coverage.changed, step.coverage.total) == (4, 4)  # 3 convs and the fc
    assert step.size_bytes * 3 < res.original.size_bytes and step.params == res.steps[0].params
    assert not step.latency_s

    info = res.save(tmp_path / "int8.pt2")
    assert info.format == ("torch.export" if expected == "pt2e" else "torchscript")
    assert info.verify_max_abs_diff is not None and info.verify_max_abs_diff < 1e-4
    ref = load_optimized(info.path, compile=False)  # the reference int8 graph, not compiled
    assert _out(ref, x).shape == (32, 10)


def test_int8_fx_saves_as_torchscript_with_random_calibration(tmp_path):
    model = randomize_bn(get_model("small_cnn"))
    x = torch.randn(16, 1, 8, 8)
    res = optimize(model, "int8:fx", x, measure=False)
    assert res.steps[0].backend == "fx" and "random batches" in res.calibration
    assert res.save_format == "torchscript" and res.suggested_suffix == ".pt"
    info = res.save(tmp_path / "int8.pt")
    loaded = load_optimized(info.path)
    assert isinstance(loaded, torch.jit.ScriptModule)
    assert torch.equal(_out(loaded, x[:3]), _out(res.model, x[:3]))


def test_int8_dynamic_transformer_and_pickle_round_trip(tmp_path):
    model = get_model("transformer", num_layers=2, dim_feedforward=128)
    before = state_copy(model)
    tokens = torch.randint(0, 1000, (16, 24))
    res = optimize(model, ["int8-dynamic"], tokens, batches=(16,), repeats=2, warmup=1)
    assert same_state(model, before)
    step = res.steps[0]
    assert step.backend == "torch.ao dynamic" and step.within_tolerance, step.step_agreement
    assert step.latency_s[16] > 0 and step.size_bytes < 0.7 * res.original.size_bytes  # embedding stays fp32
    assert res.save_format == "pickle"
    info = res.save(tmp_path / "dyn.pt")
    assert info.verify_max_abs_diff == 0.0 and "weights_only=False" in info.load
    tokens2 = torch.randint(0, 1000, (3, 40))  # other batch and sequence length: nothing was frozen
    assert torch.equal(_out(load_optimized(info.path), tokens2), _out(res.model, tokens2))


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_int8_dynamic_on_gpt2_quantizes_every_matmul_but_the_tied_head_and_says_so():
    """GPT-2's attention and MLP are transformers Conv1D layers: int8-dynamic once quantized only the
    tied lm_head (the file grew) and reported ok. Now: 8 of 9 matmul layers, the head left fp32, smaller."""
    model = _gpt2()
    before = state_copy(model)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    res = optimize(model, "int8-dynamic", ids, measure=False)
    assert same_state(model, before)
    step = res.steps[0]
    assert step.status == "ok" and step.within_tolerance and step.tolerance == "max rel diff <= 0.1"
    assert (step.coverage.changed, step.coverage.total, list(step.coverage.kept)) == (8, 9, ["lm_head"])
    assert step.notes[0].startswith("quantized 8 of 9 matmul layers; lm_head left fp32: tied to the input embedding")
    assert step.agreement.max_rel_diff < 0.1, step.agreement
    assert step.size_bytes < 0.5 * res.original.size_bytes  # the head is not stored twice
    headers, rows = res.table_rows()
    assert rows[1][headers.index("changed")] == "8/9" and rows[1][-1] == "ok"
    d = json.loads(json.dumps(res.to_dict()))["steps"][0]
    assert d["status"] == "ok" and d["coverage"]["changed"] == 8 and d["coverage_text"] == step.notes[0]
    assert f"  int8-dynamic: {step.notes[0]}" in res.to_text().splitlines()


class _TiedOnly(nn.Module):
    """An embedding and a head that shares its weight: the only matmul layer is the tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


class _AttentionHead(nn.Module):
    """nn.MultiheadAttention outside an encoder layer: torch.ao leaves its out_proj fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        h = self.embed(x)
        return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))


def test_a_step_that_changes_no_layer_says_no_change_and_a_partial_one_partial():
    x = torch.randn(12, 8, 16)
    res = optimize(nn.Sequential(nn.Linear(16, 16), nn.ReLU()).eval(), "fuse", x, measure=False)
    fuse = res.steps[0]
    assert not fuse.changed and fuse.status == "no change" and fuse.within_tolerance
    assert res.table_rows()[1][1][-1] == "no change" and "fuse changed nothing" in res.to_text().splitlines()[-1]

    tied = optimize(_TiedOnly().eval(), "int8-dynamic", torch.randint(0, 50, (12, 5)), measure=False).steps[0]
    assert tied.status == "no change" and not tied.changed
    assert tied.notes[0].startswith("quantized 0 of 1 matmul layers; head left fp32: tied to the input embedding")

    part = optimize(_AttentionHead().eval(), "int8-dynamic", torch.randn(12, 5, 8), measure=False)
    step = part.steps[0]
    assert step.within_tolerance and step.status == "partial" and list(step.coverage.missed) == ["attn.out_proj"]
    assert "int8-dynamic changed only some of its layers" in part.to_text().splitlines()[-1]


def test_onnx_and_onnx_int8_run_in_ort_and_save_the_file(tmp_path):
    model = _train_mode_model("small_cnn")
    x = torch.randn(16, 1, 8, 8)
    res = optimize(model, "fuse,onnx", x, measure=False)
    step = res.steps[-1]
    assert step.backend.startswith("onnxruntime") and step.within_tolerance
    assert step.agreement.max_abs_diff <= 1e-4 and step.params == res.steps[0].params
    with pytest.raises(UserError):
        optimize(model, "fuse", x, measure=False).save(tmp_path / "wrong.onnx")
    info = res.save(tmp_path / "m.onnx")
    assert info.format == "onnx" and info.size_bytes == step.size_bytes
    assert torch.allclose(_out(load_optimized(info.path), x), _out(res.model, x))
    res.close()  # temporary folder gone; the saved copy stays
    assert (tmp_path / "m.onnx").is_file()

    q = optimize(model, "onnx-int8", x, measure=False)
    assert "static int8" in q.steps[0].backend and q.steps[0].size_bytes < 0.5 * q.original.size_bytes
    assert q.steps[0].agreement.top1_agreement >= 0.8


@pytest.mark.parametrize(
    "steps, words",
    [
        ("fuse,int8,prune", ["'prune' cannot follow 'int8'", "last step"]),
        ("int8,fuse", ["'fuse' cannot follow 'int8'"]),
        ("fuse,reparam", ["put reparam before fuse"]),
        ("int8,onnx", ["cannot be chained"]),
        ("fuse,frobnicate", ["unknown step 'frobnicate'", "onnx-int8"]),
        ("fp16", ["fp16 on CPU is slower than fp32", "bf16"]),
        ("prune:1.5", ["prune:0.3", "macs="]),
        ("int8:tensorrt", ["int8:pt2e", "int8:fx"]),
        ("fuse,fuse", ["twice"]),
        ("", ["no steps"]),
    ],
)
def test_bad_chains_fail_in_one_line_before_any_work(steps, words):
    model = _train_mode_model("small_cnn")
    before = state_copy(model)
    with pytest.raises(UserError) as exc:
        optimize(model, steps, torch.randn(2, 1, 8, 8), measure=False)
    msg = str(exc.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert same_state(model, before) and model.training


class _DataDependent(nn.Module):
    """Control flow on tensor values: neither torch.export nor torch.fx can trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = self.bn(self.conv(x))
        if y.sum() > 0:
            y = y * 2
        return self.fc(y.mean((2, 3)))


@pytest.mark.parametrize(
    "model_fn, steps, words",
    [
        (_DataDependent, "int8:fx", ["step 'int8:fx' cannot apply", "torch.fx cannot trace"]),
        (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU()), "fuse,int8-dynamic",
         ["step 'int8-dynamic' cannot apply", "no nn.Linear"]),
    ],
)
def test_a_step_that_cannot_apply_says_why_and_leaves_the_model(model_fn, steps, words):
    model = model_fn()
    before = state_copy(model)
    with pytest.raises(UserError) as exc:
        optimize(model, steps, torch.randn(2, 1, 8, 8), measure=False)
    msg = str(exc.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    assert same_state(model, before)


def test_bad_inputs_and_calibration_are_user_errors():
    model = get_model("small_cnn")
    with pytest.raises(UserError, match="does not run on the example inputs"):
        optimize(model, "fuse", torch.randn(2, 3, 8, 8), measure=False)
    with pytest.raises(UserError, match="check_inputs"):
        optimize(model, "fuse", torch.randn(2, 1, 8, 8), check_inputs=torch.randn(4, 1, 9, 9), measure=False)
    with pytest.raises(UserError, match="calib is empty"):
        optimize(model, "int8:fx", torch.randn(2, 1, 8, 8), calib=[], measure=False)
    with pytest.raises(UserError, match="batches"):
        optimize(model, "fuse", torch.randn(2, 1, 8, 8), batches=(0,))
    with pytest.raises(UserError, match="nn.Module"):
        optimize(lambda x: x, "fuse", torch.randn(2, 1, 8, 8))  # type: ignore[arg-type]


def test_result_is_an_optimize_result_with_bf16_step():
    model = randomize_bn(get_model("small_cnn"))
    x = torch.randn(12, 1, 8, 8)
    res = optimize(model, "fuse,bf16", x, measure=False)
    assert isinstance(res, OptimizeResult)
    step = res.steps[-1]
    assert step.backend == "cast" and step.within_tolerance and step.size_bytes < 0.6 * res.original.size_bytes
    assert step.status == "ok" and step.coverage.changed == step.coverage.total > 0
    assert _out(res.model, x).dtype == torch.float32
    assert any(n.startswith("bf16:") for n in res.notes())


class _DataclassOut(nn.Module):
    """A forward returning a plain dataclass whose first field is an integer tensor, logits later."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 10)

    def forward(self, x):
        from dataclasses import make_dataclass

        logits = self.fc2(torch.relu(self.fc1(x)))
        Out = make_dataclass("Out", ["pred", "features", "logits"])
        return Out(logits.argmax(-1), torch.relu(self.fc1(x)), logits)


def test_agreement_is_taken_on_the_logits_of_any_output_dataclass_and_model_output():
    """optimize compares what torch_tricks.outputs calls the prediction: a dataclass's or a
    transformers ModelOutput's logits, not its first field."""
    model = _DataclassOut().eval()
    x = torch.randn(32, 16)
    step = optimize(model, "int8-dynamic", x, measure=False).steps[0]
    assert step.within_tolerance and step.agreement.top1_agreement is not None  # (32, 10) logits, not the argmax
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=100, num_labels=3)
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(cfg).eval()
    ids = torch.randint(0, 100, (16, 12))
    step = optimize(bert, "int8-dynamic", ids, measure=False).steps[0]
    assert step.agreement.top1_agreement is not None and step.agreement.max_abs_diff < 0.5, step.agreement


def test_latency_counts_are_refused_before_any_work():
    """The CLI's --repeats / --warmup check lives in the library: a Python caller gets it before any step
    runs (the model below does not even run on these inputs), also with measure=False."""
    model = get_model("small_cnn")
    wrong = torch.randn(2, 3, 8, 8)
    for kw, needle in [(dict(repeats=0), "repeats must be an integer >= 1"),
                       (dict(warmup=-1), "warmup must be an integer >= 0"),
                       (dict(repeats=0, measure=False), "repeats must be an integer >= 1"),
                       (dict(repeats=True), "repeats must be an integer >= 1")]:
        with pytest.raises(UserError, match=needle):
            optimize(model, "fuse", wrong, **kw)


def test_to_text_holds_what_ran_the_table_the_notes_the_verdict_and_what_was_written(tmp_path):
    """to_text is the report `torch-tricks optimize` prints (tests/test_deploy_cli.py checks that it is the
    very text): here its parts, from the result alone and from what the caller adds."""
    res = optimize(randomize_bn(get_model("small_cnn")), "fuse", torch.randn(12, 1, 8, 8),
                   check_inputs=torch.randn(20, 1, 8, 8), batches=(2,), warmup=1, repeats=2)
    text = res.to_text(model_name="net")
    lines = text.splitlines()
    assert lines[0] == "net: fuse on cpu, 1 thread(s); outputs compared on (20, 1, 8, 8) float32 (random)"
    assert lines[1] == "latency: median ms of 2 calls after 1 warm-up, bsN x = speed-up over the original"
    assert res.format_table() in text and all(f"  {n}" in lines for n in res.notes())
    assert lines[-1] == "verified: every step within its tolerance against the model before it"
    head = res.to_text(model_name="net", steps=["fuse:asked"], data_name="digits").splitlines()[0]
    assert head.startswith("net: fuse:asked on cpu") and head.endswith(" from digits (validation)")
    assert res.to_text(save_asked=True) == res.to_text()  # nothing exceeded: no save was held back
    info = res.save(tmp_path / "m.pt2")
    assert info.to_text().startswith(f"wrote {tmp_path / 'm.pt2'}: torch.export, ")
    assert f"  load: {info.load}" in info.to_text().splitlines()
    assert res.to_text(model_name="net") == text + "\n" + info.to_text()
