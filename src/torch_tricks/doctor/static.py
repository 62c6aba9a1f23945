"""The static half of ``torch-tricks doctor``: classic PyTorch pitfalls found by reading code.

Files are parsed with :mod:`ast`; nothing is imported or run, so linting is safe on any
code and needs no GPU. Names are resolved through the file's own imports
(``import torch.nn.functional as F``, ``from torch import nn``, ``from torch.nn import
CrossEntropyLoss``), and each function's simple bindings are followed
(``criterion = nn.CrossEntropyLoss()`` ... ``criterion(out, y)``; ``for x, y in loader``;
``self.fc = nn.Linear(...)`` in ``__init__`` ... ``self.fc`` in ``forward``; a function's
parameter when every call in the file passes the same kind of thing).

Precision comes before recall: a rule fires only on evidence in the file that the code is
the pitfall (the receiver of ``.cuda()`` was made by ``torch.randn``, the input of
``cross_entropy`` came from ``log_softmax``). Where the evidence is elsewhere — a model
passed in from another module, a loader built in another file — the rule stays quiet.

Public API: :func:`lint_source`, :func:`lint_paths` (a :class:`LintResult`),
:func:`format_text`, :func:`exit_code`, :func:`check_rule_codes`, :func:`filter_findings`,
and, re-exported from the sibling modules, :func:`load_config` / :class:`DoctorConfig` and
:func:`to_sarif`.
"""

from __future__ import annotations

import ast
import bisect
import io
import os
import re
import time
import tokenize
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Callable, Iterable, Iterator

from torch_tricks.doctor.config import DoctorConfig, load_config
from torch_tricks.doctor.rules import Finding, Rule, list_rules, register_rule, severity_rank
from torch_tricks.doctor.sarif import to_sarif
from torch_tricks.errors import UserError

__all__ = ["LintResult", "lint_source", "lint_paths", "format_text", "exit_code", "check_rule_codes",
           "filter_findings", "static_rules", "load_config", "DoctorConfig", "to_sarif"]


# --------------------------------------------------------------------------- public API


@dataclass
class LintResult:
    """What a run over files found, how many files it read, and which it could not."""

    findings: list[Finding] = field(default_factory=list)
    files: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)  # (path, one-line reason)
    seconds: float = 0.0


def lint_source(source: str, path: str = "<string>", select: Iterable[str] | None = None,
                ignore: Iterable[str] | None = None) -> list[Finding]:
    """The static findings in ``source``, sorted by position.

    ``select``/``ignore`` hold rule ids or id prefixes (``"TT1"``); ``# noqa`` on a
    finding's line silences it, ``# noqa: TT101,TT105`` only those rules. Source that
    does not parse raises :class:`SyntaxError` (:func:`lint_paths` reports it per file).
    """
    enabled = _enabled(select, ignore)
    return _lint_tree(_parse(source, path), source, path, enabled)


def lint_paths(paths: Iterable[str | Path], select: Iterable[str] | None = None,
               ignore: Iterable[str] | None = None, config: DoctorConfig | None = None,
               progress: Callable[[int, int], None] | None = None) -> LintResult:
    """Lint files and folders (walked for ``*.py``, skipping VCS, virtualenv, hidden and
    ``__pycache__`` folders and the config's ``exclude`` patterns).

    ``select``/``ignore`` given here replace the config's; ``exclude`` applies to what the
    walk finds (a file named explicitly is always linted). A path that does not exist is
    a :class:`UserError`; a file that cannot be read or parsed is listed in ``errors`` and
    the run goes on. ``progress(done, total)`` is called after each file.
    """
    started = time.perf_counter()
    config = config or DoctorConfig()
    enabled = _enabled(config.select if select is None else select,
                       config.ignore if ignore is None else ignore)
    files = _collect(paths, config)
    result = LintResult(files=len(files))
    for done, file in enumerate(files, 1):
        name = str(file)
        try:
            source = _read(file)
            tree = _parse(source, name)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError) as exc:
            result.errors.append((name, _reason(exc)))
        else:
            try:
                result.findings.extend(_lint_tree(tree, source, name, enabled))
            except RecursionError:
                result.errors.append((name, "nested too deeply to analyse"))
            except Exception as exc:  # a bug in a checker: keep the traceback, say which file
                if hasattr(exc, "add_note"):
                    exc.add_note(f"torch-tricks doctor crashed while linting {name}")
                raise
        if progress is not None:
            progress(done, len(files))
    result.findings.sort(key=_order)
    result.seconds = time.perf_counter() - started
    return result


def format_text(findings: Iterable[Finding]) -> list[str]:
    """One ``path:line:col: TT101 message`` line per finding (flake8 style, 1-based column)."""
    return [f"{f.path or '-'}:{f.line}:{f.col}: {f.rule} {f.message}" for f in findings]


def exit_code(findings: Iterable[Finding], fail_on: str = "warning") -> int:
    """1 if any finding is at or above the ``fail_on`` severity, else 0."""
    threshold = severity_rank(fail_on)
    return int(any(severity_rank(f.severity) >= threshold for f in findings))


def filter_findings(findings: Iterable[Finding], select: Iterable[str] | None = None,
                    ignore: Iterable[str] | None = None) -> list[Finding]:
    """The findings whose rule ``select`` keeps (ids or prefixes; None keeps all) and
    ``ignore`` does not drop: the same filter as linting's, for any rule (runtime too)."""
    sel = None if select is None else check_rule_codes(select, "select")
    ign = check_rule_codes(ignore or (), "ignore")
    return [f for f in findings if (sel is None or any(f.rule.startswith(c) for c in sel))
            and not any(f.rule.startswith(c) for c in ign)]


def static_rules() -> list[Rule]:
    """The static rules, by id (no runtime module needed)."""
    return [_RULES[rid] for rid in sorted(_RULES)]


def check_rule_codes(codes: Iterable[str], where: str = "the rule list") -> tuple[str, ...]:
    """``codes`` upper-cased, each checked to name a rule or be a prefix of rule ids.

    An unknown code is a :class:`UserError` (``where`` says where it was written), so a
    typo in ``--select`` or a config never silently disables a check.
    """
    if isinstance(codes, str):
        codes = [codes]
    out = []
    for code in codes:
        c = code.strip().upper()
        if not c or not (any(r.startswith(c) for r in _RULES) or any(r.id.startswith(c) for r in list_rules())):
            raise UserError(f"unknown doctor rule {code!r} in {where}: use ids such as TT101 or a "
                            f"prefix such as TT1 (`torch-tricks doctor --list` shows them)")
        out.append(c)
    return tuple(out)


# --------------------------------------------------------------------------- the rules

_RULES: dict[str, Rule] = {}
_CHECKS: dict[str, Callable[["_File"], Iterator[tuple[ast.AST, str]]]] = {}


def _rule(id: str, name: str, severity: str, source: str, message: str, explanation: str) -> None:
    _RULES[id] = register_rule(Rule(id=id, name=name, message=message, explanation=explanation,
                                    severity=severity, source=source, kind="static"))


_rule("TT101", "module-in-plain-container", "error",
      "X (plain-list submodules); seeds/003 网络模型构建 §1-2 (nn.Sequential和nn.ModuleList的区别)",
      "submodules kept in a plain list/dict attribute are not registered: use nn.ModuleList / nn.ModuleDict",
      "An nn.Module registers only submodules assigned to it directly or held in nn.ModuleList, "
      "nn.ModuleDict or nn.Sequential. Layers in a plain list or dict attribute are invisible to "
      "parameters(), state_dict(), .to()/.cuda(), train()/eval() and DDP: the optimizer never updates "
      "them, checkpoints lose them, they stay on the CPU, and nothing raises. Fix: "
      "self.layers = nn.ModuleList([...]) or nn.ModuleDict({...}) (a nested list needs a ModuleList "
      "at every level).")
_rule("TT102", "functional-dropout-always-on", "error",
      "X (F.dropout without training=); seeds/003 测试阶段 §3 (Dropout里需要设置训练标志位)",
      "F.dropout without training= stays on after model.eval(): pass training=self.training or use nn.Dropout",
      "torch.nn.functional.dropout defaults to training=True, so inside forward() it keeps dropping "
      "activations after model.eval(): evaluation is random and wrong. Fix: "
      "F.dropout(x, p, training=self.training), or an nn.Dropout(p) submodule, which follows the "
      "module's train/eval mode.")
_rule("TT103", "tensor-data-attribute", "warning",
      "X (.data instead of .detach()); seeds/003 Tensor的操作 §6 (data和detach()的区别)",
      "`.data` hides changes from autograd: a write before backward, or a read in forward, breaks gradients",
      "x.data gives the tensor's values with autograd's checks cut off: an in-place change through it "
      "is not recorded, so a backward pass that needs the old values computes wrong gradients instead "
      "of raising; and a module's own parameter read through .data in forward gets no gradient from "
      "that use. Fix: update parameters in place inside `with torch.no_grad():` (p.mul_(...), "
      "p.copy_(...)), and use the parameter itself in forward (x.detach() where no gradient is meant). "
      "Quiet where .data changes nothing: reads outside forward (p.grad.data.norm(), outputs.data for "
      "an argmax), writes under no_grad, writes with no backward after them in the function (a manual "
      "SGD step, a conversion that swaps a parameter's tensor), and weight initialisation (__init__, "
      "init_weights, reset_parameters, a function given to module.apply), before any graph exists.")
_rule("TT104", "inplace-on-expanded-view", "error",
      "X (expand() then in-place write); seeds/003 Pytorch 使用陷阱 §1 (expand, expand_as是共享内存的)",
      "in-place write to an expand()/expand_as() view, whose elements share memory: .clone() it first",
      "expand(), expand_as() and broadcast_to() return views in which many elements share one memory "
      "location. An in-place write through such a view either fails ('more than one element of the "
      "written-to tensor refers to a single memory location') or, for index assignment, fill_ and "
      "masked_fill_, silently writes every expanded copy and the source tensor. Fix: "
      "y = x.expand(...).clone() before writing, or build the tensor with repeat().")
_rule("TT105", "sqrt-of-sum-of-squares", "warning",
      "X (sqrt of a sum of squares); seeds/003 Pytorch 使用陷阱 §7 (torch.sqrt()在0处的左导数没有定义)",
      "sqrt of a sum of squares has a NaN gradient at zero: use torch.linalg.vector_norm, or add an eps",
      "The derivative of sqrt(s) is 1/(2*sqrt(s)), infinite at s = 0, and the chain rule multiplies it "
      "by ds/dx = 2x = 0: the gradient is inf*0 = NaN, which then spreads to every weight. It happens "
      "whenever the vector is exactly zero (identical points, padding, a zero residual). Fix: "
      "torch.linalg.vector_norm(x, dim=...) (or x.norm()), whose gradient at 0 is defined as 0, or "
      "torch.sqrt(s + eps).")
_rule("TT106", "log-softmax-into-cross-entropy", "warning",
      "X (log-softmax output fed to CrossEntropyLoss); seeds/003 网络结构可视化 §2 (a Net whose "
      "forward returns F.log_softmax)",
      "log_softmax output fed to cross-entropy, which applies log_softmax itself: use nll_loss, or pass the logits",
      "nn.CrossEntropyLoss and F.cross_entropy take raw logits and apply log_softmax internally. Given "
      "log-probabilities they apply it a second time: the value happens to be the same (log_softmax is "
      "idempotent), but it costs an extra pass and contradicts what the model claims to output. Fix: "
      "keep log_softmax and use nn.NLLLoss / F.nll_loss, or drop the log_softmax and keep "
      "cross-entropy.")
_rule("TT107", "activation-applied-twice", "error",
      "X (log-softmax output fed to CrossEntropyLoss, and the other output/loss pairings)",
      "probabilities fed to a loss that expects logits: the activation is applied twice",
      "F.cross_entropy / nn.CrossEntropyLoss apply log_softmax to their input and "
      "BCEWithLogitsLoss applies sigmoid. Fed probabilities (softmax or sigmoid output), they squash "
      "them a second time: the loss can no longer approach 0, gradients shrink, and training is slow "
      "or stalls, with no error. Fix: pass the logits (the output before softmax/sigmoid) to the "
      "loss; apply softmax/sigmoid only to make predictions.")
_rule("TT108", "sigmoid-into-bce-loss", "warning",
      "X (the other output/loss pairings); T1 (losses unsafe in float16)",
      "sigmoid output fed to BCELoss: use BCEWithLogitsLoss on the logits (stable, and allowed under autocast)",
      "sigmoid followed by BCELoss computes log(sigmoid(x)), which saturates for large |x| (BCELoss "
      "clamps the log at -100, so confidently wrong outputs get no gradient), and torch.autocast "
      "refuses BCELoss in float16. BCEWithLogitsLoss fuses the two with the log-sum-exp trick. Fix: "
      "drop the sigmoid from the output and use nn.BCEWithLogitsLoss / "
      "F.binary_cross_entropy_with_logits; apply torch.sigmoid only to make predictions.")
_rule("TT109", "legacy-loss-reduction-args", "warning",
      "X (deprecated size_average/reduce); seeds/003 Tensor的操作 §7 (reduce,size_average参数说明)",
      "size_average= / reduce= are deprecated: use reduction='mean' | 'sum' | 'none'",
      "The size_average and reduce flags of the loss functions were merged into one argument, "
      "reduction. They still work with a deprecation warning, and their interplay is easy to get wrong "
      "(reduce=False ignores size_average). Map: reduce=False -> reduction='none'; "
      "size_average=False -> 'sum'; otherwise 'mean'.")
_rule("TT110", "torch-load-without-map-location", "info",
      "X (torch.load without map_location); T20, T26; "
      "seeds/003 训练阶段 §6 (载入模型权重GPU内存被额外占用); "
      "seeds/002 问题 §1",
      "torch.load without map_location restores tensors to the device they were saved from: pass map_location",
      "Without map_location, tensors saved from cuda:0 are loaded back onto cuda:0: on a machine "
      "without that GPU the load fails, and under DDP every process allocates memory on GPU 0 (the "
      "extra processes seen in nvidia-smi). Fix: torch.load(f, map_location='cpu') and then "
      "load_state_dict / .to(device), or map_location=f'cuda:{local_rank}'.")
