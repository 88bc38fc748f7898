"""One file of KV pages on disk (a cached block, or a saved session's blocks), and what identifies
the engine that may read it.

A file is `MAGIC`, the header's length, a JSON header, then the payload: the pages' raw bytes as
the pool stores them (int8 / fp8 pages with their float32 scales, never converted). The header
names the engine's fingerprint, the tokens the pages stand for, each part's dtype and shape, and
the payload's CRC-32: a check against damage, not against someone who may write the folder (such
a one could rewrite any checksum kept beside the data); it runs 2.8x faster than SHA-256 here, and
reading and checking is a warm prompt's whole load. `read` checks all of it and raises
`KVFileError` naming the first thing that is wrong, so that a truncated, flipped, foreign or stale
file is refused, never loaded.

Writes go to a temporary file in the same folder, renamed over the name at the end (`os.replace`
is atomic), so a reader sees a whole file or none. No fsync: after a power loss a torn file fails
its checksum and is recomputed, which is all a cache owes.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import zlib
from pathlib import Path

import torch

MAGIC = b"WBKVPG01"
PREFIX = struct.Struct("<8sI")  # magic, header length
MAX_HEADER_BYTES = 16 * 2**20
FORMAT_VERSION = 1  # bump with any change to the layout of a file or of a block's pages

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)}


class KVFileError(ValueError):
    """A file that must not be loaded: what is wrong with it, in a few words."""


class FingerprintMismatch(KVFileError):
    """A whole, valid file written by an engine that is not this one (other weights, dtype, KV dtype...)."""

    def __init__(self, field: str, theirs: object, ours: object):
        super().__init__(f"it was written with {field} {theirs!r}; this engine's is {ours!r}")
        self.field = field


def engine_fingerprint(model_identity: str, dtype: str, kernels: str, kv_cache_dtype: torch.dtype,
                       block_size: int, kv_shape: tuple[int, int, int], tp_rank: int = 0, tp_size: int = 1) -> dict:
    """What a page's bytes depend on besides its tokens: the weights (`model_identity`), the
    activation dtype and the kernels (`kernels`: the ISA level of the packed path; both change the
    K/V computed, as torch's version may), the page dtype, the block size, the pool's (layers, KV
    heads, head dim) and the tensor-parallel shard. The prefix-cache salt is not here: it is the
    root of the chained block hash, so it is in every block's key."""
    return {"format": FORMAT_VERSION, "model": model_identity, "dtype": dtype, "kernels": kernels,
            "torch": torch.__version__, "kv_cache_dtype": str(kv_cache_dtype).removeprefix("torch."),
            "block_size": block_size, "kv_shape": list(kv_shape), "tp_rank": tp_rank, "tp_size": tp_size}


def fingerprint_digest(fingerprint: dict) -> bytes:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).digest()


def check_fingerprint(theirs: object, ours: dict) -> None:
    if not isinstance(theirs, dict):
        raise KVFileError("its header has no fingerprint")
    for key, value in ours.items():
        if theirs.get(key) != value:
            raise FingerprintMismatch(key, theirs.get(key), value)


def write_atomic(path: Path, header: dict, parts: list[torch.Tensor]) -> int:
    """Write `parts` (contiguous CPU tensors) under `header` to `path`, atomically. Returns the bytes written."""
    views = [memoryview(p.contiguous().view(torch.uint8).reshape(-1).numpy()) for p in parts]  # 1-D bytes, even empty
    crc = 0
    for v in views:
        crc = zlib.crc32(v, crc)
    header = {**header, "parts": [[str(p.dtype).removeprefix("torch."), list(p.shape)] for p in parts],
              "payload_bytes": sum(v.nbytes for v in views), "crc32": crc}
    head = json.dumps(header, separators=(",", ":")).encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(PREFIX.pack(MAGIC, len(head)))
            f.write(head)
            for v in views:
                f.write(v)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    return PREFIX.size + len(head) + header["payload_bytes"]


def read(path: Path, fingerprint: dict) -> tuple[dict, list[torch.Tensor], int]:
    """(header, parts, bytes read) of a file written by `write_atomic` under `fingerprint`.
    `FileNotFoundError` when there is none; `KVFileError` when it must not be loaded."""
    with open(path, "rb") as f:
        data = bytearray(os.fstat(f.fileno()).st_size)  # writable, so the parts are views, not copies
        if f.readinto(data) != len(data):
            raise KVFileError("shorter than its size (changed while read)")
    if len(data) < PREFIX.size:
        raise KVFileError("shorter than its prefix (truncated)")
    magic, head_len = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise KVFileError("not a wallbreaker KV file (bad magic)")
    if head_len > MAX_HEADER_BYTES or PREFIX.size + head_len > len(data):
        raise KVFileError("its header runs past the end (truncated)")
    try:
        header = json.loads(data[PREFIX.size:PREFIX.size + head_len])
    except ValueError:
        raise KVFileError("its header is not JSON") from None
    if not isinstance(header, dict):
        raise KVFileError("its header is not a JSON object")
    check_fingerprint(header.get("fingerprint"), fingerprint)
    payload = memoryview(data)[PREFIX.size + head_len:]
    if header.get("payload_bytes") != len(payload):
        raise KVFileError(f"{len(payload)} payload bytes where the header says {header.get('payload_bytes')} (truncated)")
    if zlib.crc32(payload) != header.get("crc32"):
        raise KVFileError("its payload fails its checksum")
    return header, _parts(header.get("parts"), payload), len(data)


def _parts(spec: object, payload: memoryview) -> list[torch.Tensor]:
    try:
        parts, offset = [], 0
        for dtype_name, shape in spec:
            dtype = _DTYPES[dtype_name]
            count = 1
            for s in shape:
                count *= int(s)
            size = count * dtype.itemsize
            raw = torch.frombuffer(payload[offset:offset + size], dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
            parts.append(raw.view(dtype).view(*[int(s) for s in shape]))
            offset += size
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise KVFileError(f"its parts do not describe its payload ({e})") from None
    if offset != len(payload):
        raise KVFileError("its parts do not cover its payload")
    return parts
