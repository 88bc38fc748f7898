"""Choosing the speculation length K each step, to maximize expected tokens per second.

With acceptance rate a, K drafts yield E(K) = (1 − a^(K+1)) / (1 − a) tokens per verify step (the
accepted run plus the one the target adds). A step costs verify(K + 1) + K · draft_step, both
measured as the engine runs (moving averages). K = 0 is plain decoding, so speculation is chosen only
where it is expected to pay; on a CPU, where verifying K + 1 positions costs almost K + 1 decode
steps, that is often nowhere. Unmeasured lengths are tried once (and neighbours now and then), so
the estimates follow the machine and the text.
"""
from __future__ import annotations

from collections import deque

# Weight of the newest step in the moving averages of step times. Times follow the machine (a
# neighbour's load comes and goes), so they weigh the newest more than a sequence's acceptance rate
# does (engine/sequence.py ACCEPTANCE_SMOOTHING), which follows the text.
TIMING_SMOOTHING = 0.3


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpecLengthController:
    def __init__(self, max_k: int, adaptive: bool = True, smoothing: float = TIMING_SMOOTHING,
                 explore_every: int = 16):
        self.max_k = max_k
        self.adaptive = adaptive
        self.smoothing = smoothing
        self.explore_every = explore_every
        self.verify_s: dict[int, float] = {}  # tokens per sequence in a step -> seconds per step
        self.draft_step_s: float | None = None
        self.steps = 0
        self._interval = explore_every
        self._next_explore = explore_every
        self._pending_explore = False
        self.chosen: deque[int] = deque(maxlen=4096)  # K chosen, step by step

    def choose(self, alpha: float) -> int:
        if not self.adaptive:
            return self.max_k
        best = self.best(alpha)
        if self.steps >= self._next_explore:
            # measure the next length up now and then; while speculation keeps not paying, ever more
            # rarely (a draft model must catch up on every token it skipped, which is not free)
            self._pending_explore = True
            return min(self.max_k, best + 1)
        return best

    def best(self, alpha: float) -> int:
        """The K with the most expected tokens per second, without exploring."""
        if not self.adaptive:
            return self.max_k
        rates = {k: expected_tokens(alpha, k) / self._step_cost(k) for k in range(self.max_k + 1)}
        return max(rates, key=rates.get)

    def _after_step(self, chosen_k: int) -> None:
        if self._pending_explore:
            self._pending_explore = False
            self._interval = self.explore_every if chosen_k > 1 else min(self._interval * 2, 1024)
            self._next_explore = self.steps + self._interval

    def record_step(self, tokens_per_seq: int, seconds: float, chosen_k: int) -> None:
        self.steps += 1
        self.chosen.append(chosen_k)
        self._after_step(chosen_k)
        self.verify_s[tokens_per_seq] = self._ema(self.verify_s.get(tokens_per_seq), seconds)

    def record_draft_step(self, seconds: float) -> None:
        self.draft_step_s = self._ema(self.draft_step_s, seconds)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def _step_cost(self, k: int) -> float:
        """Seconds for a step with k drafts; unmeasured lengths get an optimistic estimate (the
        nearest measured shorter one), so they are tried and then known."""
        m = k + 1
        if m in self.verify_s:
            verify = self.verify_s[m]
        else:
            shorter = [j for j in self.verify_s if j < m]
            verify = self.verify_s[max(shorter)] if shorter else 1.0
        return verify + k * (self.draft_step_s or 0.0)
