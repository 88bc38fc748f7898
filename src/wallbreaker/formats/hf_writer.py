"""Write a model as a Hugging Face folder: config.json, model.safetensors, tokenizer files.

The inverse of `hf_model.read_hf_folder`: `hf_config` describes a ModelConfig the way transformers
saves the architecture (so `config_from_hf` gives the same ModelConfig back), and tensors go from
canonical names and layout to Hugging Face's (Gemma norms back from 1 + w to w, Phi-3's projections
fused, each expert's projections stored on their own).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import ModelConfig, RopeScaling
from ..text.tokenizer import Tokenizer
from .families import adds_one, family, hf_expert_name, hf_to_canonical_table
from .names import FUSED_GATE_UP, FUSED_QKV

def rope_parameters(theta: float, s: RopeScaling | None) -> dict[str, Any]:
    """transformers' `rope_parameters` for plain RoPE or a scaling.

    Llama 3 as llama.cpp stores it (one divisor per frequency) has no transformers form of its own;
    it is written as LongRoPE with those divisors as both factor sets and no attention factor,
    which is the same rotation."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if s is None:
        return rope
    if s.kind == "llama3" and s.freq_factors:
        return {**rope, "rope_type": "longrope", "short_factor": list(s.freq_factors),
                "long_factor": list(s.freq_factors), "attention_factor": 1.0}
    rope.update(rope_type=s.kind, factor=s.factor)
    if s.original_max_position_embeddings is not None:
        rope["original_max_position_embeddings"] = s.original_max_position_embeddings
    if s.kind == "llama3":
        rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    elif s.kind == "yarn":
        rope.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
    elif s.kind == "longrope":
        rope.update(short_factor=list(s.short_factor), long_factor=list(s.long_factor))
    if s.attention_factor is not None:
        rope["attention_factor"] = s.attention_factor
    return rope


def hf_config(c: ModelConfig) -> dict[str, Any]:
    """config.json of `c`: the keys every family has, then its own (its spec's `hf_write`)."""
    spec = family(c.architecture)
    if spec.hf_write is None:
        raise ValueError(f"a {c.architecture} model cannot be written as a Hugging Face folder")
    model_type = spec.hf_model_type(c) if spec.hf_model_type is not None else next(iter(spec.hf_classes))
    hf: dict[str, Any] = {
        "architectures": [spec.hf_classes[model_type]], "model_type": model_type, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else next(iter(c.eos_token_ids), None),
        "dtype": "float32", "rope_parameters": rope_parameters(c.rope_theta, c.rope_scaling), "attention_bias": c.qkv_bias,
    }
    spec.hf_write(c, hf)
    return hf


def canonical_to_hf(config: ModelConfig) -> dict[str, str]:
    """Canonical name -> HF name of every tensor stored under one name of its own."""
    return {canon: hf for hf, canon in
            hf_to_canonical_table(config.architecture, config.num_layers, config.is_moe).items()}


def hf_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A canonical float tensor as Hugging Face stores it."""
    t = tensor.detach().float().contiguous()
    return t - 1.0 if adds_one(config.architecture, name) else t


def hf_state(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical float tensors -> the safetensors state of a Hugging Face folder."""
    names = canonical_to_hf(config)
    tensors = dict(tensors)
    state: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        p = f"blk.{i}."
        fused = ((FUSED_QKV, ("attn_q.weight", "attn_k.weight", "attn_v.weight")),
                 (FUSED_GATE_UP, ("ffn_gate.weight", "ffn_up.weight"))) if family(config.architecture).writes_fused else ()
        for whole, parts in fused:
            if all(p + n in tensors for n in parts):
                state[names[p + whole]] = torch.cat([tensors.pop(p + n).float() for n in parts]).contiguous()
        for part in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
            stacked = tensors.pop(p + part, None)
            if stacked is not None and config.is_moe:
                for e in range(stacked.shape[0]):
                    state[hf_expert_name(config.architecture, p + part, e)] = stacked[e].float().contiguous()
            elif stacked is not None:
                tensors[p + part] = stacked  # reported below as not canonical
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise ValueError(f"not canonical {config.architecture} tensor names: {unknown}")
    state.update({names[n]: hf_tensor(n, t, config) for n, t in tensors.items()})
    return state


def write_hf_folder(path: str | Path, config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer: Tokenizer,
                    chat_template: str | None = None, extra_tensors: dict[str, torch.Tensor] | None = None,
                    extra_config: dict[str, Any] | None = None) -> Path:
    """`tensors`: canonical names, float; `extra_tensors`: stored under their own (HF) names as given."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = hf_state(config, tensors)
    state.update({k: v.contiguous() for k, v in (extra_tensors or {}).items()})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**hf_config(config), **(extra_config or {})}, indent=2))
    tokenizer.save_hf(path, chat_template)
    return path
