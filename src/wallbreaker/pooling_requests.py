"""Pooling requests, for `LLM` and the server alike: texts (or token ids, or pairs) to the token ids
a pooling model reads, their pooled vectors to what the caller asked for, and the scores of pairs.

Truncation happens only where asked (`truncate_prompt_tokens`, vLLM's name: a count, or -1 for the
model's limit), on the right as sentence-transformers cuts, the model's own [CLS] and [SEP] kept.
A pair for a cross-encoder is `[CLS] a [SEP] b [SEP]` (BERT's pair template), truncated in `b`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .engine.client import EngineClient, EngineRequest, RequestOutput
from .errors import InvalidRequestError
from .text.tokenizer import Tokenizer
from .layers.pooling import finish_embedding, finish_score
from .config import PoolingConfig
from .pooling_params import PoolingParams
from .sampling_params import SamplingParams

_POOLING_SAMPLING = SamplingParams(max_tokens=1)  # carried, never read: nothing is sampled


def truncation_limit(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    if truncate_prompt_tokens is None:
        return None
    if not isinstance(truncate_prompt_tokens, int) or isinstance(truncate_prompt_tokens, bool) or \
            truncate_prompt_tokens == 0 or truncate_prompt_tokens < -1:
        raise InvalidRequestError("truncate_prompt_tokens must be a positive integer or -1 (the model's limit)",
                                  param="truncate_prompt_tokens")
    if truncate_prompt_tokens > max_model_len:
        raise InvalidRequestError(f"truncate_prompt_tokens {truncate_prompt_tokens} is more than this model's limit "
                                  f"of {max_model_len} tokens", param="truncate_prompt_tokens")
    return max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def _encode_with_template(tokenizer: Tokenizer, text: str) -> tuple[list[int], int, int]:
    """(ids, leading special tokens, trailing special tokens) as the model's tokenizer.json encodes
    the text, its post-processor included, as sentence-transformers does: Qwen3-Embedding's
    appends <|endoftext|>, which is not the EOS its tokenizer_config names."""
    enc = tokenizer.backend.encode(text, add_special_tokens=True)
    mask = enc.special_tokens_mask
    head = next((i for i, m in enumerate(mask) if not m), len(mask))
    tail = next((i for i, m in enumerate(reversed(mask)) if not m), 0)
    return list(enc.ids), head, tail


def _cut(ids: list[int], limit: int, head: int, tail: int) -> list[int]:
    if len(ids) <= limit:
        return ids
    keep = max(limit - head - tail, 0)
    return ids[:head + keep] + (ids[len(ids) - tail:] if tail else [])


def input_ids(tokenizer: Tokenizer, text: str | list[int], limit: int | None) -> list[int]:
    """One input's token ids (a text is tokenized with the model's special tokens; ids pass as
    given), cut to `limit` tokens where it is set."""
    if isinstance(text, str):
        if not text:
            raise InvalidRequestError("an input is an empty string")
        ids, head, tail = _encode_with_template(tokenizer, text)
    elif isinstance(text, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        ids, head, tail = list(text), 0, 0
    else:
        raise InvalidRequestError("an input is a string or a list of token ids")
    return ids if limit is None else _cut(ids, limit, head, tail)


def pair_ids(tokenizer: Tokenizer, first: str, second: str, limit: int | None) -> list[int]:
    """A cross-encoder's input for (first, second): BERT's pair template, `second` cut to fit `limit`."""
    if not isinstance(first, str) or not isinstance(second, str):
        raise InvalidRequestError("a cross-encoder scores text pairs: both sides must be strings")
    if not first or not second:
        raise InvalidRequestError("a text of a pair is empty")
    a = tokenizer.encode(first)
    b = tokenizer.encode(second, add_special_tokens=False)
    tail = [tokenizer.eos_token_id] if tokenizer.add_eos else []
    if limit is not None and len(a) + len(b) + len(tail) > limit:
        b = b[:max(limit - len(a) - len(tail), 0)]
    return a + b + tail


@dataclass
class PoolingRun:
    """What a pooling model needs from its owner: the engine, the tokenizer, the model's config."""

    engine: EngineClient
    tokenizer: Tokenizer
    embedding_size: int  # the hidden size: the most `dimensions` may keep

    @property
    def config(self) -> PoolingConfig | None:
        return self.engine.pooling_config

    def requests(self, inputs: list[list[int]], params: PoolingParams, prefix: str | None = None) -> list[EngineRequest]:
        """Engine requests for the inputs, checked (`InvalidRequestError` names the first bad one)."""
        if not inputs:
            raise InvalidRequestError("the input is empty: give at least one text")
        self.engine.check_pooling(params.task)
        for i, ids in enumerate(inputs):
            try:
                self.engine.check_pooling_prompt(ids)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"input {i}: {e}", param=e.param) from None
        if params.dimensions is not None and params.dimensions > self.embedding_size:
            raise InvalidRequestError(f"dimensions {params.dimensions} is more than this model's "
                                      f"{self.embedding_size}", param="dimensions")
        return [EngineRequest(ids, _POOLING_SAMPLING, None, None if prefix is None else f"{prefix}-{i}",
                              pooling=params) for i, ids in enumerate(inputs)]

    def run(self, requests: list[EngineRequest]) -> list[RequestOutput]:
        """Runs the requests to the end on the calling thread (LLM's use); outputs in request order."""
        ids = []
        try:
            for r in requests:
                ids.append(self.engine.add_request(r))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        mine = set(ids)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids) and self.engine.has_unfinished():
            for output in self.engine.step().finished:
                if output.request_id in mine:
                    done[output.request_id] = output
        return [done[rid] for rid in ids]

    def embeddings(self, outputs: list[RequestOutput], params: PoolingParams) -> list[list[float]]:
        return [finish_embedding(o.pooled, self.config, params) for o in outputs]

    def scores(self, outputs: list[RequestOutput]) -> list[float]:
        return [finish_score(o.pooled, self.config) for o in outputs]


