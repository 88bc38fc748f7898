"""Quantization: the grids, GPTQ, AWQ, the bit allocator, and the files they write.

The exactness tests pin that a quantized folder loads back as exactly the weights the method
produced (and the in-memory model computed with), against a float folder of those dequantized
weights; the GGUF tests pin the blocks against gguf-py's own quantizer and dequantizer.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import TinyModel

from wallbreaker import LLM, SamplingParams
from wallbreaker.cli import main
from wallbreaker.errors import InvalidRequestError
from wallbreaker.formats.hf_writer import write_hf_folder
from wallbreaker.formats.names import llama_permute
from wallbreaker.quant.awq import search_clip, search_scales
from wallbreaker.quant.calibration import InputStats, calibration_sequences
from wallbreaker.quant.fold import fold_scales, tie_heads
from wallbreaker.quant.gptq import GPTQConfig, gptq_quantize, prepare_hessian
from wallbreaker.formats.grid import QuantGrid
from wallbreaker.quant.layerwise import LayerRunner
from wallbreaker.quant.mixed import allocate_bits, average_bits, candidate_bits
from wallbreaker.formats.packing import pack_codes, unpack_codes
from wallbreaker.quant.pipeline import QuantizeConfig, quantize_model
from wallbreaker.quant.rtn import quantize_rtn
from wallbreaker.quant.run import quantize_to

Q = gguf.GGMLQuantizationType
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time there was"
CALIB_TEXT = (Path(__file__).parent / "tiny_models.py").read_text()  # any text longer than a few windows


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(CALIB_TEXT)
    return str(path)


def tiny_cfg(calib: str, **kw) -> QuantizeConfig:
    return QuantizeConfig(**{"group_size": 32, "nsamples": 4, "seqlen": 48, "calib": calib, **kw})


def correlated_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose channels are strongly correlated and unequal in scale, like real activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / dim ** 0.5 + torch.eye(dim)
    scale = torch.exp(torch.randn(dim, generator=g))
    return (torch.randn(n, dim, generator=g) @ mix) * scale  # [n, dim]


# -- grids and packing -------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(bits=st.integers(2, 8), rows=st.integers(1, 4), n=st.integers(1, 70), seed=st.integers(0, 1000))
def test_packed_codes_round_trip(bits: int, rows: int, n: int, seed: int) -> None:
    codes = torch.randint(0, 1 << bits, (rows, n), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, -(-n * bits // 8))
    assert torch.equal(unpack_codes(packed, bits, n), codes)


def test_four_bit_packing_puts_even_columns_in_low_nibbles() -> None:
    packed = pack_codes(torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.uint8), 4)
    assert packed.tolist() == [[0x21, 0x43, 0x05]]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_rtn_is_nearest_point_of_each_group_grid(bits: int, sym: bool, group_size: int) -> None:
    w = torch.randn(8, 200) * torch.linspace(0.1, 3, 200)  # 200 columns: a short last group
    grid = QuantGrid(bits, group_size, sym)
    q = quantize_rtn(w, grid)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= grid.maxq
    assert q.scales.shape == (8, -(-200 // group_size)) and (q.zeros is None) == sym
    assert torch.equal(q.scales, q.scales.half().float())  # float16 parameters, as stored
    g = torch.arange(200) // group_size
    err = (q.dequantize() - w).abs()
    step = q.scales.abs()[:, g]
    inside = (q.codes > 0) & (q.codes < grid.maxq)
    assert bool((err[inside] <= step[inside] / 2 + 1e-5).all())  # the nearest point of the group's grid
    # the extreme maps to its level up to the scale's float16 rounding (2^-11 of a step for each of the
    # 2^(bits-1) levels below it); on a symmetric grid the other sign may reach one step past the top level
    assert bool((err <= step * ((1.0 + 2 ** (bits - 1 - 11)) if sym else 0.5) + 1e-5).all())


def test_symmetric_grid_maps_the_extreme_weight_to_code_zero() -> None:
    w = torch.tensor([[0.5, -2.0, 1.0, 1.9]])
    q = quantize_rtn(w, QuantGrid(4, 4, sym=True))
    assert q.codes[0, 1] == 0 and q.dequantize()[0, 1] == -2.0
    assert float(q.scales[0, 0]) == pytest.approx(2.0 / 8)  # Q4_0's d = max / -8


def test_asymmetric_grid_reproduces_min_and_max() -> None:
    w = torch.tensor([[0.25, 1.75, 1.0, 0.5]])
    deq = quantize_rtn(w, QuantGrid(3, 4, sym=False)).dequantize()
    assert deq[0, 0] == pytest.approx(0.25, abs=1e-3) and deq[0, 1] == pytest.approx(1.75, abs=1e-3)


def test_grid_rejects_unsupported_widths() -> None:
    with pytest.raises(ValueError):
        QuantGrid(1)
    with pytest.raises(ValueError):
        QuantGrid(9)
    with pytest.raises(InvalidRequestError):
        QuantizeConfig(method="gptq", bits=3.5)
    with pytest.raises(InvalidRequestError):
        QuantizeConfig(method="awq", bits=4, act_order=True)


# -- GPTQ ----------------------------------------------------------------------------------------

def _hessian(x: torch.Tensor) -> torch.Tensor:
    stats = InputStats(x.shape[1])
    for chunk in x.split(300):
        stats.add(chunk)
    return stats.hessian


def test_hessian_is_two_x_xt_over_n() -> None:
    x = torch.randn(1000, 16)
    assert torch.allclose(_hessian(x), 2 * x.T @ x / 1000, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_beats_rtn_in_output_error(act_order: bool, bits: int) -> None:
    x = correlated_inputs(2048, 128)
    w = torch.randn(64, 128)
    grid = QuantGrid(bits, 32, sym=False)
    prepared = prepare_hessian(_hessian(x), GPTQConfig(act_order=act_order))
    gptq = gptq_quantize(w, prepared, grid)
    rtn = quantize_rtn(w, grid)
    err = lambda q: (x @ (q.dequantize() - w).T).pow(2).mean().item()  # noqa: E731
    assert err(gptq) < 0.8 * err(rtn)
    assert (gptq.g_idx is not None) == act_order


def test_gptq_act_order_groups_follow_activation_order() -> None:
    x = correlated_inputs(2048, 64)
    q = gptq_quantize(torch.randn(16, 64), prepare_hessian(_hessian(x), GPTQConfig(act_order=True)), QuantGrid(4, 16))
    order = torch.argsort(torch.diag(_hessian(x)), descending=True)
    assert q.g_idx.dtype == torch.int32 and torch.equal(q.g_idx[order].long(), torch.arange(64) // 16)


def test_gptq_lazy_block_updates_equal_column_by_column_updates() -> None:
    x = correlated_inputs(1024, 96)
    w = torch.randn(24, 96)
    prepared = prepare_hessian(_hessian(x), GPTQConfig())
    blocked = gptq_quantize(w, prepared, QuantGrid(4, 32), block_size=128)
    unblocked = gptq_quantize(w, prepared, QuantGrid(4, 32), block_size=1)
    assert (blocked.codes != unblocked.codes).float().mean() < 0.01  # float summation order only
    assert torch.allclose(blocked.dequantize(), unblocked.dequantize(), atol=0.05)


def test_gptq_zeroes_dead_input_columns() -> None:
    x = correlated_inputs(512, 32)
    x[:, 5] = 0
    q = gptq_quantize(torch.randn(8, 32), prepare_hessian(_hessian(x), GPTQConfig()), QuantGrid(4, 32))
    assert bool((q.dequantize()[:, 5].abs() <= q.scales[:, 0] / 2 + 1e-6).all())  # 0, to the grid's nearest


# -- AWQ -----------------------------------------------------------------------------------------

def test_awq_scales_reduce_output_error_with_salient_channels() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 128, generator=g)
    x[:, :4] *= 50  # a few channels with large activations
    w = torch.randn(64, 128, generator=g)
    grid = QuantGrid(3, 128)
    found = search_scales(x.T @ x / len(x), x.abs().mean(0), w, grid)
    assert found.alpha > 0 and found.error < 0.7 * found.rtn_error
    assert found.scales[:4].min() > found.scales[4:].max()
    wq = quantize_rtn(w * found.scales, grid).dequantize()
    awq_err = ((x / found.scales) @ wq.T - x @ w.T).pow(2).mean()
    rtn_err = (x @ quantize_rtn(w, grid).dequantize().T - x @ w.T).pow(2).mean()
    assert awq_err < 0.7 * rtn_err
    assert awq_err.item() == pytest.approx(found.error, rel=1e-3)  # the Gram form is the same error
    assert rtn_err.item() == pytest.approx(found.rtn_error, rel=1e-3)


def test_awq_clipping_never_increases_the_output_error() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 96, generator=g)
    w = torch.randn(32, 96, generator=g)
    w[:, 7] *= 8  # an outlier column that stretches every group's range
    grid = QuantGrid(3, 32)
    clipped = search_clip(x.T @ x / len(x), w, grid)
    err = lambda v: (x @ (quantize_rtn(v, grid).dequantize() - w).T).pow(2).mean().item()  # noqa: E731
    assert err(clipped) < err(w)
    assert bool((clipped.abs() <= w.abs().amax(1, keepdim=True)).all())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_folding_scales_leaves_the_float_model_unchanged(arch: str, request: pytest.FixtureRequest) -> None:
    tiny: TinyModel = request.getfixturevalue(f"tiny_{arch}")
    llm = LLM(str(tiny.hf_dir), dtype="float32")
    before = llm.logits(PROMPT)
    cfg, g = llm.model_config, torch.Generator().manual_seed(1)
    for layer in llm.model.layers:
        for group, dim in (("qkv", cfg.hidden_size), ("o", cfg.num_heads * cfg.head_dim),
                           ("gate_up", cfg.hidden_size), ("down", cfg.intermediate_size)):
            s = torch.exp(torch.randn(dim, generator=g))
            if group == "o":
                s = tie_heads(s, cfg.num_heads, cfg.num_kv_heads)
            fold_scales(layer, group, s, cfg.num_heads, cfg.num_kv_heads)
    assert torch.allclose(llm.logits(PROMPT), before, atol=1e-4)


# -- mixed precision -----------------------------------------------------------------------------

def test_allocation_reaches_the_target_and_favours_sensitive_tensors() -> None:
    numel = {"a": 1000, "b": 1000, "c": 2000}
    # "a" is ten times as sensitive as "b"; each extra bit quarters the error
    errors = {n: {b: k * 4.0 ** -b for b in (2, 3, 4, 5)} for n, k in (("a", 10.0), ("b", 1.0), ("c", 2.0))}
    bits = allocate_bits(numel, errors, 3.5)
    assert average_bits(bits, numel) == pytest.approx(3.5)
    assert bits["a"] > bits["b"]
    assert candidate_bits(3.5) == [2, 3, 4, 5] and candidate_bits(4.5) == [3, 4, 5, 6]


def test_allocation_never_exceeds_the_budget() -> None:
    numel = {"a": 1000, "b": 3000}
    errors = {"a": {3: 1.0, 4: 0.1}, "b": {3: 1.0, 4: 0.5}}
    bits = allocate_bits(numel, errors, 3.3)
    assert average_bits(bits, numel) <= 3.3 and bits == {"a": 4, "b": 3}


# -- calibration and layer-by-layer running -------------------------------------------------------

def test_calibration_sequences_are_seeded_windows(tiny_llama: TinyModel) -> None:
    llm = LLM(str(tiny_llama.hf_dir), dtype="float32")
    a = calibration_sequences(llm.tokenizer, CALIB_TEXT, 5, 32, seed=3)
    assert a.shape == (5, 32) and torch.equal(a, calibration_sequences(llm.tokenizer, CALIB_TEXT, 5, 32, seed=3))
    assert not torch.equal(a, calibration_sequences(llm.tokenizer, CALIB_TEXT, 5, 32, seed=4))
    assert bool((a[:, 0] == llm.tokenizer.bos_token_id).all())  # tiny llama adds BOS


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_layer_runner_reproduces_the_engine(arch: str, request: pytest.FixtureRequest) -> None:
    """Running the layers one by one on calibration windows gives the engine's hidden states
    (gemma3: windows longer than its sliding window)."""
    tiny: TinyModel = request.getfixturevalue(f"tiny_{arch}")
    llm = LLM(str(tiny.hf_dir), dtype="float32")
    seqs = calibration_sequences(llm.tokenizer, CALIB_TEXT, 3, 40, seed=0)
    runner = LayerRunner(llm.model, 40, batch=2)
    hidden = runner.embed(seqs)
    for i in range(len(llm.model.layers)):
        hidden = runner.run(i, hidden)
    logits = llm.model.logits(llm.model.norm(hidden))  # [3, 40, vocab]
    for j in range(3):
        assert torch.allclose(logits[j], llm.logits(seqs[j].tolist()), atol=1e-4)


# -- quantized folders -----------------------------------------------------------------------------

METHODS = {
    "rtn": dict(method="rtn", bits=4),
    "rtn-sym-3": dict(method="rtn", bits=3, sym=True),
    "gptq": dict(method="gptq", bits=3),
    "gptq-act-order": dict(method="gptq", bits=4, act_order=True),
    "awq": dict(method="awq", bits=3),
    "awq-no-clip": dict(method="awq", bits=3, awq_clip=False),
    "mixed": dict(method="mixed", bits=3.5),
}


def _greedy(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids


def _reference_folder(qm, llm: LLM, path: Path) -> Path:
    """The quantized model written as a plain float folder: our codes dequantized by hand."""
    deq = {name: (q.codes.float() - q.zero_points()[:, q.group_index()]) * q.scales[:, q.group_index()]
           for name, q in qm.quantized.items()}
    return write_hf_folder(path, qm.config, {**qm.tensors, **deq}, llm.tokenizer, None)


# every method on llama; on qwen2 (q/k/v biases, tied head) and gemma3 (sandwich norms, 1 + w norms) the
# methods whose handling differs by architecture: AWQ's folds and GPTQ's shared inputs
FOLDER_CASES = [("llama", m) for m in METHODS] + [(a, m) for a in ("qwen2", "gemma3") for m in ("gptq-act-order", "awq")]


@pytest.mark.parametrize("arch,method", FOLDER_CASES)
def test_quantized_folder_reloads_as_the_quantized_weights(arch: str, method: str, calib: str, tmp_path: Path,
                                                           request: pytest.FixtureRequest) -> None:
    tiny: TinyModel = request.getfixturevalue(f"tiny_{arch}")
    llm = LLM(str(tiny.hf_dir), dtype="float32")
    qm = quantize_model(llm, tiny_cfg(calib, **METHODS[method]), progress=False)
    in_memory = llm.logits(PROMPT)

    from wallbreaker.quant.export import export_folder
    folder = export_folder(qm, tmp_path / "q", llm.tokenizer, llm.chat_template.source)
    loaded = LLM(str(folder), dtype="float32")
    reference = LLM(str(_reference_folder(qm, llm, tmp_path / "ref")), dtype="float32")

    assert loaded.model_config == tiny.config
    assert _greedy(loaded) == _greedy(reference)
    assert torch.equal(loaded.logits(PROMPT), reference.logits(PROMPT))
    assert torch.allclose(loaded.logits(PROMPT), in_memory, atol=1e-4)  # gemma3: 1 + w round trip
    assert not torch.allclose(loaded.logits(PROMPT), LLM(str(tiny.hf_dir), dtype="float32").logits(PROMPT), atol=1e-3)
    for name, q in qm.quantized.items():
        assert torch.equal(loaded.files.weights[name].load(), q.dequantize())


def test_quantized_folder_layout(tiny_llama: TinyModel, calib: str, tmp_path: Path) -> None:
    from safetensors import safe_open
    cfg = tiny_cfg(calib, method="gptq", bits=3, act_order=True)
    quantize_to(str(tiny_llama.hf_dir), tmp_path / "q", cfg, progress=False)
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qcfg == {"quant_method": "wallbreaker", "method": "gptq", "bits": 3, "group_size": 32, "sym": False,
                    "desc_act": True, "calibration": {"nsamples": 4, "seqlen": 48, "seed": 0, "file": "calib.txt"}}
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        m = "model.layers.0.mlp.down_proj"
        assert f.get_tensor(f"{m}.qweight").dtype == torch.uint8
        assert tuple(f.get_tensor(f"{m}.qweight").shape) == (64, 128 * 3 // 8)
        assert tuple(f.get_tensor(f"{m}.scales").shape) == (64, 4) and f.get_tensor(f"{m}.scales").dtype == torch.float16
        assert tuple(f.get_tensor(f"{m}.zeros").shape) == (64, 4)
        assert f.get_tensor(f"{m}.g_idx").dtype == torch.int32
        assert f.get_tensor("model.layers.0.input_layernorm.weight").dtype == torch.float32
    ref = LLM(str(tmp_path / "q"), dtype="float32").files.weights["blk.0.ffn_down.weight"]
    assert ref.stored_type == "INT3_G32_ACT" and ref.nbytes == 64 * 48 + 2 * 64 * 4 * 2 + 128 * 4
    assert ref.quant.bits == 3 and ref.quant.act_order and ref.quant.load().codes.shape == (64, 128)


def test_four_bit_folder_runs_as_q4_1_blocks_on_the_auto_path(tiny_llama: TinyModel, calib: str,
                                                               tmp_path: Path) -> None:
    quantize_to(str(tiny_llama.hf_dir), tmp_path / "q", tiny_cfg(calib, method="rtn", bits=4), progress=False)
    llm = LLM(str(tmp_path / "q"), dtype="auto")
    qkv = llm.model.layers[1].attn.qkv
    assert qkv.qtypes == [int(gguf.GGMLQuantizationType.Q4_1)] * 3
    want = torch.cat([llm.files.weights[f"blk.1.attn_{x}.weight"].load() for x in "qkv"])
    # the same codes and scales; only the zero point's product m = -z·s is rounded to float16
    assert torch.allclose(qkv.dequantize(), want, atol=2e-3 * float(want.abs().max()), rtol=0)


def test_mixed_folder_records_each_tensors_width(tiny_llama: TinyModel, calib: str, tmp_path: Path) -> None:
    qm = quantize_to(str(tiny_llama.hf_dir), tmp_path / "q", tiny_cfg(calib, method="mixed", bits=3.5), progress=False)
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    widths = qcfg["bits_per_tensor"]
    assert len(widths) == 7 * 4 and set(widths.values()) <= {2, 3, 4, 5}
    assert 3.3 <= qm.average_bits <= 3.5
    loaded = LLM(str(tmp_path / "q"), dtype="float32").files.weights
    assert loaded["blk.0.attn_q.weight"].quant.bits == widths["model.layers.0.self_attn.q_proj"]


# -- GGUF ----------------------------------------------------------------------------------------

def _disk(name: str, w: torch.Tensor, tiny: TinyModel) -> torch.Tensor:
    c = tiny.config
    if name.endswith("attn_q.weight"):
        return llama_permute(w, c.num_heads)
    if name.endswith("attn_k.weight"):
        return llama_permute(w, c.num_kv_heads)
    return w


@pytest.mark.parametrize("qtype,bits,sym", [(Q.Q4_0, 4, True), (Q.Q4_1, 4, False), (Q.Q8_0, 8, True)])
def test_rtn_gguf_blocks_equal_gguf_quants(qtype, bits: int, sym: bool, tiny_llama: TinyModel, tmp_path: Path) -> None:
    out = tmp_path / "q.gguf"
    qm = quantize_to(str(tiny_llama.gguf_path), out, QuantizeConfig("rtn", bits, 32, sym), progress=False)
    source = tiny_llama.canonical_tensors()
    reader = gguf.GGUFReader(out)
    seen = 0
    for t in reader.tensors:
        if t.name in qm.quantized:
            expected = gguf.quants.quantize(_disk(t.name, source[t.name], tiny_llama).numpy(), qtype)
            assert t.tensor_type == qtype
            assert np.array_equal(np.asarray(t.data).reshape(expected.shape), expected), t.name
            seen += 1
    assert seen == 7 * 4
    assert LLM(str(out), dtype="float32").files.weights["blk.0.ffn_up.weight"].stored_type == qtype.name


@pytest.mark.parametrize("qtype,bits,sym,tol", [(Q.Q4_0, 4, True, 0.0), (Q.Q8_0, 8, True, 0.0), (Q.Q4_1, 4, False, 1e-3)])
def test_gptq_gguf_blocks_hold_gptqs_codes(qtype, bits: int, sym: bool, tol: float, tiny_llama: TinyModel,
                                           calib: str, tmp_path: Path) -> None:
    out = tmp_path / "q.gguf"
    qm = quantize_to(str(tiny_llama.gguf_path), out, tiny_cfg(calib, method="gptq", bits=bits, sym=sym), progress=False)
    for t in gguf.GGUFReader(out).tensors:
        if t.name in qm.quantized:
            stored = gguf.quants.dequantize(np.asarray(t.data), qtype).reshape(qm.quantized[t.name].shape)
            ours = _disk(t.name, qm.quantized[t.name].dequantize(), tiny_llama).numpy()
            assert np.abs(stored - ours).max() <= tol, t.name


@pytest.mark.parametrize("kw,message", [
    (dict(method="gptq", bits=4, group_size=128), "group"),
    (dict(method="gptq", bits=3, group_size=32), "GGUF"),
    (dict(method="gptq", bits=4, group_size=32, act_order=True), "act-order"),
    (dict(method="mixed", bits=3.5, group_size=32), "mixed"),
])
def test_gguf_output_refuses_what_its_blocks_cannot_hold(kw: dict, message: str, tiny_llama: TinyModel,
                                                         tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        quantize_to(str(tiny_llama.gguf_path), tmp_path / "q.gguf", QuantizeConfig(**kw), progress=False)


# -- the CLI ---------------------------------------------------------------------------------------

def test_cli_quantize_writes_a_loadable_folder(tiny_qwen2: TinyModel, calib: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "awq"
    rc = main(["quantize", "--method", "awq", "--no-awq-clip", "--bits", "4", "--group-size", "32", "--calib", calib,
               "--nsamples", "2", "--seqlen", "32", str(tiny_qwen2.hf_dir), str(out)])
    assert rc == 0 and capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert LLM(str(out), dtype="float32").files.weights["blk.0.attn_v.weight"].stored_type == "INT4_G32"


def test_cli_quantize_error_is_one_line(tiny_llama: TinyModel, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["quantize", "--method", "gptq", "--bits", "4", "--group-size", "128", str(tiny_llama.gguf_path),
               str(tmp_path / "x.gguf")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("wallbreaker: error:") and "\n" not in err
