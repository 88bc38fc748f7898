"""Paged attention: K and V live in a block pool; each sequence reaches its tokens through a block table.

One call serves a whole step of mixed work. Sequences with a few new tokens (decode steps,
speculative verification, short chunks) come first in the flat batch and go to one kernel call
that reads K/V through their block tables where they lie (csrc/attention_*.cpp). Longer prefill
chunks follow, one span per sequence, each through PyTorch's SDPA over its gathered context,
where the work is matrix products that SDPA tiles well.

In batch-invariant mode (`AttentionMetadata.split_by_origin`) the split is by the token, not by the
chunk: generated tokens go to the paged kernel (one query at a time over the blocks in order),
prompt tokens to SDPA in calls of one shape (`_prefill_invariant`), so a token's attention has the
same bits whatever chunk, cache hit or neighbours its step has.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _C
from .recurrent import StateMetadata

MAX_PAGED_QUERIES = 33  # a sequence with at most this many new tokens goes to the paged kernel
# Batch-invariant prompt attention: SDPA calls of exactly INVARIANT_QUERIES queries (the last padded)
# over the keys padded to a multiple of INVARIANT_KEYS (PyTorch's CPU flash kernel takes keys in
# blocks of 512; a block wholly masked leaves the running max and sums unchanged, so the padding and
# the keys past a query never change its bits). 64 queries cost ~10% over one call of 512 queries
# (Qwen2.5-0.5B's heads, 4,096 tokens: 1.71 s against 1.54 s over 24 layers); 32 cost 65% more.
INVARIANT_QUERIES = 64
INVARIANT_KEYS = 512


class LayerKV(NamedTuple):
    """One layer's K and V pages, [kv_heads, slots, head_dim] each; for int8 and fp8 pages also
    their scales, [kv_heads, slots], one per token and head, and where the model has them the
    offsets, [kv_heads, head_dim]: a quantized row stands for page * scale + offset."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_offset: torch.Tensor | None = None
    v_offset: torch.Tensor | None = None


