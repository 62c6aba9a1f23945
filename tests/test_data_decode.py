"""Decoding (D3): decoder choice, reduce-on-decode, cross-decoder tolerance, odd inputs, errors."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
from PIL import Image

from torch_tricks.data import decode as D
from torch_tricks.errors import UserError


def smooth(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A photo-like image (gradients, waves, a little noise): JPEG-friendly, unlike pure noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    fx, fy = rng.uniform(0.05, 0.3, 2)
    img = np.stack([x * 255 / w, y * 255 / h, 128 + 100 * np.sin(x * fx + y * fy)], -1)
    return (img + rng.normal(0, 4, img.shape)).clip(0, 255).astype(np.uint8)


def jpeg(img: np.ndarray, mode: str = "RGB", **kw) -> bytes:
    im = Image.fromarray(img)
    if mode != "RGB":
        im = im.convert(mode)
    out = io.BytesIO()
    im.save(out, format="JPEG", **kw)
    return out.getvalue()


def encoded(img: np.ndarray, fmt: str, mode: str = "RGB") -> bytes:
    im = Image.fromarray(img).convert(mode)
    out = io.BytesIO()
    im.save(out, format=fmt)
    return out.getvalue()


JPEG_VARIANTS = {
    "420": dict(quality=90),
    "444": dict(quality=80, subsampling=0),
    "422": dict(quality=95, subsampling=1),
    "progressive": dict(quality=85, progressive=True),
}
SIZES = [(48, 64), (61, 97), (120, 90), (17, 9)]


def jpeg_cases():
    for (h, w), (variant, kw) in itertools.product(SIZES, JPEG_VARIANTS.items()):
        yield f"{h}x{w}-{variant}", jpeg(smooth(h, w, h * w), **kw)
    for h, w in SIZES:
        yield f"{h}x{w}-gray", jpeg(smooth(h, w, h + w), mode="L", quality=90)
        yield f"{h}x{w}-cmyk", jpeg(smooth(h, w, h * 7 + w), mode="CMYK", quality=90)


def test_available_decoders_in_speed_order():
    names = D.available_decoders()
    assert "pil" in names  # Pillow is a test dependency
    assert names == [n for n in D.DECODERS if n in names]
    assert D.fastest_decoder() == names[0]


def test_decoders_agree_within_stated_tolerance():
    """Every installed decoder vs Pillow, every variant and DCT scale: same shape, within tolerance."""
    worst_max, worst_mean = 0, 0.0
    others = [d for d in D.available_decoders() if d != "pil"]
    for name, data in jpeg_cases():
        for min_size in (None, 2, 6, 12, 30):
            ref = D.decode(data, min_size=min_size, decoder="pil")
            assert ref.dtype == np.uint8 and ref.ndim == 3 and ref.shape[2] == 3 and ref.flags.writeable
            for dec in others:
                out = D.decode(data, min_size=min_size, decoder=dec)
                assert out.shape == ref.shape, (name, min_size, dec)
                diff = np.abs(out.astype(np.int16) - ref)
                worst_max, worst_mean = max(worst_max, int(diff.max())), max(worst_mean, float(diff.mean()))
                assert diff.max() <= D.DECODER_TOLERANCE_MAX, (name, min_size, dec, diff.max())
                assert diff.mean() <= D.DECODER_TOLERANCE_MEAN, (name, min_size, dec, diff.mean())
    print(f"cross-decoder difference over {others}: max {worst_max}, mean {worst_mean:.4f}")


@pytest.mark.parametrize("decoder", D.available_decoders())
def test_reduce_on_decode_picks_largest_fast_scale(decoder):
    data = jpeg(smooth(96, 128), quality=90)
    expect = {None: (96, 128), 1: (12, 16), 12: (12, 16), 13: (24, 32), 24: (24, 32), 25: (48, 64),
              48: (48, 64), 49: (96, 128), 500: (96, 128)}
    for min_size, shape in expect.items():
        assert D.decode(data, min_size=min_size, decoder=decoder).shape[:2] == shape, (min_size, decoder)


def test_reduce_on_decode_odd_size_rounds_up():
    data = jpeg(smooth(61, 97), quality=90)
    for dec in D.available_decoders():
        assert D.decode(data, min_size=8, decoder=dec).shape[:2] == (8, 13)  # ceil(61/8), ceil(97/8)
        assert D.decode(data, min_size=9, decoder=dec).shape[:2] == (16, 25)  # 1/4


def test_jpeg_info_reads_the_frame_header():
    assert D.jpeg_info(jpeg(smooth(61, 97))) == (61, 97, 3)
    assert D.jpeg_info(jpeg(smooth(20, 30), mode="L")) == (20, 30, 1)
    assert D.jpeg_info(jpeg(smooth(20, 30), mode="CMYK")) == (20, 30, 4)
    assert D.jpeg_info(encoded(smooth(20, 30), "PNG")) is None
    assert D.jpeg_info(b"\xff\xd8\xff") is None


@pytest.mark.parametrize("decoder", D.available_decoders())
def test_non_jpeg_and_gray_inputs_become_rgb(decoder):
    img = smooth(30, 40, 3)
    rgba = np.dstack([img, np.full(img.shape[:2], 7, np.uint8)])
    out = D.decode(encoded(rgba, "PNG", "RGBA"), decoder=decoder)
    assert np.array_equal(out, img)  # alpha dropped, as PIL's convert("RGB")
    gray = D.decode(encoded(img, "PNG", "L"), decoder=decoder)
    assert gray.shape == (30, 40, 3) and np.array_equal(gray[..., 0], gray[..., 2])
    assert np.array_equal(D.decode(encoded(img, "BMP"), decoder=decoder), img)
    assert np.array_equal(D.decode(encoded(img, "PNG", "P"), decoder=decoder),
                          np.array(Image.fromarray(img).convert("P").convert("RGB")))
    g = D.decode(jpeg(img, mode="L", quality=90), decoder=decoder)
    assert g.shape == (30, 40, 3) and np.array_equal(g[..., 0], g[..., 1])


@pytest.mark.parametrize("decoder", D.available_decoders())
def test_undecodable_bytes_raise_decode_error_naming_the_sample(decoder):
    good = jpeg(smooth(64, 64), quality=90)
    for bad in (b"definitely not an image", good[: len(good) // 2], b"\xff\xd8\xff\xe0" + bytes(100), b""):
        with pytest.raises(D.DecodeError, match="cat/007.jpg"):
            D.decode(bad, decoder=decoder, name="cat/007.jpg")
    assert issubclass(D.DecodeError, UserError)


def test_decode_accepts_buffers():
    data = jpeg(smooth(20, 30), quality=90)
    ref = D.decode(data)
    for buf in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert np.array_equal(D.decode(buf), ref)
    with pytest.raises(UserError, match="encoded bytes"):
        D.decode(smooth(4, 4))
    with pytest.raises(UserError, match="unknown decoder"):
        D.decode(data, decoder="nope")


@pytest.mark.parametrize("backend", ["cv2", "pil"] if D._load("cv2") is not None else ["pil"])
def test_resize_shorter_keeps_aspect_like_torchvision(backend):
    img = smooth(50, 75)
    assert D.resize_shorter(img, 20, backend=backend).shape == (20, 30, 3)
    assert D.resize_shorter(smooth(75, 50), 20, backend=backend).shape == (30, 20, 3)
    assert D.resize_shorter(smooth(33, 70), 10, backend=backend).shape == (10, int(10 * 70 / 33), 3)
    assert D.resize_shorter(img, 50, backend=backend) is img  # nothing to do
    for interp in ("area", "nearest", "cubic"):
        assert D.resize_shorter(img, 25, interp, backend=backend).shape == (25, 37, 3)
    with pytest.raises(UserError, match="interpolation"):
        D.resize_shorter(img, 25, "lanczos9")


def test_center_crop_matches_torchvision_offsets():
    img = np.arange(7 * 10, dtype=np.uint8).reshape(7, 10)
    out = D.center_crop(img, 4)
    top, left = int(round((7 - 4) / 2.0)), int(round((10 - 4) / 2.0))
    assert np.array_equal(out, img[top : top + 4, left : left + 4])
    assert D.center_crop(img, (7, 3)).shape == (7, 3)
    padded = D.center_crop(img, 9)  # smaller than the crop: zero padding, like torchvision
    assert padded.shape == (9, 9) and padded[0].sum() == 0


def test_encode_jpeg_round_trip():
    img = smooth(48, 64)
    data = D.encode_jpeg(img, quality=95)
    assert D.jpeg_info(data) == (48, 64, 3)
    assert np.abs(D.decode(data).astype(int) - img).mean() < 5
    assert D.jpeg_info(D.encode_jpeg(img[..., 0])) == (48, 64, 3)
    with pytest.raises(UserError, match="quality"):
        D.encode_jpeg(img, quality=0)


def test_to_rgb_inputs():
    import torch

    img = smooth(6, 8)
    assert np.array_equal(D.to_rgb(Image.fromarray(img)), img)
    assert np.array_equal(D.to_rgb(torch.from_numpy(img).permute(2, 0, 1)), img)
    assert D.to_rgb(img[..., :1]).shape == (6, 8, 3)
    with pytest.raises(UserError, match="uint8"):
        D.to_rgb(img.astype(np.float32))


def test_pillow_alone_is_enough(monkeypatch):
    real = D._load
    monkeypatch.setattr(D, "_load", lambda name: real(name) if name == "pil" else None)
    assert D.available_decoders() == ["pil"] and D.fastest_decoder() == "pil"
    data = jpeg(smooth(48, 64), quality=90)
    assert D.decode(data, min_size=12).shape == (12, 16, 3)
    assert D.resize_shorter(D.decode(data), 24).shape == (24, 32, 3)
    assert D.jpeg_info(D.encode_jpeg(smooth(8, 8))) == (8, 8, 3)
    with pytest.raises(UserError, match="simplejpeg"):
        D.decode(data, decoder="simplejpeg")


def test_no_decoder_at_all_says_install_pillow(monkeypatch):
    monkeypatch.setattr(D, "_load", lambda name: None)
    with pytest.raises(UserError, match="pip install Pillow"):
        D.fastest_decoder()
