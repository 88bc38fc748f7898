"""What a loader hands the engine: the config, lazily loaded weights, the tokenizer and the chat template."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ModelConfig
from ..errors import ModelFormatError
from .chat_template import ChatTemplate
from .tokenizer import Tokenizer


@dataclass
class WeightRef:
    """One stored tensor. `load()` gives it as float32 in canonical layout; nothing is read before that."""

    name: str
    shape: tuple[int, ...]
    stored_type: str  # "F32", "BF16", "Q4_1", ...
    nbytes: int  # bytes as stored
    load: Callable[[], torch.Tensor] = field(repr=False)
    raw: Any = field(default=None, repr=False)  # the stored bytes (GGUF), for kernels that read them
    quant: Any = field(default=None, repr=False)  # formats.quantized_hf.QuantInfo of a wallbreaker-quantized weight
    load_part: Callable[[int, int, int], torch.Tensor] | None = field(default=None, repr=False)  # (dim, lo, hi)
    # The stored GGUF blocks, for the kernels (wallbreaker.kernels): [rows, row bytes] uint8 in the
    # file's block layout and canonical row order; `blocks_part(dim, lo, hi)` those of a row or
    # column range (None where a column bound cuts a block). None: no blocks are stored.
    blocks: Callable[[], torch.Tensor] | None = field(default=None, repr=False)
    blocks_part: Callable[[int, int, int], torch.Tensor | None] | None = field(default=None, repr=False)

    def load_slice(self, dim: int, lo: int, hi: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) lo..hi of `load()`, reading only the stored bytes they need
        where the format allows (a tensor-parallel rank never holds the whole tensor)."""
        if (lo, hi) == (0, self.shape[dim]):
            return self.load()
        if self.load_part is not None:
            return self.load_part(dim, lo, hi)
        return self.load().narrow(dim, lo, hi - lo).clone()


@dataclass
class ModelFiles:
    path: Path
    format: str  # "gguf" | "hf"
    config: ModelConfig
    weights: dict[str, WeightRef]
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    metadata: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def weight_bytes(self) -> int:
        return sum(w.nbytes for w in self.weights.values())


def check_weights(source: str, cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """Every tensor the architecture reads must be there with the shape the metadata implies.

    Checked layer by layer, so that memory stays bounded whatever `num_layers` claims; a layer
    count the tensors cannot hold is refused before any layer is looked at."""
    h, q, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_layer = 9 + 3 * cfg.qkv_bias + 2 * cfg.qk_norm + 2 * cfg.sandwich_norm
    if cfg.num_layers * per_layer > len(weights):
        raise ModelFormatError(f"{source}: {cfg.num_layers} layers need at least {cfg.num_layers * per_layer} "
                               f"tensors but the model has {len(weights)}")

    def check(expected: dict[str, tuple[int, ...]]) -> None:
        for name, shape in expected.items():
            if name not in weights:
                raise ModelFormatError(f"{source}: missing tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise ModelFormatError(
                    f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")

    top = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        top["output.weight"] = (cfg.vocab_size, h)
    check(top)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        expected = {p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,),
                    p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
                    p + "attn_output.weight": (h, q), p + "ffn_gate.weight": (ff, h),
                    p + "ffn_up.weight": (ff, h), p + "ffn_down.weight": (h, ff)}
        if cfg.qkv_bias:
            expected.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
        if cfg.qk_norm:
            expected.update({p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,)})
        if cfg.sandwich_norm:
            expected.update({p + "post_attention_norm.weight": (h,), p + "post_ffw_norm.weight": (h,)})
        check(expected)