@dataclass
class PrefillSpan:
    start: int  # first of this sequence's tokens in the flat batch
    length: int  # tokens computed this step
    context_len: int  # tokens in the cache after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # [num_blocks] physical block ids
    # [start, end) positions of image blocks among this span's queries: their tokens attend to each
    # other both ways (Gemma 3's images), the rest of the attention stays causal
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot that receives each new token's K/V
    block_tables: torch.Tensor  # [N, W] int32 of the paged-kernel sequences, padded with 0
    query_start: torch.Tensor  # [N + 1] int32: sequence n's tokens are rows query_start[n]..query_start[n+1]
    context_lens: torch.Tensor  # [N] int32: tokens in the cache after this step
    prefills: list[PrefillSpan]  # the longer chunks, rows after the paged ones
    positions: torch.Tensor  # [T]
    block_size: int  # tokens a KV block holds
    num_paged_tokens: int  # rows 0 .. num_paged_tokens - 1 belong to the paged-kernel sequences
    state: "StateMetadata | None" = None  # recurrent layers' slots (layers/recurrent.py); None: the model has none
    # batch-invariant mode: the paged rows are generated tokens, the prefill spans prompt tokens
    # (engine/model_runner.py), computed in calls of one shape (`_prefill_invariant`)
    split_by_origin: bool = False
    mrope_positions: torch.Tensor | None = None  # [3, T] where a sequence's images have M-RoPE positions (Qwen2.5-VL)
    _memo: dict = field(default_factory=dict, repr=False)  # per-step values every layer shares

    def rotary(self, rope, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of this step's positions, computed once per step for each distinct RoPE (and dtype)."""
        key = (rope.key, dtype)
        if key not in self._memo:
            cos, sin = rope.cos_sin(self.positions if self.mrope_positions is None else self.mrope_positions)
            self._memo[key] = cos.to(dtype), sin.to(dtype)
        return self._memo[key]


def paged_attention(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]. The new tokens' K/V must already be written.
    `softcap` (Gemma 2): scores become softcap * tanh(scores / softcap) before the softmax.
    `sinks` [heads] float32 (gpt-oss): each head's learned logit in the softmax's denominator, as if
    one more key had that score and a zero value (`_with_sink`)."""
    if sinks is not None and softcap is not None:
        raise ValueError("attention sinks with a soft cap are not supported")
    n = meta.num_paged_tokens
    if n == q.shape[0] and not meta.prefills:
        return _paged(q, kv, meta, scale, sliding_window, softcap, sinks)
    out = torch.empty_like(q)
    if n:
        out[:n] = _paged(q[:n], kv, meta, scale, sliding_window, softcap, sinks)
    prefill = (_flash_prefill if _flash_runs(kv, softcap, sinks) else
               _prefill_invariant if meta.split_by_origin else _prefill)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.length)
        out[rows] = prefill(q[rows], kv, span, scale, sliding_window, meta.block_size, softcap, sinks)
    return out


def _paged(q, kv: LayerKV, meta: AttentionMetadata, scale, sliding_window, softcap, sinks=None):
    out = _C.paged_attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, kv.k_offset, kv.v_offset, meta.block_tables,
                             meta.query_start, meta.context_lens, meta.block_size, scale, sliding_window or 0,
                             softcap or 0.0, sinks)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def _with_sink(q, k, v, sinks: torch.Tensor, scale: float, shift: torch.Tensor | None = None):
    """The sink as one more key, first, for SDPA: q [1, heads, L, D], k and v [1, kv_heads, ctx, D] ->
    q' [1, heads, L, D + 2] = [q, hi, lo] where hi + lo = sink / scale (lo what q's dtype rounds off hi:
    a bfloat16 query keeps the sink to float32's precision), k' [1, kv_heads, ctx + 1, D + 2] with the
    sink's key (0, ..., 0, 1, 1) first and the others' extra channels 0, v' likewise with a zero row
    first (one head size for all three, as the flash kernel wants) and its last extra channel 1 for the
    real keys: the output's last channel is the real keys' share of the weights, which V's offset is
    scaled by (`_output`). So every real score is q . k exactly (plus 0) and the sink's is the head's own
    logit, whichever KV head it shares; its value adds nothing. The mask gets a leading column that is
    always true (`_sink_column`). `shift` [1, heads, L, 1]: q . k_offset, what quantized pages' offsets
    (left out of k) add to each real score, taken from the sink's instead, so that the two still differ
    by what they should."""
    logit = (sinks.to(torch.float32) / scale).view(1, -1, 1, 1).expand(*q.shape[:3], 1)  # [1, heads, L, 1]
    if shift is not None:
        logit = logit - shift
    hi = logit.to(q.dtype)
    lo = (logit - hi.float()).to(q.dtype)
    extra = torch.cat([hi, lo], dim=-1)  # [1, heads, L, 2]
    q = torch.cat([q, extra], dim=-1)
    k = F.pad(F.pad(k, (0, 2)), (0, 0, 1, 0))  # [1, kv_heads, ctx + 1, D + 2]
    k[:, :, 0, -2:] = 1
    v = F.pad(v, (0, 2, 1, 0))  # [1, kv_heads, ctx + 1, D + 2]
    v[:, :, 1:, -1] = 1
    return q, k, v


def _output(out: torch.Tensor, kv: LayerKV, heads: int) -> torch.Tensor:
    """[L, heads, D (+ 2 with a sink)] -> [L, heads, D]: V's offset added (the weights sum to 1, or with a
    sink to the real keys' share, its output's last channel), a sink's channels dropped."""
    d = kv.v.shape[-1]
    if kv.v_offset is None:
        return out[..., :d]
    share = out[..., -1:].float() if out.shape[-1] > d else 1.0
    return out[..., :d].float() + share * _per_query_head(kv.v_offset, heads)


def _sink_column(mask: torch.Tensor) -> torch.Tensor:
    """[L, K] -> [L, 1 + K]: every query sees the sink."""
    return torch.cat([torch.ones_like(mask[:, :1]), mask], dim=1)


