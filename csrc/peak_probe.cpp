// Tight loops of one multiply-accumulate instruction each, for the machine's arithmetic peaks that
// the prefill GEMM is judged against (benchmarks/prefill_gemm.py): independent accumulators
// in registers, no loads, so each loop runs at its instruction's throughput on one core.
//
//   vnni512   _mm512_dpbusd_epi32    u8 x s8, 64 products an instruction (AVX-512 VNNI)
//   avx2      maddubs + madd + add   u8 x s8, 32 products in three instructions (the avx2 level's dot)
//   amx_int8  _tile_dpbusd           16 x 16 x 64 products an instruction (AMX-INT8)
//   amx_bf16  _tile_dpbf16ps         16 x 16 x 32 products an instruction (AMX-BF16)
//
// peak_ops runs one loop on `threads` threads at once and returns 2 x products / second (ops/s), the
// best of `trials` runs of about `seconds` each. No torch header (ops.cpp binds it).
#include <stdint.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace wb {
namespace {

// The loops are written in assembly: compiled from intrinsics, GCC keeps an array of accumulators in
// memory, shares a product that does not change between turns, or adds register moves, and the
// loop would time those instead of the instruction.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
int64_t loop_vnni512(int64_t iters) {
  // zmm2..zmm13 += dot(zmm0 as u8, zmm1 as s8): twelve independent chains
  int64_t n = iters;
  __asm__ volatile(
      "vpternlogd $0xff, %%zmm0, %%zmm0, %%zmm0\n\t"
      "vpternlogd $0xff, %%zmm1, %%zmm1, %%zmm1\n\t"
      "1:\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm2\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm3\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm4\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm5\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm6\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm7\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm8\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm9\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm10\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm11\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm12\n\t"
      "vpdpbusd %%zmm1, %%zmm0, %%zmm13\n\t"
      "dec %0\n\t"
      "jnz 1b\n\t"
      "vzeroupper\n\t"
      : "+r"(n)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
  return iters * 12 * 64;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
int64_t loop_avx2(int64_t iters) {
  // six chains of ymm9..ymm14 += madd(maddubs(ymm0 as u8, ymm1 as s8), ymm2 = ones)
  int64_t n = iters;
  __asm__ volatile(
      "vpcmpeqd %%ymm0, %%ymm0, %%ymm0\n\t"
      "vpabsb %%ymm0, %%ymm1\n\t"
      "vpabsw %%ymm0, %%ymm2\n\t"
      "1:\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm3\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm4\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm5\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm6\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm7\n\t"
      "vpmaddubsw %%ymm1, %%ymm0, %%ymm8\n\t"
      "vpmaddwd %%ymm2, %%ymm3, %%ymm3\n\t"
      "vpmaddwd %%ymm2, %%ymm4, %%ymm4\n\t"
      "vpmaddwd %%ymm2, %%ymm5, %%ymm5\n\t"
      "vpmaddwd %%ymm2, %%ymm6, %%ymm6\n\t"
      "vpmaddwd %%ymm2, %%ymm7, %%ymm7\n\t"
      "vpmaddwd %%ymm2, %%ymm8, %%ymm8\n\t"
      "vpaddd %%ymm3, %%ymm9, %%ymm9\n\t"
      "vpaddd %%ymm4, %%ymm10, %%ymm10\n\t"
      "vpaddd %%ymm5, %%ymm11, %%ymm11\n\t"
      "vpaddd %%ymm6, %%ymm12, %%ymm12\n\t"
      "vpaddd %%ymm7, %%ymm13, %%ymm13\n\t"
      "vpaddd %%ymm8, %%ymm14, %%ymm14\n\t"
      "dec %0\n\t"
      "jnz 1b\n\t"
      "vzeroupper\n\t"
      : "+r"(n)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "cc");
  return iters * 6 * 32;
}
#pragma GCC pop_options

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {
#if defined(__linux__)
  // Linux gives a process AMX's tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, 18 = XTILEDATA).
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,amx-bf16")
void load_config() {
  TileConfig c;
  for (int t = 0; t < 8; t++) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// AMX-INT8 (`tdpbusd`, 64 bytes of K a row) or AMX-BF16 (`tdpbf16ps`, 32 values): four independent
// products a turn into tiles 0-3, from tiles 4-7 loaded once (the tile numbers are immediates).
template <bool Int8>
int64_t loop_amx(int64_t iters) {
  alignas(64) static thread_local uint16_t buf[16 * 32];
  alignas(64) static thread_local uint32_t out[16 * 16];
  load_config();
  for (int t = 0; t < 16 * 32; t++) buf[t] = 0x3f80;  // 1.0 in bfloat16; any bytes do for int8
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  for (int64_t it = 0; it < iters; it++) {
    if constexpr (Int8) {
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(2, 5, 6);
      _tile_dpbusd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return iters * 4 * 16 * 16 * (Int8 ? 64 : 32);
}
#pragma GCC pop_options


bool cpuid_bit(int leaf, int sub, int reg, int bit) {
  unsigned r[4];
  __asm__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
  return (r[reg] >> bit) & 1;
}

using Loop = int64_t (*)(int64_t);

// The loop of `kind`, or nullptr where this CPU (or the kernel, for AMX) cannot run it.
Loop loop_of(const std::string& kind) {
  __builtin_cpu_init();
  if (kind == "vnni512")
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") ? loop_vnni512 : nullptr;
  if (kind == "avx2") return __builtin_cpu_supports("avx2") ? loop_avx2 : nullptr;
  const bool amx_tile = cpuid_bit(7, 0, 3, 24);  // EDX bits of leaf 7: AMX-BF16 22, AMX-TILE 24, AMX-INT8 25
  if (kind == "amx_int8") return amx_tile && cpuid_bit(7, 0, 3, 25) && amx_permitted() ? loop_amx<true> : nullptr;
  if (kind == "amx_bf16") return amx_tile && cpuid_bit(7, 0, 3, 22) && amx_permitted() ? loop_amx<false> : nullptr;
  return nullptr;
}

double run_once(Loop loop, int threads, int64_t iters) {
  std::atomic<int64_t> products{0};
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  products += loop(iters);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 2.0 * (double)products.load() / s;
}

}  // namespace

double peak_ops(const std::string& kind, int64_t threads, double seconds, int64_t trials) {
  const Loop loop = loop_of(kind);
  if (loop == nullptr) return 0.0;
  int64_t iters = 1 << 12;  // grow until one run takes a tenth of `seconds`, then scale
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    loop(iters);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > seconds / 10 || iters > (int64_t(1) << 40)) {
      iters = std::max<int64_t>(1, (int64_t)(iters * seconds / s));
      break;
    }
    iters *= 4;
  }
  double best = 0.0;
  for (int64_t t = 0; t < trials; t++) best = std::max(best, run_once(loop, (int)threads, iters));
  return best;
}

}  // namespace wb

#else
namespace wb {
double peak_ops(const std::string&, int64_t, double, int64_t) { return 0.0; }
}  // namespace wb
#endif
