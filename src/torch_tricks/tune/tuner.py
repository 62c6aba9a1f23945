"""``tune``: measure every applicable trick on the user's model and hardware, then recommend.

The plan, inside ``budget_s``:

1. build the plain fp32 baseline (a model that cannot run the input stops here, with
   one line); time one step to size the rest of the plan;
2. for each candidate trick (see :mod:`torch_tricks.tune.candidates`): drift against
   fp32 from the same seed, peak memory at the batch and at half of it, then all
   candidates' steps timed round-robin with the baseline *twice* (an A/A pair whose
   disagreement is the stated noise);
3. greedy combinations: the fastest trick that fits the memory limit, plus the next
   one while the pair is faster beyond the noise; if the plain step does not fit the
   memory limit, memory tricks and micro-batching (accumulation) until one fits;
4. the largest batch: all memory tricks that cut bytes per sample, together;
5. with ``data``, the loader; with ``deploy``, the inference chain.

A trick that fails is recorded with its reason and the tune goes on.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.tune.candidates import training_candidates
from torch_tricks.tune.measure import (
    Runner,
    build_runner,
    measure_memory,
    paired_ratio,
    relative_diff,
    time_interleaved,
)
from torch_tricks.tune.report import Result, TuneReport

__all__ = ["tune", "TUNED_KEYS", "DRIFT_TOLERANCE"]

# The config keys the tuner decides; tricks.toml states every one of them.
TUNED_KEYS = ("precision", "channels_last", "checkpointing", "compile", "fused_optimizer", "inplace",
              "memory_efficient_bn", "accumulate", "cudnn_benchmark", "ema", "deterministic")

# Past these a trick changes the numbers too much to recommend it for speed alone:
# relative gradient difference of the first step, relative loss difference after the drift steps.
# bf16 autocast alone shows 0.2-0.4 on the first gradients of a freshly initialised ResNet on
# random batches (cancellation in BatchNorm's backward) and a few % on the loss: these
# bounds catch broken numerics (overflow, a wrong accumulation), not ordinary rounding.
DRIFT_TOLERANCE = {"grad": 0.5, "loss": 0.1}
_COMPILE_RESERVE_S = 60.0  # seconds kept for torch.compile's first call on a small CPU


def tune(
    model_fn: Callable[[], nn.Module] | nn.Module,
    example_batch: tuple[Any, Any],
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer_fn: Callable[..., torch.optim.Optimizer] | None = None,
    *,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    device: str | torch.device = "cpu",
    budget_s: float = 120.0,
    memory_limit: int | None = None,
    data: str | None = None,
    deploy: bool = False,
    seed: int = 0,
    progress: bool = True,
    name: str = "",
) -> TuneReport:
    """Measure the training tricks on ``model_fn()`` with ``example_batch`` = ``(inputs, target)``.

    ``loss_fn(output, target)`` defaults to cross-entropy; ``optimizer_fn(params)`` to
    the ``optimizer`` by name with ``fit``'s no-decay groups. ``memory_limit`` in bytes
    (default: CUDA's total memory, or 80% of the RAM available now). Returns a
    :class:`TuneReport`; nothing is printed (the progress bar goes to stderr).
    """
    t_start = time.perf_counter()
    deadline = t_start + float(budget_s)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda asked for, but this torch sees no CUDA device: use --device cpu")
    if budget_s <= 0:
        raise UserError("--budget-seconds must be > 0")
    from torch_tricks.train.seed import seed_everything

    seed_everything(seed)
    model = model_fn() if not isinstance(model_fn, nn.Module) else copy.deepcopy(model_fn)
    inputs, target = example_batch
    inputs_t = inputs if isinstance(inputs, tuple) else (inputs,)
    batch = int(target.shape[0]) if isinstance(target, torch.Tensor) else len(target)
    limit, limit_source = _memory_limit(memory_limit, dev)
    base_cfg = {"optimizer": optimizer, "lr": lr, "fused_optimizer": False, "device": str(dev), "seed": seed,
                "batch_size": batch}
    batches = [_move(example_batch, dev)]
    kw = {"loss_fn": loss_fn, "optimizer_fn": optimizer_fn}

    cands, skipped = training_candidates(model, inputs_t, dev, batch=batch, own_optimizer=optimizer_fn is not None)
    report = TuneReport(model=name or type(model).__name__, batch=batch, device=str(dev), optimizer=optimizer,
                        memory_limit=limit, memory_limit_source=limit_source, budget_s=float(budget_s),
                        skipped=skipped, drift_tolerance=dict(DRIFT_TOLERANCE),
                        inputs=[list(t.shape[1:]) for t in inputs_t if isinstance(t, torch.Tensor)])
    from tqdm.auto import tqdm

    bar = tqdm(total=len(cands) + 5, desc="tune", unit="step", disable=not progress, leave=False)
    try:
        # 1. the baseline, and its A/A twin; a model that cannot run the input stops here
        bar.set_postfix_str("baseline")
        try:
            base = build_runner("plain", model, base_cfg, batches, **kw)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"{report.model} cannot run a training step on the given input: {_line(exc)}") from None
        base_twin = build_runner("plain (again)", model, base_cfg, batches, **kw)
        base_res = Result("plain", "baseline", {}, (), status="measured", verdict="baseline")
        _memory_into(base_res, model, base_cfg, batches[0], limit, kw)
        base_res.first_call_s = base.first_call_s
        base_res.losses = base.losses
        report.baseline = base_res
        bar.update(1)
        step_s = _quick_step_time(base)

        # 2. every candidate alone (compile apart, at the end): drift and memory now, time together below
        compile_cand = next((c for c in cands if c.name == "compile"), None)
        runners: list[Runner] = [base, base_twin]
        results: list[Result] = []
        for c in cands:
            res = Result(c.name, c.goal, c.changes, c.ids, note=c.note)
            results.append(res)
            if c is compile_cand:
                continue
            bar.set_postfix_str(c.name)
            if deadline - time.perf_counter() < 12 * step_s * (len(runners) + 1):
                res.status, res.reason = "skipped", "over --budget-seconds before it could be measured: raise it"
                bar.update(1)
                continue
            try:
                cfg = {**base_cfg, **c.changes}
                r = build_runner(c.name, model, cfg, batches, **kw)
                _drift_into(res, r, base)
                _memory_into(res, model, cfg, batches[0], limit, kw)
                runners.append(r)
                res.runner = r
            except Exception as exc:
                res.status, res.reason = "failed", _line(exc)
            bar.update(1)

        # 3. all of them timed round-robin with the baseline twice (the A/A pair gives the noise)
        bar.set_postfix_str("timing")
        reserve = _COMPILE_RESERVE_S if compile_cand is not None else 0.0
        left = deadline - time.perf_counter() - reserve
        rounds = _rounds(runners, step_s, time.perf_counter() + 0.6 * max(left, 0.0))
        report.rounds = time_interleaved(runners, rounds, deadline=time.perf_counter() + 0.6 * max(left, 0.0))
        bar.update(1)
        aa_ratio, aa_spread = paired_ratio(base_twin.times, base.times)
        report.noise = max(abs(aa_ratio - 1.0), aa_spread, 0.02)
        base_res.step_s = _median(base.times)
        base_res.ratio = 1.0
        for res in results:
            if res.runner is not None and res.runner.times:
                res.step_s = _median(res.runner.times)
                res.ratio, res.ratio_spread = paired_ratio(res.runner.times, base.times)
                res.status = "measured"
                res.verdict = _verdict(res, report.noise, limit)
            elif res.status == "pending" and res.name != "compile":
                res.status, res.reason = "skipped", "over --budget-seconds before it could be timed"
        report.results = results

        # 4. combinations for throughput (under the memory limit), and for the largest batch
        bar.set_postfix_str("combinations")
        _best_throughput(report, model, base_cfg, batches, base, kw, deadline - reserve, limit)
        bar.update(1)
        _largest_batch(report, model, base_cfg, batches, kw, limit, deadline - reserve)
        bar.update(1)
        for res in results:
            res.runner = None
        del runners

        # 5. compile, on top of the best configuration so far: one compilation, timed against both
        if compile_cand is not None:
            bar.set_postfix_str("compile")
            _try_compile(report, compile_cand, model, base_cfg, batches, base, kw, deadline, limit)
            bar.update(1)

        # 6. data and deploy
        if data:
            bar.set_postfix_str("data")
            report.data = _measure_data(data, report, deadline)
        if deploy:
            bar.set_postfix_str("deploy")
            report.deploy = _measure_deploy(model, inputs_t, deadline)
    finally:
        bar.close()
    report.elapsed_s = time.perf_counter() - t_start
    return report


# -- combinations ------------------------------------------------------------------------------

def _best_throughput(report: TuneReport, model, base_cfg, batches, base: Runner, kw, deadline, limit) -> None:
    report.best_throughput = report.baseline
    """Greedy: the fastest fitting trick, plus the next fastest while the pair beats it beyond the noise."""
    fits = lambda r: r.peak_bytes is None or r.peak_bytes <= limit  # noqa: E731
    good = [r for r in report.results if r.verdict == "faster" and r.goal == "speed" and fits(r)]
    good.sort(key=lambda r: r.ratio)
    plain_fits = report.baseline.peak_bytes is None or report.baseline.peak_bytes <= limit
    if not plain_fits:
        report.notes.append(
            f"the plain step needs {_gib(report.baseline.peak_bytes)} at batch {report.batch}, over the memory "
            f"limit {_gib(limit)}: looking for a configuration that fits")
        fitting = _make_it_fit(report, model, base_cfg, batches, base, kw, deadline, limit)
        if fitting is None:
            report.notes.append("no configuration tried fits under the memory limit: lower --batch or raise the limit")
            report.best_throughput = report.baseline
            return
        current = fitting
        good = [r for r in good if not (set(r.changes) & set(current.changes))]
    else:
        current = good[0] if good else report.baseline
        good = good[1:]
    for nxt in good:
        if time.perf_counter() > deadline - 5:
            report.notes.append(f"combination with {nxt.name} not tried: over --budget-seconds")
            break
        combo = _measure_combo(current, nxt, model, base_cfg, batches, base, kw, deadline, limit, report)
        if combo is None:
            continue
        report.combos.append(combo)
        if combo.status == "measured" and fits(combo) and combo.ratio < current.ratio - report.noise:
            current = combo
    report.best_throughput = current


def _make_it_fit(report, model, base_cfg, batches, base, kw, deadline, limit) -> Result | None:
    """The fastest measured way under ``limit``: memory tricks alone, together, then with micro-batches."""
    singles = [r for r in report.results if r.status == "measured" and r.peak_bytes is not None]
    fit = [r for r in singles if r.peak_bytes <= limit]
    if fit:
        best = min(fit, key=lambda r: r.ratio)
        report.notes.append(f"fits with {best.name}: peak {_gib(best.peak_bytes)}")
        return best
    mem = [r for r in singles if r.goal == "memory" and r.name != "gradient_accumulation"
           and r.peak_bytes < report.baseline.peak_bytes * 0.98 and _drift_ok(r)]
    changes: dict[str, Any] = {}
    names: list[str] = []
    for r in sorted(mem, key=lambda r: r.peak_bytes):
        changes.update(r.changes)
        names.append(r.name)
    tries = [(names, changes)] if names else []
    k = 2
    while k <= report.batch:
        tries.append((names + [f"accumulate={k}"], {**changes, "accumulate": k}))
        k *= 2
    for tnames, tchanges in tries:
        if time.perf_counter() > deadline:
            break
        cfg = {**base_cfg, **tchanges}
        res = Result("+".join(tnames), "memory", tchanges, ())
        try:
            _memory_into(res, model, cfg, batches[0], limit, kw)
        except Exception as exc:
            report.notes.append(f"{res.name} failed: {_line(exc)}")
            continue
        peak = res.peak_bytes
        if peak > limit:
            report.notes.append(f"{res.name}: peak {_gib(peak)}, still over the limit")
            continue
        _time_against_base(res, model, cfg, batches, base, kw, deadline, report)
        report.combos.append(res)
        report.notes.append(f"fits with {res.name}: peak {_gib(peak)} (limit {_gib(limit)})")
        return res
    return None


def _measure_combo(a: Result, b: Result, model, base_cfg, batches, base, kw, deadline, limit, report) -> Result | None:
    if set(a.changes) & set(b.changes):
        return None
    changes = {**a.changes, **b.changes}
    name = "+".join(sorted(set(a.name.split("+")) | set(b.name.split("+"))))
    res = Result(name, "speed", changes, tuple(sorted(set(a.ids) | set(b.ids))))
    cfg = {**base_cfg, **changes}
    try:
        _memory_into(res, model, cfg, batches[0], limit, kw)
        _time_against_base(res, model, cfg, batches, base, kw, deadline, report)
    except Exception as exc:
        res.status, res.reason = "failed", _line(exc)
    return res


def _time_against_base(res: Result, model, cfg, batches, base: Runner, kw, deadline, report: TuneReport) -> None:
    r = build_runner(res.name, model, cfg, batches, **kw)
    _drift_into(res, r, base)
    base.times.clear()
    step_s = _median(r.times) if r.times else report.baseline.step_s or 0.1
    until = min(deadline, time.perf_counter() + max(15.0, 20 * step_s))
    time_interleaved([base, r], _rounds([base, r], step_s, until), deadline=until)
    res.step_s = _median(r.times)
    res.ratio, res.ratio_spread = paired_ratio(r.times, base.times)
    res.status = "measured"
    res.verdict = _verdict(res, report.noise, report.memory_limit)


def _largest_batch(report: TuneReport, model, base_cfg, batches, kw, limit, deadline) -> None:
    """All memory tricks that cut bytes per sample (drift within tolerance), together."""
    base = report.baseline
    if base.bytes_per_sample is None:
        return
    mem = [r for r in report.results if r.status == "measured" and r.bytes_per_sample is not None
           and r.bytes_per_sample < base.bytes_per_sample * 0.95 and _drift_ok(r) and r.name != "gradient_accumulation"]
    best = max([base] + mem, key=lambda r: r.max_batch or 0)
    if len(mem) >= 2 and time.perf_counter() < deadline:
        changes: dict[str, Any] = {}
        for r in mem:
            changes.update(r.changes)
        combo = Result("+".join(sorted(r.name for r in mem)), "memory", changes,
                       tuple(sorted({i for r in mem for i in r.ids})))
        cfg = {**base_cfg, **changes}
        try:
            _memory_into(combo, model, cfg, batches[0], limit, kw)
            combo.status = "measured (memory)"
            report.combos.append(combo)
            if (combo.max_batch or 0) > (best.max_batch or 0):
                best = combo
        except Exception as exc:
            report.notes.append(f"memory combination {combo.name} failed: {_line(exc)}")
    report.best_batch = best


# -- helpers -----------------------------------------------------------------------------------

def _verdict(res: Result, noise: float, limit: int) -> str:
    if res.status != "measured":
        return res.status
    if res.peak_bytes is not None and res.peak_bytes > limit:
        return "over the memory limit"
    if not _drift_ok(res):
        return "drifts"
    margin = max(2 * noise, res.ratio_spread or 0.0)
    if res.ratio < 1 - margin:
        return "faster"
    if res.ratio > 1 + margin:
        return "slower"
    return "no measurable change"


def _drift_ok(res: Result) -> bool:
    g = res.grad_drift if res.grad_drift is not None else 0.0
    l = res.loss_drift if res.loss_drift is not None else 0.0
    return g <= DRIFT_TOLERANCE["grad"] and l <= DRIFT_TOLERANCE["loss"]


def _loss_drift(losses: list[float], base: list[float]) -> float | None:
    if not losses or len(losses) != len(base):
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, base))


def _memory_into(res: Result, model, cfg, batch, limit: int, kw) -> None:
    """Peak memory, bytes per sample and the largest batch under ``limit`` (straight-line estimate)."""
    m = measure_memory(model, cfg, batch, **kw)
    res.peak_bytes = m.peak_bytes
    res.bytes_per_sample = m.bytes_per_sample
    if m.bytes_per_sample and cfg.get("accumulate", 1) == 1:
        n = _batch_len(batch)
        fixed = m.fb_peak_bytes - m.bytes_per_sample * n
        res.max_batch = max(int((limit - fixed) // m.bytes_per_sample), 0)


def _drift_into(res: Result, r: Runner, base: Runner) -> None:
    res.first_call_s = r.first_call_s
    res.losses = r.losses
    res.grad_drift = relative_diff(r.grads, base.grads)
    res.loss_drift = _loss_drift(r.losses, base.losses)
    r.grads = None if r is not base else r.grads


def _try_compile(report: TuneReport, cand, model, base_cfg, batches, base: Runner, kw, deadline, limit) -> None:
    """``compile`` on top of the best configuration so far (one compilation), timed against plain."""
    res = next(r for r in report.results if r.name == "compile")
    left = deadline - time.perf_counter()
    if left < _COMPILE_RESERVE_S:
        res.status, res.reason = "skipped", (f"compiling takes tens of seconds here and only {max(left, 0):.0f} s of "
                                             "--budget-seconds are left: raise it to measure compile")
        res.verdict = "skipped"
        return
    best = report.best_throughput or report.baseline
    on_best = best is not report.baseline
    target = res if not on_best else Result(f"{best.name}+compile", "speed", {**best.changes, **cand.changes},
                                            tuple(sorted(set(best.ids) | set(cand.ids))))
    target.changes = {**(best.changes if on_best else {}), **cand.changes}
    try:
        _time_against_base(target, model, {**base_cfg, **target.changes}, batches, base, kw, deadline, report)
        target.peak_bytes = best.peak_bytes  # eager figure: inductor plans memory its own way
        target.note = (f"first call {target.first_call_s:.0f} s (compilation), not in the step time; "
                       "peak memory: the eager figure")
    except Exception as exc:
        target.status, target.reason, target.verdict = "failed", _line(exc), "failed"
        if on_best:
            res.status, res.reason, res.verdict = "failed", target.reason, "failed"
        return
    if on_best:
        report.combos.append(target)
        res.status, res.reason, res.verdict = "measured (with the best)", f"see {target.name}", target.verdict
        if target.status == "measured" and target.ratio < best.ratio - report.noise:
            report.best_throughput = target
    elif target.verdict == "faster":
        report.best_throughput = target


def _memory_limit(limit: int | None, dev: torch.device) -> tuple[int, str]:
    if limit is not None:
        if limit <= 0:
            raise UserError("--memory-limit must be > 0, e.g. 8GiB")
        return int(limit), "given"
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory), "the GPU's total memory"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * 0.8), "80% of the RAM available at start"
    except OSError:
        pass
    return 8 << 30, "a default of 8 GiB (available RAM unknown)"


def _rounds(runners: list[Runner], step_s: float, until: float) -> int:
    left = max(until - time.perf_counter(), 0.0)
    per_round = sum(_median(r.times) if r.times else step_s for r in runners) or step_s * len(runners)
    return int(min(max(left / max(per_round, 1e-6), 3), 40))


def _quick_step_time(r: Runner) -> float:
    t0 = time.perf_counter()
    r()
    synchronize_all(r)
    return max(time.perf_counter() - t0, 1e-4)


def synchronize_all(r: Runner) -> None:
    from torch_tricks.inspect.timing import synchronize

    synchronize(r.step.device)


def _median(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs) if xs else math.nan


def _batch_len(batch: Any) -> int:
    y = batch[1]
    return int(y.shape[0]) if isinstance(y, torch.Tensor) else len(y)


def _slice(batch: Any, n: int) -> Any:
    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t[:n]
        if isinstance(t, (tuple, list)):
            return type(t)(cut(u) for u in t)
        return t
    return cut(batch)


def _move(batch: Any, dev: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dev)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_move(b, dev) for b in batch)
    return batch


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _gib(n: float | None) -> str:
    from torch_tricks._format import human_bytes

    return human_bytes(n) if n is not None else "n/a"


def _measure_data(path: str, report: TuneReport, deadline: float) -> dict[str, Any]:
    """Loader throughput at the tuned batch vs the recommended step's samples/s: data-bound or not."""
    from torch_tricks.data.loader_tune import tune_loader_path

    left = deadline - time.perf_counter()
    seconds = min(max(left / 8, 0.5), 3.0)
    lt = tune_loader_path(path, batch_sizes=(report.batch,), seconds_per_trial=seconds, progress=False,
                          cold_read=False)
    best = report.best_throughput or report.baseline
    step_rate = report.batch / best.step_s if best and best.step_s else None
    load_rate = lt.best.samples_per_s if lt.best else None
    out: dict[str, Any] = {"path": path, "loader_samples_per_s": load_rate, "step_samples_per_s": step_rate,
                           "loader": lt.loader_kwargs(), "verdict": lt.verdict, "advice": lt.advice}
    if load_rate and step_rate:
        out["data_bound"] = load_rate < step_rate
        out["summary"] = (f"the loader delivers {load_rate:,.0f} samples/s, the step consumes {step_rate:,.0f}: "
                          + ("data-bound: the step waits for data" if load_rate < step_rate
                             else "not data-bound"))
    return out


def _measure_deploy(model: nn.Module, inputs: tuple[Any, ...], deadline: float) -> dict[str, Any]:
    """The inference chain (fuse, int8 ...) on an eval copy, each step against eager fp32."""
    try:
        from torch_tricks.deploy.pipeline import optimize
    except ImportError as exc:
        return {"error": f"deploy measurement unavailable: {exc}"}
    out: dict[str, Any] = {"steps": []}
    example = tuple(t[:1] if isinstance(t, torch.Tensor) else t for t in inputs)
    for steps in (["fuse"], ["int8"], ["int8-dynamic"], ["bf16"]):
        if time.perf_counter() > deadline:
            out["steps"].append({"steps": steps, "status": "skipped", "reason": "over --budget-seconds"})
            continue
        try:
            res = optimize(copy.deepcopy(model).eval(), steps, example, measure=True)
            out["steps"].append({"steps": steps, "status": "measured", **res.as_dict()})
        except Exception as exc:
            out["steps"].append({"steps": steps, "status": "not applicable", "reason": _line(exc)})
    return out
