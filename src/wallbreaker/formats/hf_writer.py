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
from .names import FUSED_GATE_UP, FUSED_QKV, GEMMA_ARCHITECTURES, hf_expert_name, hf_to_canonical_table, is_norm

_ARCH = {"llama": ("llama", "LlamaForCausalLM"), "mistral": ("mistral", "MistralForCausalLM"),
         "mixtral": ("mixtral", "MixtralForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
         "qwen3": ("qwen3", "Qwen3ForCausalLM"), "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
         "phi3": ("phi3", "Phi3ForCausalLM"), "gemma2": ("gemma2", "Gemma2ForCausalLM"),
         "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}


def _family(c: ModelConfig) -> str:
    """Which transformers class a config is: llama with experts is Mixtral, with a window Mistral."""
    if c.architecture == "llama" and c.is_moe:
        return "mixtral"
    if c.architecture == "llama" and c.sliding_window is not None:
        return "mistral"
    return c.architecture


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
    family = _family(c)
    model_type, cls = _ARCH[family]
    rope = rope_parameters(c.rope_theta, c.rope_scaling)
    hf: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else next(iter(c.eos_token_ids), None),
        "dtype": "float32", "rope_parameters": rope, "attention_bias": c.qkv_bias,
    }
    if c.architecture in GEMMA_ARCHITECTURES:
        hf.update({"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": c.query_pre_attn_scalar,
                   "sliding_window": c.sliding_window, "layer_types": [f"{t}_attention" for t in c.layer_types],
                   "attn_logit_softcapping": c.attn_logit_softcap,
                   "final_logit_softcapping": c.final_logit_softcap})
        if c.architecture == "gemma3":
            hf["rope_parameters"] = {"full_attention": rope,
                                     "sliding_attention": {"rope_theta": c.rope_local_theta, "rope_type": "default"}}
        return hf
    hf["hidden_act"] = c.hidden_act
    if c.sliding_window is not None:
        hf.update(sliding_window=c.sliding_window, layer_types=[f"{t}_attention" for t in c.layer_types])
        if c.architecture.startswith("qwen"):
            hf["use_sliding_window"] = True
    elif c.architecture.startswith("qwen") or c.architecture == "phi3":
        hf.update(use_sliding_window=False, sliding_window=None)
    if c.architecture == "phi3" and c.rope_scaling is not None and c.rope_scaling.kind == "longrope":
        hf["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings
    if family == "mixtral":
        if not c.norm_topk_prob:
            raise ValueError("Mixtral always renormalizes its top-k router weights (norm_topk_prob)")
        hf.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
    elif c.architecture == "qwen3moe":
        hf.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                  moe_intermediate_size=c.expert_ffn, norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1,
                  mlp_only_layers=[])
    return hf


def canonical_to_hf(config: ModelConfig) -> dict[str, str]:
    """Canonical name -> HF name of every tensor stored under one name of its own."""
    return {canon: hf for hf, canon in
            hf_to_canonical_table(config.architecture, config.num_layers, config.is_moe).items()}


def hf_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A canonical float tensor as Hugging Face stores it."""
    t = tensor.detach().float().contiguous()
    return t - 1.0 if config.architecture in GEMMA_ARCHITECTURES and is_norm(name) else t


def hf_state(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical float tensors -> the safetensors state of a Hugging Face folder."""
    names = canonical_to_hf(config)
    tensors = dict(tensors)
    state: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        p = f"blk.{i}."
        fused = ((FUSED_QKV, ("attn_q.weight", "attn_k.weight", "attn_v.weight")),
                 (FUSED_GATE_UP, ("ffn_gate.weight", "ffn_up.weight"))) if config.architecture == "phi3" else ()
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
