"""Kernels tuned where they run. For each format, the knobs of csrc/ (qkernels.h: Knob) are timed on
this host and kept in `<cache>/kernel_tuning.json`, keyed by what names the CPU (vendor, family, model,
stepping and cache sizes: kernels/cpu_id.py; the model name does not, every AMD VM says `AMD EPYC`)
and the kernel level:

- `rows_m1`, `rows_m1_long`: the weight rows a batch-1 tile takes (1, 2 or 4), for rows of at most
  4096 values and for longer ones. Which keeps the memory busy depends on the CPU's prefetchers and
  the format's arithmetic: on a Zen 4, Q4_K streams fastest at 4, Q6_K at 2, the 32-block formats'
  rows of 1,536 values at 1 and their rows of 8,960 values at 4.
- `prefetch`: how far ahead of a tile the software prefetch runs (2 to 16 KB).
- `rows`: the weight rows a tile takes in calls of several activation rows (a few sequences'
  decode, a verification, a batch), where the arithmetic, not the memory, is the bound.

Each choice gives a row the same bits (tests/test_kernels.py checks every one), so tuning moves
speed only; a choice is kept only where it beats the level's default by MARGIN (two within the
noise would otherwise flip from run to run). The batch-1 knobs are timed on a pool of weights
larger than the last-level cache, as a decode step reads them.

`apply()` runs at the first load of a packed-weight model in a process: the stored choices for this
CPU and level, or, where none are stored, a measurement of a few seconds, then stored with when it
ran and a probe: the seconds of one fixed call (Q8_0 at the level's defaults, batch 1, over the
pool), best of PROBE_PASSES, taken before and after the measurement, the slower kept. A neighbour
that took a core during the measurement slowed a probe too, so the next CHECKS loads time the probe
again (a fraction of a second) and measure everything again where it now runs RETIME_MARGIN faster
than when the choices were made: a busy first run does not stay the host's truth, and at most
CHECKS loads pay for a probe. `wallbreaker roofline` shows the choices and when they were timed
(`describe`). `WALLBREAKER_RETUNE=1` measures again; `WALLBREAKER_KERNEL_TUNING=0` keeps each
level's defaults.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch

from .. import _C

log = logging.getLogger(__name__)

T = gguf.GGMLQuantizationType
VERSION = 3  # of what is measured and stored; entries of another version are measured again
FORMATS = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K)  # what the real models store
ROWS = (4, 16)  # the calls `rows` serves
SHORT, LONG = (2048, 2048), (1024, 8192)  # out x in: batch-1 shapes on either side of 4096 values a row
POOL_MB = (64, 256)  # the batch-1 pool: twice the last-level cache, within these bounds
MARGIN = 0.03
PROBE_PASSES = 5
CHECKS = 3  # later loads that time the probe again
RETIME_MARGIN = 0.15  # a probe this much faster than at tuning time: the tuning ran on a busy host
# Seconds a call of fn over each weight of the pool takes; tests inject a clock of their own.
Timer = Callable[[Callable[[torch.Tensor], object], list[torch.Tensor]], float]
_applied: tuple[str, dict[str, dict[str, int]]] | None = None  # (host key, choices) set in this process


def tuning_path() -> Path:
    from ..formats.packaged import cache_dir
    return cache_dir() / "kernel_tuning.json"


def host_key() -> str:
    from .cpu_id import this_cpu
    return f"{this_cpu()} | {_C.isa()} | v{VERSION}"


def last_level_cache_bytes() -> int:
    """The largest cache sysfs reports for CPU 0 (0 where it says nothing)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=0)


