"""The prefix cache's disk tier: full KV blocks kept in files, so that a restart, a model swap or an
eviction from RAM does not pay a cold prefill again (what LMCache's disk tier does for vLLM).

Every full block the RAM prefix cache registers is also written here (write-through, so the disk
holds what RAM holds and more: a block evicted from RAM, or lost with the process, is already on
disk). The engine thread only copies the block's pages out of the pool (a memcpy, before the slots
can be reused) and queues them; a writer thread writes the file (kv_file.py: atomic, checksummed)
and keeps the folder within its quota, least recently used first. The writer waits while the engine
computes (unless half of MAX_PENDING_BYTES is queued) and runs at the lowest priority: a run without
hits must not pay for the tier, and on a CPU the writer's checksums and copies take cores and memory
bandwidth from the steps (two cores, SmolLM2, 4,000 tokens: decode 11% slower with the writer at
normal priority beside the steps, 5% at nice 19; within noise once it also waits).

A prompt whose prefix misses in RAM reads the following blocks from here, on the engine thread,
each checked before use: its engine fingerprint, its key, its tokens, its checksum. A file that
fails is counted (`bad`), removed, and its block computed again (and written anew); a file gone
(another process evicted it) is a miss.

A model with recurrent layers also needs the state after a cached prefix (kv/state_pool.py): each
state checkpoint the prefix cache keeps (the state at a prompt's last block boundary) is written too,
one file of its own (`STATE_SUFFIX`, the same format and checks), named by the chained hash of the
block it ends. A prefix found in RAM or here is used up to its deepest block with a state, in RAM or
here; a state file that fails its checks is counted (`bad`), removed, and its tokens computed again.

A file is named by its key, SHA-256 over the engine fingerprint's digest and the chained block
hash, so engines with different weights or page dtypes sharing one folder never read each other's
blocks, nor do requests with different `cache_salt` (the salt roots the hash chain). Several
processes may share a folder: writes are atomic renames, reads are of whole files, and a process
that evicts another's file costs that one a miss.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .cache import KVCache
from .kv_file import KVFileError, fingerprint_digest, read, write_atomic

logger = logging.getLogger("wallbreaker.kv")

SUFFIX = ".kvb"
STATE_SUFFIX = ".kvst"
MAX_PENDING_BYTES = 512 * 2**20  # pages copied out and not yet written; beyond, new blocks are not written
EVICT_TO = 0.9  # eviction frees down to this share of the quota, so it does not run at every write
STALE_TMP_S = 3600.0  # a temporary file this old was left by a process that died while writing


@dataclass
class DiskStats:
    hits: int = 0  # blocks read from disk into the pool
    misses: int = 0  # prefix lookups that found no file for their next block
    bad: int = 0  # files refused (truncated, corrupt, foreign) and recomputed
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    writes_dropped: int = 0  # blocks not written: the writer was behind, or a block exceeds the quota
    write_errors: int = 0  # writes that failed (a full disk, a read-only folder)
    evicted: int = 0  # files removed to keep within the quota
    states_read: int = 0  # recurrent states read from disk (as prefix-cache checkpoints)
    states_written: int = 0

    def as_dict(self) -> dict:
        """`kv_disk_<count>`: the names `stats()` and the server's snapshot use."""
        return {f"kv_disk_{k}": v for k, v in asdict(self).items()}


