"""`wallbreaker roofline`: measure the machine, count what a decode step of the model moves, print the
bounds that follow, then decode for real and say how close to the bound the engine gets."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from ..kernels import tuning
from .machine import MIN_STORED_BUFFER_MIB, MachineProfile, describe_machine, machine_facts, measure, store_profile
from .reporting import fmt, markdown_table, write_json
from .prefill_bound import prefill_bound_tokens_per_s
from .roofline import DecodeCost, llm_cost, machine_profile, roofline_fraction

BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 1024, 4096)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--buffer-mib", type=int, default=512, help="bandwidth buffer size (default: 512 MiB)")
    p.add_argument("--repeats", type=int, default=7, help="runs of each bandwidth kernel (default: 7)")
    p.add_argument("--gemm-size", type=int, default=2048, help="matmul size for FLOP/s (default: 2048)")
    p.add_argument("--no-measure", action="store_true", help="use the stored machine profile, measure nothing")
    p.add_argument("--store", action=argparse.BooleanOptionalAction, default=None,
                   help=f"store the measurement in machine.json (default: when --buffer-mib >= {MIN_STORED_BUFFER_MIB})")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt of the real decode run (default: 128)")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded in the real run; 0 skips it")
    p.add_argument("--json", dest="json_out", type=Path, default=None, help="also write the results here")


def _profile(args: argparse.Namespace, threads: int) -> tuple[MachineProfile, str]:
    if args.no_measure:
        profile = machine_profile()
        if profile is None:
            from ..errors import WallbreakerError
            raise WallbreakerError("no stored machine profile; run `wallbreaker roofline` without --no-measure first")
        return profile, f"stored, measured {profile.measured_at}"
    print(f"measuring bandwidth over {args.buffer_mib} MiB at 1 and {threads} threads, "
          f"matmuls of {args.gemm_size}^3 ...", file=sys.stderr)
    profile = measure(sorted({1, threads}), args.buffer_mib, args.repeats, args.gemm_size)
    store = args.store if args.store is not None else args.buffer_mib >= MIN_STORED_BUFFER_MIB
    if store:
        return profile, f"measured now, stored in {store_profile(profile)}"
    return profile, "measured now, not stored"


def machine_lines(profile: MachineProfile) -> list[str]:
    rows = [[t, s["read"].best / 1e9, s["read"].median / 1e9, s["copy"].best / 1e9, s["copy"].median / 1e9]
            for t, s in sorted(profile.bandwidth.items(), key=lambda kv: int(kv[0]))]
    lines = [f"Memory bandwidth, GB/s ({profile.buffer_mib} MiB buffers, {profile.repeats} runs; "
             "copy counts read + write):",
             markdown_table(["threads", "read best", "read median", "copy best", "copy median"], rows), ""]
    if profile.flops:
        lines.append(f"GFLOP/s ({max(map(int, profile.bandwidth), default=1)} threads; matmuls {profile.gemm_size}^3, "
                     "q4/q8 our kernels over Q4_0/Q8_0 blocks; attention_*: SDPA, causal, "
                     f"{max(profile.gemm_size // 4, 16)} positions, as prefill runs it):")
        lines.append(markdown_table(["kind", "best", "median"],
                                    [[k, s.best / 1e9, s.median / 1e9] for k, s in profile.flops.items()]))
        lines.append("")
    return lines


def cost_lines(cost: DecodeCost, bandwidth: float, flops: dict[str, float] | None) -> tuple[list[str], dict]:
    kv_per_pos = cost.kv_bytes(1)
    total, active = cost.experts
    moe = (f" ({cost.expert_bytes / 1e6:.1f} MB of them experts, {active} of {total} active per token: "
           f"{cost.weights_read(1) / 1e6:.1f} MB read at batch 1)") if total else ""
    lines = [f"A decode step reads {cost.weight_bytes / 1e6:.1f} MB of weights{moe} (resident form, once per step)"
             + (f" + {cost.row_bytes:,} bytes per embedding row gathered" if cost.row_bytes else "")
             + f" + {kv_per_pos:,} bytes of K/V per sequence per context position"
             + (f" + {cost.state_bytes:,} bytes of recurrent state per sequence, read and written anew"
                + (f" (as much as the K/V of {cost.break_even_context:,.0f} positions)" if cost.break_even_context
                   else "") if cost.state_bytes else "") + ".", "",
             "Bytes moved per decoded token, MB (a step's bytes / batch):"]
    lines.append(markdown_table(["batch"] + [f"ctx {c}" for c in CONTEXTS],
                                [[b] + [cost.bytes_per_token(b, c) / 1e6 for c in CONTEXTS] for b in BATCHES], 2))
    memory = {c: {b: cost.memory_bound(bandwidth, b, c) for b in BATCHES} for c in CONTEXTS}
    lines += ["", f"Memory bound, tokens/s of all sequences together, at {bandwidth / 1e9:.1f} GB/s:",
              markdown_table(["batch"] + [f"ctx {c}" for c in CONTEXTS],
                             [[b] + [memory[c][b] for c in CONTEXTS] for b in BATCHES]), ""]
    result: dict[str, Any] = {"bytes_per_token": {c: {b: cost.bytes_per_token(b, c) for b in BATCHES} for c in CONTEXTS},
                              "memory_bound_tokens_per_s": memory}
    params = ", ".join(f"{n / 1e6:.1f}M {k}" for k, n in cost.matmul_params.items())
    lines.append(f"Compute: 2 x {cost.params / 1e6:.1f}M matmul weights ({params}) = "
                 f"{2 * cost.params / 1e6:.0f} MFLOP per token, plus attention over the context.")
    if flops:
        compute = {c: cost.compute_bound(flops, c) for c in CONTEXTS}
        crossover = {c: cost.crossover_batch(bandwidth, flops, c) for c in CONTEXTS}
        lines.append(markdown_table(["context", "compute bound (tokens/s)", "memory-bound below batch"],
                                    [[c, compute[c], "never compute-bound" if crossover[c] is None else
                                      f"{crossover[c]:.1f}"] for c in CONTEXTS]))
        result.update(compute_bound_tokens_per_s=compute, crossover_batch=crossover)
    else:
        lines.append("(no FLOP/s measured: no compute bound)")
    return lines, result


def _floor_at_run(rate: float, bound: float) -> tuple[float, str]:
    """A bound is a rate the run cannot pass; where the run passed it anyway (the probe ran beside a
    busy neighbour, or the weights sat in a cache larger than the bandwidth buffer assumed), the
    run's own rate is the tightest bound known, and the line says so."""
    if rate <= bound:
        return bound, ""
    return rate, f"; the run passed the measured {bound:,.1f} tokens/s, so the bound is the run's own rate"


