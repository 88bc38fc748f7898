"""OpenAI request fields -> `SamplingParams`, with OpenAI's defaults for fields left out or null."""
from __future__ import annotations

import dataclasses

from ..errors import InvalidRequestError
from ..sampling_params import MAX_LOGPROBS, SamplingParams
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields

_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _or(value, default):
    return default if value is None else value


def _sampling_params(body: _SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            n=_or(body.n, 1), temperature=_or(body.temperature, 1.0), top_p=_or(body.top_p, 1.0),
            top_k=_or(body.top_k, 0), min_p=_or(body.min_p, 0.0), max_tokens=max_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, seed=body.seed, logprobs=logprobs,
            repetition_penalty=_or(body.repetition_penalty, 1.0),
            presence_penalty=_or(body.presence_penalty, 0.0), frequency_penalty=_or(body.frequency_penalty, 0.0),
            ignore_eos=bool(body.ignore_eos), include_stop_str_in_output=bool(body.include_stop_str_in_output))
    except InvalidRequestError as e:
        first_word = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=first_word if first_word in _FIELDS else None) from e


def completion_params(body: CompletionRequest) -> SamplingParams:
    if body.echo:
        raise bad_request("echo is not supported", param="echo")
    return _sampling_params(body, _or(body.max_tokens, 16), body.logprobs)


def chat_params(body: ChatCompletionRequest) -> SamplingParams:
    """Chat's `max_completion_tokens` wins over the older `max_tokens`; absent, the answer may run to
    the end of the context. `top_logprobs` counts alternatives and needs `logprobs: true`."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = None
    if body.logprobs:
        logprobs = _or(body.top_logprobs, 0)
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="top_logprobs")
    elif body.top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    try:
        return _sampling_params(body, max_tokens, logprobs)
    except APIError as e:
        if e.info.param == "max_tokens" and body.max_completion_tokens is not None:
            e.info.param = "max_completion_tokens"
        raise
