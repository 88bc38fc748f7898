"""Gemma 2 and 3's config keys, as their entries in formats/families.py read and write them: GeGLU,
norms around both branches (stored as w, applied as 1 + w), embeddings scaled by sqrt(hidden),
sliding-window layers (Gemma 2 every other one, Gemma 3 five of six with their own RoPE base) and
the attention scale `query_pre_attn_scalar`. llama.cpp hardcodes the sliding pattern, local RoPE base
and attention scale of Gemma; a GGUF may carry them explicitly (ours do), else its values apply."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from .config_keys import GGUFKeys, layer_types, number, obj, pre_attn_scalar

GEMMA3_SLIDING_PATTERN = 6  # every sixth layer is global, as llama.cpp and transformers assume
GEMMA2_SLIDING_PATTERN = 2  # every second layer is global


def gemma2_hf_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    return dict(sandwich_norm=True, embed_scale=True, query_pre_attn_scalar=number(hf, "query_pre_attn_scalar", 256.0),
                sliding_window=hf.get("sliding_window", 4096),
                layer_types=layer_types(hf, hf.get("num_hidden_layers"), where, "alternate"))


def gemma3_hf_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    local_rope = obj(obj(hf, "rope_parameters", where), "sliding_attention", where)
    return dict(sandwich_norm=True, embed_scale=True,
                query_pre_attn_scalar=number(hf, "query_pre_attn_scalar", hf.get("head_dim", 256)),
                sliding_window=hf.get("sliding_window"),
                layer_types=layer_types(hf, hf.get("num_hidden_layers"), where, "none"),
                rope_local_theta=number(local_rope, "rope_theta", number(hf, "rope_local_base_freq", 10000.0)))


def _gguf_fields(k: GGUFKeys, every: int, default_window: int, default_scalar: float,
                 local_theta: float | None) -> dict[str, Any]:
    types = tuple("sliding" if p else "full" for p in k.pattern) if k.pattern else \
        tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(k.layers))
    return dict(hidden_act="gelu_tanh", sandwich_norm=True, embed_scale=True,
                query_pre_attn_scalar=pre_attn_scalar(k.scale) if k.scale else default_scalar,
                sliding_window=k.window or default_window, layer_types=types,
                rope_local_theta=k.number(k.a + "rope.freq_base_swa", local_theta))


def gemma2_gguf_fields(k: GGUFKeys) -> dict[str, Any]:
    # Gemma 2 27B (46 layers) scales by hidden / heads, the others by head_dim
    scalar = float(k.hidden // k.heads) if k.layers == 46 and k.heads > 0 else float(k.head_dim)
    return _gguf_fields(k, GEMMA2_SLIDING_PATTERN, 4096, scalar, None)


def gemma3_gguf_fields(k: GGUFKeys) -> dict[str, Any]:
    return _gguf_fields(k, GEMMA3_SLIDING_PATTERN, 512, float(k.head_dim), 10000.0)


def gemma2_hf_write(c: ModelConfig, hf: dict[str, Any]) -> None:
    """config.json's Gemma keys (formats/hf_writer.py writes the common ones)."""
    hf.update({"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": c.query_pre_attn_scalar,
               "sliding_window": c.sliding_window, "layer_types": [f"{t}_attention" for t in c.layer_types],
               "attn_logit_softcapping": c.attn_logit_softcap, "final_logit_softcapping": c.final_logit_softcap})


def gemma3_hf_write(c: ModelConfig, hf: dict[str, Any]) -> None:
    """Gemma 2's keys, and the sliding layers' RoPE base beside the full layers' RoPE."""
    gemma2_hf_write(c, hf)
    hf["rope_parameters"] = {"full_attention": hf["rope_parameters"],
                             "sliding_attention": {"rope_theta": c.rope_local_theta, "rope_type": "default"}}
