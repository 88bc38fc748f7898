"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, NoReturn

from wallbreaker.errors import InvalidRequestError

MAX_LOGPROBS = 20
# Stop conditions are checked for every token of every sequence, on the engine thread that all
# requests share: bounded so that one request cannot slow every step (OpenAI allows 4 strings).
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 128
MAX_STOP_TOKEN_IDS = 1024
# Temperatures below this are treated as greedy (as vLLM does): dividing by them overflows.
GREEDY_EPS = 1e-5
# logit_bias values, as OpenAI bounds them: -100 bans a token in practice, +100 forces it.
MAX_LOGIT_BIAS = 100.0
# bad_words are matched against every sequence's last tokens at every step: bounded like stop strings.
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARS = 128
# DRY's sequence breakers, as llama.cpp bounds and defaults them.
MAX_DRY_BREAKERS = 64
MAX_DRY_BREAKER_CHARS = 40
DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, vLLM's `StructuredOutputsParams`: exactly one of `json` (a JSON
    schema, as a dict or its text), `regex`, `choice` (the output is one of these strings),
    `grammar` (EBNF: GBNF as llama.cpp writes it, or Lark) or `json_object` (any JSON object).
    `disable_any_whitespace` makes JSON compact (no whitespace between tokens)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        elif self.json_object is not None and self.json_object is not False:
            _fail(f"structured_outputs.json_object must be a bool, got {type(self.json_object).__name__}")
        if len(given) != 1:
            _fail("structured_outputs takes exactly one of json, regex, choice, grammar, json_object"
                  + (f"; got {', '.join(given)}" if given else ""))
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    _fail(f"structured_outputs.json is not valid JSON: {e}")
            if not isinstance(self.json, (dict, bool)):
                _fail(f"structured_outputs.json must be a JSON schema (an object), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                _fail("structured_outputs.choice must be a non-empty list of strings")
            if not all(isinstance(c, str) for c in self.choice):
                _fail("structured_outputs.choice must hold only strings")
            self.choice = list(self.choice)
        if not isinstance(self.disable_any_whitespace, bool):
            _fail("structured_outputs.disable_any_whitespace must be a bool")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    @property
    def key(self) -> str:
        """The constraint as canonical text: equal keys compile to the same grammar (the cache's key)."""
        value = {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": True}[self.kind]
        return json.dumps([self.kind, value, self.disable_any_whitespace], sort_keys=True, separators=(",", ":"))

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputsParams | None":
        """A StructuredOutputsParams from itself, a dict of its fields, or that dict as JSON text (a CLI flag)."""
        if value is None or isinstance(value, cls):
            return value
        value = _from_json_text(value, "structured_outputs")
        if not isinstance(value, dict):
            _fail(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")
        fields = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - fields)
        if unknown:
            _fail(f"structured_outputs has no field {unknown[0]!r} (it takes {', '.join(sorted(fields))})")
        return cls(**value)


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
    # the penalties above look at the last repeat_last_n tokens of prompt and output (llama.cpp's and
    # Ollama's window; presence and frequency at the output tokens among them); -1: all (vLLM's)
    repeat_last_n: int = -1
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # False keeps special tokens in the text (vLLM's name): tool-call and harmony markers are special
    skip_special_tokens: bool = True
    # constraints (vLLM's names): the output fits a grammar; token id -> a bias added to its logit
    # (-100..100); only these token ids; never these words (as the tokenizer writes them, with or
    # without a leading space)
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # llama.cpp's samplers, with its names and defaults (layers/dry.py, layers/truncation.py):
    # locally typical sampling (1 = off); XTC removes, with probability xtc_probability, every token
    # of probability >= xtc_threshold but the least likely of them (0 = off); DRY subtracts
    # dry_multiplier * dry_base ** (n - dry_allowed_length) from a token that would extend a
    # repetition of n >= dry_allowed_length tokens found in the last dry_penalty_last_n tokens
    # (-1: the whole context, as older llama.cpp), repetitions not crossing a sequence breaker;
    # mirostat 2.0 keeps the surprise near mirostat_tau (mirostat_mode 2; 0 = off).
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: list[str] | None = None  # None: llama.cpp's ["\n", ":", "\"", "*"]
    mirostat_mode: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "typical_p", "xtc_probability", "xtc_threshold",
                     "dry_multiplier", "dry_base", "mirostat_tau", "mirostat_eta"):
            value = getattr(self, name)
            if not _is_number(value):
                _fail(f"{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                _fail(f"{name} must be finite, got {value}")
            setattr(self, name, float(value))
        for name in ("n", "top_k", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n", "mirostat_mode"):
            _check_int(name, getattr(self, name))
        for name in ("max_tokens", "seed", "logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
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
        if self.repeat_last_n < -1:
            _fail(f"repeat_last_n must be >= 0, or -1 for every token, got {self.repeat_last_n}")
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
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                _fail("allowed_token_ids must be a non-empty list of token ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
            for t in self.allowed_token_ids:
                if not _is_int(t) or t < 0:
                    _fail(f"allowed_token_ids must be non-negative ints, got {t!r}")
        self.bad_words = _normalize_bad_words(self.bad_words)
        self._check_llama_cpp_samplers()

    def _check_llama_cpp_samplers(self) -> None:
        if not 0 < self.typical_p <= 1:
            _fail(f"typical_p must be in (0, 1], got {self.typical_p}")
        for name in ("xtc_probability", "xtc_threshold"):
            if not 0 <= getattr(self, name) <= 1:
                _fail(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.dry_multiplier < 0:
            _fail(f"dry_multiplier must be >= 0, got {self.dry_multiplier}")
        if self.dry_base < 1:
            _fail(f"dry_base must be >= 1, got {self.dry_base}")
        if self.dry_allowed_length < 0:
            _fail(f"dry_allowed_length must be >= 0, got {self.dry_allowed_length}")
        if self.dry_penalty_last_n < -1:
            _fail(f"dry_penalty_last_n must be >= 0, or -1 for the whole context, got {self.dry_penalty_last_n}")
        self.dry_sequence_breakers = list(DEFAULT_DRY_BREAKERS) if self.dry_sequence_breakers is None else \
            _strings(self.dry_sequence_breakers, "dry_sequence_breakers", MAX_DRY_BREAKERS, MAX_DRY_BREAKER_CHARS)
        if self.mirostat_mode not in (0, 2):
            _fail(f"mirostat_mode must be 0 (off) or 2 (mirostat 2.0; version 1 is not supported), "
                  f"got {self.mirostat_mode}")
        if self.mirostat_tau <= 0:
            _fail(f"mirostat_tau must be > 0, got {self.mirostat_tau}")
        if self.mirostat_eta < 0:
            _fail(f"mirostat_eta must be >= 0, got {self.mirostat_eta}")

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0

    @property
    def uses_mirostat(self) -> bool:
        return self.mirostat_mode == 2 and not self.is_greedy

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


def _fail(message: str) -> NoReturn:
    raise InvalidRequestError(message)


def _from_json_text(value: object, name: str) -> object:
    """A value given as JSON text (a CLI flag) parsed; any other value as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        _fail(f"{name} is not valid JSON: {e}")


def _check_int(name: str, value: object) -> None:
    if not _is_int(value):
        _fail(f"{name} must be an int, got {type(value).__name__}")


def _strings(value: object, name: str, max_items: int, max_chars: int) -> list[str]:
    """A string or a list of strings, checked: non-empty, at most `max_items` of at most `max_chars`."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        _fail(f"{name} must be a string or a list of strings, got {type(value).__name__}")
    if len(value) > max_items:
        _fail(f"{name} holds {len(value)} strings; at most {max_items} are allowed")
    for v in value:
        if not isinstance(v, str):
            _fail(f"{name} strings must be strings, got {type(v).__name__}")
        if not v:
            _fail(f"{name} strings must be non-empty")
        if len(v) > max_chars:
            _fail(f"{name} strings may have at most {max_chars} characters; one has {len(v)}")
    return list(value)


def _normalize_stop(stop: object) -> list[str]:
    return [] if stop is None else _strings(stop, "stop", MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)


def _normalize_logit_bias(bias: object) -> dict[int, float] | None:
    """{token id: bias}; ids may be given as strings of digits (OpenAI's JSON keys), or the whole
    mapping as JSON text (a CLI flag)."""
    if bias is None:
        return None
    bias = _from_json_text(bias, "logit_bias")
    if not isinstance(bias, dict):
        _fail(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not _is_int(token) or token < 0:
            _fail(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
        if not _is_number(value) or not math.isfinite(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            _fail(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
        out[token] = float(value)
    return out or None


def _normalize_bad_words(words: object) -> list[str] | None:
    if words is None:
        return None
    words = _strings(words, "bad_words", MAX_BAD_WORDS, MAX_BAD_WORD_CHARS)
    if any(not w.strip() for w in words):
        _fail("bad_words strings must not be blank")
    return words or None
