"""Speculation inside the engine loop: before each step, decoding sequences get K drafted tokens
(K chosen per sequence by the controller) in their `spec_token_ids`, computed after their tokens in
one target pass; the engine computes them and `verify_drafts` keeps what rejection.py accepts."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from ..layers.sampler import processed_probs
from .adaptive import SpecLengthController
from .ngram import propose_ngram
from .rejection import verify

if TYPE_CHECKING:
    from ..engine.scheduler import ScheduledBatch
    from ..engine.sequence import Sequence
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
            probs = [None] * len(candidates)
        else:
            drafts, probs, per_step = self.draft.propose(candidates, ks)
            self.controller.record_draft_step(per_step)
        for seq, tokens, q in zip(candidates, drafts, probs):
            if tokens:
                seq.spec_token_ids = list(tokens)
                seq.draft_probs = q

    def verify_drafts(self, seq: "Sequence", logits: torch.Tensor) -> list[int]:
        """What `seq` appends after a step that computed its K drafts: the drafts that rejection
        sampling keeps against the target's logits [1 + K, V], then the token the target adds."""
        drafts = list(seq.spec_token_ids)
        k = len(drafts)
        outputs = seq.output_token_ids
        p = processed_probs(logits, [seq.params] * (k + 1), [seq.prompt_token_ids] * (k + 1),
                            [outputs + drafts[:j] for j in range(k + 1)])  # [K + 1, V]
        q = seq.draft_probs
        if q is not None:
            q = _fit_vocab(q, p.shape[1])
        accepted, nxt = verify(p, q, drafts, seq.generator)
        return drafts[:accepted] + [nxt]

    def record_step(self, batch: "ScheduledBatch", seconds: float) -> None:
        width = max((1 + s.num_draft for s in batch.seqs), default=1)
        self.controller.record_step(width, seconds, width - 1)

    def stats(self) -> dict:
        chosen = Counter(self.controller.chosen)
        return {"spec_method": self.method, "spec_k_histogram": dict(sorted(chosen.items())),
                "spec_k_recent": list(self.controller.chosen)[-32:]}


def _fit_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft distributions over the target's vocabulary (padded embeddings may differ in size)."""
    if q.shape[1] >= vocab:
        return q[:, :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[1]))
