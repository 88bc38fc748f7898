"""One log line a request: its id, status, tokens in and out, time to first token, total time."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("wallbreaker.server")
_QUIET_PATHS = ("/health", "/metrics")  # scraped often: logged at DEBUG


@dataclass
class AccessRecord:
    method: str
    path: str
    request_id: str = "-"
    status: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    start: float = field(default_factory=time.perf_counter)

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.start

    def log(self) -> None:
        level = logging.DEBUG if self.path in _QUIET_PATHS else logging.INFO
        ttft = f"{self.ttft_s:.3f}s" if self.ttft_s is not None else "-"
        logger.log(level, "%s %s %s %s prompt_tokens=%d completion_tokens=%d ttft=%s total=%.3fs",
                   self.request_id, self.method, self.path, self.status or 500, self.prompt_tokens,
                   self.completion_tokens, ttft, time.perf_counter() - self.start)


class AccessLogMiddleware:
    """Puts an `AccessRecord` in `request.state.access` for handlers to fill, and logs it once the
    response has been sent (for a stream: after its last chunk, or after the client left)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord(scope.get("method", "-"), scope.get("path", "-"))
        scope.setdefault("state", {})["access"] = record

        async def send_and_note(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            record.log()
