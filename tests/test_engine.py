"""Continuous batching on the paged cache: exactness whatever the batch, preemption, sharing,
prefix caching, beam search, and no leaked blocks."""
from __future__ import annotations

import random

import pytest
import torch

from wallbreaker import LLM, InvalidRequestError, SamplingParams
from wallbreaker.engine.client import EngineRequest
from wallbreaker.kv.cache import bytes_per_block

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts_of_mixed_lengths(llm: LLM, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))] for _ in range(count)]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tiny_of):
    return tiny_of(request.param)


@pytest.fixture(scope="module")
def model_dir(tiny):
    return str(tiny.hf_dir)


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_gb", 0.02)
    return LLM(model_dir, dtype="float32", **kw)


def alone(llm: LLM, prompts, params) -> list[list[int]]:
    return [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]


def test_batched_and_continuous_greedy_equals_each_prompt_alone(model_dir):
    llm = make_llm(model_dir, kv_block_size=4, max_num_batched_tokens=64)
    prompts = prompts_of_mixed_lengths(llm, 32)
    expected = alone(llm, prompts, GREEDY)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in together] == expected
    # requests arriving while others decode
    engine = llm.engine
    ids, pending, done = [], list(enumerate(prompts)), {}
    while pending or engine.has_unfinished():
        for _ in range(3):
            if pending:
                i, p = pending.pop(0)
                ids.append((i, engine.add_request(EngineRequest(p, GREEDY))))
        done.update((o.request_id, o) for o in engine.step().finished)
    assert [done[rid].outputs[0].token_ids for _, rid in ids] == expected
    assert llm.stats()["kv_blocks_used"] == 0


def test_preemption_under_a_tiny_pool_loses_and_corrupts_nothing(model_dir):
    reference = make_llm(model_dir, kv_block_size=4)
    prompts = prompts_of_mixed_lengths(reference, 16, seed=1)
    expected = alone(reference, prompts, GREEDY)
    tiny_pool = make_llm(model_dir, kv_block_size=4, kv_cache_memory_gb=64 * bytes_per_block(reference.model_config, 4, torch.float32) / 2**30)
    outs = tiny_pool.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert tiny_pool.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert tiny_pool.stats()["kv_blocks_used"] == 0


def test_seeded_sampling_is_the_same_whatever_else_is_in_the_batch(model_dir):
    llm = make_llm(model_dir)
    prompts = prompts_of_mixed_lengths(llm, 8, seed=2)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    solo = llm.generate([{"prompt_token_ids": prompts[0]}], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True)] * 7
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], [seeded] + others)
    assert mixed[0].outputs[0].token_ids == solo
    again = llm.generate([{"prompt_token_ids": prompts[0]}], seeded)[0].outputs[0].token_ids
    assert again == solo


def test_n_samples_share_the_prompt_blocks_once(model_dir):
    llm = make_llm(model_dir, kv_block_size=16, max_num_batched_tokens=1024)
    prompt = prompts_of_mixed_lengths(llm, 1, seed=3)[0] * 20
    prompt = prompt[:500] if len(prompt) >= 500 else (prompt * 500)[:500]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    engine = llm.engine
    engine.add_request(EngineRequest(prompt, params))
    engine.step()  # the prompt's prefill, then the fork into 8
    prompt_blocks = -(-len(prompt) // 16)
    used = llm.stats()["kv_blocks_used"]
    # one copy of the prompt's blocks, plus at most one private tail block per sample
    assert prompt_blocks <= used <= prompt_blocks + 8
    seqs = engine.scheduler.running
    assert len(seqs) == 8 and all(s.block_table[:-1] == seqs[0].block_table[:-1] for s in seqs)
    finished = []
    while engine.has_unfinished():
        finished += engine.step().finished
    out, = finished
    assert len(out.outputs) == 8 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert llm.stats()["kv_blocks_used"] == 0


def test_prefix_cache_reuses_a_shared_prefix_and_gives_the_same_tokens(model_dir):
    llm = make_llm(model_dir, kv_block_size=16, max_num_batched_tokens=1024)
    base = (prompts_of_mixed_lengths(llm, 1, seed=4)[0] * 100)[:480]
    first = llm.generate([{"prompt_token_ids": base + [5, 6]}], GREEDY)[0]
    hits_before = llm.stats()["prefix_cache_hits"]
    second = llm.generate([{"prompt_token_ids": base + [5, 6]}], GREEDY)[0]
    assert llm.stats()["prefix_cache_hits"] - hits_before == 480 // 16
    assert second.metrics["num_cached_prompt_tokens"] == 480
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    cold = make_llm(model_dir, kv_block_size=16, max_num_batched_tokens=1024, enable_prefix_caching=False)
    assert cold.generate([{"prompt_token_ids": base + [5, 6]}], GREEDY)[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert cold.stats()["prefix_cache_hits"] == 0


def test_kv_waste_stays_small_while_decoding(model_dir):
    llm = make_llm(model_dir, kv_block_size=16)
    engine = llm.engine
    rng = random.Random(5)
    for p in prompts_of_mixed_lengths(llm, 32, seed=5):
        prompt = (p * 500)[: rng.randint(400, 470)]
        engine.add_request(EngineRequest(prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 40),
                                                                ignore_eos=True)))
    worst = 0.0
    while engine.has_unfinished():
        engine.step()
        stats = llm.stats()
        if stats["kv_blocks_used"]:
            worst = max(worst, stats["kv_waste_fraction"])
    # only the partly filled tail block of each sequence wastes slots: < 16 / 400 here
    assert 0 < worst < 0.04


