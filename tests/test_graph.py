"""Behaviour of torch_tricks.inspect.graph: DOT from autograd, rendering, ONNX, TensorBoard."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
from torch import nn

from torch_tricks.errors import UserError
from torch_tricks.inspect.graph import (
    autograd_dot,
    export_onnx,
    model_graph,
    render_dot,
    save_graph,
    tensorboard_graph,
)

HAVE_DOT = shutil.which("dot") is not None
HAVE_ORT = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))
HAVE_TB = importlib.util.find_spec("tensorboard") is not None


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        return self.fc(self.drop(x))


class SmallEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.enc(self.emb(ids)))


def _balanced(dot: str) -> bool:
    depth = 0
    for ch in dot:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


# --- autograd DOT -----------------------------------------------------------------------


def test_autograd_dot_of_mlp():
    model = mlp()
    dot = model_graph(model, torch.randn(3, 4))
    assert dot.startswith("digraph autograd {") and dot.rstrip().endswith("}")
    assert _balanced(dot)
    assert "AddmmBackward0" in dot and "ReluBackward0" in dot
    assert '"0.weight\\n(8, 4) float32"' in dot
    assert '"2.bias\\n(2) float32"' in dot
    assert '"output\\n(3, 2) float32"' in dot
    assert dot.count("lightblue") == 4  # one node per parameter
    if HAVE_DOT:
        subprocess.run(["dot", "-Tsvg"], input=dot.encode(), check=True, capture_output=True)


@pytest.mark.skipif(not HAVE_DOT, reason="Graphviz `dot` binary not installed")
def test_autograd_dot_parses_with_graphviz():
    dot = autograd_dot(mlp()(torch.randn(2, 4)), show_saved=True)
    out = subprocess.run(["dot", "-Tsvg"], input=dot.encode(), check=True, capture_output=True)
    assert b"<svg" in out.stdout


def test_autograd_dot_options_and_escaping():
    model = mlp()
    out = model(torch.randn(3, 4))
    dot = autograd_dot({"a": out, "b": [out * 2]}, {'we"ird\\name': model[0].weight}, show_saved=True)
    assert "output 0" in dot and "output 1" in dot and "MulBackward0" in dot
    assert '"we\\"ird\\\\name\\n(8, 4) float32"' in dot  # quotes and backslashes escaped
    assert "(leaf tensor)" in dot  # unnamed parameters still appear
    assert "mat1: (3, 8) float32" in dot  # saved tensors shown
    small = autograd_dot(out, max_nodes=2)
    assert "truncated after 2 nodes" in small and _balanced(small)
    leaf = torch.ones(2, requires_grad=True)
    assert "(leaf tensor)" in autograd_dot(leaf)


def test_autograd_dot_rejects_graphless_outputs():
    model = mlp()
    with torch.no_grad():
        out = model(torch.randn(3, 4))
    with pytest.raises(UserError, match="no autograd graph"):
        autograd_dot(out)
    with pytest.raises(UserError):
        autograd_dot("not a tensor")
    with pytest.raises(UserError):
        autograd_dot(model(torch.randn(1, 4)), max_nodes=0)


# --- rendering and save_graph ----------------------------------------------------------


def test_render_dot_without_graphviz_says_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="install Graphviz"):
        render_dot("digraph { a }", tmp_path / "g.svg")


def test_render_dot_runs_dot_and_writes_atomically(tmp_path, monkeypatch):
    """A stand-in `dot` (copies stdin to -o) checks the plumbing without Graphviz."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "dot"
    fake.write_text('#!/bin/sh\n[ "$1" = "-Tbad" ] && { echo "Format: bad not recognized" >&2; exit 1; }\ncat > "$3"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    out_dir = tmp_path / "out"
    path = render_dot("digraph { a -> b }", out_dir / "g.svg")
    assert path.read_text() == "digraph { a -> b }"
    with pytest.raises(UserError, match="not recognized"):
        render_dot("digraph { a }", out_dir / "g.bad", format="bad")
    assert sorted(p.name for p in out_dir.iterdir()) == ["g.svg"]  # no temp files left
    save_graph(mlp(), torch.randn(2, 4), out_dir / "m.svg")
    assert "AddmmBackward0" in (out_dir / "m.svg").read_text()


def test_save_graph_dot_and_bad_format(tmp_path):
    path = save_graph(mlp(), torch.randn(2, 4), tmp_path / "g.dot")
    assert "AddmmBackward0" in path.read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["g.dot"]
    with pytest.raises(UserError, match="unknown graph format"):
        save_graph(mlp(), torch.randn(2, 4), tmp_path / "g.xyz")


# --- ONNX -------------------------------------------------------------------------------


def _onnx_matches_eager(model, path, inputs_list):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    for x in inputs_list:
        (got,) = sess.run(None, {names[0]: x.numpy()})
        with torch.no_grad():
            want = model(x).numpy()
        assert got.shape == want.shape
        assert abs(got - want).max() <= 1e-4


@pytest.mark.skipif(not HAVE_ORT, reason="needs onnx, onnxscript and onnxruntime (pip install 'torch-tricks[onnx]')")
def test_export_onnx_cnn_restores_mode_and_batch_is_dynamic(tmp_path):
    model = SmallCNN()
    model.train()
    model.bn.eval()  # a mixed-mode model: each module's own mode must come back
    path = save_graph(model, torch.randn(1, 3, 12, 12), tmp_path / "cnn.onnx")  # batch 1 traced as 2
    assert path == tmp_path / "cnn.onnx"
    assert model.training and model.drop.training and not model.bn.training
    assert [p.name for p in tmp_path.iterdir()] == ["cnn.onnx"]  # single file, no temp dirs left
    model.eval()
    _onnx_matches_eager(model, path, [torch.randn(1, 3, 12, 12), torch.randn(5, 3, 12, 12)])


@pytest.mark.skipif(not HAVE_ORT, reason="needs onnx, onnxscript and onnxruntime (pip install 'torch-tricks[onnx]')")
def test_export_onnx_transformer_encoder(tmp_path):
    model = SmallEncoder()
    path = export_onnx(model, torch.randint(0, 50, (2, 7)), tmp_path / "enc.onnx", opset=18)
    assert model.training
    model.eval()
    _onnx_matches_eager(model, path, [torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (3, 7))])


