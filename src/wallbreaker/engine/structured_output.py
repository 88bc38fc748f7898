"""Structured output: the grammar a request's output must fit, as a token mask each step.

The grammar engine is llguidance (BENCHMARKS.md, structured output, has the measurements against
xgrammar). A constraint (`StructuredOutputsParams`: a JSON schema, a regex, a choice of strings,
an EBNF/GBNF or Lark grammar) compiles once (a JSON schema closed first, as llama.cpp reads it:
engine/closed_schema.py) into a `Grammar`, cached by the constraint's canonical
text; each sequence holds its own `GrammarMatcher`, a copy of the grammar's initial state that
advances on every token the sequence appends. Before a token is sampled the matcher writes the
tokens it allows into a bitmask row (bit t % 32 of word t // 32: token t), which the sampler
applies (`layers/sampler.py`).

The mask covers the tokenizer's vocabulary, never a padded embedding's extra rows (their logits
are -inf already, `ModelRunner.vocab_limit`). Compiling runs on the caller's thread: the server
calls `compile` from a worker thread with a time limit, never from the engine thread; llguidance
bounds its own work too (grammar size, lexer fuel per build and per mask), so a pathological
grammar fails with an error instead of running away, at compile time or at a step.

Other token restrictions ride on the same mask: `bad_words` (tokenized here, checked against each
sequence's last tokens). `allowed_token_ids` and `logit_bias` are static and left to the sampler.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import InvalidRequestError
from ..layers.sampler import TokenMask
from ..sampling_params import StructuredOutputsParams
from .closed_schema import closed

if TYPE_CHECKING:
    import llguidance

    from ..text.tokenizer import Tokenizer

# Compiled grammars kept, least recently used dropped first (each is a grammar and its lexer).
GRAMMAR_CACHE_SIZE = 256
# llguidance's own bounds on one grammar: total size, lexer work to build it and per mask. Its
# defaults, but a mask's fuel is cut so that no step of the shared engine loop waits on one grammar
# for more than about 10 ms.
MAX_GRAMMAR_SIZE = 500_000
INITIAL_LEXER_FUEL = 1_000_000
STEP_LEXER_FUEL = 150_000
# What JSON may have between two tokens: enough to pretty-print 16 levels deep, and a bound, so that
# a model cannot pad its output with whitespace until max_tokens runs out (small ones do).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,40}"
# An llguidance error is cut to this many characters.
MAX_ERROR_CHARS = 300


class GrammarError(InvalidRequestError):
    """A schema, regex or grammar that does not compile, or is too complex; the message names why."""


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: llguidance's grammar and a matcher at its start, which every
    sequence's matcher is copied from."""

    key: str
    initial: "llguidance.LLMatcher"

    def matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self.initial.deep_copy())


