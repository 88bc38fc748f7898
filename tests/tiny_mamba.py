"""Tiny random-weight Mamba2 and Granite-4.0-H models (tests/tiny_recurrent.py builds them), their
llama.cpp-converted GGUFs, and the checks both architectures' tests share."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_recurrent import VOCAB, save_random_model

TEXT = ("A recurrent layer keeps a fixed-size state per sequence instead of a cache that grows with the context; "
        "the quick brown fox jumps over the lazy dog. def main(): return x + y, and a paged cache keeps keys "
        "and values in fixed blocks so that many sequences share one pool.")
PROMPTS = ["The quick brown fox", "Once upon a time there was"]
GREEDY_TOKENS = 12
TIE = 1e-3  # the reference's top two logits this close: either token is right


def mamba2_config(**changes):
    from transformers import Mamba2Config
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=2, expand=2,
              conv_kernel=4, chunk_size=8, num_hidden_layers=2, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)
    return Mamba2Config(**{**kw, **changes})


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


def assert_greedy_matches(model, prompt: list[int], ours: list[int]) -> None:
    """`ours` is the reference's greedy continuation, up to a tie: at the first token that differs,
    the reference's two best logits must be within TIE of each other."""
    ids = list(prompt)
    with torch.no_grad():
        for i, token in enumerate(ours):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2)
            if token != int(top.indices[0]):
                assert float(top.values[0] - top.values[1]) < TIE and token == int(top.indices[1]), \
                    f"token {i}: ours {token}, transformers {int(top.indices[0])} (not a tie)"
                return
            ids.append(token)


def logits_error(llm, reference, ids: list[int]) -> float:
    """Our float32 logits against transformers', relative to the range of theirs."""
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    return ((llm.logits(ids) - expected).abs().max() / (expected.max() - expected.min())).item()
