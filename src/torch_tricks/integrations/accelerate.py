"""The tune's configuration in a loop of your own on Hugging Face Accelerate (issue 22)::

    from accelerate import Accelerator
    from torch_tricks.integrations.accelerate import accelerator_kwargs_from, tricks_for

    accelerator = Accelerator(**accelerator_kwargs_from(cfg))   # cfg: tricks.toml, a TrainConfig or a dict
    tricks = tricks_for(cfg, accelerator)                        # the switches Accelerate has no argument for
    model, optimizer = tricks.prepare(model, optimizer)          # model changes, your optimizer as asked, EMA
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            tricks.guard(loss)           # the NaN guard, before the step
            optimizer.step()
            optimizer.zero_grad()
            tricks.after_step()          # the lr schedule and the EMA: only when the optimizer stepped

``accelerator_kwargs_from(cfg, **yours)`` merges the configuration's keywords into your own (a
conflict is one line). The Accelerator owns what it has arguments for (mixed precision, gradient accumulation, the
device, DDP or FSDP2 across processes, compile, checkpoint folders, trackers);
:func:`tricks_for` makes the :class:`~torch_tricks.Tricks` of the rest, with those keys neutral
so nothing is applied twice. Lines of your own loop (clipping, saving state, the epochs) are
what :func:`trainer_lines` prints with them.

Written here rather than taken from Accelerate: it has no switch for activation checkpointing,
the chunked loss, channels_last, EMA, the NaN guard or a fused or low-precision optimizer.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch_tricks._optional import require
from torch_tricks.integrations.mapping import (
    build,
    changed_keys,
    check_keywords,
    code_lines,
    config_of,
    keywords,
    routes,
    sourced_keywords,
)
from torch_tricks.integrations.merge import Tuned, merge
from torch_tricks.train.compile_modes import check_compile_mode
from torch_tricks.train.tricks import Tricks

_accelerate = require("accelerate", "hf", "the Accelerate integration")

__all__ = ["accelerator_kwargs_from", "tricks_for", "trainer_lines", "ACCELERATOR_OWNS"]

# What the Accelerator applies: neutral in the Tricks of the rest, so that nothing is applied twice.
ACCELERATOR_OWNS = {"precision": "fp32", "accumulate": 1, "compile": False, "distributed": "off", "grad_clip": 0.0}


def accelerator_kwargs_from(cfg: Any, *, prefer: str | None = None, **yours: Any) -> dict[str, Any]:
    """``Accelerator``'s keywords for the keys ``cfg`` was given (a path to ``tricks.toml``, a ``TrainConfig`` or a
    dict), merged into ``yours`` (your own keywords); the result's ``tricks_changes`` maps each keyword the
    configuration set to ``(Accelerate's default, new)``, and a keyword of yours with another value is one line
    naming both, unless ``prefer`` is ``"tuned"`` or ``"yours"``. A value with no place in Accelerate, or a keyword
    the installed version lacks, is one line saying which and what to do."""
    tuned = sourced_keywords(config_of(cfg), "accelerate")
    params = inspect.signature(_accelerate.Accelerator.__init__).parameters
    check_keywords(tuned, set(params), "accelerate", _accelerate, "Accelerator keyword")
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    merged = merge(tuned, yours, explicit=set(yours), defaults=defaults, prefer=prefer,
                   where="your Accelerator keywords")
    out = Tuned({k: build(v) for k, v in merged.items()})
    out.tricks_changes = merged.tricks_changes
    return out


def tricks_for(cfg: Any, accelerator: Any = None) -> Tricks:
    """The :class:`Tricks` of what the Accelerator has no argument for: ``cfg`` with the keys it owns
    (:data:`ACCELERATOR_OWNS`) neutral, on the accelerator's device. Given the accelerator, ``after_step`` does
    nothing on a micro-batch it did not step, and the Tricks' own state (step count, lr schedule, EMA) is saved
    and loaded with ``accelerator.save_state()`` / ``load_state()``."""
    config = config_of(cfg)
    routes(config, "accelerate", given=True)  # a value Accelerate cannot serve is refused here, before any training
    if accelerator is None:
        return Tricks(config.replace(**ACCELERATOR_OWNS))
    if config.compile:  # the Accelerator compiles (its dynamo_plugin): the mode is checked for its device here
        check_compile_mode(config.compile, accelerator.device)
    tricks = Tricks(config.replace(**ACCELERATOR_OWNS, device=str(accelerator.device)), accelerator=accelerator)
    accelerator.register_for_checkpointing(_TricksState(tricks))
    return tricks


class _TricksState:
    """What ``accelerator.save_state()`` keeps of the Tricks, read when it saves (after ``prepare``): the step
    count, the lr schedule, the EMA and its update count."""

    def __init__(self, tricks: Tricks) -> None:
        self.tricks = tricks

    def state_dict(self) -> dict[str, Any]:
        return self.tricks.checkpointable().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tricks.checkpointable().load_state_dict(state)


def trainer_lines(cfg: Any, source: str | None = None) -> list[str]:
    """The lines of an Accelerate loop that carry ``cfg``. ``source``: how the script names the configuration
    (a path to tricks.toml); default: its given keys."""
    config = config_of(cfg)
    kwargs = keywords(config, "accelerate")
    code = code_lines(config, "accelerate")
    kw = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "nothing"
    autocast = "with tricks.autocast():  # the activation offload\n                " if config.offload_activations \
        else ""
    return ["from accelerate import Accelerator",
            "from torch_tricks.integrations.accelerate import accelerator_kwargs_from, tricks_for",
            "",
            f"cfg = {source!r}" if source else f"cfg = {changed_keys(config)!r}",
            f"accelerator = Accelerator(**accelerator_kwargs_from(cfg))  # with your own keywords too; sets {kw}",
            "tricks = tricks_for(cfg, accelerator)",
            *([code["sync_bn"]] if "sync_bn" in code else []),
            "model, optimizer = tricks.prepare(model, optimizer)  # yours (a scheduler of yours after them)",
            *([code["token_batches"]] if "token_batches" in code else []),
            "model, optimizer, loader = accelerator.prepare(model, optimizer, loader)",
            *([code["resume"]] if "resume" in code else []),
            code.get("epochs", "for epoch in range(epochs):"),
            "    for batch in loader:",
            "        with accelerator.accumulate(model):",
            f"            {autocast}loss = model(**batch).loss",
            "            accelerator.backward(loss)",
            "            tricks.guard(loss)",
            *([f"            {code['grad_clip']}"] if "grad_clip" in code else []),
            "            optimizer.step()",
            "            optimizer.zero_grad()",
            "            tricks.after_step()  # the lr schedule and the EMA: only when the optimizer stepped",
            *(f"        {code[k]}" for k in ("checkpoint_every", "log_every") if k in code),
            *([f"        {code['max_steps']}  # (and out of the epochs' loop)"] if "max_steps" in code else [])]
