"""The tune's measurements of a configuration outside the races: the plain step and its A/A twin, each
candidate's probe, build, drift against fp32 and memory, and a combination's build before its race.

:class:`Builds` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`); every memory run
of the tune goes through :meth:`Builds._memory_run`.
"""

from __future__ import annotations

import math
import time
from typing import Any

from torch_tricks.device import synchronize
from torch_tricks.errors import UserError, one_line
from torch_tricks.tuning.candidates import Candidate
from torch_tricks.tuning.measure import (
    Memory,
    Runner,
    StepAt,
    TooSlow,
    build_runner,
    measure_memory,
    probe_seconds,
    relative_diff,
)
from torch_tricks.tuning.racing import _MIN_ROUNDS, _median
from torch_tricks.tuning.result import Result

# A candidate whose probe step (an eighth of the batch) takes this many times the plain one is
# reported slower from the probe and not measured further (emulated fp16 on a CPU: ~100x).
SLOW_FACTOR = 10.0


# The step's scaling with threads at the start: alternated plain steps at each count, and how much faster one
# thread must be to become every lane's count.
_THREAD_PROBES = 3
_THREADS_WIN = 0.9


def _timed_at(base: Runner, threads: int) -> float:
    """One plain step's seconds at ``threads`` intra-op threads (the runner sets them around the call)."""
    cfg = base.step.config
    base.step.config = cfg.replace(threads=threads)
    try:
        t = time.perf_counter()
        base()
        synchronize(base.step.device)
        return time.perf_counter() - t
    finally:
        base.step.config = cfg


