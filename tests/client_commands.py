"""How each real client is pointed at a wallbreaker server: its command line and environment.

One builder per client, shared by tests/test_real_clients.py and benchmarks/agent_turns.py. Each
takes the client's executable, the server's URL, a fresh HOME for the client's own config (written
there, so no user config is read or changed), the prompt and the model name to send, and returns
(argv, env). The environment is this process's, less anything that would point a client elsewhere.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

Command = tuple[list[str], dict[str, str]]
SCRIPTS = Path(__file__).parent / "client_scripts"
AIDER_FILE = "hello.py"  # aider edits it: the caller puts it in the working folder


def client_env(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment without keys, base URLs, client settings or our PYTHONPATH, with
    HOME set to `home`."""
    skip = ("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "OPENCODE", "LLM_", "AIDER_", "XDG_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip) and k not in ("PYTHONPATH", "HOME")}
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), **extra}


def claude(exe: str, url: str, home: Path, prompt: str, model: str) -> Command:
    """Only a base URL and a dummy key (issue 47): Claude Code sends its own model name."""
    env = client_env(home, ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="x", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    return [exe, "-p", prompt, "--allowedTools", "Read"], env  # the option takes every word after it


def codex(exe: str, url: str, home: Path, prompt: str, model: str) -> Command:
    """A Responses provider in a fresh CODEX_HOME; Codex sends its default tools (some not functions)."""
    codex_home = home / "codex-home"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "wallbreaker"\n\n[model_providers.wallbreaker]\nname = "wallbreaker"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n')
    return [exe, "exec", "--skip-git-repo-check", prompt], client_env(home, CODEX_HOME=str(codex_home))


def opencode(exe: str, url: str, home: Path, prompt: str, model: str) -> Command:
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "wallbreaker", "models": {model: {"name": model}},
                "options": {"baseURL": f"{url}/v1", "apiKey": "x"}}
    (config / "opencode.json").write_text(json.dumps({"$schema": "https://opencode.ai/config.json",
                                                      "model": f"wallbreaker/{model}",
                                                      "provider": {"wallbreaker": provider}}))
    env = client_env(home, XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
                     XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"))
    return [exe, "run", prompt], env


def aider(exe: str, url: str, home: Path, prompt: str, model: str) -> Command:
    """aider with AIDER_FILE in the chat, no git; litellm's price table from its package, not the web."""
    return ([exe, "--model", f"openai/{model}", "--openai-api-base", f"{url}/v1", "--openai-api-key", "x", "--no-git",
             "--yes", "--no-check-update", "--no-show-model-warnings", "--analytics-disable", "--no-pretty",
             "--message", prompt, AIDER_FILE], client_env(home, LITELLM_LOCAL_MODEL_COST_MAP="True"))


def llm(exe: str, url: str, home: Path, prompt: str, model: str) -> Command:
    user = home / "llm"
    user.mkdir(parents=True, exist_ok=True)
    (user / "extra-openai-models.yaml").write_text(
        f'- model_id: wallbreaker\n  model_name: {model}\n  api_base: "{url}/v1"\n')
    return [exe, "-m", "wallbreaker", prompt], client_env(home, LLM_USER_PATH=str(user), OPENAI_API_KEY="x")


def openai_agents(exe: str, url: str, home: Path, prompt: str, model: str) -> Command:
    """client_scripts/agent_with_tool.py (its question about the weather; `prompt` is not used) on the
    SDK's default Responses API."""
    return [exe, str(SCRIPTS / "agent_with_tool.py"), f"{url}/v1", model, "responses"], client_env(home)
