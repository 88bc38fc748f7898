"""What a loader hands the engine: the config, lazily loaded weights, the tokenizer and the chat template."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import MAMBA2_ARCHITECTURES, ModelConfig
from ..errors import ModelFormatError
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer
from . import qwen3_next
from .lfm2 import FINAL_NORM as LFM2_FINAL_NORM, conv_layer_tensors
from .mamba_tensors import mamba_layer_tensors
from .names import FUSED_GATE_UP, FUSED_QKV


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
    blocks_mapped: bool = False  # `blocks()` and row ranges of `blocks_part` are views of the file's mapping
    # A 3-D expert tensor [experts, out, in]: each expert's [out, in] as a WeightRef of its own
    # (its stored blocks a view of the file where it has them), so that a model never loads the rest.
    experts: list["WeightRef"] | None = field(default=None, repr=False)

    def load_slice(self, dim: int, lo: int, hi: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) lo..hi of `load()`, reading only the stored bytes they need
        where the format allows (a tensor-parallel rank never holds the whole tensor)."""
        if (lo, hi) == (0, self.shape[dim]):
            return self.load()
        if self.load_part is not None:
            return self.load_part(dim, lo, hi)
        return self.load().narrow(dim, lo, hi - lo).clone()


def row_view(ref: WeightRef, name: str, lo: int, hi: int) -> WeightRef:
    """Rows lo..hi of `ref` as a tensor of its own: one projection of a fused one (Phi-3's q/k/v in
    `attn_qkv`, gate and up in `ffn_up`). Its float values, slices and stored blocks all come from
    those rows of `ref` alone."""
    shape = (hi - lo, *ref.shape[1:])
    nbytes = ref.nbytes * (hi - lo) // ref.shape[0]

    def load_part(dim: int, a: int, b: int) -> torch.Tensor:
        if dim == 0:
            return ref.load_slice(0, lo + a, lo + b)
        return ref.load_slice(1, a, b)[lo:hi].clone()

    blocks = blocks_part = None
    if ref.blocks_part is not None:
        def blocks() -> torch.Tensor | None:
            return ref.blocks_part(0, lo, hi)

        def blocks_part(dim: int, a: int, b: int) -> torch.Tensor | None:
            if dim == 0:
                return ref.blocks_part(0, lo + a, lo + b)
            cols = ref.blocks_part(1, a, b)
            return None if cols is None else cols[lo:hi].contiguous()
    return WeightRef(name, shape, ref.stored_type, nbytes, lambda: ref.load_slice(0, lo, hi), raw=None,
                     load_part=load_part, blocks=blocks, blocks_part=blocks_part, blocks_mapped=ref.blocks_mapped)


def stacked_experts(name: str, experts: list[WeightRef]) -> WeightRef:
    """One [experts, out, in] tensor of per-expert [out, in] ones (a Hugging Face folder stores each
    expert's projection on its own)."""
    first = experts[0]
    for e in experts:
        if tuple(e.shape) != tuple(first.shape):
            raise ModelFormatError(f"expert tensor {e.name!r} has shape {tuple(e.shape)}, its siblings "
                                   f"{tuple(first.shape)}")
    types = {e.stored_type for e in experts}
    return WeightRef(name, (len(experts), *first.shape), first.stored_type if len(types) == 1 else "mixed",
                     sum(e.nbytes for e in experts), lambda: torch.stack([e.load() for e in experts]),
                     experts=experts)


