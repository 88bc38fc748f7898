"""`_C.DecoderPlan` (csrc/decoder_plan.cpp): the Llama-family layer stack run from C++ on steps of a
few tokens per sequence must give exactly what the layers' Python `forward` gives, token for token
and logit for logit, on every variant it takes (biases, q/k norms, a sliding window, int8 pages,
several sequences, speculative verification), and must not take a model it cannot run."""
from __future__ import annotations

import pytest

from wallbreaker import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time there was", "def main(): return x + y * 2 " * 3]


def _run(llm: LLM, planned: bool, prompts: list[str] = PROMPTS, lora_request=None, **params) -> list:
    plan = llm.engine.runner.model.decoder_plan
    plan.enabled = planned
    plan.reset()
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, **params)
    outs = llm.generate(prompts, sp, lora_request=lora_request)
    assert (plan._plan is not None) == planned  # the plan ran exactly when asked
    return [(c.token_ids, c.logprobs, c.top_logprobs) for out in outs for c in out.outputs]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_decoder_plan_is_bit_identical_to_the_layers(tiny_of, kind):
    llm = LLM(str(tiny_of(kind).gguf_path), enable_prefix_caching=False)
    assert llm.engine.runner.model.decoder_plan.enabled
    assert _run(llm, True) == _run(llm, False)


@pytest.mark.parametrize("kind, kv_dtype", [("llama", "int8"), ("qwen2", "int8"), ("qwen2", "fp8")])
def test_decoder_plan_with_quantized_pages_and_speculation(tiny_of, kind, kv_dtype):
    """int8 and fp8 pages, with the K/V offsets Qwen2's biases give them, under n-gram speculation."""
    llm = LLM(str(tiny_of(kind).gguf_path), kv_cache_dtype=kv_dtype, speculative_method="ngram",
              num_speculative_tokens=3, enable_prefix_caching=False)
    assert _run(llm, True) == _run(llm, False)


def test_decoder_plan_with_sampled_forks(tiny_qwen2):
    llm = LLM(str(tiny_qwen2.gguf_path), enable_prefix_caching=False)
    planned = _run(llm, True, n=3, seed=7)
    assert planned == _run(llm, False, n=3, seed=7)


def test_decoder_plan_on_a_batch_past_the_dense_threshold(tiny_llama):
    """Steps of 40 rows: where the CPU has the dense path (AMX), its calls go there in both."""
    llm = LLM(str(tiny_llama.gguf_path), enable_prefix_caching=False, max_num_seqs=64)
    prompts = [f"{p} {i}" for i in range(14) for p in PROMPTS][:40]
    assert _run(llm, True, prompts) == _run(llm, False, prompts)


@pytest.mark.parametrize("invariant", [True, False])
def test_decoder_plan_with_lora_adapters_is_bit_identical_to_the_layers(tiny_llama, tmp_path, invariant):
    """Two adapters and the base model in one batch: the plan adds each row's adapter delta with the
    same ops in the same order as the layers (in batch-invariant mode, in calls of 16 rows)."""
    from tiny_lora import make_peft_adapter

    from wallbreaker import LoRARequest
    adapters = [make_peft_adapter(tiny_llama, tmp_path / f"a{i}", seed=i) for i in (1, 2)]
    llm = LLM(str(tiny_llama.gguf_path), enable_prefix_caching=False, enable_lora=True, max_loras=2,
              max_lora_rank=8, batch_invariant=invariant)
    loras = [LoRARequest("a1", 1, str(adapters[0])), None, LoRARequest("a2", 2, str(adapters[1]))]
    planned = _run(llm, True, lora_request=loras)
    assert planned == _run(llm, False, lora_request=loras)
    assert planned != _run(llm, True)  # the adapters change the tokens, so the comparison means something


def test_decoder_plan_follows_a_rebound_kv_pool(tiny_llama):
    llm = LLM(str(tiny_llama.gguf_path), enable_prefix_caching=False)
    model = llm.engine.runner.model
    first = _run(llm, True)
    old = model.decoder_plan._plan
    for layer in model.layers:  # what a new pool's binding does: new LayerKV objects
        layer.attn.kv = type(layer.attn.kv)(*layer.attn.kv)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=3))
    assert model.decoder_plan._plan is not old
    assert _run(llm, True) == first


@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe"])
def test_decoder_plan_is_not_taken_where_it_cannot_run(tiny_of, kind):
    llm = LLM(str(tiny_of(kind).gguf_path))
    assert not llm.engine.runner.model.decoder_plan.enabled


def test_decoder_plan_is_not_taken_on_the_float_path(tiny_llama):
    llm = LLM(str(tiny_llama.gguf_path), dtype="float32")
    assert not llm.engine.runner.model.decoder_plan.enabled


def test_decoder_plan_is_not_taken_by_a_recurrent_model(recurrent_folder):
    llm = LLM(str(recurrent_folder("lfm2")))
    assert not llm.engine.runner.model.decoder_plan.enabled
