"""gpt-oss files (config.json `gpt_oss`; GGUF `gpt-oss`) -> ModelConfig and canonical weights, as its
entry in formats/families.py reads them.

Canonical names and layouts are what llama.cpp's converter writes (conversion/gpt_oss.py): the Llama
attention with biases on q/k/v and the output, `blk.N.attn_sinks.weight` [heads] (a learned logit per
head in the softmax's denominator), `post_attention_norm` before the experts, a router with a bias
(`ffn_gate_inp.weight`, `.bias`), and experts `ffn_{gate,up}_exps.weight` [experts, ff, hidden],
`ffn_down_exps.weight` [experts, hidden, ff], each with a bias [experts, out]. A folder stores gate and
up fused and interleaved (`gate_up_proj` [experts, hidden, 2 ff], gate in the even columns) and the
down projection transposed; they are brought to the converter's form here, expert by expert. OpenAI's
checkpoints store the experts as MXFP4 (`*_blocks` [experts, out, in / 32, 16] uint8, two e2m1 values a
byte, low nibble first, and `*_scales` [experts, out, in / 32] e8m0): those are dequantized to float
here, expert by expert (as the GGUF reader dequantizes llama.cpp's MXFP4 blocks).

Layers alternate sliding-window (even) and full attention; the RoPE is YaRN, which gpt-oss runs
without truncating the ramp's bounds (config.json `truncate: false`): a GGUF carries neither the
pattern nor `truncate`, so both are gpt-oss's own here. The experts' clamped SwiGLU (alpha 1.702,
limit 7.0) is not in a GGUF either: llama.cpp fixes those values, and so does models/gpt_oss.py
(a folder with others is refused).
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig, RopeScaling, short_repr
from ..errors import ModelFormatError
from .config_keys import GGUFKeys, layer_types, unsupported
from .weights import WeightRef, stacked_experts

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
GGUF_KEYS = frozenset({"expert_feed_forward_length"})


def hf_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    for key, value in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        if hf.get(key, value) != value:
            raise unsupported(where, f"{key} {short_repr(hf[key])} (gpt-oss's is {value}, as llama.cpp fixes it)")
    quant = hf.get("quantization_config")
    if quant is not None and not (isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"):
        raise unsupported(where, f"quantization_config {short_repr(quant)} (gpt-oss's own is MXFP4 experts)")
    return dict(num_experts=hf.get("num_local_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"),
                sliding_window=hf.get("sliding_window", 128),
                layer_types=layer_types(hf, hf.get("num_hidden_layers"), where, "alternate"))


HF_FIELD_KEYS = {"num_experts": "num_local_experts"}


def gguf_fields(k: GGUFKeys) -> dict[str, Any]:
    """The window (even layers) and YaRN untruncated, as the folder's config.json says."""
    fields: dict[str, Any] = dict(sliding_window=k.window or 128,
                                  layer_types=tuple("sliding" if i % 2 == 0 else "full" for i in range(k.layers)))
    if k.raw(k.a + "rope.scaling.type", None) == "yarn":
        context = k.integer(k.a + "context_length", 4096)
        fields["rope_scaling"] = RopeScaling(
            "yarn", factor=k.number(k.a + "rope.scaling.factor", 1.0),
            original_max_position_embeddings=k.integer(k.a + "rope.scaling.original_context_length", context),
            beta_fast=k.number(k.a + "rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=k.number(k.a + "rope.scaling.yarn_beta_slow", 1.0), truncate=False)
    return fields


def hf_tensor_names(num_layers: int) -> dict[str, str]:
    """HF name -> canonical name; the experts' fused gate|up go to `ffn_gate_up_exps.*` until
    `canonical_hf_weights` splits them."""
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm.weight": "attn_norm.weight",
                 "post_attention_layernorm.weight": "post_attention_norm.weight",
                 "self_attn.sinks": "attn_sinks.weight",
                 "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
                 "mlp.experts.gate_up_proj": "ffn_gate_up_exps.weight",
                 "mlp.experts.gate_up_proj_bias": "ffn_gate_up_exps.bias",
                 "mlp.experts.down_proj": "ffn_down_exps.weight", "mlp.experts.down_proj_bias": "ffn_down_exps.bias"}
    for part, name in (("gate_up_proj", "ffn_gate_up_exps"), ("down_proj", "ffn_down_exps")):  # MXFP4
        per_layer[f"mlp.experts.{part}_blocks"] = f"{name}.blocks"
        per_layer[f"mlp.experts.{part}_scales"] = f"{name}.scales"
    for x, y in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
        per_layer[f"self_attn.{x}_proj.weight"] = f"attn_{y}.weight"
        per_layer[f"self_attn.{x}_proj.bias"] = f"attn_{y}.bias"
    for i in range(num_layers):
        for hf, gg in per_layer.items():
            table[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    return table


def _expert(ref: WeightRef, name: str, e: int, fn) -> WeightRef:
    """Expert e of a folder's [experts, ...] tensor, brought to [out, in] by `fn`."""
    shape = tuple(fn(torch.empty(ref.shape[1:], device="meta")).shape)
    return WeightRef(f"{name}[{e}]", shape, ref.stored_type, ref.nbytes // ref.shape[0],
                     lambda: fn(ref.load_slice(0, e, e + 1)[0]).contiguous())


def _half(ref: WeightRef, name: str, fn) -> WeightRef:
    shape = tuple(fn(torch.empty(ref.shape, device="meta")).shape)
    return WeightRef(name, shape, ref.stored_type, ref.nbytes // 2, lambda: fn(ref.load()).contiguous())


_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4: blocks [rows, groups, 16] uint8 (value 2j in byte j's low nibble, 2j + 1 in its
    high one), scales [rows, groups] (2 ** (s - 127)) -> [rows, groups * 32] float32."""
    blocks = blocks.to(torch.uint8)  # a loader may hand the bytes over as floats (exactly)
    values = torch.stack([_FP4[(blocks & 0x0F).long()], _FP4[(blocks >> 4).long()]], dim=-1).flatten(-2)
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).flatten(-2)


def _mxfp4_experts(source: str, weights: dict[str, WeightRef], name: str) -> WeightRef | None:
    """`name`'s MXFP4 blocks and scales, if the folder has them, as one float [experts, out, in] ref."""
    blocks, scales = weights.pop(name + ".blocks", None), weights.pop(name + ".scales", None)
    if blocks is None and scales is None:
        return None
    if blocks is None or scales is None or len(blocks.shape) != 4 or tuple(blocks.shape[:3]) != tuple(scales.shape) \
            or blocks.shape[3] != 16:
        raise ModelFormatError(f"{source}: {name}: MXFP4 blocks [experts, out, in / 32, 16] and their scales "
                               f"[experts, out, in / 32] must come together")
    e, rows, groups = blocks.shape[:3]

    def expert(i: int) -> WeightRef:
        return WeightRef(f"{name}[{i}]", (rows, groups * 32), "MXFP4", blocks.nbytes // e + scales.nbytes // e,
                         lambda: mxfp4_rows(blocks.load_slice(0, i, i + 1)[0], scales.load_slice(0, i, i + 1)[0]))
    return stacked_experts(name, [expert(i) for i in range(e)])


def canonical_hf_weights(source: str, cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """A folder's experts in place as the converter writes them: gate and up split from the
    interleaved `gate_up_proj` [experts, hidden, 2 ff] and transposed, `down_proj` transposed; or,
    stored as MXFP4, dequantized ([experts, out, in] already: gate and up interleaved rows)."""
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        packed = _mxfp4_experts(source, weights, p + "ffn_gate_up_exps")
        if packed is not None:
            for part, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                name = f"{p}ffn_{part}_exps.weight"
                weights[name] = stacked_experts(name, [
                    WeightRef(f"{name}[{e}]", (x.shape[0] // 2, x.shape[1]), x.stored_type, x.nbytes // 2,
                              lambda x=x, r=rows: x.load()[r].contiguous()) for e, x in enumerate(packed.experts)])
        packed = _mxfp4_experts(source, weights, p + "ffn_down_exps")
        if packed is not None:
            weights[p + "ffn_down_exps.weight"] = packed
        gate_up = weights.pop(p + "ffn_gate_up_exps.weight", None)
        if gate_up is not None and len(gate_up.shape) == 3:
            for part, cols in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                name = f"{p}ffn_{part}_exps.weight"
                weights[name] = stacked_experts(name, [_expert(gate_up, name, e, lambda w, c=cols: w[:, c].T)
                                                       for e in range(gate_up.shape[0])])
        bias = weights.pop(p + "ffn_gate_up_exps.bias", None)
        if bias is not None and len(bias.shape) == 2:
            for part, cols in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                weights[f"{p}ffn_{part}_exps.bias"] = _half(bias, f"{p}ffn_{part}_exps.bias",
                                                               lambda w, c=cols: w[:, c])
        down = weights.get(p + "ffn_down_exps.weight")
        if down is not None and len(down.shape) == 3 and down.experts is None:
            name = p + "ffn_down_exps.weight"
            weights[name] = stacked_experts(name, [_expert(down, name, e, lambda w: w.T)
                                                   for e in range(down.shape[0])])


def layer_tensors(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor layer i reads, canonical name -> shape."""
    h, q, kv, ff, e = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                       cfg.expert_ffn, cfg.num_experts)
    p = f"blk.{i}."
    expected = {p + "attn_norm.weight": (h,), p + "post_attention_norm.weight": (h,),
                p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
                p + "attn_output.weight": (h, q), p + "attn_sinks.weight": (cfg.num_heads,),
                p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_inp.bias": (e,),
                p + "ffn_gate_exps.weight": (e, ff, h), p + "ffn_up_exps.weight": (e, ff, h),
                p + "ffn_down_exps.weight": (e, h, ff), p + "ffn_gate_exps.bias": (e, ff),
                p + "ffn_up_exps.bias": (e, ff), p + "ffn_down_exps.bias": (e, h)}
    if cfg.qkv_bias:
        expected.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,),
                         p + "attn_output.bias": (h,)})
    return expected
