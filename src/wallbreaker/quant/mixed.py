"""Mixed precision: a bit width per tensor, reaching a target average, where it helps most.

Sensitivity: for each tensor alone at each candidate width, the relative error it causes in its
decoder layer's output on calibration tokens, ||Δy||² / ||y||² averaged over tokens (ExLlamaV2's
measure), times that layer's propagation gain: how much of an error at its output reaches the final
hidden state (see `pipeline._propagation_gains`). Allocation: every tensor starts at the narrowest
width; then, greedily, the upgrade with the largest error reduction per added bit of storage is
taken while the budget allows.

Convention: the target and the averages count code bits per weight over the quantized Linear
weights, as `--bits 3` does for a uniform model; the scales and zero points of the groups add the
same overhead to both (16 or 32 bits per group), reported separately as bits per weight.
"""
from __future__ import annotations

import math


def candidate_bits(target: float) -> list[int]:
    """Widths the allocator may choose from: one below the target's floor to one above its ceiling."""
    lo, hi = max(2, math.floor(target) - 1), min(8, math.ceil(target) + 1)
    return list(range(lo, hi + 1))


def allocate_bits(numel: dict[str, int], errors: dict[str, dict[int, float]], target: float) -> dict[str, int]:
    """Per tensor the width to use: the sum of errors made small under Σ bits·numel ≤ target·Σ numel."""
    total = sum(numel.values())
    budget = target * total
    bits = {name: min(errors[name]) for name in numel}
    used = sum(bits[n] * numel[n] for n in numel)
    if used > budget + 1e-9:
        raise ValueError(f"target {target} bits is below the narrowest candidate width {min(bits.values())}")
    while True:
        best: tuple[float, str, int] | None = None
        for name in numel:
            b = bits[name]
            for wider, err in errors[name].items():
                cost = (wider - b) * numel[name]
                if wider <= b or used + cost > budget + 1e-9:
                    continue
                gain = (errors[name][b] - err) / cost
                if best is None or gain > best[0]:
                    best = (gain, name, wider)
        if best is None or best[0] <= 0:
            return bits
        _, name, wider = best
        used += (wider - bits[name]) * numel[name]
        bits[name] = wider


def average_bits(bits: dict[str, int], numel: dict[str, int]) -> float:
    return sum(bits[n] * numel[n] for n in bits) / sum(numel[n] for n in bits)
