"""The bound on a prompt's prefill that the prefill cannot pass: the time of its matrix products alone.

A rate per kernel kind from the machine profile (one 2048^3 product, a few trials) is no bound on a
prefill of other shapes: on a shared host the probe may run while a neighbour is busy and the prefill
while it is not, a prompt's shapes may run faster than the probe's, and the output head runs for one
row of a prompt, not for every token. So `wallbreaker roofline` times each distinct linear layer of
the loaded model as the prefill calls it ([prompt tokens, in] activations; the head with one row),
the best of many trials, and sums them over the layers. A prefill does all of these products and
more (attention, norms, the embedding), so it takes longer. Experts are left out (the prefill runs
only the chosen ones): the bound is looser for a mixture of experts, never lower.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from ..layers.linear import Linear, QuantLinear


def _shape_key(m: nn.Module) -> tuple:
    if isinstance(m, QuantLinear):
        return "q", tuple(m.rows), tuple(m.qtypes), m.in_features, m._bias is not None
    return "f", tuple(m.weight.shape), m.weight.dtype, m.bias is not None


def matmul_groups(model: nn.Module) -> list[tuple[nn.Module, int, int]]:
    """(a representative layer, how many layers of its shape a prompt runs, rows each gets per prompt
    token): the layers of one shape and format take the same time; the head gets one row a prompt
    (rows 0 here, timed apart)."""
    from .roofline import _expert_modules
    experts = {id(sub) for e in _expert_modules(model) for sub in e.modules()}
    head = getattr(model, "lm_head", None)
    groups: dict[tuple, list] = {}
    for m in model.modules():
        if not isinstance(m, (Linear, QuantLinear)) or id(m) in experts or m is head:
            continue
        groups.setdefault(_shape_key(m), [m, 0, 1])[1] += 1
    out = [tuple(g) for g in groups.values()]
    if isinstance(head, (Linear, QuantLinear)):
        out.append((head, 1, 0))
    return out


def best_seconds(fn: Callable[[], object], trials: int, min_seconds: float) -> float:
    """The fastest of at least `trials` calls (more until `min_seconds` have passed), after a warm-up:
    a neighbour only ever slows a call."""
    fn()
    best, start, n = float("inf"), time.perf_counter(), 0
    while n < trials or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        n += 1
    return best


def in_features(m: nn.Module) -> int:
    return m.in_features if isinstance(m, QuantLinear) else m.weight.shape[1]


@torch.inference_mode()
def prefill_matmul_seconds(model: nn.Module, tokens: int, trials: int = 10, min_seconds: float = 0.05) -> float:
    """Seconds the linear layers of a prefill of `tokens` prompt tokens take at best (one sequence)."""
    g = torch.Generator().manual_seed(0)
    total = 0.0
    for layer, count, rows_per_token in matmul_groups(model):
        x = torch.randn(max(1, rows_per_token * tokens), in_features(layer), generator=g)
        total += count * best_seconds(lambda: layer(x), trials, min_seconds)
    return total


def prefill_bound_tokens_per_s(model: nn.Module, tokens: int, trials: int = 10) -> float:
    """The prefill rate no prefill of `tokens` prompt tokens can pass on this host (see the module)."""
    return tokens / prefill_matmul_seconds(model, tokens, trials)