_rule("TT111", "torch-load-without-weights-only", "warning",
      "X (torch.load without weights_only); T26",
      "torch.load without weights_only (its default changed in torch 2.6): pass weights_only=True, "
      "or False only for trusted files",
      "torch.load unpickles the file. Before torch 2.6 the default, weights_only=False, runs any "
      "code an untrusted checkpoint carries; from 2.6 the default is True and checkpoints that hold "
      "other Python objects fail to load. Saying it explicitly makes the load safe and the same on "
      "every version. Fix: torch.load(f, map_location='cpu', weights_only=True); weights_only=False "
      "only for files you trust. Quiet where the code already chose weights_only loading: inside "
      "torch.serialization.safe_globals(...), in a file that calls add_safe_globals, and in the "
      "fallback of a load that passes weights_only (an except after it, the other branch of a version "
      "check).")
_rule("TT112", "timing-without-synchronize", "warning",
      "X (time.time() around device work without synchronize); P4; "
      "seeds/003 测试阶段 §1 (正确的测试时间计时代码)",
      "wall-clock time read after CUDA work without torch.cuda.synchronize(): "
      "it measures kernel launches, not the work",
      "CUDA kernels run asynchronously: time.time() / time.perf_counter() return as soon as the "
      "kernels are queued, so the measured time is too short and the cost lands on whatever "
      "synchronises next. Fix: torch.cuda.synchronize() before reading the clock (at both ends), or "
      "time with torch.cuda.Event(enable_timing=True) or torch.utils.benchmark.Timer, after a "
      "warm-up.")
_rule("TT113", "device-move-not-assigned", "error",
      "X (.cuda() on a tensor without reassigning); "
      "seeds/003 Tensor的操作 §8 (将tensor以及model迁移至cuda上)",
      "tensor .cuda()/.to()/.cpu()/.half() returns a new tensor and the result is discarded: reassign it",
      "For a tensor, .cuda(), .to(), .cpu(), .half(), .float() and the other conversions are not "
      "in place: they return a converted copy and leave the original where it was (only nn.Module's "
      ".to()/.cuda() move in place). Fix: x = x.to(device).")
_rule("TT114", "data-parallel", "warning",
      "X (DataParallel use); T18; seeds/002 分布式数据并行DistributedDataParallel "
      "(DataParallel 和 DistributedDataParallel 区别)",
      "nn.DataParallel is single-process and slower than DistributedDataParallel: use DDP with torchrun",
      "DataParallel drives every GPU from one Python process: each step it replicates the model, "
      "scatters the inputs and gathers the outputs on GPU 0 (unbalanced memory), all under the GIL. "
      "PyTorch recommends DistributedDataParallel even on one machine. Fix: one process per GPU "
      "(torchrun), torch.distributed.init_process_group, a DistributedSampler, and "
      "DDP(model, device_ids=[local_rank]).")
_rule("TT115", "empty-cache-in-loop", "warning",
      "X (empty_cache() inside the loop); T16; seeds/001 基本操作 check list; seeds/003 内存优化和加速 §3",
      "torch.cuda.empty_cache() in the training loop slows every step and frees no memory your tensors use",
      "empty_cache() only hands cached, unused blocks back to the driver (so nvidia-smi shows less); "
      "the allocator then has to cudaMalloc them again, which synchronises and costs time every "
      "step. It never frees memory held by live tensors, so it does not cure an out-of-memory "
      "error. Fix: remove it from the loop; if memory grows, find what keeps tensors alive (e.g. an "
      "accumulated loss, TT117).")
_rule("TT116", "eval-without-no-grad", "warning",
      "X (eval without no_grad); T13; seeds/003 测试阶段 §2b; seeds/001 基本操作 check list "
      "(用 eval() 和 with torch.no_grad())",
      "forward pass after model.eval() outside torch.no_grad()/inference_mode(): autograd still records the graph",
      "model.eval() switches dropout and batch norm to inference behaviour; it does not stop "
      "autograd. Without torch.no_grad() (or torch.inference_mode()) every evaluation forward keeps "
      "its activations for a backward pass that never comes: more memory, slower. Fix: wrap the loop "
      "in `with torch.no_grad():` or decorate the function with @torch.no_grad() / "
      "@torch.inference_mode().")
_rule("TT117", "loss-accumulated-with-graph", "warning",
      "X; T27; seeds/003 Pytorch 使用陷阱 §2 (在循环中使用全局变量当做累加器)",
      "loss tensor accumulated across iterations keeps every step's graph alive: accumulate loss.item()",
      "A loss tensor carries its autograd graph. Adding it to a running total (or appending it to a "
      "list) that outlives the iteration keeps every step's graph and saved activations reachable, "
      "so memory grows each step until it runs out. Fix: total += loss.item() (or "
      "loss.detach()); append loss.item() to lists.")
_rule("TT118", "set-deterministic-removed", "error",
      "T17; seeds/002 其他技巧·重现 (强制确定性操作 torch.set_deterministic)",
      "torch.set_deterministic / is_deterministic no longer exist: use torch.use_deterministic_algorithms",
      "torch.set_deterministic and torch.is_deterministic (PyTorch 1.7) were renamed in 1.8 and "
      "later removed: calling them raises AttributeError. Fix: torch.use_deterministic_algorithms(True) "
      "and torch.are_deterministic_algorithms_enabled(); on CUDA also set "
      "CUBLAS_WORKSPACE_CONFIG=:4096:8.")
_rule("TT119", "adam-weight-decay", "warning",
      "X (weight decay pitfalls); T15; seeds/003 Pytorch 使用陷阱 §5 (L2正则不等于权值衰减)",
      "Adam with weight_decay is an L2 penalty that the adaptive step rescales: use AdamW for decoupled weight decay",
      "torch.optim.Adam adds weight_decay*w to the gradient, which is then divided by the running RMS "
      "of the gradient: weights with large gradients are hardly decayed, so it is not weight decay "
      "(Loshchilov & Hutter). AdamW applies the decay to the weights directly. Fix: "
      "torch.optim.AdamW(params, lr, weight_decay=...) (AdamW's usual values are larger, 0.01-0.1), "
      "or Adam(..., decoupled_weight_decay=True).")
_rule("TT120", "loader-without-pin-memory", "info",
      "D8, T5; seeds/003 pytorch训练数据准备 §1 (pin_memory); seeds/001 0x02 读取数据并行操作",
      "DataLoader without pin_memory=True feeds batches to CUDA: set pin_memory=True and copy with "
      "non_blocking=True",
      "Batches in pageable memory are copied to the GPU through a staging buffer, synchronously. With "
      "pin_memory=True the loader returns page-locked batches, and .to(device, non_blocking=True) "
      "copies them while the GPU computes. Fix: DataLoader(..., pin_memory=True) and "
      "x.to(device, non_blocking=True). Leave it off when the host is short of RAM (pinned memory "
      "cannot be swapped).")
_rule("TT121", "loader-without-workers", "info",
      "D8; seeds/001 0x02 读取数据并行操作 (num_workers); seeds/003 pytorch训练数据准备 §1",
      "DataLoader with num_workers=0 in a training loop: batches load in the training process while the "
      "device waits; set num_workers > 0",
      "With num_workers=0 (the default) every batch is read, decoded and collated in the training "
      "process between steps, so the accelerator idles meanwhile. Fix: "
      "DataLoader(..., num_workers=k, persistent_workers=True) with k up to the CPU cores "
      "(torch-tricks' loader tuner measures the best k). Keep 0 for data already in memory, or to "
      "debug.")

_rule("TT122", "scheduler-step-before-optimizer-step", "warning",
      "T21; seeds/003 Pytorch 使用陷阱 (学习率调度); PyTorch 1.1 release notes (the order of step())",
      "lr_scheduler.step() before optimizer.step() in the loop: the first value of the schedule is skipped; "
      "call it after optimizer.step()",
      "Since PyTorch 1.1 a scheduler's step() is meant to follow the optimizer's: called first (the "
      "older order), it moves the learning rate before the first update, so the schedule's first "
      "value is never used and every later change comes one step (or epoch) early; PyTorch warns at "
      "run time. Fix: in each iteration, optimizer.step() (or scaler.step(optimizer)) first, then "
      "scheduler.step(). Quiet when the scheduler step is guarded by an if in the loop (if epoch > 0: "
      "..., a warm-up switch) or comes after the optimizer's in the loop's order.")
_rule("TT123", "distributed-sampler-without-set-epoch", "warning",
      "T18; seeds/001 (DistributedSampler); torch.utils.data.distributed.DistributedSampler's documentation",
      "DistributedSampler without set_epoch(epoch): every epoch shuffles in the same order; call "
      "sampler.set_epoch(epoch) before each epoch",
      "A DistributedSampler shuffles with a generator seeded by seed + epoch, and its epoch only "
      "changes through set_epoch(). Without it every epoch visits the samples in the same order on "
      "every rank: the shuffling is done once, and the model sees the same batches each epoch. "
      "Fix: `sampler.set_epoch(epoch)` at the start of each epoch (before iterating the loader). "
      "Quiet with shuffle=False, when the file calls set_epoch anywhere, and where no training loop "
      "is in sight.")
_rule("TT124", "eval-without-train", "warning",
      "X (eval() without train() again); T13; seeds/003 测试阶段 §2 (model.eval() 与 model.train())",
      "model.eval() inside the training loop and no model.train() in it: after the first evaluation the "
      "model trains in eval mode (dropout off, BatchNorm statistics frozen); call model.train() again",
      "eval() switches dropout off and makes BatchNorm use (and stop updating) its running statistics, "
      "for every later forward until train() switches them back. An evaluation inside the epoch loop "
      "(directly, or in a helper the loop calls) with no train() anywhere in that loop leaves every "
      "following epoch training in eval mode: no regularisation from dropout, no statistics update, "
      "silently. Fix: model.train() at the start of each epoch (or at the end of the evaluation). "
      "Quiet when the loop calls train() anywhere, when the helper restores it itself, and in loops "
      "that do not train (no backward in them).")
_rule("TT125", "backward-under-no-grad", "error",
      "X (backward with autograd off); seeds/003 测试阶段 §2b (torch.no_grad)",
      "backward() where autograd is off (under torch.no_grad() / inference_mode / a decorated function): the "
      "loss has no graph and backward raises; compute the loss with autograd on",
      "Under torch.no_grad() (or inference_mode, or in a function decorated with either) no graph is "
      "recorded, so a loss computed there has no grad_fn and loss.backward() raises 'element 0 of "
      "tensors does not require grad' (inference_mode: a tensor created in inference mode cannot be "
      "saved for backward). It usually means a training step was put inside an evaluation block, or a "
      "whole function was decorated. Fix: compute the loss and call backward outside no_grad, or "
      "inside `with torch.enable_grad():`.")


def _check(rule_id: str):
    def register(fn):
        _CHECKS[rule_id] = fn
        return fn
    return register


# --------------------------------------------------------------------------- driving


def _enabled(select, ignore) -> list[str]:
    sel = None if select is None else check_rule_codes(select, "select")
    ign = check_rule_codes(ignore or (), "ignore")
    return [rid for rid in sorted(_RULES)
            if (sel is None or any(rid.startswith(c) for c in sel)) and not any(rid.startswith(c) for c in ign)]


def _parse(source: str, path: str) -> ast.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes: not ours to report
        return ast.parse(source, filename=path)


def _lint_tree(tree: ast.Module, source: str, path: str, enabled: list[str]) -> list[Finding]:
    file = _File(tree, source)
    found, seen = [], set()
    for rid in enabled:
        for node, message in _CHECKS[rid](file):
            line, col = node.lineno, file.column(node)
            if (rid, line, col) not in seen:
                seen.add((rid, line, col))
                found.append((rid, line, col, message))
    # Comments are tokenized only when a reported line mentions noqa: most files never pay.
    noqa = _noqa_lines(source) if any("noqa" in file.line(line).lower() for _, line, _, _ in found) else {}
    findings = [Finding(rule=rid, message=message, path=path, line=line, col=col, severity=_RULES[rid].severity)
                for rid, line, col, message in found
                if not (line in noqa and (noqa[line] is None or rid in noqa[line]))]
    findings.sort(key=_order)
    return findings


def _order(f: Finding):
    return (f.path, f.line, f.col, f.rule)


_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Za-z]+[0-9]+(?:[\s,]+[A-Za-z]+[0-9]+)*))?", re.IGNORECASE)


def _noqa_lines(source: str) -> dict[int, frozenset[str] | None]:
    """line -> None (bare ``# noqa``: everything) or the codes it names. Comments only:
    a ``noqa`` inside a string does not count."""
    if "noqa" not in source.lower():
        return {}
    out: dict[int, frozenset[str] | None] = {}
    try:
        comments = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
                    if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        comments = [(i, line[line.index("#"):]) for i, line in enumerate(source.splitlines(), 1) if "#" in line]
    for line, text in comments:
        m = _NOQA.search(text)
        if m:
            codes = m.group("codes")
            out[line] = None if codes is None else frozenset(c.upper() for c in re.split(r"[\s,]+", codes) if c)
    return out


_SKIP_DIRS = {"__pycache__", "node_modules", "venv", "site-packages"}


def _collect(paths: Iterable[str | Path], config: DoctorConfig) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise UserError(f"{p}: no such file or folder: give existing .py files or folders to lint")
        if path.is_file():
            files.append(path)
            continue
        found = []
        for folder, dirs, names in os.walk(path):
            base = Path(folder)
            dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d in _SKIP_DIRS
                                                      or (base / d / "pyvenv.cfg").exists()
                                                      or _excluded(base / d, config)))
            found.extend(base / n for n in names if n.endswith(".py") and not _excluded(base / n, config))
        files.extend(sorted(found))
    return list(dict.fromkeys(files))


