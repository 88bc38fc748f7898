// Float math on whole vectors for the small per-token steps (fused_ops.cpp, recurrent_ops.cpp):
// GCC's vector extension, which each kernel level's variant of a loop lowers to what it targets
// (one AVX-512 register for 16 lanes, two AVX2, four SSE2). Everything here is in an anonymous
// namespace, so each file that includes it has its own copies: none is shared between code built
// for different instruction sets.
#pragma once
#include <stdint.h>
#include <string.h>

int wb_kernel_level();  // ops.cpp: 0 generic, 1 avx2, 2 avx512 (WALLBREAKER_CPU_ISA moves it)

// DEFINE(name, target) writes one variant of a loop; WB_VARIANTS makes the plain, AVX2 and AVX-512
// ones and `name_for_level()`, which picks the one of the kernel level, as the matmuls are picked.
#if defined(__x86_64__)
#define WB_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define WB_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx2,fma")))
#else
#define WB_TARGET_AVX2
#define WB_TARGET_AVX512
#endif
#define WB_VARIANTS(DEFINE, name)                                                           \
  DEFINE(name##_generic, )                                                                  \
  DEFINE(name##_avx2, WB_TARGET_AVX2)                                                       \
  DEFINE(name##_avx512, WB_TARGET_AVX512)                                                   \
  inline decltype(&name##_generic) name##_for_level() {                                     \
    const int level = wb_kernel_level();                                                    \
    return level >= 2 ? name##_avx512 : level >= 1 ? name##_avx2 : name##_generic;          \
  }

namespace {

// The vector helpers are always inlined: no vector crosses a call, whatever the level (GCC warns,
// at the end of the file, of the ABI of a 64-byte vector return in a function built without AVX-512).
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float Lanes16 __attribute__((vector_size(64)));
typedef int32_t Ints16 __attribute__((vector_size(64)));

template <typename F, typename I>
inline __attribute__((always_inline)) F exp_poly(F x) {
  x = x < -87.3f ? F{} - 87.3f : x;
  x = x > 88.3f ? F{} + 88.3f : x;
  const F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2): 1.5 * 2^23 trick
  const F r = x - n * 0.693359375f + n * 2.12194440e-4f;                 // x - n ln 2, in two parts
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I bits;
  if constexpr (sizeof(F) == sizeof(float)) {
    bits = (I)((int32_t)n + 127) << 23;
  } else {
    bits = (__builtin_convertvector(n, I) + 127) << 23;
  }
  F scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename F, typename I>
inline __attribute__((always_inline)) F act_of(F g, bool silu) {
  if (silu) return g / (exp_poly<F, I>(F{} - g) + 1.0f);
  const F y = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // torch's gelu(approximate="tanh")
  return 0.5f * g * (2.0f - 2.0f / (exp_poly<F, I>(y + y) + 1.0f));   // 1 + tanh(y)
}

}  // namespace