class DiskKVCache:
    def __init__(self, directory: Path, max_bytes: int, fingerprint: dict, kv_cache: KVCache):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.kv_cache = kv_cache
        self.stats = DiskStats()
        self._digest = fingerprint_digest(fingerprint)
        self._on_disk: set[bytes] = set()  # block hashes (b"S" + hash: states) this process wrote or read
        self._queue: queue.Queue[tuple[bytes, Path, dict, list[torch.Tensor], int] | None] = queue.Queue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._used_bytes: int | None = None  # the folder's size, as the writer last counted it
        self._writer: threading.Thread | None = None
        self._engine_idle = threading.Event()
        self._engine_idle.set()

    # -- the engine thread ------------------------------------------------------------------------
    def path(self, block_hash: bytes) -> Path:
        return self.directory / (hashlib.sha256(self._digest + block_hash).hexdigest()[:48] + SUFFIX)

    def state_path(self, block_hash: bytes) -> Path:
        return self.directory / (hashlib.sha256(self._digest + b"state" + block_hash).hexdigest()[:48] + STATE_SUFFIX)

    def store(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Queue a newly full block for writing (its pages copied now: the slots may be reused)."""
        header = {"block_hash": block_hash.hex(), "token_ids": list(token_ids)}
        self._enqueue(block_hash, self.path(block_hash), header, self.kv_cache.block_nbytes,
                      lambda: self.kv_cache.read_block(block_id))

    def store_state(self, block_hash: bytes, read_state: Callable[[], list[torch.Tensor]], nbytes: int) -> None:
        """Queue the recurrent state after the block `block_hash` (a prefix-cache checkpoint) for
        writing; `read_state` copies it now (its slot may be reused)."""
        self._enqueue(b"S" + block_hash, self.state_path(block_hash), {"kind": "state", "block_hash": block_hash.hex()},
                      nbytes, read_state)

    def _enqueue(self, key: bytes, path: Path, header: dict, size: int,
                 read_parts: Callable[[], list[torch.Tensor]]) -> None:
        """Queue a file for the writer (`key`: what `_on_disk` knows it by)."""
        if key in self._on_disk:
            return
        with self._lock:
            if self._pending_bytes + size > MAX_PENDING_BYTES or size > self.max_bytes:
                self.stats.writes_dropped += 1
                return
            self._pending_bytes += size
        self._on_disk.add(key)
        self._start_writer()
        self._queue.put((key, path, header, read_parts(), size))

    def load_state(self, block_hash: bytes, shapes: list[tuple[int, ...]]) -> list[torch.Tensor] | None:
        """The recurrent state after the block `block_hash`, checked (float32 parts of `shapes`);
        None where there is none or its file is bad (then removed: the tokens are computed again)."""
        path = self.state_path(block_hash)
        try:
            header, parts, size = read(path, self.fingerprint)
            if header.get("kind") != "state" or header.get("block_hash") != block_hash.hex():
                raise KVFileError("it holds another state (its key differs)")
            if [tuple(p.shape) for p in parts] != shapes or any(p.dtype != torch.float32 for p in parts):
                raise KVFileError("its state has another shape or dtype")
        except FileNotFoundError:
            return None
        except (KVFileError, OSError) as e:
            self.stats.bad += 1
            logger.warning("KV disk cache: recurrent state file %s is not usable (%s); its tokens are computed again",
                           path.name, e)
            _remove(path)
            return None
        self.stats.states_read += 1
        self.stats.bytes_read += size
        self._on_disk.add(b"S" + block_hash)
        _touch(path)
        return parts

    def load(self, block_hash: bytes, token_ids: tuple[int, ...]) -> list[torch.Tensor] | None:
        """The pages of the block with this key and these tokens, checked; None on a miss or a bad file."""
        path = self.path(block_hash)
        try:
            header, parts, size = read(path, self.fingerprint)
            if header.get("block_hash") != block_hash.hex():
                raise KVFileError("it holds another block (its key differs)")
            if header.get("token_ids") != list(token_ids):
                raise KVFileError("it holds other tokens")
            if [tuple(p.shape) for p in parts] != self.kv_cache.block_shapes or \
                    [p.dtype for p in parts] != self.kv_cache.block_dtypes:
                raise KVFileError("its pages have another shape or dtype")
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except (KVFileError, OSError) as e:
            self.stats.bad += 1
            logger.warning("KV disk cache: %s is not usable (%s); its block is computed again", path.name, e)
            _remove(path)
            return None
        self.stats.hits += 1
        self.stats.bytes_read += size
        self._on_disk.add(block_hash)
        _touch(path)
        return parts

    def set_engine_idle(self, idle: bool) -> None:
        """The scheduler says whether the engine has work (the writer then waits) or none."""
        if idle:
            self._engine_idle.set()
        else:
            self._engine_idle.clear()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped); False if `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                if self._pending_bytes == 0:
                    return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)

    def close(self, timeout_s: float | None = 60.0) -> None:
        """Write what is queued, then stop the writer."""
        self._engine_idle.set()
        self.flush(timeout_s)
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout_s)
            self._writer = None

    def stats_dict(self) -> dict:
        return self.stats.as_dict()

    def write_block(self, block_id: int, parts: list[torch.Tensor]) -> None:
        """Put pages `load` returned into a block of the pool."""
        self.kv_cache.write_block(block_id, parts)

    # -- the writer thread ------------------------------------------------------------------------
    def _start_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="wallbreaker-kv-disk", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        _lowest_priority()
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, path, header, parts, size = item
            while not self._engine_idle.wait(0.05):
                with self._lock:
                    if self._pending_bytes > MAX_PENDING_BYTES // 2:
                        break
            try:
                self._write(path, header, parts)
            except Exception as e:  # a full disk, a read-only folder, a folder removed under us
                self.stats.write_errors += 1
                self._on_disk.discard(key)
                logger.warning("KV disk cache: cannot write a block to %s (%s)", self.directory, e)
            finally:
                with self._lock:
                    self._pending_bytes -= size

    def _write(self, path: Path, header: dict, parts: list[torch.Tensor]) -> None:
        # replaced if there: a file this process did not read is one it could not use
        written = write_atomic(path, {"fingerprint": self.fingerprint, **header}, parts)
        if header.get("kind") == "state":
            self.stats.states_written += 1
        else:
            self.stats.blocks_written += 1
        self.stats.bytes_written += written
        if self._used_bytes is None:
            self._used_bytes = self._folder_bytes()
        else:
            self._used_bytes += written
        if self._used_bytes > self.max_bytes:
            self._evict()

    def _folder_bytes(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every block file; temporary files of dead writers are removed."""
        entries = []
        now = time.time()
        for entry in os.scandir(self.directory):
            try:
                st = entry.stat()
            except OSError:
                continue  # removed meanwhile
            if entry.name.endswith((SUFFIX, STATE_SUFFIX)):
                entries.append((st.st_mtime, st.st_size, Path(entry.path)))
            elif entry.name.startswith(".") and ".tmp-" in entry.name and now - st.st_mtime > STALE_TMP_S:
                _remove(Path(entry.path))
        return entries

    def _evict(self) -> None:
        """Remove the least recently used files (by any process sharing the folder) until within the quota."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes * EVICT_TO:
                break
            if _remove(path):
                self.stats.evicted += 1
            total -= size
        self._used_bytes = total
        self._on_disk.clear()  # which of ours went is unknown: a block registered again is written again


def _remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False


def _touch(path: Path) -> None:
    """Mark `path` most recently used (eviction goes by modification time)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _lowest_priority() -> None:
    """The calling thread at nice 19 (Linux, where a thread has a priority of its own): writes take
    the CPU the engine leaves."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
