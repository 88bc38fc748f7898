"""A speed model of the arm level's inner loops where no ARM hardware is: `llvm-mca` (LLVM 19) on the
loops GCC emits for csrc/kernels_arm.cpp, for Apple M1 and Neoverse V1/V2/N2 cores.

    python benchmarks/arm_mca.py [--out benchmarks/results/arm_mca.json]

Compiles kernels_arm.cpp for aarch64 as setup.py would (aarch64-linux-gnu-g++ -O3, fp-contract off;
the file sets armv8.2-a+dotprod+i8mm itself), takes from each tile function named below the
shortest loop that holds the most of its products (`sdot`: 16 weights x 1 activation row;
`smmla`: 2 x 2 x 8; the per-block loop, or per group of 4 32-blocks where GCC unrolled the group),
and runs `llvm-mca -mcpu=CPU` on that loop body as straight-line code
(both sides of any branch inside counted). Reports llvm-mca's block reciprocal throughput (cycles
an iteration in the steady state) and cycles per 256 weight x activation-row products.

A model, not a measurement: llvm-mca assumes every load hits L1 and knows nothing of the memory
bandwidth that bounds batch 1 on real hardware; `apple-m1` uses LLVM's Cyclone-derived model.
Needs g++-aarch64-linux-gnu and llvm-19 (apt-get install).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPUS = ("apple-m1", "neoverse-v1", "neoverse-v2", "neoverse-n2")
QT = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
      "Q6_K": 14}
# (format, tile function, MT activation rows, NT weight rows): the batch-1 tile of the default knobs
# and the tile of calls of several rows
LOOPS = [(f, "tile_b32", mt, 4) for f in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") for mt in (1, 4)]
LOOPS += [(f, fn, mt, nt) for f, fn in (("Q4_K", "tile_k45"), ("Q5_K", "tile_k45"), ("Q6_K", "tile_k6"),
                                         ("Q2_K", "tile_k23"), ("Q3_K", "tile_k23")) for mt, nt in ((1, 4), (4, 2))]
# the i8mm tiles of several rows (CPUs with FEAT_I8MM)
LOOPS += [(f, "tile_b32_mm", 4, 4) for f in ("Q4_0", "Q8_0")] + [(f, "tile_k_mm", 4, 2) for f in ("Q4_K", "Q6_K")]
# llama.cpp's batch-1 dot products (ggml-cpu/arch/arm/quants.c: one weight row by one activation row)
LLAMACPP = [("Q4_0", "ggml_vec_dot_q4_0_q8_0"), ("Q8_0", "ggml_vec_dot_q8_0_q8_0"), ("Q4_K", "ggml_vec_dot_q4_K_q8_K"),
            ("Q6_K", "ggml_vec_dot_q6_K_q8_K")]
LLAMACPP_GGML = Path.home() / ".cache/wallbreaker/llama-cpp-ggml-0.3.36/ggml"  # `make llamacpp` puts it there
BRANCH = re.compile(r"^\s*(b\.?\w*|cbn?z|tbn?z)\s+(?:[^,]+,\s*)*(\.L\w+)\s*$")


def compile_asm(out: Path) -> str:
    """kernels_arm.cpp with a caller of each tile of LOOPS outside its target region (so that GCC
    keeps each tile a function of its own), as assembly."""
    probe = out.with_suffix(".cpp")
    calls = "".join(f"extern \"C\" void probe_{i}(const uint8_t* w, int64_t rb, int64_t nb, const wb::ActQ8& a, "
                    f"float* o) {{ wb::{fn}<wb::{fmt}, {mt}, {nt}>(w, rb, nb, a, 0, o, 4); }}\n"
                    for i, (fmt, fn, mt, nt) in enumerate(LOOPS))
    probe.write_text(f'#include "{ROOT}/csrc/kernels_arm.cpp"\n' + calls)
    cmd = ["aarch64-linux-gnu-g++", "-std=c++20", "-O3", "-ffp-contract=off", "-fno-math-errno", f"-I{ROOT}/csrc",
           "-S", str(probe), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return "aarch64-linux-gnu-g++ -std=c++20 -O3 -ffp-contract=off -fno-math-errno -S (csrc/kernels_arm.cpp and a caller of each tile)"


def compile_llamacpp(ggml: Path, out: Path) -> str:
    """llama.cpp's ARM quants.c as its build would compile it for an Armv8.2-A+dotprod+i8mm CPU."""
    cmd = ["aarch64-linux-gnu-gcc", "-std=gnu11", "-O3", "-march=armv8.2-a+dotprod+i8mm", f"-I{ggml}/include",
           f"-I{ggml}/src", f"-I{ggml}/src/ggml-cpu", "-S", str(ggml / "src/ggml-cpu/arch/arm/quants.c"), "-o", str(out)]
    subprocess.run(cmd, check=True)
    return "aarch64-linux-gnu-gcc -std=gnu11 -O3 -march=armv8.2-a+dotprod+i8mm -S ggml/src/ggml-cpu/arch/arm/quants.c"


