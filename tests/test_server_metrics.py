"""/metrics shows every name the contract lists, and they move as requests come and go."""
from __future__ import annotations

import httpx
import pytest
from server_process import ServerProcess, scrape_metrics, wait_for_metric

NAMES = [
    "wallbreaker_requests_running", "wallbreaker_requests_waiting", "wallbreaker_queue_length",
    "wallbreaker_kv_blocks_used", "wallbreaker_kv_blocks_total", "wallbreaker_spec_acceptance_rate",
    "wallbreaker_prompt_tokens_total", "wallbreaker_generation_tokens_total",
    *(f'wallbreaker_requests_total{{finish_reason="{r}"}}' for r in ("stop", "length", "abort", "timeout")),
    *(f"wallbreaker_{h}_{part}" for h in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                                          "e2e_request_latency_seconds") for part in ("count", "sum")),
]
LONG = {"prompt": "Hi", "max_tokens": 480, "ignore_eos": True}  # seconds of work: only an abort ends it soon


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    process = ServerProcess(tiny_llama.gguf_path, log_path=tmp_path_factory.mktemp("server") / "server.log")
    yield process
    process.stop()


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[name] - before[name]


def test_metrics_expose_every_name(server):
    samples = scrape_metrics(server.url)
    assert [n for n in NAMES if n not in samples] == []
    assert samples["wallbreaker_kv_blocks_total"] > 0
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")


def test_a_request_moves_the_counters_and_histograms(server):
    before = scrape_metrics(server.url)
    response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True, "temperature": 0})
    usage = response.json()["usage"]
    after = scrape_metrics(server.url)
    assert _delta(before, after, 'wallbreaker_requests_total{finish_reason="length"}') == 1
    assert _delta(before, after, "wallbreaker_prompt_tokens_total") == usage["prompt_tokens"]
    assert _delta(before, after, "wallbreaker_generation_tokens_total") == 6 == usage["completion_tokens"]
    assert _delta(before, after, "wallbreaker_time_to_first_token_seconds_count") == 1
    assert _delta(before, after, "wallbreaker_e2e_request_latency_seconds_count") == 1
    assert _delta(before, after, "wallbreaker_inter_token_latency_seconds_count") == 5
    assert _delta(before, after, "wallbreaker_e2e_request_latency_seconds_sum") > 0
    assert after["wallbreaker_kv_blocks_used"] == 0


def test_kv_gauges_rise_during_a_stream_and_fall_when_its_client_leaves(server):
    before = scrape_metrics(server.url)
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            during = scrape_metrics(server.url)
    assert during["wallbreaker_kv_blocks_used"] > 0
    assert during["wallbreaker_requests_running"] == 1
    after = wait_for_metric(server.url, "wallbreaker_kv_blocks_used", 0.0)
    assert after["wallbreaker_kv_blocks_used"] == 0
    assert after["wallbreaker_requests_running"] == 0
    assert _delta(before, after, 'wallbreaker_requests_total{finish_reason="abort"}') == 1


def test_plain_request_whose_client_leaves_is_aborted(server):
    before = scrape_metrics(server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.15))
    after = wait_for_metric(server.url, 'wallbreaker_requests_total{finish_reason="abort"}',
                            before['wallbreaker_requests_total{finish_reason="abort"}'] + 1)
    assert _delta(before, after, 'wallbreaker_requests_total{finish_reason="abort"}') == 1
    assert _delta(before, after, 'wallbreaker_requests_total{finish_reason="length"}') == 0
    assert wait_for_metric(server.url, "wallbreaker_kv_blocks_used", 0.0)["wallbreaker_kv_blocks_used"] == 0
