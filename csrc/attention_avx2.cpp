// Paged attention, the avx2 level (AVX2 + FMA; also used at the avx512 level: decode attention
// reads the cache once and is bound by memory, not by vector width). Needs head_dim % 8 == 0.
// No torch header here, and everything has internal linkage (see qkernels.h).
#include "attention.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include <vector>


#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace wb {
namespace {

template <int KVT>
inline __m256 load8(const void* row, int64_t i) {
  if (KVT == KV_F32) return _mm256_loadu_ps(static_cast<const float*>(row) + i);
  if (KVT == KV_BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  if (KVT == KV_F16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i)));
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(row) + i));
  if (KVT == KV_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  // fp8 e4m3 as float16 bits: exponent and mantissa moved up 7 places read as a float16 are 2^-8
  // times the e4m3 value (its subnormals become float16 subnormals, which F16C widens exactly), so
  // one multiply by 256 restores it. The quantizer never writes NaN (values are clamped to ±448).
  const __m128i w = _mm_cvtepu8_epi16(b);
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

inline float hsum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// [sum(a0), sum(a1), sum(a2), sum(a3)], each as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// sum(v) in hsum4x8's order: a score is the same bits whether its row came alone or in a group of
// four, so a query's scores do not depend on how many other queries share the pass over its rows.
inline float hsum8_pairs(__m256 v) {
  const __m256 t = _mm256_hadd_ps(v, v);
  const __m256 u = _mm256_hadd_ps(t, t);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

// NG query heads against one row: NG accumulators in registers, the row converted once per 8 values.
template <int KVT, int NG>
void dot_block(const float* q, const void* row, int64_t D, float* s, int64_t ld) {
  __m256 acc[NG];
  for (int g = 0; g < NG; g++) acc[g] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 x = load8<KVT>(row, i);
    for (int g = 0; g < NG; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), x, acc[g]);
  }
  for (int g = 0; g < NG; g++) s[g * ld] = hsum8_pairs(acc[g]);
}

// NG query heads against four rows: 4 * NG independent FMA chains (one row's chain alone waits on
// the FMA latency at head_dim 64), and the 4 sums of a head reduced together.
template <int KVT, int NG>
void dot_block4(const float* q, const void* const* rows, int64_t D, float* s, int64_t ld) {
  __m256 acc[NG][4];
  for (int g = 0; g < NG; g++)
    for (int r = 0; r < 4; r++) acc[g][r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    __m256 x[4];
    for (int r = 0; r < 4; r++) x[r] = load8<KVT>(rows[r], i);
    for (int g = 0; g < NG; g++) {
      const __m256 qg = _mm256_loadu_ps(q + g * D + i);
      for (int r = 0; r < 4; r++) acc[g][r] = _mm256_fmadd_ps(qg, x[r], acc[g][r]);
    }
  }
  for (int g = 0; g < NG; g++) _mm_storeu_ps(s + g * ld, hsum4x8(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
}

template <int KVT>
void dot_rows_t(const float* q, int64_t G, const void* row, int64_t D, float* s, int64_t ld) {
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const float* qg = q + g0 * D;
    float* sg = s + g0 * ld;
    switch (G - g0 < 8 ? G - g0 : 8) {
      case 1: dot_block<KVT, 1>(qg, row, D, sg, ld); break;
      case 2: dot_block<KVT, 2>(qg, row, D, sg, ld); break;
      case 3: dot_block<KVT, 3>(qg, row, D, sg, ld); break;
      case 4: dot_block<KVT, 4>(qg, row, D, sg, ld); break;
      case 5: dot_block<KVT, 5>(qg, row, D, sg, ld); break;
      case 6: dot_block<KVT, 6>(qg, row, D, sg, ld); break;
      case 7: dot_block<KVT, 7>(qg, row, D, sg, ld); break;
      default: dot_block<KVT, 8>(qg, row, D, sg, ld); break;
    }
  }
}

template <int KVT>
void dot_rows4_t(const float* q, int64_t G, const void* const* rows, int64_t D, float* s, int64_t ld) {
  for (int64_t g0 = 0; g0 < G; g0 += 3) {  // at most 12 accumulators
    const float* qg = q + g0 * D;
    float* sg = s + g0 * ld;
    switch (G - g0 < 3 ? G - g0 : 3) {
      case 1: dot_block4<KVT, 1>(qg, rows, D, sg, ld); break;
      case 2: dot_block4<KVT, 2>(qg, rows, D, sg, ld); break;
      default: dot_block4<KVT, 3>(qg, rows, D, sg, ld); break;
    }
  }
}

void dot_rows4(const float* q, int64_t G, const void* const* rows, int kv_type, int64_t D, float* s, int64_t ld) {
  switch (kv_type) {
    case KV_F32: return dot_rows4_t<KV_F32>(q, G, rows, D, s, ld);
    case KV_BF16: return dot_rows4_t<KV_BF16>(q, G, rows, D, s, ld);
    case KV_F16: return dot_rows4_t<KV_F16>(q, G, rows, D, s, ld);
    case KV_INT8: return dot_rows4_t<KV_INT8>(q, G, rows, D, s, ld);
    default: return dot_rows4_t<KV_FP8>(q, G, rows, D, s, ld);
  }
}

void dot_rows(const float* q, int64_t G, const void* row, int kv_type, int64_t D, float* s, int64_t ld) {
  switch (kv_type) {
    case KV_F32: return dot_rows_t<KV_F32>(q, G, row, D, s, ld);
    case KV_BF16: return dot_rows_t<KV_BF16>(q, G, row, D, s, ld);
    case KV_F16: return dot_rows_t<KV_F16>(q, G, row, D, s, ld);
    case KV_INT8: return dot_rows_t<KV_INT8>(q, G, row, D, s, ld);
    default: return dot_rows_t<KV_FP8>(q, G, row, D, s, ld);
  }
}

// NG heads, CW vectors of the row at a time: NG * CW accumulators stay in registers over all
// positions, so a row's chunk is converted once and nothing is stored until the end.
template <int KVT, int NG, int CW>
void weighted_block(const float* w, int64_t ldw, int64_t j0, int64_t j1, const char* vbase, const int64_t* slots,
                    int64_t row_bytes, float* out, int64_t D, bool accumulate) {
  for (int64_t i = 0; i < D; i += 8 * CW) {
    __m256 acc[NG][CW];
    for (int g = 0; g < NG; g++)
      for (int c = 0; c < CW; c++)
        acc[g][c] = accumulate ? _mm256_loadu_ps(out + g * D + i + 8 * c) : _mm256_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
      const void* row = vbase + slots[j] * row_bytes;
      __m256 x[CW];
      for (int c = 0; c < CW; c++) x[c] = load8<KVT>(row, i + 8 * c);
      for (int g = 0; g < NG; g++) {
        const __m256 wg = _mm256_broadcast_ss(w + g * ldw + j);
        for (int c = 0; c < CW; c++) acc[g][c] = _mm256_fmadd_ps(wg, x[c], acc[g][c]);
      }
    }
    for (int g = 0; g < NG; g++)
      for (int c = 0; c < CW; c++) _mm256_storeu_ps(out + g * D + i + 8 * c, acc[g][c]);
  }
}

