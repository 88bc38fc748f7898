"""What this machine can move and compute: streaming memory bandwidth and matmul FLOP/s, measured with
torch, stored in `<cache>/machine.json` so that other code (request metrics, `inspect`) reads them
without measuring again.

Bandwidth is measured over buffers far larger than the caches (default 512 MiB of float32): a
read-only sum (bytes read / s) and a copy (bytes read + bytes written / s, STREAM's convention).
Each kernel runs `repeats` times; the best run is the ceiling the hardware allows, the median what a
shared machine usually gives.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import gguf
import torch

MIN_STORED_BUFFER_MIB = 256  # smaller buffers partly fit in cache and overstate the bandwidth


@dataclass
class Sample:
    best: float
    median: float

    @classmethod
    def of(cls, values: list[float]) -> "Sample":
        return cls(max(values), statistics.median(values))


@dataclass
class MachineProfile:
    bandwidth: dict[str, dict[str, Sample]] = field(default_factory=dict)  # threads -> kernel -> bytes/s
    flops: dict[str, Sample] = field(default_factory=dict)  # kernel kind -> FLOP/s
    buffer_mib: int = 0
    gemm_size: int = 0
    repeats: int = 0
    host: str = field(default_factory=platform.node)
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 1)
    torch_version: str = torch.__version__
    measured_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    def read_bandwidth(self, threads: int | None = None) -> float | None:
        """Best read-only bandwidth (bytes/s) at `threads` (default: the most threads measured)."""
        if not self.bandwidth:
            return None
        key = str(threads) if threads is not None and str(threads) in self.bandwidth else \
            max(self.bandwidth, key=int)
        return self.bandwidth[key]["read"].best

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "MachineProfile":
        bandwidth = {t: {k: Sample(**s) for k, s in kernels.items()} for t, kernels in data.get("bandwidth", {}).items()}
        flops = {k: Sample(**s) for k, s in data.get("flops", {}).items()}
        rest = {k: v for k, v in data.items() if k not in ("bandwidth", "flops") and k in cls.__dataclass_fields__}
        return cls(bandwidth=bandwidth, flops=flops, **rest)


def machine_facts(threads: int | None = None) -> dict:
    """What every speed figure must name: the CPU (model name, and vendor, family/model/stepping and
    caches, which tell apart chips that share a name), the instruction set our kernels and ATen ran
    at (forced lower by WALLBREAKER_CPU_ISA / ATEN_CPU_CAPABILITY), the threads, the stored read
    bandwidth at those threads (`wallbreaker roofline` measures and stores it), and the commit and
    command line that made the figure (benchmarks/tables.py prints them beside every row)."""
    from .. import kernels
    from ..kernels.cpu_id import this_cpu
    threads = threads or torch.get_num_threads()
    profile = load_profile()
    bandwidth = profile.read_bandwidth(threads) if profile else None
    return {"cpu": kernels.cpu_model(), "cpu_id": this_cpu(), "cpu_isa": kernels.cpu_isa(), "kernel_isa": kernels.isa(),
            "aten_isa": torch.backends.cpu.get_cpu_capability(), "threads": threads,
            "read_bandwidth_gb_per_s": round(bandwidth / 1e9, 1) if bandwidth else None,
            "commit": source_commit(), "command": command_line()}


def source_commit() -> str | None:
    """The git commit of this source tree (`+dirty` where tracked files differ), or None outside git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def command_line() -> str:
    """The command that is running, as typed: `wallbreaker bench ...` or `benchmarks/x.py ...`."""
    argv = list(sys.argv) or [""]
    if Path(argv[0]).name == "wallbreaker":
        argv[0] = "wallbreaker"
    return shlex.join(argv)


def describe_machine(facts: dict) -> str:
    bandwidth = f"{facts['read_bandwidth_gb_per_s']} GB/s read" if facts.get("read_bandwidth_gb_per_s") \
        else "bandwidth not measured (run `wallbreaker roofline`)"
    cpu = f"{facts['cpu']} ({facts['cpu_id']})" if facts.get("cpu_id") else facts["cpu"]
    return (f"{cpu}; kernels {facts['kernel_isa']} (CPU supports {facts['cpu_isa']}), "
            f"ATen {facts['aten_isa']}; {facts['threads']} threads; {bandwidth}")


def machine_path() -> Path:
    from ..formats.packaged import cache_dir
    return cache_dir() / "machine.json"


