"""Saved sessions over HTTP: a conversation's cached prefix saved under a name, and restored later,
in this server or in one started after a restart (llama-server's `POST /slots/{id}?action=save|restore`,
by name rather than by slot, since this server has no slots).

- `POST /sessions/{name}/save` with `{"prompt": "..." | [ids]}` or `{"messages": [...]}` (rendered
  by the chat template without the generation prompt, so the next turn starts with it), and
  optionally `"cache_salt"`: computes the prompt (or finds it in the prefix cache) and writes its
  full KV blocks to `kv_cache_disk_dir/sessions/{name}.kvs`.
- `POST /sessions/{name}/restore`: puts the saved blocks back into the prefix cache; the next
  request that starts with those tokens (and has the same `cache_salt`) computes only the rest.
  A session saved by another model or other engine settings is a 400 naming what differs;
  an unknown name, a 404.
- `DELETE /sessions/{name}`: removes a saved session.

Each answers `{"object": "session", "name", "model", "num_tokens", "num_blocks", "bytes"}`.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from ..engine.client import EngineRequest, SessionInfo, SessionNotFoundError, check_session_name
from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from .errors import APIError, bad_request, parse_body
from .protocol import ChatMessage, TokenIds, _Body
from .router import serving_state
from .state import ServerState
from .streaming import collect
from .tools import template_messages


class SessionSaveRequest(_Body):
    model: str | None = None
    prompt: str | TokenIds | None = None
    messages: list[ChatMessage] | None = None
    cache_salt: str | None = None


class SessionRestoreRequest(_Body):
    model: str | None = None


class SessionResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    object: str = "session"
    name: str
    model: str
    num_tokens: int
    num_blocks: int
    bytes: int


def add_session_routes(app: FastAPI, dependencies: list) -> None:
    """The routes; each acts on the model its body (or, for DELETE, `?model=`) names."""
    @app.post("/sessions/{name}/save", dependencies=dependencies)
    async def save(name: str, request: Request) -> Response:
        body = await parse_body(request, SessionSaveRequest)
        state = await serving_state(request, body.model)
        _, request_id, deadline = state.admit(request, "session")
        with _api_errors():
            check_session_name(name)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either prompt or messages", param="prompt")
        text, ids = await run_in_threadpool(_encode, state, body)
        client = state.engine.client
        with _api_errors():
            client.check_prompt(ids, 1)
        prefill = EngineRequest(ids, SamplingParams(max_tokens=1, temperature=0.0), text, request_id, body.cache_salt,
                                saved_prefix=True)
        handle = state.engine.submit([prefill], stream=False)
        await collect(handle, request, deadline, state.request_timeout)
        with _api_errors():
            info = await state.engine.call(partial(client.save_session, name, ids, body.cache_salt))
        return _answer(state, info)

    @app.post("/sessions/{name}/restore", dependencies=dependencies)
    async def restore(name: str, request: Request) -> Response:
        body = await parse_body(request, SessionRestoreRequest)  # a body, if any, must be valid JSON of its shape
        state = await serving_state(request, body.model)
        state.admit(request, "session")
        with _api_errors():
            check_session_name(name)
            info, _ = await state.engine.call(partial(state.engine.client.load_session, name))
        return _answer(state, info)

    @app.delete("/sessions/{name}", dependencies=dependencies)
    async def delete(name: str, request: Request) -> Response:
        state = await serving_state(request, request.query_params.get("model"))
        state.admit(request, "session")
        with _api_errors():
            info = await state.engine.call(partial(state.engine.client.delete_session, name))
        return _answer(state, info)


def _encode(state: ServerState, body: SessionSaveRequest) -> tuple[str | None, list[int]]:
    llm = state.llm
    with _api_errors():
        if body.messages is not None:
            if not body.messages:
                raise InvalidRequestError("messages is empty", param="messages")
            messages, _ = template_messages([m.for_template() for m in body.messages], None, llm.chat_template)
            return llm.encode_chat(messages, None, add_generation_prompt=False)
        return llm.encode(body.prompt)


@contextmanager
def _api_errors() -> Iterator[None]:
    """`InvalidRequestError` as a 400 naming its field; `SessionNotFoundError` as a 404."""
    try:
        yield
    except SessionNotFoundError as e:
        raise APIError(404, str(e), type="not_found_error", param="name", code="session_not_found") from None
    except InvalidRequestError as e:
        raise bad_request(str(e), param=e.param) from None


def _answer(state: ServerState, info: SessionInfo) -> Response:
    out = SessionResponse(name=info.name, model=state.model_name, num_tokens=info.num_tokens,
                          num_blocks=info.num_blocks, bytes=info.nbytes)
    return Response(out.model_dump_json(), media_type="application/json")
