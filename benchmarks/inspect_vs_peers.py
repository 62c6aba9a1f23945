"""Cross-check torch-tricks' parameter and MAC counts against torchinfo, fvcore, thop and ptflops.

What it claims, on every built-in model (batch 1, its default input, eval mode, ``no_grad``):

* our MACs agree within 1% with fvcore's on the operators both count (conv + linear/matmul)
  for the conv/linear-only models (``Summary`` section, PASS/FAIL);
* every other disagreement has a cause, and the cause is measured on this run, not assumed:
  operators a peer does not count (LSTM recurrent matmuls, attention, an operator its tracer
  does not know, a module its formula undercounts, matmuls run functionally), operators it
  counts that we do not (BatchNorm, pooling, activations, embeddings, bias adds), a MACs vs
  FLOPs convention, or a parameter miscount.

Each peer is read in its own convention: thop and ptflops report MACs, fvcore one "flop" per
multiply-add (i.e. MACs), torchinfo "mult-adds". We count MACs of conv, linear, matmul,
attention and recurrent matmuls only, and FLOPs = 2 x MACs.

How to read the output:

* table: our params and MACs, then per peer ``params / MACs (MACs ratio peer/ours)``; ``=``
  is the same parameter count as ours, ``error: Type`` a peer that raised (reason in the
  notes), ``not installed`` a peer that is missing. Notes: one line per disagreement,
  ``peer: cause (share of our total MACs)``, found by comparing the peer's own per-module
  (torchinfo, thop, ptflops) or per-operator (fvcore) counts with ours.
* time: wall time of each tool's call as a ratio to ours (ours = 1.0, above 1 = slower than
  ours): the median of 3 runs (5 for calls under 0.5 s, 1 for calls over 3 s), the tools
  interleaved so a slow spell of the machine hits them alike, on one torch thread by default
  (--threads). Ratios only: absolute times are in the --json file, and on a shared machine
  they are noisy; when other processes used more than a quarter of a core on average during
  the run (``benchmarks/_trust.py``, issue 16) the time ratios are marked UNRELIABLE. The
  PASS/FAIL counts MACs, which no load changes.
* Summary: the fvcore cross-check, and for the transformer and the LSTM the fraction of our
  attention / recurrent MACs each peer reports.

Usage::

    pip install -e ".[peers]"
    python benchmarks/inspect_vs_peers.py [--models a,b] [--quick] [--json PATH] [--repeats N]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import inspect
import io
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/_trust.py, when imported from elsewhere
from _trust import UNRELIABLE, LoadMonitor  # noqa: E402

from torch_tricks.inspect.inputs import make_inputs
from torch_tricks.inspect.summarize import Summary, summary
from torch_tricks.models import get_model, list_models, model_spec

PEERS = ("torchinfo", "fvcore", "thop", "ptflops")
QUICK_MODELS = ("mlp", "small_cnn", "resnet9", "lstm", "transformer")
CONV_LINEAR_MODELS = (
    "resnet18", "resnet34", "resnet50", "resnet9", "mobilenet_v2", "repvgg", "small_cnn", "mlp",
)
SEQ_MODELS = ("transformer", "lstm")
FVCORE_TOLERANCE = 0.01  # the claim: |ours - fvcore conv+linear| / ours <= 1%
SLOW_CALL_S = 3.0  # a first call slower than this is not repeated
FAST_CALL_S = 0.5  # a first call faster than this gets FAST_REPEATS runs: short timings are noisier
FAST_REPEATS = 5


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    models = _select_models(args)
    torch.set_num_threads(args.threads)
    with LoadMonitor() as window:  # the time ratios are timings: watched for foreign load (issue 16)
        results = run_benchmark(models, repeats=args.repeats, progress=not args.no_progress)
    print(render_table(results))
    print()
    print(render_times(results))
    load = window.check("the whole run")
    if not load.ok:  # the PASS/FAIL below counts MACs, which no load changes; only the times are affected
        print(f"{UNRELIABLE} time ratios: {load}")
    print()
    print(render_summary(results))
    if args.json:
        _write_json_atomic(args.json, results)
        print(f"\nfull results written to {args.json}")
    return 0


@dataclass
class ToolResult:
    """One tool's count of one model, in the tool's own units. ``by_type``: MACs per module
    type (hook-based tools, plus ``(functional ...)`` entries for what they count outside
    module rules) or per operator (fvcore)."""

    tool: str
    status: str  # "ok", "error" or "not installed"
    params: int | None = None
    macs: int | None = None
    seconds: float | None = None  # median wall time of the call
    runs: int = 0
    error: str | None = None
    by_type: dict[str, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # tool-specific evidence (unsupported ops, ...)


@dataclass
class ModelResult:
    name: str
    input: str
    ours: ToolResult
    ours_totals: dict[str, int]
    ours_by_operator: dict[str, int]
    peers: dict[str, ToolResult]
    notes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # our measured quantities the notes cite


def run_benchmark(models: list[str], *, repeats: int = 3, progress: bool = True) -> list[ModelResult]:
    """Count every model with ours and every installed peer, then explain the differences."""
    runners = {"ours": _run_ours}
    runners.update({p: _PEER_RUNNERS[p] for p in PEERS if _peer_available(p)})
    _warm_up(runners)
    bar = tqdm(total=len(models) * len(runners), desc="counting", unit="call", file=sys.stderr,
               disable=not progress)
    results = []
    for name in models:
        spec = model_spec(name)
        model, inputs = _build(name, spec.default_input)
        with torch.no_grad():  # first-call kernel set-up (mkldnn RNN, conv algorithms) is nobody's cost
            model(*inputs)
        done = _count_model(name, spec.default_input, runners, repeats, bar)
        ours = done.pop("ours")
        if ours.status != "ok":  # our own failure is a real failure of this benchmark
            raise RuntimeError(f"torch-tricks failed on {name}: {ours.error}")
        res = ModelResult(
            name=name,
            input=spec.default_input,
            ours=ours,
            ours_totals=ours.info.pop("totals"),
            ours_by_operator=ours.info.pop("by_operator"),
            peers={p: done.get(p, ToolResult(p, "not installed")) for p in PEERS},
        )
        explain(res, _Context(ours.info.pop("model"), ours.info.pop("summary")))
        results.append(res)
    bar.close()
    return results


def explain(res: ModelResult, ctx: _Context) -> None:
    """Fill ``res.notes`` (and ``res.facts``) from the measured counts, peer by peer."""
    res.facts = ctx.facts
    ours_macs = res.ours.macs or 0
    for tool, peer in res.peers.items():
        if peer.status == "not installed":
            continue
        if peer.status == "error":
            res.notes.append(f"{tool}: failed: {peer.error}")
            continue
        notes = _param_notes(peer, res.ours, ctx)
        if ours_macs and peer.macs is not None and abs(peer.macs / ours_macs - 2) < 0.02:
            notes.append("reports FLOPs = 2 x MACs, not MACs")
        notes += _fvcore_notes(peer, res, ctx) if tool == "fvcore" else _module_notes(peer, res, ctx)
        res.notes += [f"{tool}: {n}" for n in notes]


def render_table(results: list[ModelResult]) -> str:
    header = ["model", "params", "MACs", *(f"{p} params / MACs (ratio)" for p in PEERS), "notes"]
    lines: list[list[str]] = []
    for r in results:
        cells = [r.name, _si(r.ours.params), _si(r.ours.macs), *(_peer_cell(r.peers[p], r.ours) for p in PEERS)]
        ran = any(t.status == "ok" for t in r.peers.values())
        notes = r.notes or ["all peers agree exactly" if ran else "no peer ran"]
        lines.append(cells + [notes[0]])
        lines += [[""] * len(cells) + [n] for n in notes[1:]]
    return "Parameters and MACs, batch 1, default input, eval mode\n" + _grid(header, lines)


def render_times(results: list[ModelResult]) -> str:
    lines = []
    for r in results:
        row = [r.name, "1.00"]
        for p in PEERS:
            peer = r.peers[p]
            ok = peer.seconds is not None and r.ours.seconds
            row.append(f"{peer.seconds / r.ours.seconds:.2f}" if ok else peer.status)
        lines.append(row)
    runs = sorted({t.runs for r in results for t in (r.ours, *r.peers.values()) if t.runs})
    span = f"{runs[0]}-{runs[-1]}" if len(runs) > 1 else str(runs[0] if runs else 0)
    return (
        f"Wall time of each tool's call, ratio to ours (median of {span} runs per tool, interleaved, "
        f"{torch.get_num_threads()} torch thread(s); >1 = slower than ours).\n"
        "Short calls on a shared machine are noisy: compare ratios within one run, not across runs.\n"
    ) + _grid(["model", "ours", *PEERS], lines)


def render_summary(results: list[ModelResult]) -> str:
    return "\n".join(["Summary", fvcore_check(results)["text"], sequence_check(results)["text"]])


def fvcore_check(results: list[ModelResult]) -> dict[str, Any]:
    """Our MACs vs fvcore's conv + linear-like MACs on the conv/linear-only models."""
    rows, devs = [], []
    for r in results:
        if r.name not in CONV_LINEAR_MODELS:
            continue
        fv = r.peers["fvcore"]
        if fv.status != "ok":
            rows.append(f"    {r.name:<13} fvcore {fv.status}")
            continue
        same_ops = fv.info["conv"] + fv.info["linear_like"]
        dev = (same_ops - r.ours.macs) / r.ours.macs
        devs.append(abs(dev))
        rows.append(f"    {r.name:<13} ours {r.ours.macs:>15,}  fvcore conv+linear {same_ops:>15,}  "
                    f"deviation {dev:+.4%}")
    if not rows:
        text = "  fvcore cross-check: no conv/linear-only model selected"
        return {"text": text, "max_deviation": None, "passed": None}
    passed = max(devs) <= FVCORE_TOLERANCE if devs else None
    verdict = (f"max |deviation| {max(devs):.4%} (tolerance {FVCORE_TOLERANCE:.0%}): "
               f"{'PASS' if passed else 'FAIL'}") if devs else "fvcore did not run: n/a"
    head = "  fvcore cross-check, conv/linear-only models (our MACs vs fvcore's conv + linear/matmul ops):"
    return {"text": "\n".join([head, *rows, "    " + verdict]),
            "max_deviation": max(devs) if devs else None, "passed": passed}


