"""Qwen3-Next's files: its config keys (config.json and llama.cpp's `qwen3next.*` metadata) and the
layout of its Hugging Face tensors, brought to what llama.cpp's converter writes (the canonical form).

The converter (conversion/qwen.py, Qwen3NextModel) splits the fused `in_proj_qkvz`, whose rows come
per key head ([q, k, v, z] of head 0, then of head 1, ...), into `attn_qkv` (all q rows, then all k,
then all v) and `attn_gate` (all z rows); stores -exp(A_log) as `ssm_a`, `dt_bias` as `ssm_dt.bias`,
the convolution squeezed to [channels, kernel]; and adds 1 to every RMSNorm weight but the gated
one of the delta net (`ssm_norm`), which transformers applies as w where the others are 1 + w.
`in_proj_ba` keeps its order ([b, a] of each key head's value heads) as `ssm_ba`. A folder's
tensors are brought to that form in qwen3_next_weights.py.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config import ModelConfig, short_repr
from ..errors import ModelFormatError
from .config_keys import GGUFKeys, unsupported
from .names import is_norm

# llama.cpp's `qwen3next.*` metadata keys read here (beside the generic ones).
GGUF_KEYS = frozenset({"nextn_predict_layers", "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank",
                       "ssm.inner_size", "attention.recurrent_layers", "full_attention_interval",
                       "expert_shared_feed_forward_length"})
# ModelConfig field -> the key it is read from, to name the key in errors
HF_FIELD_KEYS = {"rotary_dim": "partial_rotary_factor", "linear_conv_kernel": "linear_conv_kernel_dim",
                 "linear_key_head_dim": "linear_key_head_dim", "linear_value_head_dim": "linear_value_head_dim",
                 "linear_num_key_heads": "linear_num_key_heads", "linear_num_value_heads": "linear_num_value_heads",
                 "shared_expert_intermediate_size": "shared_expert_intermediate_size"}
GGUF_FIELD_KEYS = {"rotary_dim": "rope.dimension_count", "linear_conv_kernel": "ssm.conv_kernel",
                   "linear_key_head_dim": "ssm.state_size", "linear_value_head_dim": "ssm.inner_size",
                   "linear_num_key_heads": "ssm.group_count", "linear_num_value_heads": "ssm.time_step_rank",
                   "shared_expert_intermediate_size": "expert_shared_feed_forward_length"}
# config.json keys the common reader refuses (partial RoPE, a shared expert) that `config_from_hf` reads
HF_OWN_KEYS = frozenset({"partial_rotary_factor", "shared_expert_intermediate_size"})
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # transformers' and llama.cpp's: every fourth layer has attention


def norm_adds_one(name: str) -> bool:
    """Every RMSNorm weight is stored as w and applied as 1 + w, but the delta net's gated one."""
    return is_norm(name) and not name.endswith("ssm_norm.weight")


def qkvz_rows(num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of HF's `in_proj_qkvz` that make llama.cpp's `attn_qkv` and `attn_gate`, in their order."""
    per_v = num_v_heads // num_k_heads * v_dim
    width = 2 * k_dim + 2 * per_v  # one key head's [q, k, v, z]
    heads = torch.arange(num_k_heads)[:, None] * width

    def part(offset: int, size: int) -> torch.Tensor:
        return (heads + offset + torch.arange(size)[None, :]).flatten()

    qkv = torch.cat([part(0, k_dim), part(k_dim, k_dim), part(2 * k_dim, per_v)])
    return qkv, part(2 * k_dim + per_v, per_v)


def layer_tensors(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor layer i of a Qwen3-Next reads, canonical name -> shape."""
    h, p = cfg.hidden_size, f"blk.{i}."
    expected = {p + "attn_norm.weight": (h,), p + "post_attention_norm.weight": (h,)}
    if cfg.is_attention(i):
        d, kv = cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        expected.update({p + "attn_q.weight": (2 * cfg.num_heads * d, h), p + "attn_k.weight": (kv, h),
                         p + "attn_v.weight": (kv, h), p + "attn_output.weight": (h, cfg.num_heads * d),
                         p + "attn_q_norm.weight": (d,), p + "attn_k_norm.weight": (d,)})
    else:
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        keys, values = hk * cfg.linear_key_head_dim, hv * cfg.linear_value_head_dim
        expected.update({p + "attn_qkv.weight": (2 * keys + values, h), p + "attn_gate.weight": (values, h),
                         p + "ssm_ba.weight": (2 * hv, h), p + "ssm_a": (hv,), p + "ssm_dt.bias": (hv,),
                         p + "ssm_conv1d.weight": (2 * keys + values, cfg.linear_conv_kernel),
                         p + "ssm_norm.weight": (cfg.linear_value_head_dim,), p + "ssm_out.weight": (h, values)})
    e, eff, shared = cfg.num_experts, cfg.expert_ffn, cfg.shared_expert_intermediate_size
    expected.update({p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, eff, h),
                     p + "ffn_up_exps.weight": (e, eff, h), p + "ffn_down_exps.weight": (e, h, eff),
                     p + "ffn_gate_inp_shexp.weight": (1, h), p + "ffn_gate_shexp.weight": (shared, h),
                     p + "ffn_up_shexp.weight": (shared, h), p + "ffn_down_shexp.weight": (h, shared)})
    return expected


