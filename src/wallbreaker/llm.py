"""`LLM`: the Python front door, shaped like vLLM's. Loads a model, builds the engine, runs batches."""
from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Iterator, Sequence as Seq

import torch

from .config import EngineConfig
from .engine.llm_engine import LLMEngine
from .engine.model_runner import ModelRunner
from .engine.outputs import RequestOutput, StreamDelta
from .engine.scheduler import Scheduler
from .errors import EngineError, InvalidRequestError
from .formats import ModelFiles, open_model
from .kv import BlockManager, BlockPool
from .kv.cache import default_num_blocks, make_kv_cache
from .layers.linear import module_bytes
from .layers.shard import check_splittable
from .models import load_model
from .sampling_params import SamplingParams
from .spec_decode.draft import DraftProposer
from .spec_decode.speculator import Speculator

logger = logging.getLogger("wallbreaker")


PromptType = str | list[int] | dict  # dict: {"prompt": str} or {"prompt_token_ids": [...]}, and "cache_salt"


def _raise_step_failure(failures: list, num_requests: int) -> None:
    first = failures[0]
    detail = " ".join(str(first.error).split())[:300]  # one line, whatever the error's own text
    raise EngineError(f"{len(failures)} of {num_requests} requests failed in a model step (error id "
                      f"{first.error_id}): {type(first.error).__name__}: {detail}") from first.error


