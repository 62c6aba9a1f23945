"""``compile`` in the tune: planned only if the budget holds it after the other tricks (else tried at the end
if the races settled early), measured on top of the best configuration (one compilation) and raced against
it, and recommended only if it beats it beyond the margin and its compilation pays back within the run.

:class:`Compiling` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn as nn

from torch_tricks._io import atomic_path
from torch_tricks.inspect.peak import cache_path, machine_key

from torch_tricks.errors import one_line
from torch_tricks.tuning.builds import _drift_into, _probed_slow
from torch_tricks.tuning.candidates import Candidate
from torch_tricks.tuning.measure import build_runner
from torch_tricks.tuning.racing import _MIN_ROUNDS
from torch_tricks.tuning.result import Result


class Compiling:
    """compile's plan (``compile_planned``, ``compile_reserve``, ``compile_est``, ``compile_need``), its row, what
    it was measured as and on top of (``compile_row``, ``compile_target``, ``compile_base``), and its decision."""

    def _plan_compile(self, cands: list[Candidate]) -> tuple[list[Result], list[Candidate]]:
        """(compile's rows: its default mode's first, then its other modes'; the other candidates, speed first):
        compile is planned, with the time it needs kept back, only if the budget holds it after the others; else
        it is tried at the end if the races settle early (:meth:`_compile_phase`). Its other modes (T35) are
        not planned: each is tried after the default mode while the time left holds it."""
        compile_cand = next((c for c in cands if c.changes.get("compile") is True), None)
        modes = [c for c in cands if isinstance(c.changes.get("compile"), str)]
        order = {"speed": 0, "memory": 1, "cost": 2}  # what a short budget leaves out last
        others = sorted((c for c in cands if not c.changes.get("compile")), key=lambda c: order.get(c.goal, 3))
        self.compile_reserve = 0.0
        self.compile_planned = False
        self.compile_modes = []
        if compile_cand is None:
            return [], others
        compile_res = Result(compile_cand.name, compile_cand.goal, compile_cand.changes, compile_cand.ids,
                             note=compile_cand.note)
        mode_rows = [Result(c.name, c.goal, c.changes, c.ids, note=c.note) for c in modes]
        est = self.compile_est = _compile_estimate(self.model, self.step_s, self._foreign_share())
        self.compile_need = est + self._race_need(3, _MIN_ROUNDS + 1)  # its compilation, then a short race
        # the speed tricks before it: their set-up and the least race (compile is a speed trick: it comes before
        # more rounds of a race, a combination's race and the memory tricks; a 1-s step's combination race alone
        # would have kept compile out of a 240 s tune of a 4 x 256 GPT-2, where it was the largest gain, 1.24x)
        first = self._contenders_first(others)[0]
        n = sum(1 for c in first if not _probed_slow(c))  # a trick its probe called slower gets no lane
        need_rest = sum(self._setup_need(c) for c in first) * 1.3 + self._race_need(n + 2, _MIN_ROUNDS)
        if self.left() < self.compile_need + need_rest:
            # not planned: tried at the end only if the races settle early and leave the time for it
            self.compile_skip_reason = (
                f"over --budget-seconds: compiling takes about {est:.0f} s here ({self._estimate_source()}) and its "
                f"race {self.compile_need - est:.0f} s, the other speed tricks' least measurement about "
                f"{need_rest:.0f} s, of the {max(self.left(), 0):.0f} s left: raise it to about "
                f"{math.ceil(self.report.budget_s + self.compile_need + need_rest - self.left()):.0f} to measure it")
        else:
            self.compile_planned = True
            self.compile_reserve = self.compile_need
        return [compile_res, *mode_rows], others

    def _compile_phase(self, rows: list[Result]) -> None:
        """6. compile, on top of the best configuration so far, if the time left holds it (else skipped, why);
        then its other modes, each while the time left holds it."""
        compile_res = rows[0]
        t_compile = time.perf_counter()
        budget_left = self.left()
        # again, with the machine's load as measured so far: a compilation cannot be cut short once started
        self.compile_est = max(self.compile_est, _compile_estimate(self.model, self.step_s, self._foreign_share()))
        if self.compile_planned:
            room = budget_left >= self.compile_est + self._race_need(3, _MIN_ROUNDS)
        else:  # not planned: it may fit now, with the time the races saved by settling early
            room = budget_left >= self.compile_need
        if room:
            self.phase("compile")
            self._try_compile(compile_res)
            self._try_modes(rows[1:])
        elif self.compile_planned:
            compile_res.status, compile_res.verdict = "skipped", "skipped"
            compile_res.reason = (f"over --budget-seconds: compiling takes about {self.compile_est:.0f} s here "
                                  f"and only {max(budget_left, 0):.0f} s are left; raise it")
        else:
            compile_res.status, compile_res.verdict = "skipped", "skipped"
            compile_res.reason = self.compile_skip_reason
        for row in rows[1:]:
            if row.status == "pending":
                row.status, row.verdict = "skipped", "skipped"
                row.reason = f"measured beside compile's default mode, which was not measured ({compile_res.reason})"
        self.phase_s["compile"] = time.perf_counter() - t_compile
        self.compile_reserve = 0.0
        self.bar.update(1)

    def _estimate_source(self) -> str:
        """Where compile's estimate comes from, in words."""
        if _compile_key(self.model) in _read_compile_times():
            return "the first call an earlier tune measured here"
        return "a first estimate from the model's size"

    def _foreign_share(self) -> float:
        """Other processes' share of this process's cores so far in the tune (0 where not measured)."""
        load = self.monitor.load if self.monitor is not None else None
        if load is None or load.foreign_cores is None or not load.cores:
            return 0.0
        return min(load.foreign_cores / load.cores, 1.0)

    def _try_compile(self, res: Result) -> None:
        """``compile`` on top of the best configuration so far (one compilation), raced against it and plain."""
        report = self.report
        best = report.best_throughput or report.baseline
        on_best = best is not report.baseline
        target = res
        if on_best:
            target = Result(f"{best.name}+{res.name}", "speed", {**best.changes, **res.changes},
                            tuple(sorted(set(best.ids) | set(res.ids))))
        cfg = {**self.base_cfg, **target.changes}
        self.compile_target, self.compile_base, self.compile_row = target, best, res
        try:  # no probe: a second batch shape would make dynamo recompile with dynamic shapes
            r = build_runner(target.name, self.model, cfg, self.batches, probe=False, **self.kw)
            _drift_into(target, r, self.base)
            record_compile(self.model, r.first_call_s)
            target.runner = r
            # half of what is left; more rounds at the end are shared with the other open races
            self._race_side_by_side(target, best if on_best else None, self.train_end, share=0.5)
            target.note = (f"first call {target.first_call_s:.1f} s (compilation), not in the step time; "
                           "memory not measured under compile")
        except Exception as exc:
            target.status, target.verdict, target.reason = "failed", "failed", one_line(exc, with_type=True)
        if on_best:
            report.combos.append(target)
            res.status, res.verdict = target.status, target.verdict
            res.reason = f"measured on top of {best.name}: see {target.name}"
        self._compile_decide()

    def _try_modes(self, rows: list[Result]) -> None:
        """compile's other modes (T35), each compiled on top of what the default mode was and raced against the
        compiled default, while the time left holds its compilation (estimated at twice the default's first call:
        autotuning benchmarks kernels) and its race besides what the memory tricks need after it."""
        default = self.compile_target
        for row in rows:
            if default is None or default.status != "measured":
                why = default.reason if default is not None and default.reason else "it was not measured"
                row.status, row.verdict, row.reason = "skipped", "skipped", (
                    f"measured against compile's default mode, which was not measured: {why}")
                continue
            need = 2.0 * (default.first_call_s or self.compile_est) + self._race_need(3, _MIN_ROUNDS + 1)
            room = self.left() - self.memory_reserve - self.later_need
            if room < need:
                row.status, row.verdict, row.reason = "skipped", "skipped", (
                    f"over --budget-seconds: compiling it and its race take about {need:.0f} s here, "
                    f"{max(room, 0):.0f} s were left after compile's default mode: raise it to about "
                    f"{math.ceil(self.report.budget_s + need - room):.0f} to measure it")
                continue
            self.phase(row.name)
            self._try_mode(row, default)
        self._mode_decide()  # the default's own decision stands (taken again with it after more rounds)

    def _try_mode(self, row: Result, default: Result) -> None:
        """One compile mode on top of the configuration the default mode extended, raced against the default."""
        base = self.compile_base
        on_best = base is not self.report.baseline
        target = row
        if on_best:
            target = Result(f"{base.name}+{row.name}", "speed", {**base.changes, **row.changes},
                            tuple(sorted(set(base.ids) | set(row.ids))))
        try:
            r = build_runner(target.name, self.model, {**self.base_cfg, **target.changes}, self.batches, probe=False,
                             **self.kw)
            _drift_into(target, r, self.base)
            target.runner = r
            self._race_side_by_side(target, default, self.train_end, share=0.5)
            target.note = (f"first call {target.first_call_s:.1f} s (compilation), not in the step time; "
                           "memory not measured under compile")
        except Exception as exc:
            target.status, target.verdict, target.reason = "failed", "failed", one_line(exc, with_type=True)
        if on_best:
            self.report.combos.append(target)
            row.status, row.verdict = target.status, target.verdict
            row.reason = f"measured on top of {base.name}: see {target.name}"
        self.compile_modes.append((row, target))

    def _compile_decide(self) -> None:
        """Recommend the compiled configuration if it beats the one it was compiled on top of beyond the margin."""
        report = self.report
        target, base = self.compile_target, self.compile_base
        if target is None or target.status != "measured":
            return
        best = report.best_throughput or report.baseline
        row = self.compile_row
        if row is not target:  # the compile row points at the +compile one
            row.status, row.verdict = target.status, target.verdict
        if best is not base:
            self.choice_notes.append(f"compile was measured on top of {base.name}; after more rounds the "
                                     f"recommendation is {best.name}, on top of which it was not measured: not "
                                     "recommended")
            return
        if self._compile_wins(target):
            best.chosen = False
            target.chosen = True
            report.best_throughput = target
        self._mode_decide()

    def _mode_decide(self) -> None:
        """A compile mode replaces the default mode where the default is recommended and the mode is faster than
        it beyond the margin, with its longer first call paid back within the run (the fastest such mode)."""
        default = self.compile_target
        winners = []
        for row, target in self.compile_modes:
            if target.status != "measured":
                continue
            if row is not target:
                row.status, row.verdict = target.status, target.verdict
            beyond = self._margin(target.vs_current_half_ci)
            if not (target.vs_current is not None and target.vs_current < 1 - beyond and self._faster(target)):
                continue
            if not default.chosen:
                self.choice_notes.append(f"{target.name} is faster than {default.name}, which is not recommended: "
                                         "not recommended either")
            elif self.report.amortised(target) is not False:
                winners.append(target)
        if winners:
            fastest = min(winners, key=lambda t: t.vs_current)
            default.chosen = False
            fastest.chosen = True
            self.report.best_throughput = fastest

    def _compile_wins(self, target: Result) -> bool:
        """The compiled configuration is faster than what it extends beyond the margin, the plain step fits
        the memory limit, and its compilation pays back within the run."""
        beyond = self._margin(target.vs_current_half_ci)
        if not (target.vs_current is not None and target.vs_current < 1 - beyond and self._faster(target)):
            return False
        if not self._fits(self.report.baseline):  # its memory is not measured: no bet under a tight limit
            self.choice_notes.append(f"{target.name} is faster, but its memory is not measured under compile and "
                                     "the limit is tight: not recommended")
            return False
        # its first call must be paid back within the run (its row says so, with the break-even step count)
        return self.report.amortised(target) is not False


def _compile_estimate(model: nn.Module, step_s: float, foreign_share: float = 0.0) -> float:
    """Seconds a first ``torch.compile`` of forward + backward takes here: the last first call an earlier tune
    of the same model measured on this machine (:func:`record_compile`), or the longest where inductor's cache on
    disk is empty (a cold cache is what a fresh machine pays), else a first estimate from the model's size
    (per module: a transformers model's 0.6 s, others' 0.45 s: ResNet-18's 68 took 42 s cold, a 4-layer
    GPT-2 41 s); either times 1 + the share of the cores other processes use now (a 2-layer GPT-2 compiled in 8 s quiet, 12 s beside a busy loop on one of
    two cores), and a tenth more for the recorded figure's own spread.

    The estimate decides whether compile is started at all: once started, a compilation cannot be cut short,
    so one that was under-estimated runs the tune past its budget (a 2-layer GPT-2 took 54 s on 2 cores where
    the size rule said 14). On the 2-core machine this project is tested on, a cold compile took ~10 s for
    small_cnn (13 modules), ~15-25 s for ResNet-18 (68 modules) and ~50 s for a transformers GPT-2 of 2 blocks
    (its attention and generation code trace slowly); a warm inductor cache is faster.
    """
    seen = _read_compile_times().get(_compile_key(model))
    if isinstance(seen, (int, float)):  # an earlier version's record: one figure
        seen = {"last": seen, "max": seen}
    if isinstance(seen, dict):
        took = seen["last"] if _inductor_cache_warm() else seen["max"]
        return float(took) * (1.1 + foreign_share) + 10 * step_s
    modules = sum(1 for _ in model.modules())
    per_module = 0.6 if type(model).__module__.startswith("transformers.") else 0.45
    return (8.0 + per_module * modules) * (1.0 + foreign_share) + 10 * step_s


def record_compile(model: nn.Module, first_call_s: float) -> None:
    """Keep a compiled first call's seconds for the next tune of this model here (a cache of its own beside
    the peaks'); a cache that cannot be written is left as it is (the size estimate stands in)."""
    times = _read_compile_times()
    key = _compile_key(model)
    before = times.get(key) if isinstance(times.get(key), dict) else {}
    first = round(float(first_call_s), 2)
    times[key] = {"last": first, "max": max(first, float(before.get("max", 0.0)))}  # max: a cold cache's
    try:
        with atomic_path(_compile_cache()) as tmp:
            tmp.write_text(json.dumps(times, indent=1))
    except OSError:
        pass


def _inductor_cache_warm() -> bool:
    """Whether inductor's cache on disk holds anything (a compilation here reuses its kernels and graphs: a first
    call of ResNet-18 took 42 s cold, 18 s warm); False where it cannot be read."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        with os.scandir(cache_dir()) as entries:
            return any(True for _ in entries)
    except Exception:
        return False


def _compile_key(model: nn.Module) -> str:
    """What a compile time depends on: the model's class and size, this machine and torch."""
    params = sum(p.numel() for p in model.parameters())
    return f"{type(model).__module__}.{type(model).__qualname__}|{sum(1 for _ in model.modules())} modules|" \
           f"{params} params|{machine_key(torch.device('cpu'))}"


def _compile_cache() -> Path:
    return cache_path().with_name("compile_times.json")


def _read_compile_times() -> dict[str, float]:
    try:
        data = json.loads(_compile_cache().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