def cosine(a: list[float], b: list[float]) -> float:
    return float(F.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))


def score_pairs(first: str | list[str], second: str | list[str]) -> list[tuple[str, str]]:
    """vLLM's score shapes: one to one, one to many, many to many (the same number on each side)."""
    a = [first] if isinstance(first, str) else list(first)
    b = [second] if isinstance(second, str) else list(second)
    if not a or not b:
        raise InvalidRequestError("score needs at least one text on each side")
    if len(a) == 1:
        a = a * len(b)
    if len(a) != len(b):
        raise InvalidRequestError(f"score pairs texts one to one, one to many or many to many (as many on each "
                                  f"side): got {len(a)} and {len(b)}")
    return list(zip(a, b))


def relevance_requests(run: PoolingRun, pairs: list[tuple[str, str]], limit: int | None, prefix: str | None = None
                       ) -> tuple[list[EngineRequest], Callable[[list[RequestOutput]], list[float]]]:
    """The requests that score `pairs`, and what turns their outputs into one score a pair: a
    cross-encoder reads each pair whole; an embedding model embeds both sides and the score is
    their cosine similarity (as vLLM scores with an embedding model)."""
    config = run.config
    if config is not None and config.task == "score":
        requests = run.requests([pair_ids(run.tokenizer, a, b, limit) for a, b in pairs], PoolingParams("score"), prefix)
        return requests, run.scores
    params = PoolingParams("embed")
    texts = [t for pair in pairs for t in pair]
    requests = run.requests([input_ids(run.tokenizer, t, limit) for t in texts], params, prefix)

    def finish(outputs: list[RequestOutput]) -> list[float]:
        vectors = run.embeddings(outputs, params)
        return [cosine(vectors[2 * i], vectors[2 * i + 1]) for i in range(len(pairs))]
    return requests, finish
