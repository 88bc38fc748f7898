"""Qwen3-Next against transformers on the same random weights (tests/tiny_recurrent.py), read from the
Hugging Face folder and from llama.cpp's converter's GGUF (F32; Q8_0 loads and generates): float32
logits over a text of 40+ tokens and greedy tokens on two prompts; the config keys we do not run
refused. The engine's behaviours on its states are tests/test_recurrent_engine.py's."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from tiny_recurrent import TEXT, assert_generates, assert_matches_reference, load_reference, logits_error

from wallbreaker import LLM
from wallbreaker.errors import ModelFormatError, UnsupportedModelError


@pytest.fixture(scope="session")
def hf_dir(recurrent_folder):
    return recurrent_folder("qwen3_next")


@pytest.fixture(scope="session")
def gguf_of(hf_dir, llamacpp_converter):
    """`gguf_of("f32")`: the folder converted by llama.cpp's convert_hf_to_gguf.py (without MTP layers,
    which a Qwen3-Next folder may carry and ours does not)."""
    from llamacpp_converter import convert

    def get(outtype: str):
        return convert(llamacpp_converter, hf_dir, outtype, hf_dir.parent / f"model-{outtype}.gguf", ("--no-mtp",))
    return get


@pytest.fixture(scope="session")
def reference(hf_dir):
    return load_reference(hf_dir)


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_matches_transformers(hf_dir, gguf_of, reference, source):
    llm = LLM(str(gguf_of("f32") if source == "gguf" else hf_dir), dtype="float32", kv_cache_memory_gb=0.05)
    cfg = llm.model_config
    assert cfg.architecture == "qwen3next" and cfg.num_attention_layers == 1 and cfg.rotary_dim == 4
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) >= 40
    assert_matches_reference(llm, reference, ids)


def test_folder_and_converted_gguf_read_as_the_same_model(hf_dir, gguf_of):
    from wallbreaker.formats import open_model
    folder, converted = open_model(str(hf_dir)), open_model(str(gguf_of("f32")))
    # the file's eps is float32; its special tokens come from the tokenizer, the folder's config has none
    same = dict(rms_norm_eps=folder.config.rms_norm_eps, bos_token_id=folder.config.bos_token_id,
                eos_token_ids=folder.config.eos_token_ids)
    assert dataclasses.replace(converted.config, **same) == folder.config
    assert set(converted.weights) == set(folder.weights)
    for name, ref in folder.weights.items():
        assert torch.equal(ref.load(), converted.weights[name].load()), name


def test_q8_0_gguf_loads_and_generates(gguf_of, reference):
    llm = LLM(str(gguf_of("q8_0")), kv_cache_memory_gb=0.05)
    assert llm.model_config.architecture == "qwen3next"
    assert logits_error(llm, reference, llm.tokenizer.encode(TEXT)) < 0.1  # 8-bit weights: near, not at it
    assert_generates(llm)


@pytest.mark.parametrize("key, value", [("decoder_sparse_step", 2), ("mlp_only_layers", [1]),
                                        ("attention_bias", True), ("num_experts", 0)])
def test_what_we_do_not_run_is_refused(hf_dir, tmp_path, key, value):
    folder = tmp_path / "model"
    shutil.copytree(hf_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=key):
        LLM(str(folder), dtype="float32", kv_cache_memory_gb=0.05)


@pytest.mark.parametrize("key, value", [("linear_num_value_heads", 3), ("linear_conv_kernel_dim", 1),
                                        ("partial_rotary_factor", 0.1), ("layer_types", ["mamba"] * 4)])
def test_impossible_values_are_named(hf_dir, tmp_path, key, value):
    folder = tmp_path / "model"
    shutil.copytree(hf_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    if key == "partial_rotary_factor":  # 16 * 0.1: an odd number of channels to rotate
        config["rope_parameters"][key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=key):
        LLM(str(folder), dtype="float32", kv_cache_memory_gb=0.05)


def test_our_gguf_writer_round_trips(gguf_of, tmp_path):
    """formats/gguf_writer.py writes what llama.cpp's converter wrote: the same config and tensors."""
    from wallbreaker.formats import open_model
    from wallbreaker.formats.gguf_writer import write_gguf
    from wallbreaker.quant.export import gguf_tokenizer_metadata
    converted = open_model(str(gguf_of("f32")))
    ours = write_gguf(tmp_path / "ours.gguf", converted.config, {n: r.load() for n, r in converted.weights.items()},
                      gguf_tokenizer_metadata(converted.metadata))
    again = open_model(str(ours))
    assert again.config == converted.config
    assert all(torch.equal(r.load(), converted.weights[n].load()) for n, r in again.weights.items())
    assert set(again.weights) == set(converted.weights)


@pytest.fixture(scope="session")
def with_mtp(hf_dir):
    """The folder plus a multi-token prediction head as Qwen3-Next checkpoints carry one (`mtp.*`: a
    decoder layer, here a copy of the attention layer's tensors, and its projections and norms)."""
    from safetensors.torch import load_file, save_file
    folder = hf_dir.parent / "with-mtp"
    if not folder.is_dir():
        shutil.copytree(hf_dir, folder)
        state = load_file(folder / "model.safetensors")
        hidden = state["model.norm.weight"].shape[0]
        mtp = {k.replace("model.layers.3.", "mtp.layers.0."): v.clone() for k, v in state.items()
               if k.startswith("model.layers.3.")}
        mtp.update({"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.randn(hidden),
                    "mtp.pre_fc_norm_embedding.weight": torch.randn(hidden),
                    "mtp.pre_fc_norm_hidden.weight": torch.randn(hidden)})
        save_file({**state, **mtp}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_multi_token_prediction_head_is_left_unread(with_mtp, llamacpp_converter, reference):
    """In a folder (`mtp.*`) and in the converter's GGUF made without --no-mtp (layers after the
    model's own, `nextn_predict_layers`), the model reads as without it."""
    from llamacpp_converter import convert
    import gguf
    converted = convert(llamacpp_converter, with_mtp, "f32", with_mtp.parent / "with-mtp-f32.gguf")
    reader = gguf.GGUFReader(converted)
    assert reader.fields["qwen3next.nextn_predict_layers"].contents() == 1
    for source in (with_mtp, converted):
        llm = LLM(str(source), dtype="float32", kv_cache_memory_gb=0.05)
        assert llm.model_config.num_layers == 4
        assert logits_error(llm, reference, llm.tokenizer.encode(TEXT)) < 1e-4
