"""Writing Hugging Face folders: a model read from GGUF and written as a folder reads back the same."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_architectures import same_rotation
from tiny_models import KINDS, TinyModel

from wallbreaker import LLM
from wallbreaker.formats.hf_model import config_from_hf
from wallbreaker.formats.hf_writer import hf_config, write_hf_folder
from wallbreaker.text.tokenizer import Tokenizer

TEXTS = ["Hello, world! How are you today?", "<|im_start|>user\nhi<|im_end|>\n", "café 日本語 🙂 12345"]


@pytest.fixture(params=["llama", "qwen2", "gemma3", "qwen3", "phi3", "gemma2", "mixtral", "qwen3moe", "llama3"])
def tiny(request: pytest.FixtureRequest, tiny_of) -> TinyModel:
    return tiny_of(request.param)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_config_round_trips_the_model_config(tiny_of, kind: str) -> None:
    config = tiny_of(kind).config
    assert config_from_hf(hf_config(config), Path("x")) == config


def test_gguf_model_written_as_a_folder_reads_back_the_same(tiny: TinyModel, tmp_path: Path) -> None:
    """Phi-3's projections fused again, experts stored one by one; Llama 3's RoPE as llama.cpp
    stores it (one divisor per frequency) comes back as the same rotation in LongRoPE's terms."""
    src = LLM(str(tiny.gguf_path), dtype="float32")
    tensors = {name: ref.load() for name, ref in src.files.weights.items()}
    folder = write_hf_folder(tmp_path / "hf", src.model_config, tensors, src.tokenizer, src.chat_template.source)
    back = LLM(str(folder), dtype="float32")
    assert same_rotation(back.model_config, src.model_config)
    assert dataclasses.replace(back.model_config, rope_scaling=None) == \
        dataclasses.replace(src.model_config, rope_scaling=None)
    for text in TEXTS:
        assert back.tokenizer.encode(text) == src.tokenizer.encode(text)
    assert back.tokenizer.stop_token_ids == src.tokenizer.stop_token_ids
    assert back.chat_template.source == src.chat_template.source
    assert torch.allclose(back.logits(TEXTS[0]), src.logits(TEXTS[0]), atol=1e-5)


def test_saved_tokenizer_keeps_adding_bos(tiny_llama: TinyModel, tmp_path: Path) -> None:
    tok = LLM(str(tiny_llama.gguf_path), dtype="float32").tokenizer
    assert tok.add_bos
    tok.save_hf(tmp_path)
    back = Tokenizer.from_hf_folder(tmp_path)
    assert back.add_bos and back.encode("hi")[0] == tok.bos_token_id == back.bos_token_id
