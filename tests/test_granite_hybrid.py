"""Granite-4.0-H (models/granite_hybrid.py) end to end against transformers' GraniteMoeHybridForCausalLM
on the same random weights: Mamba2 layers around attention without positional encoding, experts
beside a shared expert (or a dense shared MLP alone, as Granite-4.0-H-1B and -350M are), Granite's
four multipliers; from the Hugging Face folder and from llama.cpp's converter's GGUF (F32; Q8_0 loads
and runs). The engine's behaviours on the hybrid ("moe", the shared tiny Granite) are
tests/test_recurrent_engine.py's."""
from __future__ import annotations

import dataclasses

import pytest

from llamacpp_converter import convert
from tiny_mamba import granite_config, save_model
from tiny_recurrent import (TEXT, assert_generates, assert_matches_reference, load_reference, logits_error,
                            make_llm)
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