def split_fused(source: str, cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """Phi-3's fused projections, `blk.N.attn_qkv.weight` and `blk.N.ffn_gate_up.weight`, replaced in
    place by row views under the separate projections' names (which the model and the checks read).
    (Qwen3-Next's `attn_qkv` is its delta net's q/k/v, read as it is.)"""
    if cfg.architecture == qwen3_next.ARCH:
        return
    q, kv, ff = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        for fused, parts in ((FUSED_QKV, (("attn_q.weight", q), ("attn_k.weight", kv), ("attn_v.weight", kv))),
                             (FUSED_GATE_UP, (("ffn_gate.weight", ff), ("ffn_up.weight", ff)))):
            ref = weights.pop(p + fused, None)
            if ref is None:
                continue
            rows = sum(n for _, n in parts)
            if len(ref.shape) != 2 or ref.shape[0] != rows:
                raise ModelFormatError(f"{source}: tensor {ref.name!r} has shape {tuple(ref.shape)}, expected "
                                       f"({rows}, {cfg.hidden_size})")
            lo = 0
            for name, n in parts:
                if p + name in weights:
                    raise ModelFormatError(f"{source}: tensor {p + name!r} is stored both fused in {ref.name!r} "
                                           f"and on its own")
                weights[p + name] = row_view(ref, p + name, lo, lo + n)
                lo += n


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


def layer_tensors(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor layer i of `cfg` reads, canonical name -> shape."""
    if cfg.architecture == qwen3_next.ARCH:
        return qwen3_next.layer_tensors(cfg, i)
    if cfg.architecture in MAMBA2_ARCHITECTURES:
        return mamba_layer_tensors(cfg, i)
    h, q, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    p = f"blk.{i}."
    expected = {p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,)}
    if cfg.is_attention(i):
        expected.update({p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
                         p + "attn_output.weight": (h, q)})
    elif cfg.layer_types[i] == "conv":
        expected.update(conv_layer_tensors(h, cfg.conv_kernel, p))
    if cfg.is_moe:
        e, eff = cfg.num_experts, cfg.expert_ffn
        expected.update({p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, eff, h),
                         p + "ffn_up_exps.weight": (e, eff, h), p + "ffn_down_exps.weight": (e, h, eff)})
    else:
        expected.update({p + "ffn_gate.weight": (ff, h), p + "ffn_up.weight": (ff, h), p + "ffn_down.weight": (h, ff)})
    if cfg.qkv_bias:
        expected.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
    if cfg.qk_norm and cfg.is_attention(i):
        expected.update({p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,)})
    if cfg.sandwich_norm:
        expected.update({p + "post_attention_norm.weight": (h,), p + "post_ffw_norm.weight": (h,)})
    return expected


def top_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    final_norm = LFM2_FINAL_NORM if cfg.architecture == "lfm2" else "output_norm.weight"
    top = {"token_embd.weight": (cfg.vocab_size, cfg.hidden_size), final_norm: (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        top["output.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if cfg.pooling is not None and cfg.pooling.task == "score":  # a decoder cross-encoder's head
        top["cls.output.weight"] = (cfg.num_labels, cfg.hidden_size)
    return top


def check_weights(source: str, cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """Every tensor the architecture reads must be there with the shape the metadata implies, and
    every tensor there must be one it reads: a tensor nothing would read means a model we would
    run wrong (an unknown bias, a norm of another architecture), so it is refused, named.

    Checked layer by layer, so that memory stays bounded whatever `num_layers` claims; a layer
    count the tensors cannot hold is refused before any layer is looked at."""
    per_layer = 6 + (4 if cfg.is_moe else 3) + 3 * cfg.qkv_bias + 2 * cfg.qk_norm + 2 * cfg.sandwich_norm
    if cfg.is_recurrent:  # a recurrent layer's tensors differ; every layer has its two norms
        per_layer = 2
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

    top = top_tensors(cfg)
    check(top)
    used = len(top)
    for i in range(cfg.num_layers):
        expected = layer_tensors(cfg, i)
        check(expected)
        used += len(expected)
    if used != len(weights):  # every expected name is there, so the rest are extra
        known = set(top).union(*(layer_tensors(cfg, i) for i in range(cfg.num_layers)))
        extra = sorted(n for n in weights if n not in known)
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelFormatError(f"{source}: tensor {extra[0]!r} is not used by the {describe(cfg)} "
                               f"architecture{more}; refusing to run the model without it")


def describe(cfg: ModelConfig) -> str:
    """The architecture as the user knows it: llama with experts is Mixtral's."""
    if cfg.architecture == "llama" and cfg.is_moe:
        return "llama (mixture of experts)"
    return cfg.architecture
