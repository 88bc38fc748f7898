"""Each API's error body, chosen by the request's path: OpenAI's `{"error": {"message", "type",
"param", "code"}}` everywhere but under Anthropic's Messages (`/v1/messages`: `{"type": "error",
"error": {"type", "message"}}`) and Ollama's API (`/api/`: `{"error": "message"}`), so that each
official client reads its own shape, whatever failed: the body, the key, the route or the engine."""
from __future__ import annotations

from .responses import ErrorInfo

ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"

# Anthropic's error types by status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(status: int, info: ErrorInfo, path: str) -> dict:
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return anthropic_error(status, info.message)
    if path.startswith(OLLAMA_PREFIX):
        return {"error": info.message}
    return {"error": info.model_dump()}
