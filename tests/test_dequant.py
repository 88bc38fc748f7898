"""Our torch dequantization must match gguf.quants.dequantize bit for bit (and llama.cpp's own C,
where a build is at hand: $LLAMA_CPP_DIR)."""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from wallbreaker.errors import ModelFormatError, UnsupportedModelError
from wallbreaker.formats import dequant
from wallbreaker.formats.dequant import SUPPORTED_TYPES, block_info, dequantize, tensor_nbytes

T = gguf.GGMLQuantizationType

# Byte offsets of the float16 scale fields inside one block.
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ1_S: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,),
}
# Types whose scales are not a float16 field: each gets finite scales its own way (random_bytes).
OTHER_SCALES = (T.IQ1_M, T.MXFP4, T.NVFP4, T.Q8_K)
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
NEW_TYPES = (T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_NL, T.IQ4_XS,
             T.TQ1_0, T.TQ2_0, T.MXFP4, T.NVFP4, T.Q8_K)



def finite_floats(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite float32 values of both signs spanning ~8 decades, including float16 subnormals."""
    return (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2, n)).astype(np.float32)


def random_bytes(qtype: gguf.GGMLQuantizationType, n_rows: int, row: int, seed: int = 0) -> np.ndarray:
    """[n_rows, row bytes] of random blocks whose float fields are finite."""
    rng = np.random.default_rng(seed)
    n = n_rows * row
    if qtype == T.F32:
        return finite_floats(rng, n).view(np.uint8).reshape(n_rows, -1)
    if qtype == T.F16:
        return finite_floats(rng, n).astype(np.float16).view(np.uint8).reshape(n_rows, -1)
    if qtype == T.BF16:
        top = (finite_floats(rng, n).view(np.uint32) >> 16).astype(np.uint16)
        return top.view(np.uint8).reshape(n_rows, -1)
    block, size = block_info(qtype)
    blocks = rng.integers(0, 256, (n // block, size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        halves = finite_floats(rng, len(blocks)).astype(np.float16)
        blocks[:, off:off + 2] = halves.view(np.uint8).reshape(-1, 2)
    if qtype == T.IQ1_M:  # its float16 scale is spread over the top nibbles of four uint16
        d = finite_floats(rng, len(blocks)).astype(np.float16).view(np.uint16)
        scales = blocks[:, 48:56].copy().view(np.uint16) & 0x0FFF
        for k in range(4):
            scales[:, k] |= ((d >> (4 * k)) & 0xF) << 12
        blocks[:, 48:56] = scales.view(np.uint8)
    elif qtype == T.MXFP4:  # an e8m0 exponent: 2^(e - 127), kept where products stay finite
        blocks[:, 0] = rng.integers(100, 150, len(blocks))
    elif qtype == T.Q8_K:  # a float32 scale
        blocks[:, :4] = finite_floats(rng, len(blocks)).view(np.uint8).reshape(-1, 4)
    return blocks.reshape(n_rows, -1)


def reference(data: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    if qtype == T.Q8_K:  # not in gguf.quants: llama.cpp's dequantize_row_q8_K, y = d * q
        blocks = np.ascontiguousarray(data).reshape(-1, 292)
        d = blocks[:, :4].copy().view(np.float32)
        return torch.from_numpy(d * blocks[:, 4:260].view(np.int8).astype(np.float32)).reshape(shape)
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype))).reshape(shape)


def assert_bit_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert not ref.isnan().any()
    assert torch.equal(ours, ref)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))  # also tells -0.0 from 0.0


def test_supported_types() -> None:
    """Every type the gguf package can dequantize (all but the integer and F64 ones), and Q8_K."""
    readable = {q for q in T if q in gguf.quants._type_traits} | {T.F32, T.F16}
    assert SUPPORTED_TYPES == frozenset(F16_FIELDS) | frozenset(FLOAT_TYPES) | frozenset(OTHER_SCALES)
    assert SUPPORTED_TYPES == readable | {T.Q8_K}


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_matches_reference(qtype: gguf.GGMLQuantizationType) -> None:
    block, _ = block_info(qtype)
    shape = (7, max(block, 32) * 3)
    data = random_bytes(qtype, *shape)
    assert data.size == tensor_nbytes(qtype, shape)
    ref = reference(data, qtype, shape)
    assert_bit_equal(dequantize(data, qtype, shape), ref)
    assert_bit_equal(dequantize(torch.from_numpy(data), qtype, shape), ref)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_multidim_and_chunking(qtype: gguf.GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch) -> None:
    shape = (3, 5, 512)
    data = random_bytes(qtype, 15, 512, seed=1)
    ref = reference(data, qtype, shape)
    monkeypatch.setattr(dequant, "_CHUNK_WEIGHTS", 768)  # chunk edges fall mid-row
    assert_bit_equal(dequantize(data.reshape(-1), qtype, shape), ref)


@pytest.mark.parametrize("qtype", [T.F32, T.F16], ids=lambda t: t.name)
def test_typed_input(qtype: gguf.GGMLQuantizationType) -> None:
    data = random_bytes(qtype, 4, 64, seed=2)
    typed = data.view(np.float32 if qtype == T.F32 else np.float16)
    ref = reference(data, qtype, (4, 64))
    assert_bit_equal(dequantize(typed, qtype, (4, 64)), ref)
    assert_bit_equal(dequantize(torch.from_numpy(typed), qtype, (4, 64)), ref)


def test_result_owns_memory_of_read_only_input(tmp_path: Path) -> None:
    data = random_bytes(T.F32, 2, 8)
    path = tmp_path / "t.bin"
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = dequantize(mm, T.F32, (2, 8))
    assert_bit_equal(out, reference(data, T.F32, (2, 8)))
    out.add_(1)  # would crash if it aliased the read-only mapping
    assert np.array_equal(mm, data.reshape(-1))


def test_wrong_size() -> None:
    data = random_bytes(T.Q8_0, 2, 64)
    with pytest.raises(ModelFormatError, match="Q8_0"):
        dequantize(data[:, :-1], T.Q8_0, (2, 64))
    with pytest.raises(ModelFormatError, match="Q8_0"):
        dequantize(data, T.Q8_0, (2, 96))
    with pytest.raises(ModelFormatError, match="block size"):
        dequantize(data, T.Q8_0, (4, 16))


def _ggml() -> ctypes.CDLL:
    """llama.cpp's libggml-base from $LLAMA_CPP_DIR (its build's bin folder), else the one `make
    llamacpp` builds into the cache folder (tests/llamacpp_converter.py), or skip."""
    from llamacpp_converter import ggml_lib_dir
    from wallbreaker.formats.packaged import cache_dir
    folder = os.environ.get("LLAMA_CPP_DIR")
    path = (Path(folder) if folder else ggml_lib_dir(cache_dir())) / "libggml-base.so"
    if not path.is_file():
        pytest.skip("run `make llamacpp` (builds llama.cpp's libggml-base into the cache folder) or set "
                    "LLAMA_CPP_DIR to a llama.cpp build's bin folder (with libggml-base.so)")
    return ctypes.CDLL(str(path))


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_new_types_against_llama_cpp(qtype: gguf.GGMLQuantizationType) -> None:
    """The same blocks through llama.cpp's own dequantize_row_<type> (for Q8_K, which gguf.quants
    lacks, the only reference but the definition)."""
    lib = _ggml()
    row = getattr(lib, f"dequantize_row_{qtype.name.lower() if qtype != T.Q8_K else 'q8_K'}")
    row.argtypes, row.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    block, _ = block_info(qtype)
    data = np.ascontiguousarray(random_bytes(qtype, 5, block * 2, seed=3))
    expected = np.empty(data.shape[0] * block * 2, dtype=np.float32)
    row(data.ctypes.data, expected.ctypes.data, expected.size)
    assert_bit_equal(dequantize(data, qtype, (5, block * 2)), torch.from_numpy(expected).reshape(5, -1))


def test_unsupported_type() -> None:
    block, size = block_info(T.Q8_1)
    with pytest.raises(UnsupportedModelError, match="Q8_1"):
        dequantize(np.zeros(size, np.uint8), T.Q8_1, (block,))


def test_real_file(packaged_model) -> None:
    reader = gguf.GGUFReader(packaged_model("smollm2"))
    tensors = {t.name: t for t in reader.tensors}
    names = ("token_embd.weight", "blk.0.ffn_down.weight", "blk.3.attn_q.weight", "blk.0.attn_norm.weight")
    for name in names:
        t = tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        ours = dequantize(t.data, t.tensor_type, shape)
        rows = t.data.reshape(shape[0], -1)[-300:]  # the reference is slow: check the last rows only
        assert_bit_equal(ours[-300:], reference(rows, t.tensor_type, (len(rows), *shape[1:])))
