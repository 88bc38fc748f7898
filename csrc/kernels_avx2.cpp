// The avx2 level: AVX2 + FMA + F16C (e.g. AMD Zen 1/2/3, Intel Haswell..). 8-bit products by
// _mm256_maddubs_epi16 (unsigned codes x signed activations) and _mm256_madd_epi16.
// No torch header here, and everything has internal linkage (see qblocks.inc).
#include "qkernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

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

inline int hsum8i(__m256i v) {
  __m128i r = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  r = _mm_add_epi32(r, _mm_unpackhi_epi64(r, r));
  r = _mm_add_epi32(r, _mm_shuffle_epi32(r, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(r);
}

inline float dotf(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float r = hsum8(acc);
  for (; i < n; i++) r += a[i] * b[i];
  return r;
}

// ---- activations ------------------------------------------------------------------------------
void quantize_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int bs, int8_t* q, int64_t ldq,
                   float* d, float* s, int16_t* bsums, int64_t ldb) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t m = m0; m < m1; m++) {
    for (int64_t b = 0; b < K / bs; b++) {
      const float* xb = x + m * ldx + b * bs;
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < bs; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      const float dd = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
      const __m256 mul = _mm256_set1_ps(id);
      int8_t* qb = q + m * ldq + b * bs;
      __m256i total = _mm256_setzero_si256();
      for (int c = 0; c < bs; c += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
          const __m256 f = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + c + 8 * k), mul),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          v[k] = _mm256_cvtps_epi32(f);
        }
        if (bsums) {
          bsums[(m * ldb + b) * 16 + c / 16] = (int16_t)hsum8i(_mm256_add_epi32(v[0], v[1]));
          bsums[(m * ldb + b) * 16 + c / 16 + 1] = (int16_t)hsum8i(_mm256_add_epi32(v[2], v[3]));
        }
        total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i*)(qb + c), _mm256_permutevar8x32_epi32(p, perm));
      }
      d[m * ldb + b] = dd;
      if (s) s[m * ldb + b] = dd * (float)hsum8i(total);
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
template <int QT> constexpr int kQB = QT == Q8_0 ? 32 : (QT == Q5_0 || QT == Q5_1) ? 20 : 16;
template <int QT> constexpr float kOffset = QT == Q4_0 ? -8.0f : QT == Q5_0 ? -16.0f : 0.0f;
template <int QT> constexpr bool kHasMin = QT == Q4_1 || QT == Q5_1;

inline __m256i nib32(const uint8_t* qs) {  // 16 bytes -> 32 codes: low nibbles, then high nibbles
  const __m128i t = _mm_loadu_si128((const __m128i*)qs);
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

inline __m256i bits32_x10(const uint8_t* p) {  // bit i of a little-endian uint32 -> byte i = 0x10 or 0
  uint32_t v;
  memcpy(&v, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  b = _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
  return _mm256_and_si256(b, _mm256_set1_epi8(0x10));
}

template <int QT>
inline __m256i codes32(const uint8_t* q) {  // q: the code bytes of one block
  if (QT == Q4_0 || QT == Q4_1) return nib32(q);
  if (QT == Q5_0 || QT == Q5_1) return _mm256_or_si256(nib32(q + 4), bits32_x10(q));
  return _mm256_loadu_si256((const __m256i*)q);  // Q8_0, signed
}

inline __m256 halves8(const uint8_t* p, int64_t cnt) {  // cnt (<= 8) float16 -> float32, zeros after
  if (cnt >= 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  uint16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  memcpy(tmp, p, 2 * cnt);
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)tmp));
}

template <int QT>
inline float offset_dot(const uint8_t* row, int64_t nb, const float* s) {
  if (QT == Q8_0) return 0.0f;
  const uint8_t* c = row + (kHasMin<QT> ? 2 * nb : 0);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < nb; g += 8) {
    const int64_t cnt = nb - g < 8 ? nb - g : 8;
    acc = _mm256_fmadd_ps(halves8(c + 2 * g, cnt), _mm256_loadu_ps(s + g), acc);  // s is zero-padded
  }
  return hsum8(acc) * (kHasMin<QT> ? 1.0f : kOffset<QT>);
}

