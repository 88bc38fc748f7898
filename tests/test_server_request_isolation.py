"""The server isolates requests: eight good streaming requests run beside a stream of bad ones (one
for each malformed or hostile input a request can carry). The good ones must finish with exactly the
text they give alone, the KV blocks must return to zero, and /health must answer 200 throughout.

The server is real (uvicorn on loopback, the settings `serve` uses) but runs in this process, so
that its model can carry two faults a request can reach: 64 padded embedding rows that win every
argmax, and a step that fails on one token id."""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from server_apps import make_app, running_server
from server_process import free_port
from tiny_models import write_padded_vocab_model

from wallbreaker import LLM, SamplingParams
from wallbreaker.engine.model_runner import ModelRunner

GOOD_MAX_TOKENS = 24
POISON = 7


def good_prompt(i: int) -> str:
    return f"Request {i}: the quick brown fox jumps over {i} lazy dogs."


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory):
    return write_padded_vocab_model(tiny_llama, tmp_path_factory.mktemp("padded_mixed"))


def bad_requests(url: str) -> list[tuple[str, dict, dict, int]]:
    """(what, request kwargs for httpx, extra, expected status)."""
    json_headers = {"Content-Type": "application/json"}

    def body(**fields) -> dict:
        return {"content": json.dumps({"prompt": "Hi", "max_tokens": 4, **fields}), "headers": json_headers}
    return [
        ("a step that fails on this request", body(prompt=[5, POISON, 9]), {}, 500),
        ("token id past the embedding", body(prompt=[10**6]), {}, 400),
        ("token id in the padded rows", body(prompt=[520]), {}, 400),
        ("logprobs while padded rows dominate", body(temperature=1.0, logprobs=5, seed=3), {}, 200),
        ("another tenant's cache salt", body(prompt=good_prompt(0), cache_salt="other", temperature=0.0), {}, 200),
        ("10,000 stop strings", body(stop=[f"s{i}" for i in range(10_000)]), {}, 400),
        ("a stop string of 100k characters", body(stop=["z" * 100_000]), {}, 400),
        ("a 20 MB body", {"content": b'{"prompt": "' + b"a" * 20_000_000 + b'"}', "headers": json_headers}, {}, 413),
        ("a prompt too long to tokenize", body(prompt="word " * 200_000), {}, 400),
        ("a DNS-rebinding Host", body(), {"Host": "evil.example"}, 400),
        ("a text/plain cross-site POST", {"content": json.dumps({"prompt": "Hi"}), "headers": {"Content-Type": "text/plain"}},
         {"Origin": "http://evil.example"}, 403),
        ("malformed JSON", {"content": b'{"prompt": "Hi", ', "headers": json_headers}, {}, 400),
        ("n past 128", body(n=129), {}, 400),
    ]


async def _good(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
    stream = await client.completions.create(model="default", prompt=good_prompt(i), temperature=0.0,
                                             max_tokens=GOOD_MAX_TOKENS, stream=True)
    text, reason = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


async def _bad(http: httpx.AsyncClient, what: str, request: dict, headers: dict, status: int) -> str | None:
    kwargs = dict(request)
    kwargs["headers"] = {**request.get("headers", {}), **headers}
    response = await http.post("/v1/completions", **kwargs)
    if response.status_code != status:
        return f"{what}: {response.status_code} (expected {status}) {response.text[:200]}"
    if status >= 400 and "error" not in response.json():
        return f"{what}: not in OpenAI's error shape"
    if status == 200 and not isinstance(response.json()["choices"][0]["text"], str):
        return f"{what}: no text"
    return None


async def _leaver(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(model="default", prompt="leave", max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True})
    async for _ in stream:
        break
    await stream.close()


async def _health(http: httpx.AsyncClient, stop: asyncio.Event) -> list[int]:
    statuses = []
    while not stop.is_set():
        statuses.append((await http.get("/health")).status_code)
        await asyncio.sleep(0.05)
    return statuses


async def _metrics_flood(http: httpx.AsyncClient, stop: asyncio.Event) -> int:
    count = 0
    while not stop.is_set():
        assert (await http.get("/metrics")).status_code == 200
        count += 1
    return count


async def _run(url: str) -> dict:
    limits = httpx.Limits(max_connections=64)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client, \
            httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        stop = asyncio.Event()
        health = asyncio.ensure_future(_health(http, stop))
        flood = asyncio.ensure_future(_metrics_flood(http, stop))
        bad = [_bad(http, *b) for b in bad_requests(url) for _ in range(2)]
        results = await asyncio.gather(*[_good(client, i) for i in range(8)], *bad, _leaver(client))
        stop.set()
        return {"good": results[:8], "bad": [r for r in results[8:-1] if r], "health": await health,
                "scrapes": await flood}


def test_good_requests_are_untouched_by_a_stream_of_bad_ones(model, monkeypatch):
    expected = LLM(model, dtype="float32", max_model_len=256, max_num_seqs=16).generate(
        [good_prompt(i) for i in range(8)], SamplingParams(temperature=0.0, max_tokens=GOOD_MAX_TOKENS))
    app = make_app(model, max_model_len=256, max_num_seqs=16, port=free_port(), header_timeout=2.0)
    runner = app.state.server.llm.engine.runner
    execute = ModelRunner.execute

    def failing(self, step):
        if (step.input_ids == POISON).any():
            raise RuntimeError("kernel fault")
        return execute(self, step)
    monkeypatch.setattr(runner, "execute", failing.__get__(runner))

    with running_server(app) as url:
        slowloris = socket.create_connection(("127.0.0.1", app.state.server.config.port))
        slowloris.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
        result = asyncio.run(asyncio.wait_for(_run(url), timeout=300))
        slowloris.close()
        for _ in range(100):
            snapshot = app.state.server.engine.snapshot
            if snapshot["kv_blocks_used"] == 0 and snapshot["num_running"] == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        metrics = httpx.get(f"{url}/metrics").text

    assert result["good"] == [(e.outputs[0].text, e.outputs[0].finish_reason) for e in expected]
    assert result["bad"] == []
    assert result["health"] and set(result["health"]) == {200}
    assert result["scrapes"] > 0
    assert snapshot["kv_blocks_used"] == 0 and snapshot["num_running"] == 0
    assert "wallbreaker_kv_blocks_used 0.0" in metrics
