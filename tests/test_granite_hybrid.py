"""Granite-4.0-H (models/granite_hybrid.py) end to end against transformers' GraniteMoeHybridForCausalLM
on the same random weights: Mamba2 layers around attention without positional encoding, experts
beside a shared expert (or a dense shared MLP alone, as Granite-4.0-H-1B and -350M are), Granite's
four multipliers; from the Hugging Face folder and from llama.cpp's converter's GGUF (F32; Q8_0 loads
and runs); and the engine's promises on the hybrid."""
from __future__ import annotations

import dataclasses
import functools

import pytest

from llamacpp_converter import convert
from tiny_mamba import granite_config, save_model
from tiny_recurrent import (TEXT, Make, assert_a_small_state_pool_keeps_greedy,
                            assert_batching_and_chunking_keep_greedy, assert_generates, assert_matches_reference,
                            assert_preemption_keeps_greedy, assert_prefix_cache_hit,
                            assert_seeded_forks_are_separate_requests, assert_speculation_keeps_greedy, greedy_alone,
                            load_reference, logits_error, make_llm, no_fused_kernels, text_prompts)
from wallbreaker.errors import UnsupportedModelError

VARIANTS = {
    "moe": {},
    "dense": dict(num_local_experts=0, tie_word_embeddings=False, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"]),
    "rope": dict(position_embedding_type="rope", num_hidden_layers=3, layer_types=["attention", "mamba", "attention"]),
}


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory, recurrent_folder):
    """The "moe" variant is the tiny Granite the recurrent tests share (tiny_recurrent.save_tiny_model)."""
    built = {"moe": recurrent_folder("granite")}

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


@pytest.fixture(scope="module")
def make(folder_of) -> Make:
    return functools.partial(make_llm, folder_of("moe"))


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
def prompts(make):
    return text_prompts(make())


@pytest.fixture(scope="module")
def expected(make, prompts):
    return greedy_alone(make(enable_prefix_caching=False), prompts)


def test_chunked_prefill_and_batching_keep_the_greedy_tokens(make, prompts, expected):
    assert_batching_and_chunking_keep_greedy(make, prompts, expected)


def test_repeated_prompt_hits_the_prefix_cache(make, prompts, expected):
    assert assert_prefix_cache_hit(make(kv_block_size=4), prompts[2]) == expected[2]


def test_ngram_speculation_keeps_the_greedy_tokens(make, prompts, expected):
    llm = make(speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False)
    assert assert_speculation_keeps_greedy(llm, prompts, expected)[-1].metrics["spec_proposed_tokens"] > 0


def test_draft_model_speculation_keeps_the_greedy_tokens(make, prompts, expected):
    """SmolLM2-135M (the same tokenizer) drafts; the random target rejects its drafts, so each
    verification keeps the state after the first position and drops the rest."""
    from wallbreaker.formats.packaged import packaged_model_path
    llm = make(speculative_method="draft", speculative_model=str(packaged_model_path("smollm2")),
               num_speculative_tokens=3, speculative_adaptive=False)
    outs = assert_speculation_keeps_greedy(llm, prompts, expected)
    assert all(o.metrics.get("spec_proposed_tokens", 0) > 0 for o in outs)


def test_a_pool_too_small_for_all_keeps_the_greedy_tokens(make, prompts, expected):
    assert_a_small_state_pool_keeps_greedy(make, prompts, expected, slots=20, kv_block_size=4)


def test_preemption_keeps_the_greedy_tokens(make):
    """Two long prompts in a budget whose KV share holds fewer tokens than both need: one is
    preempted and recomputed."""
    plain = make(enable_prefix_caching=False)
    ids = plain.tokenizer.encode(TEXT * 12)
    prompts = [ids[:440], ids[5:450], ids[10:430]]
    per_slot = plain.stats()["state_bytes_per_sequence"]
    llm = make(max_num_seqs=2, prefix_state_slots=0, kv_block_size=4, kv_cache_memory_gb=2 * 7 * per_slot / 2**30)
    assert_preemption_keeps_greedy(llm, prompts, greedy_alone(plain, prompts))


def test_seeded_samples_are_the_same_whatever_else_is_in_the_batch(make, prompts):
    assert_seeded_forks_are_separate_requests(make(), prompts[0], prompts[2])
