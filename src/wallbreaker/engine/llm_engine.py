"""The engine loop: schedule, run, sample, post-process. One step at a time, many requests at once."""
from __future__ import annotations

import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import PoolingConfig
from ..errors import InvalidRequestError, WorkerFailedError
from ..text.tokenizer import Tokenizer
from ..kv.sessions import SessionInfo, SessionStore
from ..layers.dry import DryBreakers
from ..layers.linear import SHORT_PROMPT
from ..layers.sampler import sample, top_logprobs
from ..lora.registry import LoadedAdapter, LoRARegistry
from ..lora.request import LoRARequest
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .client import EngineRequest, StepResult
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestOutput, StepFailure
from .scheduler import Append, ScheduledBatch, Scheduler, StepOutput
from .sequence import Sequence
from .structured_output import Grammar, GrammarError, GrammarMatcher, StructuredOutputs
from .threads import ThreadGovernor, using_threads

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
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    grammar: Grammar | None = None  # the compiled `params.structured_outputs`
    bad_words_ids: list[list[int]] = field(default_factory=list)
    dry_breaker_ids: frozenset[int] = frozenset()
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.perf_counter)
    failure: StepFailure | None = None
    pooled: torch.Tensor | None = None  # a pooling request's vector, once computed
    saved_prefix: bool = False  # EngineRequest.saved_prefix
    images: tuple = ()  # vision.inputs.ImageInput of the prompt's images
    lora_slot: int = 0  # its LoRA adapter's slot and key (lora/registry.py); 0, None: the base model
    lora_key: bytes | None = None

    @property
    def finished(self) -> bool:
        if self.failure is not None:
            return all(s.is_finished for s in self.seqs)
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


