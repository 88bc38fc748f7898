"""Granite-4.0-H (models/granite_hybrid.py) end to end against transformers' GraniteMoeHybridForCausalLM
on the same random weights: Mamba2 layers around attention without positional encoding, experts
beside a shared expert (or a dense shared MLP alone, as Granite-4.0-H-1B and -350M are), Granite's
four multipliers; from the Hugging Face folder and from llama.cpp's converter's GGUF (F32; Q8_0 loads
and runs); and the engine's promises on the hybrid."""
from __future__ import annotations

import dataclasses

import pytest

from llamacpp_converter import convert
from tiny_mamba import granite_config, save_model
from tiny_recurrent import (GREEDY, PROMPTS, TEXT, assert_generates, assert_matches_reference, load_reference,
                            logits_error, no_fused_kernels)
from wallbreaker import LLM, SamplingParams
from wallbreaker.errors import UnsupportedModelError
from wallbreaker.kv.state_pool import slots_per_sequence

VARIANTS = {
    "moe": {},
    "dense": dict(num_local_experts=0, tie_word_embeddings=False, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"]),
    "rope": dict(position_embedding_type="rope", num_hidden_layers=3, layer_types=["attention", "mamba", "attention"]),
}


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory):
    built = {}

    def get(variant: str):
        if variant not in built:
            out = tmp_path_factory.mktemp(f"granite_{variant}") / "hf"
            built[variant] = save_model(granite_config(**VARIANTS[variant]), out)
        return built[variant]
    return get


@pytest.fixture(scope="module")
def gguf_of(folder_of, llamacpp_converter):
    def get(variant: str, outtype: str = "f32"):
        folder = folder_of(variant)
        return convert(llamacpp_converter, folder, outtype, folder.parent / f"granite-{outtype}.gguf")
    return get


@pytest.fixture(scope="module")
def reference_of(folder_of):
    built = {}

    def get(variant: str):
        if variant not in built:
            built[variant] = load_reference(folder_of(variant))
        return built[variant]
    return get


def make_llm(path, **kw) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "kv_cache_memory_gb": 0.05, **kw})


def test_transformers_runs_its_own_torch_path():
    assert no_fused_kernels() == []


@pytest.mark.parametrize("variant,source", [("moe", "hf"), ("moe", "gguf"), ("dense", "hf"), ("dense", "gguf"),
                                            ("rope", "hf")])
def test_matches_transformers(folder_of, gguf_of, reference_of, variant, source):
    llm = make_llm(gguf_of(variant) if source == "gguf" else folder_of(variant))
    reference = reference_of(variant)
    kinds = VARIANTS[variant].get("layer_types", granite_config().layer_types)
    assert llm.model_config.num_attention_layers == sum(k in ("attention", "full_attention") for k in kinds)
    assert llm.model_config.is_moe == (variant != "dense")
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert len(ids) >= 40
    assert_matches_reference(llm, reference, ids)


@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_gguf_config_is_the_folders(folder_of, gguf_of, variant):
    from wallbreaker.formats.gguf_model import read_gguf_model
    from wallbreaker.formats.hf_model import read_hf_folder
    hf, gg = read_hf_folder(folder_of(variant)).config, read_gguf_model(gguf_of(variant)).config
    # the GGUF has no SSD chunk size (it changes only the rounding), float32 epsilon and scale,
    # and the converter's context length for a model without RoPE
    assert gg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert gg.attention_multiplier == pytest.approx(hf.attention_multiplier)
    assert dataclasses.replace(gg, ssm_chunk_size=hf.ssm_chunk_size, rms_norm_eps=hf.rms_norm_eps,
                               attention_multiplier=hf.attention_multiplier,
                               max_position_embeddings=hf.max_position_embeddings) == hf


@pytest.mark.parametrize("variant", ["moe", "dense", "rope"])
def test_our_gguf_writer_round_trip_matches_transformers(tmp_path, folder_of, gguf_of, reference_of, variant):
    """The folder's tensors written by formats/gguf_writer.py (llama.cpp's names, layouts and keys;
    RoPE where the config has it, which the converter drops for a hybrid) read back as the same model."""
    from wallbreaker.formats.gguf_model import read_gguf_model
    from wallbreaker.formats.gguf_writer import write_gguf
    from wallbreaker.formats.hf_model import read_hf_folder
    from wallbreaker.quant.export import gguf_tokenizer_metadata
    files = read_hf_folder(folder_of(variant))
    tokenizer = gguf_tokenizer_metadata(read_gguf_model(gguf_of("moe")).metadata)  # SmolLM2's, as every variant's
    path = write_gguf(tmp_path / "ours.gguf", files.config, {n: r.load() for n, r in files.weights.items()}, tokenizer)
    llm = make_llm(path)
    assert llm.model_config.attention_rope == (variant == "rope")
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert logits_error(llm, reference_of(variant), ids) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: the Q8_0 blocks run by our kernels
def test_q8_0_gguf_loads_and_generates(gguf_of, reference_of, dtype):
    llm = make_llm(gguf_of("moe", "q8_0"), dtype=dtype)
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert logits_error(llm, reference_of("moe"), ids) < 0.05  # Q8_0 rounding of the projections
    assert_generates(llm)


