"""`LLM`: the Python front door, shaped like vLLM's. Loads a model, builds the engine, runs batches."""
from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence as Seq

import torch

from ..errors import EngineError, InvalidRequestError
from ..formats import ModelFiles, open_model
from ..kv import BlockManager, BlockPool, KVCache
from ..kv.cache import default_num_blocks
from ..layers.linear import module_bytes
from ..models import WeightSource, build_model
from ..models.base import CausalLM
from ..layers.shard import Shard, check_splittable, local_kv_config
from ..sampling_params import SamplingParams
from ..spec.draft import DraftProposer
from ..spec.speculator import Speculator
from .llm_engine import LLMEngine
from .model_runner import ModelRunner
from .outputs import RequestOutput, StreamDelta
from .scheduler import Scheduler

logger = logging.getLogger("wallbreaker")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    model: str | os.PathLike | None = None
    dtype: str = "auto"
    device: str = "cpu"
    kv_block_size: int = 16
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int = 4
    speculative_adaptive: bool = True
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 60.0  # a rank silent this long in a collective fails the engine

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *_DTYPES):
            raise InvalidRequestError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        for name in ("kv_block_size", "max_num_seqs", "max_num_batched_tokens"):
            if int(getattr(self, name)) < 1:
                raise InvalidRequestError(f"{name} must be at least 1")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise InvalidRequestError("kv_cache_memory_gb must be positive")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len must be at least 2")
        if self.speculative_method not in (None, "draft", "ngram"):
            raise InvalidRequestError("speculative_method must be None, 'draft' or 'ngram'")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise InvalidRequestError("speculative_method='draft' needs speculative_model (a path or packaged name)")
        if self.speculative_method and not 1 <= self.num_speculative_tokens <= 32:
            raise InvalidRequestError("num_speculative_tokens must be between 1 and 32")
        if int(self.tensor_parallel_size) < 1:
            raise InvalidRequestError("tensor_parallel_size must be at least 1")
        if not self.tensor_parallel_timeout_s > 0:
            raise InvalidRequestError("tensor_parallel_timeout_s must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activation (and KV cache) dtype."""
        return torch.float32 if self.dtype == "auto" else _DTYPES[self.dtype]

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """bfloat16 on the `auto` path: batched decoding reads the KV cache more than the weights."""
        return torch.bfloat16 if self.dtype == "auto" else self.torch_dtype

    @property
    def packed_weights(self) -> bool:
        """`auto` on the CPU keeps linear weights as GGUF blocks for our kernels (wallbreaker.kernels)."""
        return self.dtype == "auto" and torch.device(self.device).type == "cpu"


def load_model(files: ModelFiles, config: EngineConfig, device: torch.device, shard: Shard | None = None) -> CausalLM:
    """The model, or under tensor parallelism this rank's shard of it."""
    with torch.device(device):
        return build_model(files.config, WeightSource(files.weights, config.torch_dtype, config.packed_weights, shard))


def make_kv_cache(files: ModelFiles, config: EngineConfig, num_blocks: int, device: torch.device,
                  shard: Shard | None = None) -> KVCache:
    """The KV pool; a tensor-parallel rank's holds the same blocks, for its own KV heads only."""
    model_config = files.config if shard is None else local_kv_config(files.config, shard)
    return KVCache(model_config, num_blocks, config.kv_block_size, config.kv_cache_dtype, device)


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
            self.kv_cache = make_kv_cache(files, self.config, num_blocks, device)
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
        return default_num_blocks(self.model_config, c.kv_block_size, c.kv_cache_dtype, c.kv_cache_memory_gb,
                                  c.max_num_seqs * max_len)

    def _start_tensor_parallel(self, files: ModelFiles, num_blocks: int) -> ModelRunner:
        """Start the workers (or join torchrun's ranks) and load rank 0's shard; see parallel/."""
        from ..parallel.launcher import launch
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

    def encode_chat(self, messages: list[dict]) -> tuple[str, list[int]]:
        text = self.chat_template.render(messages, add_generation_prompt=True)
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
             use_tqdm: bool = False) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([(*self.encode_chat(c), None) for c in conversations], sampling_params, use_tqdm)

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
        """One request, its new text yielded as it is generated (the CLI's chat uses this)."""
        text, token_ids = self.encode(prompt)
        yield from self._stream(text, token_ids, sampling_params or SamplingParams(), _cache_salt(prompt))

    def stream_chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        text, token_ids = self.encode_chat(messages)
        yield from self._stream(text, token_ids, sampling_params or SamplingParams())

    def _stream(self, text, token_ids, params, cache_salt: str | None = None) -> Iterator[StreamDelta]:
        rid = self.engine.add_request(token_ids, params, prompt=text, cache_salt=cache_salt)
        try:
            while not self.engine.requests[rid].finished:
                for delta in self.engine.step():
                    if delta.request_id == rid:
                        yield delta
            failure = self.engine.requests[rid].failure
            self.last_output = self.engine.pop_finished(rid)
            if failure is not None:
                _raise_step_failure([failure], 1)
        finally:
            self.engine.abort(rid)

    def beam_search(self, prompts: PromptType | Seq[PromptType], beam_width: int = 4, max_tokens: int = 32,
                    length_penalty: float = 1.0, ignore_eos: bool = False):
        """Beam search; returns one `BeamSearchOutput` a prompt, its sequences best first."""
        from .beam_search import beam_search
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return beam_search(self.engine, [self.encode(p)[1] for p in prompts], beam_width, max_tokens,
                           length_penalty, ignore_eos)

    def logits(self, prompt: PromptType, chunk_size: int | None = None) -> torch.Tensor:
        """Float32 logits [tokens, vocab] of every position of a prompt (row i predicts token i + 1)."""
        from .scoring import prompt_logits
        return prompt_logits(self.engine, self.encode(prompt)[1], chunk_size)

    def stats(self) -> dict:
        return {**self.engine.stats(), "weight_bytes_resident": self.weight_bytes_resident,
                "kv_cache_bytes": self.kv_cache.nbytes}
