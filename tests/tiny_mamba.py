"""Tiny random-weight Mamba2, Granite-4.0-H, Mamba (v1) and Falcon-Mamba models: their configs, and
their Hugging Face folders as llama.cpp's converter reads them (tests/tiny_recurrent.py builds them)."""
from __future__ import annotations

import json
from pathlib import Path

from tiny_recurrent import VOCAB, save_random_model


def mamba2_config(**changes):
    from transformers import Mamba2Config
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2,
              conv_kernel=4, chunk_size=8, num_hidden_layers=2, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
    return Mamba2Config(**{**kw, **changes})


def mamba_config(**changes):
    """Mamba (v1): the converter takes only expand 2; time_step_rank "auto" is ceil(64 / 16) = 4."""
    from transformers import MambaConfig
    kw = dict(vocab_size=VOCAB, hidden_size=64, state_size=16, expand=2, conv_kernel=4, num_hidden_layers=2,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return MambaConfig(**{**kw, **changes})


def falcon_mamba_config(**changes):
    """Falcon-Mamba: Mamba with weightless RMS norms of the time step, B and C; their epsilon is the
    layer norms' (a GGUF has only that one)."""
    from transformers import FalconMambaConfig
    kw = dict(vocab_size=VOCAB, hidden_size=64, state_size=16, expand=2, conv_kernel=4, num_hidden_layers=2,
              layer_norm_epsilon=1e-5, mixer_rms_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
    return FalconMambaConfig(**{**kw, **changes})


def granite_config(**changes):
    """Granite-4.0-H's shape in small: Mamba2 layers around one attention layer without RoPE, 4
    experts (2 a token) beside a shared expert, and multipliers far from 1 so that one left out
    shows in the logits."""
    from transformers import GraniteMoeHybridConfig
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "mamba"],
              mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
              mamba_expand=2, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
              attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=0.25, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, position_embedding_type="nope")
    return GraniteMoeHybridConfig(**{**kw, **changes})


def save_model(hf_config, out: Path) -> Path:
    """`save_random_model`, with Granite's layer kinds spelled as IBM's config.json spells them
    ("mamba" / "attention"): llama.cpp's converter finds the attention layers by those names
    (transformers 5 saves "linear_attention" / "full_attention" and reads both)."""
    folder = save_random_model(hf_config, out)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("model_type") == "granitemoehybrid":
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        cfg["layer_types"] = [names.get(t, t) for t in cfg["layer_types"]]
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return folder
