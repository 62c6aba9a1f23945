"""The tune's token phase (T39-T41): how to batch the user's token rows, measured in real tokens a second.

Which of padding each batch to its longest row (T39), grouping rows by length (T40) or packing
rows into full ones (T41) trains fastest depends on the data's lengths and the model (packing
pays attention over a whole packed row where a dense mask is used; grouping changes nothing on
data of one length). So the tune measures them on a sample of the user's own rows: each way
batches the same rows, one training step per batch (the tune's chosen configuration is not
needed: the ways differ in what they compute, not in how), the ways interleaved round after
round with padding-to-the-maximum twice (its A/A: the noise). A token of the data computed is a
real token; padding is not counted. Packing is measured only where the model keeps packed
sequences apart (:func:`~torch_tricks.data.token_batches.packing_leak`): a model that lets them
attend to each other would learn something else, however fast.

The choice replaces the loop's default (padded) only when faster beyond the noise.
"""

from __future__ import annotations

import copy
import random
import statistics
import time
from typing import Any

import torch

from torch_tricks import batches as B
from torch_tricks.data.token_batches import (TokenRowList, max_positions, packing_keywords, packing_leak,
                                             real_tokens, row_lengths, token_loader)
from torch_tricks.outputs import get_loss
from torch_tricks.tuning.measure import _Peak
from torch_tricks.errors import one_line

__all__ = ["measure_token_batches", "WAYS", "LEAK_TOLERANCE"]

WAYS = ("max", "padded", "grouped", "packed")  # TrainConfig.token_batches; max: the baseline
TRICKS = {"padded": "dynamic_padding (T39)", "grouped": "length_grouped (T40)", "packed": "packing (T41)",
          "max": "padded to the model's positions"}
LEAK_TOLERANCE = 1e-3  # logits of packed sequences against alone: beyond rounding (fp32 sums in another order)
_SAMPLE_BATCHES = 4  # batches of rows in the sample each way batches
_MAX_ROUNDS = 6


def measure_token_batches(model: torch.nn.Module, data: Any, *, batch_size: int, device: torch.device,
                          seconds: float, seed: int = 0, min_effect: float = 0.02,
                          loss_fn: Any = None) -> dict[str, Any]:
    """Real tokens a second of each way to batch a sample of ``data`` (rows ``{"input_ids": ...}``), within
    ``seconds``; the way chosen (``choice``) and why. Never raises for the model's sake: a way that fails is a
    row saying why. A step is forward, ``loss_fn`` (default: the model's own loss), backward and an AdamW
    step at lr 0 (its cost counted, the weights the same for every way)."""
    t0 = time.perf_counter()
    lengths = row_lengths(data)
    sample = _sample(len(lengths), batch_size, seed)
    rows = [data[i] for i in sample]
    out: dict[str, Any] = {"status": "measured", "sample_rows": len(rows), "real_tokens": real_tokens(rows),
                           "row_len": max_positions(model), "ways": [], "noise": None}
    leak = _leak(model, device)
    out["packing_leak"] = leak
    ways = [w for w in WAYS if w != "packed" or (leak is not None and leak <= LEAK_TOLERANCE)]
    work = copy.deepcopy(model).to(device).train()
    step = _Step(work, loss_fn or get_loss("auto"), device)
    epochs, failed = _epochs(step, rows, batch_size, seed, ways)
    times = _rounds(step, epochs, deadline=t0 + seconds, seed=seed)
    out["ways"] = _rows(epochs, times, out["real_tokens"], failed, leak)
    _loss_and_memory(step, epochs, out["ways"], deadline=t0 + seconds)
    out.update(_decide(out["ways"], times, min_effect))
    return out


def _sample(n: int, batch_size: int, seed: int) -> list[int]:
    """A seeded sample of row indices: a few batches' worth (all rows where there are fewer)."""
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    return sorted(idx[:batch_size * _SAMPLE_BATCHES])


def _leak(model: torch.nn.Module, device: torch.device) -> float | None:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        return None
    try:
        return packing_leak(copy.deepcopy(model).to(device), vocab_size=vocab)
    except Exception:  # a model that cannot take position_ids: packing is not for it
        return None


def _epochs(step: "_Step", rows: list[Any], batch_size: int, seed: int,
            ways: list[str]) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """Each way's batches of ``rows`` (on the model's device), and the ways whose first step failed, with why."""
    row_len = max_positions(step.model)
    epochs, failed = {}, {}
    for way in ways:
        try:
            kw = packing_keywords(step.model) if way == "packed" else None
            loader = token_loader(TokenRowList(rows), batch_size=batch_size, mode=way, row_len=row_len, seed=seed,
                                  keywords=kw)
            epochs[way] = [B.to_device(b, step.device) for b in loader]
            step(epochs[way][0])  # warm-up: the first shapes, the allocator
        except Exception as exc:
            epochs.pop(way, None)
            failed[way] = one_line(exc, with_type=True)
    return epochs, failed


