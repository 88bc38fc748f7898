"""Rank 0's model runner under tensor parallelism: each step's inputs go to the workers first, then
every rank runs the model on its shard."""
from __future__ import annotations

from typing import Protocol

import torch

from ..engine.model_runner import ModelRunner, StepInputs
from ..errors import WorkerFailedError
from ..kv.cache import KVCache
from ..kv.state_pool import StatePool
from ..models import CausalLM
from .channel import StepChannel


class StepWorkers(Protocol):
    """The other ranks as the runner uses them (parallel.launcher.Workers)."""

    error: WorkerFailedError | None
    channel: StepChannel

    def fail(self, error: BaseException) -> WorkerFailedError: ...


class ParallelModelRunner(ModelRunner):
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device, vocab_limit: int,
                 workers: StepWorkers, states: StatePool | None = None):
        super().__init__(model, kv_cache, device, vocab_limit, states)
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
