"""Images in beside llama.cpp's `llama-mtmd-cli` (issue 50, item 6): the image's encode time and the
time to first token of a one-image prompt, on the same GGUF and mmproj pair of a real model's shape
with random weights (`--shape`: SmolVLM-256M's or Gemma-3-4B's), and the time to first token of the
same image in a second conversation (the prefix and encoder caches' hits: issue 50, item 3, at most
half the cold one).

The model: transformers builds the real model's shape (tests/tiny_smolvlm.py `SMOLVLM_256M`,
tests/tiny_vision.py `GEMMA3_4B`; random weights, SmolLM2's tokenizer with the family's added tokens,
so Gemma's 262k vocabulary is SmolLM2's 49k here) as a Hugging Face folder, and llama.cpp's own
converter writes the pair (text Q8_0, mmproj F16), so both engines read the very files a user would
have converted. Everything is written outside the repository (`--dir`; the Gemma-3-4B shape takes
some 20 GB there while it is made, 8 GB after). Each side runs in fresh processes, A/B/A (ours,
llama.cpp, ours) per round; the photograph is scikit-image's astronaut (512x512: SmolVLM resizes it
to its longest edge of 2048 and splits it into 4 x 4 tiles plus the global image; Gemma 3 scales it
to 896x896, 256 image tokens).

    python benchmarks/vision.py --dir ~/vision-models --llama-cpp-dir ~/llama.cpp/build/bin
    python benchmarks/vision.py --dir ~/vision-models --shape gemma3-4b --rounds 1 --llama-cpp-dir ...
    python benchmarks/vision.py --dir /tmp/v --rounds 1 --json /tmp/v.json      # no llama.cpp: ours only

llama-mtmd-cli comes from the llama-cpp-python sdist's vendored llama.cpp (`cmake -B build
-DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target llama-mtmd-cli`), built outside the
repository. Writes benchmarks/results/vision_<shape>.json with the machine, the command and every run.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# tests/ for the converter's fetcher and the SmolVLM builder, in place of benchmarks/ itself, whose
# kernels.py would shadow the `kernels` package transformers imports
sys.path[0] = str(Path(__file__).resolve().parent.parent / "tests")

RESULTS = Path(__file__).parent / "results"
PROMPTS = ("Describe the image.", "What colours are in it?")

_OURS = r"""
import json, sys, time
from PIL import Image
from wallbreaker import LLM, SamplingParams
text, mmproj, image, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
llm = LLM(text, mmproj=mmproj, num_threads=threads)
picture = Image.open(image).convert("RGB")
one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
rows = []
for prompt in %r:
    out = llm.chat([{"role": "user", "content": [{"type": "image", "image": picture},
                                                   {"type": "text", "text": prompt}]}], one)[0]
    rows.append({"ttft_s": out.metrics["ttft_s"], "image_encode_s": out.metrics.get("image_encode_s", 0.0),
                 "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.metrics["num_cached_prompt_tokens"]})
print(json.dumps(rows))
""" % (PROMPTS,)


SHAPES = {"smolvlm-256m": "SmolVLM-256M", "gemma3-4b": "Gemma-3-4B"}


def build_pair(shape: str, out: Path) -> tuple[Path, Path]:
    """The random-weight folder of `shape` and llama.cpp's converter's pair of it (Q8_0 text, F16
    mmproj), made once in `out`."""
    from llamacpp_converter import convert, fetch

    from wallbreaker.formats.packaged import cache_dir
    folder = out / "hf"
    if not (folder / "config.json").is_file():
        if shape == "gemma3-4b":
            from tiny_vision import GEMMA3_4B, make_tiny_gemma3_vision
            make_tiny_gemma3_vision(folder, convertible=True, shape=GEMMA3_4B)
        else:
            from tiny_smolvlm import SMOLVLM_256M, make_tiny_smolvlm
            make_tiny_smolvlm(folder, shape=SMOLVLM_256M)
    converter = fetch(cache_dir())
    return (convert(converter, folder, "q8_0", out / f"{shape}-q8_0.gguf"),
            convert(converter, folder, "f16", out / f"mmproj-{shape}-f16.gguf", ("--mmproj",)))


def photograph(out: Path) -> Path:
    from PIL import Image
    from skimage import data
    path = out / "astronaut.png"
    if not path.is_file():
        Image.fromarray(data.astronaut()).save(path)
    return path


def ours(text: Path, mmproj: Path, image: Path, threads: int) -> list[dict]:
    """One fresh process: the cold request, then the same image in a second conversation."""
    done = subprocess.run([sys.executable, "-c", _OURS, str(text), str(mmproj), str(image), str(threads)],
                          capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_cpp(tool: Path, text: Path, mmproj: Path, image: Path, threads: int) -> dict:
    """`llama-mtmd-cli` generating one token: the image's encode time (the sum of its "mtmd batch
    encoding done in" lines, one a tile) and the time to its first token (the process's wall time
    from its `main: loading model` line on: its model load, a fraction of a second, counts against
    it). `--no-repack`: llama.cpp's AMX weight buffers crash in `ggml_backend_amx_mul_mat` on the AMX
    Xeon this was first run on; without them it runs its AVX-512 kernels."""
    start = time.perf_counter()
    done = subprocess.run([str(tool), "-m", str(text), "--mmproj", str(mmproj), "--image", str(image),
                           "-p", PROMPTS[0], "-n", "1", "-t", str(threads), "--temp", "0", "-c", "4096",
                           "--no-repack"], capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    log = done.stdout + done.stderr
    if done.returncode:
        raise RuntimeError(f"llama-mtmd-cli exited with {done.returncode}: {log.strip().splitlines()[-3:]}")
    encoded = [float(m) for m in re.findall(r"mtmd batch encoding done in (\d+(?:\.\d+)?) ms", log)]
    main_at = re.search(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I main: loading model", log, re.M)
    if not encoded or main_at is None:
        raise RuntimeError("llama-mtmd-cli's log has no encode timings or no `main: loading model` line")
    minutes, seconds, ms, us = (int(x) for x in main_at.groups())
    return {"image_encode_s": sum(encoded) / 1e3, "tiles_encoded": len(encoded), "wall_s": wall,
            "ttft_s": wall - (60 * minutes + seconds + ms / 1e3 + us / 1e6)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="where the model and its GGUF pair are made (outside the repo)")
    p.add_argument("--llama-cpp-dir", default=None, help="folder with llama-mtmd-cli (else $LLAMA_CPP_DIR, PATH)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smolvlm-256m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="A/B/A rounds (ours, llama.cpp, ours)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    from wallbreaker.measure.baselines.llama_cpp import find_tool
    from wallbreaker.measure.machine import describe_machine, machine_facts
    args.dir.mkdir(parents=True, exist_ok=True)
    text, mmproj = build_pair(args.shape, args.dir / args.shape)
    image = photograph(args.dir)
    tool = find_tool("llama-mtmd-cli", args.llama_cpp_dir)
    facts = machine_facts(args.threads)
    print(describe_machine(facts))
    runs: list[dict] = []
    for r in range(args.rounds):
        for side in ("ours", "llama.cpp", "ours"):
            if side == "llama.cpp":
                if tool is None:
                    continue
                row = {"side": side, "round": r, **llama_cpp(tool, text, mmproj, image, args.threads)}
            else:
                cold, warm = ours(text, mmproj, image, args.threads)
                row = {"side": side, "round": r, **cold, "warm_ttft_s": warm["ttft_s"],
                       "warm_cached_tokens": warm["cached_tokens"], "warm_image_encode_s": warm["image_encode_s"]}
            runs.append(row)
            print(json.dumps(row))

    def median(side: str, key: str) -> float | None:
        values = [row[key] for row in runs if row["side"] == side and row.get(key) is not None]
        return statistics.median(values) if values else None
    summary = {"ours_ttft_s": median("ours", "ttft_s"), "ours_image_encode_s": median("ours", "image_encode_s"),
               "ours_warm_ttft_s": median("ours", "warm_ttft_s"),
               "llama_cpp_ttft_s": median("llama.cpp", "ttft_s"),
               "llama_cpp_image_encode_s": median("llama.cpp", "image_encode_s")}
    if summary["ours_warm_ttft_s"] and summary["ours_ttft_s"]:
        summary["warm_over_cold"] = summary["ours_warm_ttft_s"] / summary["ours_ttft_s"]
    if summary["llama_cpp_ttft_s"]:
        summary["ttft_speedup"] = summary["llama_cpp_ttft_s"] / summary["ours_ttft_s"]
        summary["encode_speedup"] = summary["llama_cpp_image_encode_s"] / summary["ours_image_encode_s"]
    print(json.dumps(summary))
    out = args.json or RESULTS / f"vision_{args.shape}.json"
    out.write_text(json.dumps({"machine": facts, "command": facts["command"], "model": f"{SHAPES[args.shape]} shape, "
                               "random weights, text Q8_0 + mmproj F16 (llama.cpp's converter)", "image": "skimage astronaut "
                               "512x512", "summary": summary, "runs": runs}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
