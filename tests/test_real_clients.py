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

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from client_install import AIDER, CLAUDE, CODEX, LLM, OPENAI_AGENTS, OPENCODE, Client
from hello_model import ANSWER
from server_process import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

PROMPT = "Reply with the single word: hello"
CLIENT_TIMEOUT_S = 240
SCRIPTS = Path(__file__).parent / "client_scripts"


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


def client_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment without anything that points a client elsewhere (keys, base
    URLs, our PYTHONPATH), with a fresh HOME so no user config is read or written."""
    skip = ("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "OPENCODE", "LLM_", "AIDER_", "XDG_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip) and k not in ("PYTHONPATH", "HOME")}
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), **extra}


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


def test_claude_code_prints_the_answer(hello_server: ServerProcess, tmp_path: Path) -> None:
    """Only a base URL and a dummy key, as issue 47's acceptance asks: no model or beta variables."""
    claude = client_or_skip(CLAUDE)
    env = client_env(tmp_path / "home", ANTHROPIC_BASE_URL=hello_server.url, ANTHROPIC_API_KEY="x",
                     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    out = run_client([claude, "-p", PROMPT], tmp_path / "work", env, hello_server)
    assert ANSWER in out


def test_codex_exec_prints_the_answer(hello_server: ServerProcess, tmp_path: Path) -> None:
    """A Responses provider in a fresh CODEX_HOME; Codex sends its default tools (some not functions)."""
    codex = client_or_skip(CODEX)
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "hello"\nmodel_provider = "wallbreaker"\n\n[model_providers.wallbreaker]\nname = "wallbreaker"\n'
        f'base_url = "{hello_server.url}/v1"\nwire_api = "responses"\n')
    env = client_env(tmp_path / "home", CODEX_HOME=str(home))
    out = run_client([codex, "exec", "--skip-git-repo-check", PROMPT], tmp_path / "work", env, hello_server)
    assert ANSWER in out


def test_opencode_run_prints_the_answer(hello_server: ServerProcess, tmp_path: Path) -> None:
    opencode = client_or_skip(OPENCODE)
    home = tmp_path / "home"
    config = home / ".config" / "opencode"
    config.mkdir(parents=True)
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "wallbreaker", "models": {"hello": {"name": "hello"}},
                "options": {"baseURL": f"{hello_server.url}/v1", "apiKey": "x"}}
    settings = {"$schema": "https://opencode.ai/config.json", "model": "wallbreaker/hello",
                "provider": {"wallbreaker": provider}}
    (config / "opencode.json").write_text(json.dumps(settings))
    env = client_env(home, XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
                     XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"))
    out = run_client([opencode, "run", PROMPT], tmp_path / "work", env, hello_server)
    assert ANSWER in out


def test_aider_message_prints_the_answer(hello_server: ServerProcess, tmp_path: Path) -> None:
    """aider with a file in the chat, no git; litellm's price table from its package, not the web."""
    aider = client_or_skip(AIDER)
    work = tmp_path / "work"
    work.mkdir()
    (work / "hello.py").write_text("print('hi')\n")
    env = client_env(tmp_path / "home", LITELLM_LOCAL_MODEL_COST_MAP="True")
    out = run_client([aider, "--model", "openai/hello", "--openai-api-base", f"{hello_server.url}/v1",
                      "--openai-api-key", "x", "--no-git", "--yes", "--no-check-update", "--no-show-model-warnings",
                      "--analytics-disable", "--no-pretty", "--message", "Add a docstring to hello.py", "hello.py"],
                     work, env, hello_server)
    assert ANSWER in out


def test_llm_prints_the_answer(hello_server: ServerProcess, tmp_path: Path) -> None:
    llm = client_or_skip(LLM)
    user = tmp_path / "llm"
    user.mkdir()
    (user / "extra-openai-models.yaml").write_text(
        f'- model_id: wallbreaker\n  model_name: hello\n  api_base: "{hello_server.url}/v1"\n')
    env = client_env(tmp_path / "home", LLM_USER_PATH=str(user), OPENAI_API_KEY="x")
    out = run_client([llm, "-m", "wallbreaker", PROMPT], tmp_path / "work", env, hello_server)
    assert ANSWER in out


def test_openai_agents_agent_calls_its_tool(packaged_model, tmp_path: Path) -> None:
    """The SDK's default Responses API; the tool runs with the model's arguments, then the model answers."""
    python = client_or_skip(OPENAI_AGENTS)
    server = ServerProcess(packaged_model("smollm2"), log_path=tmp_path / "server.log")
    try:
        env = client_env(tmp_path / "home")
        out = run_client([python, str(SCRIPTS / "agent_with_tool.py"), f"{server.url}/v1", "default", "responses"],
                         tmp_path / "work", env, server)
    finally:
        server.stop()
    assert "TOOL CALLED city=" in out, out
    answer = out.split("ANSWER:", 1)[1].strip() if "ANSWER:" in out else ""
    assert answer, out