def _layer_types_from(recurrent: list[bool]) -> tuple[str, ...]:
    return tuple("linear_attention" if r else "full" for r in recurrent)


def config_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The ModelConfig fields of a Qwen3-Next config.json beyond the generic ones."""
    if hf.get("attention_bias"):
        raise unsupported(where, "attention_bias true (Qwen3-Next's projections have no biases)")
    layers = hf.get("num_hidden_layers")
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step not in (1, None) or only:
        raise unsupported(where, f"dense MLP layers (decoder_sparse_step {short_repr(step)}, mlp_only_layers "
                          f"{short_repr(only)}); every layer's MLP must be the mixture of experts")
    if not hf.get("num_experts"):
        raise unsupported(where, f"num_experts {short_repr(hf.get('num_experts'))} (a Qwen3-Next without experts)")
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    head_dim = hf.get("head_dim")
    if head_dim is None:  # transformers' default is 256 here, not hidden_size / heads: say it
        raise ModelFormatError(f"{where}: missing key 'head_dim'")
    if not isinstance(partial, (int, float)) or isinstance(partial, bool) or not 0 < partial <= 1:
        raise ModelFormatError(f"{where}: partial_rotary_factor must be in (0, 1], got {short_repr(partial)}")
    given = hf.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or any(t not in ("linear_attention", "full_attention") for t in given):
            raise ModelFormatError(f"{where}: layer_types must list linear_attention or full_attention, "
                                   f"got {short_repr(given)}")
        layer_types = _layer_types_from([t == "linear_attention" for t in given])
    else:
        interval = hf.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ModelFormatError(f"{where}: full_attention_interval must be a positive integer, got "
                                   f"{short_repr(interval)}")
        count = layers if isinstance(layers, int) and not isinstance(layers, bool) and 0 < layers <= 1 << 20 else 0
        layer_types = _layer_types_from([(i + 1) % interval != 0 for i in range(count)])
    return dict(qk_norm=True, layer_types=layer_types, num_experts=hf.get("num_experts"),
                num_experts_per_tok=hf.get("num_experts_per_tok"),
                expert_intermediate_size=hf.get("moe_intermediate_size"),
                norm_topk_prob=hf.get("norm_topk_prob", True),
                rotary_dim=int(head_dim * partial) if isinstance(head_dim, int) and not isinstance(head_dim, bool)
                else head_dim,
                linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
                linear_key_head_dim=hf.get("linear_key_head_dim", 128),
                linear_value_head_dim=hf.get("linear_value_head_dim", 128),
                linear_num_key_heads=hf.get("linear_num_key_heads", 16),
                linear_num_value_heads=hf.get("linear_num_value_heads", 32),
                shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 512))


def config_from_gguf(k: GGUFKeys) -> dict[str, Any]:
    """The ModelConfig fields of a `qwen3next` GGUF beyond the generic ones."""
    gf, name, a, layers, integer = k.gf, k.name, k.a, k.layers, k.integer
    recurrent = gf.get(a + "attention.recurrent_layers")
    blocks = layers + integer(a + "nextn_predict_layers", 0)  # the MTP layers have their entries too
    if recurrent is not None:
        if not (isinstance(recurrent, list) and len(recurrent) == blocks and all(isinstance(r, bool) for r in recurrent)):
            raise ModelFormatError(f"{name}: metadata {a}attention.recurrent_layers must be one true or false a "
                                   f"block ({blocks}), got {short_repr(recurrent)}")
        recurrent = recurrent[:layers]
    else:
        interval = integer(a + "full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        if interval < 1:
            raise ModelFormatError(f"{name}: metadata {a}full_attention_interval must be positive, got {interval}")
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    v_heads = integer(a + "ssm.time_step_rank")
    inner = integer(a + "ssm.inner_size")
    if v_heads <= 0 or inner % v_heads:
        raise ModelFormatError(f"{name}: metadata {a}ssm.inner_size ({inner}) must be a multiple of "
                               f"{a}ssm.time_step_rank ({v_heads})")
    return dict(qk_norm=True, layer_types=_layer_types_from(recurrent),
                rotary_dim=integer(a + "rope.dimension_count", None),
                linear_conv_kernel=integer(a + "ssm.conv_kernel"), linear_key_head_dim=integer(a + "ssm.state_size"),
                linear_value_head_dim=inner // v_heads, linear_num_key_heads=integer(a + "ssm.group_count"),
                linear_num_value_heads=v_heads,
                shared_expert_intermediate_size=integer(a + "expert_shared_feed_forward_length"))


def add_gguf_keys(writer, c: ModelConfig) -> None:
    """The `qwen3next.*` keys llama.cpp's converter writes (formats/gguf_writer.py writes the rest)."""
    writer.add_ssm_conv_kernel(c.linear_conv_kernel)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_array(f"{c.architecture}.attention.recurrent_layers", [t == "linear_attention" for t in c.layer_types])
    writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
