"""SmolVLM's (Idefics3's) image preprocessing, as transformers' `Idefics3ImageProcessor` (its PIL
backend; SmolVLM's is the same code) computes it:

1. RGB (transparency composited onto white), then Pillow's LANCZOS resize so that the longest edge is
   `size["longest_edge"]` (the other edge rounded down, then up to even; capped at 4096);
2. with image splitting (the default): a second resize to whole multiples of the tile size
   `max_image_size["longest_edge"]`, then the tiles row by row, and a global image (the whole
   resized to one tile); an image that is one tile is only that tile. Without splitting: the
   image resized to one tile;
3. each tile rescaled in float64, cast to float32 and normalized in float32.

Every tile is a full square of the tile size, so the processor's padding and pixel mask never bind
for one image (the mask is all ones), and each tile is encoded on its own. The prompt gives each
tile its run of `<image>` tokens: `<fake_token_around_image><row_r_col_c>` + `<image>` x
image_seq_len per tile, a newline after each row, then `\\n<fake_token_around_image><global-img>` +
`<image>` x image_seq_len + `<fake_token_around_image>`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelFormatError
from .gemma3_preprocess import IMAGENET_STANDARD, _processor_config, _triple, to_pixels, to_rgb

MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on the resized image's edges
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS


@dataclass(frozen=True)
class Idefics3ImageProcessor:
    longest_edge: int = 4 * 364  # `size["longest_edge"]`: the whole image's resize
    tile: int = 364  # `max_image_size["longest_edge"]`: the vision encoder's square input
    resample: int = LANCZOS
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD
    do_resize: bool = True
    do_image_splitting: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_folder(cls, path: Path, tile: int) -> "Idefics3ImageProcessor":
        """The processor of a Hugging Face folder (`processor_config.json`'s `image_processor`, or
        `preprocessor_config.json`); without either, Idefics3's defaults at the vision tower's size."""
        config = _processor_config(Path(path))
        if config is None:
            return cls(longest_edge=4 * tile, tile=tile)
        where = f"{path}: image processor"
        try:
            size, max_size = config.get("size") or {}, config.get("max_image_size") or {}
            if "longest_edge" not in size or "longest_edge" not in max_size:
                raise ValueError(f"size and max_image_size must give longest_edge, got {size!r} and {max_size!r}")
            return cls(longest_edge=int(size["longest_edge"]), tile=int(max_size["longest_edge"]),
                       resample=int(config.get("resample", LANCZOS)),
                       rescale_factor=float(config.get("rescale_factor", 1 / 255)),
                       image_mean=_triple(config.get("image_mean", IMAGENET_STANDARD)),
                       image_std=_triple(config.get("image_std", IMAGENET_STANDARD)),
                       do_resize=bool(config.get("do_resize", True)),
                       do_image_splitting=bool(config.get("do_image_splitting", True)),
                       do_rescale=bool(config.get("do_rescale", True)),
                       do_normalize=bool(config.get("do_normalize", True)),
                       do_convert_rgb=config.get("do_convert_rgb") is not False)
        except (TypeError, ValueError) as e:
            raise ModelFormatError(f"{where}: {e}") from None

    def __call__(self, image) -> tuple[int, int, list[torch.Tensor]]:
        """A PIL image -> (rows, cols, tiles): the grid of its split tiles (0, 0 for a single tile)
        and each tile's [3, tile, tile] float32 pixels, the global image last."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            image = self._resize(image, *longest_edge_size(image.height, image.width, self.longest_edge))
        rows = cols = 0
        if self.do_image_splitting:
            image = self._resize(image, *tile_multiple_size(image.height, image.width, self.tile))
            t = self.tile
            if image.height > t or image.width > t:
                rows, cols = (image.height - t) // t + 1, (image.width - t) // t + 1
                frames = [image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)]
                frames.append(self._resize(image, t, t))
            else:
                frames = [image]
        else:
            frames = [self._resize(image, self.tile, self.tile)]
        if any(f.size != (self.tile, self.tile) for f in frames):  # only without resizing
            raise ModelFormatError(f"image processor: a tile of {frames[0].size} is not {self.tile}x{self.tile}")
        pixels = [to_pixels(f, self.rescale_factor if self.do_rescale else None,
                            (self.image_mean, self.image_std) if self.do_normalize else None) for f in frames]
        return rows, cols, pixels

    def _resize(self, image, height: int, width: int):
        from PIL import Image
        return image.resize((width, height), resample=Image.Resampling(self.resample))


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' `_resize_output_size_rescale_to_max_len` then `..._scale_below_upper_bound`."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' `resize_for_vision_encoder`: both edges up to whole tiles, the aspect kept."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def image_prompt(rows: int, cols: int, per_tile: int, fake: str = "<fake_token_around_image>",
                 image: str = "<image>", global_image: str = "<global-img>") -> str:
    """The text an image takes in the prompt (transformers' `Idefics3Processor`)."""
    run = image * per_tile
    if rows == 0 and cols == 0:
        return f"{fake}{global_image}{run}{fake}"
    text = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n" for r in range(rows))
    return text + f"\n{fake}{global_image}{run}{fake}"
