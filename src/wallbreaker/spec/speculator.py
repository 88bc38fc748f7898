"""Speculation inside the engine loop: before each step, decoding sequences get K drafted tokens
(K chosen per sequence by the controller) in their `spec_token_ids`, computed after their tokens in
one target pass; the engine then verifies them (spec/rejection.py)."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .adaptive import SpecLengthController
from .ngram import propose_ngram

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

    def record_step(self, batch: "ScheduledBatch", seconds: float) -> None:
        width = max((1 + s.num_draft for s in batch.seqs), default=1)
        self.controller.record_step(width, seconds, width - 1)

    def stats(self) -> dict:
        chosen = Counter(self.controller.chosen)
        return {"spec_method": self.method, "spec_k_histogram": dict(sorted(chosen.items())),
                "spec_k_recent": list(self.controller.chosen)[-32:]}
