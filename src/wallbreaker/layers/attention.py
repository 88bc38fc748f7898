"""Paged attention: K and V live in a block pool; each sequence reaches its tokens through a block table.

One call serves a whole step of mixed work: the first `num_decode_tokens` tokens are one-token decode
steps (batched together), the rest are prefill chunks (one span per sequence). The tables are plain
integer tensors, the same inputs a GPU kernel (e.g. Triton) would take.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    start: int  # first of this sequence's tokens in the flat batch
    length: int  # tokens computed this step
    context_len: int  # tokens in the cache after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # [num_blocks] physical block ids


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot that receives each new token's K/V
    decode_block_tables: torch.Tensor  # [B_decode, max_blocks], padded with 0
    decode_context_lens: torch.Tensor  # [B_decode]
    prefills: list[PrefillSpan]
    positions: torch.Tensor | None = None  # [T]
    block_size: int = 16  # set by the runner from its KV cache
    _memo: dict = field(default_factory=dict, repr=False)  # per-step values every layer shares

    @property
    def num_decode_tokens(self) -> int:
        """A tensor's size, not a stored int: a compiled step sees it as a symbolic batch size."""
        return self.decode_context_lens.shape[0]

    def rotary(self, rope, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of this step's positions, computed once per step for each distinct RoPE (and dtype)."""
        key = (rope.key, dtype)
        if key not in self._memo:
            cos, sin = rope.cos_sin(self.positions)
            self._memo[key] = cos.to(dtype), sin.to(dtype)
        return self._memo[key]

    def decode_slots(self, block_size: int) -> torch.Tensor:
        """[B_decode, S] the cache slots each decode sequence's blocks cover."""
        if "slots" not in self._memo:
            self._memo["slots"] = _slots(self.decode_block_tables, block_size)
        return self._memo["slots"]

    def decode_mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B_decode, 1, S] which of the gathered key slots (`decode_slots`) each decode query may see."""
        key = ("mask", sliding_window)
        if key not in self._memo:
            lens = self.decode_context_lens[:, None]
            key_pos = torch.arange(self.decode_block_tables.shape[1] * self.block_size, device=lens.device)[None, :]
            mask = key_pos < lens
            if sliding_window is not None:
                mask &= key_pos > lens - 1 - sliding_window
            self._memo[key] = mask[:, None, :]
        return self._memo[key]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: [kv_heads, slots, head_dim]; k: [T, kv_heads, head_dim]."""
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]. The new tokens' K/V must already be written."""
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.length)
        out[rows] = _prefill(q[rows], k_cache, v_cache, span, scale, sliding_window, meta.block_size)
    return out


def _slots(block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block ids -> the slot ids they cover: [..., blocks] -> [..., blocks * block_size]."""
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table[..., None] * block_size + offsets).flatten(-2)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window):
    """One query per sequence against its gathered slots, as two batched matmuls with the query
    heads of a KV head side by side (GQA). PyTorch's CPU flash kernel tiles over queries and, with a
    single query per sequence, was ~20x slower than this at batch 64. (Compiled, the same sums as
    fused products and reductions were slower still beyond batch 1: the compiler vectorised them
    across the gathered slots.)"""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    slots = meta.decode_slots(meta.block_size)  # [B, S]
    k = k_cache[:, slots]  # [kv_heads, B, S, head_dim]
    v = v_cache[:, slots]
    qg = q.to(k.dtype).view(b, kv_heads, heads // kv_heads, d).transpose(0, 1)  # [kv_heads, B, group, head_dim]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [kv_heads, B, group, S]
    mask = meta.decode_mask(sliding_window)  # [B, 1, S]
    probs = scores.masked_fill_(~mask, float("-inf")).softmax(dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [kv_heads, B, group, head_dim]
    return out.transpose(0, 1).reshape(b, heads, d).to(q.dtype)


def _prefill(q, k_cache, v_cache, span: PrefillSpan, scale, sliding_window, block_size: int):
    slots = _slots(span.block_table[: -(-span.context_len // block_size)], block_size)[: span.context_len]
    k = k_cache[:, slots][None]  # [1, kv_heads, ctx, head_dim]
    v = v_cache[:, slots][None]
    q = q.transpose(0, 1)[None].to(k.dtype)  # [1, heads, L, head_dim]
    fresh = span.context_len == span.length
    if fresh and (sliding_window is None or span.context_len <= sliding_window):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(span.context_len - span.length, span.context_len, device=q.device)[:, None]
        key_pos = torch.arange(span.context_len, device=q.device)[None, :]
        mask = key_pos <= query_pos  # [L, ctx]
        if sliding_window is not None:
            mask &= (query_pos - key_pos) < sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
