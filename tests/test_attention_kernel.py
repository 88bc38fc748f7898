"""The paged attention kernel against a dense reference: softmax(q·Kᵀ)·V in float64 over each
query's visible keys, gathered through the block table, for every KV page dtype and kernel level."""
from __future__ import annotations

import pytest
import torch

from wallbreaker import _C, kernels

LEVELS = [level for level in kernels.LEVELS if kernels.LEVELS.index(level) <= kernels.LEVELS.index(kernels.cpu_isa())]


@pytest.fixture(params=LEVELS)
def level(request):
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(None)


def reference(q, k, v, tables, query_start, lens, block_size, scale, window=0, softcap=0.0, sinks=None):
    """float64: query i of sequence n (position p = len - nq + i) sees keys max(0, p - window + 1)..p;
    `sinks` [H]: one more score per head, of a zero value (gpt-oss's attention sinks)."""
    T, H, D = q.shape
    G = H // k.shape[0]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for n, L in enumerate(lens.tolist()):
        q0, q1 = query_start[n].item(), query_start[n + 1].item()
        slots = torch.tensor([tables[n, p // block_size].item() * block_size + p % block_size for p in range(L)])
        K, V = k[:, slots].double(), v[:, slots].double()
        for i in range(q1 - q0):
            p = L - (q1 - q0) + i
            lo = max(0, p - window + 1) if window else 0
            for h in range(H):
                s = K[h // G, lo:p + 1] @ q[q0 + i, h].double() * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                if sinks is not None:
                    s = torch.cat([s, sinks[h:h + 1].double()])
                w = s.softmax(0)
                out[q0 + i, h] = w[:p + 1 - lo] @ V[h // G, lo:p + 1]
    return out


def paged_case(H=8, KVH=2, D=32, lens=(37, 1, 70, 16), queries=(1, 1, 3, 16), block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-L // block_size) for L in lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)  # blocks scattered over the pool
    tables = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32)
    used = 0
    for n, nb in enumerate(blocks_per_seq):
        tables[n, :nb] = perm[used:used + nb]
        used += nb
    query_start = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    k = torch.randn(KVH, num_blocks * block_size, D, generator=g)
    v = torch.randn(KVH, num_blocks * block_size, D, generator=g)
    q = torch.randn(int(query_start[-1]), H, D, generator=g)
    return q, k, v, tables, query_start, torch.tensor(lens, dtype=torch.int32), block_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (20, 0.0), (0, 30.0)])
@pytest.mark.parametrize("heads", [(8, 2, 32), (9, 3, 64), (4, 4, 16), (12, 1, 8)])
def test_paged_attention_matches_dense_attention(level, dtype, window, softcap, heads):
    q, k, v, tables, qs, lens, bs = paged_case(*heads)
    k, v = k.to(dtype), v.to(dtype)  # the reference reads the same rounded pages
    scale = heads[2] ** -0.5
    got = _C.paged_attention(q, k, v, None, None, None, None, tables, qs, lens, bs, scale, window, softcap)
    want = reference(q, k.float(), v.float(), tables, qs, lens, bs, scale, window, softcap)
    # float32 accumulation over at most 70 keys of unit-variance products: well under 1e-5
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("heads", [(8, 2, 32), (9, 3, 64), (4, 4, 16)])
def test_sinks_join_the_softmax_as_a_key_of_zero_value(level, dtype, window, heads):
    """gpt-oss's sinks: some far above every score (the sink takes nearly all the weight), some far
    below (none), some among them."""
    q, k, v, tables, qs, lens, bs = paged_case(*heads)
    k, v = k.to(dtype), v.to(dtype)
    scale = heads[2] ** -0.5
    sinks = torch.linspace(-30.0, 30.0, heads[0])
    got = _C.paged_attention(q, k, v, None, None, None, None, tables, qs, lens, bs, scale, window, 0.0, sinks)
    want = reference(q, k.float(), v.float(), tables, qs, lens, bs, scale, window, sinks=sinks)
    assert (got.double() - want).abs().max() < 1e-5
    plain = _C.paged_attention(q, k, v, None, None, None, None, tables, qs, lens, bs, scale, window, 0.0)
    assert (plain.double() - want).abs().max() > 0.1  # the sinks changed the output


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_int8_and_fp8_pages_equal_attention_over_their_dequantized_pages(level, kind, offsets, softcap):
    """A row stands for page * scale + offset: the kernel adds the offset's share (q . k_offset to every
    score, v_offset to the output) without forming that row."""
    q, k, v, tables, qs, lens, bs = paged_case(9, 3, 64)
    g = torch.Generator().manual_seed(1)
    k_off, v_off = (3 * torch.randn(3, 64, generator=g) for _ in range(2)) if offsets else (None, None)
    k_scale, v_scale = k.abs().amax(-1) / 127, v.abs().amax(-1) / 127  # [KVH, S]: per token and head
    if kind == "int8":
        kq, vq = (torch.round(x / s[..., None]).to(torch.int8) for x, s in ((k, k_scale), (v, v_scale)))
    else:
        k_scale, v_scale = k_scale * 127 / 448, v_scale * 127 / 448
        kq, vq = ((x / s[..., None]).to(torch.float8_e4m3fn) for x, s in ((k, k_scale), (v, v_scale)))

    def dequantized(pages, scale, offset):
        x = pages.float() * scale[..., None]
        return x if offset is None else x + offset[:, None]

    got = _C.paged_attention(q, kq, vq, k_scale, v_scale, k_off, v_off, tables, qs, lens, bs, 0.125, 0, softcap)
    want = reference(q, dequantized(kq, k_scale, k_off), dequantized(vq, v_scale, v_off), tables, qs, lens, bs, 0.125,
                     softcap=softcap)
    assert (got.double() - want).abs().max() < 2e-5


@pytest.mark.parametrize("nq", [5, 37])
@pytest.mark.parametrize("pages", ["bfloat16", "int8"])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (20, 0.0), (0, 30.0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_query_of_a_span_is_computed_as_a_decode_at_its_position(level, nq, pages, window, softcap, threads):
    """Verifying K drafts, or a prefill chunk, in one call gives, row for row, what one decode step
    at each position gives, bit for bit: the queries that share a pass over the rows (blocks of 8,
    split over the threads) each get their own arithmetic."""
    q, k, v, tables, _, lens, bs = paged_case(9, 3, 64, lens=(60,), queries=(nq,))
    scales, offsets = (None, None), (None, None)
    if pages == "int8":
        scales = k.abs().amax(-1) / 127, v.abs().amax(-1) / 127
        k, v = (torch.round(x / s[..., None]).to(torch.int8) for x, s in zip((k, v), scales))
        offsets = torch.randn(3, 64), torch.randn(3, 64)
    else:
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)

    def attend(rows: slice, length) -> torch.Tensor:
        n = rows.stop - rows.start
        return _C.paged_attention(q[rows], k, v, *scales, *offsets, tables, torch.tensor([0, n], dtype=torch.int32),
                                  length, bs, 0.2, window, softcap)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = attend(slice(0, nq), lens)
        for i in range(nq):
            assert torch.equal(attend(slice(i, i + 1), lens - nq + 1 + i)[0], together[i]), i
    finally:
        torch.set_num_threads(before)


def test_bad_arguments_are_refused():
    q, k, v, tables, qs, lens, bs = paged_case()
    with pytest.raises(RuntimeError, match="scales"):
        _C.paged_attention(q, k.to(torch.int8), v.to(torch.int8), None, None, None, None, tables, qs, lens, bs, 1.0, 0, 0.0)
    offset = torch.zeros(k.shape[0], k.shape[2])
    with pytest.raises(RuntimeError, match="offsets"):  # a float page has no zero point
        _C.paged_attention(q, k, v, None, None, offset, offset, tables, qs, lens, bs, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="int32"):
        _C.paged_attention(q, k, v, None, None, None, None, tables.long(), qs, lens, bs, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="sinks"):  # one per query head
        _C.paged_attention(q, k, v, None, None, None, None, tables, qs, lens, bs, 1.0, 0, 0.0, torch.zeros(q.shape[1] - 1))
