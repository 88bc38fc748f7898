"""Our quantized matmul kernels (wallbreaker.kernels, csrc/) against gguf's own dequantization and a
float64 matmul, for every format, at every kernel level this CPU has, for decode-sized and
prefill-sized batches; the level switch; and the `auto` model against the float32 path.

The tolerance is that of the one rounding the kernels add: activations are rounded to 8 bits per
block (d_x = amax/127 over each block of 32, or of 256 for the K-quants), so each x_k moves by at
most d_x/2 and each output by at most sum over blocks of (d_x/2)·sum|w| of the block; everything
else is integer arithmetic or float32 steps, whose rounding is covered by a slack of 2^-17 of
sum|w||x| (float32 epsilon times the ~64 float operations per output at most).
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from test_dequant import F16_FIELDS

from wallbreaker import LLM, kernels
from wallbreaker.formats.dequant import block_info
from wallbreaker.kernels.blocks import q4_1_blocks, q5_0_exact_blocks, q8_0_blocks
from wallbreaker.layers.linear import QuantLinear, module_bytes
from wallbreaker.formats.grid import QuantizedTensor

T = gguf.GGMLQuantizationType
FORMATS = sorted(kernels.SUPPORTED_TYPES)  # every row of the kernels' format table (csrc/qformats.h)
LEVELS = kernels.LEVELS[: kernels.LEVELS.index(kernels.cpu_isa()) + 1]  # every level this CPU runs
ROWS = [1, 3, 16, 160]  # decode, a few sequences, a tile's worth, a prefill chunk


@pytest.fixture
def level(request):
    before = kernels.isa()
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(before)


def random_blocks(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    """[n, row bytes] valid blocks: gguf's quantization of random floats where it has one, else
    random bytes with float16 scale fields of sane size (positive and negative)."""
    rng = np.random.default_rng(seed)
    try:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    except NotImplementedError:
        block, size = block_info(qtype)
        raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
        blocks = raw.reshape(-1, size)
        for off in F16_FIELDS[qtype]:
            half = (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16)
            blocks[:, off:off + 2] = half.view(np.uint8).reshape(-1, 2)
        return raw


def knob_settings(qtype: T) -> list[tuple[str, int]]:
    """Every (knob, value) kernels/tuning.py may set for qtype at the level in use (it chooses among
    them on each host): every one is checked, so the tuner can only pick a tested kernel."""
    if not kernels._C.tuning(int(qtype), "rows"):
        return []
    return [(knob, v) for knob in kernels._C.tuning_knobs() for v in kernels._C.tuning_choices(knob)]


@contextmanager
def knob(qtype: T, name: str | None = None, value: int = 0):
    """qtype's knob `name` set to `value` within (none: the defaults)."""
    if name:
        kernels._C.set_tuning(int(qtype), name, value)
    try:
        yield
    finally:
        if name:
            kernels._C.set_tuning(int(qtype), name, 0)


