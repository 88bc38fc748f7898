"""Each architecture against transformers on the same random weights, read from a Hugging Face
folder and from a GGUF in llama.cpp's naming and layout (tiny_models: our writer; checked by hand
against llama.cpp's own converter): float32 logits and greedy tokens."""
from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

from wallbreaker import LLM, SamplingParams
from wallbreaker.config import ModelConfig
from wallbreaker.layers.rotary import RotaryEmbedding

KINDS = ["llama3", "mistral", "qwen3", "qwen3-yarn", "phi3", "phi3-longrope", "gemma2", "mixtral", "qwen3moe"]
TEXT = ("A paged cache keeps keys and values in fixed blocks, so that many sequences can share one pool. "
        "The quick brown fox jumps over the lazy dog; def main(): return x + y")
PROMPTS = ["The quick brown fox", "Once upon a time there was"]
GREEDY_TOKENS = 12
TIE = 1e-3  # the reference's top two logits this close: either token is right


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


def assert_greedy_matches(model, prompt: list[int], ours: list[int]) -> None:
    """`ours` is the reference's greedy continuation, up to a tie: at the first token that differs,
    the reference's two best logits must be within TIE of each other."""
    ids = list(prompt)
    with torch.no_grad():
        for i, token in enumerate(ours):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2)
            if token != int(top.indices[0]):
                assert float(top.values[0] - top.values[1]) < TIE and token == int(top.indices[1]), \
                    f"token {i}: ours {token}, transformers {int(top.indices[0])} (not a tie)"
                return
            ids.append(token)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_matches_transformers(tiny, reference, source):
    llm = LLM(str(tiny.gguf_path if source == "gguf" else tiny.hf_dir), dtype="float32", kv_cache_memory_gb=0.05)
    got = llm.model_config
    assert same_rotation(got, tiny.config)
    assert dataclasses.replace(got, rms_norm_eps=tiny.config.rms_norm_eps, rope_scaling=None) == \
        dataclasses.replace(tiny.config, rope_scaling=None)
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert len(ids) >= 30 and len(ids) > (tiny.config.sliding_window or 0)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    error = (llm.logits(ids) - expected).abs().max() / (expected.max() - expected.min())
    assert error.item() < 1e-4
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    for p, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == GREEDY_TOKENS
        assert_greedy_matches(reference, p, out.outputs[0].token_ids)


def test_incremental_decoding_equals_one_full_pass(tiny):
    """Decode steps against the paged cache (the C++ kernel: soft caps, windows) agree with prefill."""
    llm = LLM(str(tiny.gguf_path), dtype="float32", kv_cache_memory_gb=0.05, kv_block_size=4)
    ids = llm.tokenizer.encode(TEXT)[:40]
    full = llm.logits(ids)
    assert (llm.logits(ids, chunk_size=1) - full).abs().max().item() < 1e-4
    assert (llm.logits(ids, chunk_size=7) - full).abs().max().item() < 1e-4


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
