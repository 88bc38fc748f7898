// The avx2 level: AVX2 + FMA + F16C (e.g. AMD Zen 1/2/3, Intel Haswell..). 8-bit products by
// _mm256_maddubs_epi16 (unsigned codes x signed activations) and _mm256_madd_epi16. 32-blocks two
// at a time: one 32-byte load holds 2 blocks' codes, both nibbles meet the activations in group
// order (qkernels.h), each 128-bit lane is one block. 256-blocks 64 values (one 32-byte load of
// codes) at a time, the scales and mins of up to 2 weight rows decoded together in the lanes of
// one register, the scale of each 32 (16 for Q6_K) values applied by the madd. No torch header
// here, and everything has internal linkage (see qblocks.inc).
#include "qkernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
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
#include "tuning.inc"
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

// [hsum a, hsum b, hsum c, hsum d], each added in hsum8's order, so that a row's sum is the same
// bits whether its tile had 4 weight rows (batch 1) or fewer (batch invariance)
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  auto halves = [](__m256 v) { return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); };
  const __m128 sa = halves(a), sb = halves(b), sc = halves(c), sd = halves(d);
  const __m128 ab = _mm_add_ps(_mm_shuffle_ps(sa, sb, _MM_SHUFFLE(1, 0, 1, 0)), _mm_shuffle_ps(sa, sb, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m128 cd = _mm_add_ps(_mm_shuffle_ps(sc, sd, _MM_SHUFFLE(1, 0, 1, 0)), _mm_shuffle_ps(sc, sd, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm_add_ps(_mm_shuffle_ps(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)), _mm_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}

// ---- activations ------------------------------------------------------------------------------
inline float block_scale(const float* xb, int n, __m256& mul) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  mul = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
  return amax / 127.0f;
}

inline __m256i q8(const float* x, __m256 mul) {
  return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// 16 int32 (two 8-lane vectors, each in [-127, 127]) -> 16 int8 in order
inline __m128i pack16(__m256i a, __m256i b) {
  const __m256i w = _mm256_packs_epi32(a, b);  // a0-3 b0-3 | a4-7 b4-7
  const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
  return _mm_packs_epi16(_mm_unpacklo_epi64(lo, hi), _mm_unpackhi_epi64(lo, hi));
}

void quantize32(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int64_t ldq, float* d,
                float* s, int64_t ldb) {
  const int64_t nb = K / 32;
  for (int64_t m = m0; m < m1; m++) {
    for (int64_t b = 0; b < nb; b++) {
      const float* xb = x + m * ldx + b * 32;
      __m256 mul;
      const float dd = block_scale(xb, 32, mul);
      const __m256i v0 = q8(xb, mul), v1 = q8(xb + 8, mul), v2 = q8(xb + 16, mul), v3 = q8(xb + 24, mul);
      const int64_t g = b / 4, i = b % 4, G = nb - 4 * g < 4 ? nb - 4 * g : 4;
      int8_t* qg = q + m * ldq + 128 * g;
      _mm_storeu_si128((__m128i*)(qg + 16 * i), pack16(v0, v1));
      _mm_storeu_si128((__m128i*)(qg + 16 * G + 16 * i), pack16(v2, v3));
      d[m * ldb + b] = dd;
      s[m * ldb + b] = dd * (float)hsum8i(_mm256_add_epi32(_mm256_add_epi32(v0, v1), _mm256_add_epi32(v2, v3)));
    }
  }
}

void quantize256(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int8_t* qk, int64_t ldq,
                 float* d, int16_t* bsums, int16_t* bsums32, int64_t ldb) {
  for (int64_t m = m0; m < m1; m++) {
    for (int64_t b = 0; b < K / 256; b++) {
      const float* xb = x + m * ldx + b * 256;
      __m256 mul;
      const float dd = block_scale(xb, 256, mul);
      int8_t* qb = q + m * ldq + b * 256;
      int8_t* kb = qk + m * ldq + b * 256;
      int16_t* bs = bsums + (m * ldb + b) * 16;
      int16_t* bs32 = bsums32 + (m * ldb + b) * 8;
      for (int c = 0; c < 256; c += 32) {
        const __m256i v0 = q8(xb + c, mul), v1 = q8(xb + c + 8, mul), v2 = q8(xb + c + 16, mul), v3 = q8(xb + c + 24, mul);
        const int t0 = hsum8i(_mm256_add_epi32(v0, v1)), t1 = hsum8i(_mm256_add_epi32(v2, v3));
        bs[c / 16] = (int16_t)t0;
        bs[c / 16 + 1] = (int16_t)t1;
        bs32[c / 32] = (int16_t)(t0 + t1);
        const __m256i p = _mm256_inserti128_si256(_mm256_castsi128_si256(pack16(v0, v1)), pack16(v2, v3), 1);
        _mm256_storeu_si256((__m256i*)(qb + c), p);
        const int r = c % 128, swapped = r == 32 ? 64 : r == 64 ? 32 : r;
        _mm256_storeu_si256((__m256i*)(kb + c - r + swapped), p);
      }
      d[m * ldb + b] = dd;
    }
  }
}

// ---- 32-blocks --------------------------------------------------------------------------------
// Row layout: see qblocks.inc. Offset and min terms: sum_b c_b s_b, one fmadd per 8 blocks.
template <int QT> constexpr float kOffset = format_facts(QT).halves == 2 ? 1.0f : (float)format_facts(QT).offset;

// The 32 bits in the 4 bytes at p: bit i -> byte i = 0x10 or 0.
inline __m256i bits32_x10(const uint8_t* p) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  const __m256i v = _mm256_castps_si256(_mm256_broadcast_ss((const float*)p));
  const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(v, shuf), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(0x10));
}

inline uint32_t load_u16(const uint8_t* p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

// Codes of blocks i (and i + 1 when PAIR) of a group of G (c: the group's codes): lo = values 0..15
// of each block (128-bit lane per block), hi = values 16..31. Single block: one register, lane 0
// values 0..15, lane 1 values 16..31 (lo only). Q8_0 codes stay signed.
template <int QT, bool PAIR>
inline void pair_codes(const uint8_t* c, int64_t G, int64_t i, __m256i& lo, __m256i& hi) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if (QT == Q8_0) {
    if (PAIR) {
      lo = _mm256_loadu_si256((const __m256i*)(c + 16 * i));
      hi = _mm256_loadu_si256((const __m256i*)(c + 16 * G + 16 * i));
    } else {
      lo = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(c + 16 * i))),
                                   _mm_loadu_si128((const __m128i*)(c + 16 * G + 16 * i)), 1);
    }
    return;
  }
  const uint8_t* qs = (QT == Q5_0 || QT == Q5_1) ? c + 4 * G : c;
  if (PAIR) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 16 * i));
    lo = _mm256_and_si256(v, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (QT == Q5_0 || QT == Q5_1) {
      lo = _mm256_or_si256(lo, bits32_x10(c + 2 * i));
      hi = _mm256_or_si256(hi, bits32_x10(c + 2 * G + 2 * i));
    }
  } else {
    const __m128i t = _mm_loadu_si128((const __m128i*)(qs + 16 * i));
    lo = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1), m4);
    if (QT == Q5_0 || QT == Q5_1) {
      const uint32_t h = load_u16(c + 2 * i) | (load_u16(c + 2 * G + 2 * i) << 16);
      lo = _mm256_or_si256(lo, bits32_x10((const uint8_t*)&h));
    }
  }
}