def load_profile(path: Path | None = None) -> MachineProfile | None:
    path = path or machine_path()
    try:
        return MachineProfile.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def store_profile(profile: MachineProfile, path: Path | None = None) -> Path:
    path = path or machine_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=2))
    tmp.replace(path)
    return path


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of fn, after one call that warms up (first touches)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure_bandwidth(buffer_mib: int, repeats: int) -> dict[str, Sample]:
    """Read-only sum and copy over `buffer_mib` MiB, at the current torch thread count (bytes/s)."""
    n = buffer_mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    read = timed(lambda: src.sum(), repeats)
    copy = timed(lambda: dst.copy_(src), repeats)
    return {"read": Sample.of([nbytes / t for t in read]), "copy": Sample.of([2 * nbytes / t for t in copy])}


# Our quantized matmul kernels, by the width of the stored codes: the 4-bit and smaller formats
# run at the rate of Q4_0, the wider ones (5, 6, 8 bits) at the rate of Q8_0.
QUANT_KINDS = {"q4": gguf.GGMLQuantizationType.Q4_0, "q8": gguf.GGMLQuantizationType.Q8_0}
_FOUR_BIT_OR_LESS = {"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K"}


def quant_kind(qtype: int) -> str:
    return "q4" if gguf.GGMLQuantizationType(qtype).name in _FOUR_BIT_OR_LESS else "q8"


def _gemm(kind: str, size: int) -> tuple[Callable[[], object], float]:
    """One product as the engine runs it, and its FLOPs: size^3 float GEMMs; a quantized linear
    layer over random GGUF blocks (float32 activations; prefill-sized, so the dense path where it
    runs, kernels.dense_path); prefill attention
    (`attention_<dtype>`: PyTorch's SDPA, causal, 8 heads of 64 over size / 4 positions, K/V in the
    cache's dtype, as layers/attention.py calls it). A CPU without bfloat16 instructions runs SDPA
    in bfloat16 far faster than a bfloat16 GEMM (Zen 3: 0.3 GFLOP/s), so attention gets its own rate."""
    g = torch.Generator().manual_seed(0)
    if kind in ("float32", "bfloat16"):
        dtype = getattr(torch, kind)
        a = torch.randn(size, size, generator=g).to(dtype)
        b = torch.randn(size, size, generator=g).to(dtype)
        return (lambda: torch.mm(a, b)), 2.0 * size**3
    if kind in QUANT_KINDS:
        from .. import kernels
        qtype = QUANT_KINDS[kind]
        w = kernels.pack_rows(torch.from_numpy(gguf.quants.quantize(torch.randn(size, size, generator=g).numpy(),
                                                                    qtype)), qtype)
        from ..layers.linear import QuantLinear
        layer = QuantLinear([(w, int(qtype))], size)  # the integer tiles, or the dense path where it runs
        x = torch.randn(size, size, generator=g)
        return (lambda: layer(x)), 2.0 * size**3
    if kind in ATTENTION_KINDS:
        heads, length, dim = 8, max(size // 4, 16), 64
        q, k, v = (torch.randn(1, heads, length, dim, generator=g).to(ATTENTION_KINDS[kind]) for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return (lambda: sdpa(q, k, v, is_causal=True)), 2.0 * heads * length * length * dim  # QKᵀ and PV, half
    raise ValueError(f"unknown matmul kind {kind!r}")


ATTENTION_KINDS = {"attention_float32": torch.float32, "attention_bfloat16": torch.bfloat16}
GEMM_KINDS = ("float32", "bfloat16", *QUANT_KINDS, *ATTENTION_KINDS)


def measure_flops(size: int, repeats: int, kinds: tuple[str, ...] = GEMM_KINDS) -> dict[str, Sample]:
    """FLOP/s of each kind's product (see `_gemm`), at the current torch thread count."""
    out = {}
    for kind in kinds:
        fn, flops = _gemm(kind, size)
        out[kind] = Sample.of([flops / t for t in timed(fn, repeats)])
    return out


def measure(threads: list[int], buffer_mib: int = 512, repeats: int = 5, gemm_size: int = 2048) -> MachineProfile:
    """Bandwidth at each thread count; FLOP/s at the largest. Restores the thread count it found."""
    before = torch.get_num_threads()
    profile = MachineProfile(buffer_mib=buffer_mib, gemm_size=gemm_size, repeats=repeats)
    try:
        for t in sorted(set(threads)):
            torch.set_num_threads(t)
            profile.bandwidth[str(t)] = measure_bandwidth(buffer_mib, repeats)
        torch.set_num_threads(max(threads))
        profile.flops = measure_flops(gemm_size, max(2, repeats // 2))
    finally:
        torch.set_num_threads(before)
    return profile
