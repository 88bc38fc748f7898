"""The FastAPI app: OpenAI's routes over one `AsyncEngine`."""
from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from ..engine.llm import LLM
from ..errors import InvalidRequestError
from .access_log import AccessLogMiddleware
from .async_engine import AsyncEngine
from .errors import APIError, install_error_handlers, parse_body
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import ModelCard, ModelList
from .serving_chat import create_chat_completion
from .serving_completion import create_completion
from .state import ServerState


def default_model_name(llm: LLM) -> str:
    """The model file's stem (`SmolLM2-135M-Instruct.Q4_1`), or a Hugging Face folder's name."""
    path = llm.files.path
    return path.name if path.is_dir() else path.stem


def build_app(llm: LLM, served_model_name: str | None = None, api_key: str | None = None, max_queue: int = 1024,
              request_timeout: float | None = 600.0) -> FastAPI:
    """The server's app. Its engine thread starts now and stops with the app's lifespan."""
    if max_queue < 0:
        raise InvalidRequestError(f"max_queue must be >= 0, got {max_queue}")
    if request_timeout is not None and request_timeout <= 0:
        raise InvalidRequestError(f"request_timeout must be positive (or None for no limit), got {request_timeout}")
    metrics = ServerMetrics()
    state = ServerState(llm, AsyncEngine(llm, metrics, max_queue), metrics,
                        served_model_name or default_model_name(llm), api_key, request_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.engine.shutdown()

    app = FastAPI(title="wallbreaker", summary="An OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(AccessLogMiddleware)
    v1 = [Depends(_api_key_check(api_key))]

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.alive:
            raise APIError(503, "the engine loop is not running", type="service_unavailable", code="engine_down")
        return Response('{"status":"ok"}', media_type="application/json")

    @app.get("/metrics")
    async def metrics_text() -> Response:
        stats = await state.engine.call(lambda engine: engine.stats())
        metrics.set_engine_stats(stats, state.engine.queue_length)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=v1)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, max_model_len=llm.max_model_len)])

    @app.post("/v1/completions", dependencies=v1, openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await create_completion(await parse_body(request, CompletionRequest), request, state)

    @app.post("/v1/chat/completions", dependencies=v1, openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(await parse_body(request, ChatCompletionRequest), request, state)

    return app


def _json_body(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def _api_key_check(api_key: str | None) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
    return check
