"""The one sampler: plain decoding, n > 1 and speculative decoding draw here; beam search and every
logprob report rank candidates with `top_logprobs`.

Pipeline per row: constraints (a token mask: a grammar, bad words; allowed_token_ids; logit_bias)
-> penalties -> temperature -> top-k -> top-p -> min-p -> renormalize -> draw.
Rows carry their own `SamplingParams`; the filtering is vectorized over the batch, and the
full-vocabulary sort is only paid for top-p rows whose nucleus is not among their most
likely `TOP_P_CANDIDATES` tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from wallbreaker.sampling_params import SamplingParams

from .dry import dry_penalties
from .truncation import mirostat_truncate, mirostat_update, typical_drop, xtc_mixture

# top-p first looks for its nucleus among this many most likely tokens (see `_top_p_drop`).
TOP_P_CANDIDATES = 1024


@dataclass
class TokenMask:
    """The tokens allowed in some rows of a batch: row `rows[r]` may take token t when bit t % 32 of
    word t // 32 of `bits[r]` is set. `bits` [len(rows), words] int32 covers the tokenizer's
    vocabulary; tokens past it (a padded embedding's rows) are never allowed. Other rows are free."""

    rows: list[int]
    bits: Tensor


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [B] long; -1 where the constraints left no token allowed
    logprobs: Tensor  # [B] float32, raw log-softmax at the chosen token (0.0 where params.logprobs is None)
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, best first; None when nobody asked
    mirostat_mu: list[float | None] | None = None  # per row, mirostat's state after this draw (None: no mirostat)


def apply_penalties(
    logits: Tensor,
    params: list[SamplingParams],
    prompt_ids: list[Sequence[int]],
    output_ids: list[Sequence[int]],
    dry_breakers: list[frozenset[int]] | None = None,
) -> Tensor:
    """Return penalized logits [B, V], with vLLM semantics.

    Repetition penalty over prompt + output tokens: positive logits are divided by it,
    negative ones multiplied. Then, over output tokens only,
    logit -= presence * [count > 0] + frequency * count. A row's `repeat_last_n` >= 0 narrows both
    to the last that many tokens of prompt + output.
    Works on flat indices (row * V + token) so that it touches only the penalized entries.
    Then DRY (layers/dry.py) over prompt + output tokens, with each row's sequence-breaker token ids.
    Returns `logits` itself when no row has any penalty (a copy of [B, V] costs more than a greedy
    step's argmax).
    """
    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    pf_rows = [i for i, p in enumerate(params) if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0]
    if not rep_rows and not pf_rows and not any(p.uses_dry for p in params):
        return logits
    rep_prompt, rep_output = _penalty_windows(params, prompt_ids, output_ids)
    out = logits.float().clone()  # [B, V]
    B, V = out.shape
    flat = out.view(-1)  # [B * V]
    device = out.device

    if rep_rows:
        seen = [(i, rep_prompt[i]) for i in rep_rows] + [(i, rep_output[i]) for i in rep_rows]
        idx = _flat_ids(seen, V, device).unique()
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
        vals = flat[idx]
        r = rep[idx // V]
        flat[idx] = torch.where(vals > 0, vals / r, vals * r)

    if pf_rows:
        idx, counts = _flat_ids([(i, rep_output[i]) for i in pf_rows], V, device).unique(return_counts=True)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
        row = idx // V
        flat[idx] -= presence[row] + frequency[row] * counts.float()

    for i, p in enumerate(params):
        if p.uses_dry:
            breakers = dry_breakers[i] if dry_breakers is not None else frozenset()
            penalties = dry_penalties(list(prompt_ids[i]) + list(output_ids[i]), p, breakers)
            penalties = {t: v for t, v in penalties.items() if t < V}
            if penalties:
                ids = torch.tensor(list(penalties), dtype=torch.long, device=device)
                out[i, ids] -= torch.tensor(list(penalties.values()), dtype=torch.float32, device=device)
    return out


def apply_token_mask(logits: Tensor, mask: TokenMask) -> None:
    """Set to -inf, in place, the logits [B, V] float32 of the tokens `mask` does not allow."""
    if not mask.rows:
        return
    B, V = logits.shape
    r = len(mask.rows)
    rows = torch.tensor(mask.rows, device=logits.device)
    # token t is bit t % 8 of byte t // 8 of the row (little-endian words); each byte looks up its 8
    # addends (0 where allowed, -inf where not): a gather of 32-byte rows, much faster than unpacking
    # bits into a boolean mask and filling by it
    as_bytes = mask.bits.contiguous().view(torch.uint8).reshape(-1).to(logits.device, torch.long)  # [r * words * 4]
    addend = _byte_addends(logits.device).index_select(0, as_bytes).view(r, -1)  # [r, words * 32]
    width = min(V, addend.shape[1])
    every_row = r == B and mask.rows == list(range(B))
    sub = logits if every_row else logits[rows]  # [r, V]
    sub[:, :width] += addend[:, :width]
    sub[:, width:] = float("-inf")
    if not every_row:
        logits[rows] = sub


_ADDENDS: dict[torch.device, Tensor] = {}


def _byte_addends(device: torch.device) -> Tensor:
    """[256, 8] float32: entry (b, k) is 0 if bit k of byte b is set, else -inf."""
    table = _ADDENDS.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1  # [256, 8]
        table = _ADDENDS[device] = torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf")).to(device)
    return table


def apply_constraints(logits: Tensor, params: list[SamplingParams], mask: TokenMask | None = None) -> Tensor:
    """Logits [B, V] float32 with the token mask, `allowed_token_ids` and `logit_bias` applied (vLLM's
    order: before the penalties). Returns `logits` itself when no row has any of them, else a new tensor."""
    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids]
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    if mask is None and not allowed and not biased:
        return logits
    out = logits.float().clone()
    B, V = out.shape
    if mask is not None:
        apply_token_mask(out, mask)
    for i in allowed:
        ids = torch.tensor([t for t in params[i].allowed_token_ids if t < V], dtype=torch.long, device=out.device)
        keep = torch.zeros(V, dtype=torch.bool, device=out.device)
        keep[ids] = True
        out[i].masked_fill_(~keep, float("-inf"))
    for i in biased:
        bias = params[i].logit_bias
        ids = torch.tensor([t for t in bias if t < V], dtype=torch.long, device=out.device)
        out[i, ids] += torch.tensor([bias[t] for t in bias if t < V], dtype=torch.float32, device=out.device)
    return out


def processed_probs(
    logits: Tensor,
    params: list[SamplingParams],
    prompt_ids: list[Sequence[int]],
    output_ids: list[Sequence[int]],
    mask: TokenMask | None = None,
    dry_breakers: list[frozenset[int]] | None = None,
    mirostat_mu: list[float | None] | None = None,
) -> Tensor:
    """The distribution [B, V] float32 that `sample` draws from; greedy rows are one-hot at the argmax.
    A row whose constraints allow no token is all zeros."""
    constrained = apply_constraints(logits, params, mask)
    penalized = apply_penalties(constrained, params, prompt_ids, output_ids, dry_breakers)  # [B, V]
    probs = torch.zeros_like(penalized)
    greedy, rand = _split(params)
    if greedy:
        rows = torch.tensor(greedy, device=probs.device)
        probs[rows, first_argmax(penalized[rows])] = 1.0
    if rand:
        probs = _put_rows(probs, rand, _filtered_probs(_take_rows(penalized, rand), [params[i] for i in rand],
                                                       _rows_of(mirostat_mu, rand)))
    if constrained is not logits:
        probs[penalized.amax(dim=-1) == float("-inf")] = 0.0
    return probs


def sample(
    logits: Tensor,
    params: list[SamplingParams],
    prompt_ids: list[Sequence[int]],
    output_ids: list[Sequence[int]],
    generators: list[torch.Generator | None],
    mask: TokenMask | None = None,
    dry_breakers: list[frozenset[int]] | None = None,
    mirostat_mu: list[float | None] | None = None,
) -> SamplerOutput:
    """Draw one token per row. Greedy rows take the argmax and never touch any generator. A row whose
    constraints (`mask`, allowed_token_ids) allow no token gets -1. `dry_breakers`: each row's DRY
    sequence-breaker token ids; `mirostat_mu`: each row's mirostat state (None: its starting value,
    2 * tau), whose next value comes back in the output."""
    logits = logits.float()
    constrained = apply_constraints(logits, params, mask)
    penalized = apply_penalties(constrained, params, prompt_ids, output_ids, dry_breakers)  # [B, V]
    token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy, rand = _split(params)
    if greedy:
        token_ids = _put_rows(token_ids, greedy, first_argmax(_take_rows(penalized, greedy)))
    new_mu = None
    if rand:
        probs = _filtered_probs(_take_rows(penalized, rand), [params[i] for i in rand], _rows_of(mirostat_mu, rand))
        drawn = sample_from_probs(probs, [generators[i] for i in rand])
        token_ids = _put_rows(token_ids, rand, drawn)
        new_mu = _next_mirostat_mu(probs, drawn, params, rand, mirostat_mu)
    if constrained is not logits:
        token_ids[penalized.amax(dim=-1) == float("-inf")] = -1

    # log-softmax over the vocabulary only for the rows that asked for logprobs (it costs as much as
    # the rest of sampling at batch 64); the others report 0.0
    chosen = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    top = None
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        raw_logprobs = torch.log_softmax(logits[rows], dim=-1)  # [b, V]
        chosen[rows] = raw_logprobs.gather(1, token_ids[rows, None].clamp(min=0)).squeeze(1)
        picked = _top_logprobs(raw_logprobs, [params[i] for i in wanted])
        if picked is not None:
            top = [[] for _ in params]
            for i, entry in zip(wanted, picked):
                top[i] = entry
    return SamplerOutput(token_ids, chosen, top, new_mu)


def first_argmax(t: Tensor) -> Tensor:
    """The index of each row's first maximum, as `argmax(dim=-1)`: torch's max reduction finds it
    in ~27 µs over a 49,152-token row where its argmax takes ~72 µs (a greedy step's whole sampling)."""
    return t.max(dim=-1).indices


def sample_from_probs(probs: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """Exact draw from each row of probs [B, V] by an exponential race: argmax(p / E), E ~ Exp(1).

    A row with a generator takes its noise only from it (so a seeded row is reproducible
    whatever else is in the batch); rows with None share the device's default generator.
    Generators are fastest on probs' device. Returns [B] long.
    """
    B, V = probs.shape
    noise = torch.empty(B, V, dtype=torch.float32, device=probs.device)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        draw = torch.empty(len(shared), V, device=probs.device).exponential_()  # [b, V]
        noise = _put_rows(noise, shared, draw)
    for i, g in enumerate(generators):
        if g is None:
            continue
        if g.device == noise.device:
            noise[i].exponential_(generator=g)
        else:  # e.g. a CPU generator for GPU logits: slower, same numbers
            noise[i] = torch.empty(V, device=g.device).exponential_(generator=g).to(noise.device)
    # E == 0 would turn zero-probability tokens into 0/0.
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return first_argmax(probs.float() / noise)


def _rows_of(values: list | None, rows: list[int]) -> list | None:
    return None if values is None else [values[i] for i in rows]


def _next_mirostat_mu(probs: Tensor, drawn: Tensor, params: list[SamplingParams], rows: list[int],
                      mirostat_mu: list[float | None] | None) -> list[float | None] | None:
    """Each row's mirostat state after its draw from probs [b, V] (the rows `rows` of the batch)."""
    using = [j for j, i in enumerate(rows) if params[i].uses_mirostat]
    if not using:
        return None
    out: list[float | None] = [None] * len(params)
    chosen = probs.gather(1, drawn[:, None]).squeeze(1).tolist()
    for j in using:
        i = rows[j]
        p = params[i]
        out[i] = mirostat_update(_mu(p, mirostat_mu, i), chosen[j], p.mirostat_tau, p.mirostat_eta)
    return out


def _mu(p: SamplingParams, mirostat_mu: list[float | None] | None, row: int) -> float:
    """Row's mirostat state; before its first draw, mirostat's starting value 2 * tau."""
    mu = mirostat_mu[row] if mirostat_mu is not None else None
    return 2 * p.mirostat_tau if mu is None else mu


def _split(params: list[SamplingParams]) -> tuple[list[int], list[int]]:
    """Row indices of the greedy and of the random rows."""
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    return greedy, [i for i, p in enumerate(params) if not p.is_greedy]


def _take_rows(t: Tensor, rows: list[int]) -> Tensor:
    if len(rows) == t.shape[0]:
        return t
    return t[torch.tensor(rows, device=t.device)]


def _put_rows(t: Tensor, rows: list[int], values: Tensor) -> Tensor:
    """t with t[rows] = values (t itself when rows are all of them)."""
    if len(rows) == t.shape[0]:
        return values
    t[torch.tensor(rows, device=t.device)] = values
    return t


def _filtered_probs(logits: Tensor, params: list[SamplingParams],
                    mirostat_mu: list[float | None] | None = None) -> Tensor:
    """Temperature, top-k, typical-p, top-p, min-p, XTC, mirostat on penalized logits [b, V] of
    non-greedy rows -> probs [b, V] (layers/truncation.py has the last three).

    top-k keeps every token >= the k-th largest value (ties at the boundary are all kept);
    top-p keeps the smallest prefix of the probabilities sorted descending, ties by lower
    token id, whose mass reaches top_p; min-p keeps p >= min_p * p_max.
    """
    b, V = logits.shape
    device = logits.device
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scaled = logits / temp[:, None]  # [b, V]

    top_k = [min(p.top_k, V) if p.top_k > 0 else 0 for p in params]
    if any(top_k):
        k = torch.tensor([kk or 1 for kk in top_k], device=device)
        kth = scaled.topk(max(top_k), dim=-1).values.gather(1, (k - 1)[:, None])  # [b, 1]
        kth = kth.masked_fill(torch.tensor(top_k, device=device)[:, None] == 0, float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))

    probs = scaled.softmax(dim=-1)  # [b, V]
    typical_rows = [i for i, p in enumerate(params) if p.typical_p < 1.0]
    if typical_rows:
        typical_p = torch.tensor([params[i].typical_p for i in typical_rows], dtype=torch.float32, device=device)
        typical = _take_rows(probs, typical_rows)
        typical = typical.masked_fill(typical_drop(typical, typical_p), 0.0)
        probs = _put_rows(probs, typical_rows, typical / typical.sum(dim=-1, keepdim=True))
    nucleus_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus_rows:
        top_p = torch.tensor([params[i].top_p for i in nucleus_rows], dtype=torch.float32, device=device)
        nucleus = _take_rows(probs, nucleus_rows)
        probs = _put_rows(probs, nucleus_rows, nucleus.masked_fill(_top_p_drop(nucleus, top_p), 0.0))

    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    # Always renormalized, so a row's probs do not depend on what other rows asked for.
    probs = probs / probs.sum(dim=-1, keepdim=True)

    xtc_rows = [i for i, p in enumerate(params) if p.xtc_probability > 0 and p.xtc_threshold <= 0.5]
    if xtc_rows:
        chance = torch.tensor([params[i].xtc_probability for i in xtc_rows], dtype=torch.float32, device=device)
        threshold = torch.tensor([params[i].xtc_threshold for i in xtc_rows], dtype=torch.float32, device=device)
        probs = _put_rows(probs, xtc_rows, xtc_mixture(_take_rows(probs, xtc_rows), chance, threshold))
    mirostat_rows = [i for i, p in enumerate(params) if p.uses_mirostat]
    if mirostat_rows:
        mu_t = torch.tensor([_mu(params[i], mirostat_mu, i) for i in mirostat_rows], dtype=torch.float32,
                            device=device)
        probs = _put_rows(probs, mirostat_rows, mirostat_truncate(_take_rows(probs, mirostat_rows), mu_t))
    return probs


def _top_p_drop(probs: Tensor, top_p: Tensor, candidates: int | None = None) -> Tensor:
    """Mask [b, V] of the tokens top-p removes, for probs [b, V] and top_p [b] < 1.

    Sorting the whole vocabulary is slow on CPU, and the nucleus is usually small: first try
    the `candidates` most likely tokens, and fully sort only the rows whose nucleus may reach
    past them. Which way a row goes depends only on that row.
    """
    b, V = probs.shape
    c = min(candidates or TOP_P_CANDIDATES, V)
    if c == V:
        vals, ids = probs.sort(dim=-1, descending=True, stable=True)  # [b, V], ties: lower id first
    else:
        vals, ids = probs.topk(c, dim=-1)  # [b, c]
        ids, order = ids.sort(dim=-1)
        vals, order = vals.gather(1, order).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, order)
    mass_before = vals.cumsum(dim=-1) - vals  # [b, c]
    keep = mass_before < top_p[:, None]
    keep[:, 0] = True
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(1, ids, ~keep)  # [b, V]

    if c < V:
        # Sure only if the nucleus closes before the tokens tied with the c-th one, some of
        # which topk may have left out.
        first_tied = (vals > vals[:, -1:]).sum(dim=-1, keepdim=True)  # [b, 1]
        unsure = mass_before.gather(1, first_tied).squeeze(1) < top_p  # [b]
        redo = unsure.nonzero().flatten()
        if redo.numel():
            drop[redo] = _top_p_drop(probs[redo], top_p[redo], candidates=V)
    return drop


