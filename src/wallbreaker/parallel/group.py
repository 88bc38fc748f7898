"""The process groups: one for the model's collectives (gloo on the CPU, NCCL on CUDA) and a gloo
control group for start-up, step broadcasts and shutdown.

The model's collectives (all-reduce, gather) run under the short `tensor_parallel_timeout_s`, so that
a worker that dies or hangs mid-step fails the engine within it. Workers wait for the next step on
the control group, whose timeout is practically infinite: an idle engine (a server with no
requests) must not time its workers out. A peer that dies still fails a control broadcast at once
(its socket closes). The rendezvous itself waits at least START_TIMEOUT_S for workers to start.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import InvalidRequestError

IDLE_TIMEOUT = timedelta(days=365)
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ParallelGroup:
    rank: int
    world_size: int
    local_world_size: int  # ranks on this machine, which share its cores
    device: torch.device
    model: dist.ProcessGroup  # the model's all-reduces and the logits gather, under the short timeout
    control: dist.ProcessGroup  # gloo: step broadcasts, start-up and shutdown


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_no_group() -> None:
    if dist.is_initialized():
        raise InvalidRequestError("a torch.distributed process group is already initialized in this process; "
                                  "one tensor-parallel engine per process (call shutdown() on the other)")


def init_group(rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float,
               local_world_size: int) -> ParallelGroup:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=max(timeout_s, START_TIMEOUT_S)))
    model = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelGroup(rank, world_size, local_world_size, device, model, control)


def destroy_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env() -> dict[str, int] | None:
    """rank, world_size, local_rank, local_world_size when launched by torchrun (or any launcher
    that sets its environment variables), else None."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return {"rank": int(os.environ["RANK"]), "world_size": world,
            "local_rank": int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", world))}


def threads_per_rank(local_world_size: int) -> int:
    """The machine's cores shared by the ranks on it (oversubscribed threads slow every rank)."""
    return max(1, (os.cpu_count() or 1) // local_world_size)


def error_line(e: BaseException) -> str:
    """One line for a user: the first of the message, without gloo's "[.../pair.cc:553] " prefix."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". This is typically caused")[0]
    return text.splitlines()[0] if text else type(e).__name__


def rank_device(device: str, local_rank: int) -> torch.device:
    """One accelerator per rank: cuda -> cuda:<local rank>; the CPU is shared."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", local_rank)
    return dev