def activation_bound(x: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    """[M, N] the bound of the docstring, from the data (float64)."""
    m, k = x.shape
    xb = x.double().view(m, k // block, block)
    dx = xb.abs().amax(-1) / 127  # [M, blocks]
    wabs = w.double().abs().view(w.shape[0], k // block, block).sum(-1)  # [N, blocks]
    rounding = (dx / 2) @ wabs.T
    slack = (x.double().abs() @ w.double().abs().T) * 2.0 ** -17
    return rounding + slack


def check(qtype: T, x: torch.Tensor, raw: np.ndarray, y: torch.Tensor) -> None:
    w = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype))).reshape(raw.shape[0], x.shape[1])
    exact = x.double() @ w.double().T
    err = (y.double() - exact).abs()
    bound = activation_bound(x.float(), w, block_info(qtype)[0])
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert (err <= bound).all(), f"worst error / bound: {(err / bound).max().item():.3f}"


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_kernel_matches_gguf_dequantization(level, qtype):
    k = 512 if qtype.name.endswith("_K") else 608  # 19 blocks of 32: an odd count, a short last group
    raw = random_blocks(qtype, 37, k, seed=int(qtype))  # 37 rows: tiles of 4 and 2 with a tail
    w = kernels.pack_rows(torch.from_numpy(raw), qtype)
    gen = torch.Generator().manual_seed(int(qtype))
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        x[:, 40:44] = 0  # a block of zeros somewhere keeps d_x = 0 honest
        default = kernels.qmatmul(x, [w], [qtype])
        check(qtype, x, raw, default)
        for setting in knob_settings(qtype):  # each choice the tuner may make: the same bits
            with knob(qtype, *setting):
                assert torch.equal(kernels.qmatmul(x, [w], [qtype]), default), (m, setting)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_a_long_row_at_batch_1(level, qtype):
    """Rows past 4096 values, which batch 1 tiles by a knob of their own (`rows_m1_long`)."""
    k = 4352  # 17 blocks of 256, 136 of 32
    raw = random_blocks(qtype, 11, k, seed=60 + int(qtype))
    w = kernels.pack_rows(torch.from_numpy(raw), qtype)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(int(qtype))) * 2
    default = kernels.qmatmul(x, [w], [qtype])
    check(qtype, x, raw, default)
    for setting in knob_settings(qtype):
        with knob(qtype, *setting):
            assert torch.equal(kernels.qmatmul(x, [w], [qtype]), default), setting


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_every_row_length_and_tile_tail(level, qtype):
    """Row lengths that end in each kind of short group (the 32-block layout and activations go
    in groups of 4 blocks, the kernels in windows of 8 or 16 blocks) and row counts that leave a
    tail after the 4-row and 2-row tiles, at 1, 2, 5 and 9 activation rows."""
    blocks = [1, 3] if qtype.name.endswith("_K") else [1, 2, 3, 5, 16, 17, 33]
    size = block_info(qtype)[0]
    gen = torch.Generator().manual_seed(7 + int(qtype))
    for nb in blocks:
        k = nb * size
        raw = random_blocks(qtype, 13, k, seed=nb)
        w = kernels.pack_rows(torch.from_numpy(raw), qtype)
        for m in (1, 2, 5, 9):
            x = torch.randn(m, k, generator=gen) * 3
            check(qtype, x, raw, kernels.qmatmul(x, [w], [qtype]))


@pytest.mark.parametrize("level", LEVELS, indirect=True)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_whatever_else_is_in_the_call(level, qtype):
    """Batch invariance: each activation row's outputs are the same bits alone as among 2..9 rows
    (the tiles of 4 rows, the 5-row pass of a verification, the tails), so that speculative
    verification and continuous batching never change a greedy token."""
    k = 512 if qtype.name.endswith("_K") else 608
    raw = random_blocks(qtype, 21, k, seed=40 + int(qtype))
    w = kernels.pack_rows(torch.from_numpy(raw), qtype)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(int(qtype))) * 3
    alone = torch.cat([kernels.qmatmul(x[i:i + 1], [w], [qtype]) for i in range(9)])
    for setting in [()] + knob_settings(qtype):
        with knob(qtype, *setting):
            for m in range(2, 10):
                assert torch.equal(kernels.qmatmul(x[:m], [w], [qtype]), alone[:m]), (m, setting)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_a_format_without_tiles_at_a_level_runs_the_generic_kernel(level):
    """A format whose level lacks tiles (a new row of the table) takes the generic level's kernel,
    beside segments that keep the level's own, in one call: the generic level's exact result."""
    qtypes = [T.Q4_K, T.Q5_0, T.Q8_0]
    raws = [random_blocks(q, 9, 512, seed=20 + i) for i, q in enumerate(qtypes)]
    ws = [kernels.pack_rows(torch.from_numpy(r), q) for r, q in zip(raws, qtypes)]
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(5)) * 2
    kernels.set_isa("generic")
    generic = [kernels.qmatmul(x, [w], [q]) for w, q in zip(ws, qtypes)]
    kernels.set_isa(level)
    own = kernels.qmatmul(x, ws[:1], qtypes[:1])
    try:
        kernels._C.set_generic_formats([int(T.Q5_0), int(T.Q8_0)])
        y = kernels.qmatmul(x, ws, qtypes)
    finally:
        kernels._C.set_generic_formats([])
    assert torch.equal(y[:, :9], own)  # the level's own kernel where it has one
    assert torch.equal(y[:, 9:18], generic[1]) and torch.equal(y[:, 18:], generic[2])
    for raw, q, part in zip(raws, qtypes, y.split(9, dim=1)):
        check(q, x, raw, part)


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_bfloat16_activations(level):
    raw = random_blocks(T.Q4_K, 20, 512, seed=3)
    x = torch.randn(5, 512).to(torch.bfloat16)
    check(T.Q4_K, x.float(), raw, kernels.qmatmul(x, [kernels.pack_rows(torch.from_numpy(raw), T.Q4_K)], [T.Q4_K]))