// int32 dot products of those codes with the activations (8 lanes: 4 per block)
template <int QT, bool PAIR>
inline __m256i pair_dot(__m256i lo, __m256i hi, const int8_t* xg, int64_t G, int64_t i) {
  const __m256i ones = _mm256_set1_epi16(1);
  if (PAIR) {
    const __m256i xl = _mm256_loadu_si256((const __m256i*)(xg + 16 * i));
    const __m256i xh = _mm256_loadu_si256((const __m256i*)(xg + 16 * G + 16 * i));
    if (QT == Q8_0) {
      const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(xl, lo)), ones);
      const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(xh, hi)), ones);
      return _mm256_add_epi32(a, b);
    }
    // 4-bit and 5-bit codes: two pair products of at most 2*31*127 still fit int16
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)), ones);
  }
  const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(xg + 16 * i))),
                                            _mm_loadu_si128((const __m128i*)(xg + 16 * G + 16 * i)), 1);
  if (QT == Q8_0) return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(x, lo)), ones);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x), ones);
}

// cnt (<= 8) float16 at p -> float32, zeros after. Reads 16 bytes: the callers' rows go on past
// their d (and m) fields, so the bytes read past cnt are the row's own (masked off here).
inline __m256 halves8(const uint8_t* p, int64_t cnt) {
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  if (cnt >= 8) return v;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt), lane)));
}

