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


@pytest.mark.parametrize("decoder", [d for d in ("simplejpeg", "turbojpeg") if d in D.available_decoders()])
def test_fast_dct_is_within_its_stated_tolerance_and_really_differs(decoder):
    """The fast IDCT (FFCV's) vs the accurate one, quality <= 90, at every DCT scale and reused buffer."""
    worst_max, worst_mean, differs = 0, 0.0, False
    for seed, (h, w) in enumerate([(120, 160), (97, 61), (224, 300)]):
        img = smooth(h, w, seed)
        img[::7] = 255 - img[::7]  # sharp edges: the fast IDCT's error shows most there
        for q in (50, 75, 90):
            data = jpeg(img, quality=q)
            for min_size in (None, 30):
                ref = D.decode(data, min_size=min_size, decoder=decoder)
                fast = D.decode(data, min_size=min_size, decoder=decoder, fast_dct=True,
                                reuse=decoder == "simplejpeg")
                diff = np.abs(fast.astype(np.int16) - ref)
                differs |= bool(diff.any())
                worst_max, worst_mean = max(worst_max, int(diff.max())), max(worst_mean, float(diff.mean()))
    assert differs  # the switch reaches the decoder
    assert worst_max <= D.FAST_DCT_TOLERANCE_MAX and worst_mean <= D.FAST_DCT_TOLERANCE_MEAN, (worst_max, worst_mean)


@pytest.mark.parametrize("decoder", [d for d in ("cv2", "pil") if d in D.available_decoders()])
def test_fast_dct_is_ignored_by_decoders_without_the_switch(decoder):
    data = jpeg(smooth(64, 80), quality=90)
    assert np.array_equal(D.decode(data, decoder=decoder, fast_dct=True), D.decode(data, decoder=decoder))


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


def test_no_decoder_at_all_names_the_data_extra(monkeypatch):
    monkeypatch.setattr(D, "_load", lambda name: None)
    with pytest.raises(UserError, match=r'pip install "torch-tricks\[data\]"'):
        D.fastest_decoder()


# ---------------------------------------------------------------------------- crop-aware decoding


def crop_ready_cases():
    """Crop-ready JPEGs of several layouts: ours (4:2:0 with the MCU-offset trailer), and Pillow's with a
    restart marker after every MCU but no trailer, in 4:4:4, 4:2:2, 4:2:0 and grayscale, odd sizes."""
    for h, w in [(97, 131), (48, 64), (17, 250), (200, 33)]:
        img = smooth(h, w, h + w)
        img[::5] = 255 - img[::5]  # sharp edges: upsampling at the cut borders would show
        yield f"{h}x{w}-ours", D.encode_jpeg(img, 90, crop_ready=True)
        for sub, mode in ((0, "RGB"), (1, "RGB"), (2, "RGB"), (2, "L")):
            yield f"{h}x{w}-pil-{sub}-{mode}", jpeg(img, mode=mode, quality=85, subsampling=sub, restart_marker_blocks=1)


def test_decode_crop_is_bit_identical_to_decode_then_crop():
    rng = np.random.default_rng(0)
    cut = 0
    for name, data in crop_ready_cases():
        assert D.crop_ready(data), name
        layout = D._restart_layout(data)
        for dec in D.available_decoders():
            for fast in (False, True):
                full = D.decode(data, decoder=dec, fast_dct=fast)
                h, w = full.shape[:2]
                boxes = [(0, 0, h, w), (0, 0, 1, 1), (h - 1, w - 1, 1, 1), (h // 3, w // 3, h // 3 + 1, w // 3 + 1)]
                for _ in range(6):
                    bh, bw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
                    boxes.append((int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1)), bh, bw))
                for box in boxes:
                    t, l, bh, bw = box
                    got = D.decode_crop(data, *box, decoder=dec, fast_dct=fast)
                    assert got.shape == (bh, bw, 3) and got.flags.c_contiguous, (name, dec, box)
                    assert np.array_equal(got, full[t : t + bh, l : l + bw]), (name, dec, fast, box)
                    cut += layout.cut(data, *box)[0] is not None
    assert cut > 100  # most boxes really were decoded from a cut-out part


def test_decode_crop_decodes_only_what_the_crop_covers():
    data = D.encode_jpeg(smooth(256, 341), 90, crop_ready=True)
    part, origin, size = D._restart_layout(data).cut(data, 16, 58, 224, 224)
    assert origin == (0, 48) and D.jpeg_info(part)[:2] == size == (256, 240)  # whole MCUs, a 3-pixel margin
    assert len(part) < 0.8 * len(data)
    reused = D.decode_crop(data, 16, 58, 224, 224, reuse=True)  # a view of this thread's buffer
    assert not reused.flags.c_contiguous and np.array_equal(reused, D.decode(data)[16:240, 58:282])


def test_decode_crop_of_other_images_decodes_whole():
    img = smooth(61, 97)
    for data in (jpeg(img, quality=90), jpeg(img, quality=90, progressive=True), encoded(img, "PNG")):
        assert not D.crop_ready(data)
        assert np.array_equal(D.decode_crop(data, 5, 7, 20, 30), D.decode(data)[5:25, 7:37])


def test_decode_crop_without_or_with_a_damaged_trailer_finds_the_markers():
    data = D.encode_jpeg(smooth(97, 131), 90, crop_ready=True)
    want = D.decode(data)[10:70, 20:90]
    plain = data[: data.rindex(b"\xff\xd9") + 2]  # the JPEG without its offsets
    assert len(plain) < len(data)
    for d in [plain] + [_damage_offset(data, k) for k in range(1, 40)]:
        assert np.array_equal(D.decode_crop(d, 10, 20, 60, 70), want)


def _damage_offset(data: bytes, k: int) -> bytes:
    """``data`` with the k-th MCU offset of its trailer moved by a few bytes."""
    count = int.from_bytes(data[-8:-4], "little")
    at = len(data) - 8 - 4 * count + 4 * k
    damaged = bytearray(data)
    damaged[at : at + 4] = (int.from_bytes(data[at : at + 4], "little") + 3).to_bytes(4, "little")
    return bytes(damaged)


def test_decode_crop_rejects_a_box_outside_the_image():
    data = D.encode_jpeg(smooth(40, 50), 90, crop_ready=True)
    for box in [(-1, 0, 10, 10), (0, 0, 41, 10), (35, 0, 10, 10), (0, 0, 0, 5)]:
        with pytest.raises(UserError, match="does not fit"):
            D.decode_crop(data, *box)
    with pytest.raises(UserError, match="does not fit"):
        D.decode_crop(encoded(smooth(40, 50), "PNG"), 0, 0, 50, 50)


def test_crop_ready_jpegs_read_anywhere():
    """The restart markers and the trailer after EOI do not bother any decoder."""
    img = smooth(97, 131)
    ready, plain = D.encode_jpeg(img, 90, crop_ready=True), D.encode_jpeg(img, 90)
    for dec in D.available_decoders():
        diff = np.abs(D.decode(ready, decoder=dec).astype(np.int16) - D.decode(plain, decoder=dec))
        assert diff.mean() < 1.5  # two encoders' rounding, not damage
    Image.open(io.BytesIO(ready)).load()
