// The avx512 level: AVX-512 F/BW/VL with VNNI (e.g. AMD Zen 4, Intel Ice Lake and later).
// 32-blocks two at a time in a 512-bit register, products by _mm512_dpbusd_epi32 (unsigned codes x
// signed activations straight into int32); 256-blocks 64 values at a time, sub-block scales applied
// by _mm512_dpwssd_epi32. No torch header here, and everything has internal linkage (see qblocks.inc).
#include "qkernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

namespace wb {
namespace {

inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#define WB_HALF(p) half_f16c(p)
#include "qblocks.inc"
#include "kscales_avx2.inc"

inline float hsum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

inline float hsum16(__m512 v) {
  return hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}

inline float dotf(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + i), _mm512_maskz_loadu_ps(k, b + i), acc);
  }
  return hsum16(acc);
}

// ---- activations ------------------------------------------------------------------------------
void quantize_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int bs, int8_t* q, int64_t ldq,
                   float* d, float* s, int16_t* bsums, int64_t ldb) {
  for (int64_t m = m0; m < m1; m++) {
    for (int64_t b = 0; b < K / bs; b++) {
      const float* xb = x + m * ldx + b * bs;
      __m512 mx = _mm512_setzero_ps();
      for (int i = 0; i < bs; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
      const float amax = _mm512_reduce_max_ps(mx);
      const float dd = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
      const __m512 mul = _mm512_set1_ps(id);
      int8_t* qb = q + m * ldq + b * bs;
      int total = 0;
      for (int c = 0; c < bs; c += 16) {
        const __m512 f = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xb + c), mul),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i v = _mm512_cvtps_epi32(f);
        const int t = _mm512_reduce_add_epi32(v);
        if (bsums) bsums[(m * ldb + b) * 16 + c / 16] = (int16_t)t;
        total += t;
        _mm_storeu_si128((__m128i*)(qb + c), _mm512_cvtsepi32_epi8(v));
      }
      d[m * ldb + b] = dd;
      if (s) s[m * ldb + b] = dd * (float)total;
    }
  }
}

void quantize32(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int64_t ldq, float* d,
                float* s, int64_t ldb) {
  quantize_rows(x, ldx, m0, m1, K, 32, q, ldq, d, s, nullptr, ldb);
}

void quantize256(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int64_t ldq, float* d,
                 int16_t* bsums, int64_t ldb) {
  quantize_rows(x, ldx, m0, m1, K, 256, q, ldq, d, nullptr, bsums, ldb);
}

// ---- 32-blocks --------------------------------------------------------------------------------
// Row layout: see qblocks.inc (d of every block, m of every block, then codes block after block).
// All codes unsigned for vpdpbusd: Q8_0's signed codes are shifted by 128 (its offset c = -128 d).
template <int QT> constexpr int kQB = QT == Q8_0 ? 32 : (QT == Q5_0 || QT == Q5_1) ? 20 : 16;
template <int QT> constexpr float kOffset = QT == Q4_0 ? -8.0f : QT == Q5_0 ? -16.0f : QT == Q8_0 ? -128.0f : 0.0f;
template <int QT> constexpr bool kHasMin = QT == Q4_1 || QT == Q5_1;

inline __m256i nib32(const uint8_t* qs) {
  const __m128i t = _mm_loadu_si128((const __m128i*)qs);
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

template <int QT>
inline __m256i codes32(const uint8_t* q) {  // q: the code bytes of one block
  if (QT == Q4_0 || QT == Q4_1) return nib32(q);
  if (QT == Q5_0 || QT == Q5_1) {
    uint32_t qh;
    memcpy(&qh, q, 4);
    return _mm256_or_si256(nib32(q + 4), _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(0x10)));
  }
  return _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)q), _mm256_set1_epi8((char)0x80));
}

