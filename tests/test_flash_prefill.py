"""Our flash kernel for prompt chunks (`_C.flash_prefill`, csrc/flash_prefill.cpp) against a float64
softmax attention over the same bfloat16 queries, keys and values, for causal chunks after a cached
prefix, sliding windows and image blocks (each query's keys one range), grouped and plain heads and
several head sizes; a query's bits in any chunk and on any number of threads; the layer's choice of
it; and bad arguments. Skipped where the kernel does not run (no AVX-512 BF16)."""
from __future__ import annotations

import pytest
import torch

from wallbreaker import _C
from wallbreaker.layers.attention import LayerKV, PrefillSpan, _flash_prefill, _flash_runs, _prefill

pytestmark = pytest.mark.skipif(not _C.flash_prefill_supported(), reason="needs the avx512 level with AVX-512 BF16")


def pages(kv_heads: int, slots: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(kv_heads, slots, dim, generator=gen).to(torch.bfloat16),
            torch.randn(kv_heads, slots, dim, generator=gen).to(torch.bfloat16))


def reference(q, k, v, slots, first, last, scale) -> torch.Tensor:
    """[L, H, D] float64: softmax attention of the bfloat16-rounded queries over each query's keys."""
    heads, kv_heads = q.shape[1], k.shape[0]
    kk = k[:, slots].double().repeat_interleave(heads // kv_heads, 0)  # [H, ctx, D]
    vv = v[:, slots].double().repeat_interleave(heads // kv_heads, 0)
    qq = q.to(torch.bfloat16).double().transpose(0, 1)  # [H, L, D]
    scores = qq @ kk.transpose(1, 2) * scale  # [H, L, ctx]
    key = torch.arange(len(slots))
    seen = (key[None] >= first[:, None]) & (key[None] <= last[:, None])
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1)
    return (weights @ vv).transpose(0, 1)


def check(q, k, v, slots, first, last, scale=0.125):
    out = _C.flash_prefill(q, k, v, slots, first, last, scale)
    ref = reference(q, k, v, slots, first, last, scale)
    # the weights meet V in bfloat16 (as SDPA's bfloat16 path): each output moves by at most 2^-8 of
    # the largest |v| it averages
    bound = 2.0 ** -8 * v.abs().max().double() + 1e-6
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out.double() - ref).abs().max() <= bound


@pytest.mark.parametrize("heads, kv_heads, dim", [(12, 2, 128), (4, 4, 64), (6, 3, 96), (2, 1, 256)])
def test_a_causal_chunk_after_a_cached_prefix(heads, kv_heads, dim):
    k, v = pages(kv_heads, 600, dim, seed=dim)
    gen = torch.Generator().manual_seed(heads)
    for ctx, length in ((1, 1), (45, 45), (300, 77), (517, 9)):
        slots = torch.randperm(600, generator=gen)[:ctx]
        q = torch.randn(length, heads, dim, generator=gen) * 2
        last = torch.arange(ctx - length, ctx)
        check(q, k, v, slots, torch.zeros_like(last), last)


def test_sliding_windows_and_image_blocks():
    """Any range of keys a query sees: from a window's start, to the end of its image block."""
    k, v = pages(2, 400, 64, seed=1)
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(400, generator=gen)[:300]
    q = torch.randn(100, 8, 64, generator=gen)
    pos = torch.arange(200, 300)
    check(q, k, v, slots, (pos - 50 + 1).clamp(min=0), pos)  # a window of 50
    last = torch.where((pos >= 220) & (pos < 260), torch.full_like(pos, 259), pos)  # an image at 220..259
    check(q, k, v, slots, torch.zeros_like(pos), last)


def test_a_query_gets_the_same_bits_in_any_chunk_and_on_any_threads():
    k, v = pages(2, 700, 128, seed=3)
    gen = torch.Generator().manual_seed(4)
    slots = torch.randperm(700, generator=gen)[:650]
    q = torch.randn(650, 12, 128, generator=gen)
    pos = torch.arange(650)
    whole = _C.flash_prefill(q, k, v, slots, torch.zeros_like(pos), pos, 0.1)
    for start, end in ((0, 1), (17, 18), (100, 163), (640, 650)):  # chunks, each with its cached prefix
        part = _C.flash_prefill(q[start:end], k, v, slots[:end], torch.zeros(end - start, dtype=torch.long),
                                pos[start:end], 0.1)
        assert torch.equal(part, whole[start:end]), (start, end)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_C.flash_prefill(q, k, v, slots, torch.zeros_like(pos), pos, 0.1), whole)
    finally:
        torch.set_num_threads(threads)


def test_the_layer_takes_it_for_bfloat16_pages_and_matches_sdpa(monkeypatch):
    """`_flash_runs` picks the kernel for plain bfloat16 pages of a head size it takes (switched on: the
    default without AMX), not with a soft cap, sinks, scales, or where switched off; its span output is
    SDPA's within the rounding above."""
    k, v = pages(2, 64, 64, seed=5)
    kv = LayerKV(k, v, None, None, None, None)
    monkeypatch.setenv("WALLBREAKER_FLASH_PREFILL", "1")  # also on a CPU with AMX, where the default is SDPA
    assert _flash_runs(kv, None, None)
    assert not _flash_runs(kv, 50.0, None) and not _flash_runs(kv, None, torch.zeros(4))
    assert not _flash_runs(LayerKV(k[..., :48].contiguous(), v[..., :48].contiguous(), None, None, None, None), None, None)
    monkeypatch.setenv("WALLBREAKER_FLASH_PREFILL", "0")
    assert not _flash_runs(kv, None, None)
    span = PrefillSpan(start=0, length=20, context_len=40, block_table=torch.tensor([3, 0, 2], dtype=torch.int32))
    q = torch.randn(20, 4, 64, generator=torch.Generator().manual_seed(6))
    ours = _flash_prefill(q, kv, span, 0.125, None, 16)
    sdpa = _prefill(q, kv, span, 0.125, None, 16).float()
    assert (ours - sdpa).abs().max() <= 2.0 ** -7 * v.abs().max()


def test_bad_arguments_are_clear_errors():
    k, v = pages(1, 8, 64, seed=7)
    q, slots, pos = torch.randn(2, 1, 64), torch.arange(4), torch.tensor([2, 3])
    with pytest.raises(RuntimeError, match="key ranges"):
        _C.flash_prefill(q, k, v, slots, torch.zeros(2, dtype=torch.long), torch.tensor([2, 4]), 0.1)
    with pytest.raises(RuntimeError, match="slot out of range"):
        _C.flash_prefill(q, k, v, torch.tensor([0, 1, 2, 9]), torch.zeros(2, dtype=torch.long), pos, 0.1)
    with pytest.raises(RuntimeError, match="bfloat16"):
        _C.flash_prefill(q, k.float(), v.float(), slots, torch.zeros(2, dtype=torch.long), pos, 0.1)
    with pytest.raises(RuntimeError, match="head shapes"):
        _C.flash_prefill(torch.randn(2, 1, 48), k[..., :48].contiguous(), v[..., :48].contiguous(), slots,
                         torch.zeros(2, dtype=torch.long), pos, 0.1)
