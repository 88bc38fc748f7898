"""Serving benchmark, in the spirit of vLLM's `benchmark_serving.py`: N concurrent streaming clients
against `wallbreaker serve` (started here unless --url is given). Reports requests/s, tokens/s,
time to first token and inter-token latency (mean, p50, p90, p99); writes JSON and a PNG plot.

    python benchmarks/serving.py --model /path/model.gguf --clients 64 --max-tokens 32
    python benchmarks/serving.py --url http://127.0.0.1:8000 --clients 16

Outputs are forced to --max-tokens (ignore_eos), so every run does the same work.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

WORDS = ("the quick brown fox jumps over the lazy dog while a paged cache keeps keys and values in fixed "
         "blocks so that many sequences can share one pool of memory").split()


@dataclass
class RequestResult:
    ok: bool
    start_s: float  # from the start of the run
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    error: str = ""


def make_prompt(i: int, words: int) -> str:
    return f"Request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      t0: float) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False, start_s=start - t0)
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.e2e_s = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_clients(url: str, model: str, clients: int, requests_per_client: int, max_tokens: int,
                      prompt_words: int) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one_request(client, url, model, make_prompt(-1, prompt_words), 4, time.perf_counter())  # warm-up
        t0 = time.perf_counter()

        async def client_loop(c: int) -> list[RequestResult]:
            return [await one_request(client, url, model, make_prompt(c * requests_per_client + r, prompt_words),
                                      max_tokens, t0) for r in range(requests_per_client)]
        per_client = await asyncio.gather(*(client_loop(c) for c in range(clients)))
        duration = time.perf_counter() - t0
    return [r for results in per_client for r in results], duration


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]
    return {"mean": sum(ordered) / len(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "requests_per_s": len(ok) / duration, "output_tokens_per_s": output / duration,
        "total_tokens_per_s": (prompt + output) / duration, "prompt_tokens": prompt, "output_tokens": output,
        "ttft_ms": {k: v * 1000 for k, v in percentiles([r.ttft_s for r in ok]).items()},
        "itl_ms": {k: v * 1000 for k, v in percentiles([g for r in ok for g in r.itl_s]).items()},
        "tpot_ms": {k: v * 1000 for k, v in percentiles(tpot).items()},
        "e2e_ms": {k: v * 1000 for k, v in percentiles([r.e2e_s for r in ok]).items()},
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def plot(results: list[RequestResult], summary: dict, title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, values, name in ((axes[0], [r.ttft_s * 1000 for r in ok], "time to first token (ms)"),
                             (axes[1], [g * 1000 for r in ok for g in r.itl_s], "inter-token latency (ms)")):
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        key = "ttft_ms" if "first" in name else "itl_ms"
        for p in ("p50", "p90", "p99"):
            ax.axvline(summary[key][p], linestyle=":", color="gray")
            ax.text(summary[key][p], 0.02, p, rotation=90, fontsize=8)
    ax = axes[2]
    for r in ok:
        ax.plot([r.start_s, r.start_s + r.e2e_s], [r.e2e_s * 1000] * 2, color="tab:blue", alpha=0.4)
    ax.set_xlabel("time in run (s)")
    ax.set_ylabel("end-to-end latency (ms)")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: {summary['requests_per_s']:.1f} req/s, {summary['total_tokens_per_s']:.0f} tokens/s "
                 f"(output {summary['output_tokens_per_s']:.0f}/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "wallbreaker.cli", "serve", "--port", str(port), "--log-level", "warning", *extra]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start in 300 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one here)")
    p.add_argument("--model", default=None, help="the model the started server loads (default: the embedded one)")
    p.add_argument("--server-args", default="", help="more flags for the started server, e.g. '--max-num-seqs 32'")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--requests-per-client", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                   help="folder for serving_<name>.json and .png")
    p.add_argument("--name", default=None, help="results name (default: the served model's id)")
    args = p.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, args.server_args.split())
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        results, duration = asyncio.run(run_clients(url, model, args.clients, args.requests_per_client,
                                                    args.max_tokens, args.prompt_words))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    summary = summarize(results, duration)
    name = args.name or model
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {"config": {**config, "served_model": model}, "summary": summary,
              "requests": [asdict(r) for r in results]}
    json_path = args.out / f"serving_{name}.json"
    json_path.write_text(json.dumps(report, indent=1))
    plot(results, summary, name, args.out / f"serving_{name}.png")
    s = summary
    print(f"{name}: {s['completed']} ok, {s['failed']} failed in {s['duration_s']:.2f} s")
    print(f"  {s['requests_per_s']:.2f} req/s, {s['total_tokens_per_s']:.0f} total tokens/s, "
          f"{s['output_tokens_per_s']:.0f} output tokens/s")
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        m = s[key]
        print(f"  {label:5s} ms: mean {m['mean']:.1f}  p50 {m['p50']:.1f}  p90 {m['p90']:.1f}  p99 {m['p99']:.1f}")
    if s["errors"]:
        print(f"  errors: {s['errors']}")
    print(f"  wrote {json_path} and {json_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