def sequence_check(results: list[ModelResult]) -> dict[str, Any]:
    """Which peers miss the attention / recurrent matmuls: the fraction of ours each reports."""
    lines, data = [], {}
    for r in results:
        if r.name not in SEQ_MODELS:
            continue
        if r.name == "lstm":
            part_name, part_ours = "LSTM recurrent + input matmuls", r.facts["rnn_macs"]
        else:
            part_name, part_ours = "MultiheadAttention (projections + attention matmuls)", r.facts["mha_macs"]
        lines.append(f"  {r.name}: our total {r.ours.macs:,} MACs; {part_name}: {part_ours:,} "
                     f"({part_ours / r.ours.macs:.1%} of total)")
        data[r.name] = {}
        for p in PEERS:
            peer = r.peers[p]
            if peer.status != "ok":
                lines.append(f"    {p:<10} {peer.status}")
                continue
            frac = _peer_part(peer, r) / part_ours if part_ours else float("nan")
            verdict = "misses it" if frac < 0.1 else "undercounts it" if frac < 0.9 else "counts it"
            data[r.name][p] = {"part_fraction": frac, "total_ratio": peer.macs / r.ours.macs}
            lines.append(f"    {p:<10} reports {frac:7.1%} of that part ({verdict}); "
                         f"total {peer.macs / r.ours.macs:.3f}x ours")
    if not lines:
        lines = ["  transformer/lstm: not selected"]
    head = "  attention / recurrent matmuls (fraction of ours each peer reports):"
    return {"text": "\n".join([head, *lines]), "data": data}


