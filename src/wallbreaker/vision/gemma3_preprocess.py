"""Gemma 3's image preprocessing, as transformers' `Gemma3ImageProcessor` (its PIL backend, which
`AutoProcessor` picks where torchvision is absent) computes it: the image made RGB (transparency
composited onto white), resized by Pillow to the processor's square size (896 for the released
models; bilinear), rescaled by 1/255 in float64 and cast to float32, normalized per channel in
float32. Every step is the same Pillow call or the same IEEE operation in the same precision, so
the pixel tensor is the reference's bit for bit. Pan-and-scan stays off, as in transformers'
`Gemma3Processor` defaults."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelFormatError, UnsupportedModelError

IMAGENET_STANDARD = (0.5, 0.5, 0.5)  # transformers' IMAGENET_STANDARD_MEAN and _STD


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    height: int = 896
    width: int = 896
    resample: int = 2  # PIL.Image.Resampling.BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_folder(cls, path: Path, image_size: int | None = None) -> "Gemma3ImageProcessor":
        """The processor of a Hugging Face folder: `processor_config.json`'s `image_processor`, or
        `preprocessor_config.json`; without either, Gemma 3's values at the vision tower's size."""
        config = _processor_config(Path(path))
        if config is None:
            size = image_size or 896
            return cls(height=size, width=size)
        where = f"{path}: image processor"
        if config.get("do_pan_and_scan"):
            raise UnsupportedModelError(f"{where}: do_pan_and_scan is not supported")
        size = config.get("size") or {}
        if not isinstance(size, dict) or not {"height", "width"} <= set(size):
            raise ModelFormatError(f"{where}: size must be {{'height': ..., 'width': ...}}, got {size!r}")
        try:
            return cls(height=int(size["height"]), width=int(size["width"]), resample=int(config.get("resample", 2)),
                       rescale_factor=float(config.get("rescale_factor", 1 / 255)),
                       image_mean=_triple(config.get("image_mean", IMAGENET_STANDARD)),
                       image_std=_triple(config.get("image_std", IMAGENET_STANDARD)),
                       do_resize=bool(config.get("do_resize", True)), do_rescale=bool(config.get("do_rescale", True)),
                       do_normalize=bool(config.get("do_normalize", True)),
                       do_convert_rgb=config.get("do_convert_rgb") is not False)
        except (TypeError, ValueError) as e:
            raise ModelFormatError(f"{where}: {e}") from None

    def __call__(self, image) -> torch.Tensor:
        """A PIL image -> [3, height, width] float32 pixel values."""
        from PIL import Image

        if self.do_convert_rgb:
            image = to_rgb(image)
        if self.do_resize:
            image = image.resize((self.width, self.height), resample=Image.Resampling(self.resample))
        return to_pixels(image, self.rescale_factor if self.do_rescale else None,
                         (self.image_mean, self.image_std) if self.do_normalize else None)


def to_pixels(image, rescale_factor: float | None, mean_std: tuple[tuple[float, ...], tuple[float, ...]] | None
              ) -> torch.Tensor:
    """A PIL image -> [C, H, W] float32 as transformers' PIL backend computes it: rescaled in float64,
    then cast to float32 (`np_rescale`), normalized per channel in float32 (`np_normalize`)."""
    x = torch.from_numpy(np.array(image))
    if x.dim() == 2:
        x = x[..., None]
    x = x.permute(2, 0, 1)  # [C, H, W] uint8
    x = (x.double() * rescale_factor).float() if rescale_factor is not None else x.float()
    if mean_std is not None:
        mean = torch.tensor(mean_std[0], dtype=torch.float32)[:, None, None]
        std = torch.tensor(mean_std[1], dtype=torch.float32)[:, None, None]
        x = (x - mean) / std
    return x.contiguous()


def to_rgb(image):
    """RGB, transparency composited onto white (transformers' `convert_to_rgb`)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def _processor_config(path: Path) -> dict[str, Any] | None:
    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        file = path / name
        if not file.is_file():
            continue
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: unreadable: {e}") from None
        if key is not None:
            config = config.get(key) if isinstance(config, dict) else None
            if config is None:
                continue
        if not isinstance(config, dict):
            raise ModelFormatError(f"{file}: not a JSON object")
        return config
    return None


def _triple(value: Any) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    values = tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"expected 3 channel values, got {len(values)}")
    return values