def function_body(asm: list[str], fn: str, qt: int = 0, mt: int = 0, nt: int = 0) -> list[str]:
    if fn.startswith("ggml_"):
        name = re.compile(rf"^{fn}:$")
    else:
        name = re.compile(rf"^_ZN2wb12_GLOBAL__N_1\d+{fn}ILi{qt}ELi{mt}ELi{nt}EEEv\S*:$")
    start = next(i for i, line in enumerate(asm) if name.match(line))
    end = next(i for i in range(start + 1, len(asm)) if asm[i].lstrip().startswith(".size"))
    return asm[start:end]


def products(lines: list[str], op: str) -> int:
    """Weight x activation products of these instructions' op: sdot 16, smmla 32 (2 x 2 x 8)."""
    return (16 if op == "sdot" else 32) * sum(f"\t{op}\t" in x for x in lines)


def inner_loop(body: list[str], op: str) -> list[str]:
    """Of the loops (a label and a later branch back to it), the shortest that holds the most products
    by op (a dotprod tile of several rows also holds its i8mm sibling, inlined behind a branch)."""
    labels = {line[:-1]: i for i, line in enumerate(body) if re.match(r"^\.L\w+:$", line)}
    best = None  # (sdots, -length, i, j)
    for j, line in enumerate(body):
        m = BRANCH.match(line)
        if m and m.group(2) in labels and labels[m.group(2)] < j:
            i = labels[m.group(2)]
            key = (products(body[i:j + 1], op), i - j, i, j)
            best = key if best is None or key > best else best
    _, _, i, j = best
    return [x for x in body[i:j + 1] if x.startswith("\t") and not x.lstrip().startswith(".")]


