"""Greedy tokens of the tiny model's files, as JSON: the same script on x86-64 (the reference) and on
the aarch64 build under qemu.

    python generate.py MODEL_DIR OUT.json [--isa LEVEL]

MODEL_DIR holds `hf/` (transformers' folder) and the GGUFs of `make_model.py`. Every run of
`RUNS` loads one file with one dtype and generates `MAX_TOKENS` greedy tokens for each prompt of
`PROMPTS`; the torch import and the model loads of one process are shared, since under qemu
the import alone takes minutes. `--isa` sets WALLBREAKER_CPU_ISA (x86: `generic`, the level
that the arm one matches bit for bit).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

MAX_TOKENS = 16
PROMPTS = ("The quick brown fox", "Hello, world! How are you today?")
RUNS = (  # (name, file under MODEL_DIR, dtype)
    ("hf-float32", "hf", "float32"),
    ("gguf-f32-float32", "model.gguf", "float32"),
    ("hf-auto", "hf", "auto"),
    ("q8_0-auto", "model-Q8_0.gguf", "auto"),
    ("q4_0-auto", "model-Q4_0.gguf", "auto"),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--isa", default=None)
    args = parser.parse_args()
    if args.isa:
        os.environ["WALLBREAKER_CPU_ISA"] = args.isa
    os.environ.setdefault("WALLBREAKER_KERNEL_TUNING", "0")  # each level's default tiles; no timing under qemu
    started = time.monotonic()
    import torch

    from wallbreaker import LLM, SamplingParams
    from wallbreaker import kernels
    imported = time.monotonic() - started
    result = {"machine": platform.machine(), "python": sys.version.split()[0], "torch": torch.__version__,
              "isa": kernels.isa(), "import_s": round(imported, 1), "runs": {}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for name, file, dtype in RUNS:
        t0 = time.monotonic()
        llm = LLM(model=str(args.model_dir / file), dtype=dtype)
        outs = llm.generate(list(PROMPTS), params)
        result["runs"][name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                                "seconds": round(time.monotonic() - t0, 1)}
        print(name, result["runs"][name], flush=True)
    result["isa_after"] = kernels.isa()
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