def decode_lines(measured: dict, cost: DecodeCost, bandwidth: float, flops: dict[str, float] | None,
                 context: int, threads: int, prompt_tokens: int) -> list[str]:
    bound, note = _floor_at_run(measured["decode_tokens_per_s"],
                                cost.bound(bandwidth, flops, 1, context))
    measured.update(bound_tokens_per_s=bound, roofline_fraction=measured["decode_tokens_per_s"] / bound)
    return [f"Real run, {threads} threads: {measured['decode_tokens']} tokens after a {prompt_tokens}-token prompt "
            f"decode at {measured['decode_tokens_per_s']:.1f} tokens/s = {measured['roofline_fraction']:.0%} of the "
            f"batch-1 bound ({bound:.1f} tokens/s at mean context {context}{note})."]


def prefill_line(measured: dict, model: Any, tokens: int, trials: int = 10) -> str:
    """The prefill's rate against `prefill_bound`'s: the prompt's matrix products alone, timed now at
    the prompt's shapes. A probe the run beat is taken again with more trials before the run's own
    rate stands in (`_floor_at_run`)."""
    rate = measured["prefill_tokens_per_s"]
    probe = prefill_bound_tokens_per_s(model, tokens, trials)
    if probe < rate:
        probe = max(probe, prefill_bound_tokens_per_s(model, tokens, 3 * trials))
    bound, note = _floor_at_run(rate, probe)
    measured.update(prefill_bound_tokens_per_s=bound, prefill_bound_fraction=rate / bound)
    return (f"Prefill of the prompt: {fmt(rate)} tokens/s = {rate / bound:.0%} of the prefill bound ({bound:,.0f} "
            f"tokens/s: its matrix products alone, each layer's shape timed now, best of {trials}+ trials{note}).")


