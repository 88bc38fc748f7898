"""64 concurrent streaming clients on one server: everyone who stays gets the full offline answer,
the 16 who leave mid-stream have their requests aborted, and no KV block leaks."""
from __future__ import annotations

import asyncio

import openai
import pytest
from server_process import ServerProcess, scrape_metrics, wait_for_metric

from wallbreaker import LLM, SamplingParams

N_CLIENTS = 64
MAX_TOKENS = 24
LEAVER_MAX_TOKENS = 400  # far more than they wait for: only an abort can end them in time
ABORTED = 'wallbreaker_requests_total{finish_reason="abort"}'


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    process = ServerProcess(tiny_llama.gguf_path, log_path=tmp_path_factory.mktemp("server") / "server.log")
    yield process
    process.stop()


def _prompt(i: int) -> str:
    return f"Client {i} says: the quick brown fox jumps over {i % 7} lazy dogs."


async def _stay(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
    stream = await client.completions.create(model="model", prompt=_prompt(i), temperature=0.0,
                                             max_tokens=MAX_TOKENS, stream=True)
    text, reason = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


async def _leave(client: openai.AsyncOpenAI, i: int) -> int:
    stream = await client.completions.create(model="model", prompt=_prompt(i), temperature=0.0,
                                             max_tokens=LEAVER_MAX_TOKENS, stream=True,
                                             extra_body={"ignore_eos": True})
    seen = 0
    async for chunk in stream:
        seen += sum(1 for c in chunk.choices if c.text)
        if seen >= 3:
            break
    await stream.close()
    return seen


async def _run_clients(url: str, leavers: set[int]) -> list:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        jobs = [_leave(client, i) if i in leavers else _stay(client, i) for i in range(N_CLIENTS)]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=90)


def test_concurrent_streams_get_full_answers_and_leavers_free_their_blocks(server, tiny_llama):
    leavers = set(range(3, N_CLIENTS, 4))
    stayers = [i for i in range(N_CLIENTS) if i not in leavers]
    expected = LLM(tiny_llama.gguf_path, dtype="float32").generate([_prompt(i) for i in stayers],
                                                  SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    aborted_before = scrape_metrics(server.url)[ABORTED]

    results = asyncio.run(_run_clients(server.url, leavers))

    assert len(leavers) == 16
    assert [results[i] for i in stayers] == [(e.outputs[0].text, e.outputs[0].finish_reason) for e in expected]
    assert all(results[i] >= 3 for i in leavers)
    after = wait_for_metric(server.url, "wallbreaker_kv_blocks_used", 0.0)
    assert after["wallbreaker_kv_blocks_used"] == 0.0, "KV blocks leaked"
    assert after["wallbreaker_requests_running"] == 0.0
    assert after[ABORTED] - aborted_before == len(leavers)
