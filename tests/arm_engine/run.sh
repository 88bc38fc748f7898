#!/usr/bin/env bash
# The whole engine on aarch64 once, under emulation (issue 53): wallbreaker._C cross-compiled for
# aarch64, imported by Debian's arm64 CPython 3.11 with PyPI's aarch64 torch wheel, run under
# qemu-aarch64-static; a tiny random-weight llama's 16 greedy tokens (float32 and quantized paths)
# against the same script's on this x86-64 host.
#
#   tests/arm_engine/run.sh            build what is missing (cached), then compare
#   ARM_PYTEST=1 tests/arm_engine/run.sh   also a pytest subset under emulation (PYTEST_ARGS: others)
#
# Everything lives in $CACHE (~/.cache/wallbreaker/arm64, outside the repository): Debian's arm64
# packages unpacked into sysroot/ (downloaded, not installed: dpkg's architectures are left alone),
# the aarch64 wheels in site/, the CUDA stand-ins (cuda_stubs.py), the extension
# (build_ext.sh, rebuilt when csrc/ changes), the tiny model, the outputs. A second run rebuilds
# nothing. Needs root and apt (cross compiler, qemu, arm64 packages) and PyPI the first time;
# without them it says so and exits 0. RESULTS=FILE also writes the comparison there (what
# benchmarks/results/arm_engine.json holds). PYTHON: the x86-64 Python with wallbreaker's test
# dependencies (the venv's).
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=tests/arm_engine
CACHE="${CACHE:-$HOME/.cache/wallbreaker/arm64}"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
PYVER=3.11
skip() { echo "skipped: $*"; exit 0; }
mkdir -p "$CACHE"/{debs,wheels,out}
started=$SECONDS

# 1. the cross compiler and qemu
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    || skip "needs g++-aarch64-linux-gnu and qemu-user-static (apt-get install, as root)"
  apt-get update -qq || skip "apt-get update failed (no network?)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user-static >/dev/null
fi

# 2. Debian's arm64 CPython and the C/C++ runtime, unpacked into sysroot/
DEBS=(python$PYVER-minimal libpython$PYVER-minimal libpython$PYVER-stdlib libpython$PYVER-dev libpython$PYVER
      libc6 libstdc++6 libgcc-s1 libgomp1 zlib1g libffi8 libssl3 libexpat1 libbz2-1.0 liblzma5 libsqlite3-0
      libuuid1 libncursesw6 libtinfo6 libreadline8 libcrypt1 libnsl2 libtirpc3 libdb5.3 libgdbm6)
if [ ! -f "$CACHE/sysroot/.done" ]; then
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || skip "the arm64 sysroot needs apt-get as root"
  # arm64 for these two commands only: dpkg's own architectures stay as they are
  arches=(-o APT::Architectures::="$(dpkg --print-architecture)" -o APT::Architectures::=arm64)
  apt-get "${arches[@]}" update -qq || skip "apt-get update failed (no network?)"
  (cd "$CACHE/debs" && apt-get "${arches[@]}" download "${DEBS[@]/%/:arm64}" >/dev/null 2>&1) \
    || skip "apt-get download of arm64 packages failed"
  rm -rf "$CACHE/sysroot"
  for deb in "$CACHE"/debs/*.deb; do dpkg -x "$deb" "$CACHE/sysroot"; done
  # qemu-user shows the guest the host's /proc/cpuinfo (x86's) unless the -L prefix has one:
  # torch's cpuinfo (libc10) dereferences a null processor table when it finds no ARM cores there
  "$PYTHON" - "$CACHE/sysroot" <<'PY'
import sys
from pathlib import Path
root = Path(sys.argv[1])
core = ("processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp "
        "asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\n"
        "CPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n")
(root / "proc").mkdir(exist_ok=True)
(root / "proc/cpuinfo").write_text("\n".join(core.format(i=i) for i in range(2)))
cpus = root / "sys/devices/system/cpu"
cpus.mkdir(parents=True, exist_ok=True)
for name in ("possible", "present", "online"):
    (cpus / name).write_text("0-1\n")
PY
  touch "$CACHE/sysroot/.done"
fi

# 3. PyPI's aarch64 wheels into site/: torch (the same version as here; without its CUDA wheels)
TORCH="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
TRANSFORMERS="$("$PYTHON" -c 'import transformers; print(transformers.__version__)')"  # the pytest subset's reference
PIP=("$PYTHON" -m pip download -q --only-binary=:all: --python-version $PYVER --implementation cp
     --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 -d "$CACHE/wheels")
if [ ! -f "$CACHE/site/.done-$TORCH-$TRANSFORMERS" ]; then
  "${PIP[@]}" --no-deps "torch==$TORCH" 2>>"$CACHE/pip.log" \
    || skip "pip download of the aarch64 torch wheel failed (no network? $CACHE/pip.log)"
  "${PIP[@]}" numpy "gguf>=0.19,<0.20" tokenizers jinja2 safetensors tqdm psutil pytest pyyaml filelock typing-extensions \
    sympy networkx fsspec "transformers==$TRANSFORMERS" 2>>"$CACHE/pip.log" || skip "pip download failed ($CACHE/pip.log)"
  rm -rf "$CACHE/site" "$CACHE/stubs"
  mkdir -p "$CACHE/site"
  for wheel in "$CACHE"/wheels/*.whl; do
    case "$wheel" in */torch-*) [[ "$wheel" == */torch-$TORCH-* ]] || continue ;; esac
    "$PYTHON" -m zipfile -e "$wheel" "$CACHE/site"
  done
  touch "$CACHE/site/.done-$TORCH-$TRANSFORMERS"
