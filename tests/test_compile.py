"""The compiled decode step (`compile=True`) computes what the eager one does.

The reference is the eager engine (itself pinned to transformers in test_parity): in float32 the two
must give the same greedy tokens and the same logprobs to float tolerance, for batches that grow,
shrink and cross block boundaries, on both attention variants (global and sliding window).
"""
from __future__ import annotations

import random

import pytest
import torch

from wallbreaker import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)


def prompts(vocab: int, count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]} for _ in range(count)]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_compiled_decode_equals_eager(arch, request):
    tiny = request.getfixturevalue(arch)
    options = dict(dtype="float32", kv_block_size=4, kv_cache_memory_gb=0.02, max_num_batched_tokens=48)
    eager = LLM(str(tiny.gguf_path), **options)
    compiled = LLM(str(tiny.gguf_path), compile=True, **options)
    assert compiled.engine.runner.decode_forward != compiled.model.forward
    batch = prompts(eager.model_config.vocab_size, 12)
    want = eager.generate(batch, PARAMS)  # a small token budget: prompts arrive while others decode
    got = compiled.generate(batch, PARAMS)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(g.outputs[0].logprobs), torch.tensor(w.outputs[0].logprobs),
                                   atol=1e-4, rtol=0)
    alone = compiled.generate([batch[0]], PARAMS)[0]
    assert alone.outputs[0].token_ids == want[0].outputs[0].token_ids


def test_two_compiled_models_in_one_process_keep_their_own_graphs(tiny_llama, tiny_qwen2):
    """Module guards are skipped for speed; each model's own code object keeps graphs apart."""
    first = LLM(str(tiny_llama.gguf_path), dtype="float32", compile=True, kv_cache_memory_gb=0.02)
    second = LLM(str(tiny_qwen2.gguf_path), dtype="float32", compile=True, kv_cache_memory_gb=0.02)
    for llm, tiny in ((first, tiny_llama), (second, tiny_qwen2), (first, tiny_llama)):
        eager = LLM(str(tiny.gguf_path), dtype="float32", kv_cache_memory_gb=0.02)
        batch = prompts(llm.model_config.vocab_size, 3, seed=1)
        assert ([o.outputs[0].token_ids for o in llm.generate(batch, PARAMS)]
                == [o.outputs[0].token_ids for o in eager.generate(batch, PARAMS)])


def test_compiled_decode_under_speculation_keeps_greedy_output(tiny_llama):
    """Verify steps (1 + K tokens a sequence) run eagerly, plain decode steps compiled: together they
    still give plain greedy decoding's tokens."""
    options = dict(dtype="float32", kv_cache_memory_gb=0.02)
    plain = LLM(str(tiny_llama.gguf_path), **options)
    spec = LLM(str(tiny_llama.gguf_path), compile=True, speculative_method="ngram", num_speculative_tokens=3,
               **options)
    rng = random.Random(2)
    phrase = [rng.randrange(3, 500) for _ in range(6)]
    batch = [{"prompt_token_ids": phrase * 4}, *prompts(plain.model_config.vocab_size, 3, seed=3)]
    want = [o.outputs[0].token_ids for o in plain.generate(batch, PARAMS)]
    assert [o.outputs[0].token_ids for o in spec.generate(batch, PARAMS)] == want
    assert spec.engine.counters["spec_proposed"] > 0
