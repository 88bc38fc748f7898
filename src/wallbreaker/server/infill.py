"""POST /infill: llama.cpp's code-infilling route, as editor plugins (llama.vscode, llama.vim) call it.

`input_prefix` and `input_suffix` frame the hole, `input_extra` ({filename, text} chunks) adds other
files, `prompt` continues the prefix; the prompt is laid out by text/fim.py with the model's FIM
tokens (a model without them is a 400 naming the reason). The other fields are llama.cpp's
/completion options, with its defaults; the answer is its /completion shape (`content`, `stop`,
`tokens_predicted`, ...), streamed as `data: {...}` events without a closing [DONE].
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import Request, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ..engine.client import EngineRequest, RequestOutput
from ..errors import InvalidRequestError
from ..text.fim import ExtraFile
from ..sampling_params import SamplingParams
from .access_log import AccessRecord
from .async_engine import RequestHandle
from .errors import bad_request
from .prompts import infill_prompt, within_context
from .protocol import INT64_MAX, MAX_N, LlamaCppSamplerFields, Stop, _Closed
from .request_params import llama_cpp_sampler_fields
from .state import ServerState
from .streaming import collect, deltas, event_stream

# llama.cpp's /completion defaults
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.95
DEFAULT_MIN_P = 0.05
LLAMA_CPP_SAMPLERS = ("dry", "top_k", "typ_p", "top_p", "top_n_sigma", "min_p", "xtc", "temperature", "infill",
                      "penalties", "mirostat", "mirostat_v2")


class InfillChunk(_Closed):
    text: str
    filename: str | None = None


class InfillRequest(LlamaCppSamplerFields):
    model: str | None = None
    input_prefix: str
    input_suffix: str
    input_extra: list[InfillChunk] | None = None
    prompt: str | None = None
    stream: bool | None = False
    n_predict: int | None = None  # -1: up to the end of the context
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=-1, le=INT64_MAX - MAX_N)] | None = None  # -1: random
    stop: Stop | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool | None = False
    # llama.cpp's bookkeeping (its slots, caching, the fields it returns): never the output
    cache_prompt: bool | None = None
    id_slot: int | None = None
    t_max_prompt_ms: int | None = None
    response_fields: list[str] | None = None
    # Sent by llama.vscode on every request, so accepted, but not applied: the samplers run in
    # wallbreaker's one order (docs/samplers.md), `n_predict` bounds the reply rather than a time limit or an
    # indentation rule.
    samplers: list[Literal[*LLAMA_CPP_SAMPLERS]] | None = None
    t_max_predict_ms: int | None = None
    n_indent: int | None = None


class InfillResponse(BaseModel):
    content: str
    stop: bool
    model: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    stop_type: str | None = None  # "eos", "word" (a stop string), "limit" (n_predict or the context)
    stopping_word: str | None = None
    truncated: bool | None = None


async def create_infill(body: InfillRequest, request: Request, state: ServerState) -> Response:
    access, infill_id, deadline = state.admit(request, "infill")
    params = infill_params(body)
    extra = [ExtraFile(c.text, c.filename if c.filename is not None else "tmp") for c in body.input_extra or ()]
    ids = await run_in_threadpool(infill_prompt, state, body.input_prefix, body.input_suffix, extra,
                                  body.prompt or "")
    params = within_context(state, params, len(ids))
    access.prompt_tokens = len(ids)
    engine_request = EngineRequest(ids, params, body.input_prefix, infill_id)
    handle = state.engine.submit([engine_request], stream=bool(body.stream))
    if body.stream:
        return event_stream(handle, _stream(state, handle, access, deadline), state.config, done="")
    output = (await collect(handle, request, deadline, state.request_timeout))[infill_id]
    access.completion_tokens = len(output.outputs[0].token_ids)
    return Response(_final(state, output).model_dump_json(exclude_none=True), media_type="application/json")


def infill_params(body: InfillRequest) -> SamplingParams:
    def given(value, default):
        return default if value is None else value
    max_tokens = None if body.n_predict is None or body.n_predict < 0 else body.n_predict
    if max_tokens == 0:
        raise bad_request("n_predict 0 would generate nothing; give at least 1, or -1 for no limit",
                          param="n_predict")
    try:
        return SamplingParams(
            temperature=given(body.temperature, DEFAULT_TEMPERATURE), top_k=given(body.top_k, DEFAULT_TOP_K),
            top_p=given(body.top_p, DEFAULT_TOP_P), min_p=given(body.min_p, DEFAULT_MIN_P), max_tokens=max_tokens,
            stop=body.stop, seed=None if body.seed is None or body.seed < 0 else body.seed,
            repetition_penalty=given(body.repeat_penalty, 1.0), presence_penalty=given(body.presence_penalty, 0.0),
            frequency_penalty=given(body.frequency_penalty, 0.0), ignore_eos=bool(body.ignore_eos),
            **llama_cpp_sampler_fields(body))
    except InvalidRequestError as e:
        first_word = str(e).split(" ", 1)[0]
        param = {"repetition_penalty": "repeat_penalty", "max_tokens": "n_predict"}.get(first_word, first_word)
        raise bad_request(str(e), param=param if param in InfillRequest.model_fields else None) from e


def _final(state: ServerState, output: RequestOutput, content: str | None = None) -> InfillResponse:
    c = output.outputs[0]
    stop_type = {"length": "limit"}.get(c.finish_reason or "", "word" if isinstance(c.stop_reason, str) else "eos")
    return InfillResponse(content=c.text if content is None else content, stop=True, model=state.model_name,
                          tokens_predicted=len(c.token_ids), tokens_evaluated=len(output.prompt_token_ids),
                          stop_type=stop_type, stopping_word=c.stop_reason if isinstance(c.stop_reason, str) else "",
                          truncated=False)


async def _stream(state: ServerState, handle: RequestHandle, access: AccessRecord,
                  deadline: float | None) -> AsyncIterator[str]:
    finished: list[RequestOutput] = []
    async for event in deltas(handle, access, deadline, finished):
        if event.text:
            yield _event(InfillResponse(content=event.text, stop=False))
    if finished:
        yield _event(_final(state, finished[0], content=""))


def _event(payload: InfillResponse) -> str:
    return f"data: {payload.model_dump_json(exclude_none=True)}\n\n"