template <int QT>
inline __m512i codes64(const uint8_t* q) {  // two consecutive blocks: bytes 0..31 and 32..63
  if (QT == Q8_0) return _mm512_xor_si512(_mm512_loadu_si512((const void*)q), _mm512_set1_epi8((char)0x80));
  __m256i y;
  if (QT == Q4_0 || QT == Q4_1) {
    y = _mm256_loadu_si256((const __m256i*)q);
  } else {
    y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(q + 4))),
                                _mm_loadu_si128((const __m128i*)(q + 24)), 1);
  }
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(y, m4)),
                                       _mm256_and_si256(_mm256_srli_epi16(y, 4), m4), 1);
  __m512i r = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));  // lo0 hi0 lo1 hi1
  if (QT == Q5_0 || QT == Q5_1) {
    uint32_t h0, h1;
    memcpy(&h0, q, 4);
    memcpy(&h1, q + 20, 4);
    const __mmask64 k = (__mmask64)h0 | ((__mmask64)h1 << 32);
    r = _mm512_or_si512(r, _mm512_maskz_mov_epi8(k, _mm512_set1_epi8(0x10)));
  }
  return r;
}

inline __m512 halves16(const uint8_t* p, int64_t cnt) {  // cnt (<= 16) float16 -> float32, zeros after
  const __mmask16 k = (__mmask16)((1u << cnt) - 1);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

// sum_b c_b s_b over the row: the offset (Q4_0, Q5_0, Q8_0: a multiple of d) or min (Q4_1, Q5_1) terms
template <int QT>
inline float offset_dot(const uint8_t* row, int64_t nb, const float* s) {
  const uint8_t* c = row + (kHasMin<QT> ? 2 * nb : 0);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < nb; g += 16) {
    const int64_t cnt = nb - g < 16 ? nb - g : 16;
    acc = _mm512_fmadd_ps(halves16(c + 2 * g, cnt), _mm512_loadu_ps(s + g), acc);  // s is zero-padded
  }
  return hsum16(acc) * (kHasMin<QT> ? 1.0f : kOffset<QT>);
}

template <int QT, int MT, int NT>
void tile_b32(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo,
              float*) {
  constexpr int QB = kQB<QT>;
  const int64_t qoff = (kHasMin<QT> ? 4 : 2) * nb;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < nb; g += 16) {
    const int64_t cnt = nb - g < 16 ? nb - g : 16;
    __m512 dw[NT], dx[MT];
    for (int j = 0; j < NT; j++) dw[j] = halves16(w + j * row_bytes + 2 * g, cnt);
    for (int i = 0; i < MT; i++) dx[i] = _mm512_loadu_ps(a.d + (m + i) * a.ldb + g);  // zero-padded
    int64_t p = 0;
    for (; p + 2 <= cnt; p += 2) {
      const __m512i idx = _mm512_set_epi32(p + 1, p + 1, p + 1, p + 1, p + 1, p + 1, p + 1, p + 1, p, p, p, p, p, p, p, p);
      __m512 dxp[MT];
      for (int i = 0; i < MT; i++) dxp[i] = _mm512_permutexvar_ps(idx, dx[i]);
      for (int j = 0; j < NT; j++) {
        const __m512i q = codes64<QT>(w + j * row_bytes + qoff + (g + p) * QB);
        const __m512 dwp = _mm512_permutexvar_ps(idx, dw[j]);
        for (int i = 0; i < MT; i++) {
          const __m512i x = _mm512_loadu_si512((const void*)(a.q + (m + i) * a.ldq + (g + p) * 32));
          const __m512i p32 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p32), _mm512_mul_ps(dwp, dxp[i]), acc[i][j]);
        }
      }
    }
    if (p < cnt) {  // an odd last block
      const int64_t b = g + p;
      for (int j = 0; j < NT; j++) {
        const uint8_t* row = w + j * row_bytes;
        const __m256i q = codes32<QT>(row + qoff + b * QB);
        const float d = half_f16c(row + 2 * b);
        for (int i = 0; i < MT; i++) {
          const __m256i x = _mm256_loadu_si256((const __m256i*)(a.q + (m + i) * a.ldq + b * 32));
          const __m256i p32 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
          const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(d * a.d[(m + i) * a.ldb + b]));
          acc[i][j] = _mm512_add_ps(acc[i][j], _mm512_zextps256_ps512(f));
        }
      }
    }
  }
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++)
      out[(m + i) * ldo + j] = hsum16(acc[i][j]) + offset_dot<QT>(w + j * row_bytes, nb, a.s + (m + i) * a.ldb);
}

// ---- 256-blocks -------------------------------------------------------------------------------
// Codes of 64-element chunk c (0..3) of a block, unsigned, natural order.
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