# -- explaining disagreements --------------------------------------------------------------


def _param_notes(peer: ToolResult, ours: ToolResult, ctx: _Context) -> list[str]:
    if peer.params is None or peer.params == ours.params:
        return []
    delta = peer.params - (ours.params or 0)
    causes = {
        -ctx.frozen_params: "counts trainable parameters only",
        -ctx.nonleaf_params: "misses parameters held directly by non-leaf modules",
        ctx.shared_duplicates: "counts shared parameters once per use",
        ctx.buffer_elems: "counts buffers as parameters",
    }
    return [f"params {peer.params:,} vs ours {ours.params:,} ({delta:+,}): {causes.get(delta, 'cause not identified')}"]


def _module_notes(peer: ToolResult, res: ModelResult, ctx: _Context) -> list[str]:
    """Compare a hook-based peer with us, module type by module type."""
    total = res.ours.macs or 1
    ours_by_type = ctx.ours_by_type
    notes, extras = [], []
    doubled = _double_counted(peer)
    types = sorted(set(ours_by_type) | set(peer.by_type),
                   key=lambda t: -max(ours_by_type.get(t, 0), peer.by_type.get(t, 0)))
    # Matmuls a module runs functionally (not through a submodule) that the peer's module rules
    # miss but its functional counter (thop, ptflops) catches: compare them as one group.
    fn_keys = [k for k in peer.by_type if k.startswith("(functional") and re.search(r"matmul|attention", k)]
    uncovered = [t for t in types if t in ctx.functional_types and ours_by_type.get(t) and not peer.by_type.get(t)]
    if fn_keys and uncovered:
        ours_u = sum(ours_by_type[t] for t in uncovered)
        peer_u = sum(peer.by_type[k] for k in fn_keys)
        if peer_u != ours_u:
            notes.append(f"functional matmuls in {', '.join(uncovered)} (no module rule; its functional "
                         f"counter): {peer_u / ours_u:.2%} of ours ({_pct((peer_u - ours_u) / total)} of total)")
        types = [t for t in types if t not in uncovered and t not in fn_keys]
    for t in types:
        ours_t, peer_t = ours_by_type.get(t, 0), peer.by_type.get(t, 0)
        share = _pct((peer_t - ours_t) / total) + " of total"
        if ours_t == 0:
            if peer_t and t in doubled:
                notes.append(f"counts {doubled[t]} twice, by the module's hook and again through the "
                             f"functional call it makes ({_pct(peer_t / total)} of total each)")
            elif peer_t and t not in doubled.values():
                extras.append(f"{t} {_pct(peer_t / total)}")
            continue
        if peer_t == ours_t:
            continue
        ratio = peer_t / ours_t
        if ratio < 0.1 and t in ctx.rnn_types:
            notes.append(f"misses the {t} input/recurrent matmuls: reports {ratio:.1%} of our {t} MACs ({share})")
        elif peer_t == 0:
            notes.append(f"counts 0 for {t}{_why_uncounted(peer, t, ctx)} ({share})")
        elif ratio < 1:
            notes.append(f"{t}: {ratio:.2%} of our {t} MACs{_undercount_reason(ratio, t, ctx)} ({share})")
        else:
            notes.append(f"{t}: {_excess_reason(peer_t - ours_t, t, ctx)} ({share})")
    if extras:
        notes.append("counts ops we don't (share of our total): " + ", ".join(extras))
    return notes


