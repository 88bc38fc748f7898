"""Mamba (v1) and Falcon-Mamba (models/mamba.py, the first family added through formats/families.py)
end to end against transformers' MambaForCausalLM and FalconMambaForCausalLM on their torch path, on
the same random weights, from the Hugging Face folder and from llama.cpp's converter's GGUF (F32;
Q8_0 loads and runs). The engine's behaviours on their states are tests/test_recurrent_engine.py's."""
from __future__ import annotations

import dataclasses

import pytest

from llamacpp_converter import convert
from tiny_recurrent import (GREEDY, PROMPTS, TEXT, assert_generates, assert_matches_reference, holds_only_checkpoints,
                            load_reference, logits_error, make_llm)
from wallbreaker import LLM

ARCHS = ["mamba", "falcon_mamba"]


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(arch, recurrent_folder):
    return recurrent_folder(arch)


@pytest.fixture(scope="module")
def gguf_of(arch, folder, llamacpp_converter):
    def get(outtype: str):
        return convert(llamacpp_converter, folder, outtype, folder.parent / f"{arch}-{outtype}.gguf")
    return get


@pytest.fixture(scope="module")
def reference(folder):
    return load_reference(folder)


def mamba_llm(path, **options) -> LLM:
    """max_model_len: without attention the block table only keys the prefix cache, and the engine
    sizes it by max_num_seqs * max_model_len (the files say 2**20 tokens)."""
    return make_llm(path, **{"max_model_len": 2048, **options})


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_matches_transformers(folder, gguf_of, reference, source):
    llm = mamba_llm(gguf_of("f32") if source == "gguf" else folder)
    assert llm.model_config.architecture == "mamba" and llm.model_config.num_attention_layers == 0
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert len(ids) >= 40
    assert_matches_reference(llm, reference, ids)


def test_gguf_config_is_the_folders(arch, folder, gguf_of):
    from wallbreaker.formats.gguf_model import read_gguf_model
    from wallbreaker.formats.hf_model import read_hf_folder
    hf, gg = read_hf_folder(folder).config, read_gguf_model(gguf_of("f32")).config
    assert (gg.ssm_bc_norm_eps is not None) == (arch == "falcon_mamba")
    assert gg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)  # a float32 epsilon in the GGUF
    assert dataclasses.replace(gg, rms_norm_eps=hf.rms_norm_eps, ssm_bc_norm_eps=hf.ssm_bc_norm_eps) == hf


def test_our_gguf_writer_round_trip_matches_transformers(tmp_path, folder, gguf_of, reference):
    from wallbreaker.formats.gguf_model import read_gguf_model
    from wallbreaker.formats.gguf_writer import write_gguf
    from wallbreaker.formats.hf_model import read_hf_folder
    from wallbreaker.quant.export import gguf_tokenizer_metadata
    files = read_hf_folder(folder)
    tokenizer = gguf_tokenizer_metadata(read_gguf_model(gguf_of("f32")).metadata)
    path = write_gguf(tmp_path / "ours.gguf", files.config, {n: r.load() for n, r in files.weights.items()}, tokenizer)
    llm = mamba_llm(path)
    assert logits_error(llm, reference, llm.tokenizer.encode(TEXT)[:60]) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "auto"])  # auto: the Q8_0 blocks run by our kernels
def test_q8_0_gguf_loads_and_generates(gguf_of, reference, dtype):
    llm = mamba_llm(gguf_of("q8_0"), dtype=dtype)
    ids = llm.tokenizer.encode(TEXT)[:60]
    assert logits_error(llm, reference, ids) < 0.05  # Q8_0 rounding of the projections, not a wrong model
    assert_generates(llm)


def test_runs_with_no_kv_pages_and_reports_its_states(folder):
    llm = mamba_llm(folder, max_num_seqs=4)
    llm.generate([PROMPTS[0]], GREEDY)
    stats = llm.stats()
    assert llm.kv_cache.tensor.numel() == 0  # the block table only keys the prefix cache: no pages
    assert stats["state_bytes_per_sequence"] == 2 * 4 * (3 * 128 + 128 * 16)  # layers, float32, conv + SSM
    assert holds_only_checkpoints(llm)


def test_refuses_what_it_does_not_run(tmp_path, folder):
    import json
    import shutil

    from wallbreaker.errors import UnsupportedModelError
    bad = tmp_path / "hf"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "use_bias": True}))
    with pytest.raises(UnsupportedModelError, match="use_bias"):
        LLM(str(bad))
    with pytest.raises(Exception, match="tensor parallelism"):
        LLM(str(folder), tensor_parallel_size=2)