class GrammarMatcher:
    """One sequence's position in its grammar: advanced by `accept`, rolled back by `rollback`."""

    def __init__(self, matcher: "llguidance.LLMatcher"):
        self._m = matcher

    def fork(self) -> "GrammarMatcher":
        return GrammarMatcher(self._m.deep_copy())

    def fill(self, bits: torch.Tensor) -> None:
        """Write the tokens allowed next into `bits`, one contiguous int32 row [words] on the CPU."""
        self._m.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    def valid_prefix(self, tokens: Seq[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (nothing is consumed)."""
        return self._m.validate_tokens(list(tokens)) if tokens else 0

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and nothing may follow (but an end-of-sequence token)."""
        return self._m.is_stopped()

    @property
    def is_error(self) -> bool:
        return self._m.is_error()

    @property
    def error(self) -> str:
        return _first_line(self._m.get_error())


class StructuredOutputs:
    """One engine's grammar compiler and cache. Thread-safe: the server compiles off the engine thread."""

    def __init__(self, tokenizer: Tokenizer | None, stop_token_ids: frozenset[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer = tokenizer  # None: an engine driven by token ids alone, which takes no constraints
        self.vocab_size = tokenizer.vocab_size if tokenizer is not None else 0
        self.words = (self.vocab_size + 31) // 32  # int32 words of one mask row
        self.stop_token_ids = sorted(t for t in stop_token_ids if t < self.vocab_size)
        self._eos = frozenset(self.stop_token_ids)  # what grammars allow once complete
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses)

    def _llg_tokenizer(self) -> "llguidance.LLTokenizer":
        """The tokenizer as llguidance sees it (its token trie), built on first use (~0.2 s for 49k tokens)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer
                from llguidance._tokenizer import TokenizerWrapper
                self._ll_tokenizer = LLTokenizer(TokenizerWrapper(_TokenizerView(self.tokenizer)),
                                                 n_vocab=self.vocab_size, eos_token=self.stop_token_ids or None)
            return self._ll_tokenizer

    def cached(self, spec: StructuredOutputsParams) -> Grammar | None:
        with self._lock:
            return self._cache.get(spec.key)

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The grammar of `spec`, from the cache or compiled now. Raises `GrammarError`."""
        if self.tokenizer is None:
            raise GrammarError("structured output needs the model's tokenizer")
        key = spec.key
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = Grammar(key, self._build(spec))
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.compiled += 1
        return grammar

    def _build(self, spec: StructuredOutputsParams) -> "llguidance.LLMatcher":
        from llguidance import LLMatcher, LLParserLimits
        text = _grammar_text(spec)
        limits = LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE, initial_lexer_fuel=INITIAL_LEXER_FUEL,
                                step_lexer_fuel=STEP_LEXER_FUEL, verbose_errors=False)
        matcher = LLMatcher(self._llg_tokenizer(), text, log_level=0, limits=limits)
        if not matcher.is_error():  # the first mask builds the lexer's first states: done here, not in a step
            bits = torch.empty(self.words, dtype=torch.int32)
            matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        if matcher.is_error():
            raise GrammarError(f"invalid {_WHAT[spec.kind]}: {_first_line(matcher.get_error())}")
        return matcher

    # -- masks ---------------------------------------------------------------------------------
    # `seqs` are engine `Sequence`s (not imported: sequence.py imports this module's types)
    def step_mask(self, seqs: Seq) -> TokenMask | None:
        """The mask of one sampling row per sequence (their next token), or None if none restricts
        tokens. A matcher that fails (a grammar past llguidance's limits) allows no token."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None or s.bad_words_ids]
        if not rows:
            return None
        bits = torch.full((len(rows), self.words), -1, dtype=torch.int32)
        for r, i in enumerate(rows):
            seq = seqs[i]
            if seq.grammar is not None:
                seq.grammar.fill(bits[r])
                if seq.grammar.is_error:
                    bits[r] = 0
            if seq.bad_words_ids:
                _ban(bits[r], banned_tokens(seq.bad_words_ids, seq.output_token_ids))
        return TokenMask(rows, bits)

    def draft_masks(self, seq, drafts: list[int]) -> tuple[int, TokenMask | None]:
        """For verifying `drafts` on `seq`: how many of them the grammar allows in a row (a draft
        past them has probability 0 under the target's constrained distribution, so it and what
        follows are rejected for sure), and the masks of positions 0..that many: the position after
        each allowed draft. The matcher is left where it was."""
        if seq.grammar is None and not seq.bad_words_ids:
            return len(drafts), None
        valid = seq.grammar.valid_prefix(drafts) if seq.grammar is not None else len(drafts)
        bits = torch.full((valid + 1, self.words), -1, dtype=torch.int32)
        outputs = seq.output_token_ids
        consumed = 0
        try:
            for j in range(valid + 1):
                if seq.grammar is not None:
                    seq.grammar.fill(bits[j])
                    if seq.grammar.is_error:  # no token allowed from here: verification stops before
                        bits[j:] = 0
                        break
                if seq.bad_words_ids:
                    _ban(bits[j], banned_tokens(seq.bad_words_ids, outputs + drafts[:j]))
                if seq.grammar is None or j == valid:
                    continue
                if drafts[j] in self._eos:  # past an end of sequence nothing is read (and llguidance
                    break  # cannot roll one back): the rows after it stay unmasked
                if not seq.grammar.accept(drafts[j]):
                    bits[j + 1:] = 0
                    break
                consumed += 1
        finally:
            if seq.grammar is not None:
                seq.grammar.rollback(consumed)
        return valid, TokenMask(list(range(valid + 1)), bits)

    def bad_words_ids(self, words: list[str] | None) -> list[list[int]]:
        """vLLM's tokenization of bad words: each as written at the start of a text and, where that
        makes other tokens, after a space (a word in the middle of a text)."""
        out: list[list[int]] = []
        if words and self.tokenizer is None:
            raise GrammarError("bad_words needs the model's tokenizer")
        for word in words or ():
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if plain:
                out.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        return out


def banned_tokens(bad_words_ids: list[list[int]], output_ids: Seq[int]) -> list[int]:
    """The tokens that would complete a bad word after `output_ids`: a one-token word always, a longer
    one when the output ends with all of it but its last token."""
    banned = []
    for word in bad_words_ids:
        prefix = word[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and list(output_ids[len(output_ids) - len(prefix):]) == prefix):
            banned.append(word[-1])
    return banned


def _ban(row: torch.Tensor, tokens: list[int]) -> None:
    """Clear the bits of `tokens` in one mask row [words] int32."""
    words = row.numel()
    for t in tokens:
        if 0 <= t < words * 32:
            w, b = divmod(t, 32)
            row[w] &= ~(1 << b) if b < 31 else 0x7FFFFFFF  # bit 31 is int32's sign bit


_WHAT = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar (a JSON document naming the grammars it holds) for a constraint."""
    import json

    from llguidance import LLMatcher
    options = {"whitespace_flexible": False} if spec.disable_any_whitespace else \
        {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE}
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
    if spec.kind == "json":
        try:
            return LLMatcher.grammar_from_json_schema(closed(spec.json), overrides=options)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {_first_line(str(e))}") from None
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    if spec.kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    from llguidance.gbnf_to_lark import any_to_lark
    try:
        lark = any_to_lark(spec.grammar)  # GBNF (llama.cpp's `root ::= ...`) to Lark; Lark passes through
    except Exception as e:  # the converter fails in its own ways on what it cannot read
        raise GrammarError(f"invalid grammar: {_first_line(str(e))}") from None
    return LLMatcher.grammar_from_lark(lark)


def _first_line(text: str) -> str:
    """An error as one line: llguidance's may span several (a regex error points at the place)."""
    line = " ".join(text.split()) or "unknown error"
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS] + "..."


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the special ones, and an encoder."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(i for i, t in tokenizer.backend.get_added_tokens_decoder().items()
                                        if t.special and i < tokenizer.vocab_size)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)
