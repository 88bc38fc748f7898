"""open_gguf on valid, crafted and fuzzed files: a typed error or a valid result, nothing else."""
from __future__ import annotations

import math
import os
import resource
import signal
import tempfile
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wallbreaker.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from wallbreaker.formats.gguf_file import RUNNABLE_TYPES, GGUFFile, open_gguf


RNG = np.random.default_rng(0)
W_F32 = RNG.standard_normal((4, 8)).astype(np.float32)
W_Q8 = RNG.standard_normal((2, 64)).astype(np.float32)
W_Q8_BYTES = gguf.quants.quantize(W_Q8, QType.Q8_0)
W_F16 = RNG.standard_normal(3).astype(np.float16)
KV = {
    "general.name": "tiny",
    "llama.block_count": 2,
    "llama.rope.freq_base": 10000.0,
    "tokenizer.ggml.add_bos_token": True,
    "tokenizer.ggml.tokens": ["<s>", "</s>", "hello", "", "wörld"],
    "tokenizer.ggml.token_type": [3, 3, 1, 1, 1],
    "tokenizer.ggml.scores": [0.0, -1.5, 2.25],
}


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, QType | None]], kv: dict = KV) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    for key, value in kv.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif key.endswith("token_type"):
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            w.add_array(key, value)
    for name, (array, qtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


VALID_TENSORS = {"a.weight": (W_F32, None), "b.weight": (W_Q8_BYTES, QType.Q8_0), "c.bias": (W_F16, None)}


def layout(data: bytes) -> tuple[dict[str, list[tuple[int, int]]], dict[str, list[tuple[int, int]]]]:
    """(offset, nbytes) of every part of every metadata field and tensor info, found with the stock reader."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.gguf"
        p.write_bytes(data)
        r = gguf.GGUFReader(p)
        base = r.data.ctypes.data
        parts = lambda ps: [(p.ctypes.data - base, p.nbytes) for p in ps]  # noqa: E731
        fields = {name: parts(f.parts) for name, f in r.fields.items()}
        tensors = {t.name: parts(t.field.parts) for t in r.tensors}
        del r
    return fields, tensors


with tempfile.TemporaryDirectory() as _d:
    VALID = write_gguf(Path(_d) / "valid.gguf", VALID_TENSORS).read_bytes()
FIELDS, TENSORS = layout(VALID)
# Every integer slot of the header (counts, lengths, types, dims, offsets) that the fuzzer overwrites.
SLOTS = sorted({
    (off + i, width)
    for parts in [*FIELDS.values(), *TENSORS.values()]
    for off, n in parts
    for width in (4, 8)
    for i in range(0, n, width)
    if n % width == 0 and n <= 64
})
HEADER_END = max(off + n for parts in TENSORS.values() for off, n in parts)


def put(data: bytes, offset: int, value: int, width: int = 8) -> bytes:
    return data[:offset] + value.to_bytes(width, "little") + data[offset + width:]


def write(tmp_path: Path, data: bytes, name: str = "model.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def expect(exc: type[Exception], path: Path, *fragments: str) -> None:
    with pytest.raises(exc) as info:
        open_gguf(path)
    message = str(info.value)
    assert type(info.value) is exc, message
    assert "\n" not in message and str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_valid_file_round_trips(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    gf = open_gguf(path)
    assert isinstance(gf, GGUFFile) and gf.path == path and gf.file_size == len(VALID)
    assert gf.get("general.architecture") == "llama" and gf.get("missing", 7) == 7
    for key, value in KV.items():
        assert gf.metadata[key] == value, key
        assert type(gf.metadata[key]) is type(value)
    assert set(gf.tensors) == set(VALID_TENSORS)
    a, b, c = gf.tensors["a.weight"], gf.tensors["b.weight"], gf.tensors["c.bias"]
    assert (a.ggml_type, a.shape, b.ggml_type, b.shape, c.ggml_type, c.shape) == (
        QType.F32, (4, 8), QType.Q8_0, (2, 64), QType.F16, (3,))
    assert np.array_equal(a.raw.view(np.float32).reshape(a.shape), W_F32)
    assert a.raw.tobytes() == W_F32.tobytes() and b.raw.tobytes() == W_Q8_BYTES.tobytes()
    assert np.array_equal(gguf.quants.dequantize(np.asarray(b.raw).reshape(2, -1), QType.Q8_0),
                          gguf.quants.dequantize(W_Q8_BYTES, QType.Q8_0))
    assert c.raw.tobytes() == W_F16.tobytes()
    for t in gf.tensors.values():
        assert t.raw.dtype == np.uint8 and isinstance(t.raw, np.memmap) and not t.raw.flags.writeable


def test_real_file_opens_fast(packaged_model) -> None:
    path = packaged_model("smollm2")
    start = time.perf_counter()
    gf = open_gguf(path)
    elapsed = time.perf_counter() - start
    assert len(gf.tensors) == 272 and gf.get("llama.block_count") == 30
    tokens = gf.get("tokenizer.ggml.tokens")
    assert len(tokens) == 49152 and all(isinstance(t, str) for t in tokens)
    assert len(gf.get("tokenizer.ggml.token_type")) == 49152 and len(gf.get("tokenizer.ggml.merges")) == 48900
    assert {t.ggml_type for t in gf.tensors.values()} <= RUNNABLE_TYPES
    assert elapsed < 2.0


def test_missing_and_directory(tmp_path: Path) -> None:
    expect(ModelNotFoundError, tmp_path / "nope.gguf", "No such file")
    expect(ModelNotFoundError, tmp_path, "directory")


def test_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    expect(ModelFormatError, fifo, "not a regular file")


def test_empty_bad_magic_bad_version(tmp_path: Path) -> None:
    expect(ModelFormatError, write(tmp_path, b""), "empty")
    expect(ModelFormatError, write(tmp_path, b"PK\x03\x04" + VALID[4:]), "not a GGUF file")
    expect(ModelFormatError, write(tmp_path, b"GG"), "not a GGUF file")
    for version in (0, 1, 4, 2**32 - 1):
        expect(ModelFormatError, write(tmp_path, put(VALID, 4, version, 4)), f"version {version}")
    expect(UnsupportedModelError, write(tmp_path, put(VALID, 4, 3 << 24, 4)), "big-endian")


@pytest.mark.parametrize("cut", ["header", "metadata", "tensor_info", "padding", "tensor_data", "last_byte"])
def test_truncated(tmp_path: Path, cut: str) -> None:
    at = {
        "header": 20,
        "metadata": FIELDS["tokenizer.ggml.tokens"][-1][0] + 2,
        "tensor_info": TENSORS["b.weight"][3][0] + 3,
        "padding": HEADER_END + 1,
        "tensor_data": len(VALID) - 40,
        "last_byte": VALID.rindex(W_F16.tobytes()) + W_F16.nbytes - 1,
    }[cut]
    expect(ModelFormatError, write(tmp_path, VALID[:at]), "truncated")


def test_counts_beyond_file(tmp_path: Path) -> None:
    expect(ModelFormatError, write(tmp_path, put(VALID, 8, 2**63)), "tensor count 9223372036854775808")
    expect(ModelFormatError, write(tmp_path, put(VALID, 16, 2**64 - 1)), "metadata count")
    # Plausible but wrong counts: the reader runs off the end or misreads the data as headers.
    expect(ModelFormatError, write(tmp_path, put(VALID, 8, 40)))
    expect(ModelFormatError, write(tmp_path, put(VALID, 16, 40)))


def test_lengths_beyond_file(tmp_path: Path) -> None:
    string_len = FIELDS["general.name"][3][0]
    expect(ModelFormatError, write(tmp_path, put(VALID, string_len, 2**40)), "truncated", "metadata entry")
    key_len = FIELDS["general.name"][0][0]
    expect(ModelFormatError, write(tmp_path, put(VALID, key_len, 2**64 - 1)), "truncated")
    # The stock reader loops forever on these: past the end it reads empty arrays and carries on.
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.tokens"):
        count = FIELDS[key][4][0]
        expect(ModelFormatError, write(tmp_path, put(VALID, count, 2**64 - 1)), "truncated", "metadata entry")
    one_token_len = FIELDS["tokenizer.ggml.tokens"][5][0]
    expect(ModelFormatError, write(tmp_path, put(VALID, one_token_len, 10**6)), "truncated")
    name_len = TENSORS["b.weight"][0][0]
    expect(ModelFormatError, write(tmp_path, put(VALID, name_len, 2**50)), "truncated", "tensor infos")


def test_bad_metadata_values(tmp_path: Path) -> None:
    value_type = FIELDS["llama.block_count"][2][0]
    expect(ModelFormatError, write(tmp_path, put(VALID, value_type, 13, 4)), "GGUFValueType")
    item_type = FIELDS["tokenizer.ggml.token_type"][3][0]
    expect(ModelFormatError, write(tmp_path, put(VALID, item_type, 99, 4)), "GGUFValueType")
    expect(UnsupportedModelError, write(tmp_path, put(VALID, item_type, 9, 4)), "nested")
    name_off = FIELDS["general.name"][4][0]
    expect(ModelFormatError, write(tmp_path, put(VALID, name_off, 0xFF, 1)), "general.name", "UTF-8")
    # Two keys of equal length made equal.
    off, n = FIELDS["tokenizer.ggml.scores"][1]
    dup = VALID[:off] + b"tokenizer.ggml.tokens" + VALID[off + n:]
    assert len(dup) == len(VALID)
    expect(ModelFormatError, write(tmp_path, dup), "Duplicate")


def test_bad_tensor_infos(tmp_path: Path) -> None:
    name_len, name, n_dims, dims, qtype, offset = TENSORS["b.weight"]
    expect(ModelFormatError, write(tmp_path, put(VALID, offset[0], 2**40)), "truncated", "b.weight", "ends at byte")
    expect(ModelFormatError, write(tmp_path, put(VALID, offset[0], 2**64 - 32)), "truncated", "b.weight")
    for code in (4, 99, 2**32 - 1):
        expect(ModelFormatError, write(tmp_path, put(VALID, qtype[0], code, 4)), f"unknown type code {code}")
    expect(ModelFormatError, write(tmp_path, put(VALID, dims[0], 0)), "zero dimension")
    expect(ModelFormatError, write(tmp_path, put(VALID, dims[0] + 8, 2**40)), "needs", "bytes")
    expect(ModelFormatError, write(tmp_path, put(VALID, dims[0], 2**64 - 32)), "b.weight")
    expect(ModelFormatError, write(tmp_path, put(VALID, dims[0], 33)), "block size 32")
    expect(ModelFormatError, write(tmp_path, put(VALID, offset[0], 4)), "alignment")
    a_name = TENSORS["a.weight"][1][0]
    expect(ModelFormatError, write(tmp_path, put(VALID, a_name, ord("b"), 1)), "duplicate tensor name 'b.weight'")


def test_dimension_count(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "5d.gguf", {"x": (np.zeros((1, 1, 1, 2, 2), np.float32), None)})
    expect(ModelFormatError, path, "5 dimensions")
    path = write_gguf(tmp_path / "0d.gguf", {"x": (np.zeros((), np.float32), None)})
    expect(ModelFormatError, path, "0 dimensions")


def test_unsupported_type(tmp_path: Path) -> None:
    q8_1 = np.zeros((2, 40), np.uint8)  # two rows of one 32-element Q8_1 block (llama.cpp's activations only)
    path = write_gguf(tmp_path / "q8_1.gguf", {"a.weight": (W_F32, None), "q.weight": (q8_1, QType.Q8_1)})
    expect(UnsupportedModelError, path, "'q.weight'", "Q8_1")


class _Hang(BaseException):
    """Not an Exception, so that open_gguf's catch-all cannot swallow it."""


EDGES = [0, 1, 2, 3, 4, 8, 9, 24, 31, 32, 33, 255, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1,
         len(VALID), len(VALID) + 1, HEADER_END]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = VALID
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["flip", "slot", "slot", "slot"]))
        if kind == "flip":
            i = draw(st.integers(0, draw(st.sampled_from([HEADER_END, len(VALID) - 1]))))
            data = data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1:]
        else:
            offset, width = draw(st.sampled_from(SLOTS))
            value = draw(st.one_of(st.sampled_from(EDGES), st.integers(0, 2**(8 * width) - 1)))
            data = put(data, offset, value % 2**(8 * width), width)
    if draw(st.integers(0, 3)) == 0:
        data = data[:draw(st.integers(0, len(data)))]
    return data


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _raise_hang(signum: int, frame: object) -> None:
    raise _Hang("open_gguf took over 2 s")


@settings(max_examples=300, deadline=2000, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=mutated())
def test_fuzz(fuzz_dir: Path, data: bytes) -> None:
    path = write(fuzz_dir, data)
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    old_handler = signal.signal(signal.SIGALRM, _raise_hang)
    tracemalloc.start()
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        gf = open_gguf(path)
    except (ModelFormatError, UnsupportedModelError) as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 64 * len(data) + (1 << 20), f"{peak} bytes traced for a {len(data)}-byte file"
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss_before < 64 * 1024  # KiB
    assert gf.file_size == len(data)
    for t in gf.tensors.values():
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[t.ggml_type]
        assert t.raw.nbytes == math.prod(t.shape) // block_size * block_bytes
        root = t.raw
        while isinstance(root.base, np.ndarray):
            root = root.base
        assert root.nbytes == len(data)
        lo, hi = np.lib.array_utils.byte_bounds(t.raw)
        assert root.ctypes.data <= lo <= hi <= root.ctypes.data + len(data)
