"""The quantized KV cache: int8 and fp8 pages (one float32 scale per token and head) hold about
twice the tokens of bfloat16 pages in the same memory; forks, prefix hits, speculation rollback and
beam search work on them unchanged; logits stay within the rounding the pages allow."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from wallbreaker import LLM, SamplingParams
from wallbreaker.config import EngineConfig, ModelConfig
from wallbreaker.kv.cache import QUANTIZED_KV_DTYPES, KVCache, bytes_per_block, default_num_blocks

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 23, 7, 100, 31, 8], [200, 17, 17, 44, 3, 81, 250, 12, 9, 66, 71, 5, 5, 19, 301, 40, 2]]


def engine(tiny, kv: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_gb", 0.01)
    path = tiny if isinstance(tiny, Path) else tiny.gguf_path
    return LLM(path, dtype="float32", kv_cache_dtype=kv, kv_block_size=4, **kw)


SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64)  # head_dim 64
QWEN_1_5B = ModelConfig("qwen2", 151936, 1536, 8960, 28, 12, 2, 128)  # head_dim 128


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("shape", [SMOLLM2, QWEN_1_5B], ids=["smollm2", "qwen2.5-1.5b"])
def test_quantized_pages_hold_at_least_1_8x_the_blocks_of_bf16_in_the_same_memory(kv, shape):
    config = EngineConfig(kv_cache_memory_gb=1.0, kv_cache_dtype=kv)
    blocks = default_num_blocks(shape, 16, config.kv_cache_torch_dtype, 1.0, 10**9)
    bf16 = default_num_blocks(shape, 16, torch.bfloat16, 1.0, 10**9)
    assert blocks >= 1.8 * bf16


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_the_pool_counts_its_scales(tiny_llama, kv):
    llm = engine(tiny_llama, kv, kv_cache_memory_gb=0.05)
    dtype = llm.kv_cache.dtype
    assert dtype in QUANTIZED_KV_DTYPES and llm.kv_cache.scales is not None
    blocks = llm.stats()["kv_blocks_total"]
    assert llm.kv_cache.nbytes == blocks * bytes_per_block(tiny_llama.config, 4, dtype) <= 0.05 * 2**30
    bf16 = engine(tiny_llama, "bfloat16", kv_cache_memory_gb=0.05).stats()["kv_blocks_total"]
    assert blocks > 1.5 * bf16  # head_dim 16: a 4-byte scale is a quarter of a 16-byte row


@pytest.fixture(scope="module")
def biased_qwen2(tiny_qwen2, tmp_path_factory) -> Path:
    """tiny_qwen2 with Qwen2.5-Coder-1.5B's kind of K bias: on the two slowest RoPE channels of every
    KV head, +-300 where the rest of K is about 1 (the real model's reaches 354)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("biased-qwen2")
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2.hf_dir, dtype=torch.float32)
    c = tiny_qwen2.config
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(c.num_kv_heads, c.head_dim)
            bias[:, [c.head_dim // 2 - 1, c.head_dim - 1]] = torch.tensor([300.0, -300.0])
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen2.hf_dir / name, out / name)
    return out


def logits_error(tiny, kv: str, chunk: int | None) -> float:
    """Max |logit difference| over a 40-token text against float32 pages, relative to the logits' range."""
    ids = [(7 * i + 3) % 500 + 3 for i in range(40)]
    exact = engine(tiny, "float32").logits(ids, chunk_size=chunk)
    got = engine(tiny, kv).logits(ids, chunk_size=chunk)
    return float((got - exact).abs().max() / (exact.max() - exact.min()))


@pytest.mark.parametrize("chunk", [None, 1])  # the whole text at once (SDPA over dequantized context), token by token (the paged kernel)
@pytest.mark.parametrize("kv,tolerance", [("bfloat16", 0.005), ("int8", 0.012), ("fp8", 0.05)])
def test_logits_over_quantized_pages_stay_within_their_rounding(tiny_llama, chunk, kv, tolerance):
    """int8 rounds each value to 1/254 of its row's range, fp8 e4m3 to 1/16 of its own magnitude;
    bf16 (the default pages) to 1/256. The tolerances are a few times that, through four layers."""
    assert logits_error(tiny_llama, kv, chunk) < tolerance


@pytest.mark.parametrize("chunk", [None, 1])
@pytest.mark.parametrize("kv,tolerance", [("int8", 0.012), ("fp8", 0.025)])
def test_a_large_kv_bias_is_left_out_of_the_rounding(biased_qwen2, chunk, kv, tolerance):
    """With the bias in every row, one scale per token and head would round the rest of K to a few
    levels (int8) and fp8 would round the bias itself by up to 1/16 (errors measured without the
    offsets: int8 0.12-0.14, fp8 0.045-0.074). The pages hold K and V less their biases (measured
    with them: int8 0.003-0.004, fp8 0.012-0.013, below bfloat16 pages' 0.042 on this model)."""
    assert logits_error(biased_qwen2, kv, chunk) < tolerance


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_prefix_hits_forks_and_speculation_give_the_same_tokens_on_quantized_pages(tiny_llama, kv):
    """Every path writes a token's K/V through the same quantizer, so reuse and rollback are exact."""
    plain = engine(tiny_llama, kv, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]

    cached = engine(tiny_llama, kv)
    assert [o.outputs[0].token_ids for o in cached.generate(PROMPTS, GREEDY)] == expected
    again = cached.generate(PROMPTS, GREEDY)  # the prompts' full blocks now come from the prefix cache
    assert [o.outputs[0].token_ids for o in again] == expected
    assert cached.stats()["prefix_cache_hits"] > 0

    forked = cached.generate(PROMPTS, SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True))
    assert all([c.token_ids for c in o.outputs] == [e] * 3 for o, e in zip(forked, expected))

    spec = engine(tiny_llama, kv, speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False)
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, GREEDY)] == expected
    assert spec.stats()["spec_proposed"] > 0

    beams = cached.beam_search([PROMPTS[0]], beam_width=3, max_tokens=6)[0].sequences
    assert len(beams) == 3 and beams[0].token_ids == expected[0][:6]
    for llm in (cached, spec):
        assert llm.stats()["kv_blocks_used"] == 0


def test_copy_on_write_copies_the_scales_too(tiny_llama):
    cache = KVCache(tiny_llama.config, num_blocks=4, block_size=4, dtype=torch.int8)
    cache.tensor[:, :, :, 4:8] = 7
    cache.scales[:, :, :, 4:8] = 0.25
    cache.copy_blocks([(1, 3)])
    assert torch.equal(cache.tensor[..., 12:16, :], cache.tensor[..., 4:8, :])
    assert torch.equal(cache.scales[..., 12:16], cache.scales[..., 4:8])


def test_an_unknown_kv_cache_dtype_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        engine(tiny_llama, "int4")