def _cache_salt(prompt: PromptType) -> str | None:
    """vLLM's per-request `cache_salt`: only requests with the same salt share prefix-cache blocks."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequestError("cache_salt must be a string")
    return salt


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, **options: Any):
        start = time.perf_counter()
        self.config = EngineConfig(model=model, **options)
        self.workers = None  # parallel.launcher.Workers, under tensor parallelism
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        files = open_model(model)
        self.files = files
        self.model_config = files.config
        self.tokenizer = files.tokenizer
        self.chat_template = files.chat_template
        device = torch.device(self.config.device)
        bs = self.config.kv_block_size
        max_len = min(self.config.max_model_len or files.config.max_position_embeddings,
                      files.config.max_position_embeddings)
        num_blocks = self._num_blocks(max_len)
        max_len = self._fit_context(max_len, num_blocks * bs)
        self.max_model_len = max_len
        if self.config.tensor_parallel_size == 1:
            self.model = load_model(files, self.config, device)
            self.kv_cache = make_kv_cache(files.config, self.config, num_blocks, device)
            runner = ModelRunner(self.model, self.kv_cache, device)
        else:
            runner = self._start_tensor_parallel(files, num_blocks)
            self.model, self.kv_cache = runner.model, runner.kv_cache
        runner.vocab_limit = min(self.tokenizer.vocab_size, files.config.vocab_size)
        block_manager = BlockManager(BlockPool(num_blocks, self.config.enable_prefix_caching), bs)
        scheduler = Scheduler(block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        eos = frozenset(files.config.eos_token_ids) | self.tokenizer.stop_token_ids
        self.engine = LLMEngine(runner, self.tokenizer, block_manager, scheduler, max_len, eos,
                                self._speculator(max_len))
        self.weight_bytes_resident = module_bytes(self.model)
        self.load_time_s = time.perf_counter() - start

    def _fit_context(self, max_len: int, pool_tokens: int) -> int:
        """The context one sequence may reach, never more than the KV pool holds: a sequence that
        outgrew the pool would preempt every other and then itself, forever (vLLM refuses too).
        A `max_model_len` asked for explicitly is refused with the numbers; the model's own is capped."""
        if max_len <= pool_tokens:
            return max_len
        if self.config.max_model_len is not None:
            raise InvalidRequestError(
                f"max_model_len {max_len} is more than the KV cache holds ({pool_tokens} tokens); "
                f"raise kv_cache_memory_gb or lower max_model_len")
        logger.warning("max_model_len capped at %d tokens, what the KV cache holds (the model allows %d)",
                       pool_tokens, max_len)
        return pool_tokens

    def _num_blocks(self, max_len: int) -> int:
        """KV blocks for the whole model (under tensor parallelism each rank holds its heads' share)."""
        c = self.config
        return default_num_blocks(self.model_config, c.kv_block_size, c.kv_cache_torch_dtype, c.kv_cache_memory_gb,
                                  c.max_num_seqs * max_len)

    def _start_tensor_parallel(self, files: ModelFiles, num_blocks: int) -> ModelRunner:
        """Start the workers (or join torchrun's ranks) and load rank 0's shard; see parallel/."""
        from .parallel.launcher import launch
        check_splittable(files.config, self.config.tensor_parallel_size)
        self.workers = launch(self.config)
        weakref.finalize(self, self.workers.shutdown)  # an LLM dropped without shutdown() still stops them
        return self.workers.start_runner(files, self.config, num_blocks)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        if self.workers is not None:
            self.workers.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _speculator(self, max_len: int) -> Speculator | None:
        c = self.config
        if c.speculative_method is None:
            return None
        draft = None
        if c.speculative_method == "draft":
            draft_llm = LLM(c.speculative_model, dtype=c.dtype, device=c.device, kv_block_size=c.kv_block_size,
                            kv_cache_memory_gb=c.kv_cache_memory_gb, max_num_seqs=c.max_num_seqs,
                            max_model_len=max_len, enable_prefix_caching=c.enable_prefix_caching)
            draft = DraftProposer(draft_llm, self.tokenizer)
        return Speculator(c.speculative_method, c.num_speculative_tokens, max_len, draft, c.speculative_adaptive)

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt; the ids are checked against the vocabulary by the engine."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list):
                    raise InvalidRequestError("prompt_token_ids must be a list of token ids")
                return prompt.get("prompt"), list(ids)
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("a prompt is a string, a list of token ids, or {'prompt_token_ids': [...]}")

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """The conversation through the chat template (which receives `tools`, OpenAI's shape), tokenized."""
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        bos = self.tokenizer.bos_token
        add_special = not (bos and text.startswith(bos))
        return text, self.tokenizer.encode(text, add_special_tokens=add_special)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [(*self.encode(p), _cache_salt(p)) for p in prompts]
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, tools: list[dict] | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([(*self.encode_chat(c, tools), None) for c in conversations], sampling_params, use_tqdm)

    def _run(self, encoded: list[tuple[str | None, list[int], str | None]], sampling_params,
             use_tqdm: bool) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(encoded)
        if len(params_list) != len(encoded):
            raise InvalidRequestError("give one SamplingParams, or one per prompt")
        ids = []
        try:
            for (text, token_ids, salt), p in zip(encoded, params_list):
                ids.append(self.engine.add_request(token_ids, p, prompt=text, cache_salt=salt))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        done: set[str] = set()
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                if bar is not None and delta.finish_reason and self.engine.requests[delta.request_id].finished \
                        and delta.request_id not in done:
                    done.add(delta.request_id)
                    bar.update(1)
        if bar is not None:
            bar.close()
        failed = [self.engine.requests[rid].failure for rid in ids if self.engine.requests[rid].failure]
        outputs = [self.engine.pop_finished(rid) for rid in ids]
        if failed:
            _raise_step_failure(failed, len(ids))
        return outputs

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """One request, its new text yielded as it is generated; the last delta carries the whole
        `RequestOutput` (`delta.output`, with its metrics). The CLI's chat uses this."""
        text, token_ids = self.encode(prompt)
        yield from self._stream(text, token_ids, sampling_params or SamplingParams(), _cache_salt(prompt))

    def stream_chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        text, token_ids = self.encode_chat(messages)
        yield from self._stream(text, token_ids, sampling_params or SamplingParams())

    def _stream(self, text, token_ids, params, cache_salt: str | None = None) -> Iterator[StreamDelta]:
        rid = self.engine.add_request(token_ids, params, prompt=text, cache_salt=cache_salt)
        try:
            while True:
                mine = [delta for delta in self.engine.step() if delta.request_id == rid]
                request = self.engine.requests[rid]
                if not request.finished:
                    yield from mine
                    continue
                output = self.engine.pop_finished(rid)
                if mine:
                    mine[-1].output = output
                yield from mine
                if request.failure is not None:
                    _raise_step_failure([request.failure], 1)
                return
        finally:
            self.engine.abort(rid)

    def beam_search(self, prompts: PromptType | Seq[PromptType], beam_width: int = 4, max_tokens: int = 32,
                    length_penalty: float = 1.0, ignore_eos: bool = False, structured_outputs=None):
        """Beam search; returns one `BeamSearchOutput` a prompt, its sequences best first. With
        `structured_outputs` (a `StructuredOutputsParams`) every beam fits its grammar."""
        from .engine.beam_search import beam_search
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return beam_search(self.engine, [self.encode(p)[1] for p in prompts], beam_width, max_tokens,
                           length_penalty, ignore_eos, structured_outputs)

    def logits(self, prompt: PromptType, chunk_size: int | None = None) -> torch.Tensor:
        """Float32 logits [tokens, vocab] of every position of a prompt (row i predicts token i + 1)."""
        from .engine.scoring import prompt_logits
        return prompt_logits(self.engine, self.encode(prompt)[1], chunk_size)

    def stats(self) -> dict:
        return {**self.engine.stats(), "weight_bytes_resident": self.weight_bytes_resident,
                "kv_cache_bytes": self.kv_cache.nbytes,
                "kv_cache_dtype": str(self.kv_cache.dtype).removeprefix("torch.")}
