"""The engine loop: schedule, run, sample, post-process. One step at a time, many requests at once."""
from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..errors import InvalidRequestError, WorkerFailedError
from ..formats.tokenizer import Tokenizer
from ..kv import BlockManager
from ..layers.sampler import sample, top_logprobs
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestOutput, StreamDelta
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence
from .structured_output import Grammar, GrammarError, GrammarMatcher, StructuredOutputs

logger = logging.getLogger("wallbreaker.engine")
MAX_CACHE_SALT_CHARS = 1024


class Speculation(Protocol):
    """What the engine asks of speculative decoding (spec_decode.Speculator, which `LLM` builds and
    which sits above the engine): drafts before a step, the tokens that verification keeps after it."""

    def propose(self, running: list[Sequence]) -> None: ...
    def verify_drafts(self, seq: Sequence, logits: torch.Tensor,
                      structured: StructuredOutputs | None = None) -> list[int]: ...
    def record_step(self, batch: ScheduledBatch, seconds: float) -> None: ...
    def release_ended(self, running: list[Sequence]) -> None: ...
    def stats(self) -> dict: ...


@dataclass
class StepFailure:
    """A model step failed on this request's sequence alone: the error, and the id that names it in
    the log (clients are told the id, never the error text)."""

    error_id: str
    error: Exception


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    grammar: Grammar | None = None  # the compiled `params.structured_outputs`
    bad_words_ids: list[list[int]] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    failure: StepFailure | None = None

    @property
    def finished(self) -> bool:
        if self.failure is not None:
            return all(s.is_finished for s in self.seqs)
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, block_manager: BlockManager,
                 scheduler: Scheduler, max_model_len: int, eos_token_ids: frozenset[int],
                 speculator: Speculation | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.speculator = speculator
        self.vocab_limit = runner.vocab_limit or runner.model.config.vocab_size
        self.structured = StructuredOutputs(tokenizer, eos_token_ids)
        self._unexplained_failures = 0  # failed steps in a row in which no sequence failed alone
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                         "prefill_time_s": 0.0, "decode_time_s": 0.0, "prefill_tokens": 0, "decode_tokens": 0,
                         "spec_proposed": 0, "spec_accepted": 0, "spec_verify_steps": 0}

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    grammar: Grammar | None = None) -> str:
        """Queue a request. Everything a step will read is checked here, so that one request's bad
        input is its own error and never reaches a step that other requests share. A request with
        `structured_outputs` takes its compiled `grammar` (`structured.compile`, which the server
        runs off the engine thread), or has it compiled here."""
        self.check_request(prompt_token_ids, params, cache_salt)
        request_id = request_id if request_id is not None else str(next(self._request_ids))
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        spec = params.structured_outputs
        if spec is not None and (grammar is None or grammar.key != spec.key):
            grammar = self.structured.compile(spec)
        request = Request(request_id, prompt, list(prompt_token_ids), params, cache_salt,
                          grammar if spec is not None else None, self.structured.bad_words_ids(params.bad_words))
        seq = self._new_sequence(request, 0, list(prompt_token_ids),
                                 request.grammar.matcher() if request.grammar is not None else None)
        seq.pending_fork = params.n - 1
        self.requests[request_id] = request
        self.scheduler.add(seq)
        self.counters["prompt_tokens"] += len(prompt_token_ids)
        return request_id

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None) -> None:
        """Raises `InvalidRequestError` for a request the engine must not run."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty" if isinstance(prompt_token_ids, list)
                                      else "the prompt's token ids must be a list")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {n} tokens but the context holds "
                                      f"{self.max_model_len} (max_model_len); nothing would fit after it")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"max_tokens {params.max_tokens} with a prompt of {n} tokens needs {n + params.max_tokens} "
                f"tokens, more than the context holds ({self.max_model_len}, max_model_len)")
        self.check_token_ids(prompt_token_ids)
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= self.vocab_limit), None)
            if bad is not None:
                raise InvalidRequestError(f"{name} names token id {bad}, outside the vocabulary (0..{self.vocab_limit - 1})")
        if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters")

    def check_token_ids(self, token_ids: list[int]) -> None:
        limit = self.vocab_limit
        for t in token_ids:
            if type(t) is not int or not 0 <= t < limit:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary (0..{limit - 1})")

    def _new_sequence(self, request: Request, index: int, token_ids: list[int],
                      grammar: GrammarMatcher | None = None) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed + index)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop or [],
                                       params.include_stop_str_in_output)
        stops = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seq = Sequence(next(self._seq_ids), request.request_id, index, token_ids, len(request.prompt_token_ids),
                       params, detok, generator, stop_token_ids=stops, cache_salt=request.cache_salt,
                       arrival_time=request.arrival_time)
        seq.grammar = grammar
        seq.bad_words_ids = request.bad_words_ids
        request.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request now; its KV blocks go back to the pool at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        if self.speculator is not None:
            self.speculator.release_ended(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        start = time.perf_counter()
        try:
            sampling_seqs, logits = self.forward(batch)
        except WorkerFailedError:
            raise
        except Exception as error:
            return self._isolate(batch, error)
        self._unexplained_failures = 0
        run_time = time.perf_counter() - start
        plain, verifying, row = [], [], 0
        for seq in sampling_seqs:
            if seq.num_draft:
                verifying.append((seq, logits[row:row + 1 + seq.num_draft]))
            else:
                plain.append((seq, row))
            row += 1 + seq.num_draft
        deltas = self._sample_and_append(self._expand_forks(plain), logits) if plain else []
        for seq, rows in verifying:
            if not seq.is_finished:  # (a sibling's failure ends it)
                deltas += self._verify_and_append(seq, rows)
        decode_only = all(n == 1 + s.num_draft for s, n in zip(batch.seqs, batch.num_new_tokens))
        if self.speculator is not None:
            if decode_only:
                self.speculator.record_step(batch, run_time)
            self.speculator.release_ended(self.scheduler.running)
        for seq in self.scheduler.running:  # verified, or not scheduled: either way done with
            seq.drop_drafts()
        elapsed = time.perf_counter() - start
        phase = "decode" if decode_only else "prefill"
        self.counters[f"{phase}_time_s"] += elapsed
        self.counters[f"{phase}_tokens"] += batch.num_tokens
        self.counters["steps"] += 1
        return deltas

    def forward(self, batch: ScheduledBatch, all_logits: bool = False,
                commit: bool = True) -> tuple[list[Sequence], torch.Tensor]:
        """The one way a batch goes through the model: its K/V written, then its tokens committed
        (full blocks offered to the prefix cache); drafts stay uncommitted until verified. The
        sequences that caught up and their logits rows (see `ModelRunner.run`)."""
        seqs, logits = self.runner.run(batch, all_logits)
        if commit:
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                if not seq.num_draft:
                    self.block_manager.commit(seq, n)
        return seqs, logits

    def _isolate(self, batch: ScheduledBatch, error: Exception) -> list[StreamDelta]:
        """A step failed. Each of its sequences runs again alone: one that fails by itself ends its
        request with finish_reason "error"; the others lose nothing. Nothing was committed, so the
        next step simply redoes their work; writing the same K/V into the same slots is harmless,
        and the copy-on-write copies are redone first in case the failure came before them."""
        logger.warning("a model step of %d sequences failed (%s: %s); running them one by one",
                       len(batch), type(error).__name__, error)
        self.runner.kv_cache.copy_blocks(batch.copies)
        deltas: list[StreamDelta] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished:
                continue
            try:
                self.forward(ScheduledBatch([seq], [n]), commit=False)
            except WorkerFailedError:
                raise
            except Exception as e:
                deltas += self._fail_request(seq.request_id, e)
        for seq in batch.seqs + self.scheduler.running:
            seq.drop_drafts()
        for seq in batch.seqs:
            if not seq.is_finished:
                self.block_manager.trim(seq, seq.num_computed_tokens)
        self._unexplained_failures = 0 if deltas else self._unexplained_failures + 1
        if self._unexplained_failures >= 2:  # fails together, never alone: not one request's fault
            raise error
        return deltas

    def _fail_request(self, request_id: str, error: Exception) -> list[StreamDelta]:
        request = self.requests[request_id]
        request.failure = StepFailure(uuid.uuid4().hex[:16], error)
        logger.error("request %s failed in a model step (error id %s)", request_id, request.failure.error_id,
                     exc_info=error)
        deltas = []
        for seq in request.seqs:
            seq.pending_fork = 0
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
                deltas.append(StreamDelta(request_id, seq.index, "", [], [], [], "error"))
        return deltas

    def _expand_forks(self, seqs: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """(sequence, logits row) pairs. A request with n > 1 runs its prompt once; at its first sample
        the sequence forks into n that share the prompt's blocks and sample from the same logits."""
        rows = []
        for seq, row in seqs:
            rows.append((seq, row))
            if seq.pending_fork:
                request = self.requests[seq.request_id]
                for k in range(seq.pending_fork):
                    child = self._new_sequence(request, len(request.seqs), list(seq.token_ids),
                                               seq.grammar.fork() if seq.grammar is not None else None)
                    self.block_manager.fork(seq, child)
                    self.scheduler.admit_running(child)
                    rows.append((child, row))
                seq.pending_fork = 0
        return rows

    def _sample_and_append(self, rows: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[StreamDelta]:
        seqs = [s for s, _ in rows]
        index = torch.tensor([r for _, r in rows])
        out = sample(logits[index], [s.params for s in seqs], [s.prompt_token_ids for s in seqs],
                     [s.output_token_ids for s in seqs], [s.generator for s in seqs], self.structured.step_mask(seqs))
        tokens = out.token_ids.tolist()
        chosen_logprobs = out.logprobs.tolist()
        deltas = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.is_finished:  # its request failed a moment ago, on a sibling
                continue
            if token < 0:
                deltas += self._fail_request(seq.request_id, self._no_token_allowed(seq))
                continue
            top = out.top_logprobs[i] if out.top_logprobs is not None else []
            deltas.append(self._emit(seq, [token], [chosen_logprobs[i]], [top]))
        return deltas

    @staticmethod
    def _no_token_allowed(seq: Sequence) -> Exception:
        if seq.grammar is not None and seq.grammar.is_error:
            return GrammarError(f"the grammar failed at output token {seq.num_output_tokens}: {seq.grammar.error}")
        return InvalidRequestError(f"the constraints allow no token at output token {seq.num_output_tokens} "
                                   "(structured_outputs, allowed_token_ids and bad_words together)")

    def _verify_and_append(self, seq: Sequence, logits: torch.Tensor) -> list[StreamDelta]:
        """Append what verification keeps of the drafts riding on `seq` (target logits [1 + K, V])."""
        k = seq.num_draft
        tokens = self.speculator.verify_drafts(seq, logits, self.structured)  # accepted drafts, the target's token
        if tokens[-1] < 0:  # no token allowed where the target's token would go
            return self._fail_request(seq.request_id, self._no_token_allowed(seq))
        accepted = len(tokens) - 1
        raw = torch.log_softmax(logits.float(), dim=-1)  # [K + 1, V]
        logprobs = [float(raw[j, t]) for j, t in enumerate(tokens)]
        tops = top_logprobs(raw[:len(tokens)], seq.params.logprobs or 0)
        seq.record_verification(k, accepted)
        self.counters["spec_proposed"] += k
        self.counters["spec_accepted"] += accepted
        self.counters["spec_verify_steps"] += 1
        computed = seq.num_computed_tokens + 1 + accepted
        delta = self._emit(seq, tokens, logprobs, tops)
        if not seq.is_finished:  # keep the K/V of what was accepted; release the rejected slots
            self.block_manager.commit(seq, computed - seq.num_computed_tokens)
            self.block_manager.trim(seq, computed)
        return [delta]

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[float],
              tops: list[list[tuple[int, float]]]) -> StreamDelta:
        """Append tokens to a sequence, stopping at the first that ends it; the delta to stream."""
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        want = seq.params.logprobs is not None
        text, reason, kept = "", None, 0
        for token, lp, top in zip(tokens, logprobs, tops):
            seq.token_ids.append(token)
            if seq.grammar is not None and token not in seq.stop_token_ids:
                seq.grammar.accept(token)  # allowed by its mask; a matcher that failed fails the next mask
            kept += 1
            if want:
                seq.logprobs.append(lp)
                seq.top_logprobs.append(top)
            self.counters["generation_tokens"] += 1
            piece, reason = self._check_stop(seq, token)
            text += piece
            if reason is not None:
                if not seq.detokenizer.stopped:
                    text += seq.detokenizer.flush()
                self.scheduler.finish(seq, reason)
                break
        return StreamDelta(seq.request_id, seq.index, text, tokens[:kept], logprobs[:kept] if want else [],
                           tops[:kept] if want else [], reason)

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str, str | None]:
        """The text this token adds to the output, and the finish reason if it ends the sequence."""
        params = seq.params
        if token in seq.stop_token_ids:
            if token in (params.stop_token_ids or ()):  # the model's own EOS leaves it None, as in vLLM
                seq.stop_reason = token
            return "", "stop"
        text = seq.detokenizer.push(token)
        if seq.detokenizer.stopped:
            seq.stop_reason = seq.detokenizer.stop_string
            return text, "stop"
        if seq.grammar is not None and seq.grammar.is_stopped and not seq.grammar.is_error:
            return text, "stop"  # the grammar is complete: nothing but an end of sequence could follow
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return text, "length"
        if seq.num_tokens >= self.max_model_len:
            return text, "length"
        return text, None

    # -- results -------------------------------------------------------------------------------
    def request_output(self, request_id: str) -> RequestOutput:
        request = self.requests[request_id]
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            want_logprobs = seq.params.logprobs is not None
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.detokenizer.text(), token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                cumulative_logprob=float(sum(seq.logprobs)),
                logprobs=list(seq.logprobs) if want_logprobs else None,
                top_logprobs=list(seq.top_logprobs) if want_logprobs else None))
        return RequestOutput(request_id, request.prompt, request.prompt_token_ids, outputs, request.finished,
                             self._metrics(request))

    def pop_finished(self, request_id: str) -> RequestOutput:
        output = self.request_output(request_id)
        del self.requests[request_id]
        return output

    def _metrics(self, request: Request) -> dict:
        seqs = request.seqs
        first = min((s.first_token_time for s in seqs if s.first_token_time is not None), default=None)
        last = max((s.finish_time for s in seqs if s.finish_time is not None), default=None)
        generated = sum(s.num_output_tokens for s in seqs)
        metrics = {"num_prompt_tokens": len(request.prompt_token_ids), "num_generated_tokens": generated,
                   "num_cached_prompt_tokens": seqs[0].num_cached_tokens if seqs else 0}
        proposed = sum(s.spec_proposed for s in seqs)
        if proposed:
            accepted = sum(s.spec_accepted for s in seqs)
            metrics.update(spec_proposed_tokens=proposed, spec_accepted_tokens=accepted,
                           spec_acceptance_rate=accepted / proposed)
        if first is not None:
            metrics["ttft_s"] = first - request.arrival_time
        if first is not None and last is not None:
            metrics["e2e_s"] = last - request.arrival_time
            decode_tokens = generated - len(seqs)
            metrics["decode_tokens_per_s"] = decode_tokens / (last - first) if last > first and decode_tokens > 0 else 0.0
        return metrics

    def live_stats(self) -> dict:
        """The few counts a server publishes after every step; O(1), unlike `stats`."""
        proposed = self.counters["spec_proposed"]
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_blocks_used": self.block_manager.pool.num_used, "kv_blocks_total": self.block_manager.pool.num_blocks,
                "spec_acceptance_rate": self.counters["spec_accepted"] / proposed if proposed else 0.0}

    def stats(self) -> dict:
        pool = self.block_manager.pool
        bs = self.block_manager.block_size
        filled: dict[int, int] = {}
        live = [s for s in self.scheduler.running]
        for seq in live:
            for i, block_id in enumerate(seq.block_table):
                filled[block_id] = max(filled.get(block_id, 0), min(bs, max(seq.num_computed_tokens - i * bs, 0)))
        slots = len(filled) * bs
        stored = sum(filled.values())
        return {
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free,
            "kv_block_size": bs,
            "kv_tokens_stored": stored,
            "kv_waste_fraction": 1.0 - stored / slots if slots else 0.0,
            "prefix_cache_queries": pool.prefix_queries,
            "prefix_cache_hits": pool.prefix_hits,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "spec_acceptance_rate": (self.counters["spec_accepted"] / self.counters["spec_proposed"]
                                     if self.counters["spec_proposed"] else 0.0),
            "spec_mean_accepted_length": (self.counters["spec_accepted"] / self.counters["spec_verify_steps"]
                                          if self.counters["spec_verify_steps"] else 0.0),
            **(self.speculator.stats() if self.speculator else {}),
            **self.counters,
        }
