"""Pure Mamba2 (models/mamba2.py) end to end against transformers' Mamba2ForCausalLM on the same
random weights, from the Hugging Face folder and from llama.cpp's converter's GGUF (F32; Q8_0 loads
and runs), and the engine's promises on a model with no attention at all."""
from __future__ import annotations

import dataclasses

import pytest

from llamacpp_converter import convert
from tiny_mamba import mamba2_config, save_model
from tiny_recurrent import (GREEDY, PROMPTS, TEXT, assert_generates, assert_matches_reference, load_reference,
                            logits_error, no_fused_kernels)
from wallbreaker import LLM, SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_model(mamba2_config(), tmp_path_factory.mktemp("mamba2") / "hf")


@pytest.fixture(scope="module")
def gguf_of(folder, llamacpp_converter):
    def get(outtype: str):
        return convert(llamacpp_converter, folder, outtype, folder.parent / f"mamba2-{outtype}.gguf")
    return get


@pytest.fixture(scope="module")
def reference(folder):
    return load_reference(folder)


def make_llm(path, **kw) -> LLM:
    """max_model_len: without attention the block table only keys the prefix cache, and the engine
    sizes it by max_num_seqs * max_model_len (the converter says 2**20 tokens)."""
    return LLM(str(path), **{"dtype": "float32", "kv_cache_memory_gb": 0.05, "max_model_len": 2048, **kw})


def test_transformers_runs_its_own_torch_path():
    assert no_fused_kernels() == []


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_matches_transformers(folder, gguf_of, reference, source):
    llm = make_llm(gguf_of("f32") if source == "gguf" else folder)
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
    llm = make_llm(path)
    assert logits_error(llm, reference, llm.tokenizer.encode(TEXT)[:60]) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: the Q8_0 blocks run by our kernels
def test_q8_0_gguf_loads_and_generates(folder, gguf_of, reference, dtype):
    llm = make_llm(gguf_of("q8_0"), dtype=dtype)
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert logits_error(llm, reference, ids) < 0.05  # Q8_0 rounding of the projections, not a wrong model
    assert_generates(llm)


def test_runs_with_no_kv_pages_and_reports_its_states(folder):
    llm = make_llm(folder, max_num_seqs=4)
    llm.generate([PROMPTS[0]], GREEDY)
    stats = llm.stats()
    assert llm.kv_cache.tensor.numel() == 0  # the block table only keys the prefix cache: no pages
    assert stats["state_bytes_per_sequence"] == 2 * 4 * (3 * 192 + 8 * 16 * 16)  # layers, float32, conv + SSM
    assert stats["state_slots_used"] == stats["state_checkpoints"]  # what the finished sequence held went back


def greedy_alone(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def prompts(folder):
    llm = make_llm(folder)
    long = llm.tokenizer.encode(TEXT * 3)
    return [llm.tokenizer.encode(p) for p in PROMPTS] + [long]


@pytest.fixture(scope="module")
def expected(folder, prompts):
    return greedy_alone(make_llm(folder, enable_prefix_caching=False), prompts)


def test_chunked_prefill_and_batching_keep_the_greedy_tokens(folder, prompts, expected):
    llm = make_llm(folder, max_num_batched_tokens=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)  # the short ones beside the long one
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_repeated_prompt_hits_the_prefix_cache(folder, prompts, expected):
    llm = make_llm(folder, kv_block_size=4)
    first = llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY)[0]
    again = llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY)[0]
    assert again.metrics["num_cached_prompt_tokens"] > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[2]


def test_ngram_speculation_keeps_the_greedy_tokens(folder, prompts):
    """A prompt that repeats itself, so that n-grams propose drafts (a random model's continuation
    rejects them: the state after each verified position is what is kept or dropped)."""
    repeated = prompts[2][:6] * 4 + prompts[2][:3]
    plain = make_llm(folder, enable_prefix_caching=False)
    expected = [plain.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in (*prompts, repeated)]
    llm = make_llm(folder, speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False)
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in (*prompts, repeated)]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[-1].metrics.get("spec_proposed_tokens", 0) > 0


def test_draft_model_speculation_keeps_the_greedy_tokens(folder, prompts, expected):
    """SmolLM2-135M (the same tokenizer) drafts; the random target rejects its drafts, so each
    verification keeps the state after the first position and drops the rest."""
    from wallbreaker.formats.packaged import packaged_model_path
    llm = make_llm(folder, speculative_method="draft", speculative_model=str(packaged_model_path("smollm2")),
                   num_speculative_tokens=3, speculative_adaptive=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.metrics.get("spec_proposed_tokens", 0) > 0 for o in outs)


def test_a_pool_too_small_for_all_keeps_the_greedy_tokens(folder, prompts, expected):
    per_slot = 2 * 4 * (3 * 192 + 8 * 16 * 16)
    llm = make_llm(folder, max_num_seqs=8, kv_cache_memory_gb=8 * per_slot / 2**30)  # 2 sequences at once
    many = prompts * 3
    outs = llm.generate([{"prompt_token_ids": p} for p in many], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected * 3
    assert llm.stats()["state_slots_total"] < 8


def test_seeded_samples_are_the_same_whatever_else_is_in_the_batch(folder, prompts):
    seeded = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    llm = make_llm(folder)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], seeded)[0]
    crowd = llm.generate([{"prompt_token_ids": p} for p in (prompts[2], prompts[0])], seeded)[1]
    samples = [o.token_ids for o in alone.outputs]
    assert samples == [o.token_ids for o in crowd.outputs]
    assert len({tuple(s) for s in samples}) > 1  # the forks did not all take the one state's sample