@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_mixed_segments_in_one_call_equal_separate_calls(level):
    """q/k in Q4_K and v in Q6_K (as in Q4_K_M files), and a 32-block segment beside them: one call,
    both activation quantizations, columns side by side, threads over all rows."""
    torch.set_num_threads(2)
    parts = [(T.Q4_K, 96), (T.Q6_K, 40), (T.Q4_K, 40), (T.Q8_0, 24)]
    segs = [(kernels.pack_rows(torch.from_numpy(random_blocks(q, n, 1024, seed=i)), q), q)
            for i, (q, n) in enumerate(parts)]
    for m in (1, 7):
        x = torch.randn(m, 1024)
        fused = kernels.qmatmul(x, [w for w, _ in segs], [q for _, q in segs])
        apart = torch.cat([kernels.qmatmul(x, [w], [q]) for w, q in segs], dim=1)
        assert torch.equal(fused, apart)
        ref = kernels.qmatmul_reference(x, [w for w, _ in segs], [q for _, q in segs])
        torch.testing.assert_close(fused, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())


# -- the dense prefill path (bfloat16 tiles of decoded weights) ---------------------------------
dense = pytest.mark.skipif(not kernels._C.dense_supported(), reason="the dense path needs AVX-512 with BF16")


@dense
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_dequant_bf16_is_gguf_dequantization_rounded_to_bfloat16(qtype):
    """Each value within half a bfloat16 step of gguf's (plus float32 rounding of the scale
    products, which gguf computes in another order)."""
    k = 512 if qtype.name.endswith("_K") else 608
    raw = random_blocks(qtype, 37, k, seed=int(qtype))
    w = kernels.pack_rows(torch.from_numpy(raw), qtype)
    ref = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype))).reshape(37, k)[5:31]
    got = kernels._C.dequant_bf16(w, int(qtype), k, 5, 31)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert ((got.float() - ref).abs() <= ref.abs() * (2.0 ** -8 + 2.0 ** -20)).all()


@dense
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0, T.Q3_K, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_qmatmul_dense_matches_the_float_product(qtype):
    """Segments side by side, tiles that cut a segment, rows not a multiple of the tile: within the
    bfloat16 roundings of x, W and y (each at most 2^-8 relative), of the float64 product."""
    k = 512 if qtype.name.endswith("_K") else 608
    raws = [random_blocks(qtype, n, k, seed=n) for n in (37, 20)]
    ws = [kernels.pack_rows(torch.from_numpy(r), qtype) for r in raws]
    wf = torch.cat([torch.from_numpy(np.array(gguf.quants.dequantize(r, qtype))).reshape(-1, k) for r in raws]).double()
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))
    y = kernels._C.qmatmul_dense(x, ws, [int(qtype)] * 2, 16)
    exact = x.double() @ wf.T
    bound = (x.double().abs() @ wf.abs().T) * 2 * 2.0 ** -8 + exact.abs() * 2.0 ** -8
    assert y.dtype == torch.float32 and ((y.double() - exact).abs() <= bound).all()


