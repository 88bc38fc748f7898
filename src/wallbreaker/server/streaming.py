"""Waiting on a handle's events: to the end (plain answers) or chunk by chunk (server-sent events),
aborting the engine requests as soon as the client leaves or the deadline passes."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..engine.client import RequestOutput, StreamDelta
from .access_log import AccessRecord
from .async_engine import Finished, RequestHandle
from .config import ServerConfig
from .errors import APIError, request_timeout
from .responses import ErrorResponse

SSE_DONE = "data: [DONE]\n\n"
SSE_KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, and their idle timers restart


class ClientDisconnected(APIError):
    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", type="client_closed", code="client_closed")


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def sse_error(error: APIError) -> str:
    return sse(ErrorResponse(error=error.info))


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that calls `on_close` however it ends: finished, failed,
    cancelled by a disconnect, or cancelled before its generator ever started."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def deltas(handle: RequestHandle, access: AccessRecord, deadline: float | None,
                 finished: list[RequestOutput]) -> AsyncIterator[StreamDelta]:
    """A streamed answer's deltas, their tokens counted into its access record; each request's
    final output is appended to `finished` as it ends."""
    async for event in handle.events(deadline):
        if isinstance(event, Finished):
            finished.append(event.output)
            continue
        if event.token_ids:
            access.first_token()
            access.completion_tokens += len(event.token_ids)
        yield event


def event_stream(handle: RequestHandle, chunks: AsyncIterator[str], config: ServerConfig,
                 done: str = SSE_DONE, error_event: Callable[[APIError], str] | None = None,
                 media_type: str = "text/event-stream", keepalive: str | None = SSE_KEEPALIVE) -> EventStreamResponse:
    """`chunks` as a whole stream in an API's own framing: a deadline passed or an API error mid-way
    becomes that API's error event (`error_event`; OpenAI's by default), `done` ([DONE]; the other
    APIs and llama.cpp's own routes send nothing: "") ends it, and the requests are aborted however
    it ends. While no chunk comes for `config.keepalive_interval` seconds (a long prompt being
    prefilled), `keepalive` is sent, so that a client's watchdog (Claude Code drops a stream silent
    for 5 minutes, and sends it again) sees the server alive; None for framings that have no such
    event (NDJSON)."""
    error_event = error_event or sse_error
    timeout_s = config.request_timeout

    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in with_keepalive(chunks, keepalive, config.keepalive_interval):
                yield chunk
        except TimeoutError:
            handle.abort("timeout")
            yield error_event(request_timeout(timeout_s or 0.0))
        except APIError as e:
            yield error_event(e)
        if done:
            yield done

    return EventStreamResponse(guarded(), on_close=handle.abort, media_type=media_type)


async def with_keepalive(chunks: AsyncIterator[str], keepalive: Any, interval: float) -> AsyncIterator[Any]:
    """`chunks`, with `keepalive` between two of them wherever `interval` seconds pass without one."""
    if keepalive is None:
        async for chunk in chunks:
            yield chunk
        return
    source = aiter(chunks)
    while True:
        pending = asyncio.ensure_future(anext(source))
        try:
            while not (await asyncio.wait({pending}, timeout=interval))[0]:
                yield keepalive
            chunk = pending.result()
        except StopAsyncIteration:
            return
        finally:
            pending.cancel()
        yield chunk


async def collect(handle: RequestHandle, request: Request, deadline: float | None,
                  timeout_s: float | None) -> dict[str, RequestOutput]:
    """Every engine request's final output, by request id. Raises a 408 `APIError` at the deadline
    and `ClientDisconnected` if the client leaves first; either way the requests are aborted."""

    async def outputs() -> dict[str, RequestOutput]:
        return {e.output.request_id: e.output async for e in handle.events(deadline) if isinstance(e, Finished)}

    gather = asyncio.ensure_future(outputs())
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gather in done:
            return gather.result()
        raise ClientDisconnected()
    except TimeoutError:
        handle.abort("timeout")
        raise request_timeout(timeout_s or 0.0) from None
    finally:
        gather.cancel()
        gone.cancel()
        handle.abort()


async def wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
