"""Never silent: a tensor the architecture does not read, a RoPE scaling we do not run, or a
setting that would change the math and is not implemented is refused with one line naming it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFValueType as VType
from safetensors.torch import load_file, save_file
from test_model_loading_errors import GGUFContents

from wallbreaker import LLM
from wallbreaker.errors import ModelFormatError, UnsupportedModelError, WallbreakerError

F32 = gguf.GGMLQuantizationType.F32


def refused(exc: type[WallbreakerError], path: Path, *fragments: str) -> None:
    with pytest.raises(exc) as info:
        LLM(str(path), dtype="float32")
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def hf_copy(tiny, tmp_path: Path, edit_config=None, edit_state=None) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(tiny.hf_dir, folder)
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        edit_config(config)
        (folder / "config.json").write_text(json.dumps(config))
    if edit_state is not None:
        state = load_file(folder / "model.safetensors")
        edit_state(state)
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("kind, extra", [("llama", "blk.0.attn_output.bias"), ("qwen3moe", "blk.1.ffn_gate_shexp.weight"),
                                         ("llama3", "blk.0.ffn_gate_inp.weight")])
def test_gguf_with_a_tensor_nothing_reads_is_refused_naming_it(tiny_of, tmp_path, kind, extra):
    contents = GGUFContents.read(tiny_of(kind).gguf_path)
    contents.tensors.append((extra, np.ones((4, 64), np.float32), F32))
    refused(ModelFormatError, contents.write(tmp_path / "extra.gguf"), repr(extra), "not used")


def test_hf_folder_with_a_tensor_nothing_reads_is_refused_naming_it(tiny_of, tmp_path):
    name = "model.layers.0.self_attn.o_proj.bias"
    folder = hf_copy(tiny_of("qwen3"), tmp_path, edit_state=lambda s: s.update({name: torch.zeros(64)}))
    refused(ModelFormatError, folder, repr(name), "not used")


def test_hf_folder_missing_an_expert_is_refused(tiny_of, tmp_path):
    def drop(state):
        del state["model.layers.0.mlp.experts.3.up_proj.weight"]
    folder = hf_copy(tiny_of("qwen3moe"), tmp_path, edit_state=drop)
    refused(ModelFormatError, folder, "blk.0.ffn_up_exps.weight", "expert 3")


@pytest.mark.parametrize("key, value, fragments", [
    ("rope.scaling.type", ("ntk", VType.STRING, None), ("rope.scaling.type", "'ntk'")),
    ("expert_shared_count", (1, VType.UINT32, None), ("expert_shared_count",)),
    ("expert_gating_func", (2, VType.UINT32, None), ("expert_gating_func",)),
    ("attention.temperature_scale", (0.5, VType.FLOAT32, None), ("attention.temperature_scale",)),
])
def test_gguf_metadata_that_would_change_the_math_is_refused(tiny_of, tmp_path, key, value, fragments):
    contents = GGUFContents.read(tiny_of("qwen3moe").gguf_path)
    refused(UnsupportedModelError, contents.write(tmp_path / "m.gguf", {f"qwen3moe.{key}": value}), *fragments)


def test_gguf_metadata_at_its_neutral_value_is_accepted(tiny_of, tmp_path):
    contents = GGUFContents.read(tiny_of("qwen3moe").gguf_path)
    path = contents.write(tmp_path / "m.gguf", {"qwen3moe.expert_shared_count": (0, VType.UINT32, None),
                                                "qwen3moe.expert_gating_func": (1, VType.UINT32, None)})
    LLM(str(path), dtype="float32")


def _rope(config: dict, **changes) -> None:
    config["rope_parameters"].update(changes)


@pytest.mark.parametrize("kind, edit, fragments", [
    ("llama", lambda c: _rope(c, rope_type="dynamic", factor=2.0), ("RoPE scaling", "'dynamic'")),
    ("llama3", lambda c: _rope(c, beta_gamma=3.0), ("'beta_gamma'",)),
    ("llama", lambda c: c.update(mlp_bias=True), ("mlp_bias",)),
    ("phi3", lambda c: c.update(partial_rotary_factor=0.5), ("partial_rotary_factor",)),
    ("qwen3moe", lambda c: c.update(decoder_sparse_step=2), ("decoder_sparse_step",)),
    ("qwen3moe", lambda c: c.update(mlp_only_layers=[1]), ("mlp_only_layers",)),
    ("gemma2", lambda c: c.update(layer_types=["chunked_attention"] * 4), ("'chunked_attention'",)),
])
def test_hf_settings_we_do_not_run_are_refused(tiny_of, tmp_path, kind, edit, fragments):
    refused(UnsupportedModelError, hf_copy(tiny_of(kind), tmp_path, edit_config=edit), *fragments)
