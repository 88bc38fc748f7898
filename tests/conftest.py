"""Shared fixtures: the tiny models (built once per session) and real model paths (or a skip)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import TinyModel, make_tiny_model


# Tests check behaviour, not speed: one thread per process. Several processes (the test runner, a
# server, tensor-parallel workers) each spinning two OpenMP threads on two cores slow each other
# down by an order of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Each level's default tile shapes, not ones timed on a machine busy with tests (test_kernel_tuning.py
# measures on purpose); every shape gives the same bits anyway.
os.environ.setdefault("WALLBREAKER_KERNEL_TUNING", "0")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyModel]:
    """`tiny_of("mixtral")`: the tiny model of that kind (tiny_models.KINDS), built once a session."""
    built: dict[str, TinyModel] = {}

    def get(kind: str) -> TinyModel:
        if kind not in built:
            built[kind] = make_tiny_model(kind, tmp_path_factory.mktemp(f"tiny_{kind}"))
        return built[kind]
    return get


@pytest.fixture(scope="session")
def tiny_llama(tiny_of) -> TinyModel:
    return tiny_of("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_of) -> TinyModel:
    return tiny_of("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_of) -> TinyModel:
    return tiny_of("qwen3")


@pytest.fixture(scope="session")
def tiny_gemma3(tiny_of) -> TinyModel:
    return tiny_of("gemma3")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs a packaged real model is `real_model` (by the `packaged_model` fixture, or
    marked by hand) and, like every such test, `slow`: loading one takes seconds. The quick loop is
    `pytest -m "not slow"`."""
    for item in items:
        if "packaged_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
        if item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def packaged_model() -> Callable[[str], Path]:
    """`packaged_model("gemma3-270m")` -> the assembled GGUF of a packaged real model, or skip with
    the command that installs it."""
    from wallbreaker.errors import ModelNotFoundError
    from wallbreaker.formats.packaged import packaged_model_path

    def get(alias: str) -> Path:
        try:
            return packaged_model_path(alias)
        except ModelNotFoundError as e:
            pytest.skip(str(e))
    return get


# -- pooling models (tests/tiny_pooling_models.py) ------------------------------------------------
@pytest.fixture(scope="session")
def tiny_bert_embedding(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_pooling_models import make_tiny_bert
    return make_tiny_bert(tmp_path_factory.mktemp("tiny_bert_embed"), cross_encoder=False)


@pytest.fixture(scope="session")
def tiny_bert_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_pooling_models import make_tiny_bert
    return make_tiny_bert(tmp_path_factory.mktemp("tiny_bert_cross"), cross_encoder=True, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_embedding(tiny_qwen3, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_pooling_models import make_tiny_qwen3_embedding
    return make_tiny_qwen3_embedding(tiny_qwen3, tmp_path_factory.mktemp("tiny_qwen3_embed") / "hf")


@pytest.fixture(scope="session")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2's folder, or skip naming the install command."""
    from tiny_pooling_models import minilm_folder
    return minilm_folder(tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="session")
def llamacpp_converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py folder (tests/llamacpp_converter.py), or skip naming the fetch command."""
    from llamacpp_converter import converter_dir
    from wallbreaker.formats.packaged import cache_dir
    return converter_dir(cache_dir())


# -- recurrent and hybrid models (tests/tiny_recurrent.py) ----------------------------------------
@pytest.fixture(scope="session")
def recurrent_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`recurrent_folder("lfm2")`: the Hugging Face folder of that architecture's tiny random model
    (tiny_recurrent.ARCHITECTURES), built once a session for its own tests and the engine's."""
    from tiny_recurrent import save_tiny_model
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = save_tiny_model(arch, tmp_path_factory.mktemp(arch) / "hf")
        return built[arch]
    return get


@pytest.fixture(scope="session")
def hello_model(packaged_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF with SmolLM2's tokenizer and template and a 64k context that answers every prompt
    "Hello!" (tests/hello_model.py): for the real clients' long prompts. Needs SmolLM2 installed."""
    from hello_model import write_hello_model

    return write_hello_model(packaged_model("smollm2"), tmp_path_factory.mktemp("hello") / "hello.gguf")


# -- vision (tests/tiny_vision.py) ----------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_gemma3_vision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a tiny random-weight Gemma 3 vision model (Gemma3ForConditionalGeneration)."""
    from tiny_vision import make_tiny_gemma3_vision
    return make_tiny_gemma3_vision(tmp_path_factory.mktemp("tiny_gemma3_vision"))


@pytest.fixture(scope="session")
def tiny_smolvlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of a tiny random-weight SmolVLM (Idefics3ForConditionalGeneration, tests/tiny_smolvlm.py)."""
    from tiny_smolvlm import make_tiny_smolvlm
    return make_tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm"))
