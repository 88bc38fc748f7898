"""Reference data for the kernel harness (tests/kernel_harness/harness.cpp), made by the `gguf`
package on the host: for every format of the kernels' table, random rows of blocks in the file's
order, their dequantization by `gguf.quants.dequantize`, and activations. The harness (natively,
or cross-compiled and run under qemu) checks every kernel level's matmul against these.

    python tests/kernel_harness/make_data.py OUT_DIR

Writes OUT_DIR/manifest.txt (one line a format: name, GGML type, rows, row length, activation
rows) and, per format, NAME.w (uint8 [rows, row bytes]), NAME.deq (float32 [rows, K]) and NAME.x
(float32 [M, K]), little-endian. A few hundred KB in all; made at test time, never committed.
Needs numpy and gguf only (no torch, no wallbreaker).
"""
from __future__ import annotations

import sys
from pathlib import Path

import gguf
import gguf.quants
import numpy as np

T = gguf.GGMLQuantizationType
FORMATS = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
# the float16 scale fields of a block (random bytes elsewhere keep them finite and of sane size)
F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
ROWS, ACT_ROWS = 37, 9  # tiles of 4 and 2 weight rows with a tail; every activation tile and a tail


def random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] valid blocks: gguf's quantization of random floats where it has one (the
    32-blocks), else random bytes with float16 scale fields of sane size, positive and negative."""
    try:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
        blocks = raw.reshape(-1, size)
        for off in F16_FIELDS[qtype]:
            half = (rng.standard_normal(len(blocks)) * 0.02).astype(np.float16)
            blocks[:, off:off + 2] = half.view(np.uint8).reshape(-1, 2)
        return raw


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for qtype in FORMATS:
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        k = 512 if block == 256 else 608  # 19 blocks of 32: an odd count, a short last group
        rng = np.random.default_rng(int(qtype))
        raw = random_blocks(qtype, ROWS, k, rng)
        deq = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(ROWS, k)
        x = (rng.standard_normal((ACT_ROWS, k)) * rng.random((ACT_ROWS, 1)) * 4).astype(np.float32)
        x[:, 40:44] = 0  # a stretch of zeros keeps d_x = 0 honest where a block is all zero
        x[1, 256:288] = 0
        raw.astype("<u1").tofile(out / f"{qtype.name}.w")
        deq.astype("<f4").tofile(out / f"{qtype.name}.deq")
        x.astype("<f4").tofile(out / f"{qtype.name}.x")
        lines.append(f"{qtype.name} {int(qtype)} {ROWS} {k} {ACT_ROWS}")
    (out / "manifest.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