def test_abort_frees_blocks_at_once(model_dir):
    llm = make_llm(model_dir)
    engine = llm.engine
    rid = engine.add_request(EngineRequest(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=100,
                                                                               ignore_eos=True)))
    engine.step()
    engine.step()
    assert llm.stats()["kv_blocks_used"] > 0
    engine.abort(rid)
    assert llm.stats()["kv_blocks_used"] == 0 and not engine.has_unfinished()


def transformers_beam_search(model, prompt: list[int], width: int, steps: int) -> tuple[list[list[int]], list[float]]:
    """Hugging Face's own beam search, no end-of-sequence: every beam's tokens and cumulative logprob."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=steps,
                             min_new_tokens=steps, eos_token_id=None, pad_token_id=0, length_penalty=1.0,
                             early_stopping=False, output_scores=True, return_dict_in_generate=True)
    # its score is the cumulative logprob over the generated length (all beams have `steps` tokens)
    return [s[len(prompt):].tolist() for s in out.sequences], (out.sequences_scores * steps).tolist()


def test_beam_search_matches_transformers_and_shares_blocks(tiny, model_dir):
    llm = make_llm(model_dir, kv_block_size=4)
    hf = tiny.load_hf()
    used: list[int] = []
    run = llm.engine.runner.run

    def counting(batch, *args, **kw):
        used.append(llm.stats()["kv_blocks_used"])  # blocks held as each step runs
        return run(batch, *args, **kw)
    llm.engine.runner.run = counting
    for prompt in prompts_of_mixed_lengths(llm, 3, seed=6) + [list(range(3, 27))]:
        used.clear()
        out = llm.beam_search([{"prompt_token_ids": prompt}], beam_width=4, max_tokens=8, ignore_eos=True)[0]
        tokens, cumulative = transformers_beam_search(hf, prompt, 4, 8)
        assert [s.token_ids for s in out.sequences] == tokens  # all four beams, best first
        assert [s.cumulative_logprob for s in out.sequences] == pytest.approx(cumulative, abs=1e-4)
        if len(prompt) >= 8:  # the prompt's full blocks are held once, not once a beam
            unshared = 4 * -(-(len(prompt) + 7) // 4)
            assert max(used) <= unshared - 3 * (len(prompt) // 4)
    assert llm.stats()["kv_blocks_used"] == 0


def test_bad_requests_are_refused_with_a_clear_error(model_dir):
    llm = make_llm(model_dir, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""])
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 64}])
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([[10**9]])
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.engine.has_unfinished()


def test_stop_strings_cut_the_output_exactly(model_dir):
    llm = make_llm(model_dir)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop and full.find(stop) > 0
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == full[: full.find(stop)] and out.finish_reason == "stop"
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[: full.find(stop) + len(stop)]


def test_stop_reason_names_the_stop_string_or_token_that_ended_the_output(model_dir):
    llm = make_llm(model_dir)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert plain.finish_reason == "length" and plain.stop_reason is None
    stop = plain.text[len(plain.text) // 2: len(plain.text) // 2 + 3]
    by_string = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                       stop=["never in it \x00", stop]))[0].outputs[0]
    assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
    token = plain.token_ids[5]
    by_token = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop_token_ids=[token]))[0].outputs[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token
    assert by_token.token_ids == plain.token_ids[: plain.token_ids.index(token) + 1]
    llm.engine.eos_token_ids = frozenset({token})  # the same token as the model's EOS: no stop reason (vLLM's rule)
    at_eos = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert at_eos.finish_reason == "stop" and at_eos.stop_reason is None
    assert at_eos.token_ids == by_token.token_ids
