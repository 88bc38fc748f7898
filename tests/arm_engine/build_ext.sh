#!/usr/bin/env bash
# Cross-compiles wallbreaker._C for aarch64 with g++-aarch64-linux-gnu: setup.py's sources and flags
# (its non-x86 branch: -ffp-contract=off; -fopenmp as on Linux) plus what torch.utils.cpp_extension
# adds (c++20, -fPIC, TORCH_API_INCLUDE_EXTENSION_H, the extension's name, -DNDEBUG as distutils),
# against the aarch64 torch wheel's headers and libraries and Debian's arm64 Python 3.11 headers.
#
#   tests/arm_engine/build_ext.sh SYSROOT SITE OUT
# SYSROOT: Debian's arm64 packages unpacked (usr/include/python3.11); SITE: the site-packages holding
# the aarch64 torch; OUT: the .so to write (its objects beside it).
set -euo pipefail
script="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$script")/../.."
sysroot="$1" site="$2" out="$3"
objs="$(dirname "$out")/obj"
mkdir -p "$objs"
CXX="${CXX:-aarch64-linux-gnu-g++}"
SRC=$(grep -o '"csrc/[a-z0-9_]*\.cpp"' setup.py | tr -d '"')
FLAGS=(-std=c++20 -fPIC -O3 -fopenmp -fno-math-errno -Wno-uninitialized -Wno-maybe-uninitialized -ffp-contract=off
       -DNDEBUG -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C
       -isystem "$site/torch/include" -isystem "$site/torch/include/torch/csrc/api/include"
       -isystem "$sysroot/usr/include/python3.11" -isystem "$sysroot/usr/include")
# rebuilt when a source, a header, setup.py, this script or the torch headers change (contents,
# not times: a fresh clone reuses the cache)
key=$(cat csrc/* setup.py "$script" "$site/torch/version.py" | sha256sum | cut -c1-16)
if [ -f "$out" ] && [ "$(cat "$objs/key" 2>/dev/null)" = "$key" ]; then echo "cached $out"; exit 0; fi
pids=() built=()
for src in $SRC; do
  obj="$objs/$(basename "${src%.cpp}").o"
  built+=("$obj")
  echo "compile $src"
  (nice "$CXX" "${FLAGS[@]}" -c "$src" -o "$obj.tmp" && mv "$obj.tmp" "$obj") &
  pids+=($!)
  if [ "${#pids[@]}" -ge "${JOBS:-2}" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p"; done
"$CXX" -shared -fopenmp "${built[@]}" -L"$site/torch/lib" -lc10 -ltorch -ltorch_cpu -ltorch_python \
  -Wl,-rpath-link,"$site/torch/lib" -o "$out.tmp"
mv "$out.tmp" "$out"
echo "$key" > "$objs/key"
echo "built $out"