def _double_counted(peer: ToolResult) -> dict[str, str]:
    """``{"(functional relu)": "ReLU"}`` where a functional count equals a module type's count
    of the same operation (a patched ``F.relu`` that ``nn.ReLU.forward`` calls)."""
    squash = lambda s: re.sub(r"[^a-z0-9]", "", s.lower())  # noqa: E731
    out = {}
    for k, v in peer.by_type.items():
        if k.startswith("(functional ") and v:
            fn = squash(k[len("(functional "):-1])
            out.update({k: t for t, n in peer.by_type.items() if not t.startswith("(") and squash(t) == fn and n == v})
    return out


def _why_uncounted(peer: ToolResult, t: str, ctx: _Context) -> str:
    names = ctx.names_by_type.get(t, [])
    own = sorted({p for n in names for p in ctx.direct_params.get(n, [])})
    if peer.tool == "torchinfo" and own and any(n in peer.info.get("nonleaf_with_macs", []) for n in names):
        return (f" (non-leaf module holding its own weights {', '.join(own)}: torchinfo shows their "
                "mult-adds in its row but leaves them out of the total)")
    if t in ctx.functional_types:
        return " (matmuls run functionally in its forward, not by a submodule)"
    if names and not any(n in set(peer.info.get("seen", [])) for n in names):
        if peer.tool == "torchinfo":
            return " (its hooks never ran on these modules)"
        return " (no counting rule of its own ran on these modules)"
    return ""


def _undercount_reason(ratio: float, t: str, ctx: _Context) -> str:
    positions = ctx.positions_by_type.get(t)
    if positions and positions > 1 and abs(1 / ratio / positions - 1) < 0.05:
        return (f" - counted once per sample, not per position (x1/{positions}; "
                f"input {ctx.shape_by_type[t]})")
    return ""


def _excess_reason(excess: int, t: str, ctx: _Context) -> str:
    bias, ours_t = ctx.bias_adds_by_type.get(t, 0), ctx.ours_by_type[t]
    head = f"+{excess / ours_t:.2%} over our {t} MACs"
    if bias and abs(excess - bias) <= 0.02 * bias:
        return head + " = its bias adds"
    if bias and excess > bias:
        return (head + f": bias adds {_pct(bias / ours_t)} + other element-wise terms of its formula "
                f"{_pct((excess - bias) / ours_t)}")
    return head + " (element-wise terms of its formula)"


def _fvcore_notes(peer: ToolResult, res: ModelResult, ctx: _Context) -> list[str]:
    """Compare fvcore operator by operator: conv, linear-like, and everything else."""
    total = res.ours.macs or 1
    ours = res.ours_by_operator
    unsupported = peer.info.get("unsupported", {})
    ops = lambda pattern: ", ".join(  # noqa: E731
        f"{k} x{v}" for k, v in unsupported.items() if re.search(pattern, k)) or "none reported"
    notes = []
    if ours.get("conv", 0) and peer.info["conv"] != ours["conv"]:
        notes.append(f"conv: {peer.info['conv'] / ours['conv']:.2%} of ours")
    if ours.get("rnn", 0):
        notes.append(f"misses the recurrent matmuls (counts 0 of our {ours['rnn']:,} RNN MACs, "
                     f"{_pct(-ours['rnn'] / total)} of total): unsupported op {ops(r'lstm|gru|rnn')}")
    ours_linear = ours.get("linear/matmul", 0) + ours.get("attention", 0)
    missing = ours_linear - peer.info["linear_like"]
    if ours_linear and missing:
        candidates = {
            "whole nn.MultiheadAttention modules (in/out projections + attention matmuls)":
                ctx.ours_by_type.get("MultiheadAttention", 0),
            "attention matmuls (QK^T, AV)": ours.get("attention", 0),
        }
        what = next((d for d, v in candidates.items() if v and abs(missing - v) <= 0.01 * v), None)
        if missing > 0 and what:
            notes.append(f"misses {what} ({_pct(-missing / total)} of total): "
                         f"unsupported op {ops(r'attention|transformer|matmul|einsum|mm$')}")
        else:
            notes.append(f"linear/matmul/attention: {peer.info['linear_like'] / ours_linear:.2%} of ours "
                         f"({_pct(-missing / total)} of total)")
    extra = sorted(peer.info.get("extra_ops", {}).items(), key=lambda kv: -kv[1])
    if extra:
        notes.append("counts ops we don't (share of our total): "
                     + ", ".join(f"{k} {_pct(v / total)}" for k, v in extra))
    return notes