def test_rope_with_scaling_is_refused(tmp_path, folder_of):
    import json
    import shutil
    folder = tmp_path / "scaled"
    shutil.copytree(folder_of("rope"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="RoPE scaling"):
        make_llm(folder)


@pytest.mark.parametrize("key,value", [("mamba_proj_bias", True), ("attention_bias", True), ("mamba_rms_norm", False),
                                       ("normalization_function", "layernorm")])
def test_keys_that_change_the_math_are_refused(tmp_path, folder_of, key, value):
    import json
    import shutil
    folder = tmp_path / "changed"
    shutil.copytree(folder_of("moe"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(UnsupportedModelError, match=key):
        make_llm(folder)


@pytest.fixture(scope="module")
def prompts(folder_of):
    llm = make_llm(folder_of("moe"))
    return [llm.tokenizer.encode(p) for p in PROMPTS] + [llm.tokenizer.encode(TEXT * 3)]


@pytest.fixture(scope="module")
def expected(folder_of, prompts):
    llm = make_llm(folder_of("moe"), enable_prefix_caching=False)
    return [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in prompts]


def test_chunked_prefill_and_batching_keep_the_greedy_tokens(folder_of, prompts, expected):
    llm = make_llm(folder_of("moe"), max_num_batched_tokens=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)  # the short ones beside the long one
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_repeated_prompt_hits_the_prefix_cache(folder_of, prompts, expected):
    llm = make_llm(folder_of("moe"), kv_block_size=4)
    first = llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY)[0]
    again = llm.generate([{"prompt_token_ids": prompts[2]}], GREEDY)[0]
    assert again.metrics["num_cached_prompt_tokens"] > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[2]


def test_ngram_speculation_keeps_the_greedy_tokens(folder_of, prompts):
    repeated = prompts[2][:6] * 4 + prompts[2][:3]  # n-grams to propose from
    plain = make_llm(folder_of("moe"), enable_prefix_caching=False)
    expected = [plain.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in (*prompts, repeated)]
    llm = make_llm(folder_of("moe"), speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False)
    outs = [llm.generate([{"prompt_token_ids": p}], GREEDY)[0] for p in (*prompts, repeated)]
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[-1].metrics.get("spec_proposed_tokens", 0) > 0


def test_draft_model_speculation_keeps_the_greedy_tokens(folder_of, prompts, expected):
    """SmolLM2-135M (the same tokenizer) drafts; the random target rejects its drafts, so each
    verification keeps the state after the first position and drops the rest."""
    from wallbreaker.formats.packaged import packaged_model_path
    llm = make_llm(folder_of("moe"), speculative_method="draft", speculative_model=str(packaged_model_path("smollm2")),
                   num_speculative_tokens=3, speculative_adaptive=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.metrics.get("spec_proposed_tokens", 0) > 0 for o in outs)


def test_a_pool_too_small_for_all_keeps_the_greedy_tokens(folder_of, prompts, expected):
    llm = make_llm(folder_of("moe"), kv_block_size=4, max_num_seqs=8)
    per_slot = llm.stats()["state_bytes_per_sequence"]
    small = make_llm(folder_of("moe"), kv_block_size=4, max_num_seqs=8,
                     kv_cache_memory_gb=2 * 10 * per_slot / 2**30)
    outs = small.generate([{"prompt_token_ids": p} for p in prompts * 3], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected * 3
    assert small.stats()["state_slots_total"] < 8 * slots_per_sequence(0)  # fewer than 8 sequences at once


def test_preemption_keeps_the_greedy_tokens(folder_of):
    """Two long prompts in a budget whose KV share holds fewer tokens than both need: one is
    preempted and recomputed."""
    plain = make_llm(folder_of("moe"), enable_prefix_caching=False)
    ids = plain.tokenizer.encode(TEXT * 12)
    prompts = [ids[:440], ids[5:450], ids[10:430]]
    expected = [plain.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in prompts]
    per_slot = plain.stats()["state_bytes_per_sequence"]
    llm = make_llm(folder_of("moe"), max_num_seqs=2, prefix_state_slots=0, kv_block_size=4,
                   kv_cache_memory_gb=2 * 7 * per_slot / 2**30)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats()["num_preemptions"] > 0


def test_seeded_samples_are_the_same_whatever_else_is_in_the_batch(folder_of, prompts):
    seeded = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True)
    llm = make_llm(folder_of("moe"))
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], seeded)[0]
    crowd = llm.generate([{"prompt_token_ids": p} for p in (prompts[2], prompts[0])], seeded)[1]
    samples = [o.token_ids for o in alone.outputs]
    assert samples == [o.token_ids for o in crowd.outputs]
    assert len({tuple(s) for s in samples}) > 1
