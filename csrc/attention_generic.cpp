// Paged attention, the portable level: plain C++ (and the reference the SIMD level is tested against).
#include <math.h>
#include <string.h>

#include <vector>

#include "attention.h"
#include "fp8.h"

// No fused multiply-adds, as in kernels_generic.cpp: the same arithmetic on x86-64 and aarch64.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__) && !defined(__x86_64__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace wb {
namespace {

inline float half_to_float(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  float v;
  if (exp == 0) v = ldexpf((float)man, -24);
  else if (exp == 31) v = man ? NAN : INFINITY;
  else v = ldexpf((float)(man | 0x400), exp - 25);
  return sign ? -v : v;
}

inline float elem(const void* row, int kv_type, int64_t i) {
  switch (kv_type) {
    case KV_F32: return static_cast<const float*>(row)[i];
    case KV_BF16: {
      const uint32_t bits = (uint32_t) static_cast<const uint16_t*>(row)[i] << 16;
      float f;
      memcpy(&f, &bits, 4);
      return f;
    }
    case KV_F16: return half_to_float(static_cast<const uint16_t*>(row)[i]);
    case KV_INT8: return (float)static_cast<const int8_t*>(row)[i];
    default: return fp8_e4m3_to_float(static_cast<const uint8_t*>(row)[i]);
  }
}

void dot_rows(const float* q, int64_t G, const void* row, int kv_type, int64_t D, float* s, int64_t ld) {
  for (int64_t g = 0; g < G; g++) {
    float acc = 0.0f;
    for (int64_t i = 0; i < D; i++) acc += q[g * D + i] * elem(row, kv_type, i);
    s[g * ld] = acc;
  }
}

void dot_rows4(const float* q, int64_t G, const void* const* rows, int kv_type, int64_t D, float* s, int64_t ld) {
  for (int r = 0; r < 4; r++) dot_rows(q, G, rows[r], kv_type, D, s + r, ld);
}

void weighted_sum(const float* w, int64_t ldw, int64_t G, int64_t j0, int64_t j1, const char* vbase,
                  const int64_t* slots, int64_t row_bytes, int kv_type, float* out, int64_t D, bool accumulate) {
  if (!accumulate) memset(out, 0, sizeof(float) * G * D);
  for (int64_t j = j0; j < j1; j++) {
    const void* row = vbase + slots[j] * row_bytes;
    for (int64_t i = 0; i < D; i++) {
      const float x = elem(row, kv_type, i);
      for (int64_t g = 0; g < G; g++) out[g * D + i] += w[g * ldw + j] * x;
    }
  }
}

float exp_shifted(float* x, int64_t n, float max) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; i++) sum += (x[i] = expf(x[i] - max));
  return sum;
}

#include "attention_impl.inc"

}  // namespace
}  // namespace wb

extern "C" wb::AttnFn wb_attention_generic() { return wb::attention_items; }
