"""Tensor names: wallbreaker's canonical names are llama.cpp's GGUF names.

Hugging Face folders are mapped onto them here, in one table per architecture, so that
the GGUF reader, the safetensors reader and the GGUF writer agree by construction.
"""
from __future__ import annotations

import torch


def hf_to_canonical_table(architecture: str, num_layers: int) -> dict[str, str]:
    table = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    if architecture == "gemma3":
        per_layer.update({
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
            "self_attn.q_norm.weight": "attn_q_norm.weight",
            "self_attn.k_norm.weight": "attn_k_norm.weight",
        })
    else:
        per_layer["post_attention_layernorm.weight"] = "ffn_norm.weight"
    for i in range(num_layers):
        for hf, gg in per_layer.items():
            table[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    return table


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF q/k rows -> llama.cpp's interleaved-RoPE row order (what convert_hf_to_gguf does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `llama_permute`: GGUF llama q/k rows back to HF's rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