def _peer_part(peer: ToolResult, r: ModelResult) -> int:
    """The peer's count of the recurrent (lstm) or MultiheadAttention (transformer) part."""
    if peer.tool == "fvcore":
        if r.name == "lstm":
            return sum(v for k, v in peer.by_type.items() if re.search(r"lstm|gru|rnn", k))
        # no module view: what it counts of linear-like ops beyond our linears outside attention
        ours = r.ours_by_operator
        non_mha = ours.get("linear/matmul", 0) + ours.get("attention", 0) - r.facts["mha_macs"]
        return max(peer.info["linear_like"] - non_mha, 0)
    if r.name == "lstm":
        return peer.by_type.get("LSTM", 0)
    functional = sum(v for k, v in peer.by_type.items() if k.startswith("(functional") and "attention" in k)
    return peer.by_type.get("MultiheadAttention", 0) + functional


# -- formatting and output -----------------------------------------------------------------


def _pct(x: float) -> str:
    if 0 < abs(x) < 5e-5:
        return f"{'+' if x > 0 else '-'}<0.01%"
    return f"{x * 100:+.2f}%"


def _peer_cell(peer: ToolResult, ours: ToolResult) -> str:
    if peer.status == "not installed":
        return "not installed"
    if peer.status == "error":
        return f"error: {peer.error.split(':', 1)[0]}"
    params = "=" if peer.params == ours.params else _si(peer.params)
    return f"{params} / {_si(peer.macs)} ({peer.macs / ours.macs:.3f})"


def _si(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}"
    return str(n)


def _grid(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    widths[-1] = len(header[-1])  # the last column is not padded
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


def _write_json_atomic(path: str, results: list[ModelResult]) -> None:
    payload = {
        "versions": _versions(),
        "torch_threads": torch.get_num_threads(),
        "conventions": "ours: MACs of conv/linear/matmul/attention/RNN ops, FLOPs = 2 x MACs; each peer "
        "in its own convention (all report one unit per multiply-add)",
        "models": {r.name: _result_dict(r) for r in results},
        "summary": {
            "fvcore": {k: v for k, v in fvcore_check(results).items() if k != "text"},
            "sequence": sequence_check(results)["data"],
        },
    }
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".inspect_vs_peers.", suffix=".json", dir=folder)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the result is an ordinary file
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, default=str)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _result_dict(r: ModelResult) -> dict[str, Any]:
    ratio = lambda t: t.seconds / r.ours.seconds if t.seconds and r.ours.seconds else None  # noqa: E731
    return {
        "input": r.input,
        "ours": {**asdict(r.ours), "totals": r.ours_totals, "by_operator": r.ours_by_operator},
        "peers": {p: asdict(t) for p, t in r.peers.items()},
        "time_ratio_to_ours": {p: ratio(t) for p, t in r.peers.items()},
        "notes": r.notes,
        "facts": r.facts,
    }


def _versions() -> dict[str, str | None]:
    dists = {"torchinfo": ["torchinfo"], "fvcore": ["fvcore"], "thop": ["ultralytics-thop", "thop"],
             "ptflops": ["ptflops"]}
    out: dict[str, str | None] = {"torch": torch.__version__}
    for peer, names in dists.items():
        out[peer] = None
        for d in names if _peer_available(peer) else []:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                out[peer] = f"{d}=={importlib.metadata.version(d)}"
                break
    return out


# -- running the tools ---------------------------------------------------------------------


