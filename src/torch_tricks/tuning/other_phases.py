"""The tune's phases after the training search, each in its share of the budget: MFU of the plain step and of
the recommendation (issue 22), the distributed rows (ddp, zero1, fsdp), the loader, and the inference chain.

:class:`OtherPhases` is one part of the tune's state (:class:`~torch_tricks.tuning.tuner._Tune`).
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any, Callable

import torch

from torch_tricks import batches as B
from torch_tricks.data.loader_tune import tune_loader_path
from torch_tricks.errors import UserError, one_line
from torch_tricks.inspect.peak import cached_peak, device_peak
from torch_tricks.tuning import distributed as D
from torch_tricks.tuning.candidates import TOKEN_TRICKS
from torch_tricks.tuning.decide import DRIFT_TOLERANCE, MIN_EFFECT
from torch_tricks.tuning.efficiency import efficiency, step_cost
from torch_tricks.tuning.result import Result
from torch_tricks.tuning.token_phase import measure_token_batches

# MFU (issue 22): counting a step's FLOPs costs a few plain steps (the counter sees every operator); a machine's
# first peak measurement (square matmuls up to 4096 in each dtype) some seconds, once
_COUNT_STEPS = 4
_PEAK_MEASURE_S = 8.0
_EFFICIENCY_SHARE = 0.15  # the most of the budget they may take


class OtherPhases:
    """MFU (its time kept back at the start: ``efficiency_reserve``), then the distributed rows, data and
    deploy, each filling its part of the report."""

    def _reserve_efficiency(self) -> None:
        """Keep back from the training phases the time of the MFU figures (the step's FLOPs counted, and this
        machine's peak measured if not cached yet), where it is a small share of the budget; else say why not."""
        cached = cached_peak(torch.device(self.report.device)) is not None
        need = _COUNT_STEPS * self.step_s + (0.0 if cached else _PEAK_MEASURE_S)
        if need <= _EFFICIENCY_SHARE * self.report.budget_s:
            self.efficiency_reserve = need
            self.train_end -= need
            return
        self.report.efficiency = {"status": "skipped", "reason": (
            f"it needs about {need:.0f} s, over {_EFFICIENCY_SHARE:.0%} of --budget-seconds"
            + ("" if cached else "; `torch-tricks peak` measures this machine's peak once, for every later tune"))}

    def _efficiency_phase(self) -> None:
        """MFU of the plain step and of the recommendation against this machine's peak (issue 22): the model
        FLOPs of a step counted once, the peak read from its cache (measured there first)."""
        report, base, best = self.report, self.report.baseline, self.report.best_throughput
        if not self.efficiency_reserve or base is None or not base.step_s:
            return
        dev = torch.device(report.device)
        t = time.perf_counter()
        try:
            cost = step_cost(self.model, self.base_cfg, self.batches[0], **self.kw)
            rec = best if best is not None and best.step_s else base
            steps = {"plain": ("plain", "fp32", base.step_s),
                     "recommended": (rec.name, rec.changes.get("precision", "fp32"), rec.step_s)}
            report.efficiency = {"status": "measured", **efficiency(
                cost, device_peak(dev), steps, remeasure=self._peak_again(dev)).to_dict()}
        except UserError as exc:
            report.efficiency = {"status": "failed", "reason": str(exc)}
        except Exception as exc:  # the counter cannot follow this model: said, the tune's verdicts stand
            report.efficiency = {"status": "failed", "reason": one_line(exc, with_type=True)}
        self.phase_s["efficiency"] = time.perf_counter() - t

    def _peak_again(self, dev: torch.device) -> Callable[[], Any] | None:
        """A new measurement of the peak, for a step that beat the cached one, where the time before the later
        phases' shares holds it; else None (the MFU is then withheld, with the reason)."""
        later = self.dist_share + self.data_share + self.deploy_start_share
        if self.deadline - later - time.perf_counter() < _PEAK_MEASURE_S:
            return None
        return lambda: device_peak(dev, refresh=True)

    def _other_phases(self, data: Any) -> None:
        """7. the distributed rows, data (a loader, or token rows) and deploy, each in its share of the budget."""
        report = self.report
        if self.dist_world:
            report.distributed = self._timed_phase(f"{self.dist_world} processes", "distributed",
                                                   self._measure_distributed)
        if isinstance(data, (str, os.PathLike)):
            report.data = self._timed_phase("data", "data", lambda: self._measure_data(str(data)))
        elif data is not None:
            report.tokens = self._timed_phase("token batches", "tokens", lambda: self._measure_tokens(data))
            if report.tokens.get("status") == "measured":  # their rows are in the token table, not skipped
                report.skipped = [s for s in report.skipped if s.name not in TOKEN_TRICKS]
        if self.deploy_start_share:
            report.deploy = self._timed_phase("deploy", "deploy", self._measure_deploy)

    def _measure_distributed(self) -> dict[str, Any]:
        """ddp, zero1 and fsdp on the ranks, with the recommended configuration, against one process."""
        world = self.dist_world
        launched = D.launched_world() > 1
        job = self._dist_job(launched)
        why = "" if launched else D.unsendable(job)
        if why:
            return {**D._failed(why), "processes": world}
        budget = self.deadline - self.data_share - self.deploy_start_share - time.perf_counter()  # after the copy
        if budget < 5:
            return {"status": "skipped", "processes": world, "rows": [], "reason":
                    "over --budget-seconds before the distributed rows could be measured: raise it"}
        job.budget_s, job.deadline = budget, time.time() + budget
        result, local = self._run_on_ranks(job, launched)
        result.setdefault("processes", world)
        result["launched_by"] = "torchrun" if launched else f"tune --processes {world}"
        if result.get("status") == "measured":
            rec, why = D.recommend(result, self.limit, local_ranks=local, min_effect=MIN_EFFECT,
                                   drift_tolerance=DRIFT_TOLERANCE["loss"])
            result["recommended"], result["why"] = rec, why
        return result

    def _dist_job(self, launched: bool) -> D.DistJob:
        """The distributed rows' job: the recommended configuration (without compile) on CPU copies of the
        model and batch, its share of the budget, and the threads of a rank and of one process."""
        changes, notes = _eager_changes(self.report.best_throughput or self.report.baseline)
        budget = self.deadline - self.data_share - self.deploy_start_share - time.perf_counter()
        threads, one_process_threads = self._dist_threads(launched)
        return D.DistJob(
            model=copy.deepcopy(self.model).cpu(), batch=B.to_device(self.batches[0], torch.device("cpu")),
            loss_fn=self.kw.get("loss_fn"), optimizer_fn=self.kw.get("optimizer_fn"),
            config={**self.base_cfg, **changes}, changes=changes, limit=self.limit, budget_s=budget,
            deadline=time.time() + budget,
            seed=int(self.base_cfg.get("seed", 0)), notes=notes, min_effect=MIN_EFFECT,
            threads=threads, one_process_threads=one_process_threads)

    def _dist_threads(self, launched: bool) -> tuple[int | None, int | None]:
        """(intra-op threads of a rank, of the one-process lane) on the CPU; None on a GPU (left as they are)."""
        if torch.device(self.base_cfg.get("device", "cpu")).type != "cpu":
            return None, None
        if launched:
            return self.channel.threads, D.usable_cores()
        return max(1, D.usable_cores() // self.dist_world), torch.get_num_threads()

    def _run_on_ranks(self, job: D.DistJob, launched: bool) -> tuple[dict[str, Any], int]:
        """(the result, the ranks on this host): under torchrun, with the ranks waiting for the job; else on
        ranks the tune spawns."""
        world = self.dist_world
        if not launched:
            return D.launch(job, world), world
        self.channel.send(job)  # the other ranks wait for it
        try:
            result = D.measure_modes(job)
        except Exception as exc:
            result = D._failed(one_line(exc, with_type=True))
        return result, int(os.environ.get("LOCAL_WORLD_SIZE", world))

    def _measure_data(self, path: str) -> dict[str, Any]:
        """Loader throughput at the tuned batch vs the recommended step's samples/s: data-bound or not."""
        until = self.deadline - self.deploy_start_share
        left = until - time.perf_counter()
        if left < 3:
            return {"path": path, "status": "skipped", "reason": "over --budget-seconds before the loader could be timed"}
        report = self.report
        try:
            lt = tune_loader_path(path, batch_sizes=(report.batch,), seconds_per_trial=min(max(left / 8, 0.5), 3.0),
                                  progress=False, cold_read=False)
        except Exception as exc:
            return {"path": path, "status": "failed", "reason": one_line(exc, with_type=True)}
        return _loader_against_step(path, lt, report.batch, report.best_throughput or report.baseline)

    def _measure_tokens(self, data: Any) -> dict[str, Any]:
        """T39-T41 on a sample of the token rows, in real tokens a second (tuning.token_phase)."""
        left = self.deadline - self.deploy_start_share - time.perf_counter()
        if left < 3:
            return {"status": "skipped", "reason": "over --budget-seconds before the token batches could be timed"}
        try:
            return measure_token_batches(self.model, data, batch_size=self.report.batch,
                                         device=torch.device(self.report.device), seconds=left,
                                         seed=int(self.base_cfg.get("seed", 0)), min_effect=self.report.min_effect,
                                         loss_fn=self.kw.get("loss_fn"))
        except UserError as exc:
            return {"status": "failed", "reason": one_line(exc)}

    def _measure_deploy(self) -> dict[str, Any]:
        """The inference chains (fuse, int8 ...) on an eval copy, each against eager fp32."""
        try:  # here, not at the top: it loads the deploy package and the model zoo, for --deploy only
            from torch_tricks.deploy.pipeline import optimize
        except ImportError as exc:
            return {"status": "failed", "reason": f"the deploy package cannot be imported: {exc}", "steps": []}
        parts = B.unpack(self.batches[0])
        if parts.kwargs:
            return {"status": "skipped", "steps": [], "reason": "the model takes keyword inputs; the deploy chain "
                    "exports positional ones: run `torch-tricks optimize` with positional --input"}
        example = _first_sample(parts.args)
        batch = self.report.batch
        out: dict[str, Any] = {"steps": [], "batches": [1, batch]}
        for chain in (["fuse", "int8"], ["int8-dynamic"], ["bf16"], ["reparam"], ["onnx"]):
            if self.deadline - time.perf_counter() < 3:
                out["steps"].append({"steps": chain, "status": "skipped", "reason": "over --budget-seconds"})
            else:
                out["steps"] += self._deploy_chain(optimize, chain, example, batch)
        return out

    def _deploy_chain(self, optimize: Callable[..., Any], chain: list[str], example: Any, batch: int
                      ) -> list[dict[str, Any]]:
        """The rows of one inference chain on an eval copy (one 'not applicable' row where it raises)."""
        try:
            res = optimize(copy.deepcopy(self.model).eval(), chain, example, batches=(1, batch), warmup=2, repeats=7)
        except Exception as exc:
            return [{"steps": chain, "status": "not applicable", "reason": one_line(exc, with_type=True)}]
        d = res.as_dict()
        return [_deploy_step(chain, s, d["original"]) for s in d["steps"]]


def _eager_changes(best: Result | None) -> tuple[dict[str, Any], list[str]]:
    """(the changes of ``best`` without compile, a note where compile was left out) for the distributed rows."""
    changes = {k: v for k, v in (best.changes if best is not None else {}).items() if k != "compile"}
    if best is not None and best.changes.get("compile"):
        return changes, ["compile is left out of the distributed rows (a compilation per lane and rank would take "
                         "the phase): they are measured eagerly"]
    return changes, []


def _loader_against_step(path: str, lt: Any, batch: int, best: Result | None) -> dict[str, Any]:
    """The loader's samples/s (``lt``: its tune) against the ``best`` step's at ``batch``: data-bound or not."""
    step_rate = _samples_per_s(batch, best)
    load_rate = lt.best.samples_per_s if lt.best else None
    out: dict[str, Any] = {"path": path, "status": "measured", "loader_samples_per_s": load_rate,
                           "step_samples_per_s": step_rate, "step_config": best.name if best else None,
                           "loader": lt.loader_kwargs() if lt.best else None, "verdict": lt.verdict,
                           "reasons": lt.reasons, "advice": lt.advice, "trials": lt.rows()}
    if load_rate and step_rate:
        out["data_bound"] = load_rate < step_rate
        out["summary"] = _data_summary(load_rate, step_rate, lt.verdict, best.name)
    return out


def _samples_per_s(batch: int, r: Result | None) -> float | None:
    return batch / r.step_s if r and r.step_s else None


def _data_summary(load_rate: float, step_rate: float, verdict: str, step_name: str) -> str:
    return (f"the loader delivers {load_rate:,.0f} samples/s ({verdict}), the {step_name} step consumes "
            f"{step_rate:,.0f}: " + ("data-bound: the step waits for data" if load_rate < step_rate
                                     else "not data-bound"))


def _first_sample(args: tuple[Any, ...]) -> Any:
    """The first sample of the positional inputs: the tensor alone for one input, else a tuple."""
    return args[0][:1] if len(args) == 1 else tuple(t[:1] for t in args)


def _deploy_step(chain: list[str], s: dict[str, Any], original: dict[str, Any]) -> dict[str, Any]:
    """One step of a deploy chain's result as a row of the report (``steps``: the chain up to it)."""
    return {
        "steps": chain[: chain.index(s["step"]) + 1] if s["step"] in chain else chain,
        "status": "measured" if s.get("changed", True) else "no change",
        "speedup": s.get("speedup"), "latency_s": s.get("latency_s"),
        "agreement": s.get("agreement"), "within_tolerance": s.get("within_tolerance"),
        "tolerance": s.get("tolerance"), "size_bytes": s.get("size_bytes"),
        "original_size_bytes": original.get("size_bytes"), "notes": s.get("notes"),
    }

