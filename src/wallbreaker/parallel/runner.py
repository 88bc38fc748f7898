"""Rank 0's model runner: each step's inputs go to the workers, then every rank runs the model."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..engine.model_runner import ModelRunner, StepInputs
from ..kv import KVCache
from ..models.base import CausalLM

if TYPE_CHECKING:
    from .launcher import Workers


class ParallelModelRunner(ModelRunner):
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device, workers: "Workers"):
        super().__init__(model, kv_cache, device)
        self.workers = workers

    def execute(self, step: StepInputs) -> torch.Tensor:
        if self.workers.error is not None:
            raise self.workers.error
        try:
            self.workers.channel.send(step)
            return super().execute(step)
        except RuntimeError as e:  # torch.distributed reports a dead or timed-out peer as RuntimeError
            raise self.workers.fail(e) from None
        except BaseException as e:  # anything else mid-step leaves the ranks out of step: stop them too
            self.workers.fail(e)
            raise
