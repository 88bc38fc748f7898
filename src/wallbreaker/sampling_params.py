"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

from wallbreaker.errors import InvalidRequestError

MAX_LOGPROBS = 20
# Stop conditions are checked for every token of every sequence, on the engine thread that all
# requests share: bounded so that one request cannot slow every step (OpenAI allows 4 strings).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 128
MAX_STOP_TOKEN_IDS = 1024
# Temperatures below this are treated as greedy (as vLLM does): dividing by them overflows.
GREEDY_EPS = 1e-5


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    max_tokens: int | None = 16  # None = up to the context length
    stop: list[str] | str | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None  # top logprobs per token; 0 = just the chosen token's
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                _fail(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                _fail(f"{name} must be finite, got {value}")
            setattr(self, name, float(value))
        for name in ("n", "top_k"):
            _check_int(name, getattr(self, name))
        for name in ("max_tokens", "seed", "logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")

        if self.n < 1:
            _fail(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            _fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            _fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            _fail(f"top_k must be >= 1, or 0 / -1 to disable, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            _fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.repetition_penalty <= 0:
            _fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                _fail(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            _fail(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

        self.stop = _normalize_stop(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                _fail(f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}")
            self.stop_token_ids = list(self.stop_token_ids)
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                _fail(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
            for t in self.stop_token_ids:
                if not _is_int(t) or t < 0:
                    _fail(f"stop_token_ids must be non-negative ints, got {t!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def _fail(message: str) -> NoReturn:
    raise InvalidRequestError(message)


def _check_int(name: str, value: object) -> None:
    if not _is_int(value):
        _fail(f"{name} must be an int, got {type(value).__name__}")


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        _fail(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        _fail(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stop:
        if not isinstance(s, str):
            _fail(f"stop strings must be strings, got {type(s).__name__}")
        if not s:
            _fail("stop strings must be non-empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            _fail(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters; one has {len(s)}")
    return list(stop)
