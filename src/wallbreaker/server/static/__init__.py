"""The chat page at `GET /`: one HTML page, its scripts and its style sheet, shipped as package data
(no build step, nothing fetched from elsewhere) and served from memory.

The page only talks to this server's own OpenAI routes, so it is never behind the API key: it holds
no secret, and it asks the user for the key when `/v1/models` answers 401. Its Content-Security-Policy
allows scripts and styles from this origin only (no inline script, no `eval`), so even a rendering bug
could not run script that a model wrote: the page also never puts model text into `innerHTML`.
"""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI, Response

from ..errors import APIError

CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_ASSET_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def _files() -> tuple[bytes, dict[str, tuple[bytes, str]]]:
    root = resources.files(__name__)
    page = root.joinpath("index.html").read_bytes()
    assets = {}
    for entry in root.iterdir():
        kind = _ASSET_TYPES.get("." + entry.name.rpartition(".")[2])
        if kind is not None and entry.is_file():
            assets[entry.name] = (entry.read_bytes(), kind)
    return page, assets


def add_chat_page(app: FastAPI) -> None:
    """`GET /` (the page) and `GET /static/{name}` (its scripts and style sheet: a fixed set, read once).
    `HEAD /` answers too: clients ask it to see that a server is up (Claude Code, Ollama's)."""
    page, assets = _files()
    page_headers = {**_HEADERS, "Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Frame-Options": "DENY"}

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=page_headers)

    @app.get("/static/{name}", include_in_schema=False)
    async def chat_page_asset(name: str) -> Response:
        if name not in assets:
            raise APIError(404, f"no file {name[:100]!r} under /static", code="not_found")
        body, kind = assets[name]
        return Response(body, media_type=kind, headers=_HEADERS)
