"""Logits for every position of a text, through the same paged cache and runner as generation.
Perplexity uses it; with chunk_size=1 it is exactly incremental decoding, which tests pin against
one full pass."""
from __future__ import annotations

import torch

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine
from .scheduler import ScheduledBatch
from .sequence import Sequence


def prompt_logits(engine: LLMEngine, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
    """[len(token_ids), vocab] float32 logits; row i predicts token i + 1."""
    if not token_ids:
        raise InvalidRequestError("nothing to score")
    if len(token_ids) > engine.max_model_len:
        raise InvalidRequestError(f"{len(token_ids)} tokens exceed max_model_len {engine.max_model_len}")
    bm = engine.block_manager
    chunk = chunk_size or engine.scheduler.max_num_batched_tokens
    seq = Sequence(-1, "score", 0, list(token_ids), len(token_ids), SamplingParams(), None)
    rows = []
    try:
        if bm.blocks_needed(len(token_ids)) > bm.pool.num_free:
            raise InvalidRequestError("the KV cache is too small to score this many tokens at once")
        while seq.num_computed_tokens < len(token_ids):
            room = bm.reserve(seq, min(chunk, len(token_ids) - seq.num_computed_tokens), reuse_prefix=False)
            assert room is not None  # the whole text's blocks were checked to be free
            batch = ScheduledBatch()
            batch.add(seq, *room)
            rows.append(engine.forward(batch, all_logits=True)[1])
    finally:
        bm.free(seq)
    return torch.cat(rows)
