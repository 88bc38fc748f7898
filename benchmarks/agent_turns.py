"""A coding agent's turn against `wallbreaker serve`, timed as its user waits for it (issue 47).

For each agent (Claude Code, Codex, opencode), on a fresh server (an empty prefix cache):
1. a cold turn, "Reply with the single word: hello", in a new scratch folder;
2. the same turn again in the same folder (warm: its system prompt and tools come from the prefix cache);
3. a small task in that folder: read notes.txt (a code word in it) and answer with the word.
The other clients (aider editing a file, `llm`, an openai-agents agent whose one tool the model
calls) take one turn each, on a fresh server too.

Each turn's wall-clock time is the agent's own command, start to exit; its first token is the first
request's time to first token as the server's access log records it (the agents stream, and the
server's log line is written when the answer ends). The prompt tokens and the prefix-cache hit come
from the same lines. Results (JSON, with the machine and the command) go to benchmarks/results/.

    python benchmarks/agent_turns.py --model qwen2.5-coder-1.5b --out benchmarks/results/agent_turns_xeon.json

The agents are found as tests/test_real_clients.py finds them (tests/client_install.py: .ci/run
installs them); one that is absent is skipped, and the file says so.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from client_install import AIDER, CLAUDE, CODEX, LLM, OPENAI_AGENTS, OPENCODE, Client  # noqa: E402
from server_process import ServerProcess  # noqa: E402

HELLO = "Reply with the single word: hello"
TASK = "Read the file notes.txt in this folder and reply with the code word it contains, nothing else."
CODE_WORD = "PAPAYA"
TURN_TIMEOUT_S = 900
ACCESS = re.compile(r"(?P<id>\S+) POST (?P<path>\S+) (?P<status>\d+) prompt_tokens=(?P<prompt>\d+) "
                    r"completion_tokens=(?P<completion>\d+) ttft=(?P<ttft>[\d.]+|-)s? total=(?P<total>[\d.]+)s")


def agent_env(home: Path, **extra: str) -> dict[str, str]:
    skip = ("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "OPENCODE", "XDG_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip) and k not in ("PYTHONPATH", "HOME")}
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), **extra}


def claude_command(exe: str, url: str, home: Path, prompt: str) -> tuple[list[str], dict[str, str]]:
    env = agent_env(home, ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="x", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    return [exe, "-p", prompt, "--allowedTools", "Read"], env  # the option takes every word after it


def codex_command(exe: str, url: str, home: Path, prompt: str) -> tuple[list[str], dict[str, str]]:
    codex_home = home / "codex-home"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        'model = "local"\nmodel_provider = "wallbreaker"\n\n[model_providers.wallbreaker]\nname = "wallbreaker"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\n')
    return [exe, "exec", "--skip-git-repo-check", prompt], agent_env(home, CODEX_HOME=str(codex_home))


def opencode_command(exe: str, url: str, home: Path, prompt: str) -> tuple[list[str], dict[str, str]]:
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "wallbreaker", "models": {"local": {"name": "local"}},
                "options": {"baseURL": f"{url}/v1", "apiKey": "x"}}
    (config / "opencode.json").write_text(json.dumps({"$schema": "https://opencode.ai/config.json",
                                                      "model": "wallbreaker/local",
                                                      "provider": {"wallbreaker": provider}}))
    env = agent_env(home, XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
                    XDG_CACHE_HOME=str(home / ".cache"), XDG_STATE_HOME=str(home / ".local/state"))
    return [exe, "run", prompt], env


def aider_command(exe: str, url: str, home: Path, prompt: str) -> tuple[list[str], dict[str, str]]:
    return ([exe, "--model", "openai/local", "--openai-api-base", f"{url}/v1", "--openai-api-key", "x", "--no-git",
             "--yes", "--no-check-update", "--no-show-model-warnings", "--analytics-disable", "--no-pretty",
             "--message", prompt, "hello.py"], agent_env(home, LITELLM_LOCAL_MODEL_COST_MAP="True"))


def llm_command(exe: str, url: str, home: Path, prompt: str) -> tuple[list[str], dict[str, str]]:
    user = home / "llm"
    user.mkdir(parents=True, exist_ok=True)
    (user / "extra-openai-models.yaml").write_text(f'- model_id: wallbreaker\n  model_name: local\n  api_base: "{url}/v1"\n')
    return [exe, "-m", "wallbreaker", prompt], agent_env(home, LLM_USER_PATH=str(user), OPENAI_API_KEY="x")


def agents_sdk_command(exe: str, url: str, home: Path, prompt: str) -> tuple[list[str], dict[str, str]]:
    """tests/client_scripts/agent_with_tool.py: its question about the weather; `prompt` is not used."""
    return [exe, str(ROOT / "tests" / "client_scripts" / "agent_with_tool.py"), f"{url}/v1", "local", "responses"], \
        agent_env(home)


AIDER_TASK = "Add a docstring to hello.py"
AGENTS_TASK = "What is the weather in Paris? (its get_weather tool)"
# name -> (client, command builder, its turns)
AGENTS: dict[str, tuple[Client, object, tuple[tuple[str, str], ...]]] = {
    "claude": (CLAUDE, claude_command, (("cold", HELLO), ("warm", HELLO), ("task", TASK))),
    "codex": (CODEX, codex_command, (("cold", HELLO), ("warm", HELLO), ("task", TASK))),
    "opencode": (OPENCODE, opencode_command, (("cold", HELLO), ("warm", HELLO), ("task", TASK))),
    "aider": (AIDER, aider_command, (("task", AIDER_TASK),)),
    "llm": (LLM, llm_command, (("cold", HELLO),)),
    "openai-agents": (OPENAI_AGENTS, agents_sdk_command, (("task", AGENTS_TASK),)),
}


def access_lines(log: str) -> list[dict]:
    return [m.groupdict() for m in ACCESS.finditer(log) if m.group("path").split("?")[0] != "/health"]


def turn(name: str, exe: str, build, server: ServerProcess, folder: Path, prompt: str) -> dict:
    """One turn: the agent's command timed, and what the server logged for its requests."""
    args, env = build(exe, server.url, folder.parent / "home", prompt)
    before = len(access_lines(server.log()))
    start = time.perf_counter()
    try:
        done = subprocess.run(args, cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TURN_TIMEOUT_S)
        wall, code, out = time.perf_counter() - start, done.returncode, done.stdout
    except subprocess.TimeoutExpired as e:
        wall, code, out = time.perf_counter() - start, None, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
    time.sleep(0.5)  # the access log line of the last request
    requests = access_lines(server.log())[before:]
    first = requests[0] if requests else None
    return {"agent": name, "prompt": prompt, "exit_code": code, "wall_s": round(wall, 2),
            "first_token_s": float(first["ttft"]) if first and first["ttft"] != "-" else None,
            "requests": [{"path": r["path"], "status": int(r["status"]), "prompt_tokens": int(r["prompt"]),
                          "completion_tokens": int(r["completion"]),
                          "ttft_s": None if r["ttft"] == "-" else float(r["ttft"]), "total_s": float(r["total"])}
                         for r in requests],
            "answer_tail": out.strip()[-200:], "found_code_word": CODE_WORD in out if prompt == TASK else None,
            "tool_ran": "TOOL CALLED" in out if prompt == AGENTS_TASK else None}


