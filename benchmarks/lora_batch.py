"""What LoRA adapters cost a batch's decode (issue 52): 16 sequences over 4 random adapters (rank 8 by
default, on q/k/v/o and gate/up/down), each sequence its own, against the same 16 sequences without
adapters, on the embedded default model (SmolLM2-135M) on the packed (`auto`) path. A/B/A in one
process (base, adapters, base, per round), each run on fresh prompts (no prefix-cache hits).

    .venv/bin/python benchmarks/lora_batch.py                       # SmolLM2, rank 8, 64 decode tokens
    .venv/bin/python benchmarks/lora_batch.py --rank 16 --rounds 3
    .venv/bin/python benchmarks/lora_batch.py --decode-tokens 4 --rounds 1 --json /tmp/x.json   # a smoke run

Goal: adapters' decode throughput at least 70% of the base's. Writes
benchmarks/results/lora_batch_<model>_r<rank>.json with the machine, the command and every run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_random_adapter(out: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder for a model of `cfg` (HF llama module names), every weight random (~0.02)."""
    from safetensors.torch import save_file
    hidden, q, kv, ffn = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden), "down_proj": (hidden, ffn)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for block, names in TARGETS.items():
            for name in names:
                rows, cols = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, cols, generator=g) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": [n for names in TARGETS.values() for n in names]}))
    return out


def decode_speed(llm, prompts: list, max_tokens: int, loras: list | None) -> float:
    """Decode tokens a second of the batch: its generated tokens after the first, over the time after
    its prefill (all 16 prompts go in the first step)."""
    from wallbreaker import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    wall = time.perf_counter() - start
    prefill = max(o.metrics["ttft_s"] for o in outs)
    return len(prompts) * (max_tokens - 1) / (wall - prefill)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF path or a packaged name (default: SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="A/B/A rounds (each: base, adapters, base)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    from wallbreaker import LLM, LoRARequest
    from wallbreaker.measure.machine import machine_facts
    from wallbreaker.measure.reporting import write_json
    from wallbreaker.measure.workload import prompt_ids
    llm = LLM(args.model, dtype=args.dtype, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              max_num_seqs=max(64, args.sequences))
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(write_random_adapter(Path(tmp) / f"a{i}", llm.model_config,
                                                                                args.rank, seed=i)))
                    for i in range(args.adapters)]
        loras = [adapters[i % len(adapters)] for i in range(args.sequences)]

        def prompts(tag: str) -> list:
            return [{"prompt_token_ids": prompt_ids(llm.tokenizer, 32, f"{tag} {i}")} for i in range(args.sequences)]
        # long enough for the decode thread count (engine/threads.py) to settle on both paths
        decode_speed(llm, prompts("warm-up base"), args.decode_tokens, None)
        decode_speed(llm, prompts("warm-up adapters"), args.decode_tokens, loras)
        runs: dict[str, list[float]] = {"base": [], "adapters": []}
        order = ["base", "adapters", "base"] * args.rounds
        for i, mode in enumerate(order):
            speed = decode_speed(llm, prompts(f"run {i}"), args.decode_tokens, loras if mode == "adapters" else None)
            runs[mode].append(speed)
            print(f"{mode}: {speed:.1f} decode tokens/s", flush=True)
    med = {mode: statistics.median(speeds) for mode, speeds in runs.items()}
    ratio = med["adapters"] / med["base"]
    name = (args.model or "smollm2").removesuffix(".gguf").rsplit("/", 1)[-1].lower()
    path = write_json(args.json or RESULTS / f"lora_batch_{name}_r{args.rank}.json",
                      {"machine": machine_facts(), "command": machine_facts()["command"], "started_utc": started,
                       "model": args.model or "smollm2", "dtype": args.dtype, "rank": args.rank,
                       "adapters": args.adapters, "sequences": args.sequences, "decode_tokens": args.decode_tokens,
                       "order": order, "runs": runs, "median_tokens_per_s": med, "throughput_ratio": ratio,
                       "goal_ratio": 0.7})
    print(f"adapters / base decode throughput: {ratio:.2f} (goal >= 0.70); wrote {path}")


if __name__ == "__main__":
    main()
