"""POST /v1/chat/completions: the messages through the model's chat template, one engine request."""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

from ..engine.outputs import RequestOutput
from .access_log import AccessRecord
from .async_engine import EngineRequest, RequestHandle
from .logprobs import chat_logprobs
from .prompts import chat_prompt
from .protocol import ChatCompletionRequest
from .responses import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatStreamChoice,
                        DeltaMessage, Usage)
from .request_params import chat_params
from .state import ServerState
from .streaming import collect, deltas, event_stream, sse


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    access, chat_id, deadline = state.admit(request, body.model, "chatcmpl")
    params = chat_params(body)
    text, ids = await run_in_threadpool(chat_prompt, state, body.messages, params.max_tokens)
    engine_request = EngineRequest(chat_id, text, ids, params)
    access.prompt_tokens = len(ids)
    handle = state.engine.submit([engine_request], stream=bool(body.stream))
    if body.stream:
        chunks = _stream(state, handle, engine_request, body.include_usage, access, deadline)
        return event_stream(handle, chunks, state.request_timeout)
    output = (await collect(handle, request, deadline, state.request_timeout))[chat_id]
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                          logprobs=chat_logprobs(state.strings, c.token_ids, c.logprobs or [], c.top_logprobs or [])
                          if params.logprobs is not None else None)
               for c in output.outputs]
    usage = _usage(output)
    access.completion_tokens = usage.completion_tokens
    access.ttft_s = output.metrics.get("ttft_s")
    body_out = ChatCompletionResponse(id=chat_id, model=state.model_name, choices=choices, usage=usage)
    return Response(body_out.model_dump_json(), media_type="application/json")


async def _stream(state: ServerState, handle: RequestHandle, engine_request: EngineRequest, include_usage: bool,
                  access: AccessRecord, deadline: float | None) -> AsyncIterator[str]:
    chat_id, params = engine_request.request_id, engine_request.params

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=chat_id, model=state.model_name, choices=choices, usage=usage))

    yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(params.n)])
    finished: list[RequestOutput] = []
    async for event in deltas(handle, access, deadline, finished):
        logprobs = None
        if params.logprobs is not None and event.token_ids:
            logprobs = chat_logprobs(state.strings, event.token_ids, event.logprobs, event.top_logprobs)
        if not (event.text or event.finish_reason or logprobs):
            continue  # text held back (a possible stop string)
        delta = DeltaMessage(content=event.text) if event.text or logprobs else DeltaMessage()
        yield chunk([ChatStreamChoice(index=event.index, delta=delta, logprobs=logprobs,
                                      finish_reason=event.finish_reason)])
    if include_usage and finished:
        yield chunk([], _usage(finished[0]))


def _usage(output: RequestOutput) -> Usage:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
