"""Batched device transforms (D2) against the per-sample CPU reference on the same random parameters.

Tolerance: max |batched - per-sample| <= 1e-4 on [0, 1]-scaled float images
(TOLERANCE_UNIT_RANGE), i.e. <= 1e-4 / min(std) after normalisation - far below one
uint8 level (1/255 = 3.9e-3). The gap is float32 rounding of the sampling coordinates.
"""

from __future__ import annotations

import math

import pytest
import torch

from torch_tricks.data.transforms import (
    IMAGENET_STD,
    TOLERANCE_UNIT_RANGE,
    BatchNormalize,
    BatchRandomHorizontalFlip,
    BatchRandomResizedCrop,
    Compose,
    ToFloat,
    device_augment,
    params_at,
    per_sample_reference,
    to_float_nchw,
)
from torch_tricks.errors import UserError
from torch_tricks.registry import get_trick

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")


def _images(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """uint8 NHWC noise: the largest pixel-to-pixel steps, so any error in where a sample is taken shows most."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, h, w, 3), dtype=torch.uint8, generator=g)


def _max_diff_vs_reference(transform, images_nhwc: torch.Tensor, seed: int, device: str = "cpu") -> float:
    n, h, w, _ = images_nhwc.shape
    params = transform.sample_params(n, h, w, torch.Generator().manual_seed(seed))
    batched = transform.apply(images_nhwc.to(device), params).cpu()
    reference = torch.stack([per_sample_reference(images_nhwc[i].numpy(), params_at(params, i)) for i in range(n)])
    assert batched.shape == reference.shape
    return float((batched - reference).abs().max())


@pytest.mark.parametrize("h, w, size", [(37, 53, (24, 32)), (64, 48, (96, 80)), (160, 120, 32)])
def test_batched_matches_per_sample_reference(h, w, size):
    """The batched device transforms match the per-sample CPU transforms on the same random parameters."""
    images = _images(12, h, w)
    unit = Compose([ToFloat(), BatchRandomResizedCrop(size), BatchRandomHorizontalFlip()])
    assert _max_diff_vs_reference(unit, images, seed=1) <= TOLERANCE_UNIT_RANGE
    full = device_augment(size)  # + normalisation
    assert _max_diff_vs_reference(full, images, seed=2) <= TOLERANCE_UNIT_RANGE / min(IMAGENET_STD)


@requires_cuda
def test_cuda_batched_matches_cpu_reference():
    images = _images(16, 96, 128)
    assert _max_diff_vs_reference(device_augment(64), images, seed=3, device="cuda") <= TOLERANCE_UNIT_RANGE / min(
        IMAGENET_STD
    )


def test_nchw_and_nhwc_inputs_agree_and_tuples_pass_labels_through():
    nhwc = _images(6, 20, 30)
    t = device_augment(16)
    params = t.sample_params(6, 20, 30, torch.Generator().manual_seed(0))
    a = t.apply(nhwc, params)
    b = t.apply(nhwc.permute(0, 3, 1, 2).contiguous(), params)
    assert torch.equal(a, b) and a.dtype == torch.float32 and a.shape == (6, 3, 16, 16)
    labels = torch.arange(6)
    out = t((nhwc, labels), generator=torch.Generator().manual_seed(0))
    assert isinstance(out, tuple) and out[1] is labels and torch.equal(out[0], a)


def test_same_seed_same_augmentation():
    x = _images(8, 32, 32)
    t = device_augment(24)
    a = t(x, generator=torch.Generator().manual_seed(7))
    b = t(x, generator=torch.Generator().manual_seed(7))
    c = t(x, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    own = device_augment(24, generator=torch.Generator().manual_seed(7))
    assert torch.equal(own(x), a)  # a generator given at construction works the same


def test_crop_parameters_follow_the_sampling_rule():
    crop = BatchRandomResizedCrop(16, scale=(0.2, 0.9), ratio=(0.5, 2.0))
    p = crop.sample_params(2000, 100, 140, torch.Generator().manual_seed(0))
    top, left, h, w = p["top"], p["left"], p["height"], p["width"]
    assert bool(((top >= 0) & (left >= 0) & (top + h <= 100) & (left + w <= 140) & (h > 0) & (w > 0)).all())
    frac = (h * w).double() / (100 * 140)
    assert 0.17 < float(frac.min()) and float(frac.max()) < 0.95  # within scale, up to rounding
    aspect = (w.double() / h.double()).log()
    assert math.log(0.5) - 0.1 < float(aspect.min()) and float(aspect.max()) < math.log(2.0) + 0.1
    assert float(left.double().std()) > 5  # positions vary


def test_fallback_is_a_centre_crop():
    crop = BatchRandomResizedCrop(8, scale=(1.0, 1.0), ratio=(2.0, 3.0))  # cannot fit in a square
    p = crop.sample_params(4, 16, 16, torch.Generator().manual_seed(0))
    assert p["width"].tolist() == [16] * 4 and p["height"].tolist() == [8] * 4 and p["top"].tolist() == [4] * 4


def test_full_image_crop_at_the_same_size_is_exact():
    x = _images(3, 12, 20)
    crop = BatchRandomResizedCrop((12, 20), scale=(1.0, 1.0), ratio=(20 / 12, 20 / 12))
    out = crop(x)
    assert torch.allclose(out, to_float_nchw(x), atol=1e-6)


def test_flip_and_normalize():
    x = _images(4, 5, 7)
    f = to_float_nchw(x)
    assert torch.equal(BatchRandomHorizontalFlip(0.0)(x), f)
    assert torch.equal(BatchRandomHorizontalFlip(1.0)(x), f.flip(-1))
    norm = BatchNormalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))(x)
    assert torch.allclose(norm, (f - 0.5) / 0.25)


def test_to_float_layouts_and_errors():
    x = torch.zeros(2, 8, 8, 3, dtype=torch.uint8)
    assert to_float_nchw(x).shape == (2, 3, 8, 8)
    with pytest.raises(UserError, match="NHWC or NCHW"):
        to_float_nchw(torch.zeros(2, 3, 5, 3, dtype=torch.uint8))
    assert ToFloat(layout="NCHW")(torch.zeros(2, 3, 5, 3, dtype=torch.uint8)).shape == (2, 3, 5, 3)
    with pytest.raises(UserError, match="4-D"):
        to_float_nchw(torch.zeros(8, 8, 3, dtype=torch.uint8))
    with pytest.raises(UserError, match="channels"):
        BatchNormalize((0.5,), (0.5,))(x)
    with pytest.raises(UserError):
        BatchRandomResizedCrop(8, scale=(0.9, 0.1))
    with pytest.raises(UserError):
        BatchRandomHorizontalFlip(1.5)
    with pytest.raises(UserError, match="Generator"):
        device_augment(8)(x, generator=123)


def test_trick_registered():
    assert get_trick("device_transforms").ids == ("D2",)