template <int QT, int MT, int NT, bool PAIR>
inline void pair_step(const uint8_t* w, int64_t row_bytes, int64_t qoff, const ActQ8& a, int64_t m, int64_t g,
                      int64_t G, int64_t i, int64_t k, const __m256* dw, const __m256* dx, __m256 (*acc)[NT]) {
  constexpr int QB = kQB<QT>;
  // scale lanes: 0-3 block k of the 8-block window, 4-7 block k + 1 (PAIR) or k
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)k), _mm256_setr_epi32(0, 0, 0, 0, PAIR, PAIR, PAIR, PAIR));
  #pragma GCC unroll 8
  for (int j = 0; j < NT; j++) {
    __m256i lo, hi;
    pair_codes<QT, PAIR>(w + j * row_bytes + qoff + 4 * g * QB, G, i, lo, hi);
    const __m256 sw = _mm256_permutevar8x32_ps(dw[j], idx);
    #pragma GCC unroll 8
    for (int r = 0; r < MT; r++) {
      const __m256i p = pair_dot<QT, PAIR>(lo, hi, a.q + (m + r) * a.ldq + 128 * g, G, i);
      const __m256 sc = MT == 1 ? sw : _mm256_mul_ps(sw, _mm256_permutevar8x32_ps(dx[r], idx));
      acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[r][j]);
    }
  }
}

template <int QT, int MT, int NT>
void tile_b32(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  const int64_t qoff = (kHasMin<QT> ? 4 : 2) * nb, groups = (nb + 3) / 4;
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  __m256 acc[MT][NT];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++)
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g8 = 0; g8 < nb; g8 += 8) {
    const int64_t cnt = nb - g8 < 8 ? nb - g8 : 8;
    __m256 dw[NT], dx[MT];
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++) {
      dx[i] = _mm256_loadu_ps(a.d + (m + i) * a.ldb + g8);  // zero-padded to 16
      if (QT != Q8_0) {
        const __m256 sx = _mm256_mul_ps(_mm256_loadu_ps(a.s + (m + i) * a.ldb + g8), _mm256_set1_ps(kOffset<QT>));
        #pragma GCC unroll 8
        for (int j = 0; j < NT; j++) {
          const uint8_t* c = w + j * row_bytes + (kHasMin<QT> ? 2 * nb : 0) + 2 * g8;
          acc[i][j] = _mm256_fmadd_ps(halves8(c, cnt), sx, acc[i][j]);
        }
      }
    }
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
      dw[j] = halves8(w + j * row_bytes + 2 * g8, cnt);
      if (MT == 1) dw[j] = _mm256_mul_ps(dw[j], dx[0]);
    }
    if (cnt == 8) {  // two full groups
      const int64_t g = g8 / 4;
      prefetch_tile_share(w, NT * row_bytes, groups, g, pf);
      pair_step<QT, MT, NT, true>(w, row_bytes, qoff, a, m, g, 4, 0, 0, dw, dx, acc);
      pair_step<QT, MT, NT, true>(w, row_bytes, qoff, a, m, g, 4, 2, 2, dw, dx, acc);
      prefetch_tile_share(w, NT * row_bytes, groups, g + 1, pf);
      pair_step<QT, MT, NT, true>(w, row_bytes, qoff, a, m, g + 1, 4, 0, 4, dw, dx, acc);
      pair_step<QT, MT, NT, true>(w, row_bytes, qoff, a, m, g + 1, 4, 2, 6, dw, dx, acc);
    } else {
      for (int64_t gi = 0; gi < cnt; gi += 4) {  // the groups of this window
        const int64_t g = (g8 + gi) / 4, G = nb - 4 * g < 4 ? nb - 4 * g : 4;
        prefetch_tile_share(w, NT * row_bytes, groups, g, pf);
        int64_t i = 0;
        for (; i + 2 <= G; i += 2) pair_step<QT, MT, NT, true>(w, row_bytes, qoff, a, m, g, G, i, gi + i, dw, dx, acc);
        if (i < G) pair_step<QT, MT, NT, false>(w, row_bytes, qoff, a, m, g, G, i, gi + i, dw, dx, acc);
      }
    }
  }
  for (int i = 0; i < MT; i++) {
    if (NT == 4) {
      _mm_storeu_ps(out + (m + i) * ldo, hsum4(acc[i][0], acc[i][NT > 1 ? 1 : 0], acc[i][NT > 2 ? 2 : 0], acc[i][NT > 3 ? 3 : 0]));
    } else {
      #pragma GCC unroll 8
      for (int j = 0; j < NT; j++) out[(m + i) * ldo + j] = hsum8(acc[i][j]);
    }
  }
}

