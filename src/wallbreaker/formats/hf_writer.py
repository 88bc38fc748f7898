"""Write a model as a Hugging Face folder: config.json, model.safetensors, tokenizer files.

The inverse of `hf_model.read_hf_folder`: `hf_config` describes a ModelConfig the way transformers
saves the architecture (so `config_from_hf` gives the same ModelConfig back), and tensors go from
canonical names and layout to Hugging Face's (Gemma norms back from 1 + w to w).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from .names import hf_to_canonical_table, is_norm
from .tokenizer import Tokenizer

_ARCH = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
         "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}


def hf_config(c: ModelConfig) -> dict[str, Any]:
    model_type, cls = _ARCH[c.architecture]
    rope: dict[str, Any] = {"rope_theta": c.rope_theta, "rope_type": "default"}
    if c.rope_scaling_factor != 1.0:
        rope = {"rope_theta": c.rope_theta, "rope_type": "linear", "factor": c.rope_scaling_factor}
    hf: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else next(iter(c.eos_token_ids), None),
        "dtype": "float32",
    }
    if c.architecture == "gemma3":
        hf.update({
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": c.query_pre_attn_scalar,
            "sliding_window": c.sliding_window,
            "layer_types": [f"{t}_attention" for t in c.layer_types],
            "rope_parameters": {"full_attention": rope,
                                "sliding_attention": {"rope_theta": c.rope_local_theta, "rope_type": "default"}},
            "attention_bias": False,
        })
    else:
        hf.update({"hidden_act": c.hidden_act, "rope_parameters": rope, "attention_bias": c.qkv_bias})
        if c.architecture == "qwen2":
            hf["use_sliding_window"] = False
    return hf


def canonical_to_hf(config: ModelConfig) -> dict[str, str]:
    return {canon: hf for hf, canon in hf_to_canonical_table(config.architecture, config.num_layers).items()}


def hf_tensor(name: str, tensor: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """A canonical float tensor as Hugging Face stores it."""
    t = tensor.detach().float().contiguous()
    return t - 1.0 if config.architecture == "gemma3" and is_norm(name) else t


def write_hf_folder(path: str | Path, config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer: Tokenizer,
                    chat_template: str | None = None, extra_tensors: dict[str, torch.Tensor] | None = None,
                    extra_config: dict[str, Any] | None = None) -> Path:
    """`tensors`: canonical names, float; `extra_tensors`: stored under their own (HF) names as given."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = canonical_to_hf(config)
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise ValueError(f"not canonical {config.architecture} tensor names: {unknown}")
    state = {names[n]: hf_tensor(n, t, config) for n, t in tensors.items()}
    state.update({k: v.contiguous() for k, v in (extra_tensors or {}).items()})
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**hf_config(config), **(extra_config or {})}, indent=2))
    tokenizer.save_hf(path, chat_template)
    return path
