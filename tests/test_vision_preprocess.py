"""Gemma 3's image preprocessing against transformers' `Gemma3ImageProcessor` (PIL backend) on real
photographs (scikit-image's) and odd shapes, from the bytes a client sends; and the refusals of
what is not an image."""
from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import torch

from wallbreaker.errors import InvalidRequestError
from wallbreaker.vision.gemma3_preprocess import Gemma3ImageProcessor
from wallbreaker.vision.images import load_image

Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "retina", "immunohistochemistry", "hubble_deep_field",
          "colorwheel", "camera", "page")


def _encode(image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _reference(data: bytes, size: int) -> torch.Tensor:
    """transformers' processor on the image as transformers' `load_image` opens it (EXIF applied)."""
    from PIL import ImageOps
    from transformers import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(size={"height": size, "width": size}, image_mean=[0.5] * 3,
                                        image_std=[0.5] * 3, rescale_factor=1 / 255, resample=2)
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    return processor(images=image, return_tensors="pt")["pixel_values"][0]


def _ours(source, size: int) -> torch.Tensor:
    return Gemma3ImageProcessor(height=size, width=size)(load_image(source))


def _check(data: bytes, size: int) -> None:
    expected = _reference(data, size)
    for source in (data, "data:image/png;base64," + base64.b64encode(data).decode()):
        got = _ours(source, size)
        assert got.shape == expected.shape == (3, size, size) and got.dtype == torch.float32
        diff = (got - expected).abs().max().item()
        assert diff <= 1e-6, diff
        assert torch.equal(got, expected)  # the same operations in the same precision: the same bits


@pytest.mark.parametrize("name", PHOTOS)
@pytest.mark.parametrize("size", [896, 64])
def test_real_photographs_match_transformers(name, size):
    image = Image.fromarray(getattr(skdata, name)())
    _check(_encode(image, "PNG"), size)


def test_jpeg_photograph_matches_transformers():
    _check(_encode(Image.fromarray(skdata.chelsea()), "JPEG", quality=90), 896)


ODD = {
    "1x1": lambda: Image.new("RGB", (1, 1), (200, 10, 30)),
    "4000x300": lambda: Image.fromarray(np.tile(skdata.coffee(), (1, 7, 1))[:300, :4000]),
    "300x4000": lambda: Image.fromarray(np.tile(skdata.coffee(), (10, 1, 1))[:4000, :300]),
    "grey": lambda: Image.fromarray(skdata.camera()),
    "rgba": lambda: Image.fromarray(skdata.logo()),
    "grey+alpha": lambda: Image.fromarray(skdata.logo()).convert("LA"),
    "palette": lambda: Image.fromarray(skdata.astronaut()).convert("P", palette=Image.Palette.ADAPTIVE, colors=64),
}


@pytest.mark.parametrize("kind", list(ODD))
def test_odd_shapes_and_modes_match_transformers(kind):
    _check(_encode(ODD[kind](), "PNG"), 896)


def test_palette_png_with_a_transparent_index_is_composited_on_white():
    image = Image.fromarray(skdata.chelsea()).convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    data = _encode(image, "PNG", transparency=3)
    assert Image.open(io.BytesIO(data)).info.get("transparency") == 3
    _check(data, 64)


def test_exif_rotated_jpeg_is_turned_upright_as_transformers_loads_it():
    image = Image.fromarray(skdata.rocket())  # 640 wide, 427 high
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    data = _encode(image, "JPEG", exif=exif.tobytes())
    loaded = load_image(data)
    assert loaded.size == (427, 640)
    _check(data, 896)


def test_a_pil_image_is_taken_as_is():
    image = Image.fromarray(skdata.astronaut())
    got = Gemma3ImageProcessor(height=64, width=64)(load_image(image))
    assert torch.equal(got, _reference(_encode(image, "PNG"), 64))


def test_a_different_image_gives_different_pixels():  # the comparison above can fail
    a = _ours(_encode(Image.fromarray(skdata.astronaut()), "PNG"), 64)
    b = _ours(_encode(Image.fromarray(skdata.astronaut()[::-1].copy()), "PNG"), 64)
    assert not torch.equal(a, b)


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("source, words", [
    ("https://example.com/cat.png", "not fetched"),
    ("http://example.com/cat.png", "not fetched"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png,rawbytes", "base64"),
    ("not base64 at all!", "base64"),
    (b"GIF89a but not really", "not an image format|cannot be decoded"),
    (b"hello, these bytes are no image", "not an image format"),
    (b"<svg xmlns='http://www.w3.org/2000/svg' width='10' height='10'></svg>", "not an image format"),
    (b"", "empty"),
    (12345, "must be bytes"),
])
def test_what_is_not_an_image_is_refused_with_the_reason(source, words):
    with pytest.raises(InvalidRequestError, match=words):
        load_image(source, param="messages")


def test_truncated_image_is_refused():
    data = _encode(Image.fromarray(skdata.astronaut()), "PNG")
    with pytest.raises(InvalidRequestError, match="cannot be decoded"):
        load_image(data[: len(data) // 2])


def test_an_animated_gif_is_refused_and_a_still_one_read():
    frames = [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(200)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    with pytest.raises(InvalidRequestError, match="animated"):
        load_image(buf.getvalue())
    _check(_encode(Image.fromarray(skdata.chelsea()).convert("P"), "GIF"), 64)


def test_decompression_bomb_is_refused_from_its_header():
    data = _png_header_only(40000, 40000)
    assert len(data) < 200
    with pytest.raises(InvalidRequestError, match="40000x40000|too large"):
        load_image(data)
