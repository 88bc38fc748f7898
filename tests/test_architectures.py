"""Each architecture against transformers on the same random weights, read from a Hugging Face
folder and from a GGUF in llama.cpp's naming and layout (tiny_models: our writer; checked by hand
against llama.cpp's own converter): float32 logits and greedy tokens."""
from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
from tiny_recurrent import assert_any_chunking_gives_one_pass_logits, assert_matches_reference

from wallbreaker import LLM
from wallbreaker.config import ModelConfig
from wallbreaker.layers.rotary import RotaryEmbedding

KINDS = ["llama3", "mistral", "qwen3", "qwen3-yarn", "phi3", "phi3-longrope", "gemma2", "mixtral", "qwen3moe"]
TEXT = ("A paged cache keeps keys and values in fixed blocks, so that many sequences can share one pool. "
        "The quick brown fox jumps over the lazy dog; def main(): return x + y")


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tiny_of):
    return tiny_of(request.param)


@pytest.fixture(scope="module")
def reference(tiny):
    return tiny.load_hf()


def same_rotation(a: ModelConfig, b: ModelConfig) -> bool:
    """The RoPE of `a` and `b` turns every position alike (llama.cpp's files state Llama 3's and
    LongRoPE's scaling in another form than transformers' config)."""
    positions = torch.arange(0, max(a.max_position_embeddings, b.max_position_embeddings), 7)
    ra, rb = (RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling).cos_sin(positions) for c in (a, b))
    return all(torch.allclose(x, y, rtol=0, atol=1e-4) for x, y in zip(ra, rb))  # float32 factors: ~1e-7 an angle


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_matches_transformers(tiny, reference, source):
    llm = LLM(str(tiny.gguf_path if source == "gguf" else tiny.hf_dir), dtype="float32", kv_cache_memory_gb=0.05)
    got = llm.model_config
    assert same_rotation(got, tiny.config)
    assert dataclasses.replace(got, rms_norm_eps=tiny.config.rms_norm_eps, rope_scaling=None) == \
        dataclasses.replace(tiny.config, rope_scaling=None)
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert len(ids) >= 30 and len(ids) > (tiny.config.sliding_window or 0)
    assert_matches_reference(llm, reference, ids)


def test_incremental_decoding_equals_one_full_pass(tiny):
    """Decode steps against the paged cache (the C++ kernel: soft caps, windows) agree with prefill."""
    llm = LLM(str(tiny.gguf_path), dtype="float32", kv_cache_memory_gb=0.05, kv_block_size=4)
    assert_any_chunking_gives_one_pass_logits(llm, llm.tokenizer.encode(TEXT)[:40])


def test_llama3_gguf_carries_its_rope_scaling_as_rope_freqs(tiny_of):
    """llama.cpp's form: one divisor per frequency in `rope_freqs.weight`, which the loader reads."""
    tiny = tiny_of("llama3")
    reader = gguf.GGUFReader(tiny.gguf_path)
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    assert freqs.data.shape == (tiny.config.head_dim // 2,) and freqs.data.max() > 1.0
    scaling = LLM(str(tiny.gguf_path), dtype="float32").model_config.rope_scaling
    assert scaling.kind == "llama3" and scaling.freq_factors == pytest.approx(freqs.data.tolist())


@pytest.mark.parametrize("kind", ["mixtral", "qwen3moe"])
def test_experts_run_packed_on_the_auto_path(tiny_of, kind):
    """Quantized experts keep their stored blocks (one QuantLinear per expert), and stay accurate."""
    from wallbreaker.layers.linear import QuantLinear

    path = tiny_of(kind).quantized_gguf(gguf.GGMLQuantizationType.Q4_0)
    reference = torch.log_softmax(LLM(path, dtype="float32").logits(TEXT), -1)
    llm = LLM(path, dtype="auto")
    moe = llm.model.layers[0].mlp
    assert all(isinstance(m, QuantLinear) and m.qtypes == [int(gguf.GGMLQuantizationType.Q4_0)] * len(m.qtypes)
               for m in (*moe.gate_up, *moe.down))
    kl = (reference.exp() * (reference - torch.log_softmax(llm.logits(TEXT), -1))).sum(-1).mean()
    assert kl.item() < 5e-3
