"""Qwen3-VL's vision side from llama.cpp's mmproj (projector type `qwen3vl_merger`, what
`convert_hf_to_gguf.py --mmproj` writes for `Qwen3VLForConditionalGeneration`).

The converter keeps q, k, v fused, splits the 3D patch embedding into one 2D kernel a frame (stacked
again here), names each DeepStack merger by the block it follows (`v.deepstack.<block>.*`, the
blocks also listed in `clip.vision.is_deepstack_layers`) and writes `use_gelu` for the tanh GELU
that Qwen3-VL's blocks use. As for Qwen2.5-VL (qwen2_5_vl_mmproj.py), an image takes 8 to 4096
tokens, clip.cpp's bounds, where the file gives none; the resize is transformers'."""
from __future__ import annotations

import torch

from ..errors import ModelFormatError
from ..formats.dequant import dequantize
from .gemma3 import _check
from .qwen2_5_vl import IMAGE_PAD, Qwen25VLVision
from .qwen2_5_vl_mmproj import MAX_TOKENS, MIN_TOKENS
from .qwen2_vl_preprocess import Qwen2VLImageProcessor
from .qwen3_vl import Qwen3VisionConfig, Qwen3VisionEncoder

PROJECTOR = "qwen3vl_merger"
_LAYER = {"ln1": "norm1", "ln2": "norm2", "attn_qkv": "attn.qkv", "attn_out": "attn.proj", "ffn_up": "mlp.linear_fc1",
          "ffn_down": "mlp.linear_fc2"}
_MERGER = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}
_TOP = {"v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2",
        "v.position_embd": "pos_embed", "v.patch_embd": "patch_embed.proj"}


def read_qwen3_vl(gf, label: str, tokenizer, key) -> Qwen25VLVision:
    """The encoder, processor and image token of an open mmproj file; `key(name, default)` reads
    `clip.vision.<name>`."""
    tensors = {name: dequantize(t.raw, t.ggml_type, t.shape) for name, t in gf.tensors.items()}
    depth = int(key("block_count"))
    layers = key("is_deepstack_layers", [False] * depth)
    if not (isinstance(layers, list) and len(layers) == depth):
        raise ModelFormatError(f"{label}: clip.vision.is_deepstack_layers must be one true or false a block ({depth})")
    for name in ("mm.2.weight", "v.position_embd.weight", "v.patch_embd.weight", "v.patch_embd.weight.1"):
        if name not in tensors:
            raise ModelFormatError(f"{label}: the vision encoder's tensor {name!r} is missing")
    cfg = Qwen3VisionConfig.from_hf({
        "depth": depth, "hidden_size": key("embedding_length"), "intermediate_size": key("feed_forward_length"),
        "num_heads": key("attention.head_count"), "patch_size": key("patch_size"),
        "spatial_merge_size": key("spatial_merge_size", 2), "out_hidden_size": int(tensors["mm.2.weight"].shape[0]),
        "num_position_embeddings": int(tensors["v.position_embd.weight"].shape[0]),
        "deepstack_visual_indexes": [i for i, on in enumerate(layers) if on],
        "hidden_act": "gelu_pytorch_tanh" if gf.get("clip.use_gelu") else "silu" if gf.get("clip.use_silu")
        else "gelu"}, label)
    tensors["v.patch_embd.weight"] = torch.stack([tensors["v.patch_embd.weight"],
                                                  tensors.pop("v.patch_embd.weight.1")], dim=2)
    renamed = {_folder_name(cfg, name): t for name, t in tensors.items()}
    if None in renamed:
        extra = next(name for name in tensors if _folder_name(cfg, name) is None)
        raise ModelFormatError(f"{label}: the vision encoder's tensor {extra!r} is not used; refusing to run "
                               f"without it")
    _check(label, "vision encoder", renamed, cfg.tensor_shapes())
    unit = cfg.patch_size * cfg.spatial_merge_size
    processor = Qwen2VLImageProcessor(
        min_pixels=int(key("image_min_pixels", MIN_TOKENS * unit ** 2)),
        max_pixels=int(key("image_max_pixels", MAX_TOKENS * unit ** 2)),
        patch_size=cfg.patch_size, merge_size=cfg.spatial_merge_size,
        image_mean=tuple(float(v) for v in key("image_mean")), image_std=tuple(float(v) for v in key("image_std")))
    image_id = tokenizer.token_to_id(IMAGE_PAD)
    if image_id is None:
        raise ModelFormatError(f"{label}: the text model's tokenizer has no {IMAGE_PAD} token")
    return Qwen25VLVision(Qwen3VisionEncoder(cfg, renamed), processor, image_id)


def _folder_name(cfg: Qwen3VisionConfig, name: str) -> str | None:
    """An mmproj tensor's name under the folder's `visual.` (transformers' names), or None."""
    stem, _, part = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{part}"
    bits = stem.split(".")
    if len(bits) == 4 and bits[:2] == ["v", "blk"] and bits[2].isdigit() and bits[3] in _LAYER:
        return f"blocks.{int(bits[2])}.{_LAYER[bits[3]]}.{part}"
    if len(bits) == 4 and bits[:2] == ["v", "deepstack"] and bits[2].isdigit() and bits[3] in _MERGER \
            and int(bits[2]) in cfg.deepstack_visual_indexes:
        return f"deepstack_merger_list.{cfg.deepstack_visual_indexes.index(int(bits[2]))}.{_MERGER[bits[3]]}.{part}"
    return None
