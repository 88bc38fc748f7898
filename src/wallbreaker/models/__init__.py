"""Architectures, built from `layers/`. `build_model` picks one from the config."""
from __future__ import annotations

import torch

from ..config import EngineConfig, ModelConfig
from ..formats import ModelFiles
from ..layers.shard import Shard
from .base import CausalLM
from .gemma import GemmaCausalLM
from .llama import LlamaCausalLM
from .source import WeightSource

_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "llama": LlamaCausalLM, "qwen2": LlamaCausalLM, "qwen3": LlamaCausalLM, "qwen3moe": LlamaCausalLM,
    "phi3": LlamaCausalLM, "gemma2": GemmaCausalLM, "gemma3": GemmaCausalLM,
}  # mixtures of experts (Mixtral is llama, Qwen3-MoE qwen3moe) swap the MLP: models/moe.py


def build_model(config: ModelConfig, source: WeightSource) -> CausalLM:
    return _ARCHITECTURES[config.architecture](config, source).eval()


def load_model(files: ModelFiles, config: EngineConfig, device: torch.device, shard: Shard | None = None) -> CausalLM:
    """The model, or under tensor parallelism this rank's shard of it."""
    with torch.device(device):
        return build_model(files.config, WeightSource(files.weights, config.torch_dtype, config.packed_weights, shard))
