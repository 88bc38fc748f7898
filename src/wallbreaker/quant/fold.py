"""Folding AWQ's input scales into the op before each Linear, so that X/s costs nothing at run time.

For the four Linear modules of a decoder layer (Llama, Qwen2 and Gemma 3 alike), with W·diag(s):
- qkv     ← the attention RMSNorm's weight / s
- o       ← the v rows of qkv (and their bias) / s. Exact under grouped-query attention only when the
            q heads that share a KV head share their scales: `tie_heads` averages them first.
- gate_up ← the FFN RMSNorm's weight / s (Gemma 3: the pre-feed-forward norm)
- down    ← the up rows of gate_up / s (the gate's activation times up is linear in up)
Norm weights here are the effective multipliers (Gemma's 1 + w), so dividing them is exact.
"""
from __future__ import annotations

import torch
from torch import nn


def tie_heads(stat: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[heads·head_dim] -> same shape, averaged over the q heads that read one KV head."""
    per_kv = stat.view(num_kv_heads, num_heads // num_kv_heads, -1).mean(1, keepdim=True)  # [kv, 1, hd]
    return per_kv.expand(-1, num_heads // num_kv_heads, -1).reshape(-1)


@torch.no_grad()
def fold_scales(layer: nn.Module, group: str, s: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    """Multiply the inputs of `group`'s weight by s and divide what produces its input by s."""
    attn, mlp = layer.attn, layer.mlp
    if group == "qkv":
        layer.attn_norm.weight.div_(s)
        attn.qkv.weight.mul_(s[None, :])
    elif group == "o":
        hd = s.shape[0] // num_heads
        s_kv = s.view(num_kv_heads, num_heads // num_kv_heads, hd)[:, 0].reshape(-1)  # [kv·hd]
        v = slice(attn.qkv.weight.shape[0] - s_kv.shape[0], attn.qkv.weight.shape[0])
        attn.qkv.weight[v].div_(s_kv[:, None])
        if attn.qkv.bias is not None:
            attn.qkv.bias[v].div_(s_kv)
        attn.o.weight.mul_(s[None, :])
    elif group == "gate_up":
        layer.mlp_norm.weight.div_(s)
        mlp.gate_up.weight.mul_(s[None, :])
    elif group == "down":
        ff = mlp.down.weight.shape[1]
        mlp.gate_up.weight[ff:].div_(s[:, None])
        mlp.down.weight.mul_(s[None, :])
    else:
        raise ValueError(f"unknown linear group {group!r}")


def folded_tensor_names(i: int, has_qkv_bias: bool) -> dict[str, str]:
    """Canonical float tensors of layer `i` that folding changes -> where they live in the layer."""
    p = f"blk.{i}."
    names = {p + "attn_norm.weight": "attn_norm", p + "ffn_norm.weight": "mlp_norm"}
    if has_qkv_bias:
        names[p + "attn_v.bias"] = "v_bias"
    return names


def read_folded(layer: nn.Module, where: str, kv_size: int) -> torch.Tensor:
    if where == "attn_norm":
        return layer.attn_norm.weight.detach().float().clone()
    if where == "mlp_norm":
        return layer.mlp_norm.weight.detach().float().clone()
    return layer.attn.qkv.bias.detach()[-kv_size:].float().clone()