class LLMEngine:
    """The engine behind its door (engine/client.py): requests in, a step at a time, outputs out.
    Everything between the scheduler's two calls of a step (sampling, verifying drafts, forking
    n > 1) is decided here; the scheduler applies it (`Scheduler.update_from_output`)."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, scheduler: Scheduler,
                 eos_token_ids: frozenset[int], structured: StructuredOutputs | None = None,
                 speculator: Speculation | None = None, governor: ThreadGovernor | None = None,
                 sessions: SessionStore | None = None):
        """`structured`: the constraints' compiler and masks (made from the tokenizer where not given;
        a draft model shares its target's). `governor`: picks each decode step's thread count
        (engine/threads.py); None leaves torch's as it is."""
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = scheduler.max_model_len
        self.eos_token_ids = eos_token_ids
        self.speculator = speculator
        self.governor = governor
        self.sessions = sessions  # saved sessions (kv/sessions.py); None: not available (tensor parallelism)
        self.vocab_limit = runner.vocab_limit
        self.structured = structured or StructuredOutputs(tokenizer, eos_token_ids)
        self.dry_breakers = DryBreakers(tokenizer)
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._unexplained_failures = 0  # failed steps in a row in which no sequence failed alone
        self.loras: LoRARegistry | None = None  # `enable_lora`
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0,
                         "prefill_time_s": 0.0, "decode_time_s": 0.0, "prefill_tokens": 0, "decode_tokens": 0,
                         "spec_proposed": 0, "spec_accepted": 0, "spec_verify_steps": 0}

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> str:
        """Queue a request; its id (a fresh one where it has none). Everything a step will read is
        checked here, so that one request's bad input is its own error and never reaches a step that
        other requests share. A request with `structured_outputs` takes its compiled `grammar`
        (`compile_grammar`, which the server runs off the engine thread), or has it compiled here."""
        params = request.params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request.pooling is not None:
            return self._add_pooling_request(request)
        if not getattr(self.runner.model, "can_generate", True):
            raise InvalidRequestError("this model cannot generate text: it is an encoder that only pools "
                                      "(use embeddings, score or rerank)")
        self.check_prompt(request.prompt_token_ids, params.max_tokens)
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= self.vocab_limit), None)
            if bad is not None:
                raise InvalidRequestError(f"{name} names token id {bad}, outside the vocabulary (0..{self.vocab_limit - 1})")
        salt = request.cache_salt
        if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters")
        request_id = request.request_id if request.request_id is not None else str(next(self._request_ids))
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        spec = params.structured_outputs
        grammar = request.grammar
        if spec is not None and (grammar is None or grammar.key != spec.key):
            grammar = self.structured.compile(spec)
        prompt_ids = list(request.prompt_token_ids)
        images = self.check_images(request.images, prompt_ids)
        adapter = self.resolve_lora(request.lora_request)
        state = Request(request_id, request.prompt, prompt_ids, params, salt, grammar if spec is not None else None,
                        self.structured.bad_words_ids(params.bad_words),
                        self.dry_breakers.ids(params.dry_sequence_breakers) if params.uses_dry else frozenset(),
                        images=images, saved_prefix=request.saved_prefix,
                        lora_slot=adapter.slot if adapter else 0, lora_key=adapter.key if adapter else None)
        seq = self._new_sequence(state, 0, list(prompt_ids),
                                 state.grammar.matcher() if state.grammar is not None else None, params.n - 1)
        self._requests[request_id] = state
        self.scheduler.add(seq)
        self.counters["prompt_tokens"] += len(prompt_ids)
        return request_id

    # -- LoRA adapters ------------------------------------------------------------------------------
    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        """Let requests run with LoRA adapters, up to `max_loras` loaded at once (lora/registry.py)."""
        def in_use(slot: int) -> bool:
            return any(s.lora_slot == slot for r in self._requests.values() for s in r.seqs if not s.is_finished)
        self.loras = LoRARegistry(self.runner.model, max_loras, max_lora_rank, in_use)

    def _registry(self) -> LoRARegistry:
        if self.loras is None:
            raise InvalidRequestError("LoRA adapters are not enabled for this model (enable_lora)")
        return self.loras

    def resolve_lora(self, request: LoRARequest | None) -> LoadedAdapter | None:
        """The loaded adapter a request runs with (None: the base model), loaded now if need be."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        return self._registry().resolve(request)

    def load_lora_adapter(self, name: str, path: str) -> None:
        self._registry().load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        self._registry().unload(name)

    def lora_adapters(self) -> list[str]:
        return [] if self.loras is None else list(self.loras.adapters)

    def _add_pooling_request(self, request: EngineRequest) -> str:
        """A prompt run once, whole, for its pooled vector: one sequence that the step computing it
        finishes (its pages freed in that step); nothing is sampled."""
        self.check_pooling(request.pooling.task)
        if request.lora_request is not None:
            raise InvalidRequestError("LoRA adapters apply to generation, not to pooling requests")
        self.check_pooling_prompt(request.prompt_token_ids)
        request_id = request.request_id if request.request_id is not None else str(next(self._request_ids))
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = list(request.prompt_token_ids)
        state = Request(request_id, request.prompt, prompt_ids, SamplingParams(max_tokens=1))
        seq = Sequence(next(self._seq_ids), request_id, 0, list(prompt_ids), len(prompt_ids), state.params, None,
                       arrival_time=state.arrival_time, pooling=True)
        state.seqs.append(seq)
        self._requests[request_id] = state
        self.scheduler.add(seq)
        self.counters["prompt_tokens"] += len(prompt_ids)
        return request_id

    @property
    def pooling_config(self) -> PoolingConfig | None:
        """The model's `PoolingConfig`, or None where it only generates."""
        pooler = getattr(self.runner.model, "pooler", None)
        return None if pooler is None else pooler.config

    def check_pooling(self, task: str) -> None:
        """Raises `InvalidRequestError` unless the model pools for `task` ("embed" or "score")."""
        config = self.pooling_config
        if config is None:
            raise InvalidRequestError("this model cannot pool: it is a generation model without a pooling config "
                                      "(an embedding model ships sentence-transformers' modules.json and "
                                      "1_Pooling/config.json, or a GGUF bert.pooling_type)")
        if config.task != task:
            what = {"embed": "an embedding model", "score": "a cross-encoder (it scores pairs)"}[config.task]
            raise InvalidRequestError(f"this model is {what}; it does not serve '{task}' requests")

    def check_pooling_prompt(self, token_ids: list[int]) -> None:
        """A pooling prompt may fill the whole context (no token is left to generate)."""
        if not isinstance(token_ids, list) or not token_ids:
            raise InvalidRequestError("the input is empty" if isinstance(token_ids, list)
                                      else "the input's token ids must be a list")
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(f"the input has {len(token_ids)} tokens, more than this model's limit of "
                                      f"{self.max_model_len} tokens (max_model_len); shorten it or ask for "
                                      f"truncation with truncate_prompt_tokens")
        self.check_token_ids(token_ids)

    def check_prompt(self, token_ids: list[int], max_tokens: int | None = None) -> None:
        """Raises `InvalidRequestError` (its `param` naming the field at fault) for a prompt the engine
        cannot run: empty, past the context, or with ids outside the vocabulary. Reads only facts
        fixed at construction, so any thread may call it."""
        if not isinstance(token_ids, list) or not token_ids:
            raise InvalidRequestError("the prompt is empty" if isinstance(token_ids, list)
                                      else "the prompt's token ids must be a list")
        n, context = len(token_ids), self.max_model_len
        if n >= context:
            raise InvalidRequestError(f"the prompt has {n} tokens; this model's context (max_model_len {context}) "
                                      f"takes at most {context - 1} prompt tokens (one must be left to generate)")
        if max_tokens is not None and n + max_tokens > context:
            raise InvalidRequestError(f"max_tokens {max_tokens} with a prompt of {n} tokens needs {n + max_tokens} "
                                      f"tokens, more than this model's context holds (max_model_len {context})",
                                      param="max_tokens")
        self.check_token_ids(token_ids)

    def check_images(self, images, token_ids: list[int]) -> tuple:
        """The request's images, checked: a model that takes them, and each image's soft tokens
        within the prompt, in order, apart."""
        images = tuple(images or ())
        if not images:
            return images
        if self.runner.vision is None:
            raise InvalidRequestError("this model does not take images (it has no vision encoder)", param="messages")
        last = 0
        for image in images:
            if not last <= image.offset < image.end <= len(token_ids) - 1:
                raise InvalidRequestError("an image's tokens must lie within the prompt, in order", param="messages")
            last = image.end
        return images

    def check_token_ids(self, token_ids: list[int]) -> None:
        limit = self.vocab_limit
        for t in token_ids:
            if type(t) is not int or not 0 <= t < limit:
                raise InvalidRequestError(f"token id {t!r} is outside the vocabulary (0..{limit - 1})")

    def cached_grammar(self, spec: StructuredOutputsParams) -> Grammar | None:
        return self.structured.cached(spec)

    def compile_grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """`spec` compiled (`GrammarError` if it is invalid); safe off the engine thread."""
        return self.structured.compile(spec)

    def _new_sequence(self, request: Request, index: int, token_ids: list[int],
                      grammar: GrammarMatcher | None = None, pending_fork: int = 0) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed + index)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop or [],
                                       params.include_stop_str_in_output, params.skip_special_tokens)
        stops = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seq = Sequence(next(self._seq_ids), request.request_id, index, token_ids, len(request.prompt_token_ids),
                       params, detok, generator, stop_token_ids=stops, cache_salt=request.cache_salt,
                       lora_slot=request.lora_slot, lora_key=request.lora_key,
                       arrival_time=request.arrival_time, pending_fork=pending_fork, grammar=grammar,
                       bad_words_ids=request.bad_words_ids, dry_breaker_ids=request.dry_breaker_ids,
                       images=request.images,
                       prefill_path=len(request.prompt_token_ids) > SHORT_PROMPT or request.saved_prefix
                       or bool(request.images))
        request.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request now and forget it; its KV blocks go back to the pool at once."""
        request = self._requests.pop(request_id, None)
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
    def step(self) -> StepResult:
        """Schedule, run the model, decide what each sequence appends, and let the scheduler apply it.
        Requests that finished in this step come back whole, and are forgotten."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return StepResult([], [])
        decode_only = all(n == 1 + s.num_draft for s, n in zip(batch.seqs, batch.num_new_tokens))
        threads = self.governor.threads(decode_only) if self.governor is not None else None
        with using_threads(threads):  # the whole step: sampling forks and joins too
            start = time.perf_counter()
            try:
                sampling_seqs, logits, pooled = self.runner.run_step(batch)
            except WorkerFailedError:
                raise
            except Exception as error:
                output = self._isolate(batch, error)
            else:
                self._unexplained_failures = 0
                if decode_only and self.speculator is not None:
                    self.speculator.record_step(batch, time.perf_counter() - start)
                output = self._decide(sampling_seqs, logits)
                for seq, vector in pooled:
                    self._requests[seq.request_id].pooled = vector
                    output.pooled.append(seq)
            deltas = self.scheduler.update_from_output(batch, output)
        if decode_only and output.computed and self.governor is not None:
            self.governor.record(time.perf_counter() - start)
        if self.speculator is not None:
            self.speculator.release_ended(self.scheduler.running)
        elapsed = time.perf_counter() - start
        phase = "decode" if decode_only else "prefill"
        self.counters[f"{phase}_time_s"] += elapsed
        self.counters[f"{phase}_tokens"] += batch.num_tokens
        self.counters["generation_tokens"] += sum(len(d.token_ids) for d in deltas)
        self.counters["steps"] += 1
        finished = []
        for request_id in dict.fromkeys(d.request_id for d in deltas if d.finish_reason is not None):
            request = self._requests.get(request_id)
            if request is not None and request.finished:
                finished.append(self._request_output(self._requests.pop(request_id)))
        return StepResult(deltas, finished)

    def _decide(self, sampling_seqs: list[Sequence], logits: torch.Tensor) -> StepOutput:
        """What each sequence that caught up appends: a sampled token, or what verification keeps of
        its drafts; forks of n > 1 at their first sample; the requests that fail."""
        output = StepOutput()
        plain, verifying, row = [], [], 0
        for seq in sampling_seqs:
            if seq.num_draft:
                verifying.append((seq, logits[row:row + 1 + seq.num_draft]))
            else:
                plain.append((seq, row))
            row += 1 + seq.num_draft
        if plain:
            self._sample(self._expand_forks(plain, output), logits, output)
        for seq, rows in verifying:
            if self._requests[seq.request_id].failure is None:
                self._verify(seq, rows, output)
        return output

    def _isolate(self, batch: ScheduledBatch, error: Exception) -> StepOutput:
        """A step failed. Each of its sequences runs again alone: one that fails by itself ends its
        request with finish_reason "error"; the others lose nothing. Nothing is committed, so the
        next step simply redoes their work; writing the same K/V into the same slots is harmless,
        and the copy-on-write copies are redone first in case the failure came before them."""
        logger.warning("a model step of %d sequences failed (%s: %s); running them one by one",
                       len(batch), type(error).__name__, error)
        self.runner.kv_cache.copy_blocks(batch.copies)
        output = StepOutput(computed=False)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.is_finished or self._requests[seq.request_id].failure is not None:
                continue
            try:
                self.runner.run(ScheduledBatch([seq], [n]))
            except WorkerFailedError:
                raise
            except Exception as e:
                self._fail_request(seq.request_id, e, output)
        self._unexplained_failures = 0 if output.failed else self._unexplained_failures + 1
        if self._unexplained_failures >= 2:  # fails together, never alone: not one request's fault
            raise error
        return output

    def _fail_request(self, request_id: str, error: Exception, output: StepOutput) -> None:
        request = self._requests[request_id]
        request.failure = StepFailure(uuid.uuid4().hex[:16], error)
        logger.error("request %s failed in a model step (error id %s)", request_id, request.failure.error_id,
                     exc_info=error)
        output.failed += [s for s in request.seqs if not s.is_finished]

    def _expand_forks(self, seqs: list[tuple[Sequence, int]], output: StepOutput) -> list[tuple[Sequence, int]]:
        """(sequence, logits row) pairs. A request with n > 1 runs its prompt once; at its first sample
        the sequence forks into n that share the prompt's blocks and sample from the same logits."""
        rows = []
        for seq, row in seqs:
            rows.append((seq, row))
            if seq.pending_fork:
                request = self._requests[seq.request_id]
                for _ in range(seq.pending_fork):
                    child = self._new_sequence(request, len(request.seqs), list(seq.token_ids),
                                               seq.grammar.fork() if seq.grammar is not None else None)
                    output.forks.append((seq, child))
                    rows.append((child, row))
        return rows

    def _sample(self, rows: list[tuple[Sequence, int]], logits: torch.Tensor, output: StepOutput) -> None:
        seqs = [s for s, _ in rows]
        picked = [r for _, r in rows]
        if picked != list(range(logits.shape[0])):  # a copy of the rows only where they differ
            logits = logits[torch.tensor(picked)]
        out = sample(logits, [s.params for s in seqs], [s.prompt_token_ids for s in seqs],
                     [s.output_token_ids for s in seqs], [s.generator for s in seqs], self.structured.step_mask(seqs),
                     [s.dry_breaker_ids for s in seqs], [s.mirostat_mu for s in seqs])
        tokens = out.token_ids.tolist()
        chosen_logprobs = out.logprobs.tolist()
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if self._requests[seq.request_id].failure is not None:  # failed a moment ago, on a sibling
                continue
            if token < 0:
                self._fail_request(seq.request_id, self._no_token_allowed(seq), output)
                continue
            top = out.top_logprobs[i] if out.top_logprobs is not None else []
            mu = out.mirostat_mu[i] if out.mirostat_mu is not None else None
            output.appends.append(Append(seq, [token], [chosen_logprobs[i]], [top], mu))

    @staticmethod
    def _no_token_allowed(seq: Sequence) -> Exception:
        if seq.grammar is not None and seq.grammar.is_error:
            return GrammarError(f"the grammar failed at output token {seq.num_output_tokens}: {seq.grammar.error}")
        return InvalidRequestError(f"the constraints allow no token at output token {seq.num_output_tokens} "
                                   "(structured_outputs, allowed_token_ids and bad_words together)")

    def _verify(self, seq: Sequence, logits: torch.Tensor, output: StepOutput) -> None:
        """What verification keeps of the drafts riding on `seq` (target logits [1 + K, V])."""
        k = seq.num_draft
        tokens = self.speculator.verify_drafts(seq, logits, self.structured)  # accepted drafts, the target's token
        if tokens[-1] < 0:  # no token allowed where the target's token would go
            self._fail_request(seq.request_id, self._no_token_allowed(seq), output)
            return
        accepted = len(tokens) - 1
        raw = torch.log_softmax(logits.float(), dim=-1)  # [K + 1, V]
        logprobs = [float(raw[j, t]) for j, t in enumerate(tokens)]
        tops = top_logprobs(raw[:len(tokens)], seq.params.logprobs or 0)
        self.counters["spec_proposed"] += k
        self.counters["spec_accepted"] += accepted
        self.counters["spec_verify_steps"] += 1
        output.appends.append(Append(seq, tokens, logprobs, tops))

    # -- results -------------------------------------------------------------------------------
    def _request_output(self, request: Request) -> RequestOutput:
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            want_logprobs = seq.params.logprobs is not None
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.detokenizer.text() if seq.detokenizer is not None else "",
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                cumulative_logprob=float(sum(seq.logprobs)),
                logprobs=list(seq.logprobs) if want_logprobs else None,
                top_logprobs=list(seq.top_logprobs) if want_logprobs else None))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, request.finished,
                             self._metrics(request), request.failure, request.pooled)

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
        if request.images:
            metrics.update(num_images=sum(im.tile == 0 for im in request.images), image_encode_s=sum(s.encoder_time_s for s in seqs))
        if first is not None:
            metrics["ttft_s"] = first - request.arrival_time
        if first is not None and last is not None:
            metrics["e2e_s"] = last - request.arrival_time
            decode_tokens = generated - len(seqs)
            metrics["decode_tokens_per_s"] = decode_tokens / (last - first) if last > first and decode_tokens > 0 else 0.0
        return metrics

    # -- saved sessions ---------------------------------------------------------------------------
    def save_session(self, name: str, token_ids: list[int], cache_salt: str | None = None) -> SessionInfo:
        """Save the prefix cache's blocks of `token_ids` (computed by a request just before) as `name`."""
        return self._session_store().save(name, token_ids, cache_salt, self.scheduler.block_manager)

    def load_session(self, name: str) -> tuple[SessionInfo, list[int]]:
        """Put session `name`'s blocks into the prefix cache; its facts and its token ids."""
        return self._session_store().load(name, self.scheduler.block_manager)

    def delete_session(self, name: str) -> SessionInfo:
        return self._session_store().delete(name)

    def _session_store(self) -> SessionStore:
        if self.sessions is None:
            raise InvalidRequestError("saved sessions need the prefix cache, and are not supported under "
                                      "tensor parallelism yet")
        return self.sessions

    def live_stats(self) -> dict:
        """The few counts a server publishes after every step; O(1), unlike `stats`."""
        proposed = self.counters["spec_proposed"]
        return {**self.scheduler.live_stats(),
                "spec_acceptance_rate": self.counters["spec_accepted"] / proposed if proposed else 0.0}

    def stats(self) -> dict:
        c = self.counters
        return {
            **self.scheduler.stats(),
            "spec_acceptance_rate": c["spec_accepted"] / c["spec_proposed"] if c["spec_proposed"] else 0.0,
            "spec_mean_accepted_length": c["spec_accepted"] / c["spec_verify_steps"] if c["spec_verify_steps"] else 0.0,
            **(self.speculator.stats() if self.speculator else {}),
            **c,
        }