template <int QT, int MT, int NT>
void tile_b32(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo,
              float*) {
  constexpr int QB = kQB<QT>;
  const int64_t qoff = (kHasMin<QT> ? 4 : 2) * nb;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g = 0; g < nb; g += 8) {
    const int64_t cnt = nb - g < 8 ? nb - g : 8;
    __m256 dw[NT];
    for (int j = 0; j < NT; j++) dw[j] = halves8(w + j * row_bytes + 2 * g, cnt);
    if (MT == 1) {
      for (int j = 0; j < NT; j++) dw[j] = _mm256_mul_ps(dw[j], _mm256_loadu_ps(a.d + m * a.ldb + g));
    }
    for (int64_t k = 0; k < cnt; k++) {
      const int64_t b = g + k;
      const __m256i kk = _mm256_set1_epi32((int)k);
      for (int j = 0; j < NT; j++) {
        const __m256i q = codes32<QT>(w + j * row_bytes + qoff + b * QB);
        const __m256 dk = _mm256_permutevar8x32_ps(dw[j], kk);
        const __m256i qa = QT == Q8_0 ? _mm256_sign_epi8(q, q) : q;
        for (int i = 0; i < MT; i++) {
          __m256i x = _mm256_load_si256((const __m256i*)(a.q + (m + i) * a.ldq + b * 32));
          if (QT == Q8_0) x = _mm256_sign_epi8(x, q);
          const __m256i p32 = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, x), ones);
          const __m256 sc = MT == 1 ? dk : _mm256_mul_ps(dk, _mm256_broadcast_ss(a.d + (m + i) * a.ldb + b));
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), sc, acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++)
      out[(m + i) * ldo + j] = hsum8(acc[i][j]) + offset_dot<QT>(w + j * row_bytes, nb, a.s + (m + i) * a.ldb);
}

// ---- 256-blocks -------------------------------------------------------------------------------
// Codes of 32-element chunk c (0..7) of a block, unsigned, natural order.
template <int QT>
inline __m256i codesk(const uint8_t* p, int c) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), m1 = _mm256_set1_epi8(0x01);
  if (QT == Q4_K || QT == Q5_K) {
    const uint8_t* qs = p + (QT == Q4_K ? 16 : 48);
    const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * (c / 2)));
    __m256i q = (c & 1) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
    if (QT == Q5_K) {
      const __m256i h = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)(p + 16)), _mm_cvtsi32_si128(c)), m1);
      q = _mm256_or_si256(q, _mm256_slli_epi16(h, 4));
    }
    return q;
  }
  const int h = c / 4, rc = c % 4;
  if (QT == Q6_K) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(p + h * 64 + 32 * (rc % 2)));
    const __m256i lo = (rc / 2) ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
    const __m256i hv = _mm256_loadu_si256((const __m256i*)(p + 128 + h * 32));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(2 * rc)), m2);
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
  const uint8_t* qs = p + (QT == Q3_K ? 32 : 16);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + h * 32));
  __m256i q = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * rc)), m2);
  if (QT == Q3_K) {
    const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i*)p), _mm_cvtsi32_si128(c)), m1);
    q = _mm256_or_si256(q, _mm256_slli_epi16(hb, 2));
  }
  return q;
}

template <int QT, int MT, int NT>
void tile_k(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  constexpr int BB = QT == Q2_K ? 84 : QT == Q3_K ? 110 : QT == Q4_K ? 144 : QT == Q5_K ? 176 : 210;
  constexpr bool same_d = QT == Q6_K || QT == Q3_K;
  // byte shuffles picking int16 lane 2c%8 (low 128 bits) and (2c+1)%8 (high 128 bits)
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    for (int j = 0; j < NT; j++) {
      const uint8_t* p = w + j * row_bytes + b * BB;
      __m256i sc16, mn16;
      float D, Dm;
      kscales<QT>(p, sc16, mn16, D, Dm);
      __m256i isum[MT];
      for (int i = 0; i < MT; i++) isum[i] = _mm256_setzero_si256();
      for (int c = 0; c < 8; c++) {
        const __m256i q = codesk<QT>(p, c);
        // int16 lanes 0..7 = sc[2c], 8..15 = sc[2c+1]
        const __m256i pair = _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(c));
        const __m256i sv = _mm256_shuffle_epi8(pair, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                                       2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
        for (int i = 0; i < MT; i++) {
          const __m256i x = _mm256_load_si256((const __m256i*)(a.q + (m + i) * a.ldq + b * 256 + 32 * c));
          isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), sv));
        }
      }
      for (int i = 0; i < MT; i++) {
        const int64_t ab = (m + i) * a.ldb + b;
        const __m256i im = _mm256_madd_epi16(mn16, _mm256_loadu_si256((const __m256i*)(a.bsums + ab * 16)));
        const float dx = a.d[ab];
        if (same_d) {
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[i], im)), _mm256_set1_ps(D * dx), acc[i][j]);
        } else {
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(D * dx), acc[i][j]);
          acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_set1_ps(-Dm * dx), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MT; i++)
    for (int j = 0; j < NT; j++) out[(m + i) * ldo + j] = hsum8(acc[i][j]);
}

constexpr int MT_MAIN = 4, NT_B32 = 2, NT_K = 1, NT_M1 = 4;
#include "tile_driver.inc"

const Kernels kTable = {quantize32, quantize256, matmul};

}  // namespace
}  // namespace wb

extern "C" const wb::Kernels* wb_kernels_avx2() { return &wb::kTable; }

#pragma GCC pop_options

#else
extern "C" const wb::Kernels* wb_kernels_avx2() { return nullptr; }
#endif
