"""Pooling routes: OpenAI's `POST /v1/embeddings`, the Jina/Cohere rerank shape vLLM and llama.cpp
accept (`POST /v1/rerank`, `/rerank`), vLLM's `POST /score`, and Ollama's `POST /api/embed`.

Each input is one engine request, prefill-only, batched by the same scheduler as generation
(pooling_requests.py builds them). A model that cannot serve the route (a generation model with no
pooling config; an embedding model asked for a cross-encoder's score is fine: it scores by cosine)
is a 400 naming why. Ollama's route answers errors in Ollama's shape, `{"error": "..."}`.
"""
from __future__ import annotations

import base64
import time
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from ..engine.client import EngineRequest, RequestOutput
from ..errors import InvalidRequestError
from ..pooling_params import PoolingParams
from ..pooling_requests import PoolingRun, input_ids, relevance_requests, score_pairs, truncation_limit
from .errors import APIError, bad_request, parse_body
from .protocol import TokenIds, _Body, _one_of
from .router import serving_state
from .state import ServerState
from .streaming import collect

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one embeddings request
EmbeddingInput = Annotated[str | list[str] | TokenIds | list[TokenIds],
                           _one_of("a string, a list of strings, a list of token ids, or a list of such lists")]


class EmbeddingRequest(_Body):
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: a count, or -1 for the model's limit
    normalize: bool | None = None  # vLLM's


class RerankDocument(BaseModel):
    text: str


class RerankRequest(_Body):
    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: Annotated[int, Field(ge=1)] | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


class ScoreRequest(_Body):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: int | None = None


class OllamaEmbedRequest(_Body):
    model: str
    input: str | list[str]
    truncate: bool = True  # Ollama cuts an input at the model's limit unless told not to
    dimensions: Annotated[int, Field(ge=1)] | None = None
    keep_alive: str | int | float | None = None  # how long the model stays loaded once idle (server/router.py)
    options: dict[str, Any] | None = None


def _inputs(value: Any) -> list[str | list[int]]:
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, int) for t in value)):
        return [value]
    return list(value)


async def _pool(state: ServerState, request: Request, requests: list[EngineRequest],
                deadline: float | None) -> list[RequestOutput]:
    handle = state.engine.submit(requests, stream=False)
    outputs = await collect(handle, request, deadline, state.request_timeout)
    return [outputs[r.request_id] for r in requests]


def _run(state: ServerState) -> PoolingRun:
    return PoolingRun(state.engine.client, state.llm.tokenizer, state.llm.model_config.hidden_size)


def _embedding_requests(state: ServerState, texts: list[str | list[int]], params: PoolingParams,
                        truncate: int | None, prefix: str) -> list[EngineRequest]:
    """Checked and tokenized (called off the event loop)."""
    if len(texts) > MAX_INPUTS:
        raise InvalidRequestError(f"at most {MAX_INPUTS} inputs a request, got {len(texts)}", param="input")
    limit = truncation_limit(truncate, state.llm.max_model_len)
    run = _run(state)
    return run.requests([input_ids(state.llm.tokenizer, t, limit) for t in texts], params, prefix)


def _as_api_error(e: InvalidRequestError, param: str) -> APIError:
    return bad_request(str(e), param=e.param or param)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's client decodes it
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


router = APIRouter()


@router.post("/v1/embeddings")
async def create_embeddings(request: Request) -> Response:
    body = await parse_body(request, EmbeddingRequest)
    state = await serving_state(request, body.model)
    access, request_id, deadline = state.admit(request, "embd")
    params = PoolingParams("embed", body.dimensions, body.normalize)
    try:
        requests = await run_in_threadpool(_embedding_requests, state, _inputs(body.input), params,
                                           body.truncate_prompt_tokens, request_id)
    except InvalidRequestError as e:
        raise _as_api_error(e, "input") from None
    access.prompt_tokens = tokens = sum(len(r.prompt_token_ids) for r in requests)
    outputs = await _pool(state, request, requests, deadline)
    vectors = _run(state).embeddings(outputs, params)
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": state.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


async def _relevance(state: ServerState, request: Request, pairs: list[tuple[str, str]], truncate: int | None,
                     request_id: str, deadline: float | None) -> tuple[list[float], int]:
    def build():
        limit = truncation_limit(truncate, state.llm.max_model_len)
        return relevance_requests(_run(state), pairs, limit, request_id)
    try:
        requests, finish = await run_in_threadpool(build)
    except InvalidRequestError as e:
        raise _as_api_error(e, "documents") from None
    outputs = await _pool(state, request, requests, deadline)
    return finish(outputs), sum(len(r.prompt_token_ids) for r in requests)


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(request: Request) -> Response:
    body = await parse_body(request, RerankRequest)
    state = await serving_state(request, body.model)
    access, request_id, deadline = state.admit(request, "rerank")
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    scores, tokens = [], 0
    if documents:
        scores, tokens = await _relevance(state, request, [(body.query, d) for d in documents],
                                          body.truncate_prompt_tokens, request_id, deadline)
    access.prompt_tokens = tokens
    ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if body.return_documents else {})} for i in ranked]
    return JSONResponse({"id": request_id, "model": state.model_name, "results": results,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


@router.post("/score")
@router.post("/v1/score")
async def score(request: Request) -> Response:
    body = await parse_body(request, ScoreRequest)
    state = await serving_state(request, body.model)
    access, request_id, deadline = state.admit(request, "score")
    try:
        pairs = score_pairs(body.text_1, body.text_2)
    except InvalidRequestError as e:
        raise _as_api_error(e, "text_2") from None
    scores, tokens = await _relevance(state, request, pairs, body.truncate_prompt_tokens, request_id, deadline)
    access.prompt_tokens = tokens
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()), "model": state.model_name,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


@router.post("/api/embed")
async def ollama_embed(request: Request) -> Response:
    """Ollama's embed (its errors, `{"error": "..."}`, by path: server/error_shapes.py); `truncate`
    (default true) cuts at the model's limit."""
    start = time.perf_counter()
    body = await parse_body(request, OllamaEmbedRequest)
    state = await serving_state(request, body.model, body.keep_alive)
    access, request_id, deadline = state.admit(request, "embed")
    params = PoolingParams("embed", body.dimensions)
    try:
        requests = await run_in_threadpool(_embedding_requests, state, _inputs(body.input), params,
                                           -1 if body.truncate else None, request_id)
    except InvalidRequestError as e:
        raise _as_api_error(e, "input") from None
    outputs = await _pool(state, request, requests, deadline)
    vectors = _run(state).embeddings(outputs, params)
    tokens = sum(len(r.prompt_token_ids) for r in requests)
    access.prompt_tokens = tokens
    return JSONResponse({"model": body.model, "embeddings": vectors,
                         "total_duration": int((time.perf_counter() - start) * 1e9), "load_duration": 0,
                         "prompt_eval_count": tokens})