def _excluded(path: Path, config: DoctorConfig) -> bool:
    """A pattern with a slash matches the path relative to the config's folder (or a
    leading part of it); one without matches any single path component."""
    if not config.exclude:
        return False
    try:
        rel = path.resolve().relative_to(config.root.resolve()).as_posix()
    except ValueError:
        rel = path.as_posix()
    parts = rel.split("/")
    for pat in config.exclude:
        pat = pat.rstrip("/")
        if "/" in pat:
            if any(fnmatch("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1)):
                return True
        elif any(fnmatch(part, pat) for part in parts):
            return True
    return False


def _read(path: Path) -> str:
    """The file's text in its declared encoding (PEP 263), UTF-8 by default."""
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:  # undecodable first lines, or an unknown coding cookie
        encoding = "utf-8"
    return data.decode(encoding)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"does not parse: {exc.msg} (line {exc.lineno})"
    if isinstance(exc, UnicodeDecodeError):
        return f"not {exc.encoding} text (bad byte at offset {exc.start})"
    if isinstance(exc, OSError):
        return f"cannot read: {exc.strerror or exc}"
    if isinstance(exc, (RecursionError, MemoryError)):
        return "nested too deeply to analyse"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# --------------------------------------------------------------------------- vocabulary

_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_SCOPES = (ast.Module, ast.ClassDef) + _FUNCS + _COMPS
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_NOWHERE = (10**9, 0)

_ACT_FUNCS = {"torch.nn.functional.log_softmax": "log_softmax", "torch.log_softmax": "log_softmax",
              "torch.special.log_softmax": "log_softmax",
              "torch.nn.functional.softmax": "softmax", "torch.softmax": "softmax", "torch.special.softmax": "softmax",
              "torch.sigmoid": "sigmoid", "torch.nn.functional.sigmoid": "sigmoid", "torch.special.expit": "sigmoid"}
_ACT_METHODS = {"log_softmax": "log_softmax", "softmax": "softmax", "sigmoid": "sigmoid"}
_ACT_MODULES = {"torch.nn.LogSoftmax": "log_softmax", "torch.nn.Softmax": "softmax", "torch.nn.Sigmoid": "sigmoid"}
_ACTS = frozenset(_ACT_METHODS.values())

_F_LOSSES = frozenset("""cross_entropy nll_loss mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
    binary_cross_entropy_with_logits kl_div poisson_nll_loss gaussian_nll_loss ctc_loss margin_ranking_loss
    hinge_embedding_loss multilabel_margin_loss soft_margin_loss multilabel_soft_margin_loss
    cosine_embedding_loss multi_margin_loss triplet_margin_loss triplet_margin_with_distance_loss""".split())
_TENSOR_FUNCS = frozenset("""tensor as_tensor asarray from_numpy frombuffer zeros ones empty full rand randn randint
    randperm arange linspace logspace eye zeros_like ones_like empty_like full_like rand_like randn_like
    randint_like normal bernoulli multinomial stack cat concat concatenate hstack vstack dstack matmul mm bmm
    einsum exp log log1p sqrt rsqrt abs sum mean std var prod where clamp clip tanh relu max min amax amin
    argmax argmin sort topk gather index_select masked_select norm cdist pow square add sub mul div
    flatten reshape transpose permute squeeze unsqueeze chunk split tensor_split roll flip cumsum
    outer dot baddbmm addmm conv2d softmax log_softmax sigmoid
    Tensor FloatTensor LongTensor IntTensor ByteTensor BoolTensor DoubleTensor HalfTensor""".split())
_NON_TENSOR_METHODS = frozenset("""item tolist numpy size dim ndimension numel element_size nelement
    data_ptr is_contiguous is_floating_point storage untyped_storage stride get_device backward
    register_hook __len__ type""".split())
_VIEW_METHODS = frozenset("""view reshape flatten squeeze unsqueeze permute transpose contiguous float double
    half bfloat16 to cuda cpu type_as view_as reshape_as narrow""".split())
_MODULE_SELF_METHODS = frozenset("""to cuda cpu half float double bfloat16 train eval requires_grad_
    share_memory apply type to_empty xpu ipu mtia""".split())
_MOVE_METHODS = frozenset("cuda cpu to half float double bfloat16 long int short byte char bool pin_memory type"
                          .split())
_STATELESS_MODULES = frozenset("torch.nn." + n for n in """ReLU ReLU6 LeakyReLU GELU SiLU Mish ELU CELU SELU
    Tanh Sigmoid Hardtanh Hardswish Hardsigmoid Softplus Softsign Softshrink Hardshrink Tanhshrink LogSigmoid
    Softmax LogSoftmax Softmin Softmax2d Threshold GLU Identity Flatten Unflatten MaxPool1d MaxPool2d
    MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d
    AdaptiveMaxPool1d AdaptiveMaxPool2d AdaptiveMaxPool3d LPPool1d LPPool2d Upsample UpsamplingNearest2d
    UpsamplingBilinear2d PixelShuffle PixelUnshuffle ChannelShuffle ZeroPad2d ConstantPad1d ConstantPad2d
    ConstantPad3d ReflectionPad1d ReflectionPad2d ReplicationPad1d ReplicationPad2d""".split())
_RNN_MODULES = frozenset({"torch.nn.RNN", "torch.nn.LSTM", "torch.nn.GRU"})
_CONTAINERS = frozenset({"torch.nn.ModuleList", "torch.nn.ModuleDict", "torch.nn.Sequential",
                         "torch.nn.ParameterList", "torch.nn.ParameterDict"})
_DROPOUT_FNS = frozenset("torch.nn.functional." + n for n in
                         "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout".split())
_NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode"})
_CLOCKS = frozenset({"time.time", "time.perf_counter", "time.monotonic", "time.time_ns",
                     "time.perf_counter_ns", "time.monotonic_ns", "timeit.default_timer"})
_SYNC_FUNCS = frozenset({"torch.cuda.synchronize", "torch.cuda.current_stream", "torch.cuda.default_stream",
                         "torch.cuda.Event", "torch.cuda.Stream", "torch.accelerator.synchronize",
                         "torch.mps.synchronize", "torch.xpu.synchronize", "torch.distributed.barrier"})
_SYNC_METHODS = frozenset("synchronize item tolist numpy cpu elapsed_time wait".split())
_SAFE_BUILTINS = frozenset("""range len enumerate zip list dict tuple set str repr isinstance issubclass min
    max sum abs round sorted reversed iter next getattr setattr hasattr super type format any all map filter
    divmod hash id""".split())
_TQDM = frozenset({"tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.trange"})
_LOADERISH = re.compile(r"(?:^|_)(?:data)?loader$|^dl$|_dl$", re.IGNORECASE)
_DATALOADER = "torch.utils.data.DataLoader"
_WRAPPERS = frozenset({"torch.nn.DataParallel", "torch.nn.DistributedDataParallel", "torch.compile"})
_RENAMED = {"torch.nn.functional.sigmoid": "torch.sigmoid", "torch.special.expit": "torch.sigmoid",
            "torch.serialization.load": "torch.load", "torch.autograd.no_grad": "torch.no_grad",
            "torch.autograd.grad_mode.no_grad": "torch.no_grad",
            "torch.autograd.inference_mode": "torch.inference_mode",
            "torch.autograd.grad_mode.inference_mode": "torch.inference_mode",
            "torch.autograd.set_grad_enabled": "torch.set_grad_enabled",
            "torch.autograd.grad_mode.set_grad_enabled": "torch.set_grad_enabled",
            "torch.autograd.enable_grad": "torch.enable_grad", "torch.nn.parameter.Parameter": "torch.nn.Parameter",
            "tqdm.auto.trange": "tqdm.trange"}


def _canon(q: str | None) -> str | None:
    """One spelling per torch object: ``torch.nn.modules.loss.CrossEntropyLoss`` is
    ``torch.nn.CrossEntropyLoss``, ``torch.utils.data.dataloader.DataLoader`` is
    ``torch.utils.data.DataLoader``."""
    if q is None:
        return None
    parts = q.split(".")
    if q.startswith("torch.nn.modules.") and len(parts) >= 4 and parts[-1][:1].isupper():
        return "torch.nn." + parts[-1]
    if q.startswith("torch.nn.parallel.") and parts[-1] in ("DataParallel", "DistributedDataParallel"):
        return "torch.nn." + parts[-1]
    if q.startswith("torch.utils.data.") and parts[-1] == "DataLoader":
        return _DATALOADER
    if q.startswith("torch.optim.") and len(parts) == 4 and parts[-1][:1].isupper() \
            and parts[2] not in ("lr_scheduler", "swa_utils"):  # torch.optim.adamw.AdamW; a scheduler keeps its module
        return "torch.optim." + parts[-1]
    return _RENAMED.get(q, q)


def _is_torch_nn_class(q: str | None) -> bool:
    return bool(q) and q.startswith("torch.nn.") and q.count(".") == 2 and q[9:10].isupper()


def _is_loss(q: str | None) -> bool:
    return bool(q) and ((_is_torch_nn_class(q) and q.endswith("Loss"))
                        or (q.startswith("torch.nn.functional.") and q[20:] in _F_LOSSES))


def _pos(node: ast.AST) -> tuple[int, int]:
    return (node.lineno, node.col_offset)


def _end(node: ast.AST) -> tuple[int, int]:
    return (node.end_lineno, node.end_col_offset)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _kwarg(call: ast.Call, name: str, index: int | None = None) -> ast.AST | None:
    """The argument ``name`` of ``call`` (by keyword, or at positional ``index``)."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    if index is not None and len(call.args) > index and not any(
            isinstance(a, ast.Starred) for a in call.args[:index + 1]):
        return call.args[index]
    return None


def _has_star_args(call: ast.Call) -> bool:
    return any(kw.arg is None for kw in call.keywords) or any(isinstance(a, ast.Starred) for a in call.args)


def _number(node: ast.AST | None) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    return None


def _walk_local(root: ast.AST, into_loops: bool = True) -> Iterator[ast.AST]:
    """Nodes under ``root`` without entering nested functions and classes (their code runs
    elsewhere), nor nested loops if ``into_loops`` is False."""
    stack = list(ast.iter_child_nodes(root))[::-1]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _FUNCS + (ast.ClassDef,)) or (not into_loops and isinstance(node, _LOOPS)):
            continue
        stack.extend(list(ast.iter_child_nodes(node))[::-1])


_RECORDED = frozenset({ast.Name, ast.Call, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor,
                       ast.comprehension, ast.With, ast.AsyncWith, ast.NamedExpr, ast.FunctionDef,
                       ast.AsyncFunctionDef, ast.ClassDef, ast.arguments, ast.Import, ast.ImportFrom, ast.Global,
                       ast.Nonlocal, ast.ExceptHandler, ast.Delete})


@dataclass(frozen=True)
class _Kind:
    """What an expression evaluates to, as far as the file shows."""

    # tensor | batch | module | lossfn | loader | device | optimizer | scheduler | params | named_params | self | class
    # | func
    cat: str
    # tensor: log_softmax, softmax, sigmoid, loss, param, batch, expanded; module/lossfn: qualname or "local"
    detail: str | None = None
    ref: object = None  # ClassDef for local modules and self; the constructor Call; a FunctionDef

    def key(self):
        return (self.cat, self.detail, self.ref if isinstance(self.ref, (ast.ClassDef, ast.FunctionDef)) else None)


_TENSOR = _Kind("tensor")
_LOSS = _Kind("tensor", "loss")
_PARAM = _Kind("tensor", "param")
_BATCH = _Kind("tensor", "batch")


# --------------------------------------------------------------------------- one file


class _File:
    """A parsed file with what the rules ask of it: parents, scopes, name bindings,
    import aliases, and the kind of an expression (memoised)."""

    def __init__(self, tree: ast.Module, source: str):
        self.tree = tree
        self.lines = re.split(r"\r\n|\r|\n", source)
        self.parent: dict[ast.AST, ast.AST] = {}
        self.scope_of: dict[ast.AST, ast.AST | None] = {}
        self.bindings: dict[ast.AST, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self.uses: dict[ast.AST, dict[str, list[ast.Name]]] = defaultdict(lambda: defaultdict(list))
        self.global_names: dict[ast.AST, set[str]] = defaultdict(set)
        self.nodes: dict[type, list[ast.AST]] = defaultdict(list)
        self.aliases: dict[str, str] = {}
        self.classes: dict[str, ast.ClassDef] = {}
        self.plain_functions: dict[str, list[ast.AST]] = defaultdict(list)
        self.calls_by_name: dict[str, list[ast.Call]] = defaultdict(list)
        self.self_attrs: dict[ast.ClassDef, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self._kinds: dict[ast.AST, _Kind | None] = {}
        self._qualnames: dict[ast.AST, str | None] = {}
        self._busy: set = set()
        self._memo: dict = {}
        self._index()

    # ---- indexing

    def _index(self) -> None:
        stack: list[tuple[ast.AST, ast.AST | None]] = [(self.tree, None)]
        scope_of, parent, nodes = self.scope_of, self.parent, self.nodes
        while stack:
            node, scope = stack.pop()
            scope_of[node] = scope
            nodes[type(node)].append(node)
            if type(node) in _RECORDED:
                self._record(node, scope)
            inner = node if isinstance(node, _SCOPES) else scope
            children = []
            for name in node._fields:
                value = getattr(node, name, None)
                if isinstance(value, ast.AST):
                    children.append(value)
                elif isinstance(value, list):
                    children.extend(v for v in value if isinstance(v, ast.AST))
            for child in reversed(children):
                parent[child] = node
                stack.append((child, inner))
        for table in self.bindings.values():
            for binds in table.values():
                binds.sort(key=lambda b: b[0])

    def _record(self, node: ast.AST, scope: ast.AST | None) -> None:
        if isinstance(node, ast.Name):
            self.uses[self._function_scope(scope)][node.id].append(node)
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name):
                self.calls_by_name[node.func.id].append(node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind(scope, target, node.value, _end(node), node)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self._bind(scope, node.target, node.value, _end(node), node)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            self._add(scope, node.target.id, (_end(node), "aug", node, None))
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._bind_loop(scope, node.target, node, _end(node.iter))
        elif isinstance(node, ast.comprehension):
            self._bind_loop(scope, node.target, node, (0, 0))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    self._bind(scope, item.optional_vars, None, _end(item.context_expr), node)
        elif isinstance(node, ast.NamedExpr):
            self._bind(scope, node.target, node.value, _end(node), node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self._add(scope, node.name, (_pos(node), "def", node, None))
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif not isinstance(self.parent.get(node), ast.ClassDef):
                self.plain_functions[node.name].append(node)
        elif isinstance(node, ast.arguments):
            func = self.parent.get(node)
            for arg in node.posonlyargs + node.args + node.kwonlyargs + [node.vararg, node.kwarg]:
                if arg is not None:
                    self._add(func, arg.arg, ((0, 0), "param", func, arg.arg))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if isinstance(node, ast.Import):
                    local = alias.asname or alias.name.split(".")[0]
                    self.aliases[local] = alias.name if alias.asname else local
                elif node.level == 0 and node.module and alias.name != "*":
                    local = alias.asname or alias.name
                    self.aliases[local] = f"{node.module}.{alias.name}"
                else:
                    continue
                self._add(scope, local, (_end(node), "import", node, None))
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            self.global_names[scope].update(node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            self._add(scope, node.name, (_pos(node), "unknown", node, None))
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    self._add(scope, t.id, (_end(node), "unknown", node, None))

    def _add(self, scope, name: str, binding: tuple) -> None:
        self.bindings[scope][name].append(binding)

    def _bind(self, scope, target, value, pos, stmt, path: tuple = ()) -> None:
        if isinstance(target, ast.Name):
            self._add(scope, target.id, (pos, "value", value, path))
        elif isinstance(target, (ast.Tuple, ast.List)):
            if (not path and isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
                    and not any(isinstance(e, ast.Starred) for e in value.elts + target.elts)):
                for t, v in zip(target.elts, value.elts):
                    self._bind(scope, t, v, pos, stmt)
            else:
                for i, t in enumerate(target.elts):
                    self._bind(scope, t, value if not isinstance(t, ast.Starred) else None, pos, stmt, path + (i,))
        elif isinstance(target, ast.Starred):
            self._bind(scope, target.value, None, pos, stmt)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and value is not None:
            method = scope if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
            cls = self.parent.get(method) if method is not None else None
            args = method.args.posonlyargs + method.args.args if method is not None else []
            if isinstance(cls, ast.ClassDef) and args and args[0].arg == target.value.id:
                self.self_attrs[cls][target.attr].append((value, path, stmt))

    def _bind_loop(self, scope, target, loop, pos, path: tuple = ()) -> None:
        if isinstance(target, ast.Name):
            self._add(scope, target.id, (pos, "for", loop, path))
        elif isinstance(target, (ast.Tuple, ast.List)):
            for i, t in enumerate(target.elts):
                self._bind_loop(scope, t, loop, pos, path + (i,))
        elif isinstance(target, ast.Starred):
            self._bind_loop(scope, target.value, loop, pos, path + (None,))

    # ---- positions and structure

    def line(self, lineno: int) -> str:
        return self.lines[lineno - 1] if 0 < lineno <= len(self.lines) else ""

    def column(self, node: ast.AST) -> int:
        """1-based column in characters (ast counts UTF-8 bytes)."""
        line = self.line(node.lineno)
        if line.isascii():
            return node.col_offset + 1
        return len(line.encode("utf-8")[:node.col_offset].decode("utf-8", "replace")) + 1

    def _function_scope(self, scope):
        while isinstance(scope, _COMPS + (ast.ClassDef,)) and scope is not None:
            scope = self.scope_of.get(scope)
        return scope

    def function_scope(self, node: ast.AST):
        """The function (or module) whose frame runs ``node``: comprehensions run inline."""
        return self._function_scope(self.scope_of.get(node))

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        node = self.parent.get(node)
        while node is not None:
            yield node
            node = self.parent.get(node)

    def local_ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        """Ancestors up to (not including) the enclosing function or class."""
        for anc in self.ancestors(node):
            if isinstance(anc, _FUNCS + (ast.ClassDef, ast.Module)):
                return
            yield anc

    def loops_around(self, node: ast.AST) -> list[ast.AST]:
        return [a for a in self.local_ancestors(node) if isinstance(a, _LOOPS)]

    def method_class(self, node: ast.AST) -> ast.ClassDef | None:
        """The nn.Module subclass whose method (or a function nested in one) holds ``node``."""
        for anc in self.ancestors(node):
            if isinstance(anc, ast.ClassDef):
                return anc if self.is_module_class(anc) else None
        return None

    def qualname(self, node: ast.AST) -> str | None:
        """The dotted name ``node`` refers to through the file's imports, canonical."""
        try:
            return self._qualnames[node]
        except KeyError:
            pass
        q = None
        dotted = _dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if dotted is not None:
            head, _, rest = dotted.partition(".")
            if head in self.aliases:
                q = _canon(self.aliases[head] + ("." + rest if rest else ""))
        self._qualnames[node] = q
        return q

    @property
    def mentions_cuda(self) -> bool:
        """The file uses CUDA somewhere (``.cuda``, ``torch.cuda``, a ``"cuda..."`` device)."""
        if "cuda" not in self._memo:
            self._memo["cuda"] = any(n.attr == "cuda" for n in self.nodes[ast.Attribute]) or any(
                isinstance(n.value, str) and n.value.startswith("cuda") for n in self.nodes[ast.Constant])
        return self._memo["cuda"]

    # ---- names

    def lookup(self, node: ast.Name):
        """The binding of ``node`` where it is read: the latest one before it in its own
        function, else the last one in an enclosing function or the module."""
        name, pos = node.id, _pos(node)
        scope, own = self.scope_of.get(node), True
        while scope is not None:
            if isinstance(scope, ast.ClassDef) and not own:
                scope = self.scope_of.get(scope)
                continue
            if name in self.global_names.get(scope, ()):
                scope, own = self.tree, False
            binds = self.bindings.get(scope, {}).get(name)
            if binds:
                if not own:
                    return binds[-1]
                before = [b for b in binds if b[0] <= pos]
                if before:
                    return before[-1]
                if not isinstance(scope, _COMPS):
                    return None  # bound later in this function: a loop-carried value
            own = own and isinstance(scope, _COMPS)
            scope = self.scope_of.get(scope)
        return None

    def binding_value(self, node: ast.AST) -> ast.AST | None:
        """The expression a Name was last assigned (plain ``x = expr`` only)."""
        if isinstance(node, ast.Name):
            b = self.lookup(node)
            if b is not None and b[1] == "value" and not b[3]:
                return b[2]
        return None

    # ---- kinds

    def kind(self, node: ast.AST | None) -> _Kind | None:
        """What ``node`` evaluates to, or None when the file does not show it."""
        if node is None:
            return None
        if node in self._kinds:
            return self._kinds[node]
        if node in self._busy or len(self._busy) > 60:
            return None
        self._busy.add(node)
        try:
            k = self._kind(node)
        finally:
            self._busy.discard(node)
        self._kinds[node] = k
        return k

    def _kind(self, node: ast.AST) -> _Kind | None:
        if isinstance(node, ast.Name):
            b = self.lookup(node)
            return self._binding_kind(b) if b is not None else None
        if isinstance(node, ast.Call):
            return self._call_kind(node)
        if isinstance(node, ast.Attribute):
            return self._attribute_kind(node)
        if isinstance(node, ast.Subscript):
            k = self.kind(node.value)
            if k is not None and k.cat == "batch":
                return _BATCH
            if k is not None and k.cat == "tensor":
                return _Kind("tensor", k.detail if k.detail in _ACTS or k.detail == "batch" else None)
            return None
        if isinstance(node, ast.BinOp):
            for side in (node.left, node.right):
                k = self.kind(side)
                if k is not None and k.cat == "tensor":
                    return _TENSOR
            return None
        if isinstance(node, ast.IfExp):
            a, b = self.kind(node.body), self.kind(node.orelse)
            return a if a is not None and b is not None and a.key() == b.key() else None
        return None

    def _binding_kind(self, b) -> _Kind | None:
        _, how, a, extra = b
        if how == "value":
            k = self.kind(a)
            if extra and k is not None:  # unpacking: elements of a tensor (torch.max, chunk) are tensors
                return _TENSOR if k.cat == "tensor" else None
            return k
        if how == "for":
            return self._element_kind(a.iter, extra)
        if how == "aug":
            return self.kind(a.target) if self.lookup(a.target) is not b else None
        if how == "param":
            return self._param_kind(a, extra)
        if how == "def":
            return _Kind("class", ref=a) if isinstance(a, ast.ClassDef) else _Kind("func", ref=a)
        return None

    def _element_kind(self, it: ast.AST, path: tuple) -> _Kind | None:
        """The kind of the loop variable at ``path`` in ``for <target> in it``."""
        while isinstance(it, ast.Call) and it.args:
            fn = self.qualname(it.func) or (it.func.id if isinstance(it.func, ast.Name) else None)
            if fn == "enumerate":
                if not path or path[0] != 1:
                    return None
                path, it = path[1:], it.args[0]
            elif fn in _TQDM or fn in ("iter", "tqdm"):
                it = it.args[0]
            else:
                break
        k = self.kind(it)
        if k is None and self.looks_like_loader(it):
            k = _Kind("loader")
        if k is None:
            return None
        if k.cat == "loader":
            if path or (isinstance(k.ref, ast.Call) and _kwarg(k.ref, "collate_fn", 6) is None):
                return _BATCH  # an element of a batch, or a default-collated batch: tensors
            return _Kind("batch")  # a whole batch from a custom collate: maybe an object with an in-place .to()
        if k.cat == "params":
            return _PARAM if not path else None
        if k.cat == "named_params":
            return _PARAM if path == (1,) else None
        if k.cat == "tensor" and not path:
            return _TENSOR
        return None

    def looks_like_loader(self, node: ast.AST) -> bool:
        dotted = _dotted(node)
        return dotted is not None and bool(_LOADERISH.search(dotted.rsplit(".", 1)[-1]))

    def _param_kind(self, func: ast.AST, name: str) -> _Kind | None:
        """A parameter's kind: ``self`` in a method; for a plain function, the kind every
        call in this file passes (when they all agree)."""
        if isinstance(func, ast.Lambda):
            return None
        positional = func.args.posonlyargs + func.args.args
        cls = self.parent.get(func)
        if isinstance(cls, ast.ClassDef):
            decorators = {_dotted(d) for d in func.decorator_list}
            if positional and positional[0].arg == name and not decorators & {"staticmethod", "classmethod"}:
                return _Kind("self", ref=cls)
            return None
        if len(self.plain_functions.get(func.name, ())) != 1:
            return None
        index = next((i for i, a in enumerate(positional) if a.arg == name), None)
        kinds = []
        for call in self.calls_by_name.get(func.name, ()):
            arg = _kwarg(call, name, index)
            if arg is None:
                return None
            kinds.append(self.kind(arg))
        if not kinds or any(k is None for k in kinds):
            return None
        if all(k.key() == kinds[0].key() for k in kinds):
            return kinds[0]
        if all((k.cat, k.detail) == (kinds[0].cat, kinds[0].detail) for k in kinds):
            return _Kind(kinds[0].cat, kinds[0].detail)
        return None

    def _attribute_kind(self, node: ast.Attribute) -> _Kind | None:
        if self.qualname(node) is not None:
            return None  # a module-level name such as torch.float16
        rk = self.kind(node.value)
        if node.attr in ("weight", "bias", "grad"):
            return _PARAM if rk is None or rk.cat in ("module", "self", "tensor") else None
        if rk is None:
            return None
        if rk.cat == "tensor" and node.attr in ("data", "T", "mT", "H", "mH", "real", "imag"):
            return _PARAM if rk.detail == "param" else _TENSOR
        if rk.cat == "self" or (rk.cat == "module" and rk.detail == "local"):
            return self._self_attr_kind(rk.ref, node.attr)
        return None

    def _self_attr_kind(self, cls, attr: str, seen=None) -> _Kind | None:
        if not isinstance(cls, ast.ClassDef):
            return None
        entries = self.self_attrs.get(cls, {}).get(attr)
        if entries:
            kinds = []
            for value, path, _ in entries:
                k = self.kind(value)
                kinds.append((_TENSOR if k is not None and k.cat == "tensor" else None) if path else k)
            if kinds[0] is not None and all(k is not None and k.key() == kinds[0].key() for k in kinds):
                return kinds[0]
            return None
        seen = (seen or set()) | {cls}
        for base in self.local_bases(cls):
            if base not in seen:
                k = self._self_attr_kind(base, attr, seen)
                if k is not None:
                    return k
        return None

    def _call_kind(self, node: ast.Call) -> _Kind | None:
        func = node.func
        q = self.qualname(func)
        if q is not None:
            return self._constructor_kind(q, node)
        if isinstance(func, ast.Attribute):
            m = func.attr
            if m in _ACT_METHODS:
                return _Kind("tensor", _ACT_METHODS[m])
            if m in ("expand", "expand_as"):
                return _Kind("tensor", "expanded")
            rk = self.kind(func.value)
            if rk is None or rk.cat in ("module", "self"):
                if m in ("parameters", "buffers"):
                    return _Kind("params")
                if m in ("named_parameters", "named_buffers"):
                    return _Kind("named_params")
            if rk is not None:
                if rk.cat == "tensor":
                    if m in _NON_TENSOR_METHODS:
                        return None
                    if m in _VIEW_METHODS:
                        return _Kind("tensor", rk.detail if rk.detail in _ACTS else None)
                    return _TENSOR
                if rk.cat in ("module", "lossfn") and m in _MODULE_SELF_METHODS:
                    return rk
                if rk.cat == "self" and m in _MODULE_SELF_METHODS:
                    return _Kind("module", "local", rk.ref) if self.is_module_class(rk.ref) else None
        fk = self.kind(func)  # a callable object: a loss, a module (self.fc, model.encoder), a class
        if fk is None:
            return None
        if fk.cat == "lossfn":
            return _LOSS
        if fk.cat == "class":
            return _Kind("module", "local", fk.ref) if self.is_module_class(fk.ref) else None
        if fk.cat == "module" and fk.detail in _RNN_MODULES:
            return None  # (output, state): output is a PackedSequence when the input was packed
        if fk.cat == "module" or (fk.cat == "self" and self.is_module_class(fk.ref)):
            return _Kind("tensor", self.output_activation(fk))
        return None

    def _constructor_kind(self, q: str, node: ast.Call) -> _Kind | None:
        last = q.rsplit(".", 1)[-1]
        if q in _WRAPPERS and node.args:  # DataParallel(model), DDP(model), torch.compile(model) call model
            k = self.kind(node.args[0])
            return k if k is not None and k.cat == "module" else None
        if q in _ACT_FUNCS:
            return _Kind("tensor", _ACT_FUNCS[q])
        if q.startswith("torch.nn.functional."):
            return _LOSS if last in _F_LOSSES else _TENSOR
        if q in ("torch.nn.Parameter", "torch.nn.UninitializedParameter"):
            return _PARAM
        if _is_torch_nn_class(q):
            return _Kind("lossfn" if last.endswith("Loss") else "module", q, node)
        if q == _DATALOADER:
            return _Kind("loader", q, node)
        if q == "torch.device":
            return _Kind("device", None, node)
        if q.startswith("torch.optim.") and q.count(".") == 2 and last[:1].isupper():
            return _Kind("optimizer", q, node)
        if q.startswith("torch.optim.lr_scheduler.") and last[:1].isupper():
            return _Kind("scheduler", q, node)
        if q.startswith("torchvision.models.") and last[:1].islower():
            return _Kind("module", q, node)
        if q == "torch.broadcast_to":
            return _Kind("tensor", "expanded")
        if (q.startswith("torch.") and q.count(".") == 1 and last in _TENSOR_FUNCS) or \
                q.startswith(("torch.linalg.", "torch.fft.", "torch.special.")):
            return _TENSOR
        return None

    def output_activation(self, k: _Kind) -> str | None:
        """``softmax``/``log_softmax``/``sigmoid`` if calling this module returns that."""
        if k.cat == "self" or (k.cat == "module" and k.detail == "local"):
            return self.forward_activation(k.ref)
        if k.cat == "module":
            if k.detail in _ACT_MODULES:
                return _ACT_MODULES[k.detail]
            if k.detail == "torch.nn.Sequential" and isinstance(k.ref, ast.Call) and k.ref.args:
                last = self.kind(k.ref.args[-1])
                if last is not None and last.cat == "module" and last is not k:
                    return self.output_activation(last)
        return None

    def forward_activation(self, cls) -> str | None:
        if not isinstance(cls, ast.ClassDef):
            return None
        key = ("fwd", cls)
        if key not in self._memo:
            self._memo[key] = None
            forward = self.method(cls, "forward")
            acts = set()
            if forward is not None:
                for node in _walk_local(forward):
                    if isinstance(node, ast.Return):
                        k = self.kind(node.value) if node.value is not None else None
                        acts.add(k.detail if k is not None and k.cat == "tensor" else None)
            if len(acts) == 1 and next(iter(acts)) in _ACTS:
                self._memo[key] = acts.pop()
        return self._memo[key]

    def method(self, cls: ast.ClassDef, name: str, seen=None):
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                return stmt
        seen = (seen or set()) | {cls}
        for base in self.local_bases(cls):
            if base not in seen:
                found = self.method(base, name, seen)
                if found is not None:
                    return found
        return None

    def local_bases(self, cls: ast.ClassDef) -> list[ast.ClassDef]:
        return [self.classes[b.id] for b in cls.bases
                if isinstance(b, ast.Name) and b.id in self.classes and self.classes[b.id] is not cls]

    def is_module_class(self, cls) -> bool:
        """``cls`` derives from torch.nn.Module (directly, through an nn class, a Lightning
        module, or another class of this file)."""
        if not isinstance(cls, ast.ClassDef):
            return False
        key = ("module", cls)
        if key not in self._memo:
            self._memo[key] = False
            found = False
            for base in cls.bases:
                q = self.qualname(base)
                if q is not None and ((_is_torch_nn_class(q) and q != "torch.nn.Parameter")
                                      or q.rsplit(".", 1)[-1] == "LightningModule"):
                    found = True
            found = found or any(self.is_module_class(b) for b in self.local_bases(cls))
            self._memo[key] = found
        return self._memo[key]

    # ---- gradient mode

    def _grad_mode(self, expr: ast.AST) -> str | None:
        """'off' if ``with expr:`` / ``@expr`` disables autograd, 'on' if it enables it."""
        call = expr if isinstance(expr, ast.Call) else None
        q = self.qualname(call.func if call is not None else expr)
        if q in _NO_GRAD:
            flag = _kwarg(call, "mode", 0) if call is not None and q == "torch.inference_mode" else None
            return "on" if isinstance(flag, ast.Constant) and flag.value is False else "off"
        if q == "torch.enable_grad":
            return "on"
        if q == "torch.set_grad_enabled" and call is not None:
            flag = _kwarg(call, "mode", 0)
            if isinstance(flag, ast.Constant) and isinstance(flag.value, bool):
                return "on" if flag.value else "off"
        return None

    def no_grad(self, node: ast.AST) -> bool:
        """``node`` runs with autograd off: inside ``with torch.no_grad()`` (or
        inference_mode / set_grad_enabled(False)) in its function, under a decorated
        function, or after a ``torch.set_grad_enabled(False)`` statement."""
        inside = True
        child = node
        for anc in self.ancestors(node):
            if inside and isinstance(anc, (ast.With, ast.AsyncWith)) and child in anc.body:
                for item in anc.items:
                    mode = self._grad_mode(item.context_expr)
                    if mode is not None:
                        return mode == "off"
            if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for deco in anc.decorator_list:
                    mode = self._grad_mode(deco)
                    if mode is not None:
                        return mode == "off"
                if inside and self._grad_disabled_before(anc, node):
                    return True
                inside = False
            child = anc
        return inside and self._grad_disabled_before(self.tree, node)

    def _grad_disabled_before(self, scope: ast.AST, node: ast.AST) -> bool:
        state = None
        for stmt in _walk_local(scope):
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and _pos(stmt) < _pos(node):
                q = self.qualname(stmt.value.func)
                if q == "torch.set_grad_enabled":
                    state = self._grad_mode(stmt.value)
        return state == "off"

    # ---- calls grouped by frame

    def calls_in(self, scope: ast.AST) -> list[ast.Call]:
        """The calls that run in ``scope``'s frame, in source order."""
        if "by_frame" not in self._memo:
            groups = defaultdict(list)
            for call in self.nodes[ast.Call]:
                groups[self.function_scope(call)].append(call)
            for calls in groups.values():
                calls.sort(key=_pos)
            self._memo["by_frame"] = groups
        return self._memo["by_frame"].get(scope, [])

    def backward_mentions(self, scope: ast.AST, name: str) -> bool:
        """A ``.backward()`` (or autograd.backward/grad) in ``scope`` is called on an
        expression that uses ``name``, directly or through a variable assigned from it."""
        for call in self.calls_in(scope):
            q = self.qualname(call.func)
            if _is_backward(call):
                exprs = [call.func.value]
            elif q in ("torch.autograd.backward", "torch.autograd.grad"):
                exprs = list(call.args[:1])
            else:
                continue
            for expr in exprs:
                for n in [expr, *ast.walk(expr)]:
                    if isinstance(n, ast.Name):
                        if n.id == name:
                            return True
                        value = self.binding_value(n)
                        if value is not None and any(isinstance(v, ast.Name) and v.id == name for v in ast.walk(value)):
                            return True
        return False


# --------------------------------------------------------------------------- the checks


@_check("TT101")
def _module_in_plain_container(f: _File):
    for cls in f.nodes[ast.ClassDef]:
        if not f.is_module_class(cls):
            continue
        wrapped, registers = set(), False
        for node in _walk_local(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in _walk_local(node):
                    if isinstance(inner, ast.Call):
                        if f.qualname(inner.func) in _CONTAINERS:
                            wrapped.update(a.attr for a in ast.walk(inner) if isinstance(a, ast.Attribute))
                        name = _dotted(inner.func) or ""
                        registers = registers or name.rsplit(".", 1)[-1] in ("add_module", "register_module") \
                            or name == "setattr"
        if registers:
            continue
        for method in cls.body:
            if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = method.args.posonlyargs + method.args.args
            if not args:
                continue
            me = args[0].arg
            empty: dict[str, str] = {}
            for node in sorted((n for n in _walk_local(method) if isinstance(n, (ast.Assign, ast.Call))), key=_pos):
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    target = node.targets[0]
                    if _is_self_attr(target, me):
                        container = _container(node.value)
                        if container and _is_empty(node.value):
                            empty[target.attr] = container
                        elif container and _holds_modules(f, node.value) and target.attr not in wrapped:
                            yield node, _plain_message(container, target.attr)
                    elif (isinstance(target, ast.Subscript) and _is_self_attr(target.value, me)
                          and target.value.attr in empty and target.value.attr not in wrapped
                          and _is_module(f, node.value)):
                        yield node, _plain_message(empty[target.value.attr], target.value.attr)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr in ("append", "extend", "insert", "update")
                      and _is_self_attr(node.func.value, me) and node.func.value.attr in empty
                      and node.func.value.attr not in wrapped
                      and any(_is_module(f, a) or _holds_modules(f, a) for a in node.args)):
                    yield node, _plain_message(empty[node.func.value.attr], node.func.value.attr)


def _is_self_attr(node: ast.AST, me: str) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me


def _container(node: ast.AST) -> str | None:
    if isinstance(node, (ast.List, ast.ListComp)):
        return "list"
    if isinstance(node, ast.Tuple):
        return "tuple"
    if isinstance(node, ast.GeneratorExp):
        return "generator"
    if isinstance(node, (ast.Dict, ast.DictComp)):
        return "dict"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "tuple", "dict"):
        return node.func.id
    return None


def _is_empty(node: ast.AST) -> bool:
    return ((isinstance(node, (ast.List, ast.Tuple)) and not node.elts)
            or (isinstance(node, ast.Dict) and not node.keys)
            or (isinstance(node, ast.Call) and not node.args and not node.keywords))


def _holds_modules(f: _File, node: ast.AST) -> bool:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        elements = node.elts
    elif isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
        elements = [node.elt]
    elif isinstance(node, ast.Dict):
        elements = node.values
    elif isinstance(node, ast.DictComp):
        elements = [node.value]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "tuple", "dict"):
        elements = node.args
    else:
        return False
    return any(_is_module(f, e) or _holds_modules(f, e) for e in elements)


