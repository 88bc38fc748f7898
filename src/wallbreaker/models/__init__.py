"""Architectures, built from `layers/`. `build_model` builds the class the config's family names."""
from __future__ import annotations

import importlib

import torch

from ..config import EngineConfig, ModelConfig
from ..formats import ModelFiles
from ..formats.families import family
from ..formats.packaged import cache_dir
from ..kernels import tuning
from ..kernels.repack_cache import RepackCache, source_identity
from ..layers.shard import Shard
from .base import CausalLM
from .source import WeightSource


def model_class(architecture: str) -> type[CausalLM]:
    """The class its family's spec names (formats/families.py `ArchSpec.model`: "module.Class" here)."""
    module, cls = family(architecture).model.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def generates(architecture: str) -> bool:
    """Whether the architecture decodes text (an encoder such as BERT only pools)."""
    return getattr(model_class(architecture), "can_generate", True)


def build_model(config: ModelConfig, source: WeightSource) -> CausalLM:
    model = model_class(config.architecture)(config, source).eval()
    if config.pooling is not None and getattr(model, "pooler", None) is None:  # a decoder pooling model
        from ..layers.pooling import Pooler
        head = None
        if config.pooling.task == "score":  # a decoder cross-encoder: its score head; no LM head to generate with
            head = source.linear(["cls.output.weight"])
            model.can_generate = False
        model.pooler = Pooler(config.pooling, head)
    return model


def load_model(files: ModelFiles, config: EngineConfig, device: torch.device, shard: Shard | None = None) -> CausalLM:
    """The model, or under tensor parallelism this rank's shard of it. On the `auto` path, blocks the
    kernels cannot read from the file's mapping come from the repack cache (kernels/repack_cache.py)."""
    repack = None
    if config.packed_weights:
        tuning.apply()  # this host's tile shapes, measured once and stored (kernels/tuning.py)
        where = "" if shard is None else f"{shard.rank}/{shard.world_size}"
        repack = RepackCache(cache_dir() / "repack", source_identity(files.path, where))
    try:
        with torch.device(device):
            model = build_model(files.config, WeightSource(files.weights, config.torch_dtype, config.packed_weights,
                                                           shard, repack))
    except BaseException:
        if repack is not None:
            repack.abort()
        raise
    if repack is not None:
        repack.finish()
    if config.batch_invariant and isinstance(model, CausalLM):  # an encoder computes each input whole
        model.set_batch_invariant(True)
    return model
