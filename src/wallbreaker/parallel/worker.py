"""A tensor-parallel worker (ranks 1..N-1): it holds its shard of the weights and of the KV pool and
runs each model step rank 0 broadcasts. Scheduling, sampling and tokenizing happen on rank 0 only.

`python -m wallbreaker.parallel.worker ...` is how rank 0 starts one on this machine; under torchrun
the ranks other than 0 come here from `LLM(...)` instead (`serve`).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..engine.model_runner import ModelRunner
from ..formats import open_model
from ..kv.cache import make_kv_cache
from ..kv.state_pool import shard_state_pool
from ..layers.shard import Shard
from ..models import load_model
from .channel import StepChannel
from .group import ParallelGroup, destroy_group, error_line, init_group, threads_per_rank


def serve(group: ParallelGroup) -> None:
    """Take the engine's spec from rank 0, load this rank's shard, run steps until rank 0 stops."""

    box: list = [None]
    dist.broadcast_object_list(box, src=0, group=group.control)
    spec = box[0]
    if spec is None:  # rank 0 gave up before loading
        return
    config = EngineConfig(**spec["config"])
    torch.set_num_threads(config.num_threads or threads_per_rank(group.local_world_size))
    files = open_model(spec["model_path"])
    shard = Shard(group.rank, group.world_size, group.model)
    model = load_model(files, config, group.device, shard)
    kv_cache = make_kv_cache(files.config, config, spec["num_blocks"], group.device, shard)
    runner = ModelRunner(model, kv_cache, group.device, states=shard_state_pool(model, spec["state_slots"], group.device))
    dist.barrier(group=group.control)
    channel = StepChannel(group.control, group.device)
    while (step := channel.recv()) is not None:
        runner.execute(step)


def run_rank(group: ParallelGroup) -> int:
    """`serve`, then the exit status: 0 when rank 0 stopped us, 1 (with one line on stderr) on a failure."""
    try:
        serve(group)
    except Exception as e:  # noqa: BLE001 -- any failure ends this rank; rank 0 reports it
        print(f"wallbreaker: tensor-parallel worker rank {group.rank}: {error_line(e)}", file=sys.stderr, flush=True)
        os._exit(1)  # a broken process group may hang an orderly exit
    destroy_group()
    return 0


def _exit_with_parent(parent_pid: int) -> None:
    """A worker outlives no engine: should rank 0's process vanish, this one follows within a second."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wallbreaker.parallel.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it then stops us
    _exit_with_parent(args.parent_pid)
    try:
        group = init_group(args.rank, args.world_size, args.init_method, torch.device(args.device), args.timeout,
                           args.world_size)
    except Exception as e:  # noqa: BLE001
        print(f"wallbreaker: tensor-parallel worker rank {args.rank}: cannot join the group: {error_line(e)}",
              file=sys.stderr, flush=True)
        return 1
    return run_rank(group)


if __name__ == "__main__":
    sys.exit(main())