def _is_module(f: _File, node: ast.AST) -> bool:
    """A stateful module: parameters, buffers or train/eval behaviour to lose."""
    if isinstance(node, ast.Starred):
        node = node.value
    k = f.kind(node)
    return k is not None and k.cat == "module" and k.detail not in _STATELESS_MODULES


def _plain_message(container: str, attr: str) -> str:
    fix = "nn.ModuleDict" if container == "dict" else "nn.ModuleList"
    return (f"submodules kept in a plain {container} `self.{attr}` are not registered (not trained, saved or "
            f"moved): use {fix}")


@_check("TT102")
def _functional_dropout(f: _File):
    for call in f.nodes[ast.Call]:
        q = f.qualname(call.func)
        if q not in _DROPOUT_FNS or _has_star_args(call) or len(call.args) >= 3:
            continue
        if any(kw.arg == "training" for kw in call.keywords) or f.method_class(call) is None:
            continue
        if _guarded(f, call, _tests_training):
            continue  # `if self.training: x = F.dropout(x, p)` runs only in training
        fn = q.rsplit(".", 1)[-1]
        yield call, (f"F.{fn} without training= stays on after model.eval(): pass training=self.training "
                     f"or use an nn.Dropout module")


@_check("TT103")
def _data_attribute(f: _File):
    """Only where ``.data`` changes what is computed: a write through it (in place, or replacing it) with
    autograd on between a forward (a module or loss called) and a ``.backward()`` in the same function,
    whose graph may hold the old values;
    or a read of a module's own tensor inside its ``forward`` that feeds the output (the parameter then
    gets no gradient through it). Reads elsewhere (``p.grad.data.norm()``, ``outputs.data`` for an
    argmax), writes under ``torch.no_grad()``, in init code or with no backward to follow (a manual SGD
    step after backward, a conversion that swaps a parameter's tensor) change nothing: quiet."""
    for node in f.nodes[ast.Attribute]:
        if node.attr != "data":
            continue
        k = f.kind(node.value)
        if k is None or k.cat != "tensor":
            continue
        parent = f.parent.get(node)
        writes = isinstance(node.ctx, ast.Store) or (
            isinstance(parent, ast.Attribute) and parent.attr.endswith("_") and not parent.attr.startswith("_")
            and isinstance(f.parent.get(parent), ast.Call)) or (
            isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store)) or (
            isinstance(parent, ast.AugAssign) and parent.target is node)
        func = _enclosing_function(f, node)
        if writes:
            if f.no_grad(node) or _init_code(f, func) or not (_forward_before(f, node) and _backward_after(f, node)):
                continue
            yield node, ("writing through `.data` before the backward of a graph that may use it: autograd does not see "
                         "the change and computes wrong gradients; change it after backward, under torch.no_grad()")
        elif _own_tensor_in_forward(f, node, func):
            yield node, (f"`{ast.unparse(node)}` in forward cuts the gradient: `{ast.unparse(node.value)}` is not "
                         "trained through this use (use it directly, or .detach() if that is meant)")


