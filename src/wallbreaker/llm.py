"""`LLM`: the Python front door, shaped like vLLM's. Loads a model, builds the engine, runs batches."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any, Iterator, Sequence as Seq

import psutil
import torch

from .config import EngineConfig
from .engine.client import EngineRequest, RequestOutput, StepFailure, StreamDelta
from .engine.llm_engine import LLMEngine
from .engine.model_runner import ModelRunner
from .engine.scheduler import Scheduler
from .engine.structured_output import StructuredOutputs
from .engine.threads import ThreadGovernor
from . import kernels
from .errors import EngineError, InvalidRequestError
from .formats import ModelFiles, open_model
from .formats.families import DISK_TIER, DRAFT_MODEL, SESSIONS, TENSOR_PARALLEL, family
from .formats.packaged import cache_dir
from .formats.stored_precision import stored_dtype
from .kernels.repack_cache import source_identity
from .kv import BlockManager, BlockPool
from .kv.cache import default_num_blocks, make_kv_cache, memory_budget
from .kv.disk_cache import DiskKVCache
from .kv.kv_file import engine_fingerprint
from .kv.sessions import SessionInfo, SessionStore
from .kv.state_pool import StatePool, logs_drafts, size_state_pool, slot_bytes
from .layers.linear import mapped_bytes, module_bytes
from .layers.shard import check_splittable
from .lora.request import LoRARequest
from .models import load_model
from .pooling_params import PoolingParams
from .pooling_requests import PoolingRun, input_ids, relevance_requests, score_pairs, truncation_limit
from .sampling_params import SamplingParams
from .spec_decode.draft import DraftProposer, check_vocabularies
from .spec_decode.speculator import Speculator

logger = logging.getLogger("wallbreaker")


PromptType = str | list[int] | dict  # dict: {"prompt": str} or {"prompt_token_ids": [...]}, and "cache_salt"


def as_prompt_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict, a list of token ids) or a batch of them -> the batch. The one
    place that tells the two apart, for `LLM` and the server's completions."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    return list(prompts)


def _raise_step_failure(failures: list[StepFailure], num_requests: int) -> None:
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


def _vision_model(files: ModelFiles, mmproj: str | os.PathLike | None = None):
    """The vision encoder of a model that takes images: a Gemma 3 or SmolVLM (Idefics3) folder with its
    vision tower, or a GGUF text model with its `mmproj` file (given, or the one `mmproj*.gguf` beside
    it); else None."""
    from .vision.gemma3 import Gemma3Vision, is_gemma3_vision_config
    from .vision.idefics3 import Idefics3Vision, is_idefics3_vision_config
    if files.format == "hf":
        if mmproj is not None:
            raise InvalidRequestError("mmproj goes with a GGUF text model; a Hugging Face folder carries its own "
                                      "vision tower")
        hf = _config_json(files.path)
        if is_gemma3_vision_config(hf):
            return Gemma3Vision.from_folder(files.path, files.tokenizer)
        if is_idefics3_vision_config(hf):
            return Idefics3Vision.from_folder(files.path, files.tokenizer)
        from .vision.qwen2_5_vl import Qwen25VLVision, is_qwen2_5_vl_config
        if is_qwen2_5_vl_config(hf):
            return Qwen25VLVision.from_folder(files.path, files.tokenizer)
        from .vision.qwen3_vl import is_qwen3_vl_config, load_qwen3_vl
        if is_qwen3_vl_config(hf):
            return load_qwen3_vl(files.path, files.tokenizer)
        return None
    if mmproj is None:
        found = sorted(Path(files.path).parent.glob("mmproj*.gguf"))
        if len(found) != 1 or found[0] == Path(files.path):
            return None
        mmproj = found[0]
    from .vision.mmproj import read_mmproj
    vision = read_mmproj(mmproj, files.tokenizer, files.config.architecture)
    if vision.hidden_size != files.config.hidden_size:
        raise InvalidRequestError(f"mmproj {mmproj}: its projection gives vectors of {vision.hidden_size}, the text "
                                  f"model's embeddings are {files.config.hidden_size} wide: not this model's")
    deepstack = len(getattr(getattr(vision.tower, "cfg", None), "deepstack_visual_indexes", ()))
    expected = files.metadata.get(f"{files.config.architecture}.n_deepstack_layers", 0) if files.metadata else 0
    if deepstack != expected:  # Qwen3-VL: the text model adds as many DeepStack features as the mmproj gives
        raise InvalidRequestError(f"mmproj {mmproj}: {deepstack} DeepStack mergers, the text model takes {expected}: "
                                  f"not this model's")
    return vision


def _packed_linear(weight: torch.Tensor, bias: torch.Tensor) -> torch.nn.Module:
    """One of the vision encoder's projections as the `auto` path runs a decoder's: our kernels' packed
    linear layer (float weights packed to Q8_0 blocks at load, models/source.py)."""
    from .formats.weights import WeightRef
    from .models.source import WeightSource
    refs = {name: WeightRef(name, tuple(t.shape), "F32", t.numel() * 4, lambda t=t: t)
            for name, t in (("weight", weight), ("bias", bias))}
    return WeightSource(refs, torch.float32, packed=True).linear(["weight"], ["bias"])


def _config_json(path: Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, **options: Any):
        start = time.perf_counter()
        self.config = EngineConfig(model=model, **options)
        self.workers = None  # parallel.launcher.Workers, under tensor parallelism
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        files = open_model(model)  # dropped after the load: the model keeps views of what it reads
        if files.config.pooling is not None and self.config.dtype == "auto":  # the reference's vectors
            self.config = dataclasses.replace(self.config, dtype=stored_dtype(files.weights))
        self.model_path = files.path
        self.model_config = files.config
        self.tokenizer = files.tokenizer
        self.chat_template = files.chat_template
        device = torch.device(self.config.device)
        bs = self.config.kv_block_size
        max_len = min(self.config.max_model_len or files.config.max_position_embeddings,
                      files.config.max_position_embeddings)
        vocab_limit = self.tokenizer.vocab_size
        if files.config.pooling is not None and self.config.tensor_parallel_size > 1:
            raise InvalidRequestError("pooling models (embeddings, rerankers) run without tensor parallelism")
        if not family(files.config.architecture).supports(TENSOR_PARALLEL) and self.config.tensor_parallel_size > 1:
            raise InvalidRequestError(f"{family(files.config.architecture).name} models run without tensor parallelism")
        self.states: StatePool | None = None
        self.vision = _vision_model(files, self.config.mmproj)  # the image encoder and projector, where the model takes images
        if self.vision is not None and self.config.packed_weights:  # the auto path: the encoder's linears on our kernels
            self.vision.tower.use_linears(_packed_linear)
        if self.vision is not None and self.config.tensor_parallel_size > 1:
            raise InvalidRequestError("vision models run without tensor parallelism (not yet)")
        state_slots = self._state_slots(files.weight_bytes)
        num_blocks = self._num_blocks(max_len, files.weight_bytes, state_slots)
        max_len = self._fit_context(max_len, num_blocks * bs)
        if self.config.tensor_parallel_size == 1:
            self.model = load_model(files, self.config, device)
            self.states = StatePool(self._state_shapes(), *state_slots, device, logs_drafts(self.model)) \
                if state_slots is not None else None
            self.kv_cache = make_kv_cache(files.config, self.config, num_blocks, device)
            runner = ModelRunner(self.model, self.kv_cache, device, vocab_limit, self.states, self.vision)
        else:
            runner = self._start_tensor_parallel(files, num_blocks, vocab_limit, state_slots)
            self.model, self.kv_cache, self.states = runner.model, runner.kv_cache, runner.states
        self.max_model_len = max_len
        self.kv_disk, sessions = self._disk_tier()
        eos = frozenset(files.config.eos_token_ids) | self.tokenizer.stop_token_ids
        structured = StructuredOutputs(self.tokenizer, eos)
        speculator = self._speculator(max_len, structured, files.weight_bytes) \
            if self.config.speculative_method else None
        governor = None
        if self.config.num_threads is None and self.config.tensor_parallel_size == 1:
            governor = ThreadGovernor(torch.get_num_threads())
        self.engine = LLMEngine(runner, self.tokenizer, self._scheduler(num_blocks, max_len, self.kv_disk, self.states), eos,
                                structured, speculator, governor, sessions)
        if self.config.enable_lora:
            self.engine.enable_lora(self.config.max_loras, self.config.max_lora_rank)
        self.weight_bytes = module_bytes(self.model)
        self.weight_bytes_mapped = mapped_bytes(self.model)  # read from the model file or the repack cache
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

    def _num_blocks(self, max_len: int, weight_bytes: int, state_slots: tuple[int, int] | None) -> int:
        """KV blocks for the whole model (under tensor parallelism each rank holds its heads' share),
        in what the state pool (`state_slots`, whole states) leaves of the budget."""
        c = self.config
        state_bytes = state_slots[0] * slot_bytes(self._state_shapes()) if state_slots is not None else 0
        return default_num_blocks(self.model_config, c.kv_block_size, c.kv_cache_torch_dtype, c.kv_cache_memory_gb,
                                  c.max_num_seqs * max_len, weight_bytes, state_bytes)

    def _state_shapes(self) -> list[list[tuple[int, ...]]]:
        """Per recurrent layer, its state kinds' shapes for one sequence ([]: no recurrent layers)."""
        cfg = self.model_config
        return [cfg.state_shapes(i) for i in range(cfg.num_layers) if not cfg.is_attention(i)]

    def _state_slots(self, weight_bytes: int) -> tuple[int, int] | None:
        """The state pool's slots and its prefix cache's share of them (`prefix_state_slots`, by
        default one per sequence), for `max_num_seqs` sequences within the memory budget: all of it
        for a model without attention, three quarters for a hybrid (whose few attention layers'
        pages hold many tokens in the rest: Granite-4.0-H-1B keeps 8 KB a token in bfloat16, where
        one sequence's state is 55 MB). Under tensor parallelism every rank has as many slots, each
        holding its share of a state. None: the model has no recurrent layers."""
        shapes = self._state_shapes()
        if not shapes:
            return None
        c = self.config
        budget = memory_budget(c.kv_cache_memory_gb, weight_bytes)
        if self.model_config.num_attention_layers:
            budget *= 0.75
        checkpoints = 0
        if c.enable_prefix_caching:
            checkpoints = c.max_num_seqs if c.prefix_state_slots is None else c.prefix_state_slots
        spec = c.num_speculative_tokens if c.speculative_method else 0
        return size_state_pool(shapes, c.max_num_seqs, spec, checkpoints, budget)

    def _scheduler(self, num_blocks: int, max_len: int, disk: DiskKVCache | None = None,
                   states: StatePool | None = None) -> Scheduler:
        c = self.config
        pool = BlockPool(num_blocks, c.enable_prefix_caching)
        manager = BlockManager(pool, c.kv_block_size, disk, states, origin_keys=c.batch_invariant)
        return Scheduler(manager, c.max_num_seqs, c.max_num_batched_tokens, max_len)

    def _disk_tier(self) -> tuple[DiskKVCache | None, SessionStore | None]:
        """The prefix cache's disk tier (where `kv_cache_disk_gb` > 0) and the saved sessions'
        store, in `kv_cache_disk_dir`; neither under tensor parallelism (each rank would need its
        shard read and written: not yet), nor without the prefix cache, nor for a family whose spec
        says it has none. A recurrent model's states are written beside its blocks (their shapes are
        part of the fingerprint)."""
        c = self.config
        spec = family(self.model_config.architecture)
        if c.tensor_parallel_size > 1 or not c.enable_prefix_caching or not (spec.supports(DISK_TIER)
                                                                             or spec.supports(SESSIONS)):
            return None, None
        root = Path(c.kv_cache_disk_dir) if c.kv_cache_disk_dir else cache_dir() / "kv"
        layers, _, heads, _, head_dim = self.kv_cache.tensor.shape
        computed_by = (kernels.isa() if c.packed_weights else "torch") + (" batch-invariant" if c.batch_invariant else "")
        fingerprint = engine_fingerprint(source_identity(self.model_path), c.dtype, computed_by, self.kv_cache.dtype,
                                         c.kv_block_size, (layers, heads, head_dim))
        if self.states is not None:
            fingerprint["state_shapes"] = [list(s) for s in self.states.part_shapes]
        disk = None
        if c.kv_cache_disk_gb and spec.supports(DISK_TIER):
            try:
                disk = DiskKVCache(root / "blocks", int(c.kv_cache_disk_gb * 2**30), fingerprint, self.kv_cache)
            except OSError as e:
                raise InvalidRequestError(f"kv_cache_disk_dir {root}: {e.strerror or e}") from None
            weakref.finalize(self, disk.close)  # what is queued is written before the process ends
        sessions = SessionStore(root / "sessions", fingerprint, self.kv_cache, int(c.kv_cache_sessions_gb * 2**30),
                                self.states) if spec.supports(SESSIONS) else None
        return disk, sessions

    def _start_tensor_parallel(self, files: ModelFiles, num_blocks: int, vocab_limit: int,
                               state_slots: tuple[int, int] | None) -> ModelRunner:
        """Start the workers (or join torchrun's ranks) and load rank 0's shard; see parallel/."""
        from .parallel.launcher import launch
        check_splittable(files.config, self.config.tensor_parallel_size)
        self.workers = launch(self.config)
        weakref.finalize(self, self.workers.shutdown)  # an LLM dropped without shutdown() still stops them
        return self.workers.start_runner(files, self.config, num_blocks, vocab_limit, state_slots)

    @property
    def files(self) -> ModelFiles:
        """The model's files, opened again: the engine keeps no mapping of them but the views its
        weights are (a model whose every matrix comes from the repack cache reads nothing of the
        file, and so holds none of it mapped)."""
        return open_model(self.model_path)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and finish the disk tier's writes (both also
        done at interpreter exit)."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.kv_disk is not None:
            self.kv_disk.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _speculator(self, max_len: int, structured: StructuredOutputs, target_bytes: int) -> Speculator:
        c = self.config
        draft = None
        if c.speculative_method == "draft":
            draft = self._draft_proposer(max_len, structured, target_bytes)
        return Speculator(c.speculative_method, c.num_speculative_tokens, max_len, draft, c.speculative_adaptive)

    def _draft_proposer(self, max_len: int, structured: StructuredOutputs, target_bytes: int) -> DraftProposer:
        """The draft model with a runner, KV pool and scheduler of its own (its pool sized as the
        target's, by `kv_cache_memory_gb`; its KV pages in the default dtype)."""
        c = self.config
        files = open_model(c.speculative_model)
        check_vocabularies(self.tokenizer, files.tokenizer)
        if not family(files.config.architecture).supports(DRAFT_MODEL):
            raise InvalidRequestError("a draft model with recurrent layers is not supported: its state cannot go "
                                      "back to the tokens its target kept (the target may be recurrent)")
        config = dataclasses.replace(c, model=c.speculative_model, kv_cache_dtype="auto", speculative_method=None,
                                     speculative_model=None, tensor_parallel_size=1)
        device = torch.device(c.device)
        num_blocks = default_num_blocks(files.config, c.kv_block_size, config.kv_cache_torch_dtype,
                                        c.kv_cache_memory_gb, c.max_num_seqs * max_len,
                                        target_bytes + files.weight_bytes)
        model = load_model(files, config, device)
        runner = ModelRunner(model, make_kv_cache(files.config, config, num_blocks, device), device,
                             files.tokenizer.vocab_size)
        return DraftProposer(runner, self._scheduler(num_blocks, max_len), structured)

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

    @property
    def takes_images(self) -> bool:
        """Whether the model reads images (a vision encoder came with it)."""
        return self.vision is not None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True,
                    chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """The conversation through the chat template (which receives `tools`, OpenAI's shape, and the
        `chat_template_kwargs` as variables, e.g. `enable_thinking`), tokenized. Text without images;
        `encode_chat_images` takes them."""
        text, ids, images = self.encode_chat_images(messages, tools, add_generation_prompt, chat_template_kwargs)
        if images:
            raise InvalidRequestError("this conversation has images: use encode_chat_images", param="messages")
        return text, ids

    def encode_chat_images(self, messages: list[dict], tools: list[dict] | None = None,
                           add_generation_prompt: bool = True,
                           chat_template_kwargs: dict | None = None) -> tuple[str, list[int], list]:
        """`encode_chat`, and the conversation's images (vision.inputs.ImageInput, by the positions of
        their soft tokens). Content may be a list of OpenAI-style parts: text, and for a model that
        takes images, `image_url` (a data URL) or `image` (a PIL image, bytes or a data URL)."""
        from .vision.prompt import chat_prompt, has_images, has_parts, joined_text_parts
        if self.vision is not None and has_parts(messages):
            return chat_prompt(self.vision, self.chat_template, self.tokenizer, messages, add_generation_prompt,
                               tools=tools, **(chat_template_kwargs or {}))
        if has_images(messages):
            raise InvalidRequestError("this model does not take images (it has no vision encoder); send text only",
                                      param="messages")
        messages = joined_text_parts(messages)
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         **(chat_template_kwargs or {}))
        bos = self.tokenizer.bos_token
        add_special = not (bos and text.startswith(bos))
        return text, self.tokenizer.encode(text, add_special_tokens=add_special), []

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter every prompt runs with, or one per prompt (None: the base
        model), as vLLM's; it needs `LLM(..., enable_lora=True)`."""
        encoded = [(*self.encode(p), _cache_salt(p)) for p in as_prompt_list(prompts)]
        return self._run(encoded, sampling_params, use_tqdm, lora_request=lora_request)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """`chat_template_kwargs`: variables for the template, e.g. {"enable_thinking": False} (vLLM's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = []
        for c in conversations:
            text, ids, images = self.encode_chat_images(c, tools, chat_template_kwargs=chat_template_kwargs)
            encoded.append((text, ids, None, images))
        return self._run(encoded, sampling_params, use_tqdm, lora_request=lora_request)

    def _run(self, encoded: list[tuple], sampling_params, use_tqdm: bool,
             saved_prefix: bool = False, lora_request=None) -> list[RequestOutput]:
        """`encoded`: (text, token ids, cache salt[, images]) of each prompt."""
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(encoded)
        if len(params_list) != len(encoded):
            raise InvalidRequestError("give one SamplingParams, or one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(encoded)
        if len(loras) != len(encoded):
            raise InvalidRequestError("give one LoRARequest, or one per prompt")
        ids = []
        try:
            for (text, token_ids, salt, *images), p, lora in zip(encoded, params_list, loras):
                ids.append(self.engine.add_request(EngineRequest(token_ids, p, text, cache_salt=salt,
                                                                 images=tuple(images[0]) if images else (),
                                                                 saved_prefix=saved_prefix, lora_request=lora)))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for output in self.engine.step().finished:
                done[output.request_id] = output
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        outputs = [done[rid] for rid in ids]
        failed = [o.failure for o in outputs if o.failure is not None]
        if failed:
            _raise_step_failure(failed, len(ids))
        return outputs

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """One request, its new text yielded as it is generated; the last delta carries the whole
        `RequestOutput` (`delta.output`, with its metrics). The CLI's chat uses this."""
        text, token_ids = self.encode(prompt)
        yield from self._stream(text, token_ids, sampling_params or SamplingParams(), _cache_salt(prompt))

    def stream_chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        text, token_ids, images = self.encode_chat_images(messages)
        yield from self._stream(text, token_ids, sampling_params or SamplingParams(), images=images)

    def _stream(self, text, token_ids, params, cache_salt: str | None = None, images=()) -> Iterator[StreamDelta]:
        rid = self.engine.add_request(EngineRequest(token_ids, params, text, cache_salt=cache_salt,
                                                    images=tuple(images)))
        try:
            while True:
                result = self.engine.step()
                mine = [delta for delta in result.deltas if delta.request_id == rid]
                output = next((o for o in result.finished if o.request_id == rid), None)
                if output is None:
                    yield from mine
                    continue
                if mine:
                    mine[-1].output = output
                yield from mine
                if output.failure is not None:
                    _raise_step_failure([output.failure], 1)
                return
        finally:
            self.engine.abort(rid)

    def beam_search(self, prompts: PromptType | Seq[PromptType], beam_width: int = 4, max_tokens: int = 32,
                    length_penalty: float = 1.0, ignore_eos: bool = False, structured_outputs=None):
        """Beam search; returns one `BeamSearchOutput` a prompt, its sequences best first. With
        `structured_outputs` (a `StructuredOutputsParams`) every beam fits its grammar."""
        from .engine.beam_search import beam_search
        return beam_search(self.engine, [self.encode(p)[1] for p in as_prompt_list(prompts)], beam_width, max_tokens,
                           length_penalty, ignore_eos, structured_outputs)

    def logits(self, prompt: PromptType, chunk_size: int | None = None, images=(),
               lora_request: LoRARequest | None = None) -> torch.Tensor:
        """Float32 logits [tokens, vocab] of every position of a prompt (row i predicts token i + 1);
        `images`: the prompt's (`encode_chat_images`); `lora_request`: the LoRA adapter to run with."""
        from .engine.scoring import prompt_logits
        token_ids = self.encode(prompt)[1]
        return prompt_logits(self.engine, token_ids, chunk_size, self.engine.check_images(images, token_ids),
                             lora_request)

    def stats(self) -> dict:
        """The engine's counts, and memory: the weights (`weight_bytes_mapped` of them read from file
        mappings, in the page cache; `weight_bytes_resident` in the process's own memory), the KV
        pool, and the process's resident set."""
        return {**self.engine.stats(), "weight_bytes": self.weight_bytes, "weight_bytes_mapped": self.weight_bytes_mapped,
                "weight_bytes_resident": self.weight_bytes - self.weight_bytes_mapped,
                "kv_cache_bytes": self.kv_cache.nbytes, "kv_cache_dtype": str(self.kv_cache.dtype).removeprefix("torch."),
                "rss_bytes": psutil.Process().memory_info().rss}

    # -- saved sessions ------------------------------------------------------------------------
    def save_prefix(self, prompt: PromptType | list[dict], name: str) -> SessionInfo:
        """Compute (or find cached) the K/V of a prompt, or of a conversation's messages through the
        chat template (without the generation prompt, so that the next turn starts with it), and
        save its full blocks as session `name` in `kv_cache_disk_dir`/sessions. A later
        `load_prefix(name)`, in this process or another of the same model and settings, puts them
        back into the prefix cache. A prompt's `cache_salt` (dict form) is kept: only requests with
        that salt hit the restored blocks."""
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text, token_ids = self.encode_chat(prompt, add_generation_prompt=False)
            salt = None
        else:
            (text, token_ids), salt = self.encode(prompt), _cache_salt(prompt)
        self._run([(text, token_ids, salt)], SamplingParams(max_tokens=1, temperature=0.0), False, saved_prefix=True)
        return self.engine.save_session(name, token_ids, salt)

    def load_prefix(self, name: str) -> SessionInfo:
        """Put saved session `name` back into the prefix cache (as far as the KV pool has room):
        the next prompt that starts with its tokens computes only the rest. `InvalidRequestError`
        naming the difference when the session was saved by another model or other settings."""
        return self.engine.load_session(name)[0]

    def delete_prefix(self, name: str) -> SessionInfo:
        """Remove saved session `name` (its `nbytes` freed); `SessionNotFoundError` where there is none."""
        return self.engine.delete_session(name)

    # -- pooling models: embeddings, scores, reranking --------------------------------------------
    @property
    def pooling(self) -> PoolingRun:
        return PoolingRun(self.engine, self.tokenizer, self.model_config.hidden_size)

    def _pool(self, requests) -> list[RequestOutput]:
        outputs = self.pooling.run(requests)
        failed = [o.failure for o in outputs if o.failure is not None]
        if failed:
            _raise_step_failure(failed, len(outputs))
        return outputs

    def embed(self, texts: str | list[int] | Seq[str | list[int]], *, dimensions: int | None = None,
              normalize: bool | None = None, truncate_prompt_tokens: int | None = None) -> list[list[float]]:
        """One embedding a text (or list of token ids), as the model's pooling config makes it
        (normalized where it says so). `dimensions`: the first this many values (Matryoshka),
        normalized again. An input past the model's limit is an error unless `truncate_prompt_tokens`
        (a count, or -1 for the limit) asks to cut it."""
        items = as_prompt_list(texts)
        limit = truncation_limit(truncate_prompt_tokens, self.max_model_len)
        params = PoolingParams("embed", dimensions, normalize)
        run = self.pooling
        outputs = self._pool(run.requests([input_ids(self.tokenizer, t, limit) for t in items], params))
        return run.embeddings(outputs, params)

    def score(self, text_1: str | Seq[str], text_2: str | Seq[str], *,
              truncate_prompt_tokens: int | None = None) -> list[float]:
        """Relevance of each pair (vLLM's `LLM.score`: one to one, one to many, many to many): a
        cross-encoder's sigmoid score, or an embedding model's cosine similarity."""
        limit = truncation_limit(truncate_prompt_tokens, self.max_model_len)
        requests, finish = relevance_requests(self.pooling, score_pairs(text_1, text_2), limit)
        return finish(self._pool(requests))

    def rerank(self, query: str, documents: Seq[str], *, top_n: int | None = None,
               truncate_prompt_tokens: int | None = None) -> list[dict]:
        """The documents by relevance to the query, best first: `{"index", "relevance_score",
        "document"}` each (the shape of /v1/rerank's results), the first `top_n` of them."""
        documents = list(documents)
        scores = self.score(query, documents, truncate_prompt_tokens=truncate_prompt_tokens) if documents else []
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        return [{"index": i, "relevance_score": scores[i], "document": documents[i]} for i in ranked]