// ---- 256-blocks -------------------------------------------------------------------------------

// 16 bytes at `off` of up to 2 rows, row j in 128-bit lane j (lane 1 zero when NT = 1).
template <int NT>
inline __m256i lanes128(const uint8_t* w, int64_t row_bytes, int64_t off) {
  const __m128i r0 = _mm_loadu_si128((const __m128i*)(w + off));
  if (NT == 1) return _mm256_inserti128_si256(_mm256_castsi128_si256(r0), _mm_setzero_si128(), 1);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(r0), _mm_loadu_si128((const __m128i*)(w + row_bytes + off)), 1);
}

// Q4_K/Q5_K header lanes [d dmin s0..s11] -> lanes [8 scales, 8 mins] (bytes, 6 bits each).
inline __m256i k4_scales_mins(__m256i H) {
  const __m256i A = _mm256_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15,
                                     4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i B = _mm256_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11,
                                     -1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11);
  const __m256i mk = _mm256_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15,
                                      63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
  const __m256i t1 = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(H, A), _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)), mk);
  const __m256i t2 = _mm256_and_si256(_mm256_srli_epi16(_mm256_shuffle_epi8(H, B), 2), _mm256_set1_epi8(0x30));
  return _mm256_or_si256(t1, t2);
}

template <int QT, int MT, int NT>
void tile_k45(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  // Q4_K, Q5_K: w = D sc q - Dm mn per 32 values; activations natural.
  static_assert(NT <= 2, "two rows' headers a register");
  __m256 acc[MT][NT], accm[MT];  // accm: the min terms, lanes 0-3 row 0, 4-7 row 1
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++) {
    accm[i] = _mm256_setzero_ps();
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
  }
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  // the header of block b + 1 is decoded during block b: its shuffles are off the critical path
  __m256i Hn = lanes128<NT>(w, row_bytes, 0), Rn = k4_scales_mins(Hn);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* wb = w + b * kBB<QT>;
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    const __m256i H = Hn, R = Rn;
    if (b + 1 < nb) {
      Hn = lanes128<NT>(wb + kBB<QT>, row_bytes, 0);
      Rn = k4_scales_mins(Hn);
    }
    const __m256i MN = _mm256_shuffle_epi8(R, _mm256_setr_epi8(8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1,
                                                               8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1));
    // [D_0, Dm_0, D_1, Dm_1]
    const __m128 DD = _mm_cvtph_ps(_mm_unpacklo_epi32(_mm256_castsi256_si128(H), _mm256_extracti128_si256(H, 1)));
    alignas(16) float ddx[MT][4];
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++) {
      const int64_t ab = (m + i) * a.ldb + b;
      const __m128 dd = _mm_mul_ps(DD, _mm_set1_ps(a.d[ab]));
      _mm_store_ps(ddx[i], dd);
      const __m256i bs = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(a.bsums32 + ab * 8)));
      const __m256 mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(MN, bs));  // lane j: row j
      const __m256 dm = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dd), _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3));
      accm[i] = _mm256_fmadd_ps(mins, dm, accm[i]);
    }
    __m256i Rj[NT];
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) Rj[j] = _mm256_permute4x64_epi64(R, j == 0 ? 0x44 : 0xEE);
    __m256i qh[NT], isum[MT][NT];
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
      if (QT == Q5_K) qh[j] = _mm256_loadu_si256((const __m256i*)(wb + j * row_bytes + 16));
      #pragma GCC unroll 8
      for (int i = 0; i < MT; i++) isum[i][j] = _mm256_setzero_si256();
    }
    #pragma GCC unroll 8
    for (int c = 0; c < 4; c++) {
      __m256i q0[NT], q1[NT];
      #pragma GCC unroll 8
      for (int j = 0; j < NT; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + j * row_bytes + (QT == Q4_K ? 16 : 48) + 32 * c));
        q0[j] = _mm256_and_si256(v, m4);
        q1[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (QT == Q5_K) {  // bit 2c (2c + 1) of each qh byte is bit 4 of the low (high) nibble's code
          const __m256i b4 = _mm256_set1_epi8(0x10);
          const __m256i h0 = 2 * c <= 4 ? _mm256_slli_epi16(qh[j], 4 - 2 * c) : _mm256_srli_epi16(qh[j], 2 * c - 4);
          const __m256i h1 = 2 * c + 1 <= 4 ? _mm256_slli_epi16(qh[j], 3 - 2 * c) : _mm256_srli_epi16(qh[j], 2 * c - 3);
          q0[j] = _mm256_or_si256(q0[j], _mm256_and_si256(h0, b4));
          q1[j] = _mm256_or_si256(q1[j], _mm256_and_si256(h1, b4));
        }
      }
      #pragma GCC unroll 8
      for (int i = 0; i < MT; i++) {
        const int8_t* xq = a.q + (m + i) * a.ldq + b * 256 + 64 * c;
        const __m256i x0 = _mm256_loadu_si256((const __m256i*)xq), x1 = _mm256_loadu_si256((const __m256i*)(xq + 32));
        #pragma GCC unroll 8
        for (int j = 0; j < NT; j++) {
          const __m256i s0 = _mm256_shuffle_epi8(Rj[j], _mm256_set1_epi16((short)(0xFF00 | (2 * c))));
          const __m256i s1 = _mm256_shuffle_epi8(Rj[j], _mm256_set1_epi16((short)(0xFF00 | (2 * c + 1))));
          const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(q0[j], x0), s0);
          const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1[j], x1), s1);
          isum[i][j] = _mm256_add_epi32(isum[i][j], _mm256_add_epi32(p0, p1));
        }
      }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++)
      #pragma GCC unroll 8
      for (int j = 0; j < NT; j++)
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][j]), _mm256_set1_ps(ddx[i][2 * j]), acc[i][j]);
  }
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++) {
    const __m256 t = _mm256_hadd_ps(accm[i], accm[i]);
    const __m256 mins = _mm256_hadd_ps(t, t);  // lane j: row j's min terms
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++)
      out[(m + i) * ldo + j] = hsum8(acc[i][j]) - _mm_cvtss_f32(j == 0 ? _mm256_castps256_ps128(mins) : _mm256_extractf128_ps(mins, 1));
  }
}

