"""Qwen2-VL's and Qwen2.5-VL's image preprocessing (dynamic resolution), as transformers'
`Qwen2VLImageProcessor` (its PIL backend, which `Qwen2_5_VLProcessor` uses without torchvision)
computes it:

1. RGB (transparency composited onto white), then Pillow's BICUBIC resize to `smart_resize`'s size:
   both edges multiples of patch_size * merge_size (28), the area within [min_pixels, max_pixels],
   the aspect kept as closely as that allows;
2. rescale in float64 then float32, normalize in float32 (CLIP's mean and std);
3. patches in the order the vision encoder reads them: merge-blocks row by row, the merge_size x
   merge_size patches of a block row by row, each patch flattened as [channel, time, row, col] with
   the still image repeated over temporal_patch_size frames.

The result: [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] float32 and the grid
(grid_h, grid_w); the prompt holds grid_h * grid_w / merge_size**2 `<|image_pad|>` tokens."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidRequestError, ModelFormatError
from .gemma3_preprocess import _processor_config, _triple, to_pixels, to_rgb

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
MAX_ASPECT = 200


@dataclass(frozen=True)
class Qwen2VLImageProcessor:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    resample: int = BICUBIC
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_folder(cls, path: Path) -> "Qwen2VLImageProcessor":
        """The processor of a Hugging Face folder (`size` {shortest_edge, longest_edge} in pixels, or the
        older min_pixels / max_pixels); Qwen2-VL's defaults without one."""
        config = _processor_config(Path(path))
        if config is None:
            return cls()
        try:
            size = config.get("size") or {}
            return cls(min_pixels=int(config.get("min_pixels", size.get("shortest_edge", 56 * 56))),
                       max_pixels=int(config.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))),
                       patch_size=int(config.get("patch_size", 14)), merge_size=int(config.get("merge_size", 2)),
                       temporal_patch_size=int(config.get("temporal_patch_size", 2)),
                       resample=int(config.get("resample", BICUBIC)),
                       rescale_factor=float(config.get("rescale_factor", 1 / 255)),
                       image_mean=_triple(config.get("image_mean", OPENAI_CLIP_MEAN)),
                       image_std=_triple(config.get("image_std", OPENAI_CLIP_STD)),
                       do_resize=bool(config.get("do_resize", True)), do_rescale=bool(config.get("do_rescale", True)),
                       do_normalize=bool(config.get("do_normalize", True)),
                       do_convert_rgb=config.get("do_convert_rgb") is not False)
        except (TypeError, ValueError, AttributeError) as e:
            raise ModelFormatError(f"{path}: image processor: {e}") from None

    def tokens(self, grid: tuple[int, int]) -> int:
        """The `<|image_pad|>` tokens of an image of `grid` patches."""
        return grid[0] * grid[1] // self.merge_size ** 2

    def __call__(self, image) -> tuple[torch.Tensor, tuple[int, int]]:
        """A PIL image -> ([grid_h * grid_w, patch dim] float32 patches, (grid_h, grid_w))."""
        return self.patchify(self.normalized(image))

    def normalized(self, image) -> torch.Tensor:
        """A PIL image -> [3, H, W] float32, resized, rescaled and normalized (before patching)."""
        from PIL import Image

        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            height, width = smart_resize(image.height, image.width, self.patch_size * self.merge_size,
                                         self.min_pixels, self.max_pixels)
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        return to_pixels(image, self.rescale_factor if self.do_rescale else None,
                         (self.image_mean, self.image_std) if self.do_normalize else None)  # [C, H, W]

    def patchify(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """[C, H, W] -> ([grid_h * grid_w, patch dim] in the encoder's order, (grid_h, grid_w))."""
        c, h, w = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        if gh * p != h or gw * p != w or gh % m or gw % m:
            raise ModelFormatError(f"image processor: {h}x{w} pixels are not whole {p * m}-pixel blocks")
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], t, p, p)  # the still image over t frames
        return x.reshape(gh * gw, c * t * p * p).contiguous(), (gh, gw)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """transformers' `smart_resize`: both edges multiples of `factor`, the area within the bounds."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InvalidRequestError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f} is over "
                                  f"the model's limit of {MAX_ASPECT}", param="messages")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
