"""Beam search on the paged cache: beams are sequences that fork from their parent's block table,
so a prompt and every common prefix is stored once; a forked partial tail is copied on write.

Under `structured_outputs` each beam holds its own copy of the grammar's matcher: candidates are
ranked by log-probabilities renormalized over the tokens the grammar allows, and a beam whose
grammar is complete is finished."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidRequestError
from ..layers.sampler import apply_token_mask, top_logprobs
from ..sampling_params import SamplingParams, StructuredOutputsParams
from .detokenizer import IncrementalDetokenizer
from .llm_engine import LLMEngine
from .scheduler import StepOutput
from .sequence import Sequence


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated tokens (no prompt)
    cumulative_logprob: float
    text: str = ""
    finish_reason: str = "length"
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)  # best first


def beam_score(num_tokens: int, cumulative_logprob: float, length_penalty: float) -> float:
    """vLLM's: the cumulative logprob over (sequence length incl. prompt) ** length_penalty."""
    return cumulative_logprob / (num_tokens ** length_penalty)


def beam_search(engine: LLMEngine, prompts: list[list[int]], beam_width: int, max_tokens: int,
                length_penalty: float = 1.0, ignore_eos: bool = False,
                structured_outputs: StructuredOutputsParams | dict | None = None) -> list[BeamSearchOutput]:
    if beam_width < 1 or max_tokens < 1:
        raise InvalidRequestError("beam_width and max_tokens must be at least 1")
    if engine.has_unfinished():
        raise InvalidRequestError("beam search runs on an idle engine")
    scheduler = engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=structured_outputs)
    grammar = engine.structured.compile(params.structured_outputs) if params.structured_outputs else None
    beams: list[list[tuple[Sequence, float]]] = []
    for ids in prompts:
        if not ids or len(ids) + max_tokens > engine.max_model_len:
            raise InvalidRequestError("each beam-search prompt must be non-empty and fit max_model_len with max_tokens")
        seq = _sequence(engine, ids, params)
        seq.grammar = grammar.matcher() if grammar is not None else None
        beams.append([(seq, 0.0)])
    completed: list[list[tuple[Sequence | list[int], float, str]]] = [[] for _ in prompts]
    try:
        for step in range(max_tokens):
            live = [(p, seq, cum) for p, group in enumerate(beams) for seq, cum in group]
            if not live:
                break
            batch = scheduler.schedule_these([seq for _, seq, _ in live])
            if len(batch) < len(live) or any(s.num_computed_tokens + n != s.num_tokens
                                             for s, n in zip(batch.seqs, batch.num_new_tokens)):
                raise InvalidRequestError("the KV cache is too small for this beam search")
            seqs, logits = engine.runner.run(batch)
            scheduler.update_from_output(batch, StepOutput())
            logits = logits.float()
            mask = engine.structured.step_mask(seqs)
            if mask is not None:
                logits = logits.clone()  # (out of the model's inference mode: a tensor of our own to mask)
                apply_token_mask(logits, mask)
            logprobs = torch.log_softmax(logits, dim=-1).nan_to_num_(nan=float("-inf"))  # [beams, V]
            best = top_logprobs(logprobs, 2 * beam_width)  # per beam
            row_of = {id(s): i for i, s in enumerate(seqs)}
            new_beams: list[list[tuple[Sequence, float]]] = []
            for p, group in enumerate(beams):
                candidates = []
                for seq, cum in group:
                    candidates += [(cum + v, seq, t) for t, v in best[row_of[id(seq)]]]
                candidates.sort(key=lambda c: -c[0])
                chosen = []
                for cum, parent, token in candidates:
                    if len(chosen) == beam_width:
                        break
                    if cum == float("-inf"):  # a token the grammar forbids
                        break
                    if token in engine.eos_token_ids and not ignore_eos:
                        completed[p].append((parent.token_ids[parent.num_prompt_tokens:] + [token], cum, "stop"))
                        continue
                    child = _sequence(engine, parent.prompt_token_ids, params, parent.token_ids + [token])
                    if parent.grammar is not None:
                        child.grammar = parent.grammar.fork()
                        child.grammar.accept(token)
                        if child.grammar.is_stopped:  # complete: nothing may follow
                            completed[p].append((child.output_token_ids, cum, "stop"))
                            continue
                    scheduler.fork(parent, child)
                    chosen.append((child, cum))
                for seq, _ in group:
                    scheduler.free(seq)
                new_beams.append(chosen)
            beams = new_beams
        for p, group in enumerate(beams):
            completed[p] += [(seq.output_token_ids, cum, "length") for seq, cum in group]
    finally:
        for group in beams:
            for seq, _ in group:
                scheduler.free(seq)
    outputs = []
    for ids, done in zip(prompts, completed):
        seqs = []
        for tokens, cum, reason in done:
            eos = reason == "stop" and tokens[-1] in engine.eos_token_ids and not ignore_eos
            length = len(ids) + len(tokens) - (1 if eos else 0)
            text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
            seqs.append(BeamSequence(tokens, cum, text, reason, beam_score(length, cum, length_penalty)))
        seqs.sort(key=lambda s: -s.score)
        outputs.append(BeamSearchOutput(list(ids), seqs[:beam_width]))
    return outputs


def _sequence(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams,
              token_ids: list[int] | None = None) -> Sequence:
    detok = IncrementalDetokenizer(engine.tokenizer, prompt_ids, [])
    return Sequence(-1, "beam", 0, list(token_ids or prompt_ids), len(prompt_ids), params, detok)
