"""The tune's configuration in a loop of your own on Hugging Face Accelerate (issue 22)::

    from accelerate import Accelerator
    from torch_tricks.integrations.accelerate import accelerator_kwargs_from, tricks_for

    accelerator = Accelerator(**accelerator_kwargs_from(cfg))   # cfg: tricks.toml, a TrainConfig or a dict
    tricks = tricks_for(cfg, accelerator)                        # the switches Accelerate has no argument for
    model, optimizer = tricks.prepare(model, total_steps=steps)  # model changes, the optimizer, schedule, EMA
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            tricks.guard(loss)           # the NaN guard, before the step
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            tricks.after_step()          # the lr schedule and the EMA follow the real step

The Accelerator owns what it has arguments for (mixed precision, gradient accumulation, the
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
from torch_tricks.integrations.mapping import build, changed_keys, check_keywords, config_of, keywords, routes
from torch_tricks.train.tricks import Tricks

_accelerate = require("accelerate", "hf", "the Accelerate integration")

__all__ = ["accelerator_kwargs_from", "tricks_for", "trainer_lines", "ACCELERATOR_OWNS"]

# What the Accelerator applies: neutral in the Tricks of the rest, so that nothing is applied twice.
ACCELERATOR_OWNS = {"precision": "fp32", "accumulate": 1, "compile": False, "distributed": "off", "grad_clip": 0.0}


def accelerator_kwargs_from(cfg: Any) -> dict[str, Any]:
    """``Accelerator``'s keywords for ``cfg`` (a path to ``tricks.toml``, a ``TrainConfig`` or a dict). A value with
    no place in Accelerate, or a keyword the installed version lacks, is one line saying which and what to do."""
    out = keywords(config_of(cfg), "accelerate")
    check_keywords(out, set(inspect.signature(_accelerate.Accelerator.__init__).parameters), "accelerate",
                   _accelerate, "Accelerator keyword")
    return {k: build(v) for k, v in out.items()}


def tricks_for(cfg: Any, accelerator: Any = None) -> Tricks:
    """The :class:`Tricks` of what the Accelerator has no argument for: ``cfg`` with the keys it owns
    (:data:`ACCELERATOR_OWNS`) neutral, on the accelerator's device."""
    config = config_of(cfg)
    routes(config, "accelerate")  # a value Accelerate cannot serve is refused here, before any training
    device = str(accelerator.device) if accelerator is not None else config.device
    return Tricks(config.replace(**ACCELERATOR_OWNS, device=device))


def trainer_lines(cfg: Any) -> list[str]:
    """The lines of an Accelerate loop that carry ``cfg``."""
    config = config_of(cfg)
    kwargs = keywords(config, "accelerate")
    code = {k: r.line for k, r in routes(config, "accelerate").items() if r.how == "code"}
    kw = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "nothing to set"
    autocast = "with tricks.autocast():  # the activation offload\n                " if config.offload_activations \
        else ""
    lines = ["from accelerate import Accelerator",
             "from torch_tricks.integrations.accelerate import accelerator_kwargs_from, tricks_for",
             f"cfg = {changed_keys(config)!r}",
             f"accelerator = Accelerator(**accelerator_kwargs_from(cfg))  # {kw}",
             "tricks = tricks_for(cfg, accelerator)",
             *([code["sync_bn"]] if "sync_bn" in code else []),
             "model, optimizer = tricks.prepare(model, total_steps=total_steps)",
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
             "        if accelerator.sync_gradients:",
             "            tricks.after_step()",
             *(f"            {code[k]}" for k in ("checkpoint_every", "log_every") if k in code),
             *([f"            {code['max_steps']}  # (and out of the epochs' loop)"] if "max_steps" in code else [])]
    return lines