def test_export_onnx_missing_packages_or_bad_args(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` now raises ImportError
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(UserError, match=r"torch-tricks\[onnx\]"):
        export_onnx(mlp(), torch.randn(2, 4), tmp_path / "m.onnx")
    monkeypatch.undo()
    if HAVE_ORT:
        with pytest.raises(UserError, match="opset"):
            export_onnx(mlp(), torch.randn(2, 4), tmp_path / "m.onnx", opset=0)
        with pytest.raises(UserError, match="directory"):
            export_onnx(mlp(), torch.randn(2, 4), tmp_path)


# --- TensorBoard ------------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_TB, reason="needs tensorboard (pip install 'torch-tricks[tensorboard]')")
def test_tensorboard_graph_writes_event_file(tmp_path, capsys):
    model = SmallEncoder()  # dropout and the attention fast path must not break the trace check
    logdir = save_graph(model, torch.randint(0, 50, (2, 7)), tmp_path / "tb")
    assert logdir == tmp_path / "tb"
    assert any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())
    assert model.training
    assert capsys.readouterr().out == ""  # the library never prints


def test_tensorboard_graph_rejects_file_logdir(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UserError):
        tensorboard_graph(mlp(), torch.randn(2, 4), f)


# --- keyword inputs (a dict): a transformers-style forward ----------------------------------------


class MaskedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids, attention_mask):
        return self.head(self.emb(input_ids) * attention_mask.unsqueeze(-1).to(torch.float32))


def _named(batch: int = 2) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 50, (batch, 7)), "attention_mask": torch.ones(batch, 7, dtype=torch.long)}


def test_dot_graph_of_keyword_inputs(tmp_path):
    dot = model_graph(MaskedEncoder(), _named())
    assert "emb.weight" in dot and "head.weight" in dot and _balanced(dot)
    path = save_graph(MaskedEncoder(), _named(), tmp_path / "m.dot")
    assert path.read_text() == dot


@pytest.mark.skipif(not HAVE_ORT, reason="needs onnx, onnxscript and onnxruntime (pip install 'torch-tricks[onnx]')")
def test_export_onnx_of_keyword_inputs_names_them_and_keeps_the_batch_dynamic(tmp_path, capsys):
    import onnx
    import onnxruntime as ort

    model = MaskedEncoder().eval()
    path = export_onnx(model, _named(1), tmp_path / "m.onnx")
    graph_inputs = onnx.load(str(path)).graph.input
    assert [i.name for i in graph_inputs] == ["input_ids", "attention_mask"]
    assert graph_inputs[0].type.tensor_type.shape.dim[0].dim_param  # a symbolic batch
    feed = _named(5)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {k: v.numpy() for k, v in feed.items()})[0]
    with torch.no_grad():
        assert abs(got - model(**feed).numpy()).max() <= 1e-5
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(not HAVE_TB, reason="needs tensorboard (pip install 'torch-tricks[tensorboard]')")
def test_tensorboard_graph_of_keyword_inputs(tmp_path, capsys):
    logdir = save_graph(MaskedEncoder(), _named(), tmp_path / "tb")
    assert any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())
    assert capsys.readouterr().out == ""