template <int KVT, int NG>
void weighted_ng(const float* w, int64_t ldw, int64_t j0, int64_t j1, const char* vbase, const int64_t* slots,
                 int64_t row_bytes, float* out, int64_t D, bool accumulate) {
  constexpr int CW = NG <= 3 ? 4 : NG <= 7 ? 2 : 1;  // at most 12-14 accumulators
  if (D % (8 * CW) == 0)
    return weighted_block<KVT, NG, CW>(w, ldw, j0, j1, vbase, slots, row_bytes, out, D, accumulate);
  weighted_block<KVT, NG, 1>(w, ldw, j0, j1, vbase, slots, row_bytes, out, D, accumulate);
}

template <int KVT>
void weighted_t(const float* w, int64_t ldw, int64_t G, int64_t j0, int64_t j1, const char* vbase,
                const int64_t* slots, int64_t row_bytes, float* out, int64_t D, bool accumulate) {
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const float* wg = w + g0 * ldw;
    float* og = out + g0 * D;
    switch (G - g0 < 8 ? G - g0 : 8) {
#define WB_NG(ng) \
      case ng: weighted_ng<KVT, ng>(wg, ldw, j0, j1, vbase, slots, row_bytes, og, D, accumulate); break;
      WB_NG(1) WB_NG(2) WB_NG(3) WB_NG(4) WB_NG(5) WB_NG(6) WB_NG(7)
#undef WB_NG
      default: weighted_ng<KVT, 8>(wg, ldw, j0, j1, vbase, slots, row_bytes, og, D, accumulate); break;
    }
  }
}

void weighted_sum(const float* w, int64_t ldw, int64_t G, int64_t j0, int64_t j1, const char* vbase,
                  const int64_t* slots, int64_t row_bytes, int kv_type, float* out, int64_t D, bool accumulate) {
  switch (kv_type) {
    case KV_F32: return weighted_t<KV_F32>(w, ldw, G, j0, j1, vbase, slots, row_bytes, out, D, accumulate);
    case KV_BF16: return weighted_t<KV_BF16>(w, ldw, G, j0, j1, vbase, slots, row_bytes, out, D, accumulate);
    case KV_F16: return weighted_t<KV_F16>(w, ldw, G, j0, j1, vbase, slots, row_bytes, out, D, accumulate);
    case KV_INT8: return weighted_t<KV_INT8>(w, ldw, G, j0, j1, vbase, slots, row_bytes, out, D, accumulate);
    default: return weighted_t<KV_FP8>(w, ldw, G, j0, j1, vbase, slots, row_bytes, out, D, accumulate);
  }
}

// exp(x) for x <= 0, as Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-5 polynomial for
// e^r, then 2^n by exponent bits. Relative error about 2e-7; exp(-inf) and far below underflow give 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2)));
}

float exp_shifted(float* x, int64_t n, float max) {
  const __m256 vm = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum8(acc);
  for (; i < n; i++) sum += (x[i] = expf(x[i] - max));
  return sum;
}

#include "attention_impl.inc"

}  // namespace
}  // namespace wb

#pragma GCC pop_options

extern "C" wb::AttnFn wb_attention_avx2() { return wb::attention_items; }

#else
extern "C" wb::AttnFn wb_attention_avx2() { return nullptr; }
#endif