def _slots(block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block ids -> the slot ids they cover: [..., blocks] -> [..., blocks * block_size]."""
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table[..., None] * block_size + offsets).flatten(-2)


def _gathered(pages: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """[kv_heads, ctx, head_dim] of one sequence's context; quantized pages as page * scale in bfloat16
    (this sequence's context only, never a float copy of the cache), their offsets left out."""
    x = pages[:, slots]
    if scales is None:
        return x
    return (x.float() * scales[:, slots, None]).to(torch.bfloat16)


def _per_query_head(offset: torch.Tensor, heads: int) -> torch.Tensor:
    """[kv_heads, head_dim] -> [heads, head_dim]: each query head's KV head's offset."""
    return offset.repeat_interleave(heads // offset.shape[0], dim=0)


def _flash_runs(kv: LayerKV, softcap, sinks) -> bool:
    """Whether prefill spans go to our flash kernel (csrc/flash_prefill.cpp): bfloat16 pages without
    scales, a head size of 32, 64, .. 256, no soft cap or sinks, a CPU it runs on without AMX (there
    SDPA's bfloat16 kernel has AMX's tiles, and ours was not measured beside it). Facts of the model
    and the machine, never of the chunk, so a prompt token's path (and bits) do not depend on how it
    was chunked; the kernel computes each query alike in any chunk, so it serves batch-invariant mode
    as it is. `WALLBREAKER_FLASH_PREFILL=0` turns it off (SDPA, the A of an A/B), `=1` on wherever the
    CPU runs it."""
    from ..kernels import _amx
    wanted = os.environ.get("WALLBREAKER_FLASH_PREFILL", "")
    return (wanted != "0" and kv.k.dtype == torch.bfloat16 and kv.k_scale is None and kv.k.shape[-1] % 32 == 0
            and kv.k.shape[-1] <= 256 and softcap is None and sinks is None and _C.flash_prefill_supported()
            and (wanted == "1" or not _amx()))


def _flash_prefill(q, kv: LayerKV, span: PrefillSpan, scale, sliding_window, block_size: int, softcap=None,
                   sinks=None):
    """The span's attention by `_C.flash_prefill`, each query given the keys it sees as one range:
    up to itself, to the end of its image block (`bidirectional`), from its sliding window's start."""
    ctx, length = span.context_len, span.length
    slots = _slots(span.block_table[: -(-ctx // block_size)], block_size)[:ctx].long()
    pos = torch.arange(ctx - length, ctx)
    last = pos.clone()
    for start, end in span.bidirectional:
        last = torch.where((pos >= start) & (pos < end), pos.clamp(min=min(end, ctx) - 1), last)
    first = (pos - sliding_window + 1).clamp(min=0) if sliding_window else torch.zeros_like(pos)
    return _output(_C.flash_prefill(q, kv.k, kv.v, slots, first, last, scale), kv, q.shape[1])


def _prefill(q, kv: LayerKV, span: PrefillSpan, scale, sliding_window, block_size: int, softcap=None, sinks=None):
    """Offsets are added exactly, not rounded into bfloat16 rows (Qwen2.5's K bias of 354 would be
    rounded by up to 1): K's adds q . k_offset to all of a query's scores, which the softmax cancels
    (the soft cap does not: there it is added to the scores), and V's adds v_offset to the output,
    the weights summing to 1."""
    slots = _slots(span.block_table[: -(-span.context_len // block_size)], block_size)[: span.context_len]
    k = _gathered(kv.k, kv.k_scale, slots)[None]  # [1, kv_heads, ctx, head_dim]
    v = _gathered(kv.v, kv.v_scale, slots)[None]
    heads = q.shape[1]
    shift = None  # [1, heads, L, 1]: q . k_offset, from the float32 queries
    if (softcap is not None or sinks is not None) and kv.k_offset is not None:
        shift = (q * _per_query_head(kv.k_offset, heads)).sum(-1).T[None, :, :, None]
    q = q.transpose(0, 1)[None].to(k.dtype)  # [1, heads, L, head_dim]
    fresh = span.context_len == span.length
    if sinks is not None:
        q, k, v = _with_sink(q, k, v, sinks, scale, shift)
    if softcap is None and sinks is None and fresh and not span.bidirectional and (
            sliding_window is None or span.context_len <= sliding_window):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos = torch.arange(span.context_len - span.length, span.context_len, device=q.device)[:, None]
        key_pos = torch.arange(span.context_len, device=q.device)[None, :]
        mask = _causal(query_pos, key_pos, span.bidirectional)  # [L, ctx]
        if sliding_window is not None:
            mask &= (query_pos - key_pos) < sliding_window
        if sinks is not None:
            mask = _sink_column(mask)
        if softcap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            out = _softcapped(q, k, v, mask, scale, softcap, shift)
    return _output(out[0].transpose(0, 1), kv, heads)


def _prefill_invariant(q, kv: LayerKV, span: PrefillSpan, scale, sliding_window, block_size: int, softcap=None,
                       sinks=None):
    """`_prefill` with every SDPA call of one shape: INVARIANT_QUERIES queries, the keys padded to a
    multiple of INVARIANT_KEYS, an explicit mask (never `is_causal`, whose kernel skips blocks), so that
    a query's bits do not depend on the span's length or its cached prefix. A sink is the first key
    (`_with_sink`), at the same place in every call."""
    ctx, length, heads = span.context_len, span.length, q.shape[1]
    slots = _slots(span.block_table[: -(-ctx // block_size)], block_size)[:ctx]
    sink = int(sinks is not None)
    keys = -(-(ctx + sink) // INVARIANT_KEYS) * INVARIANT_KEYS
    k = F.pad(_gathered(kv.k, kv.k_scale, slots), (0, 0, 0, keys - ctx - sink))[None]  # [1, kv_heads, keys, head_dim]
    v = F.pad(_gathered(kv.v, kv.v_scale, slots), (0, 0, 0, keys - ctx - sink))[None]
    rows = -(-length // INVARIANT_QUERIES) * INVARIANT_QUERIES
    shift = None  # [1, heads, rows, 1]: q . k_offset, from the float32 queries
    if (softcap is not None or sinks is not None) and kv.k_offset is not None:
        shift = F.pad((q * _per_query_head(kv.k_offset, heads)).sum(-1).T, (0, rows - length))[None, :, :, None]
    q = F.pad(q.transpose(0, 1).to(k.dtype), (0, 0, 0, rows - length))[None]  # [1, heads, rows, head_dim]
    if sinks is not None:
        q, k, v = _with_sink(q, k, v, sinks, scale, shift)
    query_pos = torch.arange(ctx - length, ctx - length + rows, device=q.device).clamp(max=ctx - 1)[:, None]
    key_pos = torch.arange(keys - sink, device=q.device)[None, :]
    mask = _causal(query_pos, key_pos, span.bidirectional)  # [rows, keys - sink]
    if sliding_window is not None:
        mask &= (query_pos - key_pos) < sliding_window
    if sinks is not None:
        mask = _sink_column(mask)  # [rows, keys]
    parts = []
    for r in range(0, rows, INVARIANT_QUERIES):
        sub = slice(r, r + INVARIANT_QUERIES)
        if softcap is None:
            # SDPA over the key blocks up to the last key the call's queries see (its last query's, or
            # an image's end): the blocks past it are wholly masked, so leaving them out changes no
            # bits (as a shorter cached context does)
            seen = int(mask[sub].any(0).nonzero()[-1]) + 1
            reach = -(-seen // INVARIANT_KEYS) * INVARIANT_KEYS
            with _sdpa_backend():
                parts.append(F.scaled_dot_product_attention(q[:, :, sub], k[:, :, :reach], v[:, :, :reach],
                                                            attn_mask=mask[sub, :reach], scale=scale, enable_gqa=True))
        else:
            parts.append(_softcapped(q[:, :, sub], k, v, mask[sub], scale, softcap,
                                     None if shift is None else shift[:, :, sub]))
    return _output(torch.cat(parts, dim=2)[0, :, :length].transpose(0, 1), kv, heads)


def _causal(query_pos: torch.Tensor, key_pos: torch.Tensor, blocks: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """[L, 1] and [1, K] positions -> [L, K]: each query sees the keys up to its own position, and
    within a bidirectional block all of the block (transformers' causal mask OR'd with its
    `blockwise_overlay`; a sliding window then cuts both, as in its `create_masks_for_vision_model`)."""
    mask = key_pos <= query_pos
    for start, end in blocks:
        mask |= (query_pos >= start) & (query_pos < end) & (key_pos >= start) & (key_pos < end)
    return mask


_math_sdpa: bool | None = None


def _sdpa_backend():
    """PyTorch's math SDPA where ATen is capped below AVX-512 (ATEN_CPU_CAPABILITY=avx2) on a CPU with
    AMX: its bfloat16 flash kernel, given a mask, packs by the CPU's features and then refuses the
    capped level ("pack_vnni2 is only supported when avx512 is supported"). Elsewhere, the default."""
    global _math_sdpa
    if _math_sdpa is None:
        from ..kernels import _amx
        _math_sdpa = _amx() and torch.backends.cpu.get_cpu_capability() != "AVX512"
    return sdpa_kernel(SDPBackend.MATH) if _math_sdpa else contextlib.nullcontext()


def _softcapped(q, k, v, mask, scale: float, softcap: float, shift: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with the scores soft-capped (SDPA has no such step): [1, heads, L, head_dim]. `shift`
    [1, heads, L, 1]: what each query adds to all its scores (q . k_offset), before the cap."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [1, heads, ctx, head_dim]
    scores = torch.matmul(q, k.transpose(-1, -2)).float()  # [1, heads, L, ctx]
    if shift is not None:
        scores += shift
    scores = torch.tanh(scores * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(weights, v)