template <int QT, int MT, int NT>
void tile_k6(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  // Q6_K: w = D sc (q - 32) per 16 values; activations natural.
  __m256 acc[MT][NT];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++)
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  for (int64_t b = 0; b < nb; b++) {
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
      const uint8_t* p = w + j * row_bytes + b * kBB<QT>;
      const __m128i s8 = _mm_loadu_si128((const __m128i*)(p + 192));
      const __m256i s16 = _mm256_cvtepi8_epi16(s8);
      // even scales in lane 0, odd in lane 1: chunk c's scales (2c, 2c + 1) are word c of each lane
      const __m256i seo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
      const float D = half_f16c(p + 208);
      __m256i isum[MT];
      #pragma GCC unroll 8
      for (int i = 0; i < MT; i++) {
        const int64_t ab = (m + i) * a.ldb + b;
        const __m256i off = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i*)(a.bsums + ab * 16)));
        isum[i] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
      }
      #pragma GCC unroll 8
      for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(p + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(p + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h));
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        #pragma GCC unroll 8
        for (int k = 0; k < 4; k++) {
          const int c = 4 * h + k;
          const __m256i sv = _mm256_shuffle_epi8(seo, _mm256_set1_epi16((short)(2 * c | ((2 * c + 1) << 8))));
          #pragma GCC unroll 8
          for (int i = 0; i < MT; i++) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(a.q + (m + i) * a.ldq + b * 256 + 32 * c));
            isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], x), sv));
          }
        }
      }
      #pragma GCC unroll 8
      for (int i = 0; i < MT; i++)
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(D * a.d[(m + i) * a.ldb + b]), acc[i][j]);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++)
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) out[(m + i) * ldo + j] = hsum8(acc[i][j]);
}

