"""POST /v1/completions: one engine request a prompt, its n choices numbered prompt * n + index."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

from ..engine.client import RequestOutput, StreamDelta
from ..sampling_params import SamplingParams
from .access_log import AccessRecord
from ..engine.client import EngineRequest
from .async_engine import RequestHandle
from .logprobs import completion_logprobs
from .prompts import completion_prompts, fim_prompts, within_context
from .protocol import CompletionRequest
from .responses import CompletionChoice, CompletionLogprobs, CompletionResponse, Usage, cached_tokens
from .request_params import completion_params
from .state import ServerState
from .streaming import collect, deltas, event_stream, sse


@dataclass
class CompletionRun:
    """One completion request handed to the engine (one engine request a prompt); Ollama's raw
    generate starts one here and translates its answer."""

    state: ServerState
    handle: RequestHandle
    requests: list[EngineRequest]
    completion_id: str
    access: AccessRecord
    deadline: float | None


async def start_completion(body: CompletionRequest, request: Request, state: ServerState) -> CompletionRun:
    access, completion_id, deadline = state.admit(request, "cmpl")
    params, source = completion_params(body)
    if body.suffix is not None:  # fill in the middle, between the prompt and the suffix
        prompts = await run_in_threadpool(fim_prompts, state, body.prompt, body.suffix)
    else:
        prompts = await run_in_threadpool(completion_prompts, state, body.prompt)
    grammar = await state.compile_grammar(params.structured_outputs, source)
    requests = [EngineRequest(ids, within_context(state, params, len(ids)), text, f"{completion_id}-{i}",
                              body.cache_salt, grammar)
                for i, (text, ids) in enumerate(prompts)]
    access.prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    handle = state.engine.submit(requests, stream=bool(body.stream))
    return CompletionRun(state, handle, requests, completion_id, access, deadline)


async def completion_response(run: CompletionRun, request: Request
                              ) -> tuple[CompletionResponse, dict[str, RequestOutput]]:
    """The whole answer, and the engine's outputs (by request id) it came from."""
    state, params = run.state, run.requests[0].params
    outputs = await collect(run.handle, request, run.deadline, state.request_timeout)
    choices = []
    for i, r in enumerate(run.requests):
        for c in outputs[r.request_id].outputs:
            logprobs = None
            if params.logprobs is not None:
                logprobs = completion_logprobs(state.strings, c.token_ids, c.logprobs or [], c.top_logprobs or [])
            choices.append(CompletionChoice(index=i * params.n + c.index, text=c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason))
    usage = _usage(run.requests, outputs.values())
    run.access.completion_tokens = usage.completion_tokens
    run.access.ttft_s = min((o.metrics["ttft_s"] for o in outputs.values() if "ttft_s" in o.metrics), default=None)
    body_out = CompletionResponse(id=run.completion_id, model=state.model_name, choices=choices, usage=usage)
    return body_out, outputs


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    run = await start_completion(body, request, state)
    if body.stream:
        chunks = (sse(c) async for c in completion_chunks(run, body.include_usage, []))
        return event_stream(run.handle, chunks, state.config)
    body_out, _ = await completion_response(run, request)
    return Response(body_out.model_dump_json(), media_type="application/json")


async def completion_chunks(run: CompletionRun, include_usage: bool, finished: list[RequestOutput]
                            ) -> AsyncIterator[CompletionResponse]:
    """The streamed answer's chunks; each request's final output is appended to `finished` as it ends."""
    state, requests, params = run.state, run.requests, run.requests[0].params
    prompt_index = {r.request_id: i for i, r in enumerate(requests)}
    offsets: dict[int, int] = defaultdict(int)
    async for event in deltas(run.handle, run.access, run.deadline, finished):
        index = prompt_index[event.request_id] * params.n + event.index
        logprobs = _delta_logprobs(state, event, params, offsets, index)
        if not (event.text or event.finish_reason or logprobs):
            continue  # text held back (a possible stop string)
        choice = CompletionChoice(index=index, text=event.text, logprobs=logprobs, finish_reason=event.finish_reason)
        yield CompletionResponse(id=run.completion_id, model=state.model_name, choices=[choice])
    if include_usage:
        yield CompletionResponse(id=run.completion_id, model=state.model_name, choices=[],
                                 usage=_usage(requests, finished))


def _delta_logprobs(state: ServerState, delta: StreamDelta, params: SamplingParams, offsets: dict[int, int],
                    index: int) -> CompletionLogprobs | None:
    if params.logprobs is None or not delta.token_ids:
        return None
    logprobs = completion_logprobs(state.strings, delta.token_ids, delta.logprobs, delta.top_logprobs, offsets[index])
    offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
    return logprobs


def _usage(requests: list[EngineRequest], outputs) -> Usage:
    outputs = list(outputs)
    return Usage.of(sum(len(r.prompt_token_ids) for r in requests), sum(len(c.token_ids) for o in outputs for c in o.outputs),
                    sum(cached_tokens(o) for o in outputs))
