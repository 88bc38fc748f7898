// Tight loops of one multiply-accumulate instruction each, for the machine's arithmetic peaks that
// the prefill GEMM is judged against (benchmarks/kernels.py --prefill): independent accumulators
// in registers, no loads, so each loop runs at its instruction's throughput on one core.
//
//   vnni512   _mm512_dpbusd_epi32    u8 x s8, 64 products an instruction (AVX-512 VNNI)
//   avx2      maddubs + madd + add   u8 x s8, 32 products in three instructions (the avx2 level's dot)
//   amx_int8  _tile_dpbusd           16 x 16 x 64 products an instruction (AMX-INT8)
//   amx_bf16  _tile_dpbf16ps         16 x 16 x 32 products an instruction (AMX-BF16)
//
// peak_ops runs one loop on `threads` threads at once and returns 2 x products / second (ops/s), the
// best of `trials` runs of about `seconds` each. No torch header (ops.cpp binds it).
#include <omp.h>
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

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
int64_t loop_vnni512(int64_t iters) {
  __m512i acc[16];
  for (int i = 0; i < 16; i++) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  for (int64_t it = 0; it < iters; it++) {
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    __asm__ volatile("" : "+v"(acc[0]), "+v"(acc[5]), "+v"(acc[10]), "+v"(acc[15]));
  }
  __m512i s = acc[0];
  for (int i = 1; i < 16; i++) s = _mm512_add_epi32(s, acc[i]);
  volatile int sink = _mm512_reduce_add_epi32(s);
  (void)sink;
  return iters * 16 * 64;
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
int64_t loop_avx2(int64_t iters) {
  __m256i acc[8];
  for (int i = 0; i < 8; i++) acc[i] = _mm256_set1_epi32(i);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-5), ones = _mm256_set1_epi16(1);
  for (int64_t it = 0; it < iters; it++) {
    #pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
      acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
    __asm__ volatile("" : "+x"(acc[0]), "+x"(acc[3]), "+x"(acc[7]));
  }
  __m256i s = acc[0];
  for (int i = 1; i < 8; i++) s = _mm256_add_epi32(s, acc[i]);
  volatile int sink = _mm256_extract_epi32(s, 0);
  (void)sink;
  return iters * 8 * 32;
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

int64_t loop_amx_int8(int64_t iters) {
  alignas(64) static thread_local int8_t buf[16 * 64];
  load_config();
  for (int t = 0; t < 8; t++) buf[t] = (int8_t)t;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  for (int64_t it = 0; it < iters; it++) {
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  alignas(64) static thread_local int32_t out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return iters * 4 * 16 * 16 * 64;
}

int64_t loop_amx_bf16(int64_t iters) {
  alignas(64) static thread_local uint16_t buf[16 * 32];
  load_config();
  for (int t = 0; t < 16 * 32; t++) buf[t] = 0x3f80;  // 1.0
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  for (int64_t it = 0; it < iters; it++) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) static thread_local float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return iters * 4 * 16 * 16 * 32;
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
  if (kind == "amx_int8") return amx_tile && cpuid_bit(7, 0, 3, 25) && amx_permitted() ? loop_amx_int8 : nullptr;
  if (kind == "amx_bf16") return amx_tile && cpuid_bit(7, 0, 3, 22) && amx_permitted() ? loop_amx_bf16 : nullptr;
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
#include <string>
namespace wb {
double peak_ops(const std::string&, int64_t, double, int64_t) { return 0.0; }
}  // namespace wb
#endif
