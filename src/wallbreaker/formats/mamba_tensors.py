"""The tensors a Mamba2 or Granite-4.0-H layer reads, by canonical name (llama.cpp's; formats/mamba.py
reads them from either kind of file)."""
from __future__ import annotations

from ..config import ModelConfig


def mamba_layer_tensors(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor layer i reads, canonical name -> shape."""
    h, p = cfg.hidden_size, f"blk.{i}."
    expected = {p + "attn_norm.weight": (h,)}
    if cfg.is_attention(i):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        expected.update({p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
                         p + "attn_output.weight": (h, q)})
    else:
        heads, inner, groups = cfg.ssm_num_heads, cfg.ssm_num_heads * cfg.ssm_head_dim, cfg.ssm_num_groups
        conv_dim = inner + 2 * groups * cfg.ssm_state_size
        expected.update({p + "ssm_in.weight": (inner + conv_dim + heads, h), p + "ssm_out.weight": (h, inner),
                         p + "ssm_conv1d.weight": (conv_dim, cfg.ssm_conv_kernel), p + "ssm_conv1d.bias": (conv_dim,),
                         p + "ssm_dt.bias": (heads,), p + "ssm_a": (heads, 1), p + "ssm_d": (heads, 1),
                         p + "ssm_norm.weight": (groups, inner // groups)})
        if not cfg.ssm_conv_bias:
            del expected[p + "ssm_conv1d.bias"]
    if cfg.architecture == "mamba2":
        return expected
    expected[p + "ffn_norm.weight"] = (h,)
    if cfg.is_moe:
        e, eff, s = cfg.num_experts, cfg.expert_ffn, cfg.shared_mlp_size
        expected.update({p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, eff, h),
                         p + "ffn_up_exps.weight": (e, eff, h), p + "ffn_down_exps.weight": (e, h, eff),
                         p + "ffn_gate_shexp.weight": (s, h), p + "ffn_up_shexp.weight": (s, h),
                         p + "ffn_down_shexp.weight": (h, s)})
    else:
        ff = cfg.intermediate_size
        expected.update({p + "ffn_gate.weight": (ff, h), p + "ffn_up.weight": (ff, h), p + "ffn_down.weight": (h, ff)})
    return expected
