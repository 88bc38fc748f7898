"""Saved sessions: a prompt's cached prefix written to a named file, and read back into the prefix
cache later (in another process, after a restart), as llama-server's slot save / restore does.

A session file (kv_file.py's format) holds the prefix's tokens, the root of its block-hash chain
(the digest of its `cache_salt`, never the salt itself) and every full block's pages in one
payload. Restoring checks the file whole (fingerprint, checksum, shapes), recomputes each block's
key from the tokens, and puts the blocks into the RAM prefix cache as free cached blocks: the next
request that starts with those tokens (and has the same salt) hits them, as if it had computed them.
A session written by another engine (other weights, dtype, page dtype, block size) is refused with
the field that differs. A model with recurrent layers also needs the state after the prefix (kv/state_pool.py):
the session then holds the blocks up to the deepest one whose state the prefix cache kept, and that
state after them, under the same checksum; restoring makes it that block's checkpoint again. Sessions are explicit and named, so nothing evicts them: their folder has
a quota of its own (`kv_cache_sessions_gb`), and a save that would pass it is refused, naming what
the folder holds, rather than deleting a session someone may come back for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InvalidRequestError
from .block_manager import BlockManager
from .block_pool import Block, hash_block, salt_digest
from .cache import KVCache
from .kv_file import FingerprintMismatch, KVFileError, read, write_atomic
from .state_pool import StatePool

SUFFIX = ".kvs"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class SessionNotFoundError(InvalidRequestError):
    """No saved session has this name."""


def check_session_name(name: object) -> None:
    """A name is a file name of its own in the sessions folder: no path, no hidden file."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequestError("a session name is 1 to 128 letters, digits, '.', '_' or '-', "
                                  "starting with a letter or digit", param="name")


@dataclass
class SessionInfo:
    name: str
    num_tokens: int  # tokens whose K/V the session holds (its full blocks)
    num_blocks: int
    nbytes: int  # of the session file


