"""A sequence: one stream of tokens (prompt + output) moving through the engine.

There is no prefill or decode state: like vLLM v1, a sequence has `num_computed_tokens` catching up
with `len(token_ids)`. A new prompt is far behind (prefill, maybe in chunks); a decoding sequence is
one behind (the token it just sampled). Preemption sets it back to zero; it catches up again.

Speculative drafts are not tokens of the sequence: they wait in `spec_token_ids` (vLLM v1's name)
for one step, computed after `token_ids`, until verification appends what it accepts.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .outputs import StreamDelta

if TYPE_CHECKING:
    from ..vision.inputs import ImageInput
    from .structured_output import GrammarMatcher


# A new sequence's guess at the fraction of drafts accepted, before it has verified any: high enough
# that speculation is tried at once; the moving average (weight ACCEPTANCE_SMOOTHING on the newest
# step) soon takes over.
INITIAL_ACCEPTANCE = 0.7
ACCEPTANCE_SMOOTHING = 0.2


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n outputs
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None  # None where no text is produced (scoring, drafts)
    generator: torch.Generator | None = None
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and the request's stop ids
    cache_salt: str | None = None  # shares prefix-cache blocks only with requests of the same salt
    lora_slot: int = 0  # the LoRA adapter's slot it runs with (0: none; lora/registry.py)
    lora_key: bytes | None = None  # that adapter's key, chained into its blocks' hashes (kv/block_pool.py)
    arrival_time: float = field(default_factory=time.perf_counter)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS, length)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache, first admission
    first_token_time: float | None = None
    finish_time: float | None = None
    pending_fork: int = 0  # siblings still to be forked off this sequence at its first sample (n > 1)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify in the next step
    draft_probs: torch.Tensor | None = None  # [num_draft, V] the distributions they were drawn from
    spec_proposed: int = 0
    spec_accepted: int = 0
    acceptance: float = INITIAL_ACCEPTANCE  # moving average of the fraction of drafts accepted
    grammar: "GrammarMatcher | None" = None  # where the output is in its grammar (structured output)
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token ids that must not be completed
    dry_breaker_ids: frozenset[int] = frozenset()  # DRY's sequence breakers, as token ids
    mirostat_mu: float | None = None  # mirostat's state (None: not drawn yet, or no mirostat)
    pooling: bool = False  # a pooling request's: computed whole in one step, then finished (nothing sampled)
    # batch-invariant mode: its prompt tokens take the prefill path; False for a short prompt, whose
    # tokens all take the decode path (layers/linear.py SHORT_PROMPT)
    prefill_path: bool = True
    # recurrent layers (kv/state_pool.py): the slot with the state after num_computed_tokens, and
    # while a step runs the (k, slot) it writes, the state after its first k tokens
    state_slot: int = 0
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    state_checkpoint_at: int = 0  # the token count whose state this step keeps for the prefix cache (0: none)
    state_src_log: tuple[int, int] = (-1, 0)  # state_slot's root and entries where it is logged
    state_log_after: int = 0  # saves past this k are logs (0: none)
    images: tuple["ImageInput", ...] = ()  # the prompt's images, by the positions of their soft tokens
    encoder_time_s: float = 0.0  # spent in the vision encoder on this sequence's images
    _rope_table: tuple | None = field(default=None, repr=False)  # vision.inputs.rope_table, () for none

    def rope_positions(self, start: int, end: int) -> torch.Tensor | None:
        """[3, end - start] M-RoPE positions of tokens start..end where the prompt's images have them
        (Qwen2.5-VL); None: plain positions, the tokens' indices."""
        if not self.images:
            return None
        from ..vision.inputs import rope_positions, rope_table
        if self._rope_table is None:  # computed once: the prompt's positions never change
            self._rope_table = rope_table(self.images, self.num_prompt_tokens) or ()
        return rope_positions(self._rope_table, self.num_prompt_tokens, start, end) if self._rope_table else None

    def fit_chunk(self, start: int, num_new: int) -> int:
        """The tokens from `start` a step may compute, given at most `num_new`: never part of an image's
        block, whose tokens attend to each other both ways (vision/inputs.py `fit_chunk`)."""
        if not self.images:
            return num_new
        from ..vision.inputs import fit_chunk
        return fit_chunk(self.images, start, num_new)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_draft(self) -> int:
        return len(self.spec_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """What a step computes up to: the tokens, then the drafts."""
        return len(self.token_ids) + len(self.spec_token_ids)

    def tokens_to_compute(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of token_ids followed by the drafts."""
        if end <= len(self.token_ids):
            return self.token_ids[start:end]
        return (self.token_ids + self.spec_token_ids)[start:end]

    def record_verification(self, proposed: int, accepted: int) -> None:
        self.spec_proposed += proposed
        self.spec_accepted += accepted
        self.acceptance += ACCEPTANCE_SMOOTHING * (accepted / proposed - self.acceptance)

    def drop_drafts(self, keep: int = 0) -> None:
        """Forget all but the first `keep` drafts (they were not verified, or did not fit a step)."""
        del self.spec_token_ids[keep:]
        if not self.spec_token_ids:
            self.draft_probs = None
        elif self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:keep]

    def append(self, tokens: list[int], logprobs: list[float], tops: list[list[tuple[int, float]]],
               max_model_len: int) -> StreamDelta:
        """Append tokens, stopping at the first that ends the sequence. The delta to stream; its
        `finish_reason`, if any, is the scheduler's to apply (`Scheduler.finish`)."""
        now = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = now
        want = self.params.logprobs is not None
        text, reason, kept = "", None, 0
        for token, lp, top in zip(tokens, logprobs, tops):
            self.token_ids.append(token)
            if self.grammar is not None and token not in self.stop_token_ids:
                self.grammar.accept(token)  # allowed by its mask; a matcher that failed fails the next mask
            kept += 1
            if want:
                self.logprobs.append(lp)
                self.top_logprobs.append(top)
            piece, reason = self._check_stop(token, max_model_len)
            text += piece
            if reason is not None:
                if self.detokenizer is not None and not self.detokenizer.stopped:
                    text += self.detokenizer.flush()
                break
        return StreamDelta(self.request_id, self.index, text, tokens[:kept], logprobs[:kept] if want else [],
                           tops[:kept] if want else [], reason)

    def _check_stop(self, token: int, max_model_len: int) -> tuple[str, str | None]:
        """The text this token adds to the output, and the finish reason if it ends the sequence."""
        params = self.params
        if token in self.stop_token_ids:
            if token in (params.stop_token_ids or ()):  # the model's own EOS leaves it None, as in vLLM
                self.stop_reason = token
            return "", "stop"
        text = self.detokenizer.push(token) if self.detokenizer is not None else ""
        if self.detokenizer is not None and self.detokenizer.stopped:
            self.stop_reason = self.detokenizer.stop_string
            return text, "stop"
        if self.grammar is not None and self.grammar.is_stopped and not self.grammar.is_error:
            return text, "stop"  # the grammar is complete: nothing but an end of sequence could follow
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return text, "length"
        if self.num_tokens >= max_model_len:
            return text, "length"
        return text, None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_prefill_path_tokens(self) -> int:
        """Its first tokens that take the prefill path in batch-invariant mode: the prompt, or none."""
        return self.num_prompt_tokens if self.prefill_path else 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
