"""Qwen2.5-VL's vision side from llama.cpp's mmproj (projector type `qwen2.5vl_merger`, what
`convert_hf_to_gguf.py --mmproj` writes for `Qwen2_5_VLForConditionalGeneration`).

The converter splits what the folder holds: q, k, v apart (the folder fuses them as `attn.qkv`), the
3D patch embedding as two 2D kernels (`v.patch_embd.weight` and `.weight.1`, one per frame). Some
sizes it does not write, and llama.cpp's clip.cpp takes them as below, so do we: the spatial merge 2,
windows of 112 pixels, full attention in every `n_wa_pattern`-th block (the last of each group), an
image between 8 and 4096 merged blocks (`clip.vision.*` keys of those names win where a file has
them). Preprocessing is transformers' (qwen2_vl_preprocess.py) at those bounds, with the file's mean
and std."""
from __future__ import annotations

import torch

from ..errors import ModelFormatError, UnsupportedModelError
from ..formats.dequant import dequantize
from .gemma3 import _check
from .qwen2_5_vl import IMAGE_PAD, Qwen25VisionConfig, Qwen25VisionEncoder, Qwen25VLVision
from .qwen2_vl_preprocess import Qwen2VLImageProcessor

PROJECTOR = "qwen2.5vl_merger"
MIN_TOKENS, MAX_TOKENS = 8, 4096  # clip.cpp's set_limit_image_tokens(8, 4096) for Qwen2/2.5/3-VL
WINDOW = 112  # clip.cpp's attn_window_size where the file gives none
_LAYER = {"ln1": "norm1", "ln2": "norm2", "attn_out": "attn.proj", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"v.post_ln": "merger.ln_q", "mm.0": "merger.mlp.0", "mm.2": "merger.mlp.2"}


def read_qwen2_5_vl(gf, label: str, tokenizer, key) -> Qwen25VLVision:
    """The encoder, processor and image token of an open mmproj file; `key(name, default)` reads
    `clip.vision.<name>`."""
    tensors = {name: dequantize(t.raw, t.ggml_type, t.shape) for name, t in gf.tensors.items()}
    depth = int(key("block_count"))
    pattern = int(key("n_wa_pattern", 0))
    if gf.get("clip.use_gelu") and gf.get("clip.use_silu"):
        raise ModelFormatError(f"{label}: both clip.use_gelu and clip.use_silu are set")
    out = tensors.get("mm.2.weight")
    if out is None or out.dim() != 2:
        raise ModelFormatError(f"{label}: missing tensor mm.2.weight (the merger's last projection)")
    cfg = Qwen25VisionConfig.from_hf({
        "depth": depth, "hidden_size": key("embedding_length"), "intermediate_size": key("feed_forward_length"),
        "num_heads": key("attention.head_count"), "patch_size": key("patch_size"),
        "spatial_merge_size": key("spatial_merge_size", 2), "window_size": key("window_size", WINDOW),
        "out_hidden_size": int(out.shape[0]), "hidden_act": "silu" if gf.get("clip.use_silu") else "gelu",
        "fullatt_block_indexes": [i for i in range(depth) if pattern <= 0 or (i + 1) % pattern == 0]}, label)
    eps = float(key("attention.layer_norm_epsilon", 1e-6))
    if abs(eps - 1e-6) > 1e-9:  # the encoder's RMSNorms use transformers' 1e-6
        raise UnsupportedModelError(f"{label}: clip.vision.attention.layer_norm_epsilon {eps} is not supported (1e-6)")
    _check(label, "vision encoder", tensors, _file_shapes(cfg))
    processor = Qwen2VLImageProcessor(
        min_pixels=int(key("image_min_pixels", MIN_TOKENS * (cfg.patch_size * cfg.spatial_merge_size) ** 2)),
        max_pixels=int(key("image_max_pixels", MAX_TOKENS * (cfg.patch_size * cfg.spatial_merge_size) ** 2)),
        patch_size=cfg.patch_size, merge_size=cfg.spatial_merge_size,
        image_mean=tuple(float(v) for v in key("image_mean")), image_std=tuple(float(v) for v in key("image_std")))
    image_id = tokenizer.token_to_id(IMAGE_PAD)
    if image_id is None:
        raise ModelFormatError(f"{label}: the text model's tokenizer has no {IMAGE_PAD} token")
    return Qwen25VLVision(Qwen25VisionEncoder(cfg, _folder_names(cfg, tensors)), processor, image_id)


def _file_shapes(cfg: Qwen25VisionConfig) -> dict[str, tuple[int, ...]]:
    """The tensors the converter writes, from the folder's (`Qwen25VisionConfig.tensor_shapes`)."""
    shapes, h = {}, cfg.hidden_size
    for name, shape in cfg.tensor_shapes().items():
        stem, _, part = name.rpartition(".")
        if stem == "patch_embed.proj":
            kernel = (h, cfg.in_channels, cfg.patch_size, cfg.patch_size)
            shapes.update({"v.patch_embd.weight": kernel, "v.patch_embd.weight.1": kernel})
        elif stem.endswith("attn.qkv"):
            block = stem.split(".")[1]
            shapes.update({f"v.blk.{block}.attn_{x}.{part}": (h,) + shape[1:] for x in "qkv"})
        else:
            shapes[_file_name(stem) + "." + part] = shape
    return shapes


def _file_name(stem: str) -> str:
    """A folder tensor's stem (under `visual.`) -> the mmproj's."""
    for file, folder in _TOP.items():
        if stem == folder:
            return file
    _, block, rest = stem.split(".", 2)
    return f"v.blk.{block}." + next(f for f, o in _LAYER.items() if o == rest)


def _folder_names(cfg: Qwen25VisionConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mmproj's tensors under the folder's names, as the encoder reads them: the two frames'
    kernels stacked back into the 3D one, q, k and v fused back into qkv."""
    out = {"patch_embed.proj.weight": torch.stack([tensors["v.patch_embd.weight"], tensors["v.patch_embd.weight.1"]],
                                                  dim=2)}
    for name in cfg.tensor_shapes():
        stem, _, part = name.rpartition(".")
        if stem == "patch_embed.proj":
            continue
        if stem.endswith("attn.qkv"):
            block = stem.split(".")[1]
            out[name] = torch.cat([tensors[f"v.blk.{block}.attn_{x}.{part}"] for x in "qkv"])
        else:
            out[name] = tensors[_file_name(stem) + "." + part]
    return out
