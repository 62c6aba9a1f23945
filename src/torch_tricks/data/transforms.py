"""Batched image augmentation that runs where the batch is, e.g. on the GPU (catalogue D2).

The seed's advice is DALI: decode and augment on the accelerator so the CPU workers stop
being the bottleneck. Without DALI the same idea works for the augmentations that come
*after* decoding: the loader hands over whole uint8 batches (4x smaller than float, so the
host-to-device copy is cheaper too), and one batched call per transform does the work
for every sample at once:

* :class:`ToFloat`: uint8 NHWC or NCHW -> float NCHW in [0, 1];
* :class:`BatchRandomResizedCrop`: a random box per sample (torchvision's sampling rule:
  area fraction in ``scale``, log-uniform aspect ratio in ``ratio``, 10 tries then a
  centre crop), every box resampled in **one** ``grid_sample`` call with a per-sample grid;
* :class:`BatchRandomHorizontalFlip`, :class:`BatchNormalize`, and :class:`Compose`.

Every transform splits into ``sample_params(batch_size, height, width, generator)``
(tiny CPU tensors, drawn from a CPU ``torch.Generator``, so a seed gives the same
augmentation on CPU and on CUDA) and ``apply(batch, params)`` (the device work). The same
parameters drive :func:`per_sample_reference`, a plain one-image-at-a-time CPU
implementation (crop by slicing, resize with ``F.interpolate``), which the tests compare
with the batched path.

Conventions, chosen to match ``F.interpolate(mode="bilinear", align_corners=False,
antialias=False)`` on the cropped image exactly: output pixel ``o`` of a crop of width
``w`` resized to ``ow`` samples source column ``(o + 0.5) * w / ow - 0.5`` of the crop,
clamped to ``[0, w - 1]`` (so no pixel outside the box leaks in). There is no
antialiasing: strong downscaling aliases, as with torchvision's ``antialias=False``.
Batched and per-sample results agree within 1e-4 on [0, 1] floats (``TOLERANCE_UNIT_RANGE``,
under 3% of one uint8 level), i.e. 1e-4 / std after normalisation (4.4e-4 for ImageNet's
std). The gap is float32 rounding of the sampling position inside ``grid_sample``: about
1e-7 x image width pixels, times the step between neighbouring pixels, so 1e-4 holds up
to ~1000-pixel images even for pure noise (the worst case) and with room on real images.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from torch_tricks.errors import UserError
from torch_tricks.registry import register_trick

__all__ = [
    "BatchTransform",
    "ToFloat",
    "BatchRandomResizedCrop",
    "BatchRandomHorizontalFlip",
    "BatchNormalize",
    "Compose",
    "device_augment",
    "to_float_nchw",
    "params_at",
    "per_sample_reference",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "TOLERANCE_UNIT_RANGE",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TOLERANCE_UNIT_RANGE = 1e-4  # max |batched - per-sample| on [0, 1] float images (float32)

_CHANNELS = (1, 3, 4)


@register_trick(
    "device_transforms",
    ids=("D2",),
    kind="data",
    trades="device time and memory (small next to a model step) for CPU workers freed from augmenting",
    needs="uint8 batches of one image size (resize offline, D1); the device the model runs on",
)
def device_augment(
    size: int | tuple[int, int] = 224,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip_p: float = 0.5,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    layout: str = "auto",
    generator: torch.Generator | None = None,
) -> Compose:
    """The usual ImageNet training augmentation as one batched pipeline.

    ``ToFloat -> BatchRandomResizedCrop(size) -> BatchRandomHorizontalFlip -> BatchNormalize``.
    Use it as the ``transform`` of a :class:`~torch_tricks.data.prefetch.Prefetcher`, or
    call it on a device batch ``(images, labels)``.
    """
    return Compose(
        [
            ToFloat(layout=layout),
            BatchRandomResizedCrop(size, scale=scale, ratio=ratio),
            BatchRandomHorizontalFlip(flip_p),
            BatchNormalize(mean, std),
        ],
        generator=generator,
    )


class BatchTransform:
    """Base class: ``__call__`` = ``apply(images, sample_params(...))``.

    Accepts an image tensor, or a tuple/list whose first element is the images (the
    ``(images, labels)`` batches of a DataLoader); the other elements pass through.
    ``generator`` is a CPU ``torch.Generator`` for the random parameters (``None``: the
    global one); a generator given to the call wins over the one given here.
    """

    op = "identity"

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = _check_generator(generator)

    def sample_params(
        self, batch_size: int, height: int, width: int, generator: torch.Generator | None = None
    ) -> dict[str, Any]:
        """The random parameters for a batch of ``batch_size`` images of ``height`` x ``width`` (CPU tensors)."""
        return {"op": self.op}

    def apply(self, batch: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        """Apply to an image batch (uint8 NHWC/NCHW or float NCHW) with these parameters -> float NCHW."""
        return to_float_nchw(batch)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the output for an input of ``height`` x ``width``."""
        return height, width

    def __call__(self, batch: Any, generator: torch.Generator | None = None) -> Any:
        images = _images(batch)
        n, h, w = _nhw(images, getattr(self, "layout", "auto"))
        params = self.sample_params(n, h, w, _check_generator(generator) or self.generator)
        return _replace_images(batch, self.apply(images, params))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ToFloat(BatchTransform):
    """uint8 NHWC or NCHW -> ``dtype`` NCHW scaled to [0, 1]; float input passes through as NCHW.

    ``layout="auto"`` reads the layout from the shape (channels = 1, 3 or 4 on one side
    only); give ``"NHWC"`` or ``"NCHW"`` when both sides could be channels. An NHWC batch
    becomes an NCHW view with channels-last strides, which no later op needs to copy.
    """

    op = "to_float"

    def __init__(self, layout: str = "auto", dtype: torch.dtype = torch.float32) -> None:
        super().__init__(None)
        if layout not in ("auto", "NHWC", "NCHW"):
            raise UserError(f"layout must be 'auto', 'NHWC' or 'NCHW', got {layout!r}")
        if not dtype.is_floating_point:
            raise UserError(f"ToFloat needs a floating dtype, got {dtype}")
        self.layout = layout
        self.dtype = dtype

    def apply(self, batch: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        return to_float_nchw(batch, self.layout, self.dtype)

    def __repr__(self) -> str:
        return f"ToFloat(layout={self.layout!r}, dtype={self.dtype})"


class BatchRandomResizedCrop(BatchTransform):
    """A random box per sample, each resized to ``size`` with bilinear interpolation, in one ``grid_sample`` call.

    Box sampling follows torchvision's ``RandomResizedCrop.get_params`` (integer boxes),
    vectorised over the batch. Why ``grid_sample``: it takes a different sampling grid per
    sample, so variable-size boxes need no Python loop, no padding and no per-box resize.
    """

    op = "resized_crop"

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(generator)
        self.size = _size(size)
        s0, s1 = _pair(scale, "scale")
        r0, r1 = _pair(ratio, "ratio")
        if not 0 < s0 <= s1:
            raise UserError(f"scale must be (low, high) with 0 < low <= high, got {scale!r}")
        if not 0 < r0 <= r1:
            raise UserError(f"ratio must be (low, high) with 0 < low <= high, got {ratio!r}")
        self.scale = (s0, s1)
        self.ratio = (r0, r1)

    def sample_params(
        self, batch_size: int, height: int, width: int, generator: torch.Generator | None = None
    ) -> dict[str, Any]:
        g = generator if generator is not None else self.generator
        n, tries = batch_size, 10
        area = float(height * width)
        s = torch.empty(n, tries, dtype=torch.float64).uniform_(*self.scale, generator=g)
        log_r = torch.empty(n, tries, dtype=torch.float64).uniform_(
            math.log(self.ratio[0]), math.log(self.ratio[1]), generator=g
        )
        aspect = torch.exp(log_r)
        w = torch.round(torch.sqrt(area * s * aspect)).long()
        h = torch.round(torch.sqrt(area * s / aspect)).long()
        ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
        first = ok.to(torch.uint8).argmax(dim=1)  # the first try that fits, as torchvision's loop takes
        rows = torch.arange(n)
        w, h = w[rows, first], h[rows, first]
        any_ok = ok.any(dim=1)
        if not bool(any_ok.all()):  # torchvision's fallback: a centre crop with the ratio clamped
            fw, fh = self._fallback(height, width)
            w = torch.where(any_ok, w, torch.full_like(w, fw))
            h = torch.where(any_ok, h, torch.full_like(h, fh))
        u_top = torch.rand(n, dtype=torch.float64, generator=g)
        u_left = torch.rand(n, dtype=torch.float64, generator=g)
        top = torch.minimum(torch.floor(u_top * (height - h + 1)).long(), height - h)
        left = torch.minimum(torch.floor(u_left * (width - w + 1)).long(), width - w)
        if not bool(any_ok.all()):
            top = torch.where(any_ok, top, (height - h) // 2)
            left = torch.where(any_ok, left, (width - w) // 2)
        return {"op": self.op, "top": top, "left": left, "height": h, "width": w, "size": self.size}

    def _fallback(self, height: int, width: int) -> tuple[int, int]:
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w = width
            h = int(round(w / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            h = height
            w = int(round(h * self.ratio[1]))
        else:
            w, h = width, height
        return w, h

    def apply(self, batch: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        x = to_float_nchw(batch)
        n, _, height, width = x.shape
        oh, ow = params["size"]
        dev = x.device
        # Coordinates in float64 on small (N, ow) / (N, oh) vectors, then cast: keeps the
        # sampling positions exact to float32 rounding before the big (N, oh, ow, 2) grid.
        top, left, h, w = (params[k].to(dev, torch.float64).view(n, 1) for k in ("top", "left", "height", "width"))
        xo = torch.arange(ow, device=dev, dtype=torch.float64).view(1, ow)
        yo = torch.arange(oh, device=dev, dtype=torch.float64).view(1, oh)
        # interpolate(align_corners=False): source = (o + 0.5) * in / out - 0.5, clamped to the crop
        xs = left + torch.minimum(((xo + 0.5) * w / ow - 0.5).clamp_min(0), w - 1)
        ys = top + torch.minimum(((yo + 0.5) * h / oh - 0.5).clamp_min(0), h - 1)
        # grid_sample(align_corners=False) maps pixel p to (2p + 1) / size - 1
        gx = ((2 * xs + 1) / width - 1).to(x.dtype)
        gy = ((2 * ys + 1) / height - 1).to(x.dtype)
        grid = torch.stack((gx.view(n, 1, ow).expand(n, oh, ow), gy.view(n, oh, 1).expand(n, oh, ow)), dim=-1)
        return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        return self.size

    def __repr__(self) -> str:
        return f"BatchRandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio})"


class BatchRandomHorizontalFlip(BatchTransform):
    """Mirror each sample left-right with probability ``p`` (one ``torch.where`` for the batch)."""

    op = "hflip"

    def __init__(self, p: float = 0.5, generator: torch.Generator | None = None) -> None:
        super().__init__(generator)
        if not 0.0 <= float(p) <= 1.0:
            raise UserError(f"p must be in [0, 1], got {p!r}")
        self.p = float(p)

    def sample_params(
        self, batch_size: int, height: int, width: int, generator: torch.Generator | None = None
    ) -> dict[str, Any]:
        g = generator if generator is not None else self.generator
        return {"op": self.op, "flip": torch.rand(batch_size, dtype=torch.float64, generator=g) < self.p}

    def apply(self, batch: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        x = to_float_nchw(batch)
        flip = params["flip"].to(x.device).view(-1, 1, 1, 1)
        return torch.where(flip, x.flip(-1), x)

    def __repr__(self) -> str:
        return f"BatchRandomHorizontalFlip(p={self.p})"


class BatchNormalize(BatchTransform):
    """``(x - mean) / std`` per channel, for [0, 1]-scaled inputs (uint8 input is scaled first)."""

    op = "normalize"

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        super().__init__(None)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        if len(self.mean) != len(self.std) or not self.mean:
            raise UserError(f"mean and std need one value per channel, got {len(self.mean)} and {len(self.std)}")
        if any(s <= 0 for s in self.std):
            raise UserError(f"std values must be > 0, got {self.std}")

    def sample_params(
        self, batch_size: int, height: int, width: int, generator: torch.Generator | None = None
    ) -> dict[str, Any]:
        return {"op": self.op, "mean": self.mean, "std": self.std}

    def apply(self, batch: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        x = to_float_nchw(batch)
        if x.shape[1] != len(self.mean):
            raise UserError(f"BatchNormalize has {len(self.mean)} channels of mean/std, the batch has {x.shape[1]}")
        mean = torch.tensor(self.mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        std = torch.tensor(self.std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
        return (x - mean) / std

    def __repr__(self) -> str:
        return f"BatchNormalize(mean={self.mean}, std={self.std})"


class Compose(BatchTransform):
    """Several batch transforms in order; all random parameters come from ``generator``.

    (The children's own generators are used only when a child is called alone.)
    """

    op = "compose"

    def __init__(self, transforms: Sequence[BatchTransform], generator: torch.Generator | None = None) -> None:
        super().__init__(generator)
        transforms = list(transforms)
        for t in transforms:
            if not isinstance(t, BatchTransform):
                raise UserError(f"Compose takes batch transforms, got {type(t).__name__}")
        self.transforms = transforms
        first = transforms[0] if transforms else None
        self.layout = getattr(first, "layout", "auto")

    def sample_params(
        self, batch_size: int, height: int, width: int, generator: torch.Generator | None = None
    ) -> dict[str, Any]:
        g = generator if generator is not None else self.generator
        out = []
        for t in self.transforms:
            out.append(t.sample_params(batch_size, height, width, g))
            height, width = t.output_size(height, width)
        return {"op": self.op, "params": out}

    def apply(self, batch: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        x = batch
        for t, p in zip(self.transforms, params["params"]):
            x = t.apply(x, p)
        return to_float_nchw(x)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        for t in self.transforms:
            height, width = t.output_size(height, width)
        return height, width

    def __repr__(self) -> str:
        return "Compose([" + ", ".join(repr(t) for t in self.transforms) + "])"


def to_float_nchw(x: torch.Tensor, layout: str = "auto", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A 4-D image batch as float NCHW: uint8 (NHWC or NCHW) is scaled to [0, 1]; float is taken as NCHW."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise UserError(f"expected a 4-D image batch (N, H, W, C) or (N, C, H, W), got {shape}")
    if x.is_floating_point():
        return x
    if x.dtype != torch.uint8:
        raise UserError(f"expected a uint8 or float image batch, got {x.dtype}")
    if _layout(x, layout) == "NHWC":
        x = x.permute(0, 3, 1, 2)
    return x.to(dtype).div_(255.0)


def params_at(params: Any, i: int) -> Any:
    """The parameters of sample ``i`` out of a batch's ``sample_params`` result (tensors become Python scalars)."""
    if isinstance(params, dict):
        return {k: params_at(v, i) for k, v in params.items()}
    if isinstance(params, list):
        return [params_at(v, i) for v in params]
    if isinstance(params, torch.Tensor) and params.dim() >= 1:
        return params[i].item()
    return params


def per_sample_reference(img_uint8_hwc: Any, params_i: dict[str, Any]) -> torch.Tensor:
    """One image (H, W, C) uint8, numpy or torch, through the same ops one at a time on the CPU -> float CHW.

    The reference for the batched path: crop by slicing, resize with
    ``F.interpolate(mode="bilinear", align_corners=False, antialias=False)``, flip with
    ``flip``, normalise with broadcasting. ``params_i`` comes from :func:`params_at`.
    """
    img = torch.as_tensor(np.asarray(img_uint8_hwc))
    if img.dim() != 3 or img.dtype != torch.uint8:
        raise UserError(f"per_sample_reference takes one uint8 (H, W, C) image, got {img.dtype} {tuple(img.shape)}")
    x = img.permute(2, 0, 1).to(torch.float32) / 255.0
    return _reference_op(x, params_i)


# --- helpers ---------------------------------------------------------------------------


def _reference_op(x: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    op = p["op"]
    if op == "compose":
        for q in p["params"]:
            x = _reference_op(x, q)
        return x
    if op in ("to_float", "identity"):
        return x
    if op == "resized_crop":
        t, l, h, w = int(p["top"]), int(p["left"]), int(p["height"]), int(p["width"])
        crop = x[:, t : t + h, l : l + w]
        return F.interpolate(crop[None], size=tuple(p["size"]), mode="bilinear", align_corners=False, antialias=False)[0]
    if op == "hflip":
        return x.flip(-1) if bool(p["flip"]) else x
    if op == "normalize":
        mean = torch.tensor(p["mean"], dtype=x.dtype).view(-1, 1, 1)
        std = torch.tensor(p["std"], dtype=x.dtype).view(-1, 1, 1)
        return (x - mean) / std
    raise UserError(f"per_sample_reference does not know the op {op!r}")


def _layout(x: torch.Tensor, layout: str) -> str:
    if layout != "auto":
        return layout
    last, second = x.shape[-1] in _CHANNELS, x.shape[1] in _CHANNELS
    if last and not second:
        return "NHWC"
    if second and not last:
        return "NCHW"
    raise UserError(
        f"cannot tell whether the uint8 batch of shape {tuple(x.shape)} is NHWC or NCHW: pass layout='NHWC' or 'NCHW'"
    )


def _nhw(images: torch.Tensor, layout: str) -> tuple[int, int, int]:
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise UserError(f"expected a 4-D image batch (N, H, W, C) or (N, C, H, W), got {shape}")
    n = images.shape[0]
    if not images.is_floating_point() and _layout(images, layout) == "NHWC":
        return n, images.shape[1], images.shape[2]
    return n, images.shape[2], images.shape[3]


def _images(batch: Any) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    raise UserError(
        f"batch transforms take an image tensor or an (images, ...) tuple/list, got {type(batch).__name__}"
    )


def _replace_images(batch: Any, images: torch.Tensor) -> Any:
    if isinstance(batch, torch.Tensor):
        return images
    rest = list(batch[1:])
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(images, *rest)
    return type(batch)([images, *rest])


def _size(size: Any) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    try:
        h, w = (int(v) for v in size)
    except (TypeError, ValueError):
        raise UserError(f"size must be an int or (height, width), got {size!r}") from None
    if h < 1 or w < 1:
        raise UserError(f"size must be positive, got {size!r}")
    return h, w


def _pair(value: Any, name: str) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise UserError(f"{name} must be a pair (low, high), got {value!r}") from None
    return a, b


def _check_generator(generator: Any) -> torch.Generator | None:
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise UserError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != "cpu":
        raise UserError("batch transforms draw their parameters on the CPU: pass a CPU torch.Generator")
    return generator

