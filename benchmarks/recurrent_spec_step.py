"""What a speculative step costs on a recurrent or hybrid model: one model step that verifies K
drafts (1 + K tokens, the state after each kept in its own slot: docs/recurrent.md) against a plain
decode step, batch 1, on the same sequence, alternating A/B/A in one process. The drafts are
random tokens and all rejected, so each verification keeps the state after its first token and
the sequence moves one token a step either way; only the model step is timed (no proposer, no
sampler). Issue 34 asks for at most 1.3x at K = 4.

    python benchmarks/recurrent_spec_step.py MODEL.gguf [--drafts 4] [--rounds 30]

Writes benchmarks/results/recurrent_spec_step.json (one entry per model and host, the latest run kept) and
redraws recurrent_spec_step.png from all of them.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from wallbreaker import LLM
from wallbreaker.engine.scheduler import Append, StepOutput
from wallbreaker.engine.sequence import Sequence
from wallbreaker.measure.machine import describe_machine, machine_facts
from wallbreaker.sampling_params import SamplingParams

RESULTS = Path(__file__).parent / "results"


def timed_step(llm: LLM, seq: Sequence, drafts: list[int]) -> float:
    """One model step of `seq` (with `drafts` to verify), its seconds, then its aftermath: the
    greedy token appended, every draft rejected."""
    scheduler, runner = llm.engine.scheduler, llm.engine.runner
    seq.spec_token_ids = list(drafts)
    batch = scheduler.schedule()
    assert seq.num_computed_tokens == 0 or batch.num_new_tokens == [1 + len(drafts)], batch.num_new_tokens
    start = time.perf_counter()
    _, logits = runner.run(batch)
    seconds = time.perf_counter() - start
    token = int(logits[0].argmax())
    scheduler.update_from_output(batch, StepOutput(appends=[Append(seq, [token], [0.0], [[]])]))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=RESULTS / "recurrent_spec_step.json")
    args = parser.parse_args()
    llm = LLM(args.model, speculative_method="ngram", num_speculative_tokens=args.drafts, max_num_seqs=1,
              kv_cache_memory_gb=1.0)
    rng = random.Random(0)
    vocab = llm.tokenizer.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_tokens)]
    seq = Sequence(0, "bench", 0, list(prompt), len(prompt), SamplingParams(max_tokens=10**6, ignore_eos=True), None)
    scheduler = llm.engine.scheduler
    scheduler.add(seq)
    timed_step(llm, seq, [])  # the prompt
    for _ in range(3):  # warm-up, both kinds
        timed_step(llm, seq, [])
        timed_step(llm, seq, [rng.randrange(vocab) for _ in range(args.drafts)])
    plain, verify = [], []
    with torch.inference_mode():
        for _ in range(args.rounds):  # A/B/A: plain, verification, plain, ...
            plain.append(timed_step(llm, seq, []))
            verify.append(timed_step(llm, seq, [rng.randrange(vocab) for _ in range(args.drafts)]))
        plain.append(timed_step(llm, seq, []))
    scheduler.finish(seq, "length")
    machine = machine_facts()
    result = {"model": args.model, "architecture": llm.model_config.architecture, "drafts": args.drafts,
              "rounds": args.rounds, "machine": machine,
              "plain_step_ms_median": 1e3 * statistics.median(plain),
              "verify_step_ms_median": 1e3 * statistics.median(verify),
              "ratio": statistics.median(verify) / statistics.median(plain),
              "plain_step_ms": [1e3 * t for t in plain], "verify_step_ms": [1e3 * t for t in verify]}
    print(describe_machine(machine))
    print(f"{llm.model_config.architecture}: plain step {result['plain_step_ms_median']:.2f} ms, verifying "
          f"{args.drafts} drafts {result['verify_step_ms_median']:.2f} ms: {result['ratio']:.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(args.json.read_text()) if args.json.is_file() else []
    host = machine.get("cpu_id")  # one entry per model and host, the latest
    runs = [r for r in runs if (r.get("model"), r["machine"].get("cpu_id")) != (args.model, host)] + [result]
    args.json.write_text(json.dumps(runs, indent=2))
    plot(runs, args.json.with_suffix(".png"))


def plot(runs: list[dict], path: Path) -> None:
    """Each model's plain and verification step times (every round, and the median as a bar)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.5 + 2.2 * len(runs), 4))
    for i, run in enumerate(runs):
        for j, (kind, color) in enumerate([("plain", "tab:blue"), ("verify", "tab:orange")]):
            x = i + (j - 0.5) * 0.35
            ax.bar(x, run[f"{kind}_step_ms_median"], width=0.33, color=color, alpha=0.6,
                   label=("plain step" if kind == "plain" else f"verifying {run['drafts']} drafts") if i == 0 else None)
            ax.scatter([x] * len(run[f"{kind}_step_ms"]), run[f"{kind}_step_ms"], s=6, color=color)
        ax.text(i, max(run["verify_step_ms"]) * 1.03, f"{run['ratio']:.2f}x", ha="center")
    ax.set_xticks(range(len(runs)), [f"{r['architecture']}\n{Path(r['model']).stem}" for r in runs], fontsize=8)
    ax.set_ylim(0, 1.15 * max(max(r["verify_step_ms"]) for r in runs))
    ax.set_ylabel("ms a model step (batch 1)")
    machine = runs[-1].get("machine", {})
    ax.set_title(f"speculative verification against a plain step\n{machine.get('cpu', '')}, "
                 f"{machine.get('kernel_isa', '')}, {machine.get('threads', '')} threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
