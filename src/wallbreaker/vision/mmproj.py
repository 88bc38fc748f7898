"""llama.cpp's `mmproj` GGUF (what `convert_hf_to_gguf.py --mmproj` writes beside the text GGUF, the
file pair llama.cpp and Ollama ship) -> the vision side of a Gemma 3, SmolVLM or Qwen2.5-VL model: its
`clip.*` keys give the tower's shape and the preprocessing's size, mean and std, its `v.*` and `mm.*`
tensors the weights (dequantized to float32; the converter stores Gemma 3's projection as F16).
Qwen2.5-VL's (projector type `qwen2.5vl_merger`) and Qwen3-VL's (`qwen3vl_merger`) are read by
qwen2_5_vl_mmproj.py and qwen3_vl_mmproj.py. The image tokens
come from the text model's tokenizer, by their spelling."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import InvalidRequestError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from ..formats.dequant import dequantize
from ..formats.gguf_file import open_gguf
from .gemma3 import Gemma3Vision, ImageTokens, _check
from .gemma3_preprocess import Gemma3ImageProcessor
from .idefics3 import IMAGE_TOKEN, PROMPT_TOKENS, Idefics3Vision
from .idefics3_preprocess import Idefics3ImageProcessor
from .qwen2_5_vl import Qwen25VLVision
from .qwen2_5_vl_mmproj import PROJECTOR, read_qwen2_5_vl
from .qwen3_vl_mmproj import PROJECTOR as QWEN3_VL_PROJECTOR
from .qwen3_vl_mmproj import read_qwen3_vl
from .siglip import SiglipConfig, SiglipVisionTower

_LAYER_NAMES = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1",
                "ffn_down": "mlp.fc2"}
_TOP_NAMES = {"v.patch_embd": "embeddings.patch_embedding", "v.position_embd": "embeddings.position_embedding",
              "v.post_ln": "post_layernorm"}
GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


def tower_name(name: str) -> str | None:
    """An mmproj tensor's name in the tower (transformers' names), or None for one outside it."""
    stem, _, part = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{part}"
    bits = stem.split(".")
    if len(bits) == 4 and bits[:2] == ["v", "blk"] and bits[2].isdigit() and bits[3] in _LAYER_NAMES:
        return f"encoder.layers.{int(bits[2])}.{_LAYER_NAMES[bits[3]]}.{part}"
    return None


# projector type -> the text models' GGUF architectures it goes with
TEXT_ARCHITECTURES = {"gemma3": ("gemma3",), "idefics3": ("llama",), "qwen2.5vl_merger": ("qwen2vl",),
                      "qwen3vl_merger": ("qwen3vl",)}


def read_mmproj(path: str | os.PathLike, tokenizer,
                architecture: str | None = None) -> "Gemma3Vision | Idefics3Vision | Qwen25VLVision":
    """The vision side in an mmproj file, for a text model of `architecture` (checked) and `tokenizer`."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such mmproj file")
    gf = open_gguf(path)
    label = path.name
    if gf.get("general.architecture") != "clip" or not gf.get("clip.has_vision_encoder"):
        raise ModelFormatError(f"{label}: not a vision mmproj file (general.architecture {gf.get('general.architecture')!r})")
    projector = gf.get("clip.projector_type", gf.get("clip.vision.projector_type"))
    if projector not in TEXT_ARCHITECTURES:
        raise UnsupportedModelError(f"{label}: projector type {projector!r} is not supported (supported: "
                                    f"{', '.join(TEXT_ARCHITECTURES)})")
    if architecture is not None and architecture not in TEXT_ARCHITECTURES[projector]:
        raise InvalidRequestError(f"mmproj {label}: a {projector} projector goes with "
                                  f"{' or '.join(TEXT_ARCHITECTURES[projector])} text models, not {architecture}")

    def key(name: str, default=None):
        value = gf.get(f"clip.vision.{name}", default)
        if value is None:
            raise ModelFormatError(f"{label}: missing key clip.vision.{name}")
        return value

    if projector == PROJECTOR:
        return read_qwen2_5_vl(gf, label, tokenizer, key)
    if projector == QWEN3_VL_PROJECTOR:
        return read_qwen3_vl(gf, label, tokenizer, key)
    cfg = SiglipConfig.from_hf({
        "hidden_size": key("embedding_length"), "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"), "num_attention_heads": key("attention.head_count"),
        "image_size": key("image_size"), "patch_size": key("patch_size"),
        "layer_norm_eps": key("attention.layer_norm_epsilon", 1e-6), "hidden_act": "gelu_pytorch_tanh"}, label)
    if projector == "idefics3":
        return _idefics3(gf, label, tokenizer, cfg, key)
    scale = int(key("projector.scale_factor", 4))
    if scale <= 0 or cfg.patches_per_side % scale:
        raise ModelFormatError(f"{label}: clip.vision.projector.scale_factor {scale} does not divide the "
                               f"{cfg.patches_per_side}x{cfg.patches_per_side} patch grid")
    per_image = (cfg.patches_per_side // scale) ** 2
    tower, other = {}, {}
    for name, t in gf.tensors.items():
        mapped = tower_name(name)
        (tower if mapped is not None else other)[mapped or name] = dequantize(t.raw, t.ggml_type, t.shape)
    _check(label, "vision tower", tower, cfg.tensor_shapes())
    projection = other.get("mm.input_projection.weight")
    if projection is None or projection.dim() != 2 or projection.shape[0] != cfg.hidden_size:
        raise ModelFormatError(f"{label}: mm.input_projection.weight must be [{cfg.hidden_size}, text hidden], got "
                               f"{None if projection is None else tuple(projection.shape)}")
    _check(label, "projector", other, {"mm.input_projection.weight": tuple(projection.shape),
                                       "mm.soft_emb_norm.weight": (cfg.hidden_size,)})
    ids = [tokenizer.token_to_id(t) for t in GEMMA3_TOKENS]
    if any(i is None for i in ids):
        missing = GEMMA3_TOKENS[ids.index(None)]
        raise ModelFormatError(f"{label}: the text model's tokenizer has no {missing} token")
    tokens = ImageTokens(GEMMA3_TOKENS[0], GEMMA3_TOKENS[1], GEMMA3_TOKENS[2], ids[1], per_image)
    mean = tuple(float(v) for v in key("image_mean", [0.5] * 3))
    std = tuple(float(v) for v in key("image_std", [0.5] * 3))
    processor = Gemma3ImageProcessor(height=cfg.image_size, width=cfg.image_size, image_mean=mean, image_std=std)
    return Gemma3Vision(SiglipVisionTower(cfg, tower), other["mm.input_projection.weight"],
                        other["mm.soft_emb_norm.weight"], per_image, cfg.layer_norm_eps, processor, tokens)


def _idefics3(gf, label: str, tokenizer, cfg: SiglipConfig, key) -> Idefics3Vision:
    """SmolVLM's (projector type `idefics3`): the tower, `mm.model.fc.weight` (the connector's
    projection), the scale factor; the tile is the tower's image size and the whole image's longest
    edge `clip.vision.preproc_image_size`, as the converter writes them from the processor's config."""
    scale = int(key("projector.scale_factor", 2))
    tower, other = {}, {}
    for name, t in gf.tensors.items():
        mapped = tower_name(name)
        (tower if mapped is not None else other)[mapped or name] = dequantize(t.raw, t.ggml_type, t.shape)
    _check(label, "vision tower", tower, cfg.tensor_shapes())
    projection = other.get("mm.model.fc.weight")
    if projection is None or projection.dim() != 2 or projection.shape[1] != cfg.hidden_size * scale ** 2:
        raise ModelFormatError(f"{label}: mm.model.fc.weight must be [text hidden, {cfg.hidden_size * scale ** 2}], "
                               f"got {None if projection is None else tuple(projection.shape)}")
    _check(label, "projector", other, {"mm.model.fc.weight": tuple(projection.shape)})
    for token in (IMAGE_TOKEN,) + PROMPT_TOKENS:
        if tokenizer.token_to_id(token) is None:
            raise ModelFormatError(f"{label}: the text model's tokenizer has no {token} token")
    processor = Idefics3ImageProcessor(longest_edge=int(key("preproc_image_size", cfg.image_size * 4)),
                                       tile=cfg.image_size,
                                       image_mean=tuple(float(v) for v in key("image_mean", [0.5] * 3)),
                                       image_std=tuple(float(v) for v in key("image_std", [0.5] * 3)))
    per_tile = cfg.patches_per_side ** 2 // scale ** 2
    return Idefics3Vision(SiglipVisionTower(cfg, tower), projection, scale, processor,
                          tokenizer.token_to_id(IMAGE_TOKEN), per_tile)
