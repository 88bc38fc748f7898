"""Gemma 3's vision side (transformers' `Gemma3ForConditionalGeneration` less its decoder): the SigLIP
tower, then `Gemma3MultiModalProjector`: the patch grid average-pooled to `mm_tokens_per_image`
tokens, RMS-normalized (weight applied as 1 + w) and projected to the decoder's width. Those
vectors replace the embeddings of the image's soft tokens, unscaled (Gemma scales only token
embeddings by sqrt(hidden)).

A prompt holds an image as the processor writes it: "\\n\\n<start_of_image>" + the soft token
`mm_tokens_per_image` times + "<end_of_image>\\n\\n", in place of each <start_of_image> that the chat
template writes for an image part."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelFormatError
from .gemma3_preprocess import Gemma3ImageProcessor
from .siglip import SiglipConfig, SiglipVisionTower

# Where checkpoints keep the tower and the projector: transformers 5 saves `vision_tower.*`, 4.5x
# `model.vision_tower.vision_model.*`, Google's releases `vision_tower.vision_model.*`.
_TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                   "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
PROJECTOR_TENSORS = ("mm_input_projection_weight", "mm_soft_emb_norm.weight")


def is_gemma3_vision_config(hf: Any) -> bool:
    return isinstance(hf, dict) and hf.get("model_type") == "gemma3" and isinstance(hf.get("vision_config"), dict)


@dataclass(frozen=True)
class ImageTokens:
    """The special tokens of an image in the prompt, and how many soft tokens it takes."""

    boi: str
    image: str
    eoi: str
    image_id: int
    per_image: int

    @property
    def full_sequence(self) -> str:
        return f"\n\n{self.boi}{self.image * self.per_image}{self.eoi}\n\n"


class Gemma3Vision(nn.Module):
    def __init__(self, tower: SiglipVisionTower, projection: torch.Tensor, norm_scale: torch.Tensor,
                 tokens_per_image: int, norm_eps: float, processor: Gemma3ImageProcessor, tokens: ImageTokens):
        """`norm_scale`: the projector's RMSNorm multiplier as applied (1 + w of the HF weight w)."""
        super().__init__()
        self.tower = tower
        self.projection = projection.float()  # [vision hidden, text hidden]
        self.norm_scale = norm_scale.float()
        self.norm_eps = norm_eps
        self.tokens_per_image = tokens_per_image
        self.processor = processor
        self.tokens = tokens
        side = tower.cfg.patches_per_side
        self.tokens_per_side = int(round(tokens_per_image ** 0.5))
        if self.tokens_per_side ** 2 != tokens_per_image or side % self.tokens_per_side:
            raise ModelFormatError(f"mm_tokens_per_image {tokens_per_image} does not pool a {side}x{side} patch grid")
        self.pool = side // self.tokens_per_side

    bidirectional = True  # the decoder attends both ways among an image's soft tokens

    @property
    def hidden_size(self) -> int:
        return self.projection.shape[1]

    # what vision/prompt.py asks of a family: the marker its chat template writes for an image, what
    # replaces it, and the runs of image tokens that take the encoder's vectors
    @property
    def marker(self) -> str:
        return self.tokens.boi

    @property
    def image_id(self) -> int:
        return self.tokens.image_id

    @property
    def run_length(self) -> int:
        return self.tokens.per_image

    def expand(self, image) -> tuple[str, list[torch.Tensor]]:
        """An image -> the text that replaces its marker, and the pixels of its one run of soft tokens."""
        return self.tokens.full_sequence, [self.processor(image)]

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, mm_tokens_per_image, text hidden] float32."""
        x = self.tower(pixels)  # [N, patches, vision hidden]
        n, _, h = x.shape
        side = self.tower.cfg.patches_per_side
        x = x.transpose(1, 2).reshape(n, h, side, side)
        x = F.avg_pool2d(x, kernel_size=self.pool, stride=self.pool).flatten(2).transpose(1, 2)  # [N, tokens, h]
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_scale
        return x @ self.projection

    @classmethod
    def from_folder(cls, path: Path, tokenizer) -> "Gemma3Vision":
        """The tower and projector of a Hugging Face `Gemma3ForConditionalGeneration` folder."""
        from safetensors import safe_open

        path = Path(path)
        hf = json.loads((path / "config.json").read_text())
        where = f"{path}/config.json"
        cfg = SiglipConfig.from_hf(hf["vision_config"], where)
        per_image = hf.get("mm_tokens_per_image", 256)
        tower: dict[str, torch.Tensor] = {}
        projector: dict[str, torch.Tensor] = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    for prefixes, into in ((_TOWER_PREFIXES, tower), (_PROJECTOR_PREFIXES, projector)):
                        prefix = next((p for p in prefixes if name.startswith(p)), None)
                        if prefix is not None:
                            into[name[len(prefix):]] = f.get_tensor(name)
                            break
        expected = cfg.tensor_shapes()
        text_hidden = (hf.get("text_config") or {}).get("hidden_size")
        _check(str(path), "vision tower", tower, expected)
        _check(str(path), "projector", projector, {"mm_input_projection_weight": (cfg.hidden_size, text_hidden),
                                                   "mm_soft_emb_norm.weight": (cfg.hidden_size,)})
        tokens = image_tokens(hf, tokenizer, per_image, str(path))
        processor = Gemma3ImageProcessor.from_folder(path, cfg.image_size)
        if (processor.height, processor.width) != (cfg.image_size, cfg.image_size):
            raise ModelFormatError(f"{path}: the image processor's size {processor.height}x{processor.width} is not "
                                   f"the vision tower's {cfg.image_size}x{cfg.image_size}")
        return cls(SiglipVisionTower(cfg, tower), projector["mm_input_projection_weight"],
                   1.0 + projector["mm_soft_emb_norm.weight"].float(), per_image, cfg.layer_norm_eps, processor, tokens)


def image_tokens(hf: dict[str, Any], tokenizer, per_image: int, where: str) -> ImageTokens:
    """The boi / soft / eoi tokens, by the config's ids (`boi_token_index`, `image_token_index`,
    `eoi_token_index`) as the tokenizer spells them."""
    ids = {key: hf.get(key) for key in ("boi_token_index", "image_token_index", "eoi_token_index")}
    defaults = {"boi_token_index": 255_999, "image_token_index": 262_144, "eoi_token_index": 256_000}
    strings = {}
    for key, value in ids.items():
        value = defaults[key] if value is None else value
        text = tokenizer.id_to_token(value) if isinstance(value, int) else None
        if not text:
            raise ModelFormatError(f"{where}: {key} {value!r} is not a token of the tokenizer")
        ids[key], strings[key] = value, text
    return ImageTokens(strings["boi_token_index"], strings["image_token_index"], strings["eoi_token_index"],
                       ids["image_token_index"], per_image)


def _check(where: str, what: str, found: dict[str, torch.Tensor], expected: dict[str, tuple]) -> None:
    for name, shape in expected.items():
        if name not in found:
            raise ModelFormatError(f"{where}: the {what}'s tensor {name!r} is missing")
        if tuple(found[name].shape) != tuple(shape):
            raise ModelFormatError(f"{where}: the {what}'s tensor {name!r} has shape {tuple(found[name].shape)}, "
                                   f"expected {tuple(shape)}")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ModelFormatError(f"{where}: the {what}'s tensor {extra[0]!r} is not used; refusing to run without it")