def _count_model(
    name: str, input_spec: str, runners: dict[str, Callable[..., ToolResult]], repeats: int, bar: tqdm
) -> dict[str, ToolResult]:
    """Run every tool on a fresh copy of the model, in rounds of one call per tool, so a slow
    spell of a shared machine hits all tools alike; keep the median time.

    The first round sets each tool's number of runs: ``repeats``; ``FAST_REPEATS`` for calls
    under ``FAST_CALL_S``; 1 for calls over ``SLOW_CALL_S``."""
    times: dict[str, list[float]] = {t: [] for t in runners}
    target = dict.fromkeys(runners, 1)
    done: dict[str, ToolResult] = {}
    fast = max(repeats, FAST_REPEATS) if repeats > 1 else 1
    for rnd in range(max(repeats, fast)):
        for tool, runner in runners.items():
            if tool in done and (done[tool].status != "ok" or len(times[tool]) >= target[tool]):
                continue
            bar.set_postfix_str(f"{name}/{tool}")
            model, inputs = _build(name, input_spec)
            try:
                with warnings.catch_warnings(), torch.no_grad():
                    warnings.simplefilter("ignore")
                    t0 = time.perf_counter()
                    result = runner(model, inputs)
                    times[tool].append(time.perf_counter() - t0)
            except Exception as exc:  # a peer's failure is a result, never a crash
                done[tool] = ToolResult(tool, "error", error=_one_line(exc))
                bar.update(1)
                continue
            if rnd == 0:
                t = times[tool][0]
                target[tool] = 1 if t > SLOW_CALL_S else fast if t < FAST_CALL_S else max(repeats, 1)
            result.tool, result.status = tool, "ok"
            result.seconds, result.runs = statistics.median(times[tool]), len(times[tool])
            done[tool] = result
            if len(times[tool]) >= target[tool]:
                bar.update(1)
    return done


def _build(name: str, input_spec: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = get_model(name).eval()
    torch.manual_seed(1)
    return model, tuple(make_inputs(input_spec, batch=1, model=model))


def _warm_up(runners: dict[str, Callable[..., ToolResult]]) -> None:
    """One untimed call per tool on the smallest model, so lazy imports are not timed."""
    for runner in runners.values():
        model, inputs = _build("mlp", model_spec("mlp").default_input)
        with contextlib.suppress(Exception), warnings.catch_warnings(), torch.no_grad(), _quiet():
            warnings.simplefilter("ignore")
            runner(model, inputs)


class _PeerError(RuntimeError):
    """A failure a peer reported instead of raising; the message starts with its exception type."""

    def __str__(self) -> str:
        return self.args[0]


def _one_line(exc: BaseException) -> str:
    msg = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, _PeerError):
        return msg[:200]
    return f"{type(exc).__name__}: {msg[:160]}"


@contextlib.contextmanager
def _quiet():
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        yield buf


