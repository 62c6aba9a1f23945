"""Fitting under the memory limit when the plain step does not: the fastest single trick that fits, a
combination of the peak cutters measured to fit and be faster, else the cutters added one by one, then
micro-batches (accumulation), until one fits.

:class:`UnderLimit` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`).
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

from torch_tricks.errors import one_line
from torch_tricks.tuning.builds import _drift_into
from torch_tricks.tuning.decide import _compatible, _drift_ok, _gib, _key
from torch_tricks.tuning.measure import build_runner
from torch_tricks.tuning.report import TuneReport
from torch_tricks.tuning.result import Result

_FIT_COMBO_TRIES = 3  # combinations of peak cutters measured for a faster fit under the limit


class UnderLimit:
    """The configuration that fits, when plain does not; the configurations tried are kept in ``_fit_tries``
    (reused when decided again) and in ``report.combos``."""

    def _make_it_fit(self, end: float) -> Result | None:
        """The fastest measured way under the limit: the fastest single trick that fits, or a combination of
        the tricks that cut the peak that was measured to fit and be faster still (a few tried, those whose
        estimate could be faster first); else the cutters, fastest first, added until it fits; else all of
        them with micro-batches (accumulation)."""
        singles = [r for r in self.report.results if r.status == "measured" and r.peak_bytes is not None]
        fit = self._fitting(singles)
        best = min(fit, key=_ratio_or_inf) if fit else None
        for tnames, tchanges in self._combos_that_may_fit_faster(singles, best):
            res = self._fit_try(tnames, tchanges, end)
            if res is None:
                self.choice_notes.append("stopped trying combinations that may fit faster: over --budget-seconds")
                break
            if (res.status == "measured" and self._fits(res) and _drift_ok(res)
                    and (best is None or _ratio_or_inf(res) < _ratio_or_inf(best))):
                best = res
        if best is not None:
            return self._fits_with(best)
        return self._first_that_fits(self._ways_to_fit(singles), end)

    def _combos_that_may_fit_faster(self, singles: list[Result], best: Result | None
                                    ) -> list[tuple[list[str], dict[str, Any]]]:
        """Pairs and triples of the peak cutters whose savings, added, bring the plain peak near the limit
        (within 10%: savings overlap, so each is measured before it counts) and whose time ratios, multiplied,
        beat ``best``'s: an ordering only, estimated fastest first, at most ``_FIT_COMBO_TRIES``."""
        base_peak = self.report.baseline.peak_bytes
        cutters = sorted(self._peak_cutters(singles), key=_ratio_or_inf)
        bar = _ratio_or_inf(best) if best is not None else math.inf
        tries = []
        for k in (2, 3):
            for group in itertools.combinations(cutters, k):
                chosen, changes = _compatible(list(group))
                if len(chosen) != k:
                    continue
                est_peak = base_peak - sum(base_peak - r.peak_bytes for r in group)
                est_ratio = math.prod(_ratio_or_inf(r) for r in group)
                if est_peak <= 1.1 * self.limit and est_ratio < bar:
                    tries.append((est_ratio, [r.name for r in group], changes))
        tries.sort(key=lambda t: t[0])
        return [(names, changes) for _, names, changes in tries[:_FIT_COMBO_TRIES]]

    def _fitting(self, singles: list[Result]) -> list[Result]:
        """The single tricks that fit under the limit: those whose loss does not drift, where there are any."""
        fit = [r for r in singles if self._fits(r)]
        return [r for r in fit if _drift_ok(r)] or fit

    def _fits_with(self, res: Result) -> Result:
        """``res``, the configuration that fits, noted."""
        self.choice_notes.append(f"fits with {res.name}: peak {_gib(res.peak_bytes)} (limit {_gib(self.limit)})")
        return res

    def _ways_to_fit(self, singles: list[Result]) -> list[tuple[list[str], dict[str, Any]]]:
        """(names, changes) to try in turn: every trick that cuts the peak (memory tricks, and speed tricks
        such as bf16 that also do), fastest first, added one by one; then micro-batches on top."""
        cutters = sorted(self._peak_cutters(singles), key=_ratio_or_inf)
        tries: list[tuple[list[str], dict[str, Any]]] = []
        changes: dict[str, Any] = {}
        names: list[str] = []
        for r in cutters:
            if not set(r.changes) & set(changes):
                changes = {**changes, **r.changes}
                names = names + [r.name]
                if len(names) > 1:
                    tries.append((names, changes))
        return tries + _with_micro_batches(names, changes, self.report.batch)

    def _peak_cutters(self, singles: list[Result]) -> list[Result]:
        """The tricks that cut the plain peak by 2% or more without micro-batches, and do not drift."""
        base_peak = self.report.baseline.peak_bytes
        return [r for r in singles if not r.changes.get("accumulate") and _drift_ok(r)
                and r.peak_bytes < base_peak * 0.98]

    def _first_that_fits(self, tries: list[tuple[list[str], dict[str, Any]]], end: float) -> Result | None:
        """The first of ``tries`` that fits under the limit and was timed; None (and the closest, in a note)."""
        closest: Result | None = None
        for tnames, tchanges in tries:
            res = self._fit_try(tnames, tchanges, end)
            if res is None:
                self.choice_notes.append("stopped looking for a configuration that fits: over --budget-seconds")
                break
            if res.status == "measured (memory)":
                closest = _smaller_peak(res, closest)
                continue
            if res.status != "measured":
                continue
            return self._fits_with(res)
        self.choice_notes.append("no configuration tried fits under the memory limit: lower --batch or raise the "
                                 "limit" + (f" (closest: {closest.name}, peak {_gib(closest.peak_bytes)})"
                                            if closest else ""))
        return None

    def _fit_try(self, tnames: list[str], tchanges: dict[str, Any], end: float) -> Result | None:
        """One configuration tried for fit, measured once (reused when decided again); None when over budget."""
        res = self._fit_tries.get(_key(tchanges))
        if res is not None:
            return res
        if time.perf_counter() > end:
            return None
        res = self._try_fit(tnames, tchanges, end)
        self._fit_tries[_key(tchanges)] = res
        self.report.combos.append(res)
        return res

    def _try_fit(self, tnames: list[str], tchanges: dict[str, Any], end: float) -> Result:
        """Memory of one configuration; if it fits, its drift, and its time against the plain step."""
        report = self.report
        res = Result(_fit_name(tnames), "memory", tchanges, _ids_of(report, tchanges))
        cfg = {**self.base_cfg, **tchanges}
        try:
            self._memory_into(res, cfg)
        except Exception as exc:
            res.status, res.verdict, res.reason = "failed", "failed", one_line(exc, with_type=True)
            return res
        if not self._fits(res):
            res.status, res.verdict = "measured (memory)", "over the memory limit"
            return res
        try:
            r = build_runner(res.name, self.model, cfg, self.batches, **self.kw)
            _drift_into(res, r, self.base)
            res.runner = r
            # nothing to decide against plain (it does not fit): timed for its cost, the least rounds
            self._race_side_by_side(res, None, end, contender=False,
                                    why_not="the configuration that fits (plain does not): timed for its cost")
        except Exception as exc:
            res.status, res.verdict, res.reason = "failed", "failed", one_line(exc, with_type=True)
        return res


