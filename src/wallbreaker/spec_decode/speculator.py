"""Speculation inside the engine loop: before each step, decoding sequences get K drafted tokens
(K chosen per sequence by the controller) in their `spec_token_ids`, computed after their tokens in
one target pass; the engine computes them and `verify_drafts` keeps what rejection.py accepts.

Under a constraint (a grammar, bad words) the target's distribution at each position is the
constrained one: masked by the grammar's state after the drafts before it. A draft the grammar
forbids has probability 0 there, so it and every draft after it are rejected, and the token drawn
in its place comes from the constrained residual; the matcher only ever advances on what is
accepted. Output under a constraint is the target's constrained distribution exactly, and greedy
output is the same with and without speculation."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from ..layers.sampler import TokenMask, processed_probs
from .adaptive import SpecLengthController
from .ngram import propose_ngram
from .rejection import verify

if TYPE_CHECKING:
    from ..engine.scheduler import ScheduledBatch
    from ..engine.sequence import Sequence
    from ..engine.structured_output import StructuredOutputs
    from .draft import DraftProposer


MAX_EXPLORE_BACKLOG = 32


class Speculator:
    def __init__(self, method: str, max_k: int, max_model_len: int, draft: "DraftProposer | None" = None,
                 adaptive: bool = True):
        if method not in ("ngram", "draft") or (method == "draft") != (draft is not None):
            raise ValueError("speculation needs method 'ngram', or 'draft' with a draft model")
        self.method = method
        self.draft = draft
        self.max_model_len = max_model_len
        self.controller = SpecLengthController(max_k, adaptive)
        self._step_k: list[int] = []

    def release_ended(self, running: list["Sequence"]) -> None:
        """The draft cache of sequences no longer running (finished, aborted, preempted) is freed."""
        if self.draft is not None:
            self.draft.forget_except({s.seq_id for s in running})

    def propose(self, running: list["Sequence"]) -> None:
        candidates, ks = [], []
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.pending_fork or seq.num_output_tokens == 0:
                continue
            if seq.params.uses_mirostat:  # its distribution depends on a state each draw changes
                continue
            room = self.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(self.controller.choose(seq.acceptance), room)
            if k and self.draft is not None and self.controller.best(seq.acceptance) == 0 \
                    and self.draft.backlog(seq) > MAX_EXPLORE_BACKLOG:
                k = 0  # exploring would first make the draft catch up on every token it skipped
            if k > 0:
                candidates.append(seq)
                ks.append(k)
        self._step_k = ks
        if not candidates:
            return
        if self.draft is None:
            drafts = [propose_ngram(seq.token_ids, k) for seq, k in zip(candidates, ks)]
            # a draft its grammar forbids would be rejected for sure: propose only what it allows
            drafts = [d[:seq.grammar.valid_prefix(d)] if seq.grammar is not None else d
                      for seq, d in zip(candidates, drafts)]
            probs = [None] * len(candidates)
        else:
            drafts, probs, per_step = self.draft.propose(candidates, ks)
            self.controller.record_draft_step(per_step)
        for seq, tokens, q in zip(candidates, drafts, probs):
            if tokens:
                seq.spec_token_ids = list(tokens)
                seq.draft_probs = q

    def verify_drafts(self, seq: "Sequence", logits: torch.Tensor,
                      structured: "StructuredOutputs | None" = None) -> list[int]:
        """What `seq` appends after a step that computed its K drafts: the drafts that rejection
        sampling keeps against the target's logits [1 + K, V], then the token the target adds (-1
        if its constraints allow none). `structured` masks each position by the constraints."""
        drafts = list(seq.spec_token_ids)
        mask = None
        if structured is not None:
            valid, mask = structured.draft_masks(seq, drafts)
            drafts = drafts[:valid + 1]  # past the first forbidden draft, nothing can be accepted
        k = len(drafts)
        outputs = seq.output_token_ids
        p = processed_probs(logits[:k + 1], [seq.params] * (k + 1), [seq.prompt_token_ids] * (k + 1),
                            [outputs + drafts[:j] for j in range(k + 1)], _first_rows(mask, k + 1),
                            [seq.dry_breaker_ids] * (k + 1))  # [K + 1, V]
        if mask is not None:
            alive = p.sum(dim=-1) > 0  # a position whose constraints allow no token ends the check before it
            if not alive[0]:
                return [-1]
            if not alive.all():
                k = int(alive.logical_not().nonzero()[0]) - 1
                drafts, p = drafts[:k], p[:k + 1]
        q = seq.draft_probs
        if q is not None:
            q = _fit_vocab(q[:k], p.shape[1])
        accepted, nxt = verify(p, q, drafts, seq.generator)
        return drafts[:accepted] + [nxt]

    def record_step(self, batch: "ScheduledBatch", seconds: float) -> None:
        width = max((1 + s.num_draft for s in batch.seqs), default=1)
        self.controller.record_step(width, seconds, width - 1)

    def stats(self) -> dict:
        chosen = Counter(self.controller.chosen)
        return {"spec_method": self.method, "spec_k_histogram": dict(sorted(chosen.items())),
                "spec_k_recent": list(self.controller.chosen)[-32:]}


def _first_rows(mask: "TokenMask | None", n: int) -> "TokenMask | None":
    """The mask of positions 0..n-1 (draft_masks covers the positions after each allowed draft)."""
    if mask is None:
        return None
    keep = [i for i, r in enumerate(mask.rows) if r < n]
    return TokenMask([mask.rows[i] for i in keep], mask.bits[keep])


def _fit_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft distributions over the target's vocabulary (padded embeddings may differ in size)."""
    if q.shape[1] >= vocab:
        return q[:, :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[1]))
