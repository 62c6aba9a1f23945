"""Fast image decoding (D3): the fastest installed JPEG decoder, with reduce-on-decode.

Decoding, not reading, is what a JPEG data pipeline spends its CPU on. Two things make
it cheaper:

* **the decoder**: ``simplejpeg`` and ``PyTurboJPEG`` are thin bindings to libjpeg-turbo
  with less per-call overhead than opencv and Pillow; :func:`fastest_decoder` picks the
  first installed of ``simplejpeg``, ``turbojpeg``, ``cv2``, ``pil``. (Modern Pillow and
  opencv wheels bundle libjpeg-turbo too, so the gap is overhead, not the IDCT itself;
  and PIL's lazy ``Image.open`` only *looks* fast: pixels are decoded on ``load()``.)
* **reduce-on-decode**: a JPEG can be decoded straight to 1/2, 1/4 or 1/8 size by
  scaling the IDCT, which skips most of the work. When the target size is much smaller
  than the image, ``decode(data, min_size=N)`` decodes at the largest of those scales
  whose shorter side is still ``>= N``; resize from there. (libjpeg-turbo has other
  factors such as 3/8 or 7/8, but only the powers of two are fast, so only those are used.)

Every decoder returns the same thing: an ``(H, W, 3)`` uint8 RGB array, writable and
C-contiguous. Grayscale JPEGs are expanded to RGB, CMYK/YCCK JPEGs and every non-JPEG
format (PNG, BMP, TIFF, WebP, ...) go through Pillow (opencv if Pillow is missing), and
EXIF orientation is ignored everywhere (as torchvision's ``ImageFolder`` loader does;
opencv is told ``IMREAD_IGNORE_ORIENTATION`` so that it agrees).

Cross-decoder tolerance: all four decoders use libjpeg-turbo's accurate integer IDCT and
fancy upsampling, so on this project's machines their outputs are **bit-identical**
(max abs difference 0) for baseline and progressive JPEGs, 4:4:4 / 4:2:2 / 4:2:0 chroma,
grayscale, odd sizes, at scales 1, 1/2, 1/4, 1/8 (simplejpeg 1.9, PyTurboJPEG 1.8 with
Debian's libjpeg-turbo 2.1.5, opencv 5.0, Pillow 13). The documented guarantee, which
the tests check, is looser to allow other builds: ``max |a - b| <= DECODER_TOLERANCE_MAX``
levels and mean ``<= DECODER_TOLERANCE_MEAN``.
"""

from __future__ import annotations

import io
import threading
import warnings
from functools import lru_cache
from typing import Any

import numpy as np

from torch_tricks._optional import install_hint
from torch_tricks.errors import UserError, one_line
from torch_tricks.registry import register_trick

__all__ = [
    "DecodeError",
    "DECODERS",
    "DECODER_TOLERANCE_MAX",
    "DECODER_TOLERANCE_MEAN",
    "FAST_DCT_TOLERANCE_MAX",
    "FAST_DCT_TOLERANCE_MEAN",
    "available_decoders",
    "fastest_decoder",
    "decode",
    "jpeg_info",
    "resize_shorter",
    "center_crop",
    "crop_ready",
    "decode_crop",
    "encode_jpeg",
    "to_rgb",
    "resize_backend",
]

#: Decoder names, fastest first (the order :func:`fastest_decoder` tries them in).
DECODERS = ("simplejpeg", "turbojpeg", "cv2", "pil")
#: Largest per-pixel difference allowed between two decoders' outputs for the same JPEG.
DECODER_TOLERANCE_MAX = 2
#: Largest mean absolute difference allowed between two decoders' outputs.
DECODER_TOLERANCE_MEAN = 0.1
#: Largest per-pixel difference between ``fast_dct=True`` and the accurate IDCT, JPEG quality <= 90
#: (measured: max 6 at quality 50-90, on photos and on noise).
FAST_DCT_TOLERANCE_MAX = 8
#: Largest mean absolute difference between ``fast_dct=True`` and the accurate IDCT, quality <= 90 (measured <= 1.2).
FAST_DCT_TOLERANCE_MEAN = 1.5

_ALIASES = {"pyturbojpeg": "turbojpeg", "opencv": "cv2", "pillow": "pil", "PIL": "pil"}
_SCALES = (8, 4, 2)  # the fast IDCT scalings, largest reduction first
_INTERPOLATIONS = ("linear", "area", "nearest", "cubic")


