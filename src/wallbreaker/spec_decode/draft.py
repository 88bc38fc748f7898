"""A draft model as proposer: a second, smaller model with a model runner and paged KV cache of its
own, kept in step with each target sequence (its tokens re-synced, its cache trimmed back past any
rejected drafts). Its sequences never queue: its own scheduler gives them room (`schedule_these`)
and takes each step's aftermath, as the target's does.

A constrained target's drafts are drawn under the same constraints (a copy of its grammar matcher
advancing on the drafts): q is then the masked distribution they came from, which keeps rejection
sampling exact, and drafts the grammar forbids are never proposed."""
from __future__ import annotations

import time

import torch

from ..engine.model_runner import ModelRunner
from ..engine.scheduler import Scheduler, StepOutput
from ..engine.sequence import Sequence
from ..engine.structured_output import StructuredOutputs
from ..errors import InvalidRequestError
from ..layers.sampler import processed_probs, sample_from_probs


# A seeded draft draws from its own stream, far from its target's (seed + index): the golden-ratio
# constant of hashing, so that no small seed or index makes the two meet.
DRAFT_SEED_OFFSET = 0x9E3779B1


class DraftProposer:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, structured: StructuredOutputs):
        """`structured`: the target's constraints (the vocabularies are the same, `check_vocabularies`)."""
        self.runner = runner
        self.scheduler = scheduler
        self.structured = structured
        self.seqs: dict[int, Sequence] = {}

    def forget_except(self, live_seq_ids: set[int]) -> None:
        """Free the draft cache of target sequences that ended (or were preempted)."""
        for seq_id in [s for s in self.seqs if s not in live_seq_ids]:
            self.scheduler.free(self.seqs.pop(seq_id))

    def backlog(self, target: Sequence) -> int:
        """Tokens of `target` the draft's cache does not hold yet."""
        d = self.seqs.get(target.seq_id)
        return target.num_tokens - (d.num_computed_tokens if d is not None else 0)

    def propose(self, targets: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None], float]:
        """K drafted tokens per target (fewer if the draft cache is full) and the distributions they
        were drawn from ([K, V] each). Also returns the seconds spent per draft step."""
        active = []
        for target, k in zip(targets, ks):
            if k > 0:
                active.append((self._sync(target), k))
        drafts: list[list[int]] = [[] for _ in targets]
        probs: list[list[torch.Tensor]] = [[] for _ in targets]
        index = {id(d): i for i, (d, _) in enumerate(active)}
        slot_of = [i for i, k in enumerate(ks) if k > 0]
        steps, start = 0, time.perf_counter()
        stuck: set[int] = set()  # drafts whose constraints allow no token: no more for them
        while True:
            wanted = []
            for d, k in active:
                i = slot_of[index[id(d)]]
                if not (len(drafts[i]) >= k or (drafts[i] == [] and steps > 0) or i in stuck):
                    wanted.append(d)
            batch = self.scheduler.schedule_these(wanted)  # one the draft's pool has no room for drafts nothing
            if not batch.seqs:
                break
            seqs, logits = self.runner.run(batch)
            self.scheduler.update_from_output(batch, StepOutput())
            q = processed_probs(logits, [d.params for d in seqs], [d.prompt_token_ids for d in seqs],
                                [d.output_token_ids for d in seqs], self.structured.step_mask(seqs))  # [B, V_draft]
            tokens = sample_from_probs(q, [d.generator for d in seqs]).tolist()
            alive = (q.sum(dim=-1) > 0).tolist()
            for row, (d, token) in enumerate(zip(seqs, tokens)):
                i = slot_of[index[id(d)]]
                if not alive[row]:
                    stuck.add(i)
                    continue
                drafts[i].append(token)
                probs[i].append(q[row])
                d.token_ids.append(token)
                if d.grammar is not None and not d.grammar.accept(token):
                    stuck.add(i)
            steps += 1
        per_step = (time.perf_counter() - start) / steps if steps else 0.0
        return drafts, [torch.stack(p) if p else None for p in probs], per_step

    def _sync(self, target: Sequence) -> Sequence:
        d = self.seqs.get(target.seq_id)
        if d is None:
            generator = None
            if target.params.seed is not None:
                generator = torch.Generator().manual_seed(target.params.seed + DRAFT_SEED_OFFSET + target.index)
            d = Sequence(target.seq_id, target.request_id, target.index, list(target.token_ids),
                         target.num_prompt_tokens, target.params, None, generator,
                         prefill_path=target.prefill_path)
            self.seqs[target.seq_id] = d
            return self._constrain(d, target)
        common = 0
        for a, b in zip(d.token_ids, target.token_ids):
            if a != b:
                break
            common += 1
        # never past the target's last token: its logits give the first draft. (A draft can hold it
        # already: it computed its own drafts, the target's token budget dropped them unverified,
        # and the target then drew the first one itself.)
        self.scheduler.rollback(d, min(d.num_computed_tokens, common, target.num_tokens - 1))
        d.token_ids = list(target.token_ids)
        return self._constrain(d, target)

    @staticmethod
    def _constrain(d: Sequence, target: Sequence) -> Sequence:
        """The draft starts from its target's place in the grammar (and shares its bad words)."""
        d.grammar = target.grammar.fork() if target.grammar is not None else None
        d.bad_words_ids = target.bad_words_ids
        return d


def check_vocabularies(target_tokenizer, draft_tokenizer) -> None:
    """Draft and target must name the same tokens the same way (a larger, padded embedding is fine)."""
    n = min(target_tokenizer.vocab_size, draft_tokenizer.vocab_size)
    same = target_tokenizer.vocab_size == draft_tokenizer.vocab_size and all(
        target_tokenizer.id_to_token(i) == draft_tokenizer.id_to_token(i) for i in range(n))
    if not same:
        raise InvalidRequestError(
            f"the draft model's vocabulary ({draft_tokenizer.vocab_size} tokens) differs from the target's "
            f"({target_tokenizer.vocab_size}); speculative decoding needs the same tokenizer")