def mca(loop: list[str], cpu: str, tool: str) -> dict:
    out = subprocess.run([tool, "-mtriple=aarch64", f"-mcpu={cpu}", "-mattr=+dotprod,+i8mm", "-iterations=200"], input="\n".join(loop) + "\n",
                         capture_output=True, text=True, check=True).stdout
    field = lambda key: float(re.search(rf"{key}:\s+([\d.]+)", out).group(1))
    return {"block_rthroughput": field("Block RThroughput"), "cycles_per_iteration": field("Total Cycles") / 200,
            "instructions": int(field("Instructions") / 200)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/arm_mca.json"))
    ap.add_argument("--mca", default=shutil.which("llvm-mca-19") or "llvm-mca")
    ap.add_argument("--llamacpp", default=str(LLAMACPP_GGML), help="llama.cpp's ggml folder (its ARM loops beside ours)")
    args = ap.parse_args()
    ggml = Path(args.llamacpp)
    with tempfile.TemporaryDirectory() as tmp:
        cc = compile_asm(Path(tmp) / "kernels_arm.s")
        asm = (Path(tmp) / "kernels_arm.s").read_text().splitlines()
        llama_cc, llama_asm = None, []
        if (ggml / "src/ggml-cpu/arch/arm/quants.c").exists():
            llama_cc = compile_llamacpp(ggml, Path(tmp) / "quants.s")
            llama_asm = (Path(tmp) / "quants.s").read_text().splitlines()
        else:
            print(f"no llama.cpp sources at {ggml} (make llamacpp): its loops are left out")
    version = subprocess.run([args.mca, "--version"], capture_output=True, text=True).stdout
    rows = []
    for fmt, fn, mt, nt in LOOPS:
        op = "smmla" if fn.endswith("_mm") else "sdot"
        loop = inner_loop(function_body(asm, fn, QT[fmt], mt, nt), op)
        weights = products(loop, op) // mt  # weights a loop iteration, per activation row
        row = {"format": fmt, "tile": f"{fn}<{fmt}, MT={mt}, NT={nt}>", "activation_rows": mt, "weight_rows": nt,
               "weights_per_iteration_per_row": weights, "loop_products": products(loop, op), "loop_instructions": len(loop), "cpus": {}}
        for cpu in CPUS:
            if op == "smmla" and cpu == "apple-m1":
                continue  # M1 has no i8mm (M2 and later do; LLVM models them as M1-like cores)
            r = mca(loop, cpu, args.mca)
            r["cycles_per_256_weights_per_row"] = round(r["block_rthroughput"] * 256 / weights / mt, 2)
            row["cpus"][cpu] = r
        rows.append(row)
        print(f"{row['tile']:32s} " + "  ".join(f"{c} {row['cpus'][c]['cycles_per_256_weights_per_row']:6.2f}"
                                                 for c in CPUS if c in row["cpus"]), flush=True)
    llama_rows = []
    for fmt, fn in LLAMACPP if llama_asm else []:
        loop = inner_loop(function_body(llama_asm, fn), "sdot")
        row = {"format": fmt, "function": fn, "weights_per_iteration": products(loop, "sdot"),
               "loop_instructions": len(loop), "cpus": {}}
        for cpu in CPUS:
            r = mca(loop, cpu, args.mca)
            r["cycles_per_256_weights_per_row"] = round(r["block_rthroughput"] * 256 / row["weights_per_iteration"], 2)
            row["cpus"][cpu] = r
        llama_rows.append(row)
        print(f"llama.cpp {fn:28s} " + "  ".join(f"{c} {row['cpus'][c]['cycles_per_256_weights_per_row']:6.2f}"
                                                  for c in CPUS), flush=True)
    result = {
        "what": "llvm-mca block reciprocal throughput of the arm level's per-block loops, as cycles per 256 weights "
                "per activation row (a model: every load an L1 hit, no memory bandwidth)",
        "command": "python benchmarks/arm_mca.py",
        "compile": cc,
        "llvm_mca": (re.search(r"LLVM version [\w.]+", version) or [args.mca])[0],
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "notes": "Batch 1 (MT=1) is bound by memory bandwidth on real cores long before these cycles for most "
                 "formats; the model says how much compute a core spends per weight, not tokens/s. Where the loop "
                 "found is an inner loop of the tile (tile_k23 at MT=4 and tile_k_mm: their dot loops, not the "
                 "decoding of the codes into the buffer, which runs once a block for the tile's activation rows), "
                 "the figure leaves that work out. The i8mm rows have no apple-m1 figure (M1 has no i8mm). llama.cpp's loops are not modelled here yet (issue 53).",
        "loops": rows,
        "llamacpp": {"source": "llama-cpp-python 0.3.36's vendored llama.cpp, ggml/src/ggml-cpu/arch/arm/quants.c",
                     "compile": llama_cc, "loops": llama_rows} if llama_rows else None,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
