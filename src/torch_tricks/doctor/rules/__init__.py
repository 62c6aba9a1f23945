"""Every rule the doctor knows, one module per family; importing this package registers them.

Static families (read with :mod:`ast`, no torch): :mod:`.modules` (how a model is written),
:mod:`.losses`, :mod:`.serialization` (saving and loading), :mod:`.devices` (devices and timing),
:mod:`.determinism`, :mod:`.data` (feeding the loop), :mod:`.loop` (the training loop),
:mod:`.steps` (the optimizer step: zero_grad, clipping, per-step syncs), :mod:`.export`
(tracing and exporting a model), :mod:`.arguments` (constructor arguments in the wrong place),
:mod:`.accumulation` (gradient accumulation), :mod:`.dead_loss` (a loss that never reaches backward),
:mod:`.gan` (a discriminator step on the generator's undetached output), :mod:`.optimizer_params` (the
same parameters given to an optimizer twice), :mod:`.frozen` (a frozen BatchNorm backbone left in train mode),
:mod:`.loss_network` (a pretrained network inside a loss left trainable).
:mod:`.runtime` declares the ``TT2xx`` rules that :mod:`torch_tricks.doctor.runtime` finds by
running a model; it is declared apart so that listing them needs no torch.
"""

from torch_tricks.doctor.rules import (accumulation, arguments, data, dead_loss, determinism,  # noqa: F401
                                       devices, export, frozen, gan, loop, loss_network, losses, modules,
                                       optimizer_params,
                                       runtime, serialization, steps)

__all__: list[str] = []  # nothing to import from here: the families register their rules in the registry
