"""How many threads a decode step runs on, chosen from the step times the engine measures.

A decode step forks and joins its threads once per kernel (~150 times a step). When another process
keeps one core busy, the thread that shares that core gets a fraction of it, every join waits for
it, and two threads decode slower than one (measured on a 2-core Zen 3: 16 tokens/s at 2 threads
beside a busy process, 43 at 1). No OS figure says which count wins on the host at hand right now,
so the governor measures: it runs the count with the fastest recent decode steps, tries each other
count for a few steps now and then, and at once when the current count's recent steps slow down
sharply (a neighbour arrived) or speed up (it left): the median of the last few, so that one noisy
step on a shared host does not set off a trial.

Prefill steps are too few and too unlike each other to be timed against each other, so they follow
the decode steps' finding: every thread, unless fewer decode clearly faster than all of them (by
CONTENDED), which only a neighbour stalling the joins explains, and which stalls prefill's joins
just the same (SmolLM2 beside a busy process, this 2-vCPU Xeon: prefill 49 tokens/s on 2 threads).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

TRIAL_STEPS = 4  # decode steps a count runs when it is tried; the median of its times counts
EXPLORE_EVERY = 256  # decode steps between trials of the other counts
SHIFT = 1.5  # a step this much slower (or faster) than its count's record starts trials at once
SMOOTHING = 0.2
CONTENDED = 1.25  # every thread this much slower than the best count: the cores are not all free


class ThreadGovernor:
    def __init__(self, max_threads: int):
        self.counts = list(range(max_threads, 0, -1))  # most first: the best guess when idle
        self.seconds: dict[int, float] = {}  # count -> moving average of a decode step's time
        self.current = max_threads
        self._trial: list[float] = []
        self._recent: list[float] = []  # the current count's last TRIAL_STEPS steps outside trials
        self._queue: list[int] = []  # counts still to try in this round
        self._since_round = 0

    def threads(self, decode: bool) -> int:
        """The thread count for the next step (set it with `torch.set_num_threads` if it changed)."""
        if not decode:
            best, every = self.seconds.get(self.current), self.seconds.get(self.counts[0])
            contended = best is not None and every is not None and every > CONTENDED * best
            return self.current if contended and not self._queue else self.counts[0]
        if self._queue and not self._trial:
            self.current = self._queue[0]
        return self.current

    def record(self, seconds: float) -> None:
        """A decode step at `threads(True)` threads took `seconds`."""
        n = self.current
        if self._queue:
            self._trial.append(seconds)
            if len(self._trial) == TRIAL_STEPS:
                self.seconds[n] = sorted(self._trial)[TRIAL_STEPS // 2]
                self._trial = []
                self._queue.pop(0)
                if not self._queue:
                    self.current = min(self.seconds, key=self.seconds.__getitem__)
            return
        known = self.seconds.get(n)
        self._since_round += 1
        self._recent = (self._recent + [seconds])[-TRIAL_STEPS:]
        recent = sorted(self._recent)[len(self._recent) // 2]
        shifted = len(self._recent) == TRIAL_STEPS and not known / SHIFT < recent < known * SHIFT if known else False
        if known is None or self._since_round >= EXPLORE_EVERY or shifted:
            self._start_round()
        else:
            self.seconds[n] = known + SMOOTHING * (seconds - known)

    def _start_round(self) -> None:
        """Try every count, the current one last (its latest step already hints how it does)."""
        others = [n for n in self.counts if n != self.current]
        self._queue = others + [self.current] if others else []
        self._since_round = 0
        self._recent = []


@contextmanager
def using_threads(threads: int | None) -> Iterator[None]:
    """torch's thread count set to `threads` (None: left alone) for the block, then put back, so that
    the caller's own torch work never inherits a count chosen for one step."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