class SessionStore:
    def __init__(self, directory: Path, fingerprint: dict, kv_cache: KVCache, quota_bytes: int,
                 states: StatePool | None = None):
        """`states`: the recurrent layers' state pool, where the model has any."""
        self.states = states
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.kv_cache = kv_cache
        self.quota_bytes = quota_bytes

    def _check_room(self, name: str, nbytes: int) -> None:
        """Refuse a save of `nbytes` that would take the folder past the quota (the session it
        replaces does not count). Processes sharing the folder each check before writing, so two
        saving at once may pass it by one session."""
        if self.quota_bytes == 0:
            raise InvalidRequestError("saving sessions is off (kv_cache_sessions_gb=0)", param="name")
        others = [f for f in self.directory.glob(f"*{SUFFIX}") if f.name != f"{name}{SUFFIX}"]
        used = 0
        for f in others:
            try:
                used += f.stat().st_size
            except FileNotFoundError:  # deleted meanwhile
                pass
        if used + nbytes > self.quota_bytes:
            raise InvalidRequestError(
                f"session {name!r} needs {nbytes / 2**20:.1f} MiB, and the saved sessions already take "
                f"{used / 2**20:.1f} MiB ({len(others)} files) of kv_cache_sessions_gb="
                f"{self.quota_bytes / 2**30:g} GiB; delete sessions or raise the limit", param="name")

    def path(self, name: str) -> Path:
        check_session_name(name)
        return self.directory / f"{name}{SUFFIX}"

    def delete(self, name: str) -> SessionInfo:
        path = self.path(name)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            raise SessionNotFoundError(f"no saved session named {name!r}", param="name") from None
        return SessionInfo(name, 0, 0, size)

    def save(self, name: str, token_ids: list[int], cache_salt: str | None, manager: BlockManager) -> SessionInfo:
        """Write the cached full blocks of `token_ids` (the RAM prefix cache's, as far as they go
        unbroken from the start) as session `name`, replacing any of that name."""
        path = self.path(name)
        blocks: list[Block] = []
        for block_hash, tokens in manager.prompt_blocks(token_ids, cache_salt, len(token_ids)):
            block = manager.pool.cached(block_hash, tokens)
            if block is None:
                break
            blocks.append(block)
        state: list[torch.Tensor] = []
        if self.states is not None and blocks:
            blocks, state = self._with_state(blocks)
            if not blocks:
                raise InvalidRequestError("the prefix cache kept no recurrent state after the prompt's blocks to save "
                                          "(prefix_state_slots=0 keeps none)", param="prompt")
        if not blocks:
            raise InvalidRequestError(f"nothing of the prompt is in the prefix cache to save (it needs at least "
                                      f"{manager.block_size} tokens, one full block)", param="prompt")
        pages = [self.kv_cache.read_block(b.block_id) for b in blocks]
        parts = [torch.stack([p[i] for p in pages]) for i in range(len(pages[0]))]  # [blocks, ...] each
        parts += state
        root = salt_digest(cache_salt)
        num_tokens = len(blocks) * manager.block_size
        self._check_room(name, sum(p.numel() * p.element_size() for p in parts))
        header = {"fingerprint": self.fingerprint, "kind": "session", "name": name,
                  "salt_root": root.hex() if root is not None else None, "token_ids": token_ids[:num_tokens],
                  "state_parts": len(state)}
        self.directory.mkdir(parents=True, exist_ok=True)
        nbytes = write_atomic(path, header, parts)
        return SessionInfo(name, num_tokens, len(blocks), nbytes)

    def _with_state(self, blocks: list[Block]) -> tuple[list[Block], list[torch.Tensor]]:
        """`blocks` cut to the deepest one with a state checkpoint, and a copy of that state (none:
        no blocks)."""
        for depth in range(len(blocks), 0, -1):
            slot = self.states.checkpoints.get(blocks[depth - 1].hash)
            if slot is not None:
                return blocks[:depth], self.states.read_slot(slot)
        return [], []

    def load(self, name: str, manager: BlockManager) -> tuple[SessionInfo, list[int]]:
        """Put session `name`'s blocks into the RAM prefix cache, as far as the pool has room; the
        session's facts (`num_tokens`: the tokens restored) and its token ids."""
        path = self.path(name)
        try:
            header, parts, nbytes = read(path, self.fingerprint)
        except FileNotFoundError:
            raise SessionNotFoundError(f"no saved session named {name!r}", param="name") from None
        except FingerprintMismatch as e:
            raise InvalidRequestError(f"session {name!r} cannot be restored into this engine: {e}", param="name") from None
        except (KVFileError, OSError) as e:
            raise InvalidRequestError(f"session {name!r} is not usable: {e}", param="name") from None
        token_ids, root, num_state = header.get("token_ids"), header.get("salt_root"), header.get("state_parts", 0)
        bs = manager.block_size
        try:
            want_state = self.states.part_shapes if self.states is not None else []
            if num_state != len(want_state) or not isinstance(num_state, int) or num_state > len(parts):
                raise ValueError("its recurrent state does not match this engine's layers")
            parts, state = parts[:len(parts) - num_state], parts[len(parts) - num_state:]
            if [tuple(p.shape) for p in state] != want_state or any(p.dtype != torch.float32 for p in state):
                raise ValueError("its recurrent state has another shape or dtype")
            root_bytes = bytes.fromhex(root) if root is not None else None
            if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
                raise ValueError("bad token ids")
            num_blocks = len(token_ids) // bs
            if len(token_ids) % bs or [tuple(p.shape) for p in parts] != [(num_blocks, *s) for s in self.kv_cache.block_shapes] \
                    or [p.dtype for p in parts] != self.kv_cache.block_dtypes:
                raise ValueError("its pages do not match its tokens")
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"session {name!r} is not usable: {e}", param="name") from None
        pool = manager.pool
        held: list[Block] = []
        parent = root_bytes
        for i in range(num_blocks):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            parent = hash_block(parent, tokens)
            block = pool.cached(parent, tokens)
            if block is not None:
                pool.retain(block)
            elif pool.num_free:
                block = pool.allocate()
                self.kv_cache.write_block(block.block_id, [p[i] for p in parts])
                pool.register(block, parent, tokens)
            else:
                break
            held.append(block)
        restored = len(held)
        if self.states is not None and (restored < num_blocks or restored and self.states.restore_checkpoint(
                held[-1].hash, state) is None):
            restored = 0  # without the state after them, the blocks cannot start a prompt
        for block in reversed(held):  # the first block freed last: the last the pool evicts
            pool.release(block)
        return SessionInfo(name, restored * bs, restored, nbytes), token_ids