class DecodeError(UserError):
    """Bytes that no installed decoder can turn into an image; ``reason`` is the decoder's complaint."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


# --------------------------------------------------------------------------- public API


def available_decoders() -> list[str]:
    """Installed decoders that work here, fastest first (a subset of :data:`DECODERS`).

    ``turbojpeg`` counts only if its shared library loads: PyTurboJPEG 2.x refuses
    libjpeg-turbo < 3.0 (e.g. Debian 12's), in which case ``PyTurboJPEG<2`` works.
    """
    return [name for name in DECODERS if _load(name) is not None]


def fastest_decoder() -> str:
    """The name of the fastest installed decoder; a :class:`UserError` if there is none."""
    names = available_decoders()
    if not names:
        raise UserError(
            f"no image decoder is installed: {install_hint('data')}"
        )
    return names[0]


@register_trick(
    "fast_decode",
    ids=("D3",),
    kind="data",
    trades="nothing: the fastest installed JPEG decoder, and a 1/2-1/8 scaled IDCT when the target is small",
    needs="Pillow at least; simplejpeg, PyTurboJPEG or opencv for speed",
)
def decode(
    data: Any,
    *,
    min_size: int | None = None,
    decoder: str | None = None,
    name: str | None = None,
    reuse: bool = False,
    fast_dct: bool = False,
) -> np.ndarray:
    """Decode encoded image bytes to an ``(H, W, 3)`` uint8 RGB array.

    ``min_size``: decode a JPEG at the largest 1/2, 1/4 or 1/8 scale whose shorter side is
    still ``>= min_size`` (no effect on other formats or when no scale fits). The result
    can therefore be larger than ``min_size``: resize it afterwards.
    ``decoder``: one of :data:`DECODERS` (default: :func:`fastest_decoder`).
    ``name``: the sample's name (a path, an index) for the error message.
    ``reuse``: decode JPEGs (with simplejpeg) into a buffer this thread reuses, saving an
    allocation per image; the result is then overwritten by the thread's next ``reuse``
    decode, so copy it first (what a loader writing into its batch buffer does).

    Raises :class:`DecodeError` for bytes that are not a readable image (truncated JPEGs
    included: every decoder is run in its strict mode).
    """
    buf = _as_buffer(data)
    dec = _resolve(decoder)
    info = jpeg_info(buf)
    try:
        if info is None or info[2] not in (1, 3) or dec == "pil":
            # not a (plain) JPEG: Pillow knows every format and CMYK; opencv if it's all we have
            if _load("pil") is not None:
                return _decode_pil(buf, info, min_size)
            return _decode_cv2(buf, None, 1)
        scale = _pick_scale(info[0], info[1], min_size)
        if reuse and dec == "simplejpeg":
            out = _scratch(-(-info[0] // scale) * -(-info[1] // scale) * 3)
            return _decode_simplejpeg(buf, info, scale, out, fast_dct=fast_dct)
        return _DECODE[dec](buf, info, scale, fast_dct=fast_dct)
    except DecodeError:
        raise
    except Exception as exc:  # every decoder has its own error types; unify them
        raise _decode_error(exc, name, buf) from None


def jpeg_info(data: Any) -> tuple[int, int, int] | None:
    """``(height, width, components)`` from a JPEG's frame header, or None if ``data`` isn't a JPEG.

    Reads only the markers up to the first SOF segment (no decoding), so it costs
    microseconds; it is how :func:`decode` picks the DCT scale for decoders that have
    no header call of their own (opencv) and spots CMYK files (4 components).
    """
    mv = memoryview(_as_buffer(data)).cast("B")
    n = len(mv)
    if n < 4 or mv[0] != 0xFF or mv[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if mv[i] != 0xFF:
            return None
        marker = mv[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image / start of scan before any frame header
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if i + 10 > n:
                return None
            height = (mv[i + 5] << 8) | mv[i + 6]
            width = (mv[i + 7] << 8) | mv[i + 8]
            return height, width, mv[i + 9]
        i += 2 + ((mv[i + 2] << 8) | mv[i + 3])
    return None


def resize_shorter(
    img: np.ndarray, size: int, interpolation: str = "linear", *, backend: str | None = None
) -> np.ndarray:
    """Resize so the shorter side is ``size``, keeping the aspect ratio.

    The longer side is ``int(size * long / short)``, as torchvision's ``Resize(int)``.
    ``interpolation``: ``linear`` (default: ~0.15 ms where ``area`` takes ~0.8 ms on this
    project's 2-core machine; pair it with reduce-on-decode so the remaining factor is
    < 2 and linear doesn't alias), ``area``, ``nearest`` or ``cubic``.
    ``backend``: ``cv2`` (default when installed) or ``pil``. They do not give identical
    pixels (Pillow's bilinear widens its filter when shrinking, opencv's does not), so a
    pack records which one it used.
    """
    if interpolation not in _INTERPOLATIONS:
        raise UserError(f"unknown interpolation {interpolation!r}: choose one of {', '.join(_INTERPOLATIONS)}")
    if size < 1:
        raise UserError(f"resize size must be a positive number of pixels, not {size}")
    h, w = img.shape[:2]
    if h <= w:
        new_h, new_w = size, int(size * w / h)
    else:
        new_h, new_w = int(size * h / w), size
    if (new_h, new_w) == (h, w):
        return img
    backend = backend or resize_backend()
    if backend == "cv2":
        cv2 = _load("cv2")
        if cv2 is None:
            raise UserError(f"resize backend 'cv2' needs opencv: {install_hint('data')}, or use 'pil'")
        flag = {"linear": cv2.INTER_LINEAR, "area": cv2.INTER_AREA, "nearest": cv2.INTER_NEAREST,
                "cubic": cv2.INTER_CUBIC}[interpolation]
        return cv2.resize(np.ascontiguousarray(img), (new_w, new_h), interpolation=flag)
    if backend != "pil":
        raise UserError(f"unknown resize backend {backend!r}: choose cv2 or pil")
    Image = _require_pil("resizing")
    flag = {"linear": Image.Resampling.BILINEAR, "area": Image.Resampling.BOX,
            "nearest": Image.Resampling.NEAREST, "cubic": Image.Resampling.BICUBIC}[interpolation]
    return np.array(Image.fromarray(img).resize((new_w, new_h), flag))


def resize_backend() -> str:
    """The backend :func:`resize_shorter` uses by default: ``cv2`` if installed, else ``pil``."""
    if _load("cv2") is not None:
        return "cv2"
    _require_pil("resizing")
    return "pil"


def center_crop(img: np.ndarray, size: int | tuple[int, int], *, copy: bool = True) -> np.ndarray:
    """The central ``size`` (int for a square, or ``(h, w)``) of ``img``, as torchvision's ``CenterCrop``.

    Offsets are ``int(round((H - h) / 2))``; an image smaller than the crop is padded with
    zeros first (also as torchvision). Returns a contiguous copy, or with ``copy=False`` a
    view of ``img`` (when the next step copies anyway, e.g. into a batch buffer).
    """
    th, tw = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    h, w = img.shape[:2]
    if h < th or w < tw:
        ph, pw = max(th - h, 0), max(tw - w, 0)
        pad = [(ph // 2, (ph + 1) // 2), (pw // 2, (pw + 1) // 2)] + [(0, 0)] * (img.ndim - 2)
        img = np.pad(img, pad)
        h, w = img.shape[:2]
    top = int(round((h - th) / 2.0))
    left = int(round((w - tw) / 2.0))
    view = img[top : top + th, left : left + tw]
    return np.ascontiguousarray(view) if copy else view


def encode_jpeg(img: np.ndarray, quality: int = 90, *, crop_ready: bool = False) -> bytes:
    """Encode an ``(H, W, 3)`` (or ``(H, W)``) uint8 RGB array as a 4:2:0 JPEG at ``quality`` (1-100).

    Uses the first installed of simplejpeg, turbojpeg, opencv, Pillow; the bytes differ
    between encoders but every decoder reads any of them.
    ``crop_ready``: put a restart marker after every MCU (opencv or Pillow), and after the
    end-of-image marker (where every decoder stops reading) the byte offsets of the MCUs,
    so that :func:`decode_crop` can decode a crop from only the MCUs it covers; ~6% larger
    at quality 90 (markers 2.5%, offsets 3.5%).
    """
    if not 1 <= int(quality) <= 100:
        raise UserError(f"JPEG quality must be 1-100, not {quality}")
    img = np.ascontiguousarray(to_rgb(img))
    quality = int(quality)
    if crop_ready:
        return _encode_restarts(img, quality)
    if (sj := _load("simplejpeg")) is not None:
        return sj.encode_jpeg(img, quality=quality, colorspace="RGB", colorsubsampling="420")
    if (tj := _load("turbojpeg")) is not None:
        import turbojpeg

        return tj.encode(img, quality=quality, pixel_format=turbojpeg.TJPF_RGB, jpeg_subsample=turbojpeg.TJSAMP_420)
    if (cv2 := _load("cv2")) is not None:
        ok, out = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
        if ok:
            return out.tobytes()
    Image = _require_pil("JPEG encoding")
    out = io.BytesIO()
    Image.fromarray(img).save(out, format="JPEG", quality=quality, subsampling="4:2:0")
    return out.getvalue()


@register_trick(
    "crop_decode",
    ids=("D3",),
    kind="data",
    trades="~6% more bytes per JPEG (restart markers, an MCU index) for decoding only the MCUs a crop covers; "
    "the same pixels as decoding whole",
    needs="JPEGs packed crop-ready (pack(storage='jpeg') does by default) and a crop well inside the image",
)
def decode_crop(
    data: Any,
    top: int,
    left: int,
    height: int,
    width: int,
    *,
    decoder: str | None = None,
    name: str | None = None,
    reuse: bool = False,
    fast_dct: bool = False,
) -> np.ndarray:
    """The ``(height, width)`` region at ``(top, left)`` of the decoded image, decoding as little as possible.

    When the JPEG has a restart marker after every MCU (what :func:`encode_jpeg` writes with
    ``crop_ready=True``, and ``pack(storage="jpeg")`` stores), only the MCUs the region
    covers, plus a 3-pixel margin for chroma upsampling, are decoded: their entropy-coded
    bytes are cut out and joined into a smaller JPEG, without re-encoding anything. The
    pixels are bit-identical to decoding the whole image and cropping (tested); a center
    224 crop of a 256-short-side image decodes ~70% of it. Any other image is decoded
    whole and cropped. Why by hand: libjpeg-turbo can skip scanlines and crop them
    (``jpeg_crop_scanline``), but no Python binding exposes that, and lossless cropping
    (``tjTransform``, PyTurboJPEG's ``crop``) re-encodes, which costs more than it saves.

    ``reuse`` and ``fast_dct`` as in :func:`decode`; with ``reuse`` the result is a view
    into this thread's decode buffer. The region must lie inside the image.
    """
    top, left, height, width = int(top), int(left), int(height), int(width)
    buf = _as_buffer(data)
    layout = _restart_layout(buf)
    if layout is not None:
        h, w = layout.height, layout.width
    else:
        info = jpeg_info(buf)
        h, w = (info[0], info[1]) if info is not None else (None, None)
    if h is not None:
        _check_box(top, left, height, width, h, w, _label(name, buf))
    if layout is not None:
        try:
            part, (y0, x0), size = layout.cut(buf, top, left, height, width)
        except _NotCroppable:
            part, y0, x0 = None, 0, 0
        if part is not None:
            img = _decode_part(part, size, decoder, name, reuse, fast_dct)
            view = img[top - y0 : top - y0 + height, left - x0 : left - x0 + width]
            return view if reuse else np.ascontiguousarray(view)
    img = decode(buf, decoder=decoder, name=name, reuse=reuse, fast_dct=fast_dct)
    if h is None:  # not a JPEG: the size is known only now
        _check_box(top, left, height, width, img.shape[0], img.shape[1], _label(name, buf))
    view = img[top : top + height, left : left + width]
    return view if reuse else np.ascontiguousarray(view)


def _decode_part(part: np.ndarray, size: tuple[int, int], decoder: str | None, name: str | None, reuse: bool,
                 fast_dct: bool) -> np.ndarray:
    """:func:`decode` for a part cut out by :func:`decode_crop` (a plain baseline JPEG of ``size``, whose
    frame header it wrote itself): straight to simplejpeg, without parsing the header again."""
    if _resolve(decoder) != "simplejpeg":
        return decode(part, decoder=decoder, name=name, reuse=reuse, fast_dct=fast_dct)
    info = (size[0], size[1], 3)
    try:
        out = _scratch(info[0] * info[1] * 3) if reuse else None
        return _decode_simplejpeg(part, info, 1, out, fast_dct=fast_dct)
    except Exception as exc:
        raise _decode_error(exc, name, part) from None


def _check_box(top: int, left: int, height: int, width: int, h: int, w: int, what: str) -> None:
    if top < 0 or left < 0 or height < 1 or width < 1 or top + height > h or left + width > w:
        raise UserError(f"crop {height}x{width} at ({top}, {left}) does not fit in {what} of {h}x{w}: "
                        "crop inside the image (center_crop pads smaller images)")


def _decode_error(exc: BaseException, name: str | None, buf: Any) -> DecodeError:
    """One :class:`DecodeError` for every decoder's own error types."""
    reason = _reason(exc)
    return DecodeError(f"cannot decode {_label(name, buf)}: {reason}; skip or replace this file", reason)


def crop_ready(data: Any) -> bool:
    """Whether :func:`decode_crop` can decode crops of this JPEG from the MCUs they cover alone."""
    return _restart_layout(_as_buffer(data)) is not None


def _encode_restarts(img: np.ndarray, quality: int) -> bytes:
    """A 4:2:0 baseline JPEG with a restart marker after every MCU (opencv, else Pillow >= 10.2)."""
    out: bytes | None = None
    if (cv2 := _load("cv2")) is not None:
        ok, enc = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR) if img.ndim == 3 else img,
                               [cv2.IMWRITE_JPEG_QUALITY, quality, cv2.IMWRITE_JPEG_RST_INTERVAL, 1])
        out = enc.tobytes() if ok else None
    if out is None and (Image := _load("pil")) is not None:
        f = io.BytesIO()
        Image.fromarray(img).save(f, format="JPEG", quality=quality, subsampling="4:2:0", restart_marker_blocks=1)
        out = f.getvalue()
    if out is None or _restart_layout(out) is None:
        raise UserError("crop-ready JPEGs need opencv or Pillow >= 10.2 (restart markers): "
                        f"{install_hint('data')}")
    return _with_trailer(out)


def to_rgb(img: Any) -> np.ndarray:
    """An ``(H, W, 3)`` uint8 array from an array (HW, HW1, HW3, HW4; a CHW uint8 tensor) or a PIL image.

    Alpha is dropped (as PIL's ``convert("RGB")``), grayscale is repeated to three channels.
    """
    if hasattr(img, "convert") and hasattr(img, "mode"):  # a PIL image
        return np.array(img if img.mode == "RGB" else img.convert("RGB"))
    if hasattr(img, "numpy") and hasattr(img, "permute"):  # a torch tensor, as torchvision's read_image gives
        t = img.detach().cpu()
        if t.ndim == 3 and t.shape[0] in (1, 3, 4) and t.shape[-1] not in (1, 3, 4):
            t = t.permute(1, 2, 0)
        img = t.numpy()
    arr = np.asarray(img)
    if arr.dtype != np.uint8:
        raise UserError(f"images must be uint8, got {arr.dtype}: convert with (x * 255).round().astype('uint8')")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim == 2:
        return np.repeat(arr[:, :, None], 3, axis=2)
    if arr.ndim == 3 and arr.shape[2] in (3, 4):
        return np.ascontiguousarray(arr[:, :, :3])
    raise UserError(f"expected an image of shape (H, W), (H, W, 3) or (H, W, 4), got {arr.shape}")


# --------------------------------------------------------------------------- decoders


@lru_cache(maxsize=None)
def _load(name: str) -> Any:
    """The decoder's module (or turbojpeg instance), or None if it isn't installed or doesn't load."""
    try:
        if name == "simplejpeg":
            import simplejpeg

            return simplejpeg
        if name == "turbojpeg":
            from turbojpeg import TurboJPEG

            return TurboJPEG()  # raises if libturbojpeg is missing or too old for this PyTurboJPEG
        if name == "cv2":
            import cv2

            return cv2
        if name == "pil":
            from PIL import Image

            return Image
    except Exception:  # ImportError, OSError (no shared library), RuntimeError (version check)
        return None
    raise ValueError(name)


def _resolve(decoder: str | None) -> str:
    if decoder is None:
        return fastest_decoder()
    name = _ALIASES.get(decoder, decoder)
    if name not in DECODERS:
        raise UserError(f"unknown decoder {decoder!r}: choose one of {', '.join(DECODERS)}")
    if _load(name) is None:
        hint = {
            "simplejpeg": install_hint("data"),
            "turbojpeg": "pip install PyTurboJPEG and install libjpeg-turbo (Debian: apt-get install libturbojpeg0; "
            "with libjpeg-turbo < 3.0 use 'PyTurboJPEG<2')",
            "cv2": install_hint("data"),
            "pil": install_hint("data"),
        }[name]
        raise UserError(f"decoder {name!r} is not installed or does not load: {hint}")
    return name


def _pick_scale(h: int, w: int, min_size: int | None) -> int:
    """The largest of 8, 4, 2 with ceil(short / d) >= min_size (1 if none fits)."""
    if not min_size or min_size < 1:
        return 1
    short = min(h, w)
    for d in _SCALES:
        if short >= d and -(-short // d) >= min_size:
            return d
    return 1


def _decode_simplejpeg(buf: Any, info: tuple[int, int, int], scale: int, out: Any = None, *,
                       fast_dct: bool = False) -> np.ndarray:
    sj = _load("simplejpeg")
    if scale == 1:
        return sj.decode_jpeg(buf, colorspace="RGB", strict=True, buffer=out, fastdct=fast_dct)
    h, w = info[0], info[1]
    # simplejpeg picks the smallest libjpeg-turbo factor whose output is at least this big:
    # exactly 1/scale, since ceil(h/scale) x ceil(w/scale) is the 1/scale output size
    return sj.decode_jpeg(buf, colorspace="RGB", min_height=-(-h // scale), min_width=-(-w // scale), strict=True,
                          buffer=out, fastdct=fast_dct)


_LOCAL = threading.local()


def _scratch(nbytes: int) -> np.ndarray:
    """This thread's reusable decode buffer, grown to at least ``nbytes``; a view of exactly ``nbytes``."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _LOCAL.buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    return buf[:nbytes]


def _decode_turbojpeg(buf: Any, info: tuple[int, int, int], scale: int, *, fast_dct: bool = False) -> np.ndarray:
    import turbojpeg

    tj = _load("turbojpeg")
    # PyTurboJPEG reports libjpeg warnings (a truncated file among them) with warnings.warn and
    # returns the half-decoded image; record them and fail instead, like the other decoders
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = tj.decode(
            buf,
            pixel_format=turbojpeg.TJPF_RGB,
            scaling_factor=None if scale == 1 else (1, scale),
            flags=turbojpeg.TJFLAG_STOPONWARNING | (turbojpeg.TJFLAG_FASTDCT if fast_dct else 0),
        )
    if caught:
        raise ValueError(str(caught[0].message))
    return out


def _decode_cv2(buf: Any, info: tuple[int, int, int] | None, scale: int, *, fast_dct: bool = False) -> np.ndarray:
    """opencv path: a JPEG at 1/``scale``; or, when Pillow is missing, any format opencv reads (scale 1).
    opencv has no IDCT switch: ``fast_dct`` is ignored (the accurate IDCT is within its tolerance)."""
    cv2 = _load("cv2")
    if cv2 is None:
        raise UserError(f"no decoder for this image format: {install_hint('data')}")
    flag = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
            8: cv2.IMREAD_REDUCED_COLOR_8}[scale]
    out = cv2.imdecode(np.frombuffer(buf, dtype=np.uint8), flag | cv2.IMREAD_IGNORE_ORIENTATION)
    if out is None:
        raise ValueError("opencv could not decode it (corrupt, truncated or not an image)")
    return cv2.cvtColor(out, cv2.COLOR_BGR2RGB)


def _decode_pil(buf: Any, info: tuple[int, int, int] | None, min_size: int | None) -> np.ndarray:
    Image = _load("pil")
    img = Image.open(io.BytesIO(buf))
    if info is not None:
        scale = _pick_scale(info[0], info[1], min_size)
        if scale > 1:
            # draft() picks the largest scale whose output is at least this size: exactly 1/scale
            img.draft(img.mode, (img.size[0] // scale, img.size[1] // scale))
    img.load()  # Image.open is lazy: the pixels are decoded here (and errors raised here)
    return np.array(img if img.mode == "RGB" else img.convert("RGB"))


_CROP_MARGIN = 3  # pixels beyond a crop whose MCUs are decoded too: fancy chroma upsampling reads 1 chroma sample out


_RST_CYCLE = (0xD0 + (np.arange(1 << 14) & 7)).astype(np.uint8)  # RST0, RST1, ... RST7, RST0, ...


class _NotCroppable(Exception):
    """The restart markers are not where a restart-every-MCU JPEG has them (damaged or unusual): decode whole."""


class _RestartLayout:
    """Where the parts of a baseline JPEG with a restart marker after every MCU are (see :func:`decode_crop`)."""

    __slots__ = ("height", "width", "sof", "scan", "mcu_h", "mcu_w")

    def __init__(self, height: int, width: int, sof: int, scan: int, mcu_h: int, mcu_w: int) -> None:
        self.height, self.width, self.sof, self.scan, self.mcu_h, self.mcu_w = height, width, sof, scan, mcu_h, mcu_w

    def cut(self, buf: Any, top: int, left: int, height: int, width: int) -> tuple[Any, tuple[int, int],
                                                                                   tuple[int, int]]:
        """A JPEG of the MCUs covering the region (plus margin), its pixel origin in the image and its
        size; ``(None, ...)`` when that would be (nearly) the whole image."""
        mh, mw = self.mcu_h, self.mcu_w
        rows, cols = -(-self.height // mh), -(-self.width // mw)
        r0, r1 = max(0, (top - _CROP_MARGIN) // mh), min(rows, -(-(top + height + _CROP_MARGIN) // mh))
        c0, c1 = max(0, (left - _CROP_MARGIN) // mw), min(cols, -(-(left + width + _CROP_MARGIN) // mw))
        if (r1 - r0) * (c1 - c0) * 10 > rows * cols * 9:  # saves under 10%: not worth cutting
            return None, (0, 0), (self.height, self.width)
        a = np.frombuffer(buf, dtype=np.uint8)
        body = a[self.scan :]
        bounds = _mcu_bounds(a, self.scan, rows * cols)
        # MCU k's bytes are body[bounds[k]:bounds[k + 1]]: each ends with its 2-byte marker (the last with
        # EOI); grid: for each kept MCU row, where its kept MCUs start, and where the last of them ends
        grid = bounds[(np.arange(r0, r1) * cols)[:, None] + np.arange(c0, c1 + 1)]
        head = bytearray(a[: self.scan].tobytes())
        h, w = min(r1 * mh, self.height) - r0 * mh, min(c1 * mw, self.width) - c0 * mw
        head[self.sof + 5 : self.sof + 9] = bytes((h >> 8, h & 255, w >> 8, w & 255))
        runs = grid[:, [0, -1]].tolist()
        mv = memoryview(body)  # joined as bytes: one copy, and the GIL kept (np.concatenate lets it go and
        out = np.frombuffer(bytearray().join([head, *[mv[s:e] for s, e in runs]]), dtype=np.uint8)  # waits)
        # each kept MCU's marker's second byte in the output: renumbered 0-7 cyclic, the last one EOI
        lengths = grid[:, -1] - grid[:, 0]
        shift = len(head) - 1 - grid[:, 0] + np.cumsum(lengths) - lengths
        marks = (grid[:, 1:] + shift[:, None]).ravel()
        out[marks] = _RST_CYCLE[: len(marks)] if len(marks) <= len(_RST_CYCLE) else 0xD0 + (np.arange(len(marks)) & 7)
        out[marks[-1]] = 0xD9
        return out, (r0 * mh, c0 * mw), (h, w)


_TRAILER = b"TTMC"  # after the EOI of a crop-ready JPEG: its MCUs' byte offsets, their count, this tag


def _mcu_bounds(a: np.ndarray, scan: int, mcus: int) -> np.ndarray:
    """``bounds`` (int64, ``mcus + 1``): MCU k's entropy-coded bytes, ending with its marker, are
    ``a[scan + bounds[k] : scan + bounds[k + 1]]``. From the trailer :func:`encode_jpeg` appends when
    it is there and agrees with the file (every offset just after a marker, in order), else by
    finding the markers (~10 us for 40 KB)."""
    n = len(a)
    if n >= scan + 8 and a[n - 4 :].tobytes() == _TRAILER:
        count = int(a[n - 8 : n - 4].view("<u4")[0])
        at = n - 8 - 4 * count
        if count == mcus + 1 and at >= scan:
            bounds = a[at : n - 8].view("<u4").astype(np.int64)
            if bounds[0] == 0 and scan + bounds[-1] == at:
                ends = bounds[1:] + (scan - 1)  # each MCU ends with a marker (RSTn; the last one EOI): its 2nd byte
                second = a[ends]
                if (ends[1:] > ends[:-1] + 2).all() and (a[ends - 1] == 0xFF).all() \
                        and ((second[:-1] & 0xF8) == 0xD0).all() and second[-1] == 0xD9:
                    return bounds
    body = a[scan:]
    ff = np.flatnonzero(body[:-1] == 0xFF)  # markers; 0xFF bytes in entropy data are followed by 0x00
    nxt = body[ff + 1]
    rst, eoi = ff[(nxt & 0xF8) == 0xD0], ff[nxt == 0xD9]
    if len(rst) != mcus - 1 or not len(eoi) or (len(rst) and eoi[0] < rst[-1]):
        raise _NotCroppable
    return np.concatenate(([0], rst + 2, eoi[:1] + 2))


def _with_trailer(data: bytes) -> bytes:
    """A crop-ready JPEG followed by the byte offsets of its MCUs (every decoder stops at EOI)."""
    layout = _restart_layout(data)
    if layout is None:
        return data
    mcus = -(-layout.height // layout.mcu_h) * -(-layout.width // layout.mcu_w)
    a = np.frombuffer(data, dtype=np.uint8)
    bounds = _mcu_bounds(a, layout.scan, mcus)
    if layout.scan + bounds[-1] != len(a):  # something after EOI already: leave it as it is
        return data
    return data + bounds.astype("<u4").tobytes() + np.uint32(len(bounds)).astype("<u4").tobytes() + _TRAILER


def _restart_layout(buf: Any) -> _RestartLayout | None:
    """The layout of a baseline, single-scan JPEG whose restart interval is one MCU; None for anything else."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else memoryview(buf)
    n = len(mv)
    if n < 4 or mv[0] != 0xFF or mv[1] != 0xD8:
        return None
    i, sof, dri = 2, -1, 0
    frame: tuple[int, int, int, int, int] | None = None
    while i + 4 <= n:
        if mv[i] != 0xFF:
            return None
        marker = mv[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        length = (mv[i + 2] << 8) | mv[i + 3]
        if marker in (0xC0, 0xC1):  # baseline / extended sequential Huffman
            frame = _sequential_frame(mv, i, n)
            if frame is None:
                return None
            sof = i
        elif marker == 0xDD and i + 6 <= n:
            dri = (mv[i + 4] << 8) | mv[i + 5]
        elif marker == 0xDA:
            return _scan_layout(mv, i, n, length, sof, frame, dri)
        elif _ends_the_walk(marker):
            return None
        i += 2 + length
    return None


def _sequential_frame(mv: memoryview, i: int, n: int) -> tuple[int, int, int, int, int] | None:
    """``(height, width, components, MCU height, MCU width)`` of the SOF0/SOF1 segment at ``i``; None
    for a truncated one or a component count other than 1 (gray) or 3 (YCbCr)."""
    if i + 10 > n:
        return None
    height, width, comps = (mv[i + 5] << 8) | mv[i + 6], (mv[i + 7] << 8) | mv[i + 8], mv[i + 9]
    if comps not in (1, 3) or i + 10 + 3 * comps > n:
        return None
    if comps == 1:
        return height, width, comps, 8, 8
    hs = [mv[i + 11 + 3 * c] >> 4 for c in range(comps)]
    vs = [mv[i + 11 + 3 * c] & 15 for c in range(comps)]
    return height, width, comps, 8 * max(vs), 8 * max(hs)


def _scan_layout(mv: memoryview, i: int, n: int, length: int, sof: int,
                 frame: tuple[int, int, int, int, int] | None, dri: int) -> _RestartLayout | None:
    """The layout when the scan at ``i`` follows a sequential frame, holds every component (interleaved)
    and restarts after each MCU; None otherwise."""
    if frame is None or dri != 1 or i + 5 > n:
        return None
    height, width, comps, mcu_h, mcu_w = frame
    if mv[i + 4] != comps or not height or not width:
        return None
    return _RestartLayout(height, width, sof, i + 2 + length, mcu_h, mcu_w)


def _ends_the_walk(marker: int) -> bool:
    """A frame kind not cut here (progressive, lossless, arithmetic), or a restart / end marker before the scan."""
    return (0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC)) or marker == 0xD9 or 0xD0 <= marker <= 0xD7


_DECODE = {
    "simplejpeg": _decode_simplejpeg,
    "turbojpeg": _decode_turbojpeg,
    "cv2": _decode_cv2,
}  # "pil" is handled in decode() itself, with the other formats


# --------------------------------------------------------------------------- helpers


def _as_buffer(data: Any) -> Any:
    """bytes / bytearray as they are; anything else with the buffer protocol as a flat uint8 array."""
    if isinstance(data, (bytes, bytearray)):
        return data
    if isinstance(data, memoryview):
        return np.frombuffer(data, dtype=np.uint8)
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise UserError(f"decode() takes encoded bytes, got an array of shape {data.shape} {data.dtype}: "
                            "use to_rgb() for decoded images")
        return np.ascontiguousarray(data)
    raise UserError(f"decode() takes encoded bytes, not {type(data).__name__}")


def _require_pil(what: str) -> Any:
    Image = _load("pil")
    if Image is None:
        raise UserError(f"{what} needs Pillow (or opencv): {install_hint('data')}")
    return Image


def _label(name: str | None, buf: Any) -> str:
    return f"sample {name}" if name is not None else f"a {len(buf)}-byte image"


def _reason(exc: BaseException) -> str:
    if type(exc).__name__ == "UnidentifiedImageError":  # its message is a BytesIO repr
        return "not an image format Pillow knows (corrupt or not an image)"
    return one_line(exc, 200)
