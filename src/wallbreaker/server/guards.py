"""What a request must pass before any handler sees it: a Host the server answers to, an Origin it
allows, and a bounded body read in bounded time. Plain ASGI middlewares, answering in the error
shape of the API the path belongs to.

- Host: a server on loopback answers only to loopback names, so a web page cannot reach it by DNS
  rebinding (a name of the attacker's that resolves to 127.0.0.1: the class of Ollama's
  CVE-2024-28224). Bound to all interfaces, any Host is accepted unless a list is given.
- Origin: a browser names the page that sends a request; a page of another site may post a
  "simple" request (a form, `text/plain`) without asking first, so a request whose Origin is not
  allowed is a 403. Allowed: the server's own pages (the Origin is the Host asked for), pages on
  localhost (any port), and the `--allowed-origins` list (Ollama's OLLAMA_ORIGINS). Programs that
  are not browsers send no Origin and pass. The body's Content-Type is not checked: Ollama's and
  llama-server's documented `curl -d` sends JSON as a form type, and is answered.
- The body is read here, up to `max_bytes` and within `timeout_s`, then handed on: a 413 past the
  limit, a 408 for a client that trickles it. Before a 413 the rest of a body up to a few times
  the limit is read and dropped, so that the client, still sending, gets the answer and not a
  reset connection; a larger one is cut at once.
"""
from __future__ import annotations

import asyncio
import fnmatch
import ipaddress
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .error_shapes import error_body
from .errors import APIError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WEB_SCHEMES = ("http", "https")
DRAIN_FACTOR = 4  # a body up to this many times the limit is read to its end before the 413


def allowed_hosts_for(bind_host: str, allowed: Iterable[str] | None = None) -> frozenset[str] | None:
    """The Host names accepted (None: any). Explicit `allowed` wins ("*" means any)."""
    if allowed is not None:
        names = frozenset(h.strip().lower() for h in allowed if h.strip())
        return None if "*" in names else names
    if bind_host in ("0.0.0.0", "::", ""):
        return None
    if bind_host == "localhost" or _is_loopback(bind_host):
        return LOOPBACK_NAMES
    return frozenset({bind_host.lower()})


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


async def send_error(send: Send, path: str, error: APIError) -> None:
    """`error` in the shape of the API that `path` belongs to (server/error_shapes.py)."""
    body = json.dumps(error_body(error.status, error.info, path)).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class HostCheck:
    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.allowed is not None:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.allowed:
                await send_error(send, scope["path"], APIError(
                    400, f"this server does not answer to the host {host[:100]!r} (see --allowed-hosts)",
                    code="invalid_host"))
                return
        await self.app(scope, receive, send)


def origin_allowed(origin: str, host_header: str, allowed: Iterable[str] = ()) -> bool:
    """Whether a request from a page at `origin` (the Origin header) may be answered: the page is the
    server's own (its host and port are the Host asked for), on a loopback name, or matches one of
    `allowed` (shell-style patterns: `https://*.example.com`, `*` for any)."""
    origin = origin.strip().lower()
    if any(fnmatch.fnmatchcase(origin, pattern.strip().lower()) for pattern in allowed):
        return True
    scheme, _, rest = origin.partition("://")
    if scheme not in WEB_SCHEMES or not rest:
        return False
    return rest == host_header.strip().lower() or host_name(rest) in LOOPBACK_NAMES


class OriginCheck:
    def __init__(self, app: ASGIApp, allowed: tuple[str, ...] = ()):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            origin = headers.get(b"origin")
            if origin is not None and not origin_allowed(origin.decode("latin-1"),
                                                         headers.get(b"host", b"").decode("latin-1"), self.allowed):
                await send_error(send, scope["path"], APIError(
                    403, f"requests from pages at {origin.decode('latin-1')[:100]!r} are not allowed "
                         "(see --allowed-origins)", type="permission_error", code="origin_not_allowed"))
                return
        await self.app(scope, receive, send)


class BodyGuard:
    """The whole body read before the app runs (then replayed), within its size and time."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        limit = self.max_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            if int(declared) <= DRAIN_FACTOR * limit:
                await self._within_time(self._read(receive, DRAIN_FACTOR * limit))
            await send_error(send, scope["path"], _too_large(limit))
            return
        body = await self._within_time(self._read(receive, limit))
        if body is _TIMED_OUT:
            await send_error(send, scope["path"], APIError(
                408, f"the request body did not arrive within {self.timeout_s:g} s", type="timeout",
                code="body_timeout"))
        elif body is None:
            await self._within_time(self._read(receive, (DRAIN_FACTOR - 1) * limit))
            await send_error(send, scope["path"], _too_large(limit))
        elif isinstance(body, bytes):
            await self.app(scope, _replay(body, receive), send)
        # else the client left while sending: nobody to answer

    async def _within_time(self, reading):
        try:
            return await asyncio.wait_for(reading, self.timeout_s)
        except TimeoutError:
            return _TIMED_OUT

    @staticmethod
    async def _read(receive: Receive, limit: int) -> bytes | dict | None:
        """The (rest of the) body; None past `limit` bytes; the disconnect message if the client left."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


_TIMED_OUT = object()


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (see --max-request-bytes)",
                    code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the connection's own messages (a disconnect, for streams)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed
