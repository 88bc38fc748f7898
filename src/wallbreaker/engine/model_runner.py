"""Runs one scheduled batch through the model: flat token list in, logits of the sampling rows out."""
from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .. import _C
from ..kv import KVCache
from ..kv.state_pool import StatePool
from ..layers.attention import MAX_PAGED_QUERIES, AttentionMetadata, PrefillSpan
from ..layers.lora import step_slots
from ..layers.recurrent import StateMetadata, StateSpan
from ..models.base import CausalLM
from .scheduler import ScheduledBatch
from .sequence import Sequence

# the encoder outputs the runner keeps, in bytes: 32 images of Gemma 3 4B (2.6 MB each), or some 580
# tiles of SmolVLM-256M (64 x 576 floats, 147 KB each; an image is up to 17 of them)
ENCODER_CACHE_BYTES = 32 * 256 * 2560 * 4

# freed allocations under this size stay with malloc for the next step (`_C.retain_freed_memory`):
# a 2,048-token chunk of an 8B model's MLP is some 240 MB of activations
RETAINED_ALLOCATION_BYTES = 1 << 30


def retain_freed_memory() -> bool:
    """From now on malloc keeps what a step frees for the next one (csrc/ops.cpp says why), unless
    `WALLBREAKER_RETAIN_FREED_MEMORY=0`; whether it does. Every ModelRunner calls it once its model
    is loaded; benchmarks of the kernels call it to time them as the engine runs them."""
    return os.environ.get("WALLBREAKER_RETAIN_FREED_MEMORY", "1") != "0" and _C.retain_freed_memory(RETAINED_ALLOCATION_BYTES)


@dataclass
class StepInputs:
    """All one model step reads besides the weights and the KV pool (what rank 0 broadcasts to the
    other ranks under tensor parallelism)."""

    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata  # with positions
    copies: list[tuple[int, int]]  # KV blocks to copy (src, dst) first: copy-on-write of forked tails
    logit_rows: torch.Tensor | None  # rows of the hidden states that need logits; None: all of them
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, vectors) in place of token embeddings: images
    lora_slots: torch.Tensor | None = None  # [T] each row's LoRA adapter slot; None: no row uses one (layers/lora.py)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device, vocab_limit: int | None = None,
                 states: StatePool | None = None, vision: torch.nn.Module | None = None,
                 encoder_cache_bytes: int = ENCODER_CACHE_BYTES):
        """`vocab_limit`: token ids at or past it never come out of a step, because an embedding
        padded past the tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens) has rows that no text
        stands for. None: the model's vocabulary (a tensor-parallel worker, which never samples).
        `states`: the recurrent layers' state pool, where the model has any."""
        self.model = model
        self.kv_cache = kv_cache
        # the vision encoder and projector (vision/), where the model takes images; its outputs by the
        # image's pixel digest, the most recently used kept: an image is encoded once, however its
        # prompt is chunked, and again only when it has been evicted
        self.vision = vision
        self.encoder_cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.encoder_cache_bytes = encoder_cache_bytes
        self._encoder_cache_used = 0
        self.encoder_stats = {"images_encoded": 0, "encoder_cache_hits": 0, "encoder_time_s": 0.0}
        self.states = states
        self.block_size = kv_cache.block_size
        self.device = device
        self.vocab_limit = min(vocab_limit or model.config.vocab_size, model.config.vocab_size)
        # a sequence with at most this many new tokens goes to the paged attention kernel. In
        # batch-invariant mode (models/base.py `set_batch_invariant`) a step's tokens are split by
        # origin instead: generated tokens to the paged kernel, prompt tokens to the prefill spans;
        # a model with recurrent layers, whose rows must stay in order, sends every one to the
        # paged kernel.
        invariant = getattr(model, "batch_invariant", False)
        self.split_by_origin = invariant and states is None
        self.max_paged_queries = sys.maxsize if invariant else MAX_PAGED_QUERIES
        layers = model.attention_layers()
        kv_cache.set_offsets([attn.kv_offsets() for attn in layers])
        for i, attn in enumerate(layers):
            attn.kv = kv_cache.layer(i)
        if states is not None:
            mixers = model.recurrent_layers()
            assert [m.state_shapes() for m in mixers] == states.layer_shapes, \
                "the model's recurrent layers keep other states than its config accounts for"
            for i, mixer in enumerate(mixers):
                mixer.state = states.layer(i)
        retain_freed_memory()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, all_logits: bool = False) -> tuple[list[Sequence], torch.Tensor]:
        seqs, logits, _ = self.run_step(batch, all_logits)
        return seqs, logits

    @torch.inference_mode()
    def run_step(self, batch: ScheduledBatch, all_logits: bool = False
                 ) -> tuple[list[Sequence], torch.Tensor, list[tuple[Sequence, torch.Tensor]]]:
        """`run`, and each pooling sequence of the batch (always computed whole in one step) with
        its pooled vector (layers/pooling.py).

        Computes the batch's new tokens into the KV cache. Returns the sequences that caught up with
        their last token (they sample next) and their logits: one row each, or 1 + num_draft rows for a
        sequence carrying drafts to verify. With `all_logits`, the logits of every token computed, in
        batch order (for scoring a text)."""
        pieces = self._pieces(batch, all_logits)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables, query_start, context_lens, prefills = [], [0], [], []
        rows_of: dict[int, list[tuple[int, int]]] = {}  # batch index -> (first position, its row) of each piece
        state_spans: list[StateSpan] = []
        embed_rows: list[int] = []
        embed_values: list[torch.Tensor] = []
        mrope: list[torch.Tensor | None] = []  # each piece's M-RoPE positions (Qwen2.5-VL's images), or None
        adapters: list[tuple[int, int]] = []  # each piece's (LoRA slot, rows)
        for j, start, end, paged in pieces:
            seq, n = batch.seqs[j], end - start
            rows_of.setdefault(j, []).append((start, len(input_ids)))
            images = [im for im in seq.images if im.offset < end and im.end > start]
            for im in images:  # its soft tokens' rows take the encoder's vectors
                lo, hi = max(start, im.offset), min(end, im.end)
                embed_rows += range(len(input_ids) + lo - start, len(input_ids) + hi - start)
                embed_values.append(self._image_embeds(seq, im)[lo - im.offset:hi - im.offset])
            if paged and not prefills:  # (in batch order, for all_logits, the paged run ends at the first span)
                assert not images, "a piece with image tokens goes to a prefill span (its mask is not causal)"
                tables.append(seq.block_table)
                query_start.append(query_start[-1] + n)
                context_lens.append(end)
            else:
                prefills.append(PrefillSpan(len(input_ids), n, end, torch.tensor(seq.block_table, device=self.device),
                                            tuple((im.offset, im.end) for im in images if im.bidirectional)))
            if self.states is not None:
                state_spans.append(StateSpan(len(input_ids), n, seq.state_slot, list(seq.state_saves),
                                             *seq.state_src_log, seq.state_log_after))
            input_ids += seq.tokens_to_compute(start, end)
            adapters.append((seq.lora_slot, n))
            positions += range(start, end)
            mrope.append(seq.rope_positions(start, end))
            slots += [seq.block_table[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(start, end)]

        def row(j: int, position: int) -> int:
            first, at = max((p, r) for p, r in rows_of[j] if p <= position)
            return at + position - first
        sampling_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        pool_spans: list[tuple[int, int]] = []
        pooling_seqs: list[Sequence] = []
        batch_rows: list[int] = []  # every token's row, in batch order (all_logits)
        for j in sorted(rows_of):
            seq, n = batch.seqs[j], batch.num_new_tokens[j]
            start = seq.num_computed_tokens
            end = start + n
            if all_logits:
                batch_rows += [row(j, p) for p in range(start, end)]
            if seq.pooling:
                assert start == 0 and end == seq.num_tokens, "a pooling sequence is computed whole"
                pool_spans.append((row(j, start), n))
                pooling_seqs.append(seq)
            elif end == seq.num_tokens_with_spec:  # caught up: logits for the last token and each draft
                sampling_rows += [row(j, p) for p in range(end - 1 - seq.num_draft, end)]
                sampling_seqs.append(seq)
        width = max((len(t) for t in tables), default=0)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32, device=self.device).view(len(tables), width),
            query_start=torch.tensor(query_start, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            prefills=prefills, positions=torch.tensor(positions, device=self.device),
            block_size=self.block_size, num_paged_tokens=query_start[-1],
            state=StateMetadata(state_spans) if self.states is not None else None,
            split_by_origin=self.split_by_origin,
            mrope_positions=None if all(m is None for m in mrope) else torch.cat(
                [torch.arange(s, e).expand(3, -1) if m is None else m
                 for m, (_, s, e, _) in zip(mrope, pieces)], dim=1).to(self.device),
        )
        if all_logits:
            rows = None if batch_rows == list(range(len(batch_rows))) else torch.tensor(batch_rows, device=self.device)
        else:
            rows = torch.tensor(sampling_rows, dtype=torch.long, device=self.device)
        embeds = None
        if embed_rows:
            embeds = (torch.tensor(embed_rows, dtype=torch.long, device=self.device), torch.cat(embed_values))
        step = StepInputs(torch.tensor(input_ids, device=self.device), meta, batch.copies, rows, embeds,
                          step_slots(adapters, self.device))
        pooled: list[torch.Tensor] = []
        if pooling_seqs:
            hidden = self._hidden(step)
            logits = self._logits(step, hidden)
            pooled = self.model.pooler(hidden, pool_spans)
        else:
            logits = self.execute(step)
        if logits.shape[-1] > self.vocab_limit:
            logits[:, self.vocab_limit:] = float("-inf")
        return sampling_seqs, logits, list(zip(pooling_seqs, pooled))

    def _pieces(self, batch: ScheduledBatch, all_logits: bool) -> list[tuple[int, int, int, bool]]:
        """The step's tokens as (batch index, first position, end, paged) pieces, in the order of
        the flat batch: the paged kernel's pieces first (the plan and the kernel read them as one
        run), the prefill spans after. Normally a sequence with few new tokens is one paged piece
        and any other one prefill span (`all_logits`: in batch order, for scoring a text). Split by
        origin, a sequence's generated tokens (decode, drafts, a recompute after preemption) are a
        paged piece and its prompt tokens a prefill span, whatever the step."""
        pieces = []
        for j, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + n
            if self.split_by_origin:
                cut = end if seq.pooling else min(max(start, seq.num_prefill_path_tokens), end)
                pieces += [(j, start, cut, False)] if cut > start else []
                pieces += [(j, cut, end, True)] if end > cut else []
            else:  # a piece with image tokens is a prefill span: only there is attention other than causal
                images = any(im.offset < end and im.end > start for im in seq.images)
                pieces.append((j, start, end, n <= self.max_paged_queries and not images))
        if not all_logits or self.split_by_origin:  # stable: batch order within each kind
            pieces.sort(key=lambda piece: not piece[3])
        return pieces

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor:
        """The model over one step's inputs: K/V written into the cache, logits of `step.logit_rows`."""
        return self._logits(step, self._hidden(step))

    def _hidden(self, step: StepInputs) -> torch.Tensor:
        self.kv_cache.copy_blocks(step.copies)
        lora_rows = getattr(self.model, "lora_rows", None)
        if lora_rows is None or step.lora_slots is None:
            return self._forward(step)
        lora_rows.set(step.lora_slots)
        try:
            return self._forward(step)
        finally:
            lora_rows.set(None)

    def _forward(self, step: StepInputs) -> torch.Tensor:
        if step.embeds is not None:
            return self.model(step.input_ids, step.meta, embeds=step.embeds)
        return self.model(step.input_ids, step.meta)

    def _image_embeds(self, seq: Sequence, image) -> torch.Tensor:
        """[soft tokens, hidden] of one image: from the encoder cache, or encoded now (the time is
        the sequence's `encoder_time_s`)."""
        cached = self.encoder_cache.get(image.digest)
        if cached is not None:
            self.encoder_cache.move_to_end(image.digest)
            self.encoder_stats["encoder_cache_hits"] += 1
            return cached
        if self.vision is None:
            raise RuntimeError("a sequence with images reached a model without a vision encoder")
        start = time.perf_counter()
        out = self.vision(image.pixels[None].to(self.device))[0]
        assert out.shape[0] == image.length, f"the encoder gave {out.shape[0]} vectors for {image.length} tokens"
        elapsed = time.perf_counter() - start
        seq.encoder_time_s += elapsed
        self.encoder_stats["images_encoded"] += 1
        self.encoder_stats["encoder_time_s"] += elapsed
        self.encoder_cache[image.digest] = out
        self._encoder_cache_used += out.nbytes
        while self._encoder_cache_used > self.encoder_cache_bytes and len(self.encoder_cache) > 1:
            self._encoder_cache_used -= self.encoder_cache.popitem(last=False)[1].nbytes
        return out

    def _logits(self, step: StepInputs, hidden: torch.Tensor) -> torch.Tensor:
        if step.logit_rows is None:
            return self.model.logits(hidden)
        if not len(step.logit_rows):
            return hidden.new_empty(0, self.model.config.vocab_size)
        return self.model.logits(hidden[step.logit_rows])