def _forward_before(f: _File, node: ast.AST) -> bool:
    """A module or loss is called before ``node`` in its function's frame (a graph may exist): a module
    of this file or torch.nn, or a callable passed in as a parameter (a model given to a train step)."""
    here = _pos(node)
    for c in f.calls_in(f.function_scope(node)):
        if _pos(c) >= here:
            return False
        k = f.kind(c.func)
        if k is not None and (k.cat in ("module", "lossfn") or (k.cat == "self" and f.is_module_class(k.ref))):
            return True
        b = f.lookup(c.func) if isinstance(c.func, ast.Name) else None
        if b is not None and b[1] == "param":
            return True
    return False


def _backward_after(f: _File, node: ast.AST) -> bool:
    """A ``.backward()`` (or ``torch.autograd.backward``) runs after ``node`` in its function's frame."""
    here = _pos(node)
    return any(_pos(c) > here and (_is_backward(c) or f.qualname(c.func) == "torch.autograd.backward")
               for c in f.calls_in(f.function_scope(node)))


def _enclosing_function(f: _File, node: ast.AST) -> ast.AST | None:
    for anc in f.ancestors(node):
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return anc
    return None


_INIT_NAME = re.compile(r"(^|_)(init|initialize|initialise|reset)(_|$)|^__init__$|_init$|^init", re.IGNORECASE)


