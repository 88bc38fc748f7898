// Quantized matmul kernels over GGUF blocks as stored: the interface between the torch-facing
// ops.cpp and the per-ISA kernel files. Plain C++ types only: no torch header, and no inline
// function, may be shared with the ISA translation units (they are compiled for other CPUs).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "qformats.h"

namespace wb {

// GGML type numbers (gguf.GGMLQuantizationType), from the format table.
enum QType : int {
#define WB_QTYPE(name, qt, ...) name = qt,
  WB_FORMATS(WB_QTYPE)
#undef WB_QTYPE
};

// Activations quantized once per matmul to 8 bits, row after row.
//  32-blocks (for Q4_0..Q8_0): d[b] = amax/127, q = round(x/d); s[b] = d * sum(q) (for the min/offset terms).
//    The SIMD levels store q in *group order* (kernels.md): the blocks of a row in groups of 4 (the
//    last group: the rest), a group's first 16 values of each block, then its last 16 of each block,
//    so that the low and the high nibbles of 4 blocks' codes (one 64-byte load) meet their
//    activations in two loads. The generic level keeps the natural order.
//  256-blocks (for K-quants): natural order; d[b] likewise; bsums[16 b + j] = sum of q over its j-th
//    16 values, bsums32[8 b + j] over its j-th 32.
struct ActQ8 {
  const int8_t* q;         // [M, ldq]
  const int8_t* qk;        // [M, ldq] 256-blocks, SIMD levels: q with the 2nd and 3rd 32 values of every 128
                           // swapped (the order of Q4_K/Q5_K's nibbles in a 64-byte load); else nullptr
  const float* d;          // [M, ldb]
  const float* s;          // [M, ldb] (32-blocks) or nullptr
  const int16_t* bsums;    // [M, 16 ldb] (256-blocks) or nullptr
  const int16_t* bsums32;  // [M, 8 ldb] (256-blocks) or nullptr
  int64_t ldq;             // bytes between rows of q
  int64_t ldb;             // blocks between rows of d / s (bsums: 16 ldb, bsums32: 8 ldb)
};

// What kernels/tuning.py may choose per format on the host (csrc/tuning.inc, tile_driver.inc).
// None moves a bit of a result: every choice reduces a row alike (tests/test_kernels.py).
enum Knob : int {
  kRows = 0,        // weight rows a tile, in calls of several activation rows
  kRowsM1 = 1,      // weight rows a tile, batch 1, rows of at most kLongRowK values
  kRowsM1Long = 2,  // weight rows a tile, batch 1, longer rows
  kPrefetch = 3,    // bytes the software prefetch runs ahead of a tile
};
constexpr int kKnobs = 4;
constexpr int64_t kLongRowK = 4096;
constexpr int kWeightRowChoices[] = {1, 2, 4};
constexpr int kPrefetchChoices[] = {2048, 4096, 8192, 16384};

struct Kernels {
  // x: [M, K] float32 with row stride ldx. K % 32 == 0 (32-blocks) or K % 256 == 0 (256-blocks).
  void (*quantize32)(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int64_t ldq,
                     float* d, float* s, int64_t ldb);
  void (*quantize256)(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int8_t* qk,
                      int64_t ldq, float* d, int16_t* bsums, int16_t* bsums32, int64_t ldb);
  // out[m * ldo + (n - n0)] = sum_k W[n, k] x[m, k] for n in [n0, n1), m in [0, M).
  // w: the weight rows, each row_bytes: 32-block formats in the kernels' row layout (qblocks.inc,
  // kernels.pack_rows), K-quants in file order. Returns false for a qtype this level has no kernel
  // for (ops.cpp then runs the generic level's, which has every format of the table).
  bool (*matmul)(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K,
                 const ActQ8* act, int64_t M, float* out, int64_t ldo);
  // Whether `matmul` has a kernel for qtype (the generic level: every format of the table).
  bool (*has)(int qtype);
  // A knob's value for qtype (0: the level's default). False where the level has no tiles for
  // qtype (the generic level has none) or the value is not among the knob's choices.
  bool (*set_knob)(int qtype, int knob, int value);
  int (*knob)(int qtype, int knob);  // the value in use; 0 where the level has no tiles for qtype
  // `matmul` for prompt rows (calls of many rows), through tiles that decode the weights once per
  // call: every row reduced alike whatever the call holds, but not with `matmul`'s bits. nullptr
  // where the level has none; false for a qtype it has none for (ops.cpp then runs `matmul`).
  bool (*prefill)(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K,
                  const ActQ8* act, int64_t M, float* out, int64_t ldo);
};

}  // namespace wb

extern "C" const wb::Kernels* wb_kernels_generic();
extern "C" const wb::Kernels* wb_kernels_avx2();    // nullptr where not built (non-x86)
extern "C" const wb::Kernels* wb_kernels_avx512();  // likewise
extern "C" const wb::Kernels* wb_kernels_arm();     // nullptr where not built (non-aarch64)
// The aarch64 features the arm level uses, as this CPU reports them (0 off aarch64): the level
// needs WB_ARM_DOTPROD (vdotq_s32).
enum { WB_ARM_DOTPROD = 1, WB_ARM_I8MM = 2 };
extern "C" int wb_arm_features();
