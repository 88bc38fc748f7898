"""The prompt tiles (`qmatmul(..., prompt=True)`, csrc/prefill_avx512.inc, prefill_avx2.inc) against
gguf's own dequantization and a float64 matmul, with the bound of tests/test_kernels.py (they quantize
the activations as the row tiles do); a prompt row's bits in any call and on any number of threads; and
`QuantLinear` giving prompt rows these tiles and generated rows the row tiles. At a level without
prompt tiles the flag runs the row tiles, which these tests check the same way."""
from __future__ import annotations

import gguf
import pytest
import torch
from test_kernels import FORMATS, LEVELS, check, level, random_blocks  # noqa: F401 (level: a fixture)

from wallbreaker import kernels
from wallbreaker.formats.dequant import block_info
from wallbreaker.layers.linear import PromptRows, QuantLinear

T = gguf.GGMLQuantizationType


def packed(qtype: T, n: int, k: int, seed: int):
    raw = random_blocks(qtype, n, k, seed=seed)
    return raw, kernels.pack_rows(torch.from_numpy(raw), qtype)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_prompt_tiles_match_gguf_dequantization(level, qtype):
    """Weight rows that fill two 16-row groups and leave a short one (50, 37, 13), row lengths with a
    short last group of 32-blocks and with several decoded chunks and K panels, and activation row
    counts that leave a tail after the 4-row tiles."""
    size = block_info(qtype)[0]
    gen = torch.Generator().manual_seed(int(qtype))
    for n, blocks, m in ((50, 81 if size == 32 else 10, 160), (37, 19 if size == 32 else 2, 7), (13, 1, 1)):
        k = blocks * size
        raw, w = packed(qtype, n, k, seed=n + int(qtype))
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        x[:, :size] = 0  # a block of zeros keeps d_x = 0 honest
        check(qtype, x, raw, kernels.qmatmul(x, [w], [qtype], prompt=True))


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_a_prompt_row_gets_the_same_bits_in_any_call(level, qtype):
    """A row alone, among 2..37 rows, and on 1 or 2 threads: the same bits, so a prompt's KV does not
    depend on how the scheduler chunked or batched it."""
    k = 2048 if qtype.name.endswith("_K") else 1088
    _, w = packed(qtype, 70, k, seed=80 + int(qtype))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(int(qtype))) * 3
    alone = torch.cat([kernels.qmatmul(x[i:i + 1], [w], [qtype], prompt=True) for i in range(37)])
    for m in (2, 5, 9, 37):
        assert torch.equal(kernels.qmatmul(x[:m], [w], [qtype], prompt=True), alone[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.qmatmul(x, [w], [qtype], prompt=True), alone)
    finally:
        torch.set_num_threads(threads)


def test_quant_linear_gives_prompt_rows_the_prompt_tiles(monkeypatch):
    """Batch-invariant mode: rows before `PromptRows.start` get the row tiles' bits, the rest the
    prompt tiles' (where the dense path does not run here); without the mode, a call of
    PROMPT_MIN_ROWS rows or more takes the prompt tiles."""
    monkeypatch.setattr(kernels, "dense_path", lambda: False)
    qtype, k = T.Q4_K, 512
    _, w = packed(qtype, 48, k, seed=5)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(5))
    layer = QuantLinear([(w, int(qtype))], k)
    layer.batch_invariant, layer.prompt_rows = True, PromptRows()
    layer.prompt_rows.start = 3
    y = layer(x)
    assert torch.equal(y[:3], kernels.qmatmul(x[:3], [w], [qtype]))
    assert torch.equal(y[3:], kernels.qmatmul(x[3:], [w], [qtype], prompt=True))
    layer.batch_invariant = False
    assert torch.equal(layer(x), kernels.qmatmul(x, [w], [qtype], prompt=True))
    assert torch.equal(layer(x[:kernels.PROMPT_MIN_ROWS - 1]), kernels.qmatmul(x[:kernels.PROMPT_MIN_ROWS - 1], [w], [qtype]))