def _ratio_or_inf(r: Result) -> float:
    """Its time ratio against plain, for sorting fastest first; inf where it was not timed."""
    return r.ratio if r.ratio is not None and not math.isnan(r.ratio) else math.inf


def _fit_name(names: list[str]) -> str:
    """The name of a configuration tried for fit: its tricks in order, then its micro-batches."""
    return "+".join(sorted(n for n in names if not n.startswith("accumulate="))
                    + [n for n in names if n.startswith("accumulate=")])


def _smaller_peak(res: Result, closest: Result | None) -> Result:
    """Of ``res`` and ``closest`` (None: none yet), the one with the smaller peak (``closest`` on a tie)."""
    return res if closest is None or res.peak_bytes < closest.peak_bytes else closest


def _with_micro_batches(names: list[str], changes: dict[str, Any], batch: int
                        ) -> list[tuple[list[str], dict[str, Any]]]:
    """``changes`` with 2, 4, 8 ... micro-batches (accumulation), up to one sample each."""
    tries = []
    k = 2
    while k <= batch:
        tries.append((names + [f"accumulate={k}"], {**changes, "accumulate": k}))
        k *= 2
    return tries


def _ids_of(report: TuneReport, changes: dict[str, Any]) -> tuple[str, ...]:
    ids = {i for r in report.results if r.changes and set(r.changes) <= set(changes) for i in r.ids}
    return tuple(sorted(ids))