def _rounds(step: "_Step", epochs: dict[str, list[Any]], *, deadline: float, seed: int) -> dict[str, list[float]]:
    """Each way's epoch seconds per round (max twice: its A/A), the ways in a new random order each round;
    a round after the first only where it fits in the time left."""
    arms = list(epochs) + (["max (again)"] if "max" in epochs else [])
    times: dict[str, list[float]] = {a: [] for a in arms}
    rng = random.Random(seed)
    round_s = 0.0
    for r in range(_MAX_ROUNDS):
        if r and time.perf_counter() + round_s > deadline:
            break
        t = time.perf_counter()
        rng.shuffle(arms)
        for arm in arms:
            times[arm].append(sum(step(b) for b in epochs[arm.split(" ")[0]]))
        round_s = time.perf_counter() - t
    return times


class _Step:
    """One training step's seconds on a batch: forward, loss, backward, an AdamW step at lr 0."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any, device: torch.device) -> None:
        self.model, self.loss_fn, self.device = model, loss_fn, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)

    def __call__(self, batch: Any) -> float:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        _, loss = B.forward(self.model, batch, self.loss_fn)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t


def _loss_and_memory(step: "_Step", epochs: dict[str, list[Any]], rows: list[dict[str, Any]], *,
                     deadline: float) -> None:
    """Each way's loss over the sample (the per-token mean at the same weights: the same number for every way
    where batching changes nothing it should not; a leak between packed sequences shows here) and the peak
    of the tensor bytes a step allocates (activations, gradients) on its largest batch, where the time allows."""
    losses = {way: _mean_loss(step, batches) for way, batches in epochs.items()}
    ref = losses.get("padded")
    for row in rows:
        way = row["way"]
        if way not in epochs:
            continue
        row["loss"] = losses[way]
        row["loss_drift"] = abs(losses[way] - ref) / abs(ref) if ref else None
        if time.perf_counter() < deadline:
            row["peak_bytes"] = _peak(step, max(epochs[way], key=lambda b: b["input_ids"].numel()))


def _mean_loss(step: "_Step", batches: list[Any]) -> float:
    """The per-token mean loss over ``batches`` (each batch's mean weighted by the labels that count)."""
    total, n = 0.0, 0
    was = step.model.training
    step.model.eval()
    try:
        with torch.no_grad():
            for b in batches:
                _, loss = B.forward(step.model, b, step.loss_fn)
                k = B.count(b)
                total, n = total + float(loss) * k, n + k
    finally:
        step.model.train(was)
    return total / max(n, 1)


def _peak(step: "_Step", batch: Any) -> int | None:
    """Peak of the tensor bytes one step on ``batch`` allocates (CUDA: beyond what was allocated before it)."""
    try:
        with _Peak(step.device) as p:
            step(batch)
        return int(p.peak)
    except Exception:
        return None


def _rows(epochs: dict[str, list[Any]], times: dict[str, list[float]], real: int, failed: dict[str, str],
          leak: float | None) -> list[dict[str, Any]]:
    base = statistics.median(times["max"]) if times.get("max") else None
    out = []
    for way in WAYS:
        row: dict[str, Any] = {"way": way, "trick": TRICKS[way]}
        if way in epochs and times[way]:
            t = statistics.median(times[way])
            computed = sum(b["input_ids"].numel() for b in epochs[way])
            row.update(status="measured", steps=len(epochs[way]), computed=computed, real_share=real / computed,
                       seconds=t, real_tokens_per_s=real / t, vs_max=base / t if base else None,
                       tokens_per_step=max(b["input_ids"].numel() for b in epochs[way]))
        elif way in failed:
            row.update(status="failed", reason=failed[way])
        elif way == "packed":
            row.update(status="refused", reason=_leak_reason(leak))
        else:
            row.update(status="skipped", reason="over the phase's time")
        out.append(row)
    return out


def _leak_reason(leak: float | None) -> str:
    if leak is None:
        return "the model takes no position_ids (or has no vocab_size): packed sequences could not be kept apart"
    return (f"the model lets packed sequences attend to each other (logits {leak:.2g} from the same sequences "
            "alone): packing would change what it learns")


def _decide(rows: list[dict[str, Any]], times: dict[str, list[float]], min_effect: float) -> dict[str, Any]:
    """The fastest way where it beats padded (the loop's default) beyond the noise (max against itself)."""
    measured = {r["way"]: r for r in rows if r.get("status") == "measured"}
    noise = None
    if len(times.get("max", [])) and len(times.get("max (again)", [])):
        a, b = statistics.median(times["max"]), statistics.median(times["max (again)"])
        noise = abs(a / b - 1.0)
    if "padded" not in measured:
        return {"noise": noise, "choice": None, "reason": "padded could not be measured: nothing chosen"}
    margin = max(min_effect, noise or 0.0)
    best = max(measured.values(), key=lambda r: r["real_tokens_per_s"])
    gain = best["real_tokens_per_s"] / measured["padded"]["real_tokens_per_s"]
    if best["way"] != "padded" and gain > 1.0 + margin:
        return {"noise": noise, "choice": best["way"],
                "reason": f"{best['way']} {gain:.2f}x the real tokens a second of padded (beyond the noise, "
                          f"{margin:.0%})"}
    return {"noise": noise, "choice": "padded",
            "reason": f"no way beat padded beyond the noise ({margin:.0%}): the fastest, {best['way']}, "
                      f"{gain:.2f}x"}