def machine() -> dict:
    import torch

    from wallbreaker.kernels.cpu_id import this_cpu
    from wallbreaker.measure.machine import machine_facts
    return {**machine_facts(torch.get_num_threads()), "cpu_id": this_cpu(), "load_average_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--agents", default=",".join(AGENTS))
    parser.add_argument("--work", type=Path, default=Path("/tmp/wallbreaker-agent-turns"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results, skipped = [], {}
    for name in args.agents.split(","):
        client, build, turns = AGENTS[name]
        exe = client.find()
        if exe is None:
            skipped[name] = f"not installed ({client.install_command})"
            continue
        folder = args.work / name / "work"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "notes.txt").write_text(f"Meeting notes.\nThe code word is {CODE_WORD}.\n")
        (folder / "hello.py").write_text("def hello():\n    print('hi')\n")
        server = ServerProcess(args.model, "--dtype", "auto", log_path=args.work / name / "server.log")
        try:
            for label, prompt in turns:
                row = {"turn": label, "load_average_1m": round(os.getloadavg()[0], 2),
                       **turn(name, exe, build, server, folder, prompt)}
                print(json.dumps({k: row[k] for k in ("agent", "turn", "exit_code", "wall_s", "first_token_s")}),
                      flush=True)
                results.append(row)
        finally:
            server.stop()
    out = {"benchmark": "agent_turns", "model": args.model, "machine": machine(),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip(),
           "command": "python " + " ".join(sys.argv), "skipped": skipped, "turns": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