def _init_code(f: _File, func: ast.AST | None) -> bool:
    """A function that builds or (re)initialises weights (``__init__``, ``init_weights``, ``_init_weights``,
    ``reset_parameters`` ...), or one passed to ``module.apply``: no autograd graph holds them yet."""
    if func is None:
        return False
    if _INIT_NAME.search(func.name):
        return True
    return any(isinstance(c.func, ast.Attribute) and c.func.attr == "apply" and any(
        isinstance(a, ast.Name) and a.id == func.name for a in c.args) for c in f.nodes[ast.Call])


def _own_tensor_in_forward(f: _File, node: ast.Attribute, func: ast.AST | None) -> bool:
    """``self.<name>.data`` read in the ``forward`` of an nn.Module class, not under no_grad, and not
    only to be detached, copied or inspected (``.clone()``, ``.shape`` ...)."""
    if func is None or func.name != "forward" or f.no_grad(node):
        return False
    owner = f.parent.get(func)
    if not (isinstance(owner, ast.ClassDef) and f.is_module_class(owner)):
        return False
    value = node.value
    if not (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "self"):
        return False
    parent = f.parent.get(node)
    return not (isinstance(parent, ast.Attribute) and parent.attr in (
        "shape", "size", "dtype", "device", "clone", "cpu", "numpy", "tolist", "item", "norm", "dim", "numel"))


def _guarded(f: _File, node: ast.AST, test_ok: Callable[[ast.AST], bool]) -> bool:
    """``node`` runs only when a condition ``test_ok`` recognises holds: it sits in the
    body of ``if cond:`` / ``a if cond else b`` (or of ``if not cond:`` / ``if cond: ... else:``
    in the negated branch), ``cond`` possibly one term of an ``and``, inside its function."""
    def holds(test: ast.AST, branch_true: bool) -> bool:
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return holds(test.operand, not branch_true)
        if branch_true and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return any(holds(v, True) for v in test.values)
        if not branch_true and isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
            return any(holds(v, False) for v in test.values)
        return branch_true and test_ok(test) is True

    def exits(body: list) -> bool:
        return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))

    child = node
    for anc in f.local_ancestors(node):
        if isinstance(anc, ast.If) and child is not anc.test:
            if holds(anc.test, child in anc.body):
                return True
        elif isinstance(anc, ast.IfExp) and child is not anc.test:
            if holds(anc.test, child is anc.body):
                return True
        for block in ("body", "orelse", "finalbody"):  # an early exit: `if not self.training: return x`
            stmts = getattr(anc, block, None)
            if isinstance(stmts, list) and child in stmts:
                for stmt in stmts[:stmts.index(child)]:
                    if isinstance(stmt, ast.If) and exits(stmt.body) and holds(stmt.test, False):
                        return True
        child = anc
    parent = f.parent.get(child)  # the function itself: its top-level statements
    if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and child in parent.body:
        for stmt in parent.body[:parent.body.index(child)]:
            if isinstance(stmt, ast.If) and exits(stmt.body) and holds(stmt.test, False):
                return True
    return False


def _tests_training(test: ast.AST) -> bool | None:
    """True for ``self.training`` (any receiver), None for anything else."""
    return True if isinstance(test, ast.Attribute) and test.attr == "training" else None


_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad", "record_stream"})


@_check("TT104")
def _inplace_on_expanded(f: _File):
    def is_expand(value) -> bool:
        return isinstance(value, ast.Call) and (
            (isinstance(value.func, ast.Attribute) and value.func.attr in ("expand", "expand_as"))
            or f.qualname(value.func) == "torch.broadcast_to")

    def write_at(use: ast.Name):
        parent = f.parent.get(use)
        if (isinstance(parent, ast.Attribute) and parent.attr.endswith("_") and not parent.attr.startswith("_")
                and parent.attr not in _NOT_WRITES and isinstance(f.parent.get(parent), ast.Call)
                and f.parent[parent].func is parent):
            return f.parent[parent]
        if isinstance(parent, ast.Subscript) and parent.value is use and isinstance(parent.ctx, ast.Store):
            return parent
        if isinstance(parent, ast.AugAssign) and parent.target is use:
            return parent
        return None

    for scope, table in f.bindings.items():
        frame = f._function_scope(scope)
        for name, binds in table.items():
            for i, b in enumerate(binds):
                if b[1] != "value" or b[3] or not is_expand(b[2]):
                    continue
                stop = binds[i + 1][0] if i + 1 < len(binds) else _NOWHERE
                for use in f.uses[frame].get(name, ()):
                    if b[0] <= _pos(use) < stop and f.lookup(use) is b:
                        node = write_at(use)
                        if node is not None:
                            yield node, (f"in-place write to `{name}`, a view made by expand(): its elements share "
                                         f"memory with each other and the source; .clone() it first")
    for call in f.nodes[ast.Call]:
        func = call.func
        if (isinstance(func, ast.Attribute) and func.attr.endswith("_") and not func.attr.startswith("_")
                and func.attr not in _NOT_WRITES and is_expand(func.value)):
            yield call, f"in-place {func.attr}() on an expand() view, whose elements share memory: .clone() it first"


@_check("TT105")
def _sqrt_of_sum_of_squares(f: _File):
    def binding(node, depth):
        value = f.binding_value(node) if depth < 4 else None
        return value

    def square(e, depth=0) -> bool:
        if isinstance(e, ast.Name):
            value = binding(e, depth)
            return value is not None and square(value, depth + 1)
        if isinstance(e, ast.BinOp):
            if isinstance(e.op, ast.Pow):
                return _number(e.right) == 2
            if isinstance(e.op, ast.Mult):
                return ast.dump(e.left) == ast.dump(e.right)
            return False
        if isinstance(e, ast.Call):
            q = f.qualname(e.func)
            if q == "torch.pow" and len(e.args) == 2:
                return _number(e.args[1]) == 2
            if q == "torch.square":
                return True
            if isinstance(e.func, ast.Attribute) and q is None:
                if e.func.attr == "pow" and len(e.args) == 1:
                    return _number(e.args[0]) == 2
                return e.func.attr == "square" and not e.args
        return False

    def sum_of_squares(e, depth=0) -> bool:
        if isinstance(e, ast.Name):
            value = binding(e, depth)
            return value is not None and sum_of_squares(value, depth + 1)
        if isinstance(e, ast.Call):
            q = f.qualname(e.func)
            if q in ("torch.sum", "torch.mean", "torch.nansum") and e.args:
                return square(e.args[0], depth)
            if q is None and isinstance(e.func, ast.Attribute) and e.func.attr in ("sum", "mean", "nansum"):
                return square(e.func.value, depth)
            return False
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add):
            terms, stack = [], [e]
            while stack:
                t = stack.pop()
                if isinstance(t, ast.BinOp) and isinstance(t.op, ast.Add):
                    stack += [t.left, t.right]
                else:
                    terms.append(t)
            return all(square(t, depth) for t in terms)
        return False

    candidates = []
    for call in f.nodes[ast.Call]:
        q = f.qualname(call.func)
        if q == "torch.sqrt" and len(call.args) == 1:
            candidates.append((call, call.args[0], True))
        elif q == "torch.pow" and len(call.args) == 2 and _number(call.args[1]) == 0.5:
            candidates.append((call, call.args[0], True))
        elif q is None and isinstance(call.func, ast.Attribute):
            if call.func.attr == "sqrt" and not call.args and not call.keywords:
                candidates.append((call, call.func.value, True))
            elif call.func.attr == "pow" and len(call.args) == 1 and _number(call.args[0]) == 0.5:
                candidates.append((call, call.func.value, False))
    for binop in f.nodes[ast.BinOp]:
        if isinstance(binop.op, ast.Pow) and _number(binop.right) == 0.5:
            candidates.append((binop, binop.left, False))
    for node, arg, torch_op in candidates:
        if not sum_of_squares(arg) or _detached(f, arg) or _constant_tensor(f, arg):
            continue
        if not torch_op:  # `** 0.5` also works on floats and numpy arrays: ask for a tensor
            base = arg.func.value if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) else arg
            k = f.kind(base)
            if k is None or k.cat != "tensor":
                continue
        parent = f.parent.get(node)
        if (isinstance(parent, ast.Attribute) and parent.attr in ("item", "tolist")) or (
                isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "float"):
            continue  # a number for a metric, not a value to differentiate
        if f.no_grad(node):
            continue
        yield node, _RULES["TT105"].message


_CONSTANT_MAKERS = frozenset(f"torch.{n}" for n in (
    "arange linspace logspace meshgrid zeros ones full eye tensor as_tensor from_numpy zeros_like ones_like "
    "full_like empty").split())


def _constant_tensor(f: _File, expr: ast.AST, depth: int = 0) -> bool:
    """``expr`` is built only from numbers and tensor constructors (``torch.arange`` grids and the like,
    without ``requires_grad=True``), through operators and methods of such values: no gradient flows
    through it, so a sqrt at zero cannot give a NaN gradient (a distance grid, as in timm's convit)."""
    if depth > 6:  # variables followed back through six assignments at most
        return False
    if isinstance(expr, ast.Constant):
        return isinstance(expr.value, (int, float))
    if isinstance(expr, ast.Name):
        value = f.binding_value(expr)
        return value is not None and _constant_tensor(f, value, depth + 1)
    if isinstance(expr, ast.BinOp):
        return _constant_tensor(f, expr.left, depth) and _constant_tensor(f, expr.right, depth)
    if isinstance(expr, ast.UnaryOp):
        return _constant_tensor(f, expr.operand, depth)
    if isinstance(expr, ast.Subscript):
        return _constant_tensor(f, expr.value, depth)
    if isinstance(expr, ast.Call):
        if any(kw.arg == "requires_grad" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False)
               for kw in expr.keywords):
            return False
        q = f.qualname(expr.func)
        if q in _CONSTANT_MAKERS:
            return True
        if q is None and isinstance(expr.func, ast.Attribute):  # a method of a constant, with constant arguments
            args = list(expr.args) + [kw.value for kw in expr.keywords]
            shape_only = expr.func.attr in _SHAPE_METHODS  # sizes and dims: any argument that is not a tensor

            def fine(a: ast.AST) -> bool:
                if _constant_tensor(f, a, depth) or _harmless_arg(a):
                    return True
                k = f.kind(a)
                return shape_only and (k is None or k.cat != "tensor")
            return _constant_tensor(f, expr.func.value, depth) and all(fine(a) for a in args)
    return False


_SHAPE_METHODS = frozenset("""view reshape repeat repeat_interleave expand permute transpose flatten unsqueeze squeeze
    contiguous float double half to t""".split())


