"""LFM2 end to end against transformers on the same random weights, from a Hugging Face folder and
from llama.cpp's converter (F32, and Q8_0 that must load and generate): float32 logits and greedy
tokens; the engine's behaviours (chunked prefill, speculation, the prefix cache, preemption, forks)
keep greedy output exact on its convolution states."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_architectures import GREEDY_TOKENS, PROMPTS, TEXT as ATTENTION_TEXT, assert_greedy_matches
from tiny_recurrent import VOCAB, load_reference, no_fused_kernels, save_random_model

from wallbreaker import LLM, SamplingParams

TEXT = ATTENTION_TEXT + " A short convolution keeps the last few inputs of each channel: a state of fixed size."
GREEDY = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)


def lfm2_config():
    """Two convolutions and two attention layers; an FFN width that `block_auto_adjust_ff_dim`
    changes (2/3 of 300 = 200, rounded up to 224), so that a loader ignoring it fails."""
    from transformers import Lfm2Config
    return Lfm2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=300, block_multiple_of=32,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      layer_types=["conv", "full_attention", "conv", "full_attention"], tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)


@pytest.fixture(scope="session")
def lfm2_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model(lfm2_config(), tmp_path_factory.mktemp("lfm2") / "hf")


@pytest.fixture(scope="session")
def lfm2_gguf(lfm2_folder: Path, llamacpp_converter) -> Callable:
    from llamacpp_converter import convert

    def get(outtype: str) -> Path:
        return convert(llamacpp_converter, lfm2_folder, outtype, lfm2_folder.parent / f"lfm2-{outtype}.gguf")
    return get


@pytest.fixture(scope="module")
def reference(lfm2_folder: Path):
    return load_reference(lfm2_folder)


def test_transformers_runs_its_own_torch_path():
    assert no_fused_kernels() == []


@pytest.mark.parametrize("source", ["hf", "f32"])
def test_matches_transformers(lfm2_folder, lfm2_gguf, reference, source):
    path = lfm2_folder if source == "hf" else lfm2_gguf(source)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_gb=0.05)
    cfg = llm.model_config
    assert cfg.layer_types == ("conv", "full", "conv", "full") and cfg.intermediate_size == 224
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert len(ids) >= 40
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    error = (llm.logits(ids) - expected).abs().max() / (expected.max() - expected.min())
    assert error.item() < 1e-4
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for p, out in zip(prompts, outs):
        assert len(out.outputs[0].token_ids) == GREEDY_TOKENS
        assert_greedy_matches(reference, p, out.outputs[0].token_ids)


def test_q8_0_gguf_loads_and_generates(lfm2_gguf, reference):
    """The converter's Q8_0 (the projections quantized; the convolution's 3 taps a row stay F32), on
    the float32 path and on the packed one: close to transformers, not equal."""
    path = lfm2_gguf("q8_0")
    ids = None
    for dtype in ("float32", "auto"):
        llm = LLM(str(path), dtype=dtype, kv_cache_memory_gb=0.05)
        ids = ids or llm.tokenizer.encode(TEXT)[:60]
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0]
        got = llm.logits(ids)
        assert torch.isfinite(got).all()
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.8
        outs = llm.generate([{"prompt_token_ids": llm.tokenizer.encode(p)} for p in PROMPTS], GREEDY)
        assert all(len(o.outputs[0].token_ids) == GREEDY_TOKENS for o in outs)


def test_any_chunking_gives_the_logits_of_one_pass(lfm2_folder):
    llm = LLM(str(lfm2_folder), dtype="float32", kv_cache_memory_gb=0.05, kv_block_size=4)
    ids = llm.tokenizer.encode(TEXT)[:45]
    full = llm.logits(ids)
    for chunk in (1, 5, 7):
        assert (llm.logits(ids, chunk_size=chunk) - full).abs().max().item() < 1e-4
