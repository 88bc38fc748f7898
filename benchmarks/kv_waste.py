"""KV-cache waste of paged allocation against contiguous reservation.

64 requests with prompt and output lengths drawn from a wide distribution (prompts 400-2000
tokens, outputs 16-512, ignore_eos) are submitted at once. After every engine step we record the
engine's `kv_waste_fraction` (slots held in blocks of running sequences but not filled) beside the
waste a contiguous allocator would have on the same running set: reserving max_model_len per
request (what a static per-sequence buffer does), and reserving prompt + max_tokens (the best a
contiguous allocator that is told max_tokens can do).

By default this is a simulation, and exact: the real LLMEngine, Scheduler, BlockManager and
BlockPool run the workload step by step, and only the model is replaced by a stub that returns
zero logits (greedy picks token 0; ignore_eos keeps lengths as drawn). Waste is a property of the
allocator, so the model changes nothing but the time (seconds instead of minutes). `--real` runs
the actual model instead.

    python benchmarks/kv_waste.py

Writes benchmarks/results/kv_waste_<model>.json and .png and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

from wallbreaker.cli import add_engine_flags, engine_options
from wallbreaker.engine.client import EngineRequest
from wallbreaker.engine.llm_engine import LLMEngine
from wallbreaker.engine.scheduler import Scheduler
from wallbreaker.formats import open_model, resolve_model_path
from wallbreaker.kv import BlockManager, BlockPool
from wallbreaker.measure.reporting import markdown_table, write_json
from wallbreaker.sampling_params import SamplingParams
from wallbreaker.measure.workload import prompt_ids

RESULTS = Path(__file__).parent / "results"
ALLOCATIONS = ("paged (wallbreaker)", "contiguous, max_model_len each", "contiguous, prompt + max_tokens each")


class StubRunner:
    """Stands in for ModelRunner: no model, no KV tensors; the same sampling rows, zero logits."""

    def __init__(self, vocab_size: int):
        self.vocab_size = self.vocab_limit = vocab_size

    def run(self, batch, all_logits: bool = False):
        seqs = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
        rows = sum(1 + s.num_draft for s in seqs)
        return seqs, torch.zeros(rows, self.vocab_size)


def simulated_engine(model: str | None, block_size: int, num_blocks: int, max_num_seqs: int,
                     max_batched_tokens: int, max_model_len: int | None) -> tuple[LLMEngine, int]:
    files = open_model(model)
    cfg = files.config
    max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    block_manager = BlockManager(BlockPool(num_blocks, enable_prefix_caching=True), block_size)
    scheduler = Scheduler(block_manager, max_num_seqs, max_batched_tokens, max_len)
    eos = frozenset(cfg.eos_token_ids) | files.tokenizer.stop_token_ids
    return LLMEngine(StubRunner(cfg.vocab_size), files.tokenizer, scheduler, eos), max_len


def real_engine(model: str | None, options: dict, num_blocks: int) -> tuple[LLMEngine, int]:
    from wallbreaker import LLM, EngineConfig
    from wallbreaker.kv.cache import bytes_per_block
    config = EngineConfig(**options)
    per_block = bytes_per_block(open_model(model).config, config.kv_block_size, config.kv_cache_torch_dtype)
    llm = LLM(model, **options, kv_cache_memory_gb=(num_blocks + 0.5) * per_block / 2**30)
    return llm.engine, llm.max_model_len


def workload(count: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(count)]


def simulate(engine: LLMEngine, max_len: int, requests: list[tuple[int, int]]) -> list[dict]:
    reserved_tight = {}
    for i, (prompt_len, out_len) in enumerate(requests):
        ids = prompt_ids(engine.tokenizer, prompt_len, f"kv waste {i}")
        rid = engine.add_request(EngineRequest(ids, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)))
        reserved_tight[rid] = min(prompt_len + out_len, max_len)
    trace = []
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        stats = engine.stats()
        slots = {ALLOCATIONS[0]: len({b for s in running for b in s.block_table}) * stats["kv_block_size"],
                 ALLOCATIONS[1]: len(running) * max_len,
                 ALLOCATIONS[2]: sum(reserved_tight[s.request_id] for s in running)}
        stored = sum(s.num_computed_tokens for s in running)
        trace.append({"step": len(trace), "running": len(running), "tokens_stored": stored,
                      "engine_kv_waste_fraction": stats["kv_waste_fraction"], "slots": slots,
                      "waste": {a: 1 - stored / n if n else 0.0 for a, n in slots.items()},
                      "preemptions": stats["num_preemptions"]})
    return trace


def summarize(trace: list[dict]) -> dict[str, dict[str, float]]:
    """Per allocation: the worst step, the mean over steps, and over all slot-steps together."""
    busy = [t for t in trace if t["running"]]
    stored = sum(t["tokens_stored"] for t in busy)
    return {a: {"max": max(t["waste"][a] for t in busy), "mean": sum(t["waste"][a] for t in busy) / len(busy),
                "slot_weighted": 1 - stored / sum(t["slots"][a] for t in busy)} for a in ALLOCATIONS}


def plot(trace: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = [t for t in trace if t["running"]]
    steps = [t["step"] for t in trace]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for allocation in ALLOCATIONS:
        ax.plot(steps, [t["waste"][allocation] for t in trace], label=allocation)
    ax.set_xlabel("engine step")
    ax.set_ylabel("fraction of reserved KV slots unused")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(steps, [t["running"] for t in trace], color="gray", alpha=0.4, linestyle=":")
    twin.set_ylabel("running sequences (dotted)", color="gray")
    twin.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="center right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--real", action="store_true", help="run the actual model instead of the stub (minutes)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-range", default="400,2000")
    p.add_argument("--output-range", default="16,512")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=None, help="(default: room for every request at once)")
    # the model gives its tokenizer, vocabulary and max_model_len; the pool is --num-blocks
    add_engine_flags(p, skip=("kv_cache_memory_gb",), max_num_batched_tokens=4096)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default=None)
    args = p.parse_args()

    prompt_range = tuple(int(x) for x in args.prompt_range.split(","))
    output_range = tuple(int(x) for x in args.output_range.split(","))
    requests = workload(args.num_requests, prompt_range, output_range, args.seed)
    num_blocks = args.num_blocks or sum(-(-(p + o) // args.kv_block_size) for p, o in requests)
    if args.real:
        engine, max_len = real_engine(args.model, engine_options(args), num_blocks)
    else:
        engine, max_len = simulated_engine(args.model, args.kv_block_size, num_blocks, args.max_num_seqs,
                                           args.max_num_batched_tokens, args.max_model_len)
    print(f"{'real model' if args.real else 'simulation (stub model)'}: {len(requests)} requests, "
          f"{num_blocks} blocks of {args.kv_block_size}, max_model_len {max_len} ...", file=sys.stderr, flush=True)
    trace = simulate(engine, max_len, requests)

    summary = summarize(trace)
    engine_max = max(t["engine_kv_waste_fraction"] for t in trace)
    name = args.name or resolve_model_path(args.model).stem
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    json_path = write_json(args.out / f"kv_waste_{name}.json",
                           {"config": {**config, "num_blocks": num_blocks, "max_model_len": max_len,
                                       "mode": "real" if args.real else "simulated"},
                            "requests": requests, "summary": summary, "engine_kv_waste_fraction_max": engine_max,
                            "trace": trace})
    plot(trace, args.out / f"kv_waste_{name}.png",
         f"{name}: {len(requests)} requests, prompts {args.prompt_range}, outputs {args.output_range}, "
         f"blocks of {args.kv_block_size} ({'real' if args.real else 'simulated'})")
    print(markdown_table(["allocation", "max waste", "mean waste over steps", "waste over all slot-steps"],
                         [[label, f"{s['max']:.1%}", f"{s['mean']:.1%}", f"{s['slot_weighted']:.1%}"]
                          for label, s in summary.items()]))
    print(f"\n{len(trace)} steps, {trace[-1]['preemptions']} preemptions; the engine's own kv_waste_fraction "
          f"peaked at {engine_max:.1%}; wrote {json_path} and {json_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
