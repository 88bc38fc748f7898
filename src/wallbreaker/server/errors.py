"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every failure path."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InvalidRequestError
from .error_shapes import error_body
from .responses import ErrorInfo

logger = logging.getLogger("wallbreaker.server")
M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")


def queue_full(limit: int) -> APIError:
    return APIError(429, f"the server is busy: more than {limit} requests already wait; retry later",
                    type="server_overloaded", code="queue_full")


def request_timeout(seconds: float) -> APIError:
    return APIError(408, f"the request did not finish within {seconds:g} s and was aborted",
                    type="timeout", code="request_timeout")


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error in the shape of the API that `path` belongs to (server/error_shapes.py)."""
    return JSONResponse(error_body(error.status, error.info, path), status_code=error.status)


def install_error_handlers(app: FastAPI) -> None:
    """Turn every exception into the error shape of the path's API (OpenAI's, but Anthropic's and
    Ollama's on their paths): ours, FastAPI's validation (400, never 422),
    Starlette's 404/405, and anything unexpected (500, logged, the server keeps running)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(bad_request(str(exc), param=exc.param), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind, code=exc.status_code),
                              request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="internal_server_error",
                                       code="internal_error"), request.url.path)


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`, whatever the Content-Type says (curl's `-d` sends a form type)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def validation_error(errors: Sequence[Any]) -> APIError:
    """One readable line for the first problem: where it is and what is wrong."""
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    param = loc[0] if loc else None
    where = f"'{'.'.join(loc)}': " if loc else "the body: "
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return bad_request(f"{where}{first.get('msg', 'invalid')}{more}", param=param)
