"""Shared fixtures: the tiny models (built once per session) and real model paths (or a skip)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_models import TinyModel, make_tiny_model


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
