"""The FastAPI app: OpenAI's routes over one `AsyncEngine`."""
from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from ..llm import LLM
from .access_log import AccessLogMiddleware
from .anthropic_messages import add_anthropic_messages
from .config import ServerConfig
from .errors import APIError, install_error_handlers, parse_body
from .guards import BodyGuard, HostCheck, OriginCheck, allowed_hosts_for
from .lora_adapters import add_lora_routes
from .metrics import ServerMetrics
from .ollama_api import add_ollama_api
from .openai_responses import add_openai_responses
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeCompletionRequest
from .responses import ModelList
from .router import ModelLeases, ModelRouter, SingleModel, combined_stats, kv_bytes_by_dtype, open_state, serving_state
from .serving_chat import create_chat_completion
from .serving_completion import create_completion
from .serving_embedding import router as pooling_router
from .sessions import add_session_routes
from .static import add_chat_page
from .infill import InfillRequest, create_infill
from .tokenize import detokenize, tokenize


def default_model_name(llm: LLM) -> str:
    """The model file's stem (`SmolLM2-135M-Instruct.Q4_1`), or a Hugging Face folder's name."""
    path = llm.model_path
    return path.name if path.is_dir() else path.stem


def build_app(llm: LLM | ModelRouter, config: ServerConfig | None = None, **settings: Any) -> FastAPI:
    """The server's app (`settings` override fields of `config`) over one model, whose engine thread
    starts now, or over a router's models (server/router.py), loaded as requests name them. Engine
    threads stop with the app's lifespan."""
    config = dataclasses.replace(config or ServerConfig(), **settings)
    metrics = ServerMetrics()
    if isinstance(llm, ModelRouter):
        served: SingleModel | ModelRouter = llm
        llm.attach(metrics, config)
    else:
        state = open_state(llm, config.served_model_name or default_model_name(llm), metrics, config)
        served = SingleModel(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if isinstance(served, ModelRouter):
            served.announce()
        yield
        await served.shutdown()

    app = FastAPI(title="wallbreaker", summary="An OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.models, app.state.config = served, config
    if isinstance(served, SingleModel):
        app.state.server = served.state  # the one model's state (tests reach its engine here)
    install_error_handlers(app)
    app.add_middleware(BodyGuard, max_bytes=config.max_request_bytes, timeout_s=config.body_timeout)
    app.add_middleware(OriginCheck, allowed=config.allowed_origins)
    app.add_middleware(HostCheck, allowed=allowed_hosts_for(config.host, config.allowed_hosts))
    app.add_middleware(AccessLogMiddleware)
    app.add_middleware(ModelLeases)
    v1 = [Depends(_api_key_check(config.api_key))]
    open_routes = v1 if config.protect_metrics else []

    @app.get("/health", dependencies=open_routes)
    async def health() -> Response:
        if not all(s.engine.alive for s in served.states()):
            raise APIError(503, "the engine loop is not running", type="service_unavailable", code="engine_down")
        return Response('{"status":"ok"}', media_type="application/json")

    @app.get("/metrics", dependencies=open_routes)
    async def metrics_text() -> Response:
        """From what the engine thread published after its last step: a scrape never waits on it."""
        metrics.set_engine_stats(*combined_stats(served.states()))
        metrics.kv_cache_bytes.clear()
        for dtype, nbytes in kv_bytes_by_dtype(served.states()).items():
            metrics.kv_cache_bytes.labels(dtype).set(nbytes)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=v1)
    async def model_list() -> ModelList:
        return ModelList(data=served.cards())

    @app.post("/v1/completions", dependencies=v1, openapi_extra=_json_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest)
        return await create_completion(body, request, await serving_state(request, body.model))

    @app.post("/v1/chat/completions", dependencies=v1, openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest)
        return await create_chat_completion(body, request, await serving_state(request, body.model))

    @app.post("/tokenize", dependencies=v1, openapi_extra=_json_body(TokenizeCompletionRequest))
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(request)

    @app.post("/detokenize", dependencies=v1, openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(request)

    add_lora_routes(app, v1)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    add_session_routes(app, v1)  # POST /sessions/{name}/save|restore, DELETE /sessions/{name}

    @app.post("/infill", dependencies=v1, openapi_extra=_json_body(InfillRequest))
    async def infill(request: Request) -> Response:
        body = await parse_body(request, InfillRequest)
        return await create_infill(body, request, await serving_state(request, body.model))

    add_anthropic_messages(app, v1)
    add_ollama_api(app, v1)
    add_openai_responses(app, v1)
    app.include_router(pooling_router, dependencies=v1)  # /v1/embeddings, /v1/rerank, /rerank, /score, /api/embed

    add_chat_page(app)  # GET / and /static/*: the chat page, never behind the key (it holds no secret)
    return app


def _json_body(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def _api_key_check(api_key: str | None) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")  # Anthropic's clients send the key so
        if not secrets.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                           code="invalid_api_key")
    return check
