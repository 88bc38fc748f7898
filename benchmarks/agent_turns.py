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
import client_commands as commands  # noqa: E402
from client_install import AIDER, CLAUDE, CODEX, LLM, OPENAI_AGENTS, OPENCODE, Client  # noqa: E402
from server_process import ServerProcess  # noqa: E402

HELLO = "Reply with the single word: hello"
TASK = "Read the file notes.txt in this folder and reply with the code word it contains, nothing else."
CODE_WORD = "PAPAYA"
TURN_TIMEOUT_S = 900
ACCESS = re.compile(r"(?P<id>\S+) POST (?P<path>\S+) (?P<status>\d+) prompt_tokens=(?P<prompt>\d+) "
                    r"completion_tokens=(?P<completion>\d+) ttft=(?P<ttft>[\d.]+|-)s? total=(?P<total>[\d.]+)s")


AIDER_TASK = f"Add a docstring to {commands.AIDER_FILE}"
AGENTS_TASK = "What is the weather in Paris? (its get_weather tool)"
# name -> (client, command builder, its turns)
AGENTS: dict[str, tuple[Client, object, tuple[tuple[str, str], ...]]] = {
    "claude": (CLAUDE, commands.claude, (("cold", HELLO), ("warm", HELLO), ("task", TASK))),
    "codex": (CODEX, commands.codex, (("cold", HELLO), ("warm", HELLO), ("task", TASK))),
    "opencode": (OPENCODE, commands.opencode, (("cold", HELLO), ("warm", HELLO), ("task", TASK))),
    "aider": (AIDER, commands.aider, (("task", AIDER_TASK),)),
    "llm": (LLM, commands.llm, (("cold", HELLO),)),
    "openai-agents": (OPENAI_AGENTS, commands.openai_agents, (("task", AGENTS_TASK),)),
}


def access_lines(log: str) -> list[dict]:
    return [m.groupdict() for m in ACCESS.finditer(log) if m.group("path").split("?")[0] != "/health"]


def turn(name: str, exe: str, build, server: ServerProcess, folder: Path, prompt: str) -> dict:
    """One turn: the agent's command timed, and what the server logged for its requests."""
    args, env = build(exe, server.url, folder.parent / "home", prompt, "local")
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
        (folder / commands.AIDER_FILE).write_text("def hello():\n    print('hi')\n")
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