class Builds:
    """The baselines (``base``, ``twin``; ``step_s``, ``build_s``, ``setup_s``, ``memory_s``: what one step, one
    build, one set-up (a build and a memory run) and one memory run take), each candidate's set-up, and the
    memory runs."""

    def _baselines(self, cands: list[Candidate]) -> bool:
        """1. the plain step and its A/A twin, with the plain step's memory; False when the budget cannot
        hold even one trick's measurement (the report then says so, see :meth:`_too_slow_for_the_budget`)."""
        report = self.report
        self.phase("baseline")
        t_base = time.perf_counter()
        base = self._build_plain()
        build_s = time.perf_counter() - t_base  # one build: what the others will cost (not the threads' probe)
        self.base = base
        self._pick_threads(base, cands)
        base_res = Result("plain", "baseline", {}, (), status="measured", verdict="baseline")
        base_res.first_call_s, base_res.losses = base.first_call_s, base.losses
        if self._too_slow_for_the_budget(base, build_s, base_res, cands):
            return False
        # what one candidate's drift + memory costs, roughly: timed after the first build, which
        # pays one-off costs (imports, kernel caches) that later builds do not
        t0 = time.perf_counter()
        twin = build_runner("plain (A/A)", self.model, self.base_cfg, self.batches, **self.kw)
        report.aa_grad_drift = relative_diff(twin.grads, base.grads)  # run-to-run differences of plain itself
        report.aa_loss_drift = _loss_drift(twin.losses, base.losses)
        twin.grads = None
        t_mem = time.perf_counter()
        self.build_s = t_mem - t0  # one build with its drift steps: what a combination's costs
        self._memory_into(base_res, self.base_cfg)
        self.memory_s = time.perf_counter() - t_mem  # one memory run: a copy's build and its steps
        self.setup_s = time.perf_counter() - t0
        report.baseline = base_res
        self.base, self.twin = base, twin
        self.step_s = max(_median(base.step_times) if base.step_times else 0.0, 1e-4)
        self.bar.update(1)
        return True

    def _pick_threads(self, base: Runner, cands: list[Candidate]) -> None:
        """The step's scaling with threads, before anything else is timed: on a CPU where the caller did not fix
        the threads (a ``threads:1`` candidate stands for that), a few plain steps at one thread and at the
        process's count, alternated. The faster count becomes every lane's (a busy machine, or a step too small
        to split, can make two threads several times slower than one); the other is raced as the candidate."""
        i = next((i for i, c in enumerate(cands) if c.name == "threads:1"), None)
        n = int(self.base_cfg.get("threads") or 0)
        if i is None or n <= 1:
            return
        times: dict[int, list[float]] = {1: [], n: []}
        for _ in range(_THREAD_PROBES):
            for k in (n, 1):
                times[k].append(_timed_at(base, k))
        self.thread_times = times
        one, many = _median(times[1]), _median(times[n])
        self.report.threads = {**(self.report.threads or {}), "probe_s": {"1": one, str(n): many}}
        if one >= _THREADS_WIN * many:
            return
        self.base_cfg["threads"] = 1
        base.step.config = base.step.config.replace(threads=1)
        base.step_times = times[1]
        c = cands[i]
        cands[i] = Candidate(f"threads:{n}", {"threads": n}, "speed", tricks=c.tricks,
                             note=f"{n} intra-op threads instead of 1 (one was faster when the tune began: "
                                  f"{one * 1e3:.0f} ms against {many * 1e3:.0f} ms a plain step)")
        self.report.threads.update(threads=1, chosen_at_start=True)

    def _build_plain(self) -> Runner:
        """The plain fp32 step's runner; a UserError where the model cannot train on the input, or its loss
        is not finite."""
        model = self.report.model
        try:
            base = build_runner("plain", self.model, self.base_cfg, self.batches, **self.kw)
        except UserError:
            raise
        except Exception as exc:
            raise UserError(f"{model} cannot run a training step on the given input: {one_line(exc, with_type=True)}") from None
        if not all(math.isfinite(x) for x in base.losses):
            raise UserError(f"{model}: the plain fp32 loss is not finite on the given batch ({base.losses})")
        return base

    def _set_up_candidates(self, others: list[Candidate]) -> list[Result]:
        """2. each candidate alone: drift and memory now (time together, in the race), within half the time left."""
        results: list[Result] = []
        setup_end = time.perf_counter() + 0.5 * self.left(self.train_end - self.compile_reserve)
        built = 0
        for c in others:
            res = Result(c.name, c.goal, c.changes, c.ids, note=c.note)
            results.append(res)
            self.phase(c.name)
            self._set_up_in_turn(res, c, setup_end, built)
            built += res.runner is not None
            self.bar.update(1)
        return results

    def _set_up_in_turn(self, res: Result, c: Candidate, setup_end: float, built: int) -> None:
        """One candidate's set-up, after ``built`` others: not measured further when its probe was far slower,
        skipped when the time left would not hold it, failed (with the reason) when it raises."""
        if _probed_slow(c):
            res.probe_ratio = c.probe_ratio
            res.status, res.verdict = "measured (probe)", "slower"
            res.reason = f"{c.probe_what} took {c.probe_ratio:.2g}x fp32 here: not measured further"
            return
        if set(c.changes) == {"threads"}:
            self._threads_lane(res, c)
            return
        # room for its set-up and for the least timing of all built so far (5 rounds and a warm-up)
        timing_need = (_MIN_ROUNDS + 1) * (built + 3) * self.step_s
        # set-up gets half the time left, but the first trick (the most promising: speed first) may take
        # more: a race of the two baselines alone answers nothing (a 0.76 s GPT-2 step: 35 s per set-up)
        end = min(setup_end if built else math.inf, self.train_end - self.compile_reserve - timing_need)
        if time.perf_counter() + self._setup_need(c) > end:
            res.status, res.verdict = "skipped", "skipped"
            res.reason = "over --budget-seconds before it could be measured: raise it"
            return
        try:
            self._setup_candidate(res, c, end)
        except Exception as exc:
            res.status, res.verdict, res.reason = "failed", "failed", one_line(exc, with_type=True)

    def _threads_lane(self, res: Result, c: Candidate) -> None:
        """A thread count's lane: the plain runner's own model and optimizer stepped at ``threads`` intra-op
        threads, no copy built. The count changes neither what is computed nor what is stored, only how it is
        split; a copy would cost a build (a 1.5 s GPT-2 step: 9 s of a 120 s tune) to measure a drift of
        summation order. Its memory is the plain step's (said in its row), its first steps those of the probe
        at the start."""
        n = int(c.changes["threads"])
        r = Runner(c.name, StepAt(self.base.step, n), self.batches, first_call_s=self.base.first_call_s)
        r.step_times = list(getattr(self, "thread_times", {}).get(n, []))
        res.first_call_s, res.losses = r.first_call_s, list(self.base.losses)
        base = self.report.baseline
        res.peak_bytes, res.state_bytes, res.activation_bytes = base.peak_bytes, base.state_bytes, base.activation_bytes
        res.bytes_per_sample, res.max_batch_guess = base.bytes_per_sample, base.max_batch_guess
        res.note = _join(res.note, "timed on the plain step's own model at this thread count (no copy: the count "
                                   "changes how the work is split, not what is computed or stored); memory: the "
                                   "plain step's")
        res.status, res.runner = "measured", r

    def _setup_need(self, c: Candidate) -> float:
        """Seconds ``c``'s set-up takes, about: a build, and its memory run unless that waits; nothing more for
        one a probe already called far slower."""
        if _probed_slow(c) or set(c.changes) == {"threads"}:
            return 0.0
        return self.build_s if self.memory_later and c.goal == "speed" else self.setup_s

    def _setup_candidate(self, res: Result, c: Candidate, setup_end: float, retry: bool = True) -> None:
        """Drift and memory of one candidate, unless its probe step says it is far too slow (or too slow for the budget)."""
        cfg = {**self.base_cfg, **c.changes}
        base_probe = self.base.probe_s
        by_speed = SLOW_FACTOR * base_probe
        # the baseline's set-up took setup_s; a candidate takes about that times its probe ratio
        by_budget = base_probe * max(setup_end - time.perf_counter(), 0.0) / max(self.setup_s, 1e-6)
        try:
            r = build_runner(c.name, self.model, cfg, self.batches, probe_limit_s=max(min(by_speed, by_budget), 1e-3),
                             first_limit_s=SLOW_FACTOR * self.base.first_call_s, **self.kw)
        except TooSlow as exc:
            base_now, what = self._plain_now(exc.what)
            ratio = exc.seconds / base_now
            took = f"{what} took {exc.seconds:.2g} s"
            if ratio >= SLOW_FACTOR:
                res.probe_ratio = ratio
                res.status, res.verdict = "measured (probe)", "slower"
                res.reason = f"{took}, {ratio:.0f}x the plain one: not measured further"
            elif (exc.what == "probe" and exc.limit_s < by_speed) or not retry:
                res.status, res.verdict = "skipped", "skipped"
                res.reason = f"over --budget-seconds: {took}, too long to set it up in the time left; raise it"
            else:  # the machine was busy during the first probe
                self._setup_candidate(res, c, setup_end, retry=False)
            return
        _drift_into(res, r, self.base)
        if self.memory_later and c.goal == "speed":
            res.status = "measured"  # its memory run after the speed question (tuning.contenders)
        else:
            self._memory_into(res, cfg)
        res.runner = r

    def _plain_now(self, what: str) -> tuple[float, str]:
        """The plain step's seconds for what a candidate was too slow at (``what``: its "probe" or its "first"
        step), taken again now, under the same load of the machine; and what that step was, in words."""
        batch = self.report.batch
        if what == "probe":
            return (min(self.base.probe_s, probe_seconds(self.base.step, self.batches[0], repeats=2)),
                    f"a probe step on {max(batch // 8, min(batch, 2))} samples")
        return (min(self.base.first_call_s, probe_seconds(self.base.step, self.batches[0], fraction=1)),
                f"its first step on the batch of {batch}")

    def _measure_combo(self, a: Result, b: Result, end: float, share: float = 0.5) -> Result:
        changes = {**a.changes, **b.changes}
        name = "+".join(sorted(set(a.name.split("+")) | set(b.name.split("+"))))
        res = Result(name, "speed", changes, tuple(sorted(set(a.ids) | set(b.ids))))
        cfg = {**self.base_cfg, **changes}
        try:
            r = build_runner(name, self.model, cfg, self.batches, **self.kw)
            _drift_into(res, r, self.base)
            self._memory_into(res, cfg)
            res.runner = r
            self._race_side_by_side(res, a if a is not self.report.baseline else None, end, share=share)
        except Exception as exc:
            res.status, res.verdict, res.reason = "failed", "failed", one_line(exc, with_type=True)
            res.runner = None
        return res

    def _memory_into(self, res: Result, cfg: dict[str, Any]) -> None:
        """Peak, state and activation memory, and where the search for the largest batch under the limit starts."""
        m = self._memory_run(cfg, self.batches[0])
        res.peak_bytes, res.state_bytes, res.activation_bytes = m.peak_bytes, m.state_bytes, m.activation_bytes
        res.bytes_per_sample = m.bytes_per_sample
        if m.bytes_per_sample and int(cfg.get("accumulate", 1)) == 1:
            res.max_batch_guess = max(m.micro_batch + int((self.limit - m.peak_bytes) // m.bytes_per_sample), 0)
        if res.status == "pending":
            res.status = "measured"

    def _memory_run(self, cfg: dict[str, Any], batch: Any, **kw: Any) -> Memory:
        """One memory run of ``cfg`` on ``batch``: a fresh copy's build and its steps, the peak measured."""
        return measure_memory(self.model, cfg, batch, **kw, **self.kw)


def _probed_slow(c: Candidate) -> bool:
    """Its probe (an autocast layer on a CPU) was slower than its limit: reported slower, not built."""
    return c.probe_ratio is not None and c.probe_ratio >= (c.probe_limit or SLOW_FACTOR)


def _join(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


def _drift_into(res: Result, r: Runner, base: Runner) -> None:
    res.first_call_s = r.first_call_s
    res.losses = r.losses
    res.grad_drift = relative_diff(r.grads, base.grads)
    res.loss_drift = _loss_drift(r.losses, base.losses)
    if r is not base:
        r.grads = None


def _loss_drift(losses: list[float], base: list[float]) -> float | None:
    """Largest |loss - fp32 loss| over the drift steps, relative to the first fp32 loss (inf if not finite)."""
    if not losses or len(losses) != len(base):
        return None
    if not all(math.isfinite(x) for x in losses):
        return math.inf
    return max(abs(a - b) for a, b in zip(losses, base)) / max(abs(base[0]), 1e-12)

