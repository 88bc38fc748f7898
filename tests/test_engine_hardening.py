"""One request must never freeze, crash or corrupt the engine for the others (the engine side of
the hardening review): a context larger than the KV pool, a step that fails on one sequence,
padded vocabularies, and drafts from a larger vocabulary."""
from __future__ import annotations

import threading

import pytest
import torch

from tiny_models import write_padded_vocab_model

from wallbreaker import LLM, EngineError, InvalidRequestError, SamplingParams
from wallbreaker.engine.client import EngineRequest
from wallbreaker.engine.model_runner import ModelRunner
from wallbreaker.kv.cache import bytes_per_block

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def pool_gb(config, blocks: int, block_size: int = 16) -> float:
    return blocks * bytes_per_block(config, block_size, torch.float32) / 2**30


def finishes_within(fn, seconds: float):
    """fn() in a daemon thread; its result, or a test failure if it is still running after `seconds`
    (a livelocked engine spins forever)."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return result["value"]


# -- a context larger than the pool -----------------------------------------------------------------
def test_a_model_context_larger_than_the_pool_is_capped_so_one_sequence_can_never_livelock(tiny_llama):
    llm = LLM(tiny_llama.gguf_path, dtype="float32", kv_cache_memory_gb=pool_gb(tiny_llama.config, 4))
    assert llm.max_model_len == 64  # 4 blocks of 16, not the model's 512
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = finishes_within(lambda: llm.generate([[5, 6, 7]], params), 60)[0].outputs[0]
    assert out.finish_reason == "length" and 3 + len(out.token_ids) == 64
    assert llm.stats()["kv_blocks_used"] == 0


def test_an_explicit_max_model_len_beyond_the_pool_is_refused_with_the_numbers(tiny_llama):
    with pytest.raises(InvalidRequestError, match=r"max_model_len 256 .* \(64 tokens\)"):
        LLM(tiny_llama.gguf_path, dtype="float32", max_model_len=256, kv_cache_memory_gb=pool_gb(tiny_llama.config, 4))


def test_max_tokens_beyond_the_context_is_a_clear_error_and_nothing_is_queued(tiny_llama):
    llm = LLM(tiny_llama.gguf_path, dtype="float32", max_model_len=32, kv_cache_memory_gb=0.01)
    with pytest.raises(InvalidRequestError, match=r"max_tokens 30 with a prompt of 3 tokens needs 33"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30))
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=29))[0].outputs[0].token_ids) <= 29


# -- a step that fails ------------------------------------------------------------------------------
POISON = 7  # a token id whose presence in a step makes the (patched) model fail


def poisoned(llm: LLM, monkeypatch) -> None:
    execute = ModelRunner.execute

    def failing_execute(self, step):
        if (step.input_ids == POISON).any():
            raise RuntimeError("kernel fault on token 7")
        return execute(self, step)
    monkeypatch.setattr(llm.engine.runner, "execute", failing_execute.__get__(llm.engine.runner))


def run_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine = llm.engine
    ids = [engine.add_request(EngineRequest(p, params)) for p in prompts]
    done = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        done.update((o.request_id, o) for o in engine.step().finished)
    assert not engine.has_unfinished()
    return {rid: done[rid] for rid in ids}


def test_a_step_failing_on_one_sequence_fails_that_request_alone(tiny_llama, monkeypatch, caplog):
    llm = LLM(tiny_llama.gguf_path, dtype="float32", kv_cache_memory_gb=0.01, kv_block_size=4)
    good = [[11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in good]
    assert all(POISON not in p + out for p, out in zip(good, alone))
    poisoned(llm, monkeypatch)
    outputs = list(run_engine(llm, good[:2] + [[40, POISON, 41]] + good[2:], GREEDY).values())
    bad = outputs.pop(2)
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 3
    assert bad.outputs[0].finish_reason == "error"
    assert llm.stats()["kv_blocks_used"] == 0
    assert "kernel fault on token 7" in caplog.text  # the error is logged, with an id
    with pytest.raises(EngineError, match="1 of 2 requests failed in a model step"):
        llm.generate([good[0], [POISON]], GREEDY)
    assert llm.generate([good[0]], GREEDY)[0].outputs[0].token_ids == alone[0]  # the engine goes on


def test_n_siblings_and_a_failure_before_the_fork_end_together(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama.gguf_path, dtype="float32", kv_cache_memory_gb=0.01)
    poisoned(llm, monkeypatch)
    out = run_engine(llm, [[POISON, 3, 4]], SamplingParams(n=3, max_tokens=4))
    (output,) = out.values()
    assert [c.finish_reason for c in output.outputs] == ["error"]
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_step_that_fails_only_together_is_raised_rather_than_retried_forever(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama.gguf_path, dtype="float32", kv_cache_memory_gb=0.01)
    execute = ModelRunner.execute

    def fails_in_company(self, step):
        if step.input_ids.numel() > 3:
            raise RuntimeError("batching bug")
        return execute(self, step)
    monkeypatch.setattr(llm.engine.runner, "execute", fails_in_company.__get__(llm.engine.runner))
    with pytest.raises(RuntimeError, match="batching bug"):
        run_engine(llm, [[3, 4, 5], [6, 8, 9]], GREEDY)


@pytest.mark.parametrize("bad", [[-1], [10**9], [True], [3.0], "text"])
def test_token_ids_are_checked_before_any_step(tiny_llama, bad):
    llm = LLM(tiny_llama.gguf_path, dtype="float32", kv_cache_memory_gb=0.01)
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request(EngineRequest(bad, GREEDY))
    assert not llm.engine.has_unfinished()


# -- padded vocabularies ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def padded_model(tiny_llama, tmp_path_factory):
    return write_padded_vocab_model(tiny_llama, tmp_path_factory.mktemp("padded")), tiny_llama.config.vocab_size


def test_padded_embedding_rows_are_never_sampled_nor_crash_logprobs(padded_model):
    path, real = padded_model
    llm = LLM(path, dtype="float32", kv_cache_memory_gb=0.01)
    assert llm.model_config.vocab_size == real + 64 and llm.tokenizer.vocab_size == real
    for params in (GREEDY, SamplingParams(temperature=1.0, max_tokens=8, seed=1, logprobs=5, ignore_eos=True)):
        out = llm.generate(["Hello world"], params)[0].outputs[0]
        assert out.token_ids and max(out.token_ids) < real
        for top in out.top_logprobs or []:
            assert all(t < real for t, _ in top)
    beams = llm.beam_search(["Hello world"], beam_width=2, max_tokens=4)[0].sequences
    assert all(max(b.token_ids) < real for b in beams)


def test_a_draft_with_a_larger_padded_vocabulary_never_proposes_ids_the_target_lacks(tiny_llama, padded_model):
    path, real = padded_model
    target = str(tiny_llama.hf_dir)
    plain = LLM(target, dtype="float32", kv_cache_memory_gb=0.01).generate(["Hello world"], GREEDY)
    spec = LLM(target, dtype="float32", kv_cache_memory_gb=0.01, speculative_method="draft",
               speculative_model=str(path), num_speculative_tokens=3, speculative_adaptive=False)
    assert spec.generate(["Hello world"], GREEDY)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert spec.stats()["spec_proposed"] > 0
