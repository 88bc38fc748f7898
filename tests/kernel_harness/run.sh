#!/usr/bin/env bash
# Builds the kernel harness (harness.cpp with csrc's kernel files, no torch) and runs it against
# the portable level and gguf's dequantization (make_data.py, into a temporary folder).
#
#   tests/kernel_harness/run.sh native   this machine's compiler and CPU (x86: the avx2/avx512 levels)
#   tests/kernel_harness/run.sh arm      cross-compiled for aarch64 and run under qemu-aarch64-static,
#                                        with dotprod and i8mm (-cpu max: the arm level, its i8mm
#                                        tiles), dotprod alone (-cpu neoverse-n1) and neither
#                                        (-cpu cortex-a53: the fallback to the portable level); and
#                                        built by clang too where clang++ is installed
#
# `arm` installs g++-aarch64-linux-gnu and qemu-user-static with apt-get where it runs as root and
# they are missing; otherwise it says what to install and exits 0 (skipped). PYTHON: a Python with
# numpy and gguf (make's $(BIN)/python). BUILD: where the binaries go (build/kernel_harness).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode="${1:-native}"
PYTHON="${PYTHON:-python3}"
BUILD="${BUILD:-build/kernel_harness}"
FLAGS=(-std=c++20 -O2 -fno-math-errno -Icsrc)  # fp-contract: set by the kernel files themselves
SRC=(tests/kernel_harness/harness.cpp csrc/kernels_generic.cpp csrc/kernels_avx2.cpp csrc/kernels_avx512.cpp
     csrc/kernels_arm.cpp csrc/attention_generic.cpp)
mkdir -p "$BUILD"
data="$(mktemp -d)"
trap 'rm -rf "$data"' EXIT
"$PYTHON" tests/kernel_harness/make_data.py "$data"

case "$mode" in
  native)
    nice "${CXX:-g++}" "${FLAGS[@]}" "${SRC[@]}" -o "$BUILD/harness"
    "$BUILD/harness" --data "$data"
    ;;
  arm)
    if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user-static >/dev/null
      else
        echo "skipped: needs g++-aarch64-linux-gnu and qemu-user-static" \
             "(apt-get install g++-aarch64-linux-gnu qemu-user-static, as root)"
        exit 0
      fi
    fi
    # static: qemu-user needs no aarch64 libraries then. The arm level's file sets its own target
    # (armv8.2-a+dotprod+i8mm, kernels_arm.cpp); the rest is built for plain armv8-a, so the
    # binary runs on a CPU without dotprod and falls back to the portable level.
    nice aarch64-linux-gnu-g++ "${FLAGS[@]}" -static "${SRC[@]}" -o "$BUILD/harness-aarch64"
    echo "== qemu-aarch64-static -cpu max (dotprod, i8mm, SVE)"
    qemu-aarch64-static -cpu max "$BUILD/harness-aarch64" --data "$data" --dump "$data/generic-aarch64.bin"
    echo "== qemu-aarch64-static -cpu neoverse-n1 (dotprod without i8mm: the arm level's dotprod tiles alone)"
    qemu-aarch64-static -cpu neoverse-n1 "$BUILD/harness-aarch64" --data "$data"
    echo "== qemu-aarch64-static -cpu cortex-a53 (armv8.0: no dotprod, the portable level alone)"
    qemu-aarch64-static -cpu cortex-a53 "$BUILD/harness-aarch64" --data "$data"
    # The portable level gives the same bytes on x86-64 as on aarch64 (activations and outputs):
    # GCC would fuse its a*b + c into fmadd on aarch64 without the files' fp-contract pragmas.
    echo "== the portable level's bytes, x86-64 build against aarch64 build"
    nice "${CXX:-g++}" "${FLAGS[@]}" "${SRC[@]}" -o "$BUILD/harness-native"
    "$BUILD/harness-native" --level generic --data "$data" --dump "$data/generic-native.bin" >/dev/null
    cmp "$data/generic-native.bin" "$data/generic-aarch64.bin"
    echo "identical: $(stat -c %s "$data/generic-native.bin") bytes"
    # clang's path through the kernel files (#pragma clang attribute, STDC FP_CONTRACT: what Apple's
    # clang takes on macOS), where a clang is installed; not installed here by default
    clang="$(command -v clang++-19 || command -v clang++ || true)"
    if [ -n "$clang" ]; then
      nice "$clang" --target=aarch64-linux-gnu "${FLAGS[@]}" -static "${SRC[@]}" -o "$BUILD/harness-aarch64-clang"
      echo "== clang build, qemu-aarch64-static -cpu max"
      qemu-aarch64-static -cpu max "$BUILD/harness-aarch64-clang" --data "$data"
    else
      echo "== no clang++: the clang build is skipped (apt-get install clang-19 adds it)"
    fi
    ;;
  *) echo "usage: $0 native|arm" >&2; exit 2 ;;
esac
