"""Kernels tuned where they run. For each format, the number of weight rows a tile takes in calls of
several activation rows (csrc/tile_driver.inc: 1, 2 or 4, each compiled) is timed on this host and
kept in `<cache>/kernel_tuning.json`, keyed by the CPU model and the kernel level: a Xeon and a Zen 3
differ in which tile keeps their vector units busy (issue 32), and a figure from one host says
nothing of another. Every choice gives a row the same bits (tests/test_kernels.py), so tuning
moves speed only.

`apply()` runs at the first load of a packed-weight model in a process: the stored choices for this
CPU and level, or, where none are stored, a measurement of about a second, then stored.
`WALLBREAKER_RETUNE=1` measures again; `WALLBREAKER_KERNEL_TUNING=0` keeps each level's defaults.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from .. import _C

log = logging.getLogger(__name__)

T = gguf.GGMLQuantizationType
VERSION = 1  # of what is measured; entries of another version are measured again
FORMATS = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K)  # what the real models store
ROWS = (4, 16)  # the calls a choice serves: a few sequences' decode, a verification, a batch
SHAPE = (2048, 2048)  # out x in; a pool of four such matrices is read from memory, not cache
MARGIN = 0.03  # another choice must beat the level's default by this much (a tie keeps the default)
_applied: tuple[str, dict[str, int]] | None = None  # (host key, choices) set in this process


def tuning_path() -> Path:
    from ..formats.packaged import cache_dir
    return cache_dir() / "kernel_tuning.json"


def host_key() -> str:
    from . import cpu_model
    return f"{cpu_model()} | {_C.isa()} | v{VERSION}"


def _timed(fn, calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - start) / calls


def measure(formats=FORMATS, rows=ROWS, shape=SHAPE, repeats: int = 5, calls: int = 8) -> dict[str, int]:
    """The fastest weight rows a tile for each format this level has tiles for: per choice, the
    median over `repeats` rounds (the choices interleaved in each) of `calls` products, summed over
    `rows` relative to the best choice at each; the level's default unless another is faster by
    more than MARGIN (two choices within the noise would otherwise flip from run to run)."""
    from . import pack_rows
    from .blocks import random_blocks
    rng = np.random.default_rng(0)
    choices = _C.weight_row_choices()
    chosen: dict[str, int] = {}
    for qtype in formats:
        default = _C.weight_rows(int(qtype))
        if not default:
            continue
        n, k = shape
        pool = [pack_rows(torch.from_numpy(random_blocks(qtype, n, k, rng)), qtype) for _ in range(4)]
        score = dict.fromkeys(choices, 0.0)
        try:
            for m in rows:
                x = torch.randn(m, k)
                times: dict[int, list[float]] = {c: [] for c in choices}
                for _ in range(repeats):
                    for c in choices:
                        _C.set_weight_rows(int(qtype), c)
                        _C.qmatmul(x, [pool[0]], [int(qtype)])  # warm the tile's code
                        times[c].append(_timed(lambda i: _C.qmatmul(x, [pool[i % 4]], [int(qtype)]), calls))
                medians = {c: statistics.median(t) for c, t in times.items()}
                best = min(medians.values())
                for c in choices:
                    score[c] += medians[c] / best
        finally:
            _C.set_weight_rows(int(qtype), 0)
        best = min(choices, key=score.__getitem__)
        chosen[qtype.name] = best if score[best] < score[default] * (1 - MARGIN) else default
    return chosen


def _stored(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _set(chosen: dict[str, int]) -> dict[str, int]:
    """Sets what is valid here; a name or count this build does not know is skipped (the file may
    be edited, or written by another version)."""
    done = {}
    for name, rows in chosen.items():
        try:
            _C.set_weight_rows(int(T[name]), int(rows))
            done[name] = int(rows)
        except (KeyError, ValueError, TypeError, RuntimeError):
            log.warning("kernel tuning: ignoring %s=%r (not a choice of this build)", name, rows)
    return done


def apply(retune: bool | None = None, path: Path | None = None) -> dict[str, int]:
    """This host's choices, set for the kernel level in use: stored, or measured and stored. Once a
    process (per level), unless `retune`."""
    global _applied
    if os.environ.get("WALLBREAKER_KERNEL_TUNING", "1") == "0":
        return {}
    retune = os.environ.get("WALLBREAKER_RETUNE") == "1" if retune is None else retune
    key = host_key()
    if _applied is not None and not retune and _applied[0] == key:
        return _applied[1]
    path = path or tuning_path()
    stored = _stored(path)
    entry = stored.get(key)
    if retune or not isinstance(entry, dict):
        start = time.perf_counter()
        entry = measure()
        log.info("kernel tuning for %s: %s (%.1f s), stored in %s", key, entry, time.perf_counter() - start, path)
        stored[key] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=2))
            tmp.replace(path)
        except OSError as e:  # a read-only cache: the choices hold for this process only
            log.warning("kernel tuning not stored (%s)", e)
    chosen = _set(entry)
    _applied = key, chosen
    return chosen
