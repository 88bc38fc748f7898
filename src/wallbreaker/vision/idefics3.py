"""SmolVLM's vision side (transformers' `Idefics3ForConditionalGeneration` and
`SmolVLMForConditionalGeneration` less their Llama decoder): the SigLIP tower (siglip.py) over each
tile, with Idefics3's position ids (NaViT-style buckets of fractional patch coordinates; for a full
tile, transformers' float32 arithmetic decides them), then the connector: a pixel shuffle that
folds each `scale_factor` x `scale_factor` group of patches into one vector, and a linear
projection (no bias) to the decoder's width. The vectors replace the embeddings of the tile's
`<image>` tokens; the decoder's attention stays causal over them (a plain Llama).

An image is split into tiles (idefics3_preprocess.py); each tile is one run of `<image>` tokens in
the prompt and one `ImageInput` to the engine, so that the engine's per-image machinery (the pixel
digest keying the prefix and encoder caches, the runs' placement) works a tile at a time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelFormatError
from .gemma3 import _check
from .idefics3_preprocess import Idefics3ImageProcessor, image_prompt
from .siglip import SiglipConfig, SiglipVisionTower

MODEL_TYPES = ("idefics3", "smolvlm")
_TOWER_PREFIX = "model.vision_model."
_CONNECTOR = "model.connector.modality_projection.proj.weight"
IMAGE_TOKEN = "<image>"
# Idefics3VisionConfig's defaults (SigLIP-so400m's shape), which a saved config may leave out
VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 16,
                   "image_size": 224, "patch_size": 32, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
PROMPT_TOKENS = ("<fake_token_around_image>", "<global-img>")


def is_idefics3_vision_config(hf: Any) -> bool:
    return isinstance(hf, dict) and hf.get("model_type") in MODEL_TYPES and isinstance(hf.get("vision_config"), dict)


def position_ids(side: int, patches_per_side: int) -> torch.Tensor:
    """[side * side] position ids of a tile whose patches all hold pixels, as Idefics3's vision
    embeddings compute them (`torch.bucketize` of fractional coordinates, in float32)."""
    boundaries = torch.arange(1 / patches_per_side, 1.0, 1 / patches_per_side)
    step = 1.0 / torch.tensor([side])  # [1] (transformers' nb_patches is an integer tensor)
    coords = torch.clamp(torch.arange(side, dtype=torch.float32)[None, :] * step[:, None], max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)[0]  # [side]
    return (buckets[:, None] * patches_per_side + buckets[None, :]).reshape(-1)


class Idefics3Vision(nn.Module):
    marker = IMAGE_TOKEN  # what the chat template writes for an image part
    bidirectional = False  # the decoder attends causally over image tokens

    def __init__(self, tower: SiglipVisionTower, projection: torch.Tensor, scale_factor: int,
                 processor: Idefics3ImageProcessor, image_id: int, per_tile: int):
        """`projection`: the connector's [text hidden, vision hidden * scale_factor**2] weight."""
        super().__init__()
        self.tower = tower
        self.projection = projection.float()
        self.scale = scale_factor
        self.processor = processor
        self.image_id = image_id
        self.run_length = per_tile  # `<image>` tokens a tile
        side = processor.tile // tower.cfg.patch_size
        if processor.tile % tower.cfg.patch_size or side % scale_factor or (side // scale_factor) ** 2 != per_tile:
            raise ModelFormatError(f"a {processor.tile}-pixel tile in {tower.cfg.patch_size}-pixel patches, shuffled by "
                                   f"{scale_factor}, does not give {per_tile} image tokens")
        if projection.shape[1] != tower.cfg.hidden_size * scale_factor ** 2:
            raise ModelFormatError(f"the connector's projection {tuple(projection.shape)} does not take "
                                   f"{tower.cfg.hidden_size * scale_factor ** 2} inputs")
        self.side = side
        self.position_ids = position_ids(side, tower.cfg.patches_per_side)

    @property
    def hidden_size(self) -> int:
        return self.projection.shape[0]

    def expand(self, image) -> tuple[str, list[torch.Tensor]]:
        """An image -> the text that replaces its marker, and the pixels of each run of image tokens
        in that text (its tiles, the global image last)."""
        rows, cols, tiles = self.processor(image)
        return image_prompt(rows, cols, self.run_length), tiles

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, tile, tile] -> [N, image tokens a tile, text hidden] float32."""
        x = self.tower(pixels, self.position_ids)  # [N, side * side, vision hidden]
        n, _, h = x.shape
        s, side = self.scale, self.side
        # transformers' pixel_shuffle: [N, side, side / s, h * s] -> ... -> [N, (side / s)^2, h * s * s]
        x = x.view(n, side, side // s, h * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, h * s * s).permute(0, 2, 1, 3)
        x = x.reshape(n, (side // s) ** 2, h * s * s)
        return x @ self.projection.T

    @classmethod
    def from_folder(cls, path: Path, tokenizer) -> "Idefics3Vision":
        """The tower and connector of a Hugging Face `Idefics3ForConditionalGeneration` or
        `SmolVLMForConditionalGeneration` folder."""
        from safetensors import safe_open

        path = Path(path)
        hf = json.loads((path / "config.json").read_text())
        where = f"{path}/config.json"
        cfg = SiglipConfig.from_hf({**VISION_DEFAULTS, **hf["vision_config"]}, where)
        scale = int(hf.get("scale_factor", 2))
        tower: dict[str, torch.Tensor] = {}
        projection = None
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name.startswith(_TOWER_PREFIX):
                        tower[name[len(_TOWER_PREFIX):]] = f.get_tensor(name)
                    elif name == _CONNECTOR:
                        projection = f.get_tensor(name)
        _check(str(path), "vision tower", tower, cfg.tensor_shapes())
        text_hidden = (hf.get("text_config") or {}).get("hidden_size")
        expected = (text_hidden, cfg.hidden_size * scale ** 2)
        if projection is None or tuple(projection.shape) != expected:
            raise ModelFormatError(f"{path}: the connector's {_CONNECTOR} must be {expected}, got "
                                   f"{None if projection is None else tuple(projection.shape)}")
        processor = Idefics3ImageProcessor.from_folder(path, cfg.image_size)
        image_id = hf.get("image_token_id")
        if tokenizer.token_to_id(IMAGE_TOKEN) != image_id:
            raise ModelFormatError(f"{where}: image_token_id {image_id!r} is not the tokenizer's {IMAGE_TOKEN}")
        per_tile = _per_tile(path, cfg, processor, scale)
        for token in PROMPT_TOKENS + tuple(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)):
            if tokenizer.token_to_id(token) is None:
                raise ModelFormatError(f"{path}: the tokenizer has no {token} token")
        return cls(SiglipVisionTower(cfg, tower), projection, scale, processor, image_id, per_tile)


def _per_tile(path: Path, cfg: SiglipConfig, processor: Idefics3ImageProcessor, scale: int) -> int:
    """The processor's `image_seq_len` where it says, else what a tile gives."""
    computed = (processor.tile // cfg.patch_size) ** 2 // scale ** 2
    file = path / "processor_config.json"
    try:
        stated = json.loads(file.read_text()).get("image_seq_len") if file.is_file() else None
    except (OSError, ValueError, AttributeError):
        stated = None
    if stated is not None and stated != computed:
        raise ModelFormatError(f"{file}: image_seq_len {stated} is not the {computed} tokens a tile gives")
    return computed
