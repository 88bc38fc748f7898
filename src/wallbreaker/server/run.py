"""Serving an app with uvicorn until SIGTERM or Ctrl-C, then shutting down gracefully."""
from __future__ import annotations

import logging
import signal

import uvicorn
from fastapi import FastAPI


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          graceful_timeout: float = 30.0) -> None:
    """On SIGTERM uvicorn stops accepting connections, lets in-flight requests finish (up to
    `graceful_timeout` seconds, then cancels them, which aborts their engine requests), runs the
    app's shutdown (stopping the engine loop) and returns."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=graceful_timeout)
    # uvicorn re-raises the signal after its graceful shutdown; with this handler in place that is
    # a no-op, and the process exits 0 instead of dying of SIGTERM.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