def load(args: argparse.Namespace, options: dict, threads: int) -> Any:
    from ..llm import LLM
    return LLM(args.model, **{**options, "num_threads": threads})


def real_run(llm: Any, args: argparse.Namespace) -> dict:
    from ..sampling_params import SamplingParams
    from .workload import prompt_ids
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    llm.generate([prompt_ids(llm.tokenizer, args.prompt_tokens, "warm-up")], SamplingParams(max_tokens=8, ignore_eos=True))
    out = llm.generate([prompt_ids(llm.tokenizer, args.prompt_tokens, "roofline")], params)[0]
    m = out.metrics
    return {"prompt_tokens": args.prompt_tokens, "decode_tokens": m["num_generated_tokens"],
            "decode_tokens_per_s": m.get("decode_tokens_per_s", 0.0),
            "prefill_tokens_per_s": args.prompt_tokens / m["ttft_s"] if m.get("ttft_s") else None,
            "load_time_s": llm.load_time_s}


def run(args: argparse.Namespace, options: dict) -> int:
    """`args`: the roofline flags (and `model`); `options`: the engine's. The machine is measured at
    1 thread and at `num_threads` (default: torch's count), which the decode run uses too."""
    threads = options.get("num_threads") or torch.get_num_threads()
    profile, source = _profile(args, threads)
    bandwidth = profile.read_bandwidth(threads)
    flops = {k: s.best for k, s in profile.flops.items()} or None
    facts = machine_facts(threads)
    lines = [f"Machine ({source}): {describe_machine(facts)}"] + machine_lines(profile)
    report: dict[str, Any] = {"machine": profile.to_json(), "machine_facts": facts, "threads": threads,
                              "bandwidth_used": bandwidth}
    if args.decode_tokens <= 0:
        args.decode_tokens = 0
    llm = load(args, options, threads)
    lines += tuning.describe() + [""]  # after the load, which tunes where nothing is stored
    measured = real_run(llm, args) if args.decode_tokens else None
    cost = llm_cost(llm)
    kv_dtype = str(llm.kv_cache.tensor.dtype).removeprefix("torch.")
    lines.append(f"Model {llm.model_path.name} (dtype {llm.config.dtype}, KV cache {kv_dtype}):")
    more, bounds = cost_lines(cost, bandwidth, flops)
    lines += more
    report.update(model=str(llm.model_path), dtype=llm.config.dtype, weight_bytes=cost.weight_bytes,
                  expert_bytes=cost.expert_bytes, weight_bytes_read_batch_1=cost.weights_read(1),
                  row_bytes=cost.row_bytes, kv_bytes_per_position=cost.kv_bytes(1), state_bytes=cost.state_bytes,
                  break_even_context=cost.break_even_context, **bounds)
    if measured:
        context = args.prompt_tokens + measured["decode_tokens"] // 2
        lines += [""] + decode_lines(measured, cost, bandwidth, flops, context, threads, args.prompt_tokens)
        if measured["prefill_tokens_per_s"]:
            lines.append(prefill_line(measured, llm.model, args.prompt_tokens))
        report["run"] = measured
    print("\n".join(lines))
    if args.json_out:
        write_json(args.json_out, report)
    return 0
