"""LFM2 end to end against transformers on the same random weights, from a Hugging Face folder and
from llama.cpp's converter (F32, and Q8_0 that must load and generate): float32 logits and greedy
tokens; what the loaders read and refuse; our GGUF writer against the converter. The engine's
behaviours on its convolution states are tests/test_recurrent_engine.py's."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_recurrent import (TEXT, VOCAB, assert_generates, assert_matches_reference, load_reference, make_llm,
                            tiny_config)


@pytest.fixture(scope="session")
def lfm2_folder(recurrent_folder) -> Path:
    return recurrent_folder("lfm2")


@pytest.fixture(scope="session")
def lfm2_gguf(lfm2_folder: Path, llamacpp_converter) -> Callable:
    from llamacpp_converter import convert

    def get(outtype: str) -> Path:
        return convert(llamacpp_converter, lfm2_folder, outtype, lfm2_folder.parent / f"lfm2-{outtype}.gguf")
    return get


@pytest.fixture(scope="module")
def reference(lfm2_folder: Path):
    return load_reference(lfm2_folder)


@pytest.mark.parametrize("source", ["hf", "f32"])
def test_matches_transformers(request, lfm2_folder, reference, source):
    # the converter only where it is used: without it (a skip) the folder is still tested
    path = lfm2_folder if source == "hf" else request.getfixturevalue("lfm2_gguf")(source)
    llm = make_llm(path)
    cfg = llm.model_config
    assert cfg.layer_types == ("conv", "full", "conv", "full") and cfg.intermediate_size == 224
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert len(ids) >= 40
    assert_matches_reference(llm, reference, ids)


def test_q8_0_gguf_loads_and_generates(lfm2_gguf, reference):
    """The converter's Q8_0 (the projections quantized; the convolution's 3 taps a row stay F32), on
    the float32 path and on the packed one: close to transformers, not equal."""
    path = lfm2_gguf("q8_0")
    ids = None
    for dtype in ("float32", "auto"):
        llm = make_llm(path, dtype=dtype)
        ids = ids or llm.tokenizer.encode(TEXT)[:60]
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0]
        got = llm.logits(ids)
        assert torch.isfinite(got).all()
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.8
        assert_generates(llm)


# -- what the loaders read and refuse ------------------------------------------------------------
def lfm2_json(**changes) -> dict:
    hf = {**tiny_config("lfm2").to_dict(), **changes}
    hf.pop("full_attn_idxs", None)
    return {k: v for k, v in hf.items() if v is not None}


def test_layers_from_full_attn_idxs_as_transformers_reads_them():
    from transformers import Lfm2Config

    from wallbreaker.formats.hf_model import config_from_hf
    hf = lfm2_json(full_attn_idxs=[0, 3])
    del hf["layer_types"]
    assert config_from_hf(hf, Path("m")).layer_types == tuple(
        "conv" if t == "conv" else "full" for t in Lfm2Config(**hf).layer_types)


@pytest.mark.parametrize("changes, named", [
    (dict(conv_bias=True), "conv_bias"),
    (dict(layer_types=["conv", "sliding_attention", "conv", "full_attention"]), "sliding_attention"),
    (dict(conv_L_cache=1), "conv_L_cache"),
    (dict(use_pos_enc=False), "use_pos_enc"),
])
def test_what_we_do_not_run_is_refused_by_name(changes, named):
    from wallbreaker.errors import ModelFormatError, UnsupportedModelError
    from wallbreaker.formats.hf_model import config_from_hf
    with pytest.raises((UnsupportedModelError, ModelFormatError), match=named):
        config_from_hf(lfm2_json(**changes), Path("m"))


def test_gguf_head_counts_mark_the_convolutions():
    from wallbreaker.errors import ModelFormatError, UnsupportedModelError
    from wallbreaker.formats.lfm2 import gguf_layer_heads
    assert gguf_layer_heads("f", "k", [0, 8, 0, 8], 4) == (8, ("conv", "full", "conv", "full"))
    with pytest.raises(UnsupportedModelError, match="different KV head counts"):
        gguf_layer_heads("f", "k", [0, 8, 0, 4], 4)
    with pytest.raises(ModelFormatError, match="one count a layer"):
        gguf_layer_heads("f", "k", [0, 8], 4)


def test_a_first_release_config_json_reads_as_transformers_reads_it():
    """LiquidAI's first config.json: block_ff_dim, tie_embedding, full_attn_idxs, no RoPE base (so
    transformers' default), and keys transformers ignores."""
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    from wallbreaker.formats.hf_model import config_from_hf
    hf = {"model_type": "lfm2", "vocab_size": VOCAB, "hidden_size": 64, "block_ff_dim": 400, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "norm_eps": 1e-6, "full_attn_idxs": [1],
          "tie_embedding": True, "block_multiple_of": 64, "block_auto_adjust_ff_dim": True,
          "block_ffn_dim_multiplier": 1.0, "conv_L_cache": 3, "use_pos_enc": True, "block_use_swiglu": True}
    ref = Lfm2Config(**hf)
    ours = config_from_hf(hf, Path("m"))
    assert ours.intermediate_size == Lfm2MLP(ref).w1.out_features
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == ref.norm_eps and ours.tie_word_embeddings == ref.tie_word_embeddings
    assert ours.layer_types == ("conv", "full", "conv")


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
def test_our_gguf_writer_writes_what_llama_cpp_converter_writes(lfm2_folder, lfm2_gguf, tmp_path, quantized):
    """The same keys and tensors as the converter's file (values: its F32 file's); read back, the
    logits are the folder's (F32) or close to them (Q8_0 projections)."""
    import gguf

    from wallbreaker.formats import open_model
    from wallbreaker.formats.gguf_file import open_gguf
    from wallbreaker.formats.gguf_writer import write_gguf
    files = open_model(lfm2_folder)
    tensors = {name: ref.load() for name, ref in files.weights.items()}
    types = {n: gguf.GGMLQuantizationType.Q8_0 for n, t in tensors.items()
             if quantized and t.dim() == 2 and t.shape[1] % 32 == 0}
    converted = open_gguf(lfm2_gguf("f32"))
    tokenizer = {k: v for k, v in converted.metadata.items() if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}
    ours = open_gguf(write_gguf(tmp_path / "ours.gguf", files.config, tensors, tokenizer, types))
    arch_keys = {k: v for k, v in converted.metadata.items() if k.startswith("lfm2.")}
    for key, value in arch_keys.items():
        assert ours.metadata[key] == pytest.approx(value), key
    assert {n: t.shape for n, t in ours.tensors.items()} == {n: t.shape for n, t in converted.tensors.items()}
    ids = files.tokenizer.encode(TEXT)[:45]
    want = make_llm(lfm2_folder).logits(ids)
    got = make_llm(tmp_path / "ours.gguf").logits(ids)
    error = ((got - want).abs().max() / (want.max() - want.min())).item()
    assert error < (2e-2 if quantized else 1e-6)
