"""server/streaming.py: keep-alive events while a stream is silent (a long prompt being prefilled)."""
from __future__ import annotations

import asyncio
import json

import httpx
from server_apps import running_server, tool_app
from server_process import free_port

from wallbreaker.server.streaming import SSE_KEEPALIVE, with_keepalive


async def _slow(pieces: list[str], pause_s: float):
    for piece in pieces:
        await asyncio.sleep(pause_s)
        yield piece


def _collect(chunks, keepalive: str | None, interval: float) -> list[str]:
    async def run() -> list[str]:
        return [c async for c in with_keepalive(chunks, keepalive, interval)]
    return asyncio.run(run())


def test_a_silent_stream_gets_keepalives_between_its_chunks_and_keeps_them_all():
    out = _collect(_slow(["a", "b"], 0.25), SSE_KEEPALIVE, 0.05)
    assert [c for c in out if c != SSE_KEEPALIVE] == ["a", "b"]
    assert out.index("a") >= 2 and out.index("b") - out.index("a") >= 3  # ~4 silent intervals before each


def test_a_stream_faster_than_the_interval_and_ndjson_get_none():
    assert _collect(_slow(["a", "b", "c"], 0.0), SSE_KEEPALIVE, 5.0) == ["a", "b", "c"]
    assert _collect(_slow(["a", "b"], 0.1), None, 0.01) == ["a", "b"]


def test_anthropic_streams_ping_events_and_openai_comments(tiny_llama):
    # a microsecond: the engine thread cannot answer that fast, so each wait for the next event sees silence
    with running_server(tool_app(tiny_llama.gguf_path, port=free_port(), keepalive_interval=1e-6)) as url:
        body = {"model": "m", "max_tokens": 24, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        text = httpx.post(f"{url}/v1/messages", json=body, timeout=60).text
        events = [block.split("\n")[0] for block in text.strip().split("\n\n")]
        assert events[0] == "event: message_start" and events[-1] == "event: message_stop"
        pings = [b for b in text.strip().split("\n\n") if b.startswith("event: ping")]
        assert pings and all(json.loads(p.split("data: ", 1)[1]) == {"type": "ping"} for p in pings)
        chat = {"max_tokens": 24, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        text = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).text
        assert SSE_KEEPALIVE in text and text.endswith("data: [DONE]\n\n")


def test_a_silent_anthropic_stream_that_asked_for_thinking_gets_an_empty_thinking_block(tiny_llama):
    """Anthropic's clients skip `ping`; Claude Code drops a stream after 5 minutes without an event it
    sees. The official client still assembles the answer: an empty thinking block, then the text."""
    import anthropic
    with running_server(tool_app(tiny_llama.gguf_path, port=free_port(), keepalive_interval=1e-6)) as url:
        client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        request = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                   "extra_body": {"temperature": 0}}
        with client.messages.stream(**request, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
            final = stream.get_final_message()
        whole = client.messages.create(**request)  # after: a cold prompt keeps the stream waiting on the engine
        assert ("content_block_delta", "thinking_delta") in kinds
        assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == ""
        assert final.content[1].text == whole.content[0].text
        request["messages"] = [{"role": "user", "content": "Hello there"}]
        with client.messages.stream(**request) as stream:  # no thinking asked for: pings only
            assert [b.type for b in stream.get_final_message().content] == ["text"]
