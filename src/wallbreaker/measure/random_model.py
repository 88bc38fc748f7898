"""Random-weight GGUFs of real models' shapes, for speed and memory at a scale no installable model
has (3B, 8B). The blocks are written as they are stored (random codes, scales chosen so that a
weight's spread is about a trained model's, ~0.02), so an 8B file needs no 32 GB float model in
memory and no quantizer; norms are ones. The tokenizer is a real GGUF's (SmolLM2's by default), so
llama.cpp and wallbreaker both run the file as any other llama model.

Schemes: `q8_0` (every matrix Q8_0) and `q4_k_m` (llama.cpp's Q4_K_M choice for llama: Q4_K, with
attn_v and ffn_down in Q6_K on the layers `use_more_bits` picks, the output or tied embedding Q6_K).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from ..config import ModelConfig
from ..kernels.blocks import random_blocks
from ..formats.gguf_file import open_gguf
from ..formats.gguf_writer import write_gguf
from ..formats.checks import layer_tensors, top_tensors

Q = gguf.GGMLQuantizationType
SCHEMES = ("q8_0", "q4_k_m")

@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    tied: bool
    rope_theta: float = 500000.0


SHAPES = {
    "llama-3.2-3b": Shape(3072, 28, 8192, 24, 8, tied=True),
    "llama-3.1-8b": Shape(4096, 32, 14336, 32, 8, tied=False),
    "tiny-k": Shape(256, 2, 512, 4, 2, tied=False),  # the smallest shape every K-quant fits (tests)
}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that keep more bits in its _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, scheme: str, layers: int) -> Q:
    if scheme == "q8_0":
        return Q.Q8_0
    if name in ("output.weight", "token_embd.weight"):
        return Q.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(int(name.split(".")[1]), layers):
        return Q.Q6_K
    return Q.Q4_K


def write_random_gguf(path: Path, shape: Shape, scheme: str, tokenizer_gguf: Path, seed: int = 0,
                      context: int = 8192) -> Path:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}")
    source = open_gguf(tokenizer_gguf)
    tokenizer = {k: v for k, v in source.metadata.items()
                 if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    cfg = ModelConfig("llama", vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                      num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                      head_dim=shape.hidden // shape.heads, max_position_embeddings=context,
                      tie_word_embeddings=shape.tied, rope_theta=shape.rope_theta, rms_norm_eps=1e-5,
                      bos_token_id=source.get("tokenizer.ggml.bos_token_id"),
                      eos_token_ids=(source.get("tokenizer.ggml.eos_token_id"),))
    shapes = {**top_tensors(cfg), **{n: s for i in range(cfg.num_layers) for n, s in layer_tensors(cfg, i).items()}}
    rng = np.random.default_rng(seed)
    floats, raw = {}, {}
    for name, dims in shapes.items():
        if len(dims) == 1:
            floats[name] = torch.ones(dims)
        else:
            qtype = tensor_type(name, scheme, cfg.num_layers)
            raw[name] = (random_blocks(qtype, *dims, rng), qtype)
    return write_gguf(path, cfg, floats, tokenizer, name=f"random {path.stem}", raw_tensors=raw,
                      chat_template=source.get("tokenizer.chat_template"))
