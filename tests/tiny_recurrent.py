"""Tiny random-weight recurrent and hybrid models (LFM2, Granite-4.0-H, Mamba2, Qwen3-Next), built by
transformers from a config, written as a Hugging Face folder with SmolLM2's tokenizer (one that
llama.cpp's converter knows), and converted to GGUF by llama.cpp's own `convert_hf_to_gguf.py`."""
from __future__ import annotations

from pathlib import Path

import torch

from wallbreaker.formats.packaged import packaged_model_path

VOCAB = 49152  # SmolLM2's


def smollm2_tokenizer():
    """SmolLM2's tokenizer as transformers builds it from the embedded GGUF."""
    from transformers import AutoTokenizer
    gguf = packaged_model_path("smollm2")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def save_random_model(hf_config, out: Path, seed: int = 0) -> Path:
    """A random-weight model of `hf_config` (a transformers config with vocab_size VOCAB) saved with
    SmolLM2's tokenizer into `out`. Norm weights are moved away from their initial values so that
    a norm left out shows in the logits."""
    from transformers import AutoModelForCausalLM
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    smollm2_tokenizer().save_pretrained(tmp)
    tmp.rename(out)
    return out


def load_reference(folder: Path):
    """transformers' model from `folder`, float32, on its own torch path (the tests check that no
    fused-kernel package is importable)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def no_fused_kernels() -> list[str]:
    """The fused-kernel packages transformers would prefer over its torch path, where importable."""
    import importlib.util
    return [m for m in ("mamba_ssm", "causal_conv1d", "fla") if importlib.util.find_spec(m) is not None]


ARCHITECTURES = ("lfm2", "mamba2", "granitemoehybrid", "qwen3_next")


def tiny_config(model_type: str):
    """A tiny transformers config of `model_type`: every kind of layer the architecture has, at
    hidden size 64, with SmolLM2's vocabulary."""
    import transformers as tf
    if model_type == "lfm2":
        return tf.Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             layer_types=["conv", "full_attention", "conv", "conv"])
    if model_type == "mamba2":
        return tf.Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=16, num_heads=8,
                               head_dim=16, expand=2, n_groups=2, conv_kernel=4, chunk_size=16)
    if model_type == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, shared_intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=16,
            mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
            position_embedding_type="nope", embedding_multiplier=2.0, attention_multiplier=0.2,
            residual_multiplier=0.5, logits_scaling=2.0, max_position_embeddings=512)
    if model_type == "qwen3_next":
        return tf.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
            partial_rotary_factor=0.25, max_position_embeddings=512)
    raise ValueError(model_type)
