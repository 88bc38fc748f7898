"""Builds wallbreaker's C++ extension, `wallbreaker._C`: quantized matmul kernels over GGUF blocks,
and paged attention.

Six torch-facing files (ops.cpp, attention_ops.cpp, fused_ops.cpp, recurrent_ops.cpp, rwkv7_ops.cpp,
decoder_plan.cpp; default flags), one file per kernel level and the dense path's decoding
(dequant_avx512.cpp); the SIMD files set their instruction set with `#pragma GCC target` and include no torch header, so one build serves
every x86-64 CPU and the level is chosen at run time (csrc/ops.cpp, docs/kernels.md). On aarch64,
kernels_arm.cpp sets armv8.2-a+dotprod itself likewise (the rest stays plain armv8-a), and the
off-x86 builds turn off floating-point contraction (the compilers fuse a*b + c there by default,
which would round differently from the x86 build; the kernel files also say so themselves).
macOS (Apple's clang) has no OpenMP: the build leaves it out there (at::parallel_for then runs
serially); not built here, see README.
"""
import os
import platform
import sys

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))

x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
# -fopenmp: at::parallel_for is a header template over OpenMP pragmas, serial without it
# (the process's one libgomp is torch's own, found by its soname)
openmp = [] if sys.platform == "darwin" else ["-fopenmp"]

setup(
    ext_modules=[
        CppExtension(
            "wallbreaker._C",
            ["csrc/ops.cpp", "csrc/kernels_generic.cpp", "csrc/kernels_avx2.cpp", "csrc/kernels_avx512.cpp",
             "csrc/kernels_arm.cpp", "csrc/dequant_avx512.cpp",
             "csrc/attention_ops.cpp", "csrc/attention_generic.cpp", "csrc/attention_avx2.cpp",
             "csrc/fused_ops.cpp", "csrc/recurrent_ops.cpp", "csrc/rwkv7_ops.cpp", "csrc/lora_ops.cpp",
             "csrc/decoder_plan.cpp", "csrc/peak_probe.cpp", "csrc/flash_prefill.cpp"],
            extra_compile_args=["-O3", *openmp, "-fno-math-errno", "-Wno-uninitialized", "-Wno-maybe-uninitialized",
                                *([] if x86 else ["-ffp-contract=off"])],
            extra_link_args=openmp,
            depends=["csrc/qkernels.h", "csrc/qformats.h", "csrc/qblocks.inc", "csrc/tile_driver.inc", "csrc/prefill_avx512.inc", "csrc/transpose16.inc", "csrc/prompt_driver.inc",
                     "csrc/prefill_avx2.inc",
                     "csrc/kscales_avx2.inc", "csrc/tuning.inc", "csrc/torch_ops.h", "csrc/attention.h", "csrc/attention_impl.inc",
                     "csrc/fp8.h", "csrc/vec_math.h"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
