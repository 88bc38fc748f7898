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
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [B_decode, max_blocks], padded with 0
    decode_context_lens: torch.Tensor  # [B_decode]
    prefills: list[PrefillSpan]
    positions: torch.Tensor | None = None  # [T]
    _memo: dict = field(default_factory=dict, repr=False)  # per-step values every layer shares

    def rotary(self, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of this step's positions, computed once per step for each distinct RoPE."""
        if rope.key not in self._memo:
            self._memo[rope.key] = rope.cos_sin(self.positions)
        return self._memo[rope.key]

    def decode_mask(self, key_len: int, sliding_window: int | None) -> torch.Tensor:
        """[B_decode, 1, 1, key_len] which gathered key slots each decode query may see."""
        key = ("mask", key_len, sliding_window)
        if key not in self._memo:
            lens = self.decode_context_lens[:, None]
            key_pos = torch.arange(key_len, device=lens.device)[None, :]
            mask = key_pos < lens
            if sliding_window is not None:
                mask &= key_pos > lens - 1 - sliding_window
            self._memo[key] = mask[:, None, None, :]
        return self._memo[key]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: [num_blocks, block_size, kv_heads, head_dim]; k: [T, kv_heads, head_dim]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]. The new tokens' K/V must already be written."""
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.length)
        out[rows] = _prefill(q[rows], k_cache, v_cache, span, scale, sliding_window)  # cast back by the copy
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    return cache[block_table].flatten(-4, -3)  # [..., blocks * block_size, kv_heads, head_dim]


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window):
    k = _gather(k_cache, meta.decode_block_tables).transpose(1, 2)  # [B, kv_heads, S, head_dim]
    v = _gather(v_cache, meta.decode_block_tables).transpose(1, 2)
    mask = meta.decode_mask(k.shape[2], sliding_window)
    out = F.scaled_dot_product_attention(q.unsqueeze(2).to(k.dtype), k, v, attn_mask=mask,
                                         scale=scale, enable_gqa=True)  # [B, heads, 1, head_dim]
    return out.squeeze(2).to(q.dtype)


def _prefill(q, k_cache, v_cache, span: PrefillSpan, scale, sliding_window):
    block_size = k_cache.shape[1]
    blocks = span.block_table[: -(-span.context_len // block_size)]
    k = _gather(k_cache, blocks)[: span.context_len].transpose(0, 1)[None]  # [1, kv_heads, ctx, head_dim]
    v = _gather(v_cache, blocks)[: span.context_len].transpose(0, 1)[None]
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
