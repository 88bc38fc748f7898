"""The server process: SIGTERM lets in-flight streams finish and exits 0; bad flags fail in one line."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
from server_process import ServerProcess


def test_sigterm_lets_a_running_stream_finish_then_exits_0(tiny_llama, tmp_path):
    server = ServerProcess(tiny_llama.gguf_path, log_path=tmp_path / "server.log")
    body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                lines = (line for line in response.iter_lines() if line)
                assert next(lines).startswith("data: ")
                server.proc.send_signal(signal.SIGTERM)
                rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 400
        assert server.proc.wait(timeout=30) == 0, server.log()
    finally:
        server.stop()


def test_bad_server_flag_is_one_line_error(tiny_llama):
    result = subprocess.run([sys.executable, "-m", "wallbreaker.cli", "serve", "--model", str(tiny_llama.gguf_path),
                             "--max-queue", "-1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["wallbreaker: error: max_queue must be >= 0, got -1"]