@dense
def test_quant_linear_takes_the_dense_path_from_its_row_threshold(monkeypatch):
    """Below DENSE_MIN_ROWS the row tiles (bit for bit qmatmul), from it the dense path, or where it
    does not run the prompt tiles (PROMPT_MIN_ROWS is the same 32 rows)."""
    raw = random_blocks(T.Q4_K, 48, 512, seed=2)
    layer = QuantLinear([(kernels.pack_rows(torch.from_numpy(raw), T.Q4_K), int(T.Q4_K))], 512)
    monkeypatch.setattr(kernels, "_dense", True)
    n = kernels.DENSE_MIN_ROWS
    few, many = torch.randn(n - 1, 512), torch.randn(n, 512)
    assert torch.equal(layer(few), kernels.qmatmul(few, layer.blocks, layer.qtypes))
    assert torch.equal(layer(many), kernels.qmatmul_dense(many, layer.blocks, layer.qtypes))
    monkeypatch.setattr(kernels, "_dense", False)
    assert kernels.PROMPT_MIN_ROWS == n
    assert torch.equal(layer(many), kernels.qmatmul(many, layer.blocks, layer.qtypes, prompt=True))


def test_dense_switch_is_checked(monkeypatch):
    monkeypatch.setattr(kernels, "_dense", None)
    monkeypatch.setenv("WALLBREAKER_DENSE_PREFILL", "yes")
    with pytest.raises(ValueError, match="WALLBREAKER_DENSE_PREFILL"):
        kernels.dense_path()
    monkeypatch.setenv("WALLBREAKER_DENSE_PREFILL", "0")
    assert kernels.dense_path() is False


def test_bad_arguments_are_clear_errors():
    w = kernels.pack_rows(torch.from_numpy(random_blocks(T.Q4_0, 4, 64, seed=0)), T.Q4_0)
    with pytest.raises(RuntimeError, match="bytes a row"):
        kernels.qmatmul(torch.randn(1, 96), [w], [T.Q4_0])
    with pytest.raises(RuntimeError, match="unsupported qtype"):
        kernels.qmatmul(torch.randn(1, 64), [w], [T.F16])


# -- the level switch ---------------------------------------------------------------------------
@pytest.mark.parametrize("level", LEVELS, indirect=True)
def test_forcing_a_level_takes_effect(level):
    assert kernels.isa() == level


def test_unknown_or_unsupported_levels_are_errors():
    with pytest.raises(ValueError, match="unknown kernel level"):
        kernels.set_isa("sse9")
    if kernels.cpu_isa() != "avx512":
        with pytest.raises(ValueError, match="lacks"):
            kernels.set_isa("avx512")
    if kernels.cpu_isa() != "arm":  # aarch64's level, beside the x86 ones (an x86 CPU never runs it)
        with pytest.raises(ValueError, match="lacks"):
            kernels.set_isa("arm")


def _isa_in_subprocess(**env) -> str:
    code = "from wallbreaker import kernels; print(kernels.isa())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_environment_switches():
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "WALLBREAKER_CPU_ISA")}
    os.environ.clear()
    os.environ.update(env)
    try:
        assert _isa_in_subprocess() == kernels.cpu_isa()
        assert _isa_in_subprocess(ATEN_CPU_CAPABILITY="default") == "generic"
        assert _isa_in_subprocess(WALLBREAKER_CPU_ISA="generic", ATEN_CPU_CAPABILITY="avx2") == "generic"
        if "avx2" in LEVELS:
            assert _isa_in_subprocess(ATEN_CPU_CAPABILITY="avx2") == "avx2"
            assert _isa_in_subprocess(WALLBREAKER_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="default") == "avx2"
        assert "expected avx512, avx2, arm or generic" in _isa_in_subprocess(WALLBREAKER_CPU_ISA="fast")
    finally:
        os.environ.update({k: v for k, v in env.items()})


# -- blocks made at load ------------------------------------------------------------------------
def test_layout_round_trip_and_q8_0_blocks_equal_gguf():
    for qtype in FORMATS:
        for k in (512, 256 * 7):  # 32-blocks: 4 full groups of 4; 14 groups and a short one of 0
            raw = torch.from_numpy(random_blocks(qtype, 3, k, seed=5))
            assert torch.equal(kernels.unpack_rows(kernels.pack_rows(raw, qtype), qtype), raw)
        if qtype in kernels.BLOCK32_TYPES:
            for k in (32, 96, 608):  # a row's last group of 1, 3 and 3 blocks
                raw = torch.from_numpy(random_blocks(qtype, 2, k, seed=6))
                packed = kernels.pack_rows(raw, qtype)
                assert packed.shape == raw.shape and torch.equal(kernels.unpack_rows(packed, qtype), raw)
    w = torch.randn(8, 96)
    assert np.array_equal(q8_0_blocks(w).numpy(), gguf.quants.quantize(w.numpy(), T.Q8_0))


