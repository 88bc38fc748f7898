"""Tensor names: wallbreaker's canonical names are llama.cpp's GGUF names.

Hugging Face folders are mapped onto them here, in one table per architecture, so that
the GGUF reader, the safetensors reader and the GGUF writer agree by construction.

Two departures from one tensor per name, each undone by the readers: Phi-3 stores q/k/v fused
(`attn_qkv`) and gate/up fused (HF `gate_up_proj`, GGUF `ffn_up` of twice the rows), which the
readers present as the separate projections (`formats/weights.py` `row_view`); and a Hugging
Face folder stores each expert's projection on its own, which the reader presents as one
[experts, out, in] tensor, as GGUF stores it (`blk.N.ffn_gate_exps.weight`, ...).
"""
from __future__ import annotations

import re

import torch

from .lfm2 import hf_tensor_names as lfm2_tensor_names

# The fused tensors of a Phi-3 folder, as the table names them before the reader splits them.
FUSED_QKV = "attn_qkv.weight"
FUSED_GATE_UP = "ffn_gate_up.weight"
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")  # norms stored as w, applied as 1 + w

# HF names of an expert's projections -> the canonical [experts, out, in] tensor they belong to.
_EXPERTS = {
    "llama": (re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight"),
              {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight", "w3": "ffn_up_exps.weight"}),
    "qwen3next": (re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"),
                  {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                   "down_proj": "ffn_down_exps.weight"}),
    "qwen3moe": (re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"),
                 {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                  "down_proj": "ffn_down_exps.weight"}),
}
# Qwen3-Next's own tensors (formats/qwen3_next.py brings ssm_in, ssm_a and ssm_conv1d to the converter's form).
_QWEN3NEXT = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkvz.weight": "ssm_in.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# Buffers some checkpoints carry that are recomputed from the config, never read.
_DERIVED = re.compile(r".*\.rotary_emb\.inv_freq")


def hf_to_canonical_table(architecture: str, num_layers: int, moe: bool = False) -> dict[str, str]:
    """HF name -> canonical name of every tensor but the experts' (`hf_expert`)."""
    if architecture == "lfm2":
        return lfm2_tensor_names(num_layers)
    table = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        "score.weight": "cls.output.weight",  # *ForSequenceClassification: a reranker's head, as llama.cpp names it
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
    if architecture in GEMMA_ARCHITECTURES:
        per_layer.update({
            "post_attention_layernorm.weight": "post_attention_norm.weight",
            "pre_feedforward_layernorm.weight": "ffn_norm.weight",
            "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        })
    else:
        per_layer["post_attention_layernorm.weight"] = "ffn_norm.weight"
    if architecture == "qwen3next":
        per_layer.update(_QWEN3NEXT)
    if architecture in ("gemma3", "qwen3", "qwen3moe", "qwen3next"):
        per_layer.update({"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"})
    if architecture == "phi3":
        per_layer.update({"self_attn.qkv_proj.weight": FUSED_QKV, "mlp.gate_up_proj.weight": FUSED_GATE_UP})
    if moe:
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            del per_layer[name]
        router = "block_sparse_moe.gate.weight" if architecture == "llama" else "mlp.gate.weight"
        per_layer[router] = "ffn_gate_inp.weight"
    for i in range(num_layers):
        for hf, gg in per_layer.items():
            table[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    return table


def hf_expert(architecture: str, hf_name: str) -> tuple[str, int] | None:
    """An expert's projection -> (the canonical 3-D tensor, the expert's index); else None."""
    pattern, names = _EXPERTS.get(architecture, (None, None))
    m = pattern.fullmatch(hf_name) if pattern is not None else None
    if m is None:
        return None
    return f"blk.{int(m.group(1))}.{names[m.group(3)]}", int(m.group(2))


def hf_expert_name(architecture: str, name: str, expert: int) -> str:
    """The inverse of `hf_expert`: the HF name of expert `expert`'s part of canonical `name`."""
    layer, part = name.split(".", 2)[1], name.split(".", 2)[2]
    hf = {v: k for k, v in _EXPERTS[architecture][1].items()}[part]
    if architecture == "llama":
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{hf}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{hf}.weight"


def is_derived(hf_name: str) -> bool:
    """A buffer that is recomputed, not read (old checkpoints' `rotary_emb.inv_freq`)."""
    return _DERIVED.fullmatch(hf_name) is not None


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def adds_one(architecture: str, name: str) -> bool:
    """Whether the folder stores this norm as w where it is applied as 1 + w (Gemma's; Qwen3-Next's but
    its delta net's gated norm): the readers give the effective multiplier."""
    if architecture == "qwen3next":
        return is_norm(name) and not name.endswith("ssm_norm.weight")
    return architecture in GEMMA_ARCHITECTURES and is_norm(name)


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF q/k rows -> llama.cpp's interleaved-RoPE row order (what convert_hf_to_gguf does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `llama_permute`: GGUF llama q/k rows back to HF's rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
