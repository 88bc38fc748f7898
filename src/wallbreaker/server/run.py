"""Serving an app with uvicorn until SIGTERM or Ctrl-C, then shutting down gracefully."""
from __future__ import annotations

import asyncio
import functools
import logging
import signal

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from .config import ServerConfig


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers: a connection that
    trickles them (slowloris) is closed after `header_timeout` seconds instead of holding a
    connection slot forever. uvicorn's own keep-alive timer stops at the first byte."""

    def __init__(self, *args, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._header_timer.cancel()  # the request line and headers are in
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app: FastAPI, log_level: str = "info", graceful_timeout: float = 30.0) -> uvicorn.Config:
    """uvicorn's settings from the app's `ServerConfig`: host, port, connection and header limits."""
    config: ServerConfig = app.state.config
    protocol = functools.partial(HeaderTimeoutProtocol, header_timeout=config.header_timeout)
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, access_log=False,
                          lifespan="on", timeout_graceful_shutdown=graceful_timeout, http=protocol,
                          limit_concurrency=config.max_connections)


def serve(app: FastAPI, log_level: str = "info", graceful_timeout: float = 30.0) -> None:
    """On SIGTERM uvicorn stops accepting connections, lets in-flight requests finish (up to
    `graceful_timeout` seconds, then cancels them, which aborts their engine requests), runs the
    app's shutdown (stopping the engine loop) and returns."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn_config(app, log_level, graceful_timeout)
    # uvicorn re-raises the signal after its graceful shutdown; with this handler in place that is
    # a no-op, and the process exits 0 instead of dying of SIGTERM.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