def _harmless_arg(node: ast.AST) -> bool:
    """A method argument that carries no tensor: a dtype, a memory format, a string, a tuple of numbers."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
        return True  # torch.float32, torch.channels_last ...
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_harmless_arg(e) for e in node.elts)
    return isinstance(node, ast.Name) and node.id.isupper()


def _detached(f: _File, expr: ast.AST, depth: int = 0) -> bool:
    """``expr`` is computed from ``.detach()``/``.data``/numpy values: no gradient flows
    through it (also through the variables it reads, two assignments deep)."""
    for n in ast.walk(expr):
        if isinstance(n, ast.Attribute) and n.attr in ("detach", "data", "numpy", "item"):
            return True
        if isinstance(n, ast.Name) and depth < 2:
            value = f.binding_value(n)
            if value is not None and _detached(f, value, depth + 1):
                return True
    return False


def _activation_losses(f: _File) -> list[tuple[ast.Call, str, str]]:
    """(loss call, loss type, activation of its input) for every cross-entropy / BCE call
    whose input is known to be a softmax, log_softmax or sigmoid output."""
    if "act_losses" in f._memo:
        return f._memo["act_losses"]
    types = {"torch.nn.functional.cross_entropy": "ce", "torch.nn.CrossEntropyLoss": "ce",
             "torch.nn.functional.binary_cross_entropy": "bce", "torch.nn.BCELoss": "bce",
             "torch.nn.functional.binary_cross_entropy_with_logits": "bce_logits",
             "torch.nn.BCEWithLogitsLoss": "bce_logits"}
    out = []
    for call in f.nodes[ast.Call]:
        q = f.qualname(call.func)
        if q is None:
            k = f.kind(call.func)
            q = k.detail if k is not None and k.cat == "lossfn" else None
        loss = types.get(q)
        if loss is None:
            continue
        inp = _kwarg(call, "input", 0)
        k = f.kind(inp) if inp is not None else None
        if k is not None and k.cat == "tensor" and k.detail in _ACTS:
            out.append((call, loss, k.detail))
    f._memo["act_losses"] = out
    return out


_LOSS_NAMES = {"ce": "cross-entropy", "bce": "BCELoss", "bce_logits": "BCEWithLogitsLoss"}


@_check("TT106")
def _log_softmax_into_ce(f: _File):
    for call, loss, act in _activation_losses(f):
        if loss == "ce" and act == "log_softmax":
            yield call, ("log_softmax output fed to cross-entropy, which applies log_softmax itself: use nll_loss, "
                         "or pass the logits")


@_check("TT107")
def _activation_twice(f: _File):
    for call, loss, act in _activation_losses(f):
        if (loss, act) in (("ce", "softmax"), ("bce_logits", "sigmoid")):
            yield call, (f"{act} output fed to {_LOSS_NAMES[loss]}, which applies "
                         f"{'log_softmax' if loss == 'ce' else 'sigmoid'} itself: pass the logits")


@_check("TT108")
def _sigmoid_into_bce(f: _File):
    for call, loss, act in _activation_losses(f):
        if loss == "bce" and act == "sigmoid":
            yield call, _RULES["TT108"].message


@_check("TT109")
def _legacy_reduction(f: _File):
    for call in f.nodes[ast.Call]:
        q = f.qualname(call.func)
        if not _is_loss(q):
            continue
        given = {kw.arg: kw.value for kw in call.keywords if kw.arg in ("size_average", "reduce")
                 and isinstance(kw.value, ast.Constant) and kw.value.value is not None}
        if not given:
            continue  # none given, or a wrapper passing its caller's values through
        reduce_, size_average = given.get("reduce"), given.get("size_average")
        if isinstance(reduce_, ast.Constant) and reduce_.value is False:
            suggestion = "reduction='none'"
        elif isinstance(size_average, ast.Constant) and size_average.value is False:
            suggestion = "reduction='sum'"
        else:
            suggestion = "reduction='mean'"
        names = " and ".join(f"{k}=" for k in given)
        yield call, f"{names} deprecated in {q.rsplit('.', 1)[-1]}: use {suggestion}"


def _torch_loads(f: _File) -> Iterator[ast.Call]:
    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) == "torch.load" and not any(kw.arg is None for kw in call.keywords):
            yield call


@_check("TT110")
def _load_without_map_location(f: _File):
    for call in _torch_loads(f):
        if _kwarg(call, "map_location", 1) is None and not _holds_numpy(f, call):
            yield call, _RULES["TT110"].message


def _holds_numpy(f: _File, call: ast.Call) -> bool:
    """What ``call`` loads is used as a NumPy array (handed to ``torch.from_numpy`` or a ``numpy``
    function, whole or indexed): the file holds no device tensors, so there is no device to map."""
    target = f.parent.get(call)
    if not (isinstance(target, ast.Assign) and len(target.targets) == 1 and isinstance(target.targets[0], ast.Name)):
        return False
    name = target.targets[0].id
    for c in f.calls_in(f.function_scope(call)):
        q = f.qualname(c.func) or ""
        if _pos(c) > _pos(call) and (q == "torch.from_numpy" or q.startswith("numpy.")) and any(
                isinstance(n, ast.Name) and n.id == name for a in c.args for n in ast.walk(a)):
            return True
    return False


@_check("TT111")
def _load_without_weights_only(f: _File):
    allowlist = any(f.qualname(c.func) == "torch.serialization.add_safe_globals" for c in f.nodes[ast.Call])
    for call in _torch_loads(f):
        if _kwarg(call, "weights_only") is None and not allowlist and not _weights_only_meant(f, call):
            yield call, _RULES["TT111"].message


def _weights_only_meant(f: _File, call: ast.Call) -> bool:
    """The code around ``call`` already chose weights_only loading: it runs inside ``with
    torch.serialization.safe_globals(...)`` (which only serves weights_only=True, the default since torch
    2.6), or it is the fallback of one that passes weights_only (an ``except`` after a ``try`` that does, or
    the other branch of an ``if`` on the version): a shim for an older torch that has no such argument."""
    def passes_it(nodes: list[ast.AST]) -> bool:
        return any(isinstance(n, ast.Call) and f.qualname(n.func) == "torch.load" and _kwarg(n, "weights_only")
                   is not None for stmt in nodes for n in ast.walk(stmt))

    child: ast.AST = call
    for anc in f.local_ancestors(call):
        if isinstance(anc, (ast.With, ast.AsyncWith)) and any(
                isinstance(item.context_expr, ast.Call)
                and f.qualname(item.context_expr.func) == "torch.serialization.safe_globals" for item in anc.items):
            return True
        if isinstance(anc, ast.Try) and child in anc.handlers and passes_it(anc.body):
            return True
        if isinstance(anc, ast.If) and child is not anc.test and passes_it(anc.orelse if child in anc.body else anc.body):
            return True
        child = anc
    return False


@_check("TT112")
def _timing_without_sync(f: _File):
    if not f.mentions_cuda:
        return
    clocks = defaultdict(list)
    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) in _CLOCKS:
            clocks[f.function_scope(call)].append(call)
    for scope, reads in clocks.items():
        reads.sort(key=_pos)
        calls = f.calls_in(scope)  # in source order: each region is a slice (linear in the calls, not reads x calls)
        keys = [_pos(c) for c in calls]
        for start, stop in zip(reads, reads[1:]):
            if not isinstance(f.parent.get(start), (ast.Assign, ast.AnnAssign)):
                continue
            region = calls[bisect.bisect_right(keys, _pos(start)):bisect.bisect_left(keys, _pos(stop))]
            work = next((c for c in region if _device_work(f, c)), None)
            if work is None or any(_syncs(f, c) or _opaque(f, c) for c in region):
                continue
            yield stop, (f"time read after CUDA work (line {work.lineno}) with no torch.cuda.synchronize() since the "
                         f"clock started (line {start.lineno}): it measures kernel launches, not the work")


def _device_work(f: _File, call: ast.Call) -> bool:
    """A call that launches tensor work: a forward, a backward, a torch op, a tensor method."""
    func = call.func
    q = f.qualname(func)
    if q is not None:
        k = f._constructor_kind(q, call) if q.startswith("torch.") else None
        return k is not None and k.cat == "tensor"
    if isinstance(func, ast.Attribute):
        if func.attr == "backward":
            return True
        k = f.kind(func.value)
        return k is not None and k.cat == "tensor" and func.attr not in _NON_TENSOR_METHODS
    k = f.kind(func)
    return k is not None and (k.cat in ("module", "lossfn") or (k.cat == "self" and f.is_module_class(k.ref)))


def _syncs(f: _File, call: ast.Call) -> bool:
    """A call that waits for the device: synchronize, events, .item()/.cpu()/.tolist(),
    printing or converting a tensor, or a local helper that does one of those."""
    func = call.func
    q = f.qualname(func)
    if q in _SYNC_FUNCS:
        return True
    if isinstance(func, ast.Attribute):
        if func.attr in _SYNC_METHODS:
            return True
        if func.attr == "to" and any(isinstance(a, ast.Constant) and a.value == "cpu" for a in call.args):
            return True
    if isinstance(func, ast.Name):
        if func.id in ("print", "float", "int", "bool", "str", "repr", "format"):
            return any(_mentions_tensor(f, a) for a in call.args)
        local = f.plain_functions.get(func.id)
        if local and len(local) == 1 and func.id not in f.aliases:
            return any(isinstance(n, ast.Call) and n is not call and (f.qualname(n.func) in _SYNC_FUNCS or (
                isinstance(n.func, ast.Attribute) and n.func.attr in _SYNC_METHODS)) for n in _walk_local(local[0]))
    return False


def _mentions_tensor(f: _File, node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
            k = f.kind(n)
            if k is not None and k.cat == "tensor":
                return True
    return False


def _opaque(f: _File, call: ast.Call) -> bool:
    """A call to code this file does not show (an imported helper might synchronise)."""
    func = call.func
    if isinstance(func, ast.Name):
        if func.id in _SAFE_BUILTINS or func.id in ("print", "float", "int", "bool", "str", "repr", "format"):
            return False
        if func.id in f.plain_functions and func.id not in f.aliases:
            return False
        b = f.lookup(func)
        if b is not None and b[1] == "param":
            return False  # a model or loss passed in: forwards do not synchronise by themselves
        k = f.kind(func)
        return k is None or k.cat not in ("module", "lossfn", "class", "self")
    q = f.qualname(func)
    if q is not None:
        return not q.startswith(("torch.", "time.", "math.", "random.", "logging.", "os.", "sys.", "timeit."))
    return False


@_check("TT113")
def _move_not_assigned(f: _File):
    for stmt in f.nodes[ast.Expr]:
        call = stmt.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
            continue
        m = call.func.attr
        if m not in _MOVE_METHODS or (m == "type" and not call.args):
            continue
        k = f.kind(call.func.value)
        if k is not None and k.cat == "tensor":
            recv = ast.unparse(call.func.value)
            recv = recv if len(recv) <= 30 else "x"
            yield call, (f"`{recv}.{m}()` returns a new tensor and the result is discarded: "
                         f"write `{recv} = {recv}.{m}(...)`")


@_check("TT114")
def _data_parallel(f: _File):
    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) in ("torch.nn.DataParallel", "torch.nn.parallel.data_parallel") \
                and not _implements_data_parallel(f, call):
            yield call, _RULES["TT114"].message


_DP_IMPLEMENTER = re.compile(r"(Strategy|Plugin|Accelerator|DataParallel)$|data_?parallel", re.IGNORECASE)


def _implements_data_parallel(f: _File, call: ast.Call) -> bool:
    """``call`` sits in code that offers DataParallel as one option among others (a framework's
    ``DataParallelStrategy``, a ``wrap_data_parallel`` helper): the choice is its user's, not this code's."""
    return any(isinstance(anc, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and _DP_IMPLEMENTER.search(anc.name)
               for anc in f.ancestors(call))


@_check("TT115")
def _empty_cache_in_loop(f: _File):
    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) != "torch.cuda.empty_cache":
            continue
        for anc in f.local_ancestors(call):
            if isinstance(anc, ast.ExceptHandler):
                break  # recovering from an out-of-memory error: a fair use
            if isinstance(anc, ast.If) and _rate_limited(anc.test):
                break  # every N steps, or when memory runs high
            if isinstance(anc, _LOOPS):
                if _is_step_loop(f, anc):
                    yield call, _RULES["TT115"].message
                break


def _rate_limited(test: ast.AST) -> bool:
    for n in ast.walk(test):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod):
            return True
        if isinstance(n, (ast.Name, ast.Attribute)) and "memory" in (_dotted(n) or "").rsplit(".", 1)[-1]:
            return True
    return False


def _is_backward(node: ast.AST) -> bool:
    """``x.backward(...)``: a call of a method named backward (a loss's, a tensor's)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"


def _is_step_loop(f: _File, loop: ast.AST) -> bool:
    """A loop whose iterations are training steps: it iterates a loader, or its own body
    (not a nested loop) calls backward() or optimizer.step()."""
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        if _element_is_batch(f, loop):
            return True
    for node in _walk_local(loop, into_loops=False):
        if _is_backward(node):
            return True
    return False


def _unwrap_iterable(f: _File, it: ast.AST) -> ast.AST:
    """``loader`` for ``enumerate(loader)``, ``tqdm(loader)``, ``iter(loader)``."""
    while isinstance(it, ast.Call) and it.args and (
            (isinstance(it.func, ast.Name) and it.func.id in ("enumerate", "tqdm", "iter"))
            or f.qualname(it.func) in _TQDM):
        it = it.args[0]
    return it


def _element_is_batch(f: _File, loop: ast.AST) -> bool:
    it = loop.iter
    it = _unwrap_iterable(f, loop.iter)
    k = f.kind(it)
    return (k is not None and k.cat == "loader") or (k is None and f.looks_like_loader(it))


@_check("TT116")
def _eval_without_no_grad(f: _File):
    reported = set()
    for call in f.nodes[ast.Call]:
        func = call.func
        if not isinstance(func, ast.Attribute):
            continue
        to_eval = (func.attr == "eval" and not call.args and not call.keywords) or (
            func.attr == "train" and len(call.args) == 1 and isinstance(call.args[0], ast.Constant)
            and call.args[0].value is False)
        if not to_eval:
            continue
        k = f.kind(func.value)
        if k is not None and not (k.cat == "module" or (k.cat == "self" and f.is_module_class(k.ref))):
            continue
        scope = f.function_scope(call)
        model = ast.dump(func.value)
        calls = f.calls_in(scope)
        stop = min((_pos(c) for c in calls if _pos(c) > _pos(call) and isinstance(c.func, ast.Attribute)
                    and c.func.attr == "train" and ast.dump(c.func.value) == model
                    and not (c.args and isinstance(c.args[0], ast.Constant) and c.args[0].value is False)),
                   default=_NOWHERE)
        same = (lambda c: f.lookup(c.func) is f.lookup(func.value)) if isinstance(func.value, ast.Name) else (
            lambda c: True)
        forwards = [c for c in calls if _pos(call) < _pos(c) < stop and ast.dump(c.func) == model and same(c)]
        uncovered = [c for c in forwards if not f.no_grad(c)]
        if not uncovered or (scope, model) in reported:
            continue
        if any(_is_backward(c) or f.qualname(c.func) in ("torch.autograd.grad", "torch.autograd.backward") for c in calls):
            continue  # gradients wanted (saliency, adversarial examples): no_grad would be wrong
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and _called_without_grad(f, scope):
            continue
        if _frozen(f, scope, model, _pos(uncovered[0])):
            continue  # no parameter requires grad: autograd records nothing
        reported.add((scope, model))
        name = ast.unparse(func.value)
        yield uncovered[0], (f"forward pass of `{name}` after {name}.eval() outside torch.no_grad()/inference_mode(): "
                             f"autograd still records the graph")


def _frozen(f: _File, scope: ast.AST, model: str, before: tuple[int, int]) -> bool:
    """Before ``before`` in ``scope``, the whole model (``model`` is its ``ast.dump``) was
    frozen: ``model.requires_grad_(False)``, or ``requires_grad_(False)`` /
    ``requires_grad = False`` on every ``p`` of ``for p in model.parameters()``."""
    def false_flag(call: ast.Call) -> bool:
        flag = _kwarg(call, "requires_grad", 0)
        return isinstance(flag, ast.Constant) and flag.value is False

    for call in f.calls_in(scope):
        if _pos(call) >= before:
            break
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "requires_grad_" and false_flag(call):
            receiver = func.value
            if isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Attribute) and \
                    receiver.func.attr in ("eval", "train", "to", "cuda", "cpu"):
                receiver = receiver.func.value  # model.eval().requires_grad_(False)
            if ast.dump(receiver) == model:
                return True
    for loop in _walk_local(scope):
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and _pos(loop) < before):
            continue
        it = loop.iter
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "parameters"
                and ast.dump(it.func.value) == model):
            continue
        p = loop.target.id
        for stmt in loop.body:
            value = stmt.value if isinstance(stmt, ast.Expr) else None
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                    and value.func.attr == "requires_grad_" and _dotted(value.func.value) == p and false_flag(value)):
                return True
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and _dotted(stmt.targets[0]) == f"{p}.requires_grad"
                    and isinstance(stmt.value, ast.Constant) and stmt.value.value is False):
                return True
    return False


def _called_without_grad(f: _File, func: ast.AST) -> bool:
    """Some call of ``func`` in this file runs under no_grad (so its body does too)."""
    if isinstance(f.parent.get(func), ast.ClassDef):
        calls = [c for c in f.nodes[ast.Call] if isinstance(c.func, ast.Attribute) and c.func.attr == func.name]
    else:
        calls = f.calls_by_name.get(func.name, [])
    return any(f.no_grad(c) for c in calls)


