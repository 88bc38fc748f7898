"""The one place wallbreaker opens GGUF files.

A GGUF file from the internet is untrusted input. `open_gguf` parses it with `gguf.GGUFReader`
behind a guard, so that a malformed file yields `ModelFormatError` (or `UnsupportedModelError` for
a well-formed file we cannot run) with a one-line message naming the file, and never another
exception, a hang, or an allocation out of proportion to the file's size.
"""
from __future__ import annotations

import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType as VType

from wallbreaker.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError, WallbreakerError
from wallbreaker.formats.dequant import SUPPORTED_TYPES

# Every type formats/dequant.py reads (the quantized kernels run some of them as stored; the rest
# are dequantized at load and, on the auto path, requantized to Q8_0: models/source.py).
RUNNABLE_TYPES: frozenset[QType] = SUPPORTED_TYPES

MAX_DIMS = 4
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
_U64 = struct.Struct("<Q")
# The fewest bytes one entry can take, so that a count can be checked against the file size.
_MIN_KV_BYTES = 8 + 4 + 1  # key length (empty key), value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length (empty name), n_dims (no dims), type, offset
_PSEUDO_FIELDS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: QType
    shape: tuple[int, ...]  # torch order: outermost first (GGUF stores dims innermost first)
    raw: np.ndarray  # uint8, 1-D, memory-mapped, exactly the tensor's bytes


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _GuardedReader(gguf.GGUFReader):
    """`gguf.GGUFReader` made safe and fast on untrusted input.

    - `_get` refuses any read past the end of the file. The stock reader returns a short (even
      empty) array there, so an array field that claims 2**64 scalar elements loops forever.
    - A metadata array is kept as one byte span (`parts[-1]`) rather than one numpy view per
      element: the stock reader's view per element costs time and memory on every token of a vocab.
      (So `ReaderField.contents()` does not apply to array fields here; `_value` decodes them.)
    - Tensor infos are left unbuilt in `tensor_fields`; `open_gguf` validates them itself.
    """

    tensor_fields: list[gguf.ReaderField]

    def __init__(self, path: Path, label: str):
        self.label = label
        super().__init__(path, "r")

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > self.data.size:
            self._past_eof(end)
        return super()._get(offset, dtype, count, override_order)

    def _past_eof(self, end: int) -> NoReturn:
        raise ModelFormatError(
            f"{self.label}: truncated: {self._where()} needs bytes up to {end} but the file has {self.data.size} bytes")

    def _where(self) -> str:
        keys = [k for k in self.fields if k not in _PSEUDO_FIELDS]
        kv_count = self.fields.get("GGUF.kv_count")
        if kv_count is None:
            return "the header"
        if len(keys) < int(kv_count.parts[0][0]):
            return f"metadata entry {len(keys)}" + (f" (after {keys[-1]!r})" if keys else "")
        return "the tensor infos"

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[VType]]:
        if raw_type != VType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_item_type = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        start = orig_offs + 12
        item_type, n = VType(int(raw_item_type[0])), int(count[0])
        if item_type == VType.ARRAY:
            raise UnsupportedModelError(f"{self.label}: {self._where()}: nested metadata arrays are not supported")
        if item_type == VType.STRING:
            end = self._skip_strings(start, n)
        else:
            end = start + n * np.dtype(self.gguf_scalar_to_np[item_type]).itemsize
        span = self._get(start, np.uint8, end - start)
        return end - orig_offs, [raw_item_type, count, span], [2], [VType.ARRAY, item_type]

    def _skip_strings(self, offs: int, n: int) -> int:
        size = self.data.size
        if n > (size - offs) // 8:
            self._past_eof(offs + 8 * n)
        with memoryview(self.data) as buf:
            for _ in range(n):
                if offs + 8 > size:
                    self._past_eof(offs + 8)
                offs += 8 + _U64.unpack_from(buf, offs)[0]
        return offs

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        self.tensor_fields = fields


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open and validate a GGUF file; tensor bytes stay memory-mapped, metadata is decoded."""
    path = Path(path)
    label = str(path)
    try:
        st = path.stat()
    except OSError as e:
        raise ModelNotFoundError(f"{label}: {e.strerror or 'cannot stat'}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelNotFoundError(f"{label}: is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelFormatError(f"{label}: not a regular file")
    _check_header(path, label, st.st_size)
    try:
        reader = _GuardedReader(path, label)
        size = int(reader.data.size)
        metadata = {name: _value(field, label) for name, field in reader.fields.items() if name not in _PSEUDO_FIELDS}
        tensors = _tensors(reader, label, size)
    except WallbreakerError:
        raise
    except Exception as e:  # GGUFReader's own checks: ValueError, KeyError, IndexError, ...
        detail = " ".join(str(e).split())[:200]
        raise ModelFormatError(f"{label}: malformed GGUF: {type(e).__name__}: {detail}") from e
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, file_size=size)


def _check_header(path: Path, label: str, size: int) -> None:
    """Check the fixed header and bound its counts by the file size before GGUFReader sees it."""
    if size == 0:
        raise ModelFormatError(f"{label}: empty file, not a GGUF file")
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError as e:
        raise ModelNotFoundError(f"{label}: {e.strerror or 'cannot read'}") from None
    if head[:4] != b"GGUF":
        raise ModelFormatError(f"{label}: not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    if len(head) < _HEADER.size:
        raise ModelFormatError(f"{label}: truncated: the header needs {_HEADER.size} bytes but the file has {size}")
    _, version, n_tensors, n_kv = _HEADER.unpack(head)
    if version not in (2, 3):
        if int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
            raise UnsupportedModelError(f"{label}: big-endian GGUF files are not supported")
        raise ModelFormatError(f"{label}: unsupported GGUF version {version} (2 and 3 are supported)")
    room = size - _HEADER.size
    if n_kv * _MIN_KV_BYTES > room:
        raise ModelFormatError(f"{label}: metadata count {n_kv} cannot fit in a file of {size} bytes")
    if n_tensors * _MIN_TENSOR_INFO_BYTES > room:
        raise ModelFormatError(f"{label}: tensor count {n_tensors} cannot fit in a file of {size} bytes")
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > room:
        raise ModelFormatError(
            f"{label}: {n_kv} metadata entries and {n_tensors} tensors cannot fit in a file of {size} bytes")


def _value(field: gguf.ReaderField, label: str) -> Any:
    kind = field.types[0]
    if kind == VType.ARRAY:
        item_type, span = field.types[1], field.parts[-1]
        if item_type == VType.STRING:
            return _decode_strings(span.tobytes(), int(field.parts[-2][0]))
        if item_type == VType.BOOL:
            return (span != 0).tolist()
        return span.view(np.dtype(gguf.GGUFReader.gguf_scalar_to_np[item_type]).newbyteorder("<")).tolist()
    if kind == VType.STRING:
        try:
            return field.parts[-1].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFormatError(f"{label}: metadata {field.name!r} is not valid UTF-8") from None
    if kind == VType.BOOL:
        return bool(field.parts[-1][0])
    return field.parts[-1][0].item()


def _decode_strings(blob: bytes, n: int) -> list[str]:
    """Decode a string array laid out as (u64 length, bytes) pairs; lengths were checked by the reader.

    Token lists can hold byte tokens that are not UTF-8 on their own; surrogateescape keeps them
    lossless (`s.encode("utf-8", "surrogateescape")` gives back the bytes).
    """
    out, pos = [], 0
    for _ in range(n):
        length = _U64.unpack_from(blob, pos)[0]
        pos += 8
        out.append(blob[pos:pos + length].decode("utf-8", "surrogateescape"))
        pos += length
    return out


def _tensors(reader: _GuardedReader, label: str, size: int) -> dict[str, GGUFTensor]:
    alignment, data_start = int(reader.alignment), int(reader.data_offset)
    tensors: dict[str, GGUFTensor] = {}
    for field in reader.tensor_fields:
        _, _, n_dims, dims, raw_type, raw_offset = field.parts
        name, what = field.name, f"{label}: tensor {field.name!r}"
        if name in tensors:
            raise ModelFormatError(f"{label}: duplicate tensor name {name!r}")
        if not 1 <= int(n_dims[0]) <= MAX_DIMS:
            raise ModelFormatError(f"{what} has {int(n_dims[0])} dimensions (1 to {MAX_DIMS} allowed)")
        gguf_dims = [int(d) for d in dims]  # innermost first
        shape = tuple(reversed(gguf_dims))
        if min(gguf_dims) < 1:
            raise ModelFormatError(f"{what} has a zero dimension: shape {shape}")
        code = int(raw_type[0])
        try:
            ggml_type = QType(code)
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise ModelFormatError(f"{what} has unknown type code {code}") from None
        if gguf_dims[0] % block_size:
            raise ModelFormatError(
                f"{what}: row length {gguf_dims[0]} is not a multiple of the {ggml_type.name} block size {block_size}")
        nbytes = math.prod(gguf_dims) // block_size * block_bytes
        if nbytes > size:
            raise ModelFormatError(f"{what} of shape {shape} needs {nbytes} bytes, more than the file's {size}")
        offset = int(raw_offset[0])
        if offset % alignment:
            raise ModelFormatError(f"{what}: data offset {offset} is not a multiple of the alignment {alignment}")
        start, end = data_start + offset, data_start + offset + nbytes
        if end > size:
            raise ModelFormatError(f"{label}: truncated: tensor {name!r} ends at byte {end} but the file has {size} bytes")
        tensors[name] = GGUFTensor(name, ggml_type, shape, reader.data[start:end])
    for t in tensors.values():
        if t.ggml_type not in RUNNABLE_TYPES:
            raise UnsupportedModelError(f"{label}: tensor {t.name!r} has type {t.ggml_type.name}, which wallbreaker cannot run")
    return tensors
