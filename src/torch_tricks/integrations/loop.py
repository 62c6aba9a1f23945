"""The tune's configuration in a training loop of your own, through :class:`~torch_tricks.Tricks` (issue 34)."""

from __future__ import annotations

from typing import Any

from torch_tricks.integrations.mapping import changed_keys, config_of

__all__ = ["trainer_lines"]


def trainer_lines(cfg: Any, source: str | None = None) -> list[str]:
    """The lines of your own loop that carry ``cfg``: your model, optimizer (and scheduler) through
    ``Tricks.prepare``, the forward under ``tricks.autocast()``, ``tricks.backward`` and ``tricks.step``.
    ``source``: how the script names the configuration (a path to tricks.toml); default: its given keys."""
    config = config_of(cfg)
    return ["import torch_tricks",
            "",
            f"cfg = {source!r}" if source else f"cfg = {changed_keys(config)!r}",
            "tricks = torch_tricks.Tricks(cfg)",
            "model, optimizer = tricks.prepare(model, optimizer)  # yours; a scheduler of yours goes after them",
            *(["loader = tricks.prepare_data(dataset)  # token rows (input_ids of different lengths) batched as "
               f"token_batches = {config.token_batches!r} says"] if "token_batches" in config.given else []),
            f"for epoch in range({config.epochs if 'epochs' in config.given else 'epochs'}):",
            "    for batch in loader:",
            "        batch = tricks.to_device(batch)",
            "        with tricks.autocast():",
            "            loss = model(**batch).loss  # or loss_fn(model(x), y)",
            "        tricks.backward(loss)",
            "        tricks.step()",
            "    tricks.flush()  # a short last group of micro-batches"]