@_check("TT117")
def _loss_accumulated(f: _File):
    def loss_name(value) -> ast.Name | None:
        if isinstance(value, ast.Name):
            return value
        if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Mult, ast.Div)):
            names = [s for s in (value.left, value.right) if isinstance(s, ast.Name)]
            return names[0] if len(names) == 1 else None
        return None

    def carries_graph(name: ast.Name, scope) -> bool:
        b = f.lookup(name)
        if b is None or b[1] != "value" or b[3]:
            return False
        value = b[2]
        if value is not None and f.no_grad(value):
            return False  # computed under no_grad / inference_mode: it has no graph
        if isinstance(value, ast.Call) and (
                (isinstance(value.func, ast.Attribute)
                 and value.func.attr in ("item", "detach", "tolist", "cpu", "numpy"))
                or (isinstance(value.func, ast.Name) and value.func.id in ("float", "int"))):
            return False
        k = f.kind(name)
        if k is not None and k.cat == "tensor" and k.detail == "loss":
            return True
        return any(_is_backward(c) and isinstance(c.func.value, ast.Name) and c.func.value.id == name.id
                   and _pos(c) > b[0] and f.lookup(c.func.value) is b for c in f.calls_in(scope))

    def accumulates_across(acc: ast.Name, node: ast.AST, loop: ast.AST) -> bool:
        b = f.lookup(acc)
        return b is None or b[0] < _pos(loop)

    for node in f.nodes[ast.AugAssign] + f.nodes[ast.Assign] + f.nodes[ast.Call]:
        if isinstance(node, ast.AugAssign):
            if not (isinstance(node.op, ast.Add) and isinstance(node.target, ast.Name)):
                continue
            acc, value, how = node.target, node.value, "+="
        elif isinstance(node, ast.Assign):
            v = node.value
            if not (len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) and isinstance(v, ast.BinOp)
                    and isinstance(v.op, ast.Add) and isinstance(v.left, ast.Name) and v.left.id == node.targets[0].id):
                continue
            acc, value, how = v.left, v.right, "+"
        else:
            func = node.func
            if not (isinstance(func, ast.Attribute) and func.attr == "append" and isinstance(func.value, ast.Name)
                    and len(node.args) == 1):
                continue
            acc, value, how = func.value, node.args[0], "append"
        loss = loss_name(value)
        loops = f.loops_around(node)
        if loss is None or not loops or f.no_grad(node):
            continue
        scope = f.function_scope(node)
        if not carries_graph(loss, scope) or not accumulates_across(acc, node, loops[0]):
            continue
        if f.backward_mentions(scope, acc.id):
            continue  # the sum is what gets backpropagated (gradient accumulation, multi-task)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) and _called_without_grad(f, scope):
            continue  # an evaluation helper that its callers run under no_grad
        fix = f"{acc.id}.append({loss.id}.item())" if how == "append" else f"{acc.id} += {loss.id}.item()"
        yield node, (f"`{loss.id}` accumulated into `{acc.id}` across iterations keeps every step's graph alive: "
                     f"use {fix}")


@_check("TT118")
def _set_deterministic(f: _File):
    removed = {"torch.set_deterministic": "torch.use_deterministic_algorithms",
               "torch.is_deterministic": "torch.are_deterministic_algorithms_enabled"}
    for node in f.nodes[ast.Attribute]:
        q = f.qualname(node)
        if q in removed and not isinstance(f.parent.get(node), ast.Attribute) and not _version_guarded(f, node):
            yield node, f"{q} no longer exists (AttributeError): use {removed[q]}"
    for node in f.nodes[ast.ImportFrom]:
        if node.module == "torch" and node.level == 0 and not _version_guarded(f, node):
            for alias in node.names:
                if f"torch.{alias.name}" in removed:
                    new = removed["torch." + alias.name]
                    yield node, f"torch.{alias.name} no longer exists (ImportError): use {new}"


_COMPAT_ERRORS = frozenset({"AttributeError", "ImportError", "ModuleNotFoundError", "Exception", "BaseException"})


def _catches_compat(handler: ast.ExceptHandler) -> bool:
    caught = handler.type
    if caught is None:
        return True
    return any(_dotted(e) in _COMPAT_ERRORS for e in (caught.elts if isinstance(caught, ast.Tuple) else [caught]))


def _version_guarded(f: _File, node: ast.AST) -> bool:
    """Compatibility code for old torch versions: under a ``hasattr``/``getattr``/version
    test (either branch: the other one holds the new spelling), or in a ``try`` whose
    handler catches the AttributeError/ImportError that the new versions raise."""
    def compat_test(test: ast.AST) -> bool:
        for n in ast.walk(test):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr"):
                return True
            name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else ""
            if "version" in name.lower():
                return True
        return False

    child = node
    for anc in f.ancestors(node):
        if isinstance(anc, (ast.If, ast.IfExp)) and child is not anc.test and compat_test(anc.test):
            return True
        if isinstance(anc, ast.Try) and child in anc.body and any(_catches_compat(h) for h in anc.handlers):
            return True
        if isinstance(anc, ast.ExceptHandler) and _catches_compat(anc):
            return True  # the fallback after the new spelling failed
        if isinstance(anc, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            break
        child = anc
    return False


@_check("TT119")
def _adam_weight_decay(f: _File):
    def nonzero(node) -> bool:
        value = f.binding_value(node) if isinstance(node, ast.Name) else node
        if isinstance(value, ast.UnaryOp):
            value = value.operand
        n = _number(value)
        return n is not None and n != 0

    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) != "torch.optim.Adam":
            continue
        decoupled = _kwarg(call, "decoupled_weight_decay")
        if decoupled is not None and not (isinstance(decoupled, ast.Constant) and decoupled.value is False):
            continue
        decay = _kwarg(call, "weight_decay", 4)
        groups = call.args[0] if call.args else _kwarg(call, "params")
        in_groups = isinstance(groups, ast.List) and any(
            isinstance(g, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "weight_decay" and nonzero(v)
                                            for k, v in zip(g.keys, g.values)) for g in groups.elts)
        if (decay is not None and nonzero(decay)) or in_groups:
            yield call, _RULES["TT119"].message


def _dataloaders(f: _File) -> list[tuple[ast.Call, list[ast.AST]]]:
    """Every DataLoader(...) call with the loops that iterate it: by the loader object the
    loop's iterable is known to be, or by the same variable / attribute name."""
    if "loaders" in f._memo:
        return f._memo["loaders"]
    loops = f.nodes[ast.For] + f.nodes[ast.AsyncFor]
    out = []
    for call in f.nodes[ast.Call]:
        if f.qualname(call.func) != _DATALOADER:
            continue
        parent = f.parent.get(call)
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target] if isinstance(
            parent, ast.AnnAssign) else []
        names = {_dotted(t) for t in targets} - {None}
        found = []
        for loop in loops:
            it = _unwrap_iterable(f, loop.iter)
            k = f.kind(it)
            if it is call or (k is not None and k.cat == "loader" and k.ref is call) or _dotted(it) in names:
                found.append(loop)
        out.append((call, found))
    f._memo["loaders"] = out
    return out


def _moves_batch_to_cuda(f: _File, loop: ast.AST) -> bool:
    batch = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    for node in _walk_local(loop):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and _root_name(node.func.value) in batch):
            continue
        if node.func.attr == "cuda":
            return True
        if node.func.attr == "to":
            device = _kwarg(node, "device", 0)
            if device is not None and _is_cuda_device(f, device):
                return True
    return False


def _is_cuda_device(f: _File, node: ast.AST) -> bool:
    """``node`` names a CUDA device: a ``"cuda..."`` string (directly or in the expression
    the variable was assigned), or, when its value is not in the file, a variable called
    ``device``/``gpu``/``cuda`` in a file that uses CUDA."""
    value = f.binding_value(node) if isinstance(node, ast.Name) else None
    strings = [n.value for n in ast.walk(value if value is not None else node)
               if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    if strings:
        return any(s.startswith("cuda") for s in strings)
    dotted = _dotted(node)
    return (dotted is not None and f.mentions_cuda
            and re.search(r"device|dev$|gpu|cuda", dotted.rsplit(".", 1)[-1], re.IGNORECASE) is not None)


def _dataset_exprs(f: _File, call: ast.Call) -> list[ast.AST]:
    """The loader's dataset expression and what the variables in it were assigned, two deep."""
    exprs, todo = [], [(_kwarg(call, "dataset", 0), 0)]
    while todo:
        expr, depth = todo.pop()
        if expr is None:
            continue
        exprs.append(expr)
        if depth < 2:
            todo.extend((f.binding_value(n), depth + 1) for n in ast.walk(expr) if isinstance(n, ast.Name))
    return exprs


def _dataset_on_device(f: _File, call: ast.Call) -> bool:
    """The dataset holds tensors already moved to a device (pinning those would fail)."""
    return any((isinstance(n, ast.Attribute) and n.attr in ("cuda", "to"))
               or (isinstance(n, ast.keyword) and n.arg == "device")
               for e in _dataset_exprs(f, call) for n in ast.walk(e))


def _in_memory_dataset(f: _File, call: ast.Call) -> bool:
    """The dataset is a TensorDataset: indexing it is cheap, workers only add overhead."""
    return any(isinstance(n, ast.Call) and (f.qualname(n.func) or "").endswith("TensorDataset")
               for e in _dataset_exprs(f, call) for n in ast.walk(e))


@_check("TT120")
def _loader_without_pin_memory(f: _File):
    for call, loops in _dataloaders(f):
        if any(kw.arg is None for kw in call.keywords) or _kwarg(call, "pin_memory", 7) is not None:
            continue
        if _dataset_on_device(f, call):
            continue
        if any(_moves_batch_to_cuda(f, loop) for loop in loops):
            yield call, _RULES["TT120"].message


@_check("TT121")
def _loader_without_workers(f: _File):
    for call, loops in _dataloaders(f):
        if any(kw.arg is None for kw in call.keywords):
            continue
        workers = _kwarg(call, "num_workers", 5)
        if (workers is not None and _number(workers) != 0) or _in_memory_dataset(f, call):
            continue
        if any(_is_backward(n) for loop in loops for n in _walk_local(loop)):
            yield call, _RULES["TT121"].message


@_check("TT122")
def _scheduler_before_optimizer(f: _File):
    for loop in (n for t in _LOOPS for n in f.nodes[t]):
        if any(isinstance(a, _LOOPS) for a in f.local_ancestors(loop)):
            continue  # judged from the outermost loop, which sees the inner loops' steps in its order
        steps = sorted((c for c in _walk_local(loop) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                        and c.func.attr == "step"), key=_pos)
        first_opt = next((c for c in steps if _optimizer_step(f, c)), None)
        if first_opt is None:
            continue
        for c in steps:
            if _pos(c) >= _pos(first_opt):
                break
            k = f.kind(c.func.value)
            if k is not None and k.cat == "scheduler" and not any(
                    isinstance(a, ast.If) for a in _ancestors_until(f, c, loop)):
                yield c, _RULES["TT122"].message


def _optimizer_step(f: _File, call: ast.Call) -> bool:
    """``optimizer.step()`` or ``scaler.step(optimizer)``."""
    k = f.kind(call.func.value)
    if k is not None and k.cat == "optimizer":
        return True
    return bool(call.args) and (f.kind(call.args[0]) or _Kind("?")).cat == "optimizer"


def _ancestors_until(f: _File, node: ast.AST, stop: ast.AST) -> Iterator[ast.AST]:
    for anc in f.ancestors(node):
        if anc is stop:
            return
        yield anc


_DIST_SAMPLERS = ("torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler")


@_check("TT123")
def _sampler_without_set_epoch(f: _File):
    samplers = [c for c in f.nodes[ast.Call] if f.qualname(c.func) in _DIST_SAMPLERS]
    if not samplers or any(isinstance(c.func, ast.Attribute) and c.func.attr == "set_epoch" for c in f.nodes[ast.Call]):
        return
    if not any(_is_backward(n) for t in _LOOPS for loop in f.nodes[t] for n in _walk_local(loop)):
        return  # no training loop (a backward in a loop) in this file: the epochs run elsewhere
    for call in samplers:
        shuffle = _kwarg(call, "shuffle", 3)
        if any(kw.arg is None for kw in call.keywords) or (shuffle is not None and _number(shuffle) == 0) or (
                isinstance(shuffle, ast.Constant) and shuffle.value is False):
            continue
        yield call, _RULES["TT123"].message


@_check("TT124")
def _eval_without_train(f: _File):
    for t in _LOOPS:
        for loop in f.nodes[t]:
            if any(isinstance(a, _LOOPS) for a in f.local_ancestors(loop)):
                continue  # the outermost loop: an epoch loop sees its inner step loop's backward
            calls = [n for n in _walk_local(loop) if isinstance(n, ast.Call)]
            if not any(_is_backward(c) for c in calls):
                continue
            if any(isinstance(c.func, ast.Attribute) and c.func.attr == "train" for c in calls):
                continue
            for c in calls:
                if isinstance(c.func, ast.Attribute) and c.func.attr == "eval" and not c.args and _looks_like_model(f, c.func.value):
                    yield c, _RULES["TT124"].message
                elif isinstance(c.func, ast.Name) and _helper_leaves_eval(f, c.func.id):
                    yield c, (f"`{c.func.id}()` switches the model to eval() and nothing in this training loop calls "
                              "train() again: the following epochs train in eval mode; call model.train() after it")


def _looks_like_model(f: _File, node: ast.AST) -> bool:
    k = f.kind(node)
    if k is not None:
        return k.cat == "module" or (k.cat == "self" and f.is_module_class(k.ref))
    b = f.lookup(node) if isinstance(node, ast.Name) else None  # a model passed in, or a name that says so
    return (b is not None and b[1] == "param") or (isinstance(node, ast.Name) and "model" in node.id.lower())


def _helper_leaves_eval(f: _File, name: str) -> bool:
    """A function of this file that calls ``.eval()`` on something and never ``.train()``."""
    defs = f.plain_functions.get(name)
    if not defs or len(defs) != 1 or name in f.aliases:
        return False
    calls = [n for n in _walk_local(defs[0]) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    return any(c.func.attr == "eval" and not c.args for c in calls) and not any(c.func.attr == "train" for c in calls)


@_check("TT125")
def _backward_under_no_grad(f: _File):
    for call in f.nodes[ast.Call]:
        if _is_backward(call) and f.no_grad(call):
            yield call, _RULES["TT125"].message


assert set(_CHECKS) == set(_RULES), "every static rule needs a check"
