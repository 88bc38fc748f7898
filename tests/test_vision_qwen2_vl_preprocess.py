"""Qwen2.5-VL's (Qwen2-VL's) and Qwen3-VL's image preprocessing against transformers'
`Qwen2VLImageProcessor` (PIL backend, which `Qwen2_5_VLProcessor` and `Qwen3VLProcessor` use without
torchvision) on real photographs and odd shapes, from the bytes a client sends: the same patches, bit
for bit, and the same grid. Qwen3-VL's is the same processor at 16-pixel patches, mean and std 0.5."""
from __future__ import annotations

import io

import pytest
import torch

from test_vision_preprocess import ODD, PHOTOS, _encode
from wallbreaker.errors import InvalidRequestError
from wallbreaker.vision.images import load_image
from wallbreaker.vision.qwen2_vl_preprocess import Qwen2VLImageProcessor, smart_resize

Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")

# (min_pixels, max_pixels): Qwen2.5-VL's released preprocessor_config, transformers' default, a small one
BOUNDS = [(3136, 12845056), (56 * 56, 28 * 28 * 1280), (3136, 28 * 28 * 16)]
# Qwen3-VL's: its released preprocessor_config's bounds, tests/tiny_qwen3_vl.py's
QWEN3_VL = dict(patch_size=16, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5))
QWEN3_BOUNDS = [(65536, 16777216), (32 * 32 * 4, 32 * 32 * 36)]


def _check(data: bytes, min_pixels: int, max_pixels: int, **family) -> None:
    from PIL import ImageOps
    from transformers import Qwen2VLImageProcessorPil

    reference = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                         **{k: list(v) if isinstance(v, tuple) else v for k, v in family.items()})
    expected = reference(images=ImageOps.exif_transpose(Image.open(io.BytesIO(data))), return_tensors="pt")
    patches, grid = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, **family)(load_image(data))
    assert [1, *grid] == expected["image_grid_thw"][0].tolist()
    assert patches.shape == expected["pixel_values"].shape and patches.dtype == torch.float32
    assert (patches - expected["pixel_values"]).abs().max().item() <= 1e-6
    assert torch.equal(patches, expected["pixel_values"])  # the same operations in the same precision


@pytest.mark.parametrize("name", PHOTOS[:8])
def test_real_photographs_match_transformers(name):
    data = _encode(Image.fromarray(getattr(skdata, name)()), "PNG")
    for bounds in BOUNDS:
        _check(data, *bounds)


@pytest.mark.parametrize("kind", list(ODD))
def test_odd_shapes_and_modes_match_transformers(kind):
    _check(_encode(ODD[kind](), "PNG"), *BOUNDS[0])


@pytest.mark.parametrize("name", PHOTOS[:8])
def test_qwen3_vl_photographs_match_transformers(name):
    data = _encode(Image.fromarray(getattr(skdata, name)()), "PNG")
    for bounds in QWEN3_BOUNDS:
        _check(data, *bounds, **QWEN3_VL)


@pytest.mark.parametrize("kind", list(ODD))
def test_qwen3_vl_odd_shapes_and_modes_match_transformers(kind):
    _check(_encode(ODD[kind](), "PNG"), *QWEN3_BOUNDS[0], **QWEN3_VL)


def test_exif_rotated_jpeg_and_transparent_palette_match_transformers():
    image = Image.fromarray(skdata.rocket())
    exif = Image.Exif()
    exif[0x0112] = 6
    _check(_encode(image, "JPEG", exif=exif.tobytes()), *BOUNDS[2])
    palette = Image.fromarray(skdata.chelsea()).convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    _check(_encode(palette, "PNG", transparency=3), *BOUNDS[2])


def test_smart_resize_is_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference
    for h, w in [(1, 1), (300, 4000), (27, 29), (512, 512), (4000, 3000), (100, 19999)]:
        for bounds in BOUNDS:
            assert smart_resize(h, w, 28, *bounds) == reference(h, w, 28, *bounds)


def test_an_image_too_thin_is_refused_with_the_limit():
    with pytest.raises(InvalidRequestError, match="aspect ratio .* limit of 200"):
        Qwen2VLImageProcessor()(Image.new("RGB", (4000, 10)))


def test_a_different_image_gives_different_patches():  # the comparison above can fail
    ours = Qwen2VLImageProcessor(max_pixels=28 * 28 * 16)
    a = ours(load_image(Image.fromarray(skdata.astronaut())))[0]
    b = ours(load_image(Image.fromarray(skdata.astronaut()[::-1].copy())))[0]
    assert not torch.equal(a, b)