@pytest.mark.parametrize("bits,group", [(4, 32), (3, 64), (4, 128)])
def test_int_grids_map_onto_q4_1(bits, group):
    gen = torch.Generator().manual_seed(bits)
    n, k = 6, 256
    q = QuantizedTensor(torch.randint(0, 2 ** bits, (n, k), generator=gen).to(torch.uint8),
                        (torch.rand(n, k // group, generator=gen) * 0.1).half().float(),
                        torch.randint(0, 2 ** bits, (n, k // group), generator=gen).float(), bits, group)
    blocks = q4_1_blocks(q)
    ours = torch.from_numpy(np.array(gguf.quants.dequantize(blocks.numpy(), T.Q4_1))).reshape(n, k)
    torch.testing.assert_close(ours, q.dequantize(), rtol=0, atol=q.dequantize().abs().max().item() * 2 ** -10)
    assert q4_1_blocks(QuantizedTensor(q.codes, q.scales, q.zeros, 8, group)) is None


def test_mxfp4_values_map_onto_q5_0_exactly():
    """gguf's MXFP4 blocks (scales 2^-18 .. 2^1, all-zero blocks among them): the Q5_0 blocks made of
    their values dequantize, by gguf, to the same floats; values off such a grid get None."""
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, size=(6, 8, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(110, 130, size=(6, 8))
    raw[0, 0, 1:] = 0
    values = gguf.quants.dequantize(raw.reshape(6, -1), T.MXFP4)
    blocks = q5_0_exact_blocks(torch.from_numpy(values.copy()))
    assert np.array_equal(gguf.quants.dequantize(blocks.numpy(), T.Q5_0), values)
    assert q5_0_exact_blocks(torch.from_numpy(values * 1.1)) is None
    assert q5_0_exact_blocks(torch.from_numpy(values * 2.0 ** -30)) is None  # d below float16's range


# -- the auto path ------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
def test_auto_model_matches_float32_within_activation_rounding(tiny_llama, qtype):
    """Same stored blocks on both paths: float32 dequantizes them exactly, auto adds only the 8-bit
    activation rounding of each matmul. Relative to the logits' spread, that stays within 2% (RMS)
    over 4 layers; the top token agrees almost everywhere."""
    path = tiny_llama.quantized_gguf(qtype)
    exact = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02)
    auto = LLM(str(path), dtype="auto", kv_cache_memory_gb=0.02)
    layer = auto.model.layers[0]
    assert isinstance(layer.attn.qkv, QuantLinear) and layer.attn.qkv.qtypes == [int(qtype)] * 3
    assert isinstance(auto.model.lm_head, QuantLinear)  # the untied head, stored blocks too
    files = auto.files.weights if hasattr(auto, "files") else None
    if files is not None:  # resident bytes of the layers equal the file's tensor bytes
        assert module_bytes(layer.mlp.down) == files["blk.0.ffn_down.weight"].nbytes
    ids = exact.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    a, b = exact.logits(ids), auto.logits(ids)
    rms = ((a - b).pow(2).mean() / a.var()).sqrt().item()
    assert rms < 0.02, rms
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_tied_head_and_embedding_share_one_copy(tiny_qwen2):
    path = tiny_qwen2.quantized_gguf(T.Q8_0)
    llm = LLM(str(path), dtype="auto", kv_cache_memory_gb=0.02)
    head, embed = llm.model.lm_head, llm.model.embed
    assert isinstance(head, QuantLinear)
    assert embed.rows.data_ptr() == head.blocks[0].data_ptr()
    ids = torch.tensor([3, 7, 100])
    torch.testing.assert_close(embed(ids), head.dequantize()[ids])