// Q2_K, Q3_K: codes of 32-element chunk c (0..7) of a block, unsigned, natural order.
template <int QT>
inline __m256i codes_k23(const uint8_t* p, int c) {
  const __m256i m2 = _mm256_set1_epi8(0x03), m1 = _mm256_set1_epi8(0x01);
  const int h = c / 4, rc = c % 4;
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
void tile_k23(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  constexpr bool same_d = QT == Q3_K;
  __m256 acc[MT][NT];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++)
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) acc[i][j] = _mm256_setzero_ps();
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  for (int64_t b = 0; b < nb; b++) {
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
      const uint8_t* p = w + j * row_bytes + b * kBB<QT>;
      __m256i sc16, mn16;
      float D, Dm;
      kscales<QT>(p, sc16, mn16, D, Dm);
      __m256i isum[MT];
      #pragma GCC unroll 8
      for (int i = 0; i < MT; i++) isum[i] = _mm256_setzero_si256();
      for (int c = 0; c < 8; c++) {
        const __m256i q = codes_k23<QT>(p, c);
        // int16 lanes 0..7 = sc[2c], 8..15 = sc[2c+1]
        const __m256i pair = _mm256_permutevar8x32_epi32(sc16, _mm256_set1_epi32(c));
        const __m256i sv = _mm256_shuffle_epi8(pair, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                                       2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
        #pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
          const __m256i x = _mm256_loadu_si256((const __m256i*)(a.q + (m + i) * a.ldq + b * 256 + 32 * c));
          isum[i] = _mm256_add_epi32(isum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), sv));
        }
      }
      #pragma GCC unroll 8
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
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++)
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) out[(m + i) * ldo + j] = hsum8(acc[i][j]);
}

template <int QT, int MT, int NT>
void tile_k(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  if constexpr (QT == Q4_K || QT == Q5_K) {
    if constexpr (NT > 2) {  // two rows' headers at a time
      tile_k45<QT, MT, 2>(w, row_bytes, nb, a, m, out, ldo);
      tile_k45<QT, MT, NT - 2>(w + 2 * row_bytes, row_bytes, nb, a, m, out + 2, ldo);
    } else {
      tile_k45<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
    }
  } else if constexpr (QT == Q6_K) {
    tile_k6<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
  } else {
    tile_k23<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
  }
}

// Register budget: 4 activation rows a tile; weight rows a tile by default 2 (32-blocks) and 1
// (K-quants), each format's own count timed on the host by kernels/tuning.py. Batch 1 as at
// AVX-512 (kernels_avx512.cpp).
constexpr int MT_B32 = 4, NT_B32 = 2, MT_K = 4, NT_K = 1, NT_M1 = 1, NT_M1_LONG = 4, ONE_PASS_ROWS = 0;
// the formats this level has tiles for; any other of the table runs on the generic level
template <int QT> constexpr bool kHas = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == Q8_0 ||
                                        QT == Q2_K || QT == Q3_K || QT == Q4_K || QT == Q5_K || QT == Q6_K;
#include "tile_driver.inc"
#include "prefill_avx2.inc"

const Kernels kTable = {quantize32, quantize256, matmul, has, set_knob, knob, prefill};

}  // namespace
}  // namespace wb

extern "C" const wb::Kernels* wb_kernels_avx2() { return &wb::kTable; }

#pragma GCC pop_options

#else
extern "C" const wb::Kernels* wb_kernels_avx2() { return nullptr; }
#endif
