"""LFM2's files: its config.json keys, its tensor names, and its GGUF metadata, as its entry in
formats/families.py has the loaders read them.

- The FFN width: transformers' Lfm2MLP (and llama.cpp's converter) take `intermediate_size` (or
  `block_ff_dim`) and, with `block_auto_adjust_ff_dim`, use int(2/3 of it) times
  `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`.
- The final norm is `model.embedding_norm` (GGUF `token_embd_norm`), applied after the last layer.
- Layers are "conv" (a gated short convolution, layers/short_conv.py) or attention; GGUF marks the
  convolutions with 0 in the per-layer `attention.head_count_kv` array.
- The convolution's weight is [channels, 1, kernel] in the folder and [channels, kernel] in GGUF (the
  converter squeezes it); the readers present the latter.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..config import short_repr
from ..errors import ModelFormatError, UnsupportedModelError
from .config_keys import GGUFKeys

FINAL_NORM = "token_embd_norm.weight"
DEFAULT_ROPE_THETA = 1000000.0  # Lfm2Config.default_theta, where config.json gives none
_HF_LAYER_TYPES = {"conv": "conv", "full_attention": "full"}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def hf_ffn_width(hf: dict[str, Any], where: str) -> Any:
    """The FFN width transformers' Lfm2MLP builds from config.json."""
    ff = hf.get("block_ff_dim", hf.get("intermediate_size"))
    if not hf.get("block_auto_adjust_ff_dim", True) or not _int(ff):
        return ff  # not adjusted, or not a width (ModelConfig names it)
    multiplier, multiple = hf.get("block_ffn_dim_multiplier", 1.0), hf.get("block_multiple_of", 256)
    ff = int(2 * ff / 3)
    if multiplier is None:
        return ff
    if not isinstance(multiplier, (int, float)) or isinstance(multiplier, bool) or not _int(multiple) or multiple < 1:
        raise ModelFormatError(f"{where}: block_ffn_dim_multiplier and block_multiple_of must be numbers, got "
                               f"{short_repr(multiplier)} and {short_repr(multiple)}")
    ff = int(multiplier * ff)
    return multiple * ((ff + multiple - 1) // multiple)


def hf_config_keys(hf: dict[str, Any], where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json in the keys config_from_hf reads (norm_eps as rms_norm_eps, the adjusted FFN
    width as intermediate_size, tie_embedding as tie_word_embeddings), and the ModelConfig fields
    only LFM2 has (layer types, the convolution's taps, q/k norm)."""
    # conv_bias: biases in the convolution and its projections; LiquidAI's first config.json also has
    # block_use_swiglu and use_pos_enc (a plain FFN, no RoPE), which transformers ignores
    for key, runs in (("conv_bias", False), ("block_use_swiglu", True), ("use_pos_enc", True)):
        if hf.get(key, runs) is not runs:
            raise UnsupportedModelError(f"{where}: {key} {short_repr(hf.get(key))} is not supported")
    layers = hf.get("num_hidden_layers")
    given = hf.get("layer_types")
    if given is None:
        idxs = hf.get("full_attn_idxs")
        if idxs is None:
            idxs = list(range(layers)) if _int(layers) and 0 < layers <= 1 << 20 else []
        if not isinstance(idxs, list):
            raise ModelFormatError(f"{where}: full_attn_idxs must be a list, got {short_repr(idxs)}")
        given = ["full_attention" if i in idxs else "conv" for i in range(layers if _int(layers) else 0)]
    if not isinstance(given, list):
        raise ModelFormatError(f"{where}: layer_types must be a list, got {short_repr(given)}")
    bad = next((t for t in given if t not in _HF_LAYER_TYPES), None)
    if bad is not None:
        raise UnsupportedModelError(f"{where}: layer type {short_repr(bad)} is not supported")
    keys = {k: v for k, v in hf.items() if k != "layer_types"}
    rope = keys.get("rope_parameters")
    if "rope_theta" not in keys and not (isinstance(rope, dict) and "rope_theta" in rope):
        keys["rope_theta"] = DEFAULT_ROPE_THETA
    keys.update(rms_norm_eps=hf.get("norm_eps", 1e-5), intermediate_size=hf_ffn_width(hf, where),
                tie_word_embeddings=hf.get("tie_embedding", hf.get("tie_word_embeddings", True)))
    fields = dict(layer_types=tuple(_HF_LAYER_TYPES[t] for t in given), qk_norm=True,
                  conv_kernel=hf.get("conv_L_cache", 3))
    return keys, fields


def hf_tensor_names(num_layers: int) -> dict[str, str]:
    """HF name -> canonical (GGUF) name of every LFM2 tensor."""
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.embedding_norm.weight": FINAL_NORM,
             "lm_head.weight": "output.weight"}
    per_layer = {
        "operator_norm.weight": "attn_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
        "feed_forward.w1.weight": "ffn_gate.weight", "feed_forward.w3.weight": "ffn_up.weight",
        "feed_forward.w2.weight": "ffn_down.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.out_proj.weight": "attn_output.weight",
        "self_attn.q_layernorm.weight": "attn_q_norm.weight", "self_attn.k_layernorm.weight": "attn_k_norm.weight",
        "conv.conv.weight": "shortconv.conv.weight", "conv.in_proj.weight": "shortconv.in_proj.weight",
        "conv.out_proj.weight": "shortconv.out_proj.weight",
    }
    for i in range(num_layers):
        for hf, gg in per_layer.items():
            table[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    return table


def squeeze_conv_weights(source: str, cfg: Any, weights: dict) -> None:
    """A folder's [channels, 1, kernel] convolution weights presented as GGUF's [channels, kernel]."""
    for name, ref in list(weights.items()):
        if name.endswith("shortconv.conv.weight") and len(ref.shape) == 3 and ref.shape[1] == 1:
            weights[name] = dataclasses.replace(ref, shape=(ref.shape[0], ref.shape[2]), load_part=None,
                                                load=lambda ref=ref: ref.load().squeeze(1))


def conv_layer_tensors(hidden: int, kernel: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """A convolution layer's mixer tensors (its norms and FFN are any layer's)."""
    return {prefix + "shortconv.conv.weight": (hidden, kernel), prefix + "shortconv.in_proj.weight": (3 * hidden, hidden),
            prefix + "shortconv.out_proj.weight": (hidden, hidden)}


def gguf_layer_heads(name: str, key: str, value: Any, layers: int) -> tuple[int, tuple[str, ...]]:
    """GGUF `lfm2.attention.head_count_kv` (one count a layer, 0 for a convolution, or one count
    for all) -> (the attention layers' KV heads, the layer types)."""
    if _int(value):
        return value, ("full",) * layers
    if not (isinstance(value, list) and len(value) == layers and all(_int(v) and v >= 0 for v in value)):
        raise ModelFormatError(f"{name}: metadata {key} must be one count a layer ({layers}), got {short_repr(value)}")
    counts = {v for v in value if v}
    if len(counts) > 1:
        raise UnsupportedModelError(f"{name}: metadata {key}: attention layers with different KV head counts "
                                    f"({sorted(counts)}) are not supported")
    return (counts.pop() if counts else 1), tuple("full" if v else "conv" for v in value)


def gguf_fields(k: GGUFKeys) -> dict[str, Any]:
    """The ModelConfig fields of an `lfm2` GGUF beyond the common ones: its head_count_kv is one count
    a layer, 0 for a convolution."""
    if k.window:
        raise UnsupportedModelError(f"{k.name}: metadata {k.a}attention.sliding_window is not supported for lfm2")
    kv_heads, layer_types = gguf_layer_heads(k.name, k.a + "attention.head_count_kv", k.raw(k.a + "attention.head_count_kv"),
                                             k.layers)
    return dict(num_kv_heads=kv_heads, layer_types=layer_types, qk_norm=True,
                conv_kernel=k.integer(k.a + "shortconv.l_cache"))
