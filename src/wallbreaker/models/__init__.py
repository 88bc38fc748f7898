"""Architectures, built from `layers/`. `build_model` picks one from the config."""
from __future__ import annotations

from ..config import ModelConfig
from .base import CausalLM
from .gemma3 import Gemma3CausalLM
from .llama import LlamaCausalLM
from .source import WeightSource

_ARCHITECTURES: dict[str, type[CausalLM]] = {"llama": LlamaCausalLM, "qwen2": LlamaCausalLM, "gemma3": Gemma3CausalLM}


def build_model(config: ModelConfig, source: WeightSource) -> CausalLM:
    return _ARCHITECTURES[config.architecture](config, source).eval()
