"""Prometheus metrics of one server, in a registry of its own (so that apps and tests never share)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from ..engine.client import RequestOutput, StreamDelta

FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests_running = Gauge("wallbreaker_requests_running", "Sequences in the running batch", registry=r)
        self.requests_waiting = Gauge("wallbreaker_requests_waiting", "Sequences waiting for a seat in the batch",
                                      registry=r)
        self.queue_length = Gauge("wallbreaker_queue_length",
                                  "Sequences admitted beyond the engine's seats (bounded by --max-queue)", registry=r)
        self.kv_blocks_used = Gauge("wallbreaker_kv_blocks_used", "KV blocks held by live sequences", registry=r)
        self.kv_blocks_total = Gauge("wallbreaker_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.kv_cache_bytes = Gauge("wallbreaker_kv_cache_bytes", "Bytes of the KV pool in its page dtype, scales included",
                                    ["dtype"], registry=r)
        self.spec_acceptance_rate = Gauge("wallbreaker_spec_acceptance_rate",
                                          "Accepted / proposed speculative tokens", registry=r)
        self.prompt_tokens = Counter("wallbreaker_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("wallbreaker_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("wallbreaker_requests", "Engine requests ended, by finish reason",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.ttft = Histogram("wallbreaker_time_to_first_token_seconds", "Time to first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("wallbreaker_inter_token_latency_seconds", "Time between tokens of a sequence",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("wallbreaker_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self._last_token_time: dict[tuple[str, int], float] = {}
        self.engine_stats: dict = {}  # the engine's last published snapshot (the disk counters read it)
        r.register(_DiskCounters(self))

    # Called on the engine thread --------------------------------------------------------------
    def on_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_delta(self, delta: StreamDelta, now: float) -> None:
        n = len(delta.token_ids)
        if not n:
            return
        self.generation_tokens.inc(n)
        key = (delta.request_id, delta.index)
        last = self._last_token_time.get(key)
        if last is not None:
            for _ in range(n):  # a delta of k tokens (speculation) is k gaps of 1/k
                self.itl.observe((now - last) / n)
        self._last_token_time[key] = now

    def on_finished(self, output: RequestOutput) -> None:
        reason = output.outputs[0].finish_reason if output.outputs else None
        self.requests.labels(reason if reason in FINISH_REASONS else "stop").inc()
        if "ttft_s" in output.metrics:
            self.ttft.observe(output.metrics["ttft_s"])
        if "e2e_s" in output.metrics:
            self.e2e.observe(output.metrics["e2e_s"])
        self._forget(output.request_id, len(output.outputs))

    def on_ended_early(self, request_id: str, n: int, reason: str) -> None:
        self.requests.labels(reason).inc()
        self._forget(request_id, n)

    def _forget(self, request_id: str, n: int) -> None:
        for index in range(n):
            self._last_token_time.pop((request_id, index), None)

    # Called before each scrape -----------------------------------------------------------------
    def set_engine_stats(self, stats: dict, queue_length: int) -> None:
        self.requests_running.set(stats.get("num_running", 0))
        self.requests_waiting.set(stats.get("num_waiting", 0))
        self.kv_blocks_used.set(stats.get("kv_blocks_used", 0))
        self.kv_blocks_total.set(stats.get("kv_blocks_total", 0))
        self.spec_acceptance_rate.set(stats.get("spec_acceptance_rate") or 0.0)
        self.queue_length.set(queue_length)
        self.engine_stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The disk tier's counts (kv/disk_cache.py), counted by the engine: published from its snapshot as
# counters, (stats key, metric name without _total, help).
DISK_COUNTERS = (
    ("kv_disk_hits", "wallbreaker_kv_disk_hits", "KV blocks read from the prefix cache's disk tier"),
    ("kv_disk_misses", "wallbreaker_kv_disk_misses", "Prefix lookups past RAM that found no block on disk"),
    ("kv_disk_bad", "wallbreaker_kv_disk_bad_entries", "Disk-tier files refused (corrupt, truncated, foreign) and recomputed"),
    ("kv_disk_bytes_read", "wallbreaker_kv_disk_read_bytes", "Bytes read from the disk tier"),
    ("kv_disk_bytes_written", "wallbreaker_kv_disk_written_bytes", "Bytes written to the disk tier"),
    ("kv_disk_write_errors", "wallbreaker_kv_disk_write_errors", "Disk-tier writes that failed (a full disk)"),
)


class _DiskCounters:
    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.engine_stats
        for key, name, text in DISK_COUNTERS:
            yield CounterMetricFamily(name, text, value=stats.get(key, 0))