def _pool(qtype: T, shape: tuple[int, int], megabytes: int, rng: np.random.Generator) -> list[torch.Tensor]:
    """Distinct copies of one random matrix, `megabytes` in all (at least 4)."""
    from . import pack_rows
    from .blocks import random_blocks
    one = pack_rows(torch.from_numpy(random_blocks(qtype, *shape, rng)), qtype)
    return [one.clone() for _ in range(max(4, (megabytes << 20) // one.numel()))]


def seconds_a_call(fn: Callable[[torch.Tensor], object], pool: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in pool:
        fn(w)
    return (time.perf_counter() - start) / len(pool)


def _choose(qtype: T, knob: str, cases: list[tuple[torch.Tensor, list[torch.Tensor]]], repeats: int,
            timer: Timer) -> int:
    """The fastest value of `knob` for qtype over `cases` (activations, weight pool): per value, the
    best of `repeats` passes (the values interleaved in each), summed over the cases relative to the
    best value of each; the level's default unless another beats it by MARGIN. The best pass, not
    the median: a neighbour only ever slows a pass, and on a shared host the read bandwidth swings
    within a minute (32-58 GB/s on a Zen 4), more than the knobs' differences."""
    choices, default = _C.tuning_choices(knob), _C.tuning(int(qtype), knob)
    score = dict.fromkeys(choices, 0.0)
    try:
        for x, pool in cases:
            times: dict[int, list[float]] = {c: [] for c in choices}
            for _ in range(repeats):
                for c in choices:
                    _C.set_tuning(int(qtype), knob, c)
                    _C.qmatmul(x, [pool[0]], [int(qtype)])  # warm the tile's code
                    times[c].append(timer(lambda w: _C.qmatmul(x, [w], [int(qtype)]), pool))
            fastest = {c: min(t) for c, t in times.items()}
            best = min(fastest.values())
            for c in choices:
                score[c] += fastest[c] / best
    finally:
        _C.set_tuning(int(qtype), knob, 0)
    best = min(choices, key=score.__getitem__)
    return best if score[best] < score[default] * (1 - MARGIN) else default


def measure(formats=FORMATS, rows=ROWS, short=SHORT, long=LONG, pool_mb: int | None = None,
            repeats: int = 7, timer: Timer = seconds_a_call) -> dict[str, dict[str, int]]:
    """This host's choices for each format the level has tiles for: the batch-1 weight rows (short
    and long rows) and prefetch distance on a pool beyond the last-level cache, then the weight
    rows of several-row calls. Each knob is timed with the ones chosen before it set."""
    pool_mb = pool_mb or default_pool_mb()
    rng = np.random.default_rng(0)
    chosen: dict[str, dict[str, int]] = {}
    for qtype in formats:
        if not _C.tuning(int(qtype), "rows"):
            continue
        picks: dict[str, int] = {}
        pools = {shape: _pool(qtype, shape, pool_mb, rng) for shape in (short, long)}
        one = {shape: (torch.randn(1, shape[1]), pool) for shape, pool in pools.items()}
        try:
            for knob, cases in (("rows_m1", [one[short]]), ("rows_m1_long", [one[long]]),
                                ("prefetch", list(one.values())),
                                ("rows", [(torch.randn(m, short[1]), pools[short][:8]) for m in rows])):
                picks[knob] = _choose(qtype, knob, cases, repeats, timer)
                _C.set_tuning(int(qtype), knob, picks[knob])
        finally:
            for knob in picks:
                _C.set_tuning(int(qtype), knob, 0)
        chosen[qtype.name] = picks
    return chosen


def default_pool_mb() -> int:
    return min(max(2 * last_level_cache_bytes() >> 20, POOL_MB[0]), POOL_MB[1])


def probe(shape: tuple[int, int] = SHORT, pool_mb: int | None = None, passes: int = PROBE_PASSES,
          timer: Timer = seconds_a_call) -> float:
    """Seconds of a batch-1 Q8_0 call at the level's default knobs over a pool beyond the last-level
    cache, best of `passes`: how fast the host runs now, for comparing a tuning run with later loads."""
    qtype = T.Q8_0
    pool = _pool(qtype, shape, pool_mb or default_pool_mb(), np.random.default_rng(1))
    x = torch.randn(1, shape[1])
    fn = lambda w: _C.qmatmul(x, [w], [int(qtype)])  # noqa: E731
    knobs = {k: _C.tuning(int(qtype), k) for k in _C.tuning_knobs()} if _C.tuning(int(qtype), "rows") else {}
    try:
        for k in knobs:
            _C.set_tuning(int(qtype), k, 0)
        fn(pool[0])
        return min(timer(fn, pool) for _ in range(passes))
    finally:
        for k, v in knobs.items():
            _C.set_tuning(int(qtype), k, v)


def _tune(timer: Timer, checks: int = 0, retimed: int = 0) -> dict:
    """A stored entry: the choices, when they were timed, the slower of the probes just before and
    just after (a neighbour busy at either end slowed the measurement between), and the later loads'
    bookkeeping."""
    start = time.perf_counter()
    before = probe(timer=timer)
    picks = measure(timer=timer)
    return {"picks": picks, "timed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.perf_counter() - start, 1), "probe_s": max(before, probe(timer=timer)),
            "checks": checks, "retimed": retimed}


def _valid(entry: object) -> bool:
    return isinstance(entry, dict) and isinstance(entry.get("picks"), dict) \
        and isinstance(entry.get("probe_s"), (int, float)) and isinstance(entry.get("checks", 0), int)


def _stored(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _set(chosen: dict) -> dict[str, dict[str, int]]:
    """Sets what is valid here; a format, knob or value this build does not know is skipped (the
    file may be edited, or written by another version)."""
    done: dict[str, dict[str, int]] = {}
    for name, knobs in chosen.items():
        if not isinstance(knobs, dict):
            log.warning("kernel tuning: ignoring %s=%r (not a table of knobs)", name, knobs)
            continue
        for knob, value in knobs.items():
            try:
                _C.set_tuning(int(T[name]), str(knob), int(value))
                done.setdefault(name, {})[knob] = int(value)
            except (KeyError, ValueError, TypeError, RuntimeError):
                log.warning("kernel tuning: ignoring %s %s=%r (not a choice of this build)", name, knob, value)
    return done


def _write(path: Path, stored: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=2))
        tmp.replace(path)
    except OSError as e:  # a read-only cache: the choices hold for this process only
        log.warning("kernel tuning not stored (%s)", e)


def _checked(entry: dict, timer: Timer) -> dict:
    """`entry` after one more load's probe: measured again where the host now runs RETIME_MARGIN
    faster than when it was timed (the tuning ran beside a busy neighbour), else counted."""
    now = probe(timer=timer)
    checks = entry.get("checks", 0) + 1
    if now < entry["probe_s"] * (1 - RETIME_MARGIN):
        log.info("kernel tuning: the probe runs in %.3g s, %.3g s when the choices were timed; timing again",
                 now, entry["probe_s"])
        return _tune(timer, checks, entry.get("retimed", 0) + 1)
    return {**entry, "checks": checks, "probe_s": min(now, entry["probe_s"])}


def apply(retune: bool | None = None, path: Path | None = None,
          timer: Timer = seconds_a_call) -> dict[str, dict[str, int]]:
    """This host's choices, set for the kernel level in use: stored (and checked by the probe for
    CHECKS loads), or measured and stored. Once a process (per level), unless `retune`."""
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
    if retune or not _valid(entry):
        entry = _tune(timer)
        log.info("kernel tuning for %s: %s (%.1f s), stored in %s", key, entry["picks"], entry["seconds"], path)
    elif entry.get("checks", 0) < CHECKS and entry["picks"]:  # (a level without tiles has nothing to redo)
        entry = _checked(entry, timer)
    else:
        entry = None
    if entry is not None:
        stored[key] = entry
        _write(path, stored)
    chosen = _set(stored[key]["picks"])
    _applied = key, chosen
    return chosen


def describe(path: Path | None = None) -> list[str]:
    """The stored choices for this host and level, and when they were timed (for `roofline`)."""
    key = host_key()
    if os.environ.get("WALLBREAKER_KERNEL_TUNING", "1") == "0":
        return [f"Kernel tuning ({key}): off (WALLBREAKER_KERNEL_TUNING=0), each level's default tiles."]
    entry = _stored(path or tuning_path()).get(key)
    if not _valid(entry):
        return [f"Kernel tuning ({key}): none stored yet (the first load of a packed model measures it)."]
    picks = "; ".join(f"{name} " + ", ".join(f"{k}={v}" for k, v in knobs.items())
                      for name, knobs in entry["picks"].items())
    return [f"Kernel tuning ({key}): timed {entry.get('timed', '?')}, probe {entry['probe_s'] * 1e3:.3f} ms a call, "
            f"checked at {entry.get('checks', 0)} later loads (of {CHECKS}), timed again {entry.get('retimed', 0)} times:",
            picks or "(this level has no knobs)"]
