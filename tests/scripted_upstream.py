"""A stand-in for the server that answers every first request with a tool call, then with text.

A small model seldom writes a tool call that Claude Code or Codex can run, so their requests after a
tool ran (the `tool_result` / `function_call_output` shapes in tests/data/client_bodies/) were captured
with this behind tests/client_capture.py:

    python tests/scripted_upstream.py --port 8741 --file /tmp/scratch/notes.txt
    python tests/client_capture.py --upstream http://127.0.0.1:8741 --port 8742 --out /tmp/capture/claude
    ANTHROPIC_BASE_URL=http://127.0.0.1:8742 ANTHROPIC_API_KEY=x claude -p "Read notes.txt ..."

Anthropic Messages: a `Read` tool_use of `--file` (or `--tool NAME --input JSON`: e.g. `--tool ToolSearch
--input '{"query": "select:WebFetch"}'` with `ENABLE_TOOL_SEARCH=true`, for the deferred-tool shapes),
then text once a `tool_result` comes back.
Responses: an `exec_command` call that cats `--file` (Codex's shell tool), then a message once a
`function_call_output` comes back. Both streamed, as these clients ask.
"""
from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

ANSWER = "The file has been read."


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def _messages_stream(body: dict, tool: str, tool_input: dict) -> Iterator[str]:
    answered = any(isinstance(m["content"], list) and any(b.get("type") == "tool_result" for b in m["content"])
                   for m in body["messages"])
    yield _sse("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": body["model"], "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}})
    if answered:
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": ANSWER}
    else:
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:8]}", "name": tool, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(tool_input)}
    yield _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
    yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
    yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
    stop = "end_turn" if answered else "tool_use"
    yield _sse("message_delta", {"type": "message_delta", "usage": {"output_tokens": 1},
                                 "delta": {"stop_reason": stop, "stop_sequence": None}})
    yield _sse("message_stop", {"type": "message_stop"})


def _responses_stream(body: dict, file: str) -> Iterator[str]:
    answered = any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in body["input"])
    if answered:
        item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:8]}", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": ANSWER, "annotations": []}]}
    else:
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:8]}", "call_id": f"call_{uuid.uuid4().hex[:8]}",
                "name": "exec_command", "arguments": json.dumps({"cmd": f"cat {file}"}), "status": "completed"}
    response = {"id": f"resp_{uuid.uuid4().hex[:8]}", "object": "response", "created_at": 0, "model": body["model"],
                "status": "in_progress", "output": []}
    usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}
    yield _sse("response.created", {"type": "response.created", "sequence_number": 0, "response": response})
    for n, kind in enumerate(("added", "done"), start=1):
        yield _sse(f"response.output_item.{kind}", {"type": f"response.output_item.{kind}", "sequence_number": n,
                                                    "output_index": 0, "item": item})
    yield _sse("response.completed", {"type": "response.completed", "sequence_number": 3, "response": {
        **response, "status": "completed", "output": [item], "usage": usage}})


def scripted_app(file: str, tool: str = "Read", tool_input: dict | None = None) -> Starlette:
    tool_input = {"file_path": file} if tool_input is None else tool_input

    async def messages(request: Request) -> StreamingResponse:
        stream = _messages_stream(await request.json(), tool, tool_input)
        return StreamingResponse(stream, media_type="text/event-stream")

    async def responses(request: Request) -> StreamingResponse:
        return StreamingResponse(_responses_stream(await request.json(), file), media_type="text/event-stream")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"]),
                             Route("/v1/responses", responses, methods=["POST"]), Route("/v1/models", models)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--file", required=True, help="the file the scripted tool call reads")
    parser.add_argument("--tool", default="Read", help="the tool of the Anthropic tool_use")
    parser.add_argument("--input", type=json.loads, default=None, help="its input, JSON (default: the file's path)")
    args = parser.parse_args()
    uvicorn.run(scripted_app(args.file, args.tool, args.input), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
