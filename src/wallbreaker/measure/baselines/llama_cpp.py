"""llama.cpp as a baseline, through its own benchmark tools (`llama-bench`, `llama-batched-bench`,
`llama-speculative`, `llama-perplexity`), found in `--llama-cpp-dir`, `$LLAMA_CPP_DIR` or on PATH."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


def find_tool(name: str, directory: str | os.PathLike | None = None) -> Path | None:
    for folder in (directory, os.environ.get("LLAMA_CPP_DIR")):
        if folder:
            for candidate in (Path(folder) / name, Path(folder) / "bin" / name, Path(folder) / "build" / "bin" / name):
                if candidate.is_file() and os.access(candidate, os.X_OK):
                    return candidate
    found = shutil.which(name)
    return Path(found) if found else None


class LlamaCppError(RuntimeError):
    pass


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise LlamaCppError(f"{Path(cmd[0]).name} ran past {timeout:.0f} s") from e
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise LlamaCppError(f"{Path(cmd[0]).name} exited with {result.returncode}: {' | '.join(tail)}")
    return result


@dataclass
class LlamaCpp:
    directory: str | None = None
    threads: int = 2
    timeout_s: float = 1800.0

    def tool(self, name: str) -> Path:
        path = find_tool(name, self.directory)
        if path is None:
            raise LlamaCppError(f"{name} not found (give --llama-cpp-dir, set LLAMA_CPP_DIR, or put it on PATH)")
        return path

    def available(self, name: str = "llama-bench") -> bool:
        return find_tool(name, self.directory) is not None

    def bench(self, model: Path, prompt_tokens: int, gen_tokens: int, repetitions: int = 1,
              extra: tuple[str, ...] = ()) -> dict[str, float]:
        """`llama-bench`: prefill tokens/s over `prompt_tokens` (ppN) and decode tokens/s of `gen_tokens` (tgN);
        `extra` flags go to the tool as given (ik_llama.cpp's `-rtr 1`)."""
        cmd = [str(self.tool("llama-bench")), "-m", str(model), "-p", str(prompt_tokens), "-n", str(gen_tokens),
               "-t", str(self.threads), "-r", str(repetitions), "-o", "json", *extra]
        rows = json.loads(_run(cmd, self.timeout_s).stdout)
        out = {}
        for row in rows:
            if row.get("n_prompt") and not row.get("n_gen"):
                out["prefill_tokens_per_s"] = float(row["avg_ts"])
            elif row.get("n_gen") and not row.get("n_prompt"):
                out["decode_tokens_per_s"] = float(row["avg_ts"])
        return out

    def batched_bench(self, model: Path, prompt_tokens: int, gen_tokens: int,
                      parallel: list[int]) -> dict[int, dict[str, float]]:
        """`llama-batched-bench`: per number of parallel sequences, generation tokens/s of the decode
        phase (`speed_tg`, its S_TG), generated tokens over the whole run's time, and all tokens/s."""
        ctx = max(parallel) * (prompt_tokens + gen_tokens) + 16
        cmd = [str(self.tool("llama-batched-bench")), "-m", str(model), "-c", str(ctx), "-b", "2048", "-ub", "512",
               "-npp", str(prompt_tokens), "-ntg", str(gen_tokens), "-npl", ",".join(map(str, parallel)),
               "-t", str(self.threads), "--output-format", "jsonl"]
        result = _run(cmd, self.timeout_s)
        out: dict[int, dict[str, float]] = {}
        for line in (result.stdout + "\n" + result.stderr).splitlines():
            line = line.strip()
            if line.startswith("{") and '"speed_tg"' in line:
                row = json.loads(line)
                out[int(row["pl"])] = {"decode_tokens_per_s": row["speed_tg"],
                                       "gen_tokens_per_s": row["pl"] * row["tg"] / row["t"],
                                       "total_tokens_per_s": row["speed"]}
        return out

    def speculative(self, target: Path, draft: Path, prompt: str, gen_tokens: int, draft_max: int,
                    temperature: float = 0.0, seed: int = 1) -> dict[str, float]:
        """`llama-speculative`: decode tokens/s with the draft, tokens drafted and accepted."""
        tool = str(self.tool("llama-speculative"))
        cmd = [tool, "-m", str(target), "-md", str(draft), "-p", prompt, "-n", str(gen_tokens),
               "-t", str(self.threads), self._draft_max_flag(tool), str(draft_max),
               "--temp", str(temperature), "--seed", str(seed), "-c", "4096"]
        result = _run(cmd, self.timeout_s)
        return parse_speculative(result.stderr + result.stdout)

    def _draft_max_flag(self, tool: str) -> str:
        """Newer builds renamed --draft-max (and made the old name an error)."""
        help_text = subprocess.run([tool, "--help"], capture_output=True, text=True, timeout=60)
        return "--spec-draft-n-max" if "--spec-draft-n-max" in help_text.stdout + help_text.stderr else "--draft-max"

    def perplexity(self, model: Path, text_file: Path, ctx: int, chunks: int,
                   extra: tuple[str, ...] = ()) -> dict[str, float]:
        """`llama-perplexity` over `chunks` windows of `ctx` tokens: its final PPL and ± estimate."""
        cmd = [str(self.tool("llama-perplexity")), "-m", str(model), "-f", str(text_file), "-c", str(ctx),
               "--chunks", str(chunks), "-t", str(self.threads), *extra]
        result = _run(cmd, self.timeout_s)
        m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", result.stdout + result.stderr)
        if m is None:
            raise LlamaCppError("llama-perplexity printed no 'Final estimate' line")
        return {"ppl": float(m.group(1)), "stderr": float(m.group(2))}


def parse_speculative(text: str) -> dict[str, float]:
    def number(pattern: str) -> float | None:
        m = re.search(pattern, text)
        return float(m.group(1)) if m else None
    out = {"decode_tokens_per_s": number(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s"),
           "drafted": number(r"n_drafted\s*=\s*(\d+)"), "accepted": number(r"n_accept\s*=\s*(\d+)")}
    if out["drafted"]:
        out["acceptance_rate"] = out["accepted"] / out["drafted"]
    if out["decode_tokens_per_s"] is None:
        raise LlamaCppError("llama-speculative printed no 'decoded ... speed' line")
    return out
