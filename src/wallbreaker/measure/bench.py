"""`wallbreaker bench`: the same prompts and lengths through wallbreaker and its baselines (llama.cpp's
benchmark tools, transformers `generate`), engines interleaved in every repetition (A/B/A/B, so a
noisy spell on a shared machine hits all of them), medians over the repetitions, and the ratios.

Metrics: prefill tokens/s and TTFT over one long prompt; decode tokens/s at batch 1; generation
throughput with N concurrent sequences (generated tokens over the whole run's time, and over the
decode phase alone, which is llama-batched-bench's S_TG); batch-1 decode as a fraction of the
roofline bound (needs a stored bandwidth: run `wallbreaker roofline` once).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..formats import open_model
from .machine import describe_machine, machine_facts
from .reporting import bar_plot, markdown_table, median, write_json
from .roofline import model_cost, request_roofline_fraction, roofline_fraction, stored_bandwidth, stored_decode_cost

LABELS = {  # metric key -> (label, unit, higher is better)
    "prefill_tps": ("prefill tokens/s", "tokens/s", True),
    "ttft_ms": ("TTFT ms", "ms", False),
    "decode_tps": ("decode tokens/s (batch 1)", "tokens/s", True),
    "roofline_fraction": ("batch-1 decode / roofline bound", "fraction", True),
    "spec_acceptance_rate": ("draft acceptance rate", "fraction", True),
}


def _conc_label(key: str) -> tuple[str, str, bool]:
    kind, c = key.split("@")
    text = "gen tokens/s, whole run" if kind == "gen_tps" else "gen tokens/s, decode phase"
    return f"{text} @{c} seqs", "tokens/s", True


def label(key: str) -> tuple[str, str, bool]:
    return LABELS.get(key) or _conc_label(key)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=int, default=3, help="repetitions; medians are reported (default: 3)")
    p.add_argument("--baselines", default="transformers,llama.cpp",
                   help="comma-separated: transformers, llama.cpp, or none (default: both)")
    p.add_argument("--llama-cpp-dir", default=None, help="folder with llama-bench etc. (else $LLAMA_CPP_DIR, PATH)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--decode-prompt-tokens", type=int, default=16,
                   help="prompt before the batch-1 decode (llama-bench's tg starts from an empty context)")
    p.add_argument("--concurrency", default="4,16,32,64", help="concurrent sequences (comma-separated)")
    p.add_argument("--concurrent-prompt-tokens", type=int, default=128)
    p.add_argument("--concurrent-tokens", type=int, default=128)
    p.add_argument("--hf-tokens", type=int, default=32,
                   help="tokens transformers decodes (it is far slower: batch 1, one run)")
    p.add_argument("--busy-cores", type=int, default=0,
                   help="run this many busy processes (`while True: pass`) throughout, every engine under the "
                        "same load (a laptop is never idle)")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a bar chart (PNG) here")


# -- engines ---------------------------------------------------------------------------------------
class Wallbreaker:
    """The engine under test; with speculation, only its batch-1 decode is measured."""

    def __init__(self, args: argparse.Namespace, options: dict, name: str):
        from ..llm import LLM
        from ..sampling_params import SamplingParams
        from .workload import prompt_ids
        self.args, self.name, self.max_runs = args, name, args.runs
        self.spec = bool(options.get("speculative_method"))
        self.llm = LLM(args.model, **options)
        self.ids = lambda n, tag: prompt_ids(self.llm.tokenizer, n, tag)
        self.params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        self.llm.generate([self.ids(32, f"warm-up {name}")], self.params(8))
        threads = options.get("num_threads") or "decode threads governed (engine/threads.py)"
        self.notes = [f"{name}: loaded in {self.llm.load_time_s:.1f} s, dtype {options['dtype']}, threads: {threads}"]

    def measure(self, rep: int) -> dict[str, float | None]:
        a, out = self.args, {}
        if not self.spec:
            m = self.llm.generate([self.ids(a.prefill_tokens, f"prefill {rep}")], self.params(1))[0].metrics
            out["prefill_tps"] = a.prefill_tokens / m["ttft_s"]
            out["ttft_ms"] = m["ttft_s"] * 1000
        m = self.llm.generate([self.ids(a.decode_prompt_tokens, f"decode {rep}")], self.params(a.decode_tokens))[0].metrics
        out["decode_tps"] = m["decode_tokens_per_s"]
        out["roofline_fraction"] = request_roofline_fraction(self.llm, m)
        if self.spec:
            out["spec_acceptance_rate"] = m.get("spec_acceptance_rate", 0.0)
            return out
        for c in _concurrency(a):
            out.update(self._concurrent(c, rep))
        return out

    def _concurrent(self, c: int, rep: int) -> dict[str, float]:
        a = self.args
        before = self.llm.engine.stats()
        prompts = [self.ids(a.concurrent_prompt_tokens, f"conc {c} {rep} {i}") for i in range(c)]
        start = time.perf_counter()
        outs = self.llm.generate(prompts, self.params(a.concurrent_tokens))
        wall = time.perf_counter() - start
        generated = sum(o.metrics["num_generated_tokens"] for o in outs)
        counters = self.llm.engine.stats()
        decode_s = counters["decode_time_s"] - before["decode_time_s"]
        decode_tokens = counters["decode_tokens"] - before["decode_tokens"]
        return {f"gen_tps@{c}": generated / wall, f"decode_tps@{c}": decode_tokens / decode_s if decode_s else None}


def _concurrency(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in str(args.concurrency).split(",") if c.strip()]


class LlamaCppBaseline:
    name = "llama.cpp"

    def __init__(self, args: argparse.Namespace, model_path: Path, threads: int):
        from .baselines.llama_cpp import LlamaCpp
        self.args, self.model_path, self.max_runs = args, model_path, args.runs
        self.tool = LlamaCpp(args.llama_cpp_dir, threads)
        self.cost = stored_decode_cost(open_model(model_path), torch.float16)  # its GGUF as stored, an f16 KV cache
        self.notes = ["llama.cpp: TTFT is derived (prefill tokens / pp tokens/s); tg and batched-bench use "
                      "random tokens; its roofline fraction counts the stored GGUF bytes and an f16 KV cache"]

    def measure(self, rep: int) -> dict[str, float | None]:
        a = self.args
        b = self.tool.bench(self.model_path, a.prefill_tokens, a.decode_tokens)
        out: dict[str, float | None] = {"prefill_tps": b.get("prefill_tokens_per_s"),
                                        "decode_tps": b.get("decode_tokens_per_s")}
        out["ttft_ms"] = 1000 * a.prefill_tokens / out["prefill_tps"] if out["prefill_tps"] else None
        out["roofline_fraction"] = roofline_fraction(out["decode_tps"], self.cost, a.decode_tokens // 2,
                                                     stored_bandwidth(self.tool.threads))
        conc = _concurrency(a)
        if conc:
            rows = self.tool.batched_bench(self.model_path, a.concurrent_prompt_tokens, a.concurrent_tokens, conc)
            for c in conc:
                row = rows.get(c, {})
                out[f"gen_tps@{c}"] = row.get("gen_tokens_per_s")
                out[f"decode_tps@{c}"] = row.get("decode_tokens_per_s")
        return out


class TransformersBaseline:
    name = "transformers"
    max_runs = 1

    def __init__(self, args: argparse.Namespace, model_path: Path, tokenizer: Any, threads: int):
        from .baselines import transformers_hf
        from .workload import prompt_ids
        torch.set_num_threads(threads)
        self.hf = transformers_hf
        self.args, self.threads = args, threads
        self.model, load_s = transformers_hf.load(model_path)
        # float32 weights, read whole every step (its table too), and a float32 KV cache
        self.cost = model_cost(open_model(model_path).config, transformers_hf.weight_bytes(self.model), 0,
                               torch.float32)
        self.ids = lambda n, tag: prompt_ids(tokenizer, n, tag)
        self.hf.timed_generate(self.model, self.ids(16, "warm-up hf"), 2)
        self.notes = [f"transformers: float32 (dequantized), loaded in {load_s:.1f} s; batch 1 only, one run, "
                      f"{args.hf_tokens} decoded tokens"]

    def measure(self, rep: int) -> dict[str, float | None]:
        a = self.args
        seconds = self.hf.prefill_seconds(self.model, self.ids(a.prefill_tokens, f"prefill {rep}"))
        g = self.hf.timed_generate(self.model, self.ids(a.decode_prompt_tokens, f"decode {rep}"), a.hf_tokens)
        out: dict[str, float | None] = {"prefill_tps": a.prefill_tokens / seconds, "ttft_ms": seconds * 1000,
                                        "decode_tps": g["decode_tokens_per_s"]}
        out["roofline_fraction"] = roofline_fraction(g["decode_tokens_per_s"], self.cost,
                                                     a.decode_prompt_tokens + a.hf_tokens // 2,
                                                     stored_bandwidth(self.threads))
        return out


# -- the run ---------------------------------------------------------------------------------------
def _engines(args: argparse.Namespace, options: dict, threads: int) -> tuple[list[Any], list[str]]:
    from ..formats import resolve_model_path
    spec = options.get("speculative_method")
    engines: list[Any] = [Wallbreaker(args, {**options, "speculative_method": None}, "wallbreaker")]
    if spec:
        engines.append(Wallbreaker(args, options, f"wallbreaker+{spec}"))
    notes: list[str] = []
    wanted = {b.strip() for b in args.baselines.split(",") if b.strip() and b.strip() != "none"}
    unknown = wanted - {"transformers", "llama.cpp"}
    if unknown:
        from ..errors import InvalidRequestError
        raise InvalidRequestError(f"unknown baseline(s) {', '.join(sorted(unknown))}; choose transformers, llama.cpp or none")
    path = resolve_model_path(args.model)
    if "llama.cpp" in wanted:
        from .baselines.llama_cpp import LlamaCpp
        if path.is_dir():
            notes.append("llama.cpp skipped: the model is a Hugging Face folder, not a GGUF file")
        elif not LlamaCpp(args.llama_cpp_dir).available():
            notes.append("llama.cpp skipped: llama-bench not found (give --llama-cpp-dir or set LLAMA_CPP_DIR)")
        else:
            engines.append(LlamaCppBaseline(args, path, threads))
    if "transformers" in wanted:
        try:
            engines.append(TransformersBaseline(args, path, engines[0].llm.tokenizer, threads))
        except Exception as e:  # a baseline that cannot load is reported, not fatal
            notes.append(f"transformers skipped: {type(e).__name__}: {e}")
    return engines, notes


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run(args: argparse.Namespace, options: dict) -> int:
    """`args`: the bench flags (and `model`); `options`: the engine's, as LLM(model, **options) takes them.
    The baselines run on `num_threads` (or torch's count); wallbreaker on its own default where
    `num_threads` is not given, as a user runs it (prefill on every thread, decode governed)."""
    threads = options.get("num_threads") or torch.get_num_threads()
    engines, notes = _engines(args, options, threads)
    busy = _busy(args.busy_cores)
    try:
        samples = _measure(engines, args, notes)
    finally:
        for proc in busy:
            proc.kill()
    if busy:
        notes.append(f"{len(busy)} busy process(es) ran beside every engine throughout")
    for e in engines:
        notes += e.notes
    report = summarize(samples, args, threads, notes)
    print(render(report))
    if args.json_out:
        write_json(args.json_out, report)
        print(f"wrote {args.json_out}", file=sys.stderr)
    if args.plot:
        groups = {label(k)[0]: {e: report["medians"][e].get(k) for e in report["medians"]} for k in report["metrics"]}
        bar_plot(groups, args.plot, f"{report['model']} ({args.dtype}, {threads} threads), medians of {args.runs}",
                 {label(k)[0]: label(k)[1] for k in report["metrics"]})
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _measure(engines: list[Any], args: argparse.Namespace, notes: list[str]) -> dict[str, dict[str, list[float]]]:
    samples: dict[str, dict[str, list[float]]] = {e.name: {} for e in engines}
    for rep in range(args.runs):
        for engine in engines:
            if rep >= engine.max_runs:
                continue
            print(f"[run {rep + 1}/{args.runs}] {engine.name} ...", file=sys.stderr, flush=True)
            try:
                measured = engine.measure(rep)
            except Exception as e:
                if engine.name.startswith("wallbreaker"):
                    raise
                notes.append(f"{engine.name} run {rep + 1} failed: {e}")
                continue
            for key, value in measured.items():
                if value is not None:
                    samples[engine.name].setdefault(key, []).append(value)
    return samples


def summarize(samples: dict[str, dict[str, list[float]]], args: argparse.Namespace, threads: int,
              notes: list[str]) -> dict:
    from ..formats import resolve_model_path
    metrics = list(dict.fromkeys(k for per in samples.values() for k in per))
    medians = {e: {k: median(v) for k, v in per.items()} for e, per in samples.items()}
    ours = medians.get("wallbreaker", {})
    ratios = {e: {k: ours[k] / m[k] for k in m if ours.get(k) and m.get(k)}
              for e, m in medians.items() if e != "wallbreaker"}
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    bandwidth = stored_bandwidth(threads)
    if bandwidth is None:
        notes.append("no stored bandwidth: run `wallbreaker roofline` once for roofline fractions")
    return {"model": resolve_model_path(args.model).name, "config": config, "threads": threads,
            "machine": machine_facts(threads),
            "bandwidth_bytes_per_s": bandwidth, "metrics": metrics, "samples": samples, "medians": medians,
            "ratios": ratios, "notes": notes, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def render(report: dict) -> str:
    engines = list(report["medians"])
    baselines = [e for e in engines if e in report["ratios"]]
    headers = ["metric"] + engines + [f"wallbreaker / {b}" for b in baselines]
    rows = []
    for key in report["metrics"]:
        text, _, higher = label(key)
        row: list[Any] = [text + ("" if higher else " (lower is better)")]
        row += [report["medians"][e].get(key) for e in engines]
        row += [f"{report['ratios'][b][key]:.2f}x" if key in report["ratios"][b] else None for b in baselines]
        rows.append(row)
    lines = [f"{report['model']}, {report['threads']} threads, medians of {report['config']['runs']} run(s)",
             f"machine: {describe_machine(report['machine'])}", "",
             markdown_table(headers, rows, 2)]
    if report["notes"]:
        lines += [""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines)
