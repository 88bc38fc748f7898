"""A logging proxy between a real client (Claude Code, Codex, aider...) and a wallbreaker server.

It forwards every request unchanged and streams the answer back, and writes one JSON file per
request to a folder: method, path, query, the names of the headers (never their values: they carry
keys), the JSON body, the status with the error body when the server refused it, and when the
answer's first byte, first generated token and last byte came (seconds after the request). This is
how the fields each client sends were found (docs/clients.md), and how a client's turn is timed; the
captured bodies hold other programs' prompt text, so they stay outside the repository and only
synthetic look-alikes are committed (tests/data/client_bodies/).

    python tests/client_capture.py --upstream http://127.0.0.1:8000 --port 8100 --out /tmp/capture/claude
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

# Hop-by-hop headers, and those httpx recomputes for the body it sends or decodes
_DROPPED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


# Generated text or tool-call arguments in a streamed (or whole) answer of any of the four APIs:
# where the first token reaches the client (a ping or an empty first delta does not count)
_GENERATED = re.compile(rb'"(text_delta|input_json_delta|response\.output_text\.delta'
                        rb'|response\.function_call_arguments\.delta)"|"(content|response|arguments)": ?"[^"]')


def _parse_body(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"_not_json": raw[:2000].decode("utf-8", "replace")}


def capture_app(upstream: str, out_dir: Path) -> Starlette:
    """An app that forwards everything to `upstream` and records each request under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    counter = itertools.count(len(list(out_dir.glob("*.json"))) + 1)
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None))

    def record(n: int, request: Request, raw: bytes, status: int, error: bytes | None,
               timing: dict[str, float | None] | None = None) -> None:
        name = re.sub(r"[^A-Za-z0-9]+", "_", request.url.path).strip("_") or "root"
        entry = {
            "method": request.method, "path": request.url.path, "query": request.url.query,
            "header_names": sorted({k.lower() for k in request.headers.keys()}),
            "content_type": request.headers.get("content-type"),
            "body": _parse_body(raw), "status": status,
            "error": _parse_body(error) if error is not None else None, "timing": timing,
        }
        (out_dir / f"{n:04d}-{request.method}-{name}.json").write_text(json.dumps(entry, indent=1))

    async def forward(request: Request) -> Response:
        n, start = next(counter), time.monotonic()
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        upstream_request = client.build_request(request.method, request.url.path, params=request.url.query,
                                                headers=headers, content=raw)
        answer = await client.send(upstream_request, stream=True)
        if answer.status_code >= 400:
            error = await answer.aread()
            await answer.aclose()
            record(n, request, raw, answer.status_code, error)
            return Response(error, status_code=answer.status_code, headers=_answer_headers(answer))

        async def chunks() -> AsyncIterator[bytes]:
            timing: dict[str, float | None] = {"first_byte_s": None, "first_token_s": None, "total_s": None}
            try:
                async for chunk in answer.aiter_raw():
                    now = round(time.monotonic() - start, 3)
                    timing["first_byte_s"] = timing["first_byte_s"] or now
                    if timing["first_token_s"] is None and _GENERATED.search(chunk):
                        timing["first_token_s"] = now
                    yield chunk
            finally:
                await answer.aclose()
                timing["total_s"] = round(time.monotonic() - start, 3)
                record(n, request, raw, answer.status_code, None, timing)
        return StreamingResponse(chunks(), status_code=answer.status_code, headers=_answer_headers(answer))

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def _answer_headers(answer: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in answer.headers.items() if k.lower() not in _DROPPED}


@contextmanager
def capturing_proxy(upstream: str, out_dir: Path, port: int) -> Iterator[str]:
    """The proxy on 127.0.0.1:`port` in a thread of this process; yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(capture_app(upstream, out_dir), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the capture proxy did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--port", type=int, required=True, help="the port the client is pointed at")
    parser.add_argument("--out", type=Path, required=True, help="the folder for the captured requests")
    args = parser.parse_args()
    uvicorn.run(capture_app(args.upstream, args.out), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
