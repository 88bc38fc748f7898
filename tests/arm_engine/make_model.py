"""The tiny random-weight llama of tests/tiny_models.py, written for the aarch64 run: its transformers
folder (`hf/`, float32 safetensors) and GGUFs of the same weights with every 2-D weight in Q8_0 and
in Q4_0 (gguf-py's reference quantization), so that the aarch64 build's `arm` tiles run.

    python make_model.py OUT_DIR
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import make_tiny_model  # noqa: E402

TYPES = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0)


def main(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    model = make_tiny_model("llama", out)
    for qtype in TYPES:
        model.quantized_gguf(qtype)
    print(f"tiny llama in {out}: " + " ".join(sorted(p.name for p in out.iterdir())))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