fi

# 4. stand-ins for the CUDA libraries the torch wheel links against
[ -f "$CACHE/stubs/libcudart.so.13" ] || nice "$PYTHON" $HERE/cuda_stubs.py "$CACHE/site" "$CACHE/sysroot" "$CACHE/stubs"

# 5. wallbreaker._C for aarch64 (rebuilt when csrc/ changes), and the package beside it
SO="$CACHE/ext/_C.cpython-${PYVER/./}-aarch64-linux-gnu.so"
$HERE/build_ext.sh "$CACHE/sysroot" "$CACHE/site" "$SO"
rm -rf "$CACHE/pkg" && mkdir -p "$CACHE/pkg" && cp -r src/wallbreaker "$CACHE/pkg/"
find "$CACHE/pkg" -name __pycache__ -prune -exec rm -rf {} + && rm -f "$CACHE"/pkg/wallbreaker/_C*.so
cp "$SO" "$CACHE/pkg/wallbreaker/"
built=$SECONDS

# 6. the tiny model, and its tokens here (the x86-64 build; the quantized runs at the generic level,
#    which the arm level matches bit for bit)
if [ ! -f "$CACHE/model/.done" ] || [ $HERE/make_model.py -nt "$CACHE/model/.done" ]; then
  PYTHONPATH=src nice "$PYTHON" $HERE/make_model.py "$CACHE/model" && touch "$CACHE/model/.done"
fi
OMP_NUM_THREADS=1 PYTHONPATH=src "$PYTHON" $HERE/generate.py "$CACHE/model" "$CACHE/out/x86-64-generic.json" --isa generic
OMP_NUM_THREADS=1 PYTHONPATH=src "$PYTHON" $HERE/generate.py "$CACHE/model" "$CACHE/out/x86-64-native.json"

# 7. the same under qemu: -cpu max (dotprod, i8mm, SVE) and -cpu neoverse-n1 (dotprod alone)
guest() {  # guest CPU, then the aarch64 python's arguments
  local cpu="$1"; shift
  nice qemu-aarch64-static -cpu "$cpu" -L "$CACHE/sysroot" -E LD_LIBRARY_PATH="$CACHE/stubs" \
    -E PYTHONPATH="$CACHE/pkg:$CACHE/site:$PWD/tests" -E PYTHONNOUSERSITE=1 -E OMP_NUM_THREADS=1 \
    -E WALLBREAKER_KERNEL_TUNING=0 -E HOME="$CACHE/home" "$CACHE/sysroot/usr/bin/python$PYVER" "$@"
}
for cpu in max neoverse-n1; do
  echo "== qemu-aarch64-static -cpu $cpu"
  guest "$cpu" $HERE/generate.py "$CACHE/model" "$CACHE/out/aarch64-$cpu.json"
done
emulated=$SECONDS

# 8. an optional pytest subset under emulation
pytest_s=""
# the kernels at the arm level against gguf's dequantization and across calls, paged attention
# against dense attention, and a tiny llama against transformers (logits, 32 greedy tokens)
PYTEST=(tests/test_kernels.py tests/test_attention_kernel.py tests/test_parity.py -k
        "dequantization or same_bits or forcing_a_level or auto_model_matches or paged_attention_matches_dense or (tiny_model_matches_transformers and llama)")
[ -z "${PYTEST_ARGS:-}" ] || eval "PYTEST=($PYTEST_ARGS)"
if [ -n "${ARM_PYTEST:-}" ]; then
  echo "== pytest under qemu-aarch64-static -cpu max: ${PYTEST[*]}"
  t0=$SECONDS
  guest max -m pytest -o addopts= -q -p no:cacheprovider "${PYTEST[@]}" | tee "$CACHE/out/pytest.log"
  pytest_s=$((SECONDS - t0))
fi

"$PYTHON" $HERE/compare.py "$CACHE/out" --host-seconds "$((built - started))" --emulated-seconds "$((emulated - built))" \
  ${pytest_s:+--pytest-seconds "$pytest_s" --pytest-args "${PYTEST[*]}" --pytest-summary "$(tail -1 "$CACHE/out/pytest.log")"} ${RESULTS:+--results "$RESULTS"}
