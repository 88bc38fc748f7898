"""Where a batch-1 decode step's time goes: in our kernels, or outside them (Python, PyTorch's
own ops, the allocator), with the C++ decoder plan (`_C.DecoderPlan`) on and off, A/B/A in fresh
processes. Issue 32 asks for at most 10% outside the kernels on SmolLM2.

    python benchmarks/decode_step_profile.py [--model smollm2] [--tokens 400] [--rounds 3]

Each process decodes greedily, then `perf record` samples its main thread for a few seconds of
steady decoding; a sample in `_C` (our kernels) or in libgomp (the main thread inside a kernel's
parallel region, waiting for the other thread) counts as kernel time. Without `perf` on the PATH
only tokens/s are reported. Writes benchmarks/results/decode_step_profile.json and its plot.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

CHILD = r"""
import sys, time
from wallbreaker import LLM, SamplingParams
llm = LLM(sys.argv[1])
params = SamplingParams(max_tokens=int(sys.argv[2]), ignore_eos=True, temperature=0)
llm.generate(["Hello"], SamplingParams(max_tokens=16, ignore_eos=True))
print("READY", flush=True)
start, tokens = time.perf_counter(), 0
while time.perf_counter() - start < float(sys.argv[3]):
    tokens += len(llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids)
print("TOKENS_PER_S", tokens / (time.perf_counter() - start), flush=True)
"""


def kernel_share(perf_data: Path) -> dict:
    """Shares of the main thread's samples: our kernels (_C + libgomp) and the rest, by library."""
    report = subprocess.run(["perf", "report", "-i", str(perf_data), "--no-children", "--stdio", "--sort", "dso"],
                            capture_output=True, text=True, check=True).stdout
    shares: dict[str, float] = {}
    for line in report.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].endswith("%"):
            shares[parts[1]] = float(parts[0].rstrip("%"))
    kernels = sum(v for k, v in shares.items() if k.startswith("_C.") or k.startswith("libgomp"))
    return {"kernels_percent": kernels, "outside_percent": sum(shares.values()) - kernels, "by_library": shares}


def one_run(model: str, plan: bool, tokens: int, seconds: float) -> dict:
    env = dict(os.environ, WALLBREAKER_DECODER_PLAN="1" if plan else "0")
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, model, str(tokens), str(seconds)], env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        while proc.stdout.readline().strip() != "READY":
            if proc.poll() is not None:
                raise RuntimeError("the decoding process ended before it was ready")
        result: dict = {"decoder_plan": plan}
        if shutil.which("perf"):
            time.sleep(1.0)
            data = Path(tmp) / "perf.data"
            subprocess.run(["perf", "record", "-q", "-F", "2000", "-t", str(proc.pid), "-o", str(data), "--",
                            "sleep", str(seconds / 2)], capture_output=True, check=True)
            result.update(kernel_share(data))
        for line in proc.stdout:
            if line.startswith("TOKENS_PER_S"):
                result["tokens_per_s"] = float(line.split()[1])
        proc.wait()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=400, help="tokens a generation")
    parser.add_argument("--seconds", type=float, default=12.0, help="decoding time a process")
    parser.add_argument("--rounds", type=int, default=3, help="A/B pairs, then one more A")
    parser.add_argument("--json", type=Path, default=RESULTS / "decode_step_profile.json")
    args = parser.parse_args()
    from wallbreaker.measure.machine import describe_machine, machine_facts

    runs = []
    for i in range(2 * args.rounds + 1):
        run = one_run(args.model, i % 2 == 0, args.tokens, args.seconds)
        print(json.dumps({k: v for k, v in run.items() if k != "by_library"}), flush=True)
        runs.append(run)
    machine = machine_facts()
    print(describe_machine(machine))
    out = {"model": args.model, "machine": machine, "command": " ".join(sys.argv), "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    plot(out, args.json.with_suffix(".png"))


def plot(out: dict, path: Path) -> None:
    """tokens/s and the share outside the kernels of every run, in run order."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = out["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    colors = ["tab:blue" if r["decoder_plan"] else "tab:gray" for r in runs]
    labels = [f"{i + 1}\n{'plan' if r['decoder_plan'] else 'Python'}" for i, r in enumerate(runs)]
    axes[0].bar(range(len(runs)), [r.get("tokens_per_s", 0) for r in runs], color=colors)
    axes[0].set_ylabel("tokens/s, batch 1")
    axes[1].bar(range(len(runs)), [r.get("outside_percent", 0) for r in runs], color=colors)
    axes[1].axhline(10, color="tab:red", lw=1, ls="--")
    axes[1].set_ylabel("% of the main thread outside our kernels")
    for ax in axes:
        ax.set_xticks(range(len(runs)), labels, fontsize=7)
    m = out["machine"]
    fig.suptitle(f"{out['model']} decode step: C++ decoder plan against the Python layers (A/B/A)\n"
                 f"{m.get('cpu', '')}, {m.get('kernel_isa', '')}, {m.get('threads', '')} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