template <int QT>
inline __m512i codesk(const uint8_t* p, int c) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), m1 = _mm256_set1_epi8(0x01);
  if (QT == Q4_K || QT == Q5_K) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(p + (QT == Q4_K ? 16 : 48) + 32 * c));
    __m512i q = join(_mm256_and_si256(v, m4), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    if (QT == Q5_K) {
      const __m256i hv = _mm256_loadu_si256((const __m256i*)(p + 16));
      const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(2 * c)), m1);
      const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(2 * c + 1)), m1);
      q = _mm512_or_si512(q, _mm512_slli_epi16(join(h0, h1), 4));
    }
    return q;
  }
  const int h = c / 2, r = c % 2;
  if (QT == Q6_K) {
    const __m512i v = _mm512_loadu_si512((const void*)(p + h * 64));
    const __m512i lo = r ? _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F))
                         : _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
    const __m256i hv = _mm256_loadu_si256((const __m256i*)(p + 128 + h * 32));
    const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(4 * r)), m2);
    const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(4 * r + 2)), m2);
    return _mm512_or_si512(lo, _mm512_slli_epi16(join(h0, h1), 4));
  }
  const __m256i v = _mm256_loadu_si256((const __m256i*)(p + (QT == Q3_K ? 32 : 16) + h * 32));
  const __m256i l0 = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * r)), m2);
  const __m256i l1 = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * r + 2)), m2);
  __m512i q = join(l0, l1);
  if (QT == Q3_K) {
    const __m256i hm = _mm256_loadu_si256((const __m256i*)p);
    const __m256i b0 = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(2 * c)), m1);
    const __m256i b1 = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(2 * c + 1)), m1);
    q = _mm512_or_si512(q, _mm512_slli_epi16(join(b0, b1), 2));
  }
  return q;
}

template <int QT, int MT, int NT>
void tile_k(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  constexpr int BB = QT == Q2_K ? 84 : QT == Q3_K ? 110 : QT == Q4_K ? 144 : QT == Q5_K ? 176 : 210;
  constexpr bool same_d = QT == Q6_K || QT == Q3_K;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    for (int j = 0; j < NT; j++) {
      const uint8_t* p = w + j * row_bytes + b * BB;
      __m256i sc, mn16;
      float D, Dm;
      kscales<QT>(p, sc, mn16, D, Dm);
      const __m512i sc16 = _mm512_castsi256_si512(sc);
      __m512i isum[MT];
      for (int i = 0; i < MT; i++) isum[i] = _mm512_setzero_si512();
      for (int c = 0; c < 4; c++) {
        const __m512i q = codesk<QT>(p, c);
        // int16 lane l = sc[4c + l / 8]
        const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short)(4 * c)),
                                             _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                                                15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
        const __m512i sv = _mm512_permutexvar_epi16(idx, sc16);
        for (int i = 0; i < MT; i++) {
          const __m512i x = _mm512_loadu_si512((const void*)(a.q + (m + i) * a.ldq + b * 256 + 64 * c));
          isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(q, x), sv);
        }
      }
      for (int i = 0; i < MT; i++) {
        const int64_t ab = (m + i) * a.ldb + b;
        const __m256i im = _mm256_madd_epi16(mn16, _mm256_loadu_si256((const __m256i*)(a.bsums + ab * 16)));
        const float dx = a.d[ab];
        if (same_d) {
          const __m512i t = _mm512_sub_epi32(isum[i], _mm512_zextsi256_si512(im));
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(D * dx), acc[i][j]);
        } else {
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_set1_ps(D * dx), acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(im)), _mm512_set1_ps(-Dm * dx), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) out[(m + i) * ldo + j] = hsum16(acc[i][j]);
}

constexpr int MT_MAIN = 4, NT_B32 = 2, NT_K = 2, NT_M1 = 4;
#include "tile_driver.inc"

const Kernels kTable = {quantize32, quantize256, matmul};

}  // namespace
}  // namespace wb

extern "C" const wb::Kernels* wb_kernels_avx512() { return &wb::kTable; }

#pragma GCC pop_options

#else
extern "C" const wb::Kernels* wb_kernels_avx512() { return nullptr; }
#endif
