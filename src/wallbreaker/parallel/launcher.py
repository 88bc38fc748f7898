"""Rank 0's side of the group: start the workers (or join torchrun's), hand them the model, stop them
(each step reaches them through rank 0's model runner, parallel/runner.py).

Workers started here are fresh interpreters (`python -m wallbreaker.parallel.worker`), not
multiprocessing children: no re-import of the user's `__main__`, so a script needs no
`if __name__ == "__main__"` guard. They never outlive rank 0: stopped on `shutdown()` and at exit,
killed when a step fails, and each one exits by itself within a second if rank 0's process vanishes.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import InvalidRequestError, WorkerFailedError
from ..formats.weights import ModelFiles
from ..kv.cache import make_kv_cache
from ..kv.state_pool import shard_state_pool
from ..layers.shard import Shard
from ..models import load_model
from .channel import StepChannel
from .group import (ParallelGroup, check_no_group, destroy_group, error_line, free_port, init_group, rank_device,
                    threads_per_rank, torchrun_env)
from .runner import ParallelModelRunner

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def launch(config) -> "Workers":
    """Start (or under torchrun, join) the group of `config.tensor_parallel_size` ranks as rank 0.

    Under torchrun, the ranks other than 0 serve model steps in here and end the process when rank 0
    stops them: `LLM(...)` never returns on them."""
    size, timeout = config.tensor_parallel_size, config.tensor_parallel_timeout_s
    check_no_group()
    threads_before = torch.get_num_threads()
    env = torchrun_env()
    procs: dict[int, subprocess.Popen] = {}
    if env is not None:
        if env["world_size"] != size:
            raise InvalidRequestError(f"tensor_parallel_size={size} but torchrun started {env['world_size']} ranks")
        group = init_group(env["rank"], size, "env://", rank_device(config.device, env["local_rank"]), timeout,
                           env["local_world_size"])
        if group.rank != 0:
            from .worker import run_rank
            sys.exit(run_rank(group))
    else:
        port = free_port()
        procs = {r: _spawn(r, size, port, config) for r in range(1, size)}
        try:
            group = init_group(0, size, f"tcp://127.0.0.1:{port}", rank_device(config.device, 0), timeout, size)
        except BaseException as e:
            died = _describe_deaths(procs)  # before the kill, which ends the rest
            _kill(procs.values())
            if isinstance(e, RuntimeError):
                raise WorkerFailedError(f"tensor-parallel workers did not start ({died or error_line(e)})") from None
            raise
    torch.set_num_threads(config.num_threads or threads_per_rank(group.local_world_size))
    return Workers(group, procs, threads_before)


class Workers:
    """The other ranks, seen from rank 0. Stopped (or torn down after a failure) exactly once."""

    def __init__(self, group: ParallelGroup, procs: dict[int, subprocess.Popen], threads_before: int):
        self.group = group
        self.procs = procs
        self.channel = StepChannel(group.control, group.device)
        self.error: WorkerFailedError | None = None
        self.deaths: list[tuple[int, int]] = []  # (rank, exit code) in the order the workers ended
        self._state = "started"  # -> "loading" -> "running" -> "stopped"
        self._threads_before = threads_before
        for rank, proc in procs.items():
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True, name=f"tp-worker-{rank}").start()
        atexit.register(self.shutdown)

    @property
    def worker_pids(self) -> dict[int, int]:
        """rank -> process id of the workers started here (none under torchrun)."""
        return {rank: p.pid for rank, p in self.procs.items()}

    def start_runner(self, files: ModelFiles, config, num_blocks: int, vocab_limit: int,
                     state_slots: tuple[int, int] | None = None) -> ParallelModelRunner:
        """Hand the workers the model and its KV and state pool sizes, load rank 0's shard, wait for all."""
        spec = {"config": {**dataclasses.asdict(config), "model": None}, "model_path": str(files.path),
                "num_blocks": num_blocks, "state_slots": state_slots}
        try:
            dist.broadcast_object_list([spec], src=0, group=self.group.control)
            self._state = "loading"
            shard = Shard(0, self.group.world_size, self.group.model)
            model = load_model(files, config, self.group.device, shard)
            kv_cache = make_kv_cache(files.config, config, num_blocks, self.group.device, shard)
            states = shard_state_pool(model, state_slots, self.group.device)
            dist.barrier(group=self.group.control)
        except RuntimeError as e:
            raise self.fail(e) from None
        except BaseException:
            self.shutdown()
            raise
        self._state = "running"
        return ParallelModelRunner(model, kv_cache, self.group.device, vocab_limit, self, states)

    def fail(self, error: BaseException) -> WorkerFailedError:
        """Tear the group down after a failed collective; the error to raise, naming the rank that died."""
        if self.error is None:
            deadline = time.monotonic() + 2.0
            while self.procs and not self._failed_deaths() and time.monotonic() < deadline:
                time.sleep(0.02)
            died = _describe_deaths(self.procs, self._failed_deaths())
            cause = died or f"step failed ({error_line(error)})"
            self.error = WorkerFailedError(f"tensor-parallel {cause}; the engine has shut down")
            self._teardown()
        return self.error

    def shutdown(self) -> None:
        """Stop the workers (they exit 0) and leave the process group."""
        if self._state == "stopped":
            return
        told = False
        try:
            if self._state == "started":
                dist.broadcast_object_list([None], src=0, group=self.group.control)
                told = True
            elif self._state == "running":
                self.channel.send_stop()
                told = True
        except RuntimeError:
            pass
        deadline = time.monotonic() + 10.0
        for proc in self.procs.values() if told else ():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._teardown()  # whoever was not told (still loading) or did not listen is killed

    def _teardown(self) -> None:
        self._state = "stopped"
        _kill(self.procs.values())
        try:
            destroy_group()
        except RuntimeError:
            pass
        torch.set_num_threads(self._threads_before)
        atexit.unregister(self.shutdown)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        self.deaths.append((rank, proc.wait()))

    def _failed_deaths(self) -> list[tuple[int, int]]:
        return [(r, c) for r, c in self.deaths if c != 0]


def _spawn(rank: int, world_size: int, port: int, config) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "wallbreaker.parallel.worker", "--rank", str(rank), "--world-size", str(world_size),
           "--init-method", f"tcp://127.0.0.1:{port}", "--device", str(rank_device(config.device, rank)),
           "--timeout", str(config.tensor_parallel_timeout_s), "--parent-pid", str(os.getpid())]
    path = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": path}, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)


def _kill(procs) -> None:
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=3.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _describe_deaths(procs: dict[int, subprocess.Popen], deaths: list[tuple[int, int]] | None = None) -> str:
    if deaths is None:
        deaths = [(r, p.returncode) for r, p in procs.items() if p.poll() is not None and p.returncode != 0]
    if not deaths:
        return ""
    rank, code = deaths[0]
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"worker rank {rank} {how}"
