"""Pure Mamba2 (models/mamba2.py) end to end against transformers' Mamba2ForCausalLM on the same
random weights, from the Hugging Face folder and from llama.cpp's converter's GGUF (F32; Q8_0 loads
and runs), and a model with no attention at all: no KV pages. The engine's behaviours on its states
are tests/test_recurrent_engine.py's."""
from __future__ import annotations

import dataclasses

import pytest

from llamacpp_converter import convert
from tiny_recurrent import (GREEDY, PROMPTS, TEXT, assert_generates, assert_matches_reference, holds_only_checkpoints,
                            load_reference, logits_error, make_llm)
from wallbreaker import LLM


@pytest.fixture(scope="session")
def folder(recurrent_folder):
    return recurrent_folder("mamba2")


@pytest.fixture(scope="module")
def gguf_of(folder, llamacpp_converter):
    def get(outtype: str):
        return convert(llamacpp_converter, folder, outtype, folder.parent / f"mamba2-{outtype}.gguf")
    return get


@pytest.fixture(scope="module")
def reference(folder):
    return load_reference(folder)


def mamba2_llm(path, **options) -> LLM:
    """max_model_len: without attention the block table only keys the prefix cache, and the engine
    sizes it by max_num_seqs * max_model_len (the converter says 2**20 tokens)."""
    return make_llm(path, **{"max_model_len": 2048, **options})


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_matches_transformers(folder, gguf_of, reference, source):
    llm = mamba2_llm(gguf_of("f32") if source == "gguf" else folder)
    assert llm.model_config.num_attention_layers == 0
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert len(ids) >= 40
    assert_matches_reference(llm, reference, ids)


def test_gguf_config_is_the_folders(folder, gguf_of):
    from wallbreaker.formats.gguf_model import read_gguf_model
    from wallbreaker.formats.hf_model import read_hf_folder
    hf, gg = read_hf_folder(folder).config, read_gguf_model(gguf_of("f32")).config
    # the GGUF has no SSD chunk size (it changes only the rounding) and a float32 epsilon
    assert gg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert dataclasses.replace(gg, ssm_chunk_size=hf.ssm_chunk_size, rms_norm_eps=hf.rms_norm_eps,
                               max_position_embeddings=hf.max_position_embeddings) == hf


def test_our_gguf_writer_round_trip_matches_transformers(tmp_path, folder, gguf_of, reference):
    from wallbreaker.formats.gguf_model import read_gguf_model
    from wallbreaker.formats.gguf_writer import write_gguf
    from wallbreaker.formats.hf_model import read_hf_folder
    from wallbreaker.quant.export import gguf_tokenizer_metadata
    files = read_hf_folder(folder)
    tokenizer = gguf_tokenizer_metadata(read_gguf_model(gguf_of("f32")).metadata)
    path = write_gguf(tmp_path / "ours.gguf", files.config, {n: r.load() for n, r in files.weights.items()}, tokenizer)
    llm = mamba2_llm(path)
    assert logits_error(llm, reference, llm.tokenizer.encode(TEXT)[:60]) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: the Q8_0 blocks run by our kernels
def test_q8_0_gguf_loads_and_generates(gguf_of, reference, dtype):
    llm = mamba2_llm(gguf_of("q8_0"), dtype=dtype)
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert logits_error(llm, reference, ids) < 0.05  # Q8_0 rounding of the projections, not a wrong model
    assert_generates(llm)


def test_runs_with_no_kv_pages_and_reports_its_states(folder):
    llm = mamba2_llm(folder, max_num_seqs=4)
    llm.generate([PROMPTS[0]], GREEDY)
    stats = llm.stats()
    assert llm.kv_cache.tensor.numel() == 0  # the block table only keys the prefix cache: no pages
    assert stats["state_bytes_per_sequence"] == 2 * 4 * (3 * 192 + 8 * 16 * 16)  # layers, float32, conv + SSM
    assert holds_only_checkpoints(llm)