def _run_ours(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> ToolResult:
    s = summary(model, inputs, depth=3)
    info = {"totals": dict(s.totals), "by_operator": dict(s.by_operator), "summary": s, "model": model}
    return ToolResult("ours", "ok", params=s.totals["params"], macs=s.totals["macs"], info=info)


def _run_torchinfo(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> ToolResult:
    import torchinfo

    stats = torchinfo.summary(model, input_data=list(inputs), verbose=0, mode="eval", device="cpu")
    names = {id(m): n for n, m in model.named_modules()}
    res = ToolResult("torchinfo", "ok", params=int(stats.total_params), macs=int(stats.total_mult_adds))
    seen, nonleaf = [], []
    for layer in stats.summary_list:
        name = names.get(id(layer.module), layer.var_name)
        seen.append(name)
        if layer.is_leaf_layer:  # torchinfo's total is the sum over leaf rows
            _add(res.by_type, type(layer.module).__name__, layer.macs)
        elif layer.macs:
            nonleaf.append(name)
    res.info = {"seen": seen, "nonleaf_with_macs": nonleaf}
    return res


_FVCORE_LINEAR_OPS = {"linear", "addmm", "matmul", "bmm", "einsum", "mm", "baddbmm"}


def _run_fvcore(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> ToolResult:
    from fvcore.nn import FlopCountAnalysis, parameter_count

    with _quiet():
        fca = FlopCountAnalysis(model, inputs).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
        total = int(fca.total())
        by_op = {k: int(v) for k, v in fca.by_operator().items()}
        unsupported = {k: int(v) for k, v in fca.unsupported_ops().items()}
        params = int(parameter_count(model)[""])
    is_extra = lambda k: not k.startswith("conv") and k not in _FVCORE_LINEAR_OPS  # noqa: E731
    info = {
        "conv": sum(v for k, v in by_op.items() if k.startswith("conv")),
        "linear_like": sum(v for k, v in by_op.items() if k in _FVCORE_LINEAR_OPS),
        "extra_ops": {k: v for k, v in by_op.items() if is_extra(k) and v},
        "unsupported": unsupported,
    }
    return ToolResult("fvcore", "ok", params=params, macs=total, by_type=by_op, info=info)


def _run_thop(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> ToolResult:
    """thop's own rules, each wrapped to record what it counted per module type, and its
    functional counter (ultralytics-thop) likewise per function."""
    thop_profile = importlib.import_module("thop.profile")
    names = {id(m): n for n, m in model.named_modules()}
    res, seen = ToolResult("thop", "ok"), []
    zero = getattr(thop_profile, "zero_ops", None)

    def wrap(fn):
        def rule(m, x, y):
            before = float(m.total_ops)
            out = fn(m, x, y)
            _add(res.by_type, type(m).__name__, round(float(m.total_ops) - before))
            seen.append(names.get(id(m), "?"))
            return out

        return rule

    custom = {t: wrap(fn) for t, fn in thop_profile.register_hooks.items() if fn is not zero}
    func_counts: dict[str, int] = {}
    with _patched_values([getattr(thop_profile, "functional_hooks", {})], func_counts), _quiet():
        macs, params = thop_profile.profile(model, inputs=inputs, custom_ops=custom, verbose=False)
    res.params, res.macs = int(params), int(macs)
    _merge_functional(res, func_counts)
    res.info = {"seen": seen}
    return res


def _run_ptflops(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> ToolResult:
    """ptflops' own module hooks (passed back to it as custom hooks) and its patched
    functions, each wrapped to record what it counted."""
    import ptflops
    from ptflops import pytorch_ops

    names = {id(m): n for n, m in model.named_modules()}
    res, seen = ToolResult("ptflops", "ok"), []

    def wrap(hook):
        def counted(module, inp, out):
            before = module.__flops__
            hook(module, inp, out)
            _add(res.by_type, type(module).__name__, module.__flops__ - before)
            seen.append(names.get(id(module), "?"))

        return counted

    hooks = {t: wrap(h) for t, h in pytorch_ops.MODULES_MAPPING.items()}
    tables = [getattr(pytorch_ops, t, {}) for t in ("FUNCTIONAL_MAPPING", "TENSOR_OPS_MAPPING")]
    func_counts: dict[str, int] = {}
    count = ptflops.get_model_complexity_info
    # the module-hook backend (newer releases also have an ATen one); it is what the hooks above wrap
    backend = {"backend": "pytorch"} if "backend" in inspect.signature(count).parameters else {}
    with _patched_values(tables, func_counts), _quiet() as out:
        macs, params = count(
            model, tuple(inputs[0].shape[1:]), input_constructor=_ptflops_constructor(model, inputs),
            as_strings=False, print_per_layer_stat=False, verbose=False, custom_modules_hooks=hooks, **backend,
        )
    if macs is None:  # ptflops prints the exception and returns None instead of raising
        m = re.search(r"<class '([\w.]+)'>: (.*)", out.getvalue())
        raise _PeerError(f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}" if m else "ptflops returned None")
    res.params, res.macs = int(params), int(macs)
    _merge_functional(res, func_counts)
    res.info = {"seen": seen}
    return res


def _ptflops_constructor(model: nn.Module, inputs: tuple[torch.Tensor, ...]):
    """ptflops calls ``model(x)`` or ``model(**x)``: several inputs go by parameter name."""
    if len(inputs) == 1:
        return lambda _res: inputs[0]
    params = list(inspect.signature(model.forward).parameters)
    return lambda _res: dict(zip(params, inputs))


@contextlib.contextmanager
def _patched_values(tables: list[dict], counts: dict[str, int]):
    """Wrap every counting function in a peer's ``{function: rule}`` tables so what each rule
    returns is also added to ``counts`` under ``(functional NAME)``; restored on exit."""
    saved = [dict(t) for t in tables]

    def recording(rule, func):
        label = f"(functional {_func_label(func)})"

        def recorded(*args, **kwargs):
            n = rule(*args, **kwargs)
            with contextlib.suppress(TypeError, ValueError):
                _add(counts, label, int(n))
            return n

        return recorded

    try:
        for table in tables:
            table.update({f: recording(rule, f) for f, rule in table.items()})
        yield
    finally:
        for table, orig in zip(tables, saved):
            table.clear()
            table.update(orig)


def _func_label(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    if name in ("matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "einsum", "linear"):
        return "matmul"
    if "attention" in name:
        return "attention" if "scaled_dot" in name else "multi_head_attention"
    return name


def _merge_functional(res: ToolResult, func_counts: dict[str, int]) -> None:
    """Add the functional counts to ``by_type``, and whatever of the total is still unattributed."""
    for k, v in func_counts.items():
        if v:
            _add(res.by_type, k, v)
    rest = res.macs - sum(res.by_type.values())
    if rest:
        _add(res.by_type, "(functional, unattributed)", rest)


def _add(d: dict[str, int], key: str, n: float) -> None:
    d[key] = d.get(key, 0) + int(n)


_PEER_RUNNERS = {"torchinfo": _run_torchinfo, "fvcore": _run_fvcore, "thop": _run_thop, "ptflops": _run_ptflops}


def _peer_available(peer: str) -> bool:
    try:
        importlib.import_module({"fvcore": "fvcore.nn", "thop": "thop.profile"}.get(peer, peer))
    except Exception:  # not installed, or broken on this torch
        return False
    return True


# -- what we know about the model from our own count ---------------------------------------


class _Context:
    """Our MACs per module type (each module's own, children excluded), bias adds, input
    shapes and parameter facts: the quantities the notes compare the peers against."""

    def __init__(self, model: nn.Module, s: Summary):
        rows = {r.name: r for r in s.all_rows}
        modules = dict(model.named_modules())
        has_children = {n for n, m in modules.items() if next(m.children(), None) is not None}
        child_macs: dict[str, int] = {}
        for name, r in rows.items():
            if name:
                parent = name  # the nearest ancestor that ran (a ModuleList never runs itself)
                while parent:
                    parent = parent.rsplit(".", 1)[0] if "." in parent else ""
                    if parent in rows:
                        break
                _add(child_macs, parent, r.macs)
        self.ours_by_type: dict[str, int] = {}
        self.names_by_type: dict[str, list[str]] = {}
        self.bias_adds_by_type: dict[str, int] = {}
        self.positions_by_type: dict[str, int] = {}
        self.shape_by_type: dict[str, tuple[int, ...]] = {}
        self.rnn_types: set[str] = set()
        self.functional_types: set[str] = set()  # own MACs from functional ops, not from a submodule
        self.direct_params = {n: [p for p, _ in modules[n].named_parameters(recurse=False)] for n in has_children}
        for name, r in rows.items():
            own = r.macs - child_macs.get(name, 0)
            if not own:
                continue
            m = modules[name]
            t = type(m).__name__
            _add(self.ours_by_type, t, own)
            self.names_by_type.setdefault(t, []).append(name)
            _add(self.bias_adds_by_type, t, _bias_adds(m, r))
            if name in has_children or not type(m).__module__.startswith("torch.nn."):
                self.functional_types.add(t)
            if isinstance(m, nn.RNNBase):
                self.rnn_types.add(t)
            if r.input_shapes and t not in self.positions_by_type and len(r.input_shapes[0]) >= 3:
                self.positions_by_type[t] = math.prod(r.input_shapes[0][1:-1])
                self.shape_by_type[t] = tuple(r.input_shapes[0])
        params = list(model.parameters())
        all_uses = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
        self.frozen_params = sum(p.numel() for p in params if not p.requires_grad)
        self.nonleaf_params = sum(p.numel() for n in has_children for p in modules[n].parameters(recurse=False))
        self.shared_duplicates = all_uses - sum(p.numel() for p in params)
        self.buffer_elems = sum(b.numel() for b in model.buffers())
        mha = [n for n, m in modules.items() if isinstance(m, nn.MultiheadAttention) and n in rows]
        self.facts = {
            "ours_macs_by_module_type": dict(self.ours_by_type),
            "bias_adds_by_module_type": {k: v for k, v in self.bias_adds_by_type.items() if v},
            "rnn_macs": s.by_operator.get("rnn", 0),
            "attention_macs": s.by_operator.get("attention", 0),
            "mha_macs": sum(rows[n].macs for n in mha),
        }


def _bias_adds(m: nn.Module, r) -> int:
    """One add per output element per bias: what a formula adds if it counts bias adds as MACs."""
    if not r.input_shapes:
        return 0
    if isinstance(m, nn.RNNBase):
        shape = r.input_shapes[0]
        steps = math.prod(shape[:2]) if len(shape) >= 3 else shape[0]
        return r.calls * steps * sum(p.numel() for n, p in m.named_parameters() if n.startswith("bias"))
    if isinstance(m, nn.MultiheadAttention):
        tokens = math.prod(r.input_shapes[0][:-1])
        biases = [b for b in (m.in_proj_bias, m.out_proj.bias) if b is not None]
        return r.calls * tokens * sum(b.numel() for b in biases)
    out = r.output_shapes
    if isinstance(getattr(m, "bias", None), torch.Tensor) and isinstance(out, tuple):
        if all(isinstance(d, int) for d in out):
            return r.calls * math.prod(out)
    return 0


# -- command line --------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help=f"comma-separated subset of: {', '.join(list_models())}")
    ap.add_argument("--quick", action="store_true", help=f"CI subset: {', '.join(QUICK_MODELS)}")
    ap.add_argument("--json", metavar="PATH", help="write the full results here (atomically)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per tool and model, median kept (default 3; 1 when only the counts matter)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: on a busy machine, threads waiting on a "
                    "descheduled sibling make timings swing tenfold)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return ap.parse_args(argv)


def _select_models(args: argparse.Namespace) -> list[str]:
    known = list_models()
    if args.models:
        chosen = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in chosen if m not in known]
        if unknown:
            raise SystemExit(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(known)}")
        return chosen
    return [m for m in known if m in QUICK_MODELS] if args.quick else known


if __name__ == "__main__":
    sys.exit(main())
