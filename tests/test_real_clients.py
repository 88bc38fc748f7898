"""The real agents and chat clients complete a turn against `wallbreaker serve` (issue 47).

Each test starts a server subprocess, runs the client's own command as a user would (its config in
a temporary HOME), and asserts exit code 0 and the model's answer in what the client prints. The
coding agents send long prompts (Claude Code's system prompt and tools are ~19k SmolLM2 tokens, and
it asks for up to 64k tokens), so they talk to the "Hello!" model (tests/hello_model.py: SmolLM2's
tokenizer and template, a 64k context, always three tokens back). The openai-agents test needs a
model that fills in a tool call, so it runs on SmolLM2 with the call forced by `tool_choice`.

Each test skips, naming the install command, where its client is not installed (client_install.py;
.ci/run installs them all).
"""
from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import client_commands as commands
import pytest
from client_install import AIDER, CLAUDE, CODEX, LLM, OPENAI_AGENTS, OPENCODE, Client
from hello_model import ANSWER
from server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

PROMPT = "Reply with the single word: hello"
CLIENT_TIMEOUT_S = 240


def client_or_skip(client: Client) -> str:
    path = client.find()
    if path is None:
        pytest.skip(f"{client.package} is not installed; install with: {client.install_command}")
    return path


@pytest.fixture(scope="module")
def hello_server(hello_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("hello_server") / "server.log"
    server = ServerProcess(hello_model, "--max-model-len", "65536", log_path=log)
    yield server
    server.stop()


def run_client(args: list[str], cwd: Path, env: dict[str, str], server: ServerProcess) -> str:
    """Run the client; its stdout, after checking exit code 0 (the server's log tail otherwise)."""
    cwd.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=CLIENT_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{args[0]} ran past {CLIENT_TIMEOUT_S} s; stdout: {e.stdout!r}\n"
                             f"server log:\n{server.log()[-3000:]}") from None
    assert done.returncode == 0, (f"{Path(args[0]).name} exited {done.returncode}\nstdout: {done.stdout[-2000:]}\n"
                                  f"stderr: {done.stderr[-2000:]}\nserver log:\n{server.log()[-3000:]}")
    return done.stdout


@pytest.mark.parametrize("client, command", [(CLAUDE, commands.claude), (CODEX, commands.codex),
                                             (OPENCODE, commands.opencode), (AIDER, commands.aider),
                                             (LLM, commands.llm)], ids=["claude", "codex", "opencode", "aider", "llm"])
def test_client_prints_the_answer(client: Client, command, hello_server: ServerProcess, tmp_path: Path) -> None:
    """Claude Code with only a base URL and a dummy key, as issue 47's acceptance asks (no model or
    beta variables); Codex with its default tools; aider editing a file in its chat."""
    exe = client_or_skip(client)
    work = tmp_path / "work"
    work.mkdir()
    (work / commands.AIDER_FILE).write_text("print('hi')\n")
    args, env = command(exe, hello_server.url, tmp_path / "home", PROMPT, "hello")
    assert ANSWER in run_client(args, work, env, hello_server)


def test_openai_agents_agent_calls_its_tool(packaged_model, tmp_path: Path) -> None:
    """The SDK's default Responses API; the tool runs with the model's arguments, then the model answers."""
    python = client_or_skip(OPENAI_AGENTS)
    server = ServerProcess(packaged_model("smollm2"), log_path=tmp_path / "server.log")
    try:
        args, env = commands.openai_agents(python, server.url, tmp_path / "home", "", "default")
        out = run_client(args, tmp_path / "work", env, server)
    finally:
        server.stop()
    assert "TOOL CALLED city=" in out, out
    answer = out.split("ANSWER:", 1)[1].strip() if "ANSWER:" in out else ""
    assert answer, out
