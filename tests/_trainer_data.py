"""A tiny GPT-2 and a data set it can learn, shared by the trainer-integration tests (issue 22)."""

from __future__ import annotations

import torch

from torch_tricks.models import load_model

GPT2 = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 32, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return load_model("hf:gpt2", hf_config=GPT2)[0].train()


def lm_data(n: int = 24, length: int = 16, mask_first: bool = False) -> list[dict[str, torch.Tensor]]:
    """Sequences with something to learn: each token follows from the one before (t -> 3t + 1 mod 128).
    ``mask_first``: the first label -100 (no token predicts it): the transformers Trainer divides the summed loss by
    the labels that are not -100 before the shift, so then its loss is the model's mean, as in a plain loop."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.empty(length, dtype=torch.long)
        ids[0] = torch.randint(0, 128, (1,), generator=g)
        for i in range(1, length):
            ids[i] = (3 * ids[i - 1] + 1) % 128
        labels = ids.clone()
        if mask_first:
            labels[0] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def ema_of(history: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    """The EMA the test computes itself from the raw weights after each step, with torch-tricks' warm-up decay
    min(decay, (1 + n) / (10 + n)) at the n-th update (the first update copies)."""
    ema = None
    for n, weights in enumerate(history):
        if ema is None:
            ema = {k: v.clone() for k, v in weights.items()}
            continue
        d = min(decay, (1 + n) / (10 + n))
        ema = {k: ema[k] * d + weights[k] * (1 - d) if weights[k].is_floating_point() else weights[k] for k in weights}
    return ema


def assert_resumed_like(whole_ema, resumed_ema, whole_lrs: list[float], first: list[float],
                        second: list[float]) -> None:
    """A run stopped after 4 optimizer steps and resumed to 8 equals the uninterrupted one: the lr at every step,
    the EMA's update count and its weights (issue 34)."""
    import pytest

    assert len(first) == len(second) == 4
    assert first + second == pytest.approx(whole_lrs, rel=1e-6)
    assert resumed_ema.num_updates == whole_ema.num_updates == 8
    for (k, a), b in zip(whole_ema.module.state_dict().items(), resumed_ema.module.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=k)
