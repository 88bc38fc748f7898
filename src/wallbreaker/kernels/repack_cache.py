"""The kernels' weight layout, written once to a file and mapped on every later load.

Where a weight's bytes in the model file are what the kernels read (the K-quants' rows, in file
order), the model reads the file's own mapping. Where they are not (the 32-blocks' group order,
llama q/k rows un-permuted, blocks made at load for float or int-code weights), the packed form is
written once to a cache file, keyed by the model files' identity, the layout version and the rank's
shard, and mapped from there: a later load reads the cache file's index and maps the rest, and the
weights live in the page cache, never in the process's own memory. (llama.cpp repacks such formats
in anonymous memory at every load instead.)

A cache file is checked on open: its trailer and index, the layout version, the source's identity,
every entry inside the data it describes. One that fails any check is rebuilt, never used. A build
writes to a temporary file renamed into place at the end, so a cut-off load leaves no half file;
the folder keeps the most recently used files within `MAX_BYTES`, and none unused for `MAX_AGE_DAYS`.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import struct
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..formats.mapping import as_tensor, map_file

logger = logging.getLogger("wallbreaker.kernels")

LAYOUT_VERSION = 2  # bump with any change to `pack_rows` or to what a load packs
MAGIC = b"WBPACK01"
TRAILER = struct.Struct("<QQ8s")  # index offset, index length, magic
ALIGN = 4096  # each tensor starts on a page
MAX_BYTES = 32 * 2**30
MAX_AGE_DAYS = 30
SAMPLE_BYTES = 1 << 20  # read from each end of each source file for its identity

Packed = tuple[torch.Tensor, int]  # [rows, row bytes] uint8 in the kernels' layout, GGML type


def source_identity(source: Path, shard: str = "") -> str:
    """What a packed form depends on: each source file's name, size, modification time and first and
    last MiB (a file rewritten in place changes at least its time), the layout version and the shard."""
    h = hashlib.sha256(f"layout {LAYOUT_VERSION} shard {shard}\n".encode())
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    for path in files:
        st = path.stat()
        h.update(f"{path.name} {st.st_size} {st.st_mtime_ns}\n".encode())
        with open(path, "rb") as f:
            h.update(f.read(SAMPLE_BYTES))
            if st.st_size > 2 * SAMPLE_BYTES:
                f.seek(st.st_size - SAMPLE_BYTES)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


class RepackCache:
    def __init__(self, directory: Path, identity: str):
        self.directory = directory
        self.identity = identity
        self.path = directory / f"{identity[:40]}.bin"
        self.hits = 0
        self.written = 0
        self._index: dict[str, list[int]] = {}  # key -> [offset, rows, row bytes, GGML type]
        self._data: np.ndarray | None = None  # the whole file, mapped, when it was found valid
        self._file = None  # the temporary file while building
        self._tmp: Path | None = None
        self._end = 0
        if not self._open():
            self._start()

    def packed(self, key: str, make: Callable[[], Packed]) -> Packed:
        """The packed blocks of `key` (a weight's name and slice): mapped from the cache file, or made
        now, written there and mapped back."""
        entry = self._index.get(key)
        if entry is not None and self._data is not None:
            offset, rows, row_bytes, qtype = entry
            self.hits += 1
            return as_tensor(self._data[offset:offset + rows * row_bytes].reshape(rows, row_bytes)), qtype
        blocks, qtype = make()
        if self._file is None:  # a valid file without this key: keep it in memory, rebuild next time
            logger.warning("repack cache %s lacks %s; it will be rebuilt at the next load", self.path, key)
            self._discard(self.path)
            return blocks, qtype
        try:
            return self._write(key, blocks, qtype), qtype
        except OSError as e:  # a full or read-only disk costs memory, not the load
            logger.warning("cannot write the repack cache %s (%s); weights stay in memory", self._tmp, e)
            self._abandon()
            return blocks, qtype

    def finish(self) -> None:
        """The load is done: a file being built gets its index and trailer and is renamed into place."""
        if self._file is None:
            return
        try:
            index = json.dumps({"layout": LAYOUT_VERSION, "identity": self.identity, "tensors": self._index}).encode()
            self._file.seek(self._end)
            self._file.write(index)
            self._file.write(TRAILER.pack(self._end, len(index), MAGIC))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
        except OSError as e:
            logger.warning("cannot finish the repack cache %s (%s)", self.path, e)
            self._abandon()
            return
        self._file = None
        self._evict()
        _trim_heap()

    def abort(self) -> None:
        """The load failed: no file is left behind."""
        if self._file is not None:
            self._abandon()

    # -- reading ----------------------------------------------------------------------------------
    def _open(self) -> bool:
        """Map a valid cache file; False (and the file removed) where there is none or it fails a check."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return False
        try:
            if size < TRAILER.size:
                raise ValueError("shorter than its trailer")
            data = map_file(self.path, 0, size)
            index_at, index_len, magic = TRAILER.unpack(bytes(data[size - TRAILER.size:]))
            if magic != MAGIC or index_at + index_len + TRAILER.size != size:
                raise ValueError("bad trailer (truncated or not a repack cache)")
            index = json.loads(bytes(data[index_at:index_at + index_len]))
            if index.get("layout") != LAYOUT_VERSION:
                raise ValueError(f"layout {index.get('layout')}, not {LAYOUT_VERSION}")
            if index.get("identity") != self.identity:
                raise ValueError("made from other model files")
            tensors = index["tensors"]
            for key, (offset, rows, row_bytes, _) in tensors.items():
                if offset % ALIGN or offset + rows * row_bytes > index_at:
                    raise ValueError(f"entry {key} lies outside the data")
        except (ValueError, KeyError, TypeError, OSError) as e:
            logger.warning("repack cache %s is not usable (%s); rebuilding it", self.path, e)
            self._discard(self.path)
            return False
        self._data, self._index = data, tensors
        os.utime(self.path)  # most recently used
        return True

    # -- building ---------------------------------------------------------------------------------
    def _start(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}-{id(self)}")
            self._file = open(self._tmp, "w+b")
        except OSError as e:
            logger.warning("cannot create a repack cache in %s (%s); weights stay in memory", self.directory, e)
            self._file = None

    def _write(self, key: str, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
        blocks = blocks.contiguous()
        offset = -(-self._end // ALIGN) * ALIGN
        self._file.seek(offset)
        self._file.write(memoryview(blocks.numpy()).cast("B"))
        self._file.flush()
        self._end = offset + blocks.numel()
        rows, row_bytes = blocks.shape
        self._index[key] = [offset, rows, row_bytes, int(qtype)]
        self.written += blocks.numel()
        return as_tensor(map_file(self._tmp, offset, blocks.numel()).reshape(rows, row_bytes))

    def _abandon(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        self._file = None
        self._discard(self._tmp)

    @staticmethod
    def _discard(path: Path | None) -> None:
        try:
            if path is not None:
                path.unlink()
        except OSError:
            pass

    def _evict(self) -> None:
        """Keep the most recently used files (this one always) within MAX_BYTES and MAX_AGE_DAYS. By
        size, not count: a test suite's hundred small files must not push out a user's 3 GB one."""
        try:
            files = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in self.directory.glob("*.bin")),
                           reverse=True)
        except OSError:
            return
        oldest = time.time() - MAX_AGE_DAYS * 86400
        total = 0
        for used, size, path in files:
            if path == self.path or (total + size <= MAX_BYTES and used >= oldest):
                total += size
            else:
                self._discard(path)


def _trim_heap() -> None:
    """Hand the heap's free memory back to the OS (glibc's malloc_trim). Packing allocates one tensor
    at a time, each under glibc's mmap threshold once it has grown, so their memory stays in the heap
    after they are freed: a 3B Q8_0 model's first load kept 3.2 GB of it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