def top_logprobs(logprobs: Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The k best (token id, logprob) of each row of [B, V], best first, ties by lower token id
    (also across the k-th place: every token tied with the k-th is a candidate)."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    k = min(k, logprobs.shape[-1])
    kth = logprobs.topk(k, dim=-1).values[:, -1:]  # [B, 1]
    rows, ids = (logprobs >= kth).nonzero(as_tuple=True)
    vals = logprobs[rows, ids]
    out: list[list[tuple[int, float]]] = [[] for _ in range(logprobs.shape[0])]
    for row, token, value in zip(rows.tolist(), ids.tolist(), vals.tolist()):
        out[row].append((token, value))
    return [sorted(pairs, key=lambda t: (-t[1], t[0]))[:k] for pairs in out]


def _top_logprobs(raw_logprobs: Tensor, params: list[SamplingParams]) -> list[list[tuple[int, float]]] | None:
    wanted = [p.logprobs for p in params]
    if all(w is None for w in wanted):
        return None
    best = top_logprobs(raw_logprobs, max(w or 0 for w in wanted))
    return [pairs[: w or 0] for pairs, w in zip(best, wanted)]


def _penalty_windows(params: list[SamplingParams], prompt_ids: list[Sequence[int]], output_ids: list[Sequence[int]]
                     ) -> tuple[list[Sequence[int]], list[Sequence[int]]]:
    """Each row's prompt and output tokens within its `repeat_last_n` window (all where it is -1)."""
    if all(p.repeat_last_n < 0 for p in params):
        return prompt_ids, output_ids
    prompts, outputs = list(prompt_ids), list(output_ids)
    for i, p in enumerate(params):
        n = p.repeat_last_n
        if n >= 0:
            out = list(outputs[i])[max(0, len(outputs[i]) - n):] if n else []
            rest = n - len(out)
            prompts[i] = list(prompts[i])[max(0, len(prompts[i]) - rest):] if rest > 0 else []
            outputs[i] = out
    return prompts, outputs


def _flat_ids(rows_ids: list[tuple[int, Sequence[int]]], V: int, device: torch.device) -> Tensor:
    """(row, token ids) pairs as flat indices row * V + id into a [B * V] view."""
    parts = [torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(device) + row * V for row, ids in rows_ids]
    return torch.cat(parts)
