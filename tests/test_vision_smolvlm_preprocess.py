"""SmolVLM's (Idefics3's) image preprocessing against transformers' processors (PIL backend, as
`AutoProcessor` picks it without torchvision), Idefics3's and SmolVLM's, on real photographs
(scikit-image's) and odd shapes, from the bytes a client sends: the same tiles, bit for bit, in the
same order, and the same row/column layout of the prompt."""
from __future__ import annotations

import io

import pytest
import torch

from test_vision_preprocess import ODD, PHOTOS, _encode
from wallbreaker.vision.idefics3_preprocess import Idefics3ImageProcessor, image_prompt
from wallbreaker.vision.images import load_image

Image = pytest.importorskip("PIL.Image")
skdata = pytest.importorskip("skimage.data", reason="pip install scikit-image (a test extra)")

# (longest edge, tile): SmolVLM-256M's (2048, 512), Idefics3-8B's defaults (1456, 364), the tiny model's
SIZES = [(2048, 512), (1456, 364), (96, 32)]


def _reference(data: bytes, longest: int, tile: int, splitting: bool = True, family: str = "Idefics3"):
    """transformers' processor on the image as its `load_image` opens it (EXIF applied): the real
    tiles (padding tiles dropped as the model drops them), rows and cols."""
    from PIL import ImageOps
    import transformers

    cls = getattr(transformers, f"{family}ImageProcessorPil")
    processor = cls(size={"longest_edge": longest}, max_image_size={"longest_edge": tile},
                    do_image_splitting=splitting)
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    out = processor(images=[image], return_tensors="pt", return_row_col_info=True)
    mask = out["pixel_attention_mask"][0]
    assert bool(mask.all())  # every tile a full square: the mask never binds for one image
    return out["rows"][0][0], out["cols"][0][0], out["pixel_values"][0]


def _check(data: bytes, longest: int, tile: int, splitting: bool = True, family: str = "Idefics3") -> None:
    rows, cols, expected = _reference(data, longest, tile, splitting, family)
    ours = Idefics3ImageProcessor(longest_edge=longest, tile=tile, do_image_splitting=splitting)
    got_rows, got_cols, tiles = ours(load_image(data))
    assert (got_rows, got_cols) == (rows, cols)
    assert len(tiles) == expected.shape[0] == (rows * cols + 1 if rows else 1)
    for got, want in zip(tiles, expected):
        assert got.shape == want.shape == (3, tile, tile) and got.dtype == torch.float32
        assert (got - want).abs().max().item() <= 1e-6
        assert torch.equal(got, want)  # the same operations in the same precision: the same bits


@pytest.mark.parametrize("name", PHOTOS[:8])
def test_real_photographs_match_transformers(name):
    data = _encode(Image.fromarray(getattr(skdata, name)()), "PNG")
    for longest, tile in SIZES[1:]:
        _check(data, longest, tile)


@pytest.mark.parametrize("name", ["astronaut", "coffee"])
def test_smolvlm_256m_sizes_and_smolvlm_processor_match(name):
    data = _encode(Image.fromarray(getattr(skdata, name)()), "PNG")
    _check(data, *SIZES[0])
    _check(data, 96, 32, family="SmolVLM")


def test_jpeg_photograph_without_splitting_matches_transformers():
    data = _encode(Image.fromarray(skdata.chelsea()), "JPEG", quality=90)
    _check(data, 96, 32)
    _check(data, 96, 32, splitting=False)


@pytest.mark.parametrize("kind", list(ODD))
def test_odd_shapes_and_modes_match_transformers(kind):
    _check(_encode(ODD[kind](), "PNG"), 1456, 364)


def test_exif_rotated_jpeg_and_transparent_palette_match_transformers():
    image = Image.fromarray(skdata.rocket())
    exif = Image.Exif()
    exif[0x0112] = 6
    _check(_encode(image, "JPEG", exif=exif.tobytes()), 96, 32)
    palette = Image.fromarray(skdata.chelsea()).convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    _check(_encode(palette, "PNG", transparency=3), 96, 32)


def test_a_different_image_gives_different_tiles():  # the comparison above can fail
    ours = Idefics3ImageProcessor(longest_edge=96, tile=32)
    a = ours(load_image(Image.fromarray(skdata.astronaut())))[2]
    b = ours(load_image(Image.fromarray(skdata.astronaut()[::-1].copy())))[2]
    assert not torch.equal(a[0], b[0])


@pytest.mark.parametrize("rows, cols", [(0, 0), (1, 2), (3, 3)])
def test_image_prompt_is_the_processors(rows, cols):
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, "<unk>")),
                                        unk_token="<unk>")
    processor = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(), tokenizer=tokenizer, image_seq_len=3)
    assert image_prompt(rows, cols, 3) == processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
