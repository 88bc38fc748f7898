"""A real `wallbreaker serve` subprocess on loopback, for the server tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path, *args: str, log_path: Path | None = None, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log = open(log_path, "w") if log_path else subprocess.DEVNULL
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wallbreaker.cli", "serve", "--model", str(model), "--port", str(self.port),
             "--dtype", "float32", *args],
            stdout=log, stderr=subprocess.STDOUT, env=env)
        if log_path:
            log.close()
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during startup:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not become healthy in {STARTUP_TIMEOUT_S:.0f} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def scrape_metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, keyed `name` or `name{label="value",...}`."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_for_metric(url: str, name: str, value: float, timeout_s: float = 15.0) -> dict[str, float]:
    """Scrape until `name` reads `value` (the engine frees blocks on its next turn); the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape_metrics(url)
        if samples.get(name) == value or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)
