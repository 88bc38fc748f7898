"""Compares the aarch64 runs' greedy tokens (generate.py under qemu) with this x86-64 host's, prints
the verdict and exits 1 on any difference.

    python compare.py OUT_DIR [--results FILE] [--host-seconds S --emulated-seconds S ...]

Each run must give the tokens of the same run on x86-64 at the generic level (the arm level is bit
for bit the generic one; the float32 runs do not use the quantized kernels), and each guest CPU
must have chosen the `arm` level. Whether the quantized runs also equal the x86 float32 path's
tokens is reported, not required: a random-weight model's logits are close enough for Q8_0/Q4_0
rounding to change an argmax.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

GUESTS = ("max", "neoverse-n1")
REFERENCE = "hf-float32"


def _version(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "?"


def compare(out: Path) -> tuple[dict, list[str]]:
    x86 = json.loads((out / "x86-64-generic.json").read_text())
    native = json.loads((out / "x86-64-native.json").read_text())
    problems: list[str] = []
    guests = {}
    for cpu in GUESTS:
        arm = json.loads((out / f"aarch64-{cpu}.json").read_text())
        if arm["machine"] != "aarch64":
            problems.append(f"-cpu {cpu}: ran on {arm['machine']}")
        if arm["isa"] != "arm" or arm["isa_after"] != "arm":
            problems.append(f"-cpu {cpu}: kernel level {arm['isa']!r}, expected 'arm'")
        runs = {}
        for name, run in arm["runs"].items():
            same = run["tokens"] == x86["runs"][name]["tokens"]
            if not same:
                problems.append(f"-cpu {cpu} {name}: {run['tokens']} != x86-64 {x86['runs'][name]['tokens']}")
            runs[name] = {"equal_x86_same_path": same,
                          "equal_x86_float32": run["tokens"] == x86["runs"][REFERENCE]["tokens"],
                          "seconds": run["seconds"]}
        guests[cpu] = {"isa": arm["isa"], "python": arm["python"], "torch": arm["torch"],
                       "import_s": arm["import_s"], "runs": runs}
    summary = {
        "command": "make test-arm-engine  (tests/arm_engine/run.sh)",
        "host": f"{platform.machine()} {_cpu_model()}",
        "qemu": _version("qemu-aarch64-static", "--version"),
        "cross_compiler": _version("aarch64-linux-gnu-g++", "--version"),
        "x86_isa_native": native["isa"],
        "x86_native_equal_generic": all(native["runs"][n]["tokens"] == x86["runs"][n]["tokens"] for n in x86["runs"]),
        "tokens": {name: run["tokens"] for name, run in x86["runs"].items()},
        "guests": guests,
        "passed": not problems,
    }
    return summary, problems


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--results", type=Path)
    parser.add_argument("--host-seconds", type=int)
    parser.add_argument("--emulated-seconds", type=int)
    parser.add_argument("--pytest-seconds", type=int)
    parser.add_argument("--pytest-args")
    parser.add_argument("--pytest-summary")
    args = parser.parse_args()
    summary, problems = compare(args.out)
    summary["seconds"] = {"build_or_check_cache": args.host_seconds, "generate_x86_and_emulated": args.emulated_seconds}
    if args.pytest_seconds is not None:
        summary["pytest"] = {"args": args.pytest_args, "summary": args.pytest_summary, "seconds": args.pytest_seconds}
    text = json.dumps(summary, indent=1) + "\n"
    (args.out / "arm_engine.json").write_text(text)
    if args.results:
        args.results.write_text(text)
    for cpu, guest in summary["guests"].items():
        print(f"-cpu {cpu}: level {guest['isa']}, torch {guest['torch']} imported in {guest['import_s']} s; "
              + ", ".join(f"{n} {'=' if r['equal_x86_same_path'] else '!='} x86-64" for n, r in guest["runs"].items()))
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        sys.exit(1)
    print("aarch64 under qemu: every run's 16 greedy tokens equal x86-64's")


if __name__ == "__main__":
    main()
