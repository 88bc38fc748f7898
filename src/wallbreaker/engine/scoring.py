"""Logits for every position of a text, through the same paged cache and runner as generation.
Perplexity uses it; with chunk_size=1 it is exactly incremental decoding, which tests pin against
one full pass."""
from __future__ import annotations

import torch

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine
from .scheduler import StepOutput
from .sequence import Sequence


def prompt_logits(engine: LLMEngine, token_ids: list[int], chunk_size: int | None = None,
                  images: tuple = (), lora_request=None) -> torch.Tensor:
    """[len(token_ids), vocab] float32 logits; row i predicts token i + 1. `images`: the prompt's
    (a chunk never splits one: `Sequence.fit_chunk`); `lora_request`: the LoRA adapter to run with."""
    if not token_ids:
        raise InvalidRequestError("nothing to score")
    if len(token_ids) > engine.max_model_len:
        raise InvalidRequestError(f"{len(token_ids)} tokens exceed max_model_len {engine.max_model_len}")
    scheduler = engine.scheduler
    chunk = chunk_size or scheduler.max_num_batched_tokens
    adapter = engine.resolve_lora(lora_request)
    seq = Sequence(-1, "score", 0, list(token_ids), len(token_ids), SamplingParams(), None, images=tuple(images),
                   lora_slot=adapter.slot if adapter else 0, lora_key=adapter.key if adapter else None)
    rows = []
    try:
        while seq.num_computed_tokens < len(token_ids):
            batch = scheduler.schedule_these([seq], chunk, reuse_prefix=False)
            if not batch.seqs:
                raise InvalidRequestError("the KV cache is too small to score this many tokens at once")
            rows.append(engine.runner.run(batch, all_logits=True)[1])
            scheduler.update_from_output(batch, StepOutput())
    finally:
        scheduler.free(seq)
    return torch.cat(rows)
