"""Parity with Hugging Face transformers on the same weights (float32): logits, greedy tokens,
tokenization; and incremental decoding through the paged cache against one full pass."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from wallbreaker import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "def main(): return x + y",
    "Numbers: 1 2 3",
    "Hello, world! How are",
    "Unicode: café, naïve, 日本語",
    "A paged cache keeps keys and values in fixed blocks, so that many sequences can share one pool",
    "\tTabs\tand  double  spaces.",
]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by full forward passes: no cache, nothing shared with the code under test."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def tiny(request):
    return request.getfixturevalue(f"tiny_{request.param}")


@pytest.fixture(scope="module")
def reference(tiny):
    from transformers import AutoTokenizer
    return tiny.load_hf(), AutoTokenizer.from_pretrained(tiny.hf_dir)


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_tiny_model_matches_transformers(tiny, reference, source):
    model, tokenizer = reference
    llm = LLM(str(tiny.gguf_path if source == "gguf" else tiny.hf_dir), dtype="float32", kv_cache_memory_gb=0.05)
    assert llm.model_config.rms_norm_eps == pytest.approx(tiny.config.rms_norm_eps, rel=1e-6)  # float32 in GGUF
    assert dataclasses.replace(llm.model_config, rms_norm_eps=tiny.config.rms_norm_eps) == tiny.config
    for prompt in PROMPTS:
        assert llm.tokenizer.encode(prompt) == tokenizer(prompt)["input_ids"], prompt
    ids = llm.tokenizer.encode(" ".join(PROMPTS))[:60]  # longer than Gemma's sliding window of 16
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    assert (llm.logits(ids) - expected).abs().max().item() < 1e-4
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for p, out in zip(prompt_ids, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, p, 32)


def test_incremental_decoding_equals_one_full_pass(tiny):
    llm = LLM(str(tiny.gguf_path), dtype="float32", kv_cache_memory_gb=0.05, kv_block_size=4)
    ids = llm.tokenizer.encode(" ".join(PROMPTS))[:50]
    full = llm.logits(ids)
    step_by_step = llm.logits(ids, chunk_size=1)  # each position a decode step against the cache
    chunked = llm.logits(ids, chunk_size=7)  # chunks that straddle blocks
    assert (step_by_step - full).abs().max().item() < 1e-4
    assert (chunked - full).abs().max().item() < 1e-4


REAL = ["smollm2", "gemma3-270m", "qwen2.5-coder-0.5b"]


@pytest.mark.real_model
@pytest.mark.parametrize("alias", REAL)
def test_real_model_matches_transformers(alias, packaged_model):
    path = packaged_model(alias)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref.generation_config.eos_token_id = None  # 32 tokens each, like ignore_eos below
    llm = LLM(alias, dtype="float32", kv_cache_memory_gb=0.5)
    prompts = ["The capital of France is", "def quicksort(arr):", "Once upon a time, in a land far away,",
               "The three primary colors are", "import numpy as np\n\nx = np.", "Q: What is 12 * 7?\nA:",
               "La capitale de la France est", "Photosynthesis is the process by which"]
    prompt_ids = [llm.tokenizer.encode(p) for p in prompts]
    for p, ids in zip(prompts, prompt_ids):
        assert ids == ref_tok(p)["input_ids"], p
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for ids, out in zip(prompt_ids, outs):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()
    ids = prompt_ids[0] + outs[0].outputs[0].token_ids
    with torch.no_grad():
        expected_last = ref(torch.tensor([ids])).logits[0, -1]
    assert (llm.logits(ids)[-1] - expected_last).abs().max().item() < 1e-3


def test_auto_path_runs_a_tied_4bit_embedding(tiny_qwen2):
    """Qwen2's head is tied; stored as Q4_0 it stays Q4_0 blocks for the head and rows come from the blocks."""
    import gguf
    from wallbreaker.layers.embedding import QuantizedEmbedding
    from wallbreaker.layers.linear import QuantLinear
    path = tiny_qwen2.quantized_gguf(gguf.GGMLQuantizationType.Q4_0)
    exact = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.02)
    packed = LLM(str(path), dtype="auto", kv_cache_memory_gb=0.02)
    head, embed = packed.model.lm_head, packed.model.embed
    assert isinstance(head, QuantLinear) and head.qtypes == [gguf.GGMLQuantizationType.Q4_0]
    assert isinstance(embed, QuantizedEmbedding) and embed.rows.data_ptr() == head.blocks[0].data_ptr()  # one copy
    stored = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    table = torch.from_numpy(gguf.quants.dequantize(stored.data, stored.tensor_type))  # the gguf package's reading
    ids = exact.tokenizer.encode(" ".join(PROMPTS))[:40]
    assert torch.equal(embed(torch.tensor(ids)), table[ids])  # each row, exactly, from the stored blocks
    a, b = exact.logits(ids), packed.logits(ids)
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99
