"""OpenAI request fields -> `SamplingParams`, with OpenAI's defaults for fields left out or null.

A field we do not know is ignored and logged once (server/ignored.py); one we know but cannot
honour (`echo`, `best_of` > n) is a 400 that names it. The constraints (`response_format`, vLLM's
`structured_outputs` and its older `guided_*` names, and a forced `tool_choice`) become one
`StructuredOutputsParams`; two at once are a 400.
"""
from __future__ import annotations

import dataclasses

from ..errors import InvalidRequestError
from ..sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from .errors import APIError, bad_request
from .ignored import refuse_present
from .protocol import ChatCompletionRequest, CompletionRequest, LlamaCppSamplerFields, _SamplingFields

_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Chat fields whose absence would change the answer, and that this server does not take.
CHAT_REFUSED = {"functions": "the legacy function calling; send tools", "function_call": "send tool_choice",
                "audio": "this server writes text"}


def _or(value, default):
    return default if value is None else value


def structured_outputs(body: _SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's own constraint, and the field it came from."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append((_spec("response_format", json_object=True), "response_format"))
        else:
            schema = rf.json_schema.schema_ if rf.json_schema is not None else None
            if schema is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  param="response_format")
            found.append((_spec("response_format", json=schema), "response_format"))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        found.append((_spec("structured_outputs", json=so.json_, regex=so.regex, choice=so.choice,
                            grammar=so.grammar, json_object=so.json_object,
                            disable_any_whitespace=bool(so.disable_any_whitespace)), "structured_outputs"))
    for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            found.append((_spec(name, **{field: value}), name))
    if len(found) > 1:
        raise bad_request(f"give one constraint, not {found[0][1]} and {found[1][1]} together", param=found[1][1])
    return found[0] if found else (None, None)


def _spec(param: str, **fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except InvalidRequestError as e:
        raise bad_request(str(e).replace("structured_outputs", param, 1), param=param) from e


def llama_cpp_sampler_fields(body: LlamaCppSamplerFields) -> dict:
    """llama.cpp's sampler fields the body sets, as `SamplingParams` keywords (its defaults for the others)."""
    if body.mirostat is not None and body.mirostat_mode is not None and body.mirostat != body.mirostat_mode:
        raise bad_request("mirostat and mirostat_mode disagree; give one", param="mirostat_mode")
    fields = {name: getattr(body, name) for name in (
        "repeat_last_n", "typical_p", "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base", "dry_allowed_length",
        "dry_penalty_last_n", "dry_sequence_breakers", "mirostat_tau", "mirostat_eta")
        if getattr(body, name) is not None}
    mode = _or(body.mirostat_mode, body.mirostat)
    if mode is not None:
        fields["mirostat_mode"] = mode
    return fields


def _sampling_params(body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                     spec: StructuredOutputsParams | None) -> SamplingParams:
    try:
        return SamplingParams(
            n=_or(body.n, 1), temperature=_or(body.temperature, 1.0), top_p=_or(body.top_p, 1.0),
            top_k=_or(body.top_k, 0), min_p=_or(body.min_p, 0.0), max_tokens=max_tokens, stop=body.stop,
            stop_token_ids=body.stop_token_ids, seed=body.seed, logprobs=logprobs,
            repetition_penalty=_or(body.repetition_penalty, 1.0),
            presence_penalty=_or(body.presence_penalty, 0.0), frequency_penalty=_or(body.frequency_penalty, 0.0),
            ignore_eos=bool(body.ignore_eos), include_stop_str_in_output=bool(body.include_stop_str_in_output),
            structured_outputs=spec, logit_bias=body.logit_bias or None, allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words, **llama_cpp_sampler_fields(body))
    except InvalidRequestError as e:
        first_word = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=first_word if first_word in _FIELDS else None) from e


def completion_params(body: CompletionRequest) -> tuple[SamplingParams, str | None]:
    """The sampling params, and the field their constraint came from (None: no constraint)."""
    if body.echo:
        raise bad_request("echo is not supported", param="echo")
    if body.best_of is not None and body.best_of > _or(body.n, 1):
        raise bad_request(f"best_of {body.best_of} > n is not supported: every sequence generated is returned",
                          param="best_of")
    spec, source = structured_outputs(body)
    return _sampling_params(body, _or(body.max_tokens, 16), body.logprobs, spec), source


def chat_params(body: ChatCompletionRequest, tool_spec: StructuredOutputsParams | None = None
                ) -> tuple[SamplingParams, str | None]:
    """Chat's `max_completion_tokens` wins over the older `max_tokens`; absent, the answer may run to
    the end of the context. `top_logprobs` counts alternatives and needs `logprobs: true`.
    `tool_spec` is the constraint of a forced tool choice (server/tools.py)."""
    refuse_present(body, CHAT_REFUSED, "chat")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = None
    if body.logprobs:
        logprobs = _or(body.top_logprobs, 0)
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", param="top_logprobs")
    elif body.top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    spec, source = structured_outputs(body)
    if tool_spec is not None:
        if spec is not None:
            raise bad_request(f"{source} cannot be combined with a tool_choice that forces a call", param=source)
        spec, source = tool_spec, "tools"
    try:
        return _sampling_params(body, max_tokens, logprobs, spec), source
    except APIError as e:
        if e.info.param == "max_tokens" and body.max_completion_tokens is not None:
            e.info.param = "max_completion_tokens"
        raise
