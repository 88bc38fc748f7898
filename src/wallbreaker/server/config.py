"""The server's settings, one dataclass: what `wallbreaker serve`'s flags set."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError

API_KEY_ENV = "WALLBREAKER_API_KEY"  # `serve` reads the key from here when no --api-key is given (not in `ps`)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model file's stem
    api_key: str | None = None
    protect_metrics: bool = False  # /health and /metrics need the key too (open by default, as vLLM's)
    max_queue: int = 1024  # sequences that may wait beyond max_num_seqs before a 429
    request_timeout: float | None = 600.0  # seconds before a request is aborted (408); None: never
    max_request_bytes: int = 16 * 2**20  # a larger body is a 413
    body_timeout: float = 30.0  # seconds for a request body to arrive
    header_timeout: float = 10.0  # seconds for a connection to send a request's headers
    max_connections: int = 256  # beyond, new connections get a 503
    allowed_hosts: tuple[str, ...] | None = None  # Host names answered; None: derived from `host`
    allowed_origins: tuple[str, ...] = ()  # pages (Origin patterns) answered beyond localhost and the server's own
    keepalive_interval: float = 10.0  # seconds of silence in a stream before a keep-alive event
    grammar_compile_timeout: float = 5.0  # seconds a schema, regex or grammar may take to compile (else a 400)

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise InvalidRequestError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise InvalidRequestError(f"request_timeout must be positive (or None for no limit), got {self.request_timeout}")
        for name in ("max_request_bytes", "body_timeout", "header_timeout", "max_connections", "keepalive_interval",
                     "grammar_compile_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        if self.api_key == "":
            raise InvalidRequestError("the API key is empty")
