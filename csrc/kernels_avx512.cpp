// The avx512 level: AVX-512 F/BW/VL/DQ with VNNI (e.g. AMD Zen 4/5, Intel Ice Lake and later).
// 32-blocks four at a time: one 64-byte load holds 4 blocks' codes, both nibbles of it meet the
// activations in group order (qkernels.h) by two _mm512_dpbusd_epi32, and each 128-bit lane of the
// int32 sums is one block, scaled by one permute of d_w·d_x. 256-blocks 128 values at a time, the
// sub-block scales applied by _mm512_dpwssd_epi32, the headers of up to 4 weight rows decoded
// together in the lanes of one register. No torch header here, and everything has internal linkage
// (see qblocks.inc).
#include "qkernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
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
#include "tuning.inc"
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

// The sum of each 128-bit lane: [sum lane 0, .., sum lane 3].
inline __m128 lanesums(__m512 v) {
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v));
}

// [hsum a, hsum b, hsum c, hsum d]
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  return lanesums(_mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD)));
}

// out[(m + i) * ldo + j] = the sum of acc[i][j]: a tile of MT activation rows by NT weight rows
template <int MT, int NT>
inline void store_sums(const __m512 (&acc)[MT][NT], float* out, int64_t m, int64_t ldo) {
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++) {
    if (NT == 4) {
      _mm_storeu_ps(out + (m + i) * ldo, hsum4(acc[i][0], acc[i][NT > 1 ? 1 : 0], acc[i][NT > 2 ? 2 : 0], acc[i][NT > 3 ? 3 : 0]));
    } else {
      #pragma GCC unroll 8
      for (int j = 0; j < NT; j++) out[(m + i) * ldo + j] = hsum16(acc[i][j]);
    }
  }
}

inline __mmask64 bytes_mask(int64_t n) { return n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1); }

// ---- activations ------------------------------------------------------------------------------
// One block of 32 or 256 values: d = amax/127, q = round-half-even(x/d) (|q| <= 127).
inline float block_scale(const float* xb, int n, __m512& mul) {
  __m512 mx = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
  const float amax = _mm512_reduce_max_ps(mx);
  mul = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
  return amax / 127.0f;
}

inline __m512i q16(const float* x, __m512 mul) {
  return _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// 32-blocks, q in group order (qkernels.h).
void quantize32(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int64_t ldq, float* d,
                float* s, int64_t ldb) {
  const int64_t nb = K / 32;
  for (int64_t m = m0; m < m1; m++) {
    for (int64_t b = 0; b < nb; b++) {
      const float* xb = x + m * ldx + b * 32;
      __m512 mul;
      const float dd = block_scale(xb, 32, mul);
      const __m512i v0 = q16(xb, mul), v1 = q16(xb + 16, mul);
      const int64_t g = b / 4, i = b % 4, G = nb - 4 * g < 4 ? nb - 4 * g : 4;
      int8_t* qg = q + m * ldq + 128 * g;
      _mm_storeu_si128((__m128i*)(qg + 16 * i), _mm512_cvtsepi32_epi8(v0));
      _mm_storeu_si128((__m128i*)(qg + 16 * G + 16 * i), _mm512_cvtsepi32_epi8(v1));
      d[m * ldb + b] = dd;
      s[m * ldb + b] = dd * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
    }
  }
}

// 256-blocks: q natural, qk with the 2nd and 3rd 32 of every 128 swapped, bsums per 16 and per 32.
void quantize256(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int8_t* qk, int64_t ldq,
                 float* d, int16_t* bsums, int16_t* bsums32, int64_t ldb) {
  for (int64_t m = m0; m < m1; m++) {
    for (int64_t b = 0; b < K / 256; b++) {
      const float* xb = x + m * ldx + b * 256;
      __m512 mul;
      const float dd = block_scale(xb, 256, mul);
      int8_t* qb = q + m * ldq + b * 256;
      int8_t* kb = qk + m * ldq + b * 256;
      int16_t* bs = bsums + (m * ldb + b) * 16;
      int16_t* bs32 = bsums32 + (m * ldb + b) * 8;
      for (int c = 0; c < 256; c += 32) {
        const __m512i v0 = q16(xb + c, mul), v1 = q16(xb + c + 16, mul);
        const int t0 = _mm512_reduce_add_epi32(v0), t1 = _mm512_reduce_add_epi32(v1);
        bs[c / 16] = (int16_t)t0;
        bs[c / 16 + 1] = (int16_t)t1;
        bs32[c / 32] = (int16_t)(t0 + t1);
        const __m256i p = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtsepi32_epi8(v0)),
                                                  _mm512_cvtsepi32_epi8(v1), 1);
        _mm256_storeu_si256((__m256i*)(qb + c), p);
        const int r = c % 128, swapped = r == 32 ? 64 : r == 64 ? 32 : r;
        _mm256_storeu_si256((__m256i*)(kb + c - r + swapped), p);
      }
      d[m * ldb + b] = dd;
    }
  }
}

// ---- 32-blocks --------------------------------------------------------------------------------
// Row layout: see qblocks.inc. All codes unsigned for vpdpbusd: Q8_0's signed codes are shifted by
// 128 (its offset c = -128 d). Offset and min terms: sum_b c_b s_b, one fmadd per 16 blocks.
template <int QT> constexpr float kOffset = QT == Q8_0                        ? -128.0f  // codes shifted to unsigned
                                            : format_facts(QT).halves == 2 ? 1.0f
                                                                           : (float)format_facts(QT).offset;

// The codes of one group (G blocks, G = 4 but in a row's last group) as two registers: lo (each
// block's values 0..15 in 128-bit lane i) and hi (values 16..31), zero past G.
template <int QT, bool FULL>
inline void group_codes(const uint8_t* c, int64_t G, __m512i& lo, __m512i& hi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if (QT == Q8_0) {
    const __m512i f = _mm512_set1_epi8((char)0x80);
    if (FULL) {
      lo = _mm512_xor_si512(_mm512_loadu_si512(c), f);
      hi = _mm512_xor_si512(_mm512_loadu_si512(c + 64), f);
    } else {
      const __mmask64 k = bytes_mask(16 * G);
      lo = _mm512_maskz_xor_epi32((__mmask16)((1u << (4 * G)) - 1), _mm512_maskz_loadu_epi8(k, c), f);
      hi = _mm512_maskz_xor_epi32((__mmask16)((1u << (4 * G)) - 1), _mm512_maskz_loadu_epi8(k, c + 16 * G), f);
    }
    return;
  }
  const uint8_t* qs = (QT == Q5_0 || QT == Q5_1) ? c + 4 * G : c;
  const __m512i v = FULL ? _mm512_loadu_si512(qs) : _mm512_maskz_loadu_epi8(bytes_mask(16 * G), qs);
  lo = _mm512_and_si512(v, m4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
  if (QT == Q5_0 || QT == Q5_1) {
    uint64_t hl = 0, hh = 0;
    if (FULL) {
      memcpy(&hl, c, 8);
      memcpy(&hh, c + 8, 8);
    } else {
      memcpy(&hl, c, 2 * G);
      memcpy(&hh, c + 2 * G, 2 * G);
    }
    const __m512i b4 = _mm512_set1_epi8(0x10);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(hl), lo, b4);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(hh), hi, b4);
  }
}

template <int QT, int MT, int NT, bool FULL>
inline void group_dot(const uint8_t* w, int64_t row_bytes, int64_t qoff, const ActQ8& a, int64_t m, int64_t g,
                      int64_t G, __m512i idx, const __m512* dw, const __m512* dx, __m512 (*acc)[NT]) {
  constexpr int QB = kQB<QT>;
  const __mmask64 kx = bytes_mask(16 * G);
  __m512 sx[MT];
#pragma GCC unroll 8
  for (int i = 0; i < MT; i++) sx[i] = _mm512_permutexvar_ps(idx, dx[i]);
#pragma GCC unroll 8
  for (int j = 0; j < NT; j++) {
    __m512i lo, hi;
    group_codes<QT, FULL>(w + j * row_bytes + qoff + 4 * g * QB, G, lo, hi);
    const __m512 sw = _mm512_permutexvar_ps(idx, dw[j]);
#pragma GCC unroll 8
    for (int i = 0; i < MT; i++) {
      const int8_t* xq = a.q + (m + i) * a.ldq + 128 * g;
      const __m512i xl = FULL ? _mm512_loadu_si512(xq) : _mm512_maskz_loadu_epi8(kx, xq);
      const __m512i xh = FULL ? _mm512_loadu_si512(xq + 64) : _mm512_maskz_loadu_epi8(kx, xq + 16 * G);
      const __m512i p = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
      const __m512 sc = MT == 1 ? sw : _mm512_mul_ps(sw, sx[i]);
      acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[i][j]);
    }
  }
}

template <int QT, int MT, int NT>
void tile_b32(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  const int64_t qoff = (kHasMin<QT> ? 4 : 2) * nb;
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  __m512 acc[MT][NT];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++)
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
  const __m512i idx0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t nfull = nb / 4, groups = (nb + 3) / 4;  // full groups, all groups
  for (int64_t g16 = 0; g16 < nb; g16 += 16) {
    const int64_t cnt = nb - g16 < 16 ? nb - g16 : 16;
    const __mmask16 k16 = (__mmask16)((1u << cnt) - 1);
    __m512 dw[NT], dx[MT];
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++) {
      dx[i] = _mm512_loadu_ps(a.d + (m + i) * a.ldb + g16);  // zero-padded to 16
      const __m512 sx = _mm512_mul_ps(_mm512_loadu_ps(a.s + (m + i) * a.ldb + g16), _mm512_set1_ps(kOffset<QT>));
      #pragma GCC unroll 8
      for (int j = 0; j < NT; j++) {
        const uint8_t* c = w + j * row_bytes + (kHasMin<QT> ? 2 * nb : 0) + 2 * g16;
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k16, c)), sx, acc[i][j]);
      }
    }
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
      dw[j] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k16, w + j * row_bytes + 2 * g16));
      if (MT == 1) dw[j] = _mm512_mul_ps(dw[j], dx[0]);
    }
    const int64_t gend = (g16 + cnt) / 4 < nfull ? (g16 + cnt) / 4 : nfull;
    int64_t g = g16 / 4;
    for (; g < gend; g++) {
      prefetch_tile_share(w, NT * row_bytes, groups, g, pf);
      const __m512i idx = _mm512_add_epi32(idx0, _mm512_set1_epi32((int)(4 * (g % 4))));
      group_dot<QT, MT, NT, true>(w, row_bytes, qoff, a, m, g, 4, idx, dw, dx, acc);
    }
    if (4 * g < g16 + cnt) {  // the row's last group, short
      prefetch_tile_share(w, NT * row_bytes, groups, g, pf);
      const __m512i idx = _mm512_add_epi32(idx0, _mm512_set1_epi32((int)(4 * (g % 4))));
      group_dot<QT, MT, NT, false>(w, row_bytes, qoff, a, m, g, nb - 4 * g, idx, dw, dx, acc);
    }
  }
  store_sums<MT, NT>(acc, out, m, ldo);
}

// ---- 256-blocks -------------------------------------------------------------------------------

// 16 bytes at `off` of up to 4 rows, row j in 128-bit lane j (lanes past NT zero).
template <int NT>
inline __m512i lanes128(const uint8_t* w, int64_t row_bytes, int64_t off) {
  __m512i v = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i*)(w + off)));
  if (NT > 1) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(w + row_bytes + off)), 1);
  if (NT > 2) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(w + 2 * row_bytes + off)), 2);
  if (NT > 3) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(w + 3 * row_bytes + off)), 3);
  return v;
}

// Q4_K/Q5_K header lanes [d dmin s0..s11] -> lanes [8 scales, 8 mins] (bytes, 6 bits each).
inline __m512i k4_scales_mins(__m512i H) {
  const __m512i A = _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i B = _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m512i sh = _mm512_broadcast_i32x4(_mm_setr_epi16(0, 0, 0, 0, 0, 0, 4, 4));
  const __m512i mk = _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  const __m512i t1 = _mm512_srlv_epi16(_mm512_shuffle_epi8(H, A), sh);
  const __m512i t2 = _mm512_and_si512(_mm512_srli_epi16(_mm512_shuffle_epi8(H, B), 2), _mm512_set1_epi8(0x30));
  return _mm512_ternarylogic_epi32(t1, mk, t2, 0xEA);  // (t1 & mk) | t2
}

// Q4_K/Q5_K: the int16 scale vector of 64-value chunk k (0..3, in qk order: lanes 0-1 sub-block
// sa, lanes 2-3 sub-block sa + 2, sa = 4 (k / 2) + k % 2) from a row's [scales, mins] lane broadcast.
inline __m512i k4_scale_ctrl(int k) {
  const int sa = 4 * (k / 2) + k % 2;
  const __m128i lo = _mm_set1_epi16((short)(0x8000 | sa)), hi = _mm_set1_epi16((short)(0x8000 | (sa + 2)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(lo, lo)), _mm256_set_m128i(hi, hi), 1);
}

// Q6_K: int16 index vector picking sub-block 4k + lane of 16 int16 scales
inline __m512i k6_scale_idx(int k) {
  const __m256i lo = _mm256_set_m128i(_mm_set1_epi16(1), _mm_set1_epi16(0));
  const __m256i hi = _mm256_set_m128i(_mm_set1_epi16(3), _mm_set1_epi16(2));
  return _mm512_add_epi16(_mm512_set1_epi16((short)(4 * k)), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

// Codes of 64-value chunk k (0..3) of one row's block (Q4_K/Q5_K: in qk order; Q6_K: natural).
template <int QT>
inline __m512i kcode(const uint8_t* p, int k) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int h = k / 2;
  if (QT == Q4_K || QT == Q5_K) {
    const __m512i v = _mm512_loadu_si512(p + (QT == Q4_K ? 16 : 48) + 64 * h);
    __m512i q = k % 2 ? _mm512_and_si512(_mm512_srli_epi16(v, 4), m4) : _mm512_and_si512(v, m4);
    if (QT == Q5_K) {
      const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 16)));
      const int sa = 4 * (k / 2) + k % 2;  // sub-blocks sa (bytes 0..31) and sa + 2 (32..63)
      const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << sa)), _mm256_set1_epi8((char)(1 << (sa + 2))), 1);
      q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh, bit), q, _mm512_set1_epi8(0x10));
    }
    return q;
  }
  // Q6_K: ql[128], qh[64]; the high 2 bits of values 0-31 (32-63, 64-95, 96-127) of a half are
  // bits 0-1 (2-3, 4-5, 6-7) of its 32 qh bytes, brought to bits 4-5 by one rotate per dword
  const __m512i v = _mm512_loadu_si512(p + 64 * h);
  const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(p + 128 + 32 * h)));
  const __m512i rot = k % 2 ? _mm512_inserti64x4(_mm512_set1_epi32(0), _mm256_set1_epi32(30), 1)
                            : _mm512_inserti64x4(_mm512_set1_epi32(4), _mm256_set1_epi32(2), 1);
  const __m512i hb = _mm512_and_si512(_mm512_rolv_epi32(qh, rot), _mm512_set1_epi8(0x30));
  return _mm512_ternarylogic_epi32(k % 2 ? _mm512_srli_epi16(v, 4) : v, m4, hb, 0xEA);  // (lo & m4) | hb
}

template <int QT, int MT, int NT>
void tile_k45(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  // Q4_K, Q5_K: w = D sc q - Dm mn per 32 values; activations in qk order.
  __m512 acc[MT][NT], accm[MT];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++) {
    accm[i] = _mm512_setzero_ps();
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
  }
  const __m512i mnctrl = _mm512_broadcast_i32x4(_mm_setr_epi8(8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1));
  const __m512i dmidx = _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
  const __m512i ddidx = _mm512_zextsi128_si512(_mm_setr_epi16(0, 8, 16, 24, 1, 9, 17, 25));
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  // the header of block b + 1 is decoded during block b: its shuffles are off the critical path
  __m512i Hn = lanes128<NT>(w, row_bytes, 0), Rn = k4_scales_mins(Hn);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* wb = w + b * kBB<QT>;
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    const __m512i H = Hn, R = Rn;
    if (b + 1 < nb) {
      Hn = lanes128<NT>(wb + kBB<QT>, row_bytes, 0);
      Rn = k4_scales_mins(Hn);
    }
    // [D_0..D_3, Dm_0..Dm_3]
    const __m256 DD = _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutexvar_epi16(ddidx, H)));
    const __m512i MN = _mm512_shuffle_epi8(R, mnctrl);  // lane j: row j's 8 mins as int16
    alignas(32) float ddx[MT][8];
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++) {
      const int64_t ab = (m + i) * a.ldb + b;
      const __m256 dd = _mm256_mul_ps(DD, _mm256_set1_ps(a.d[ab]));
      _mm256_store_ps(ddx[i], dd);
      const __m512i bs = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(a.bsums32 + ab * 8)));
      const __m512 dm = _mm512_permutexvar_ps(dmidx, _mm512_castps256_ps512(dd));
      accm[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(MN, bs)), dm, accm[i]);
    }
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
      const __m512i Rj = _mm512_shuffle_i32x4(R, R, j * 0x55);
      __m512i isum[MT];
#pragma GCC unroll 8
      for (int i = 0; i < MT; i++) isum[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < 4; k++) {
        const __m512i q = kcode<QT>(wb + j * row_bytes, k), sv = _mm512_shuffle_epi8(Rj, k4_scale_ctrl(k));
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
          const __m512i x = _mm512_loadu_si512(a.qk + (m + i) * a.ldq + b * 256 + 64 * k);
          isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(q, x), sv);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < MT; i++)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_set1_ps(ddx[i][j]), acc[i][j]);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++) {
    const __m128 mins = lanesums(accm[i]);
    if (NT == 4) {
      _mm_storeu_ps(out + (m + i) * ldo, _mm_sub_ps(hsum4(acc[i][0], acc[i][NT > 1 ? 1 : 0], acc[i][NT > 2 ? 2 : 0],
                                                          acc[i][NT > 3 ? 3 : 0]), mins));
    } else {
      alignas(16) float mn[4];
      _mm_store_ps(mn, mins);
      #pragma GCC unroll 8
      for (int j = 0; j < NT; j++) out[(m + i) * ldo + j] = hsum16(acc[i][j]) - mn[j];
    }
  }
}

template <int QT, int MT, int NT>
void tile_k6(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  // Q6_K: w = D sc (q - 32) per 16 values; activations natural.
  __m512 acc[MT][NT];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++)
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* wb = w + b * kBB<QT>;
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
      const uint8_t* p = wb + j * row_bytes;
      const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 192)));
      const __m512i S = _mm512_castsi256_si512(s16);
      const float D = half_f16c(p + 208);
      __m512i isum[MT];
      // the -32 of every code: -sum_k 32 s_k bsums_k, one dpwssd (32 s_k fits int16, 32 bsums_k may not)
      const __m256i s32 = _mm256_slli_epi16(s16, 5);
#pragma GCC unroll 8
      for (int i = 0; i < MT; i++) {
        const __m256i nbs = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_loadu_si256((const __m256i*)(a.bsums + ((m + i) * a.ldb + b) * 16)));
        isum[i] = _mm512_zextsi256_si512(_mm256_dpwssd_epi32(_mm256_setzero_si256(), s32, nbs));
      }
#pragma GCC unroll 8
      for (int k = 0; k < 4; k++) {
        const __m512i q = kcode<QT>(p, k), sv = _mm512_permutexvar_epi16(k6_scale_idx(k), S);
#pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
          const __m512i x = _mm512_loadu_si512(a.q + (m + i) * a.ldq + b * 256 + 64 * k);
          isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(q, x), sv);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < MT; i++)
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_set1_ps(D * a.d[(m + i) * a.ldb + b]), acc[i][j]);
    }
  }
  store_sums<MT, NT>(acc, out, m, ldo);
}

// Q2_K, Q3_K: codes of 64-element chunk c (0..3) of a block, unsigned, natural order.
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

template <int QT>
inline __m512i codes_k23(const uint8_t* p, int c) {
  const __m256i m2 = _mm256_set1_epi8(0x03), m1 = _mm256_set1_epi8(0x01);
  const int h = c / 2, r = c % 2;
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
void tile_k23(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  constexpr bool same_d = QT == Q3_K;
  __m512 acc[MT][NT];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++)
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) acc[i][j] = _mm512_setzero_ps();
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  for (int64_t b = 0; b < nb; b++) {
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) {
      const uint8_t* p = w + j * row_bytes + b * kBB<QT>;
      __m256i sc, mn16;
      float D, Dm;
      kscales<QT>(p, sc, mn16, D, Dm);
      const __m512i sc16 = _mm512_castsi256_si512(sc);
      __m512i isum[MT];
      #pragma GCC unroll 8
      for (int i = 0; i < MT; i++) isum[i] = _mm512_setzero_si512();
      #pragma GCC unroll 8
      for (int c = 0; c < 4; c++) {
        const __m512i q = codes_k23<QT>(p, c);
        // int16 lane l = sc[4c + l / 8]
        const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short)(4 * c)),
                                             _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                                                                15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
        const __m512i sv = _mm512_permutexvar_epi16(idx, sc16);
        #pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
          const __m512i x = _mm512_loadu_si512((const void*)(a.q + (m + i) * a.ldq + b * 256 + 64 * c));
          isum[i] = _mm512_dpwssd_epi32(isum[i], _mm512_maddubs_epi16(q, x), sv);
        }
      }
      #pragma GCC unroll 8
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
  #pragma GCC unroll 8
  for (int i = 0; i < MT; i++)
    #pragma GCC unroll 8
    for (int j = 0; j < NT; j++) out[(m + i) * ldo + j] = hsum16(acc[i][j]);
}

template <int QT, int MT, int NT>
void tile_k(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  if constexpr (QT == Q4_K || QT == Q5_K) tile_k45<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
  else if constexpr (QT == Q6_K) tile_k6<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
  else tile_k23<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
}

// Register budget: 4 activation rows a tile; weight rows a tile by default 2 (32-blocks) and 4
// (K-quants: a block's header and mins decoded once for 4 rows; Q4_K 16384x3072 at 4 rows 2.24 ms
// against 2.50 with 2), each format's own count timed on the host by kernels/tuning.py. A call of 5
// rows (a verification of 4 drafts) is one pass. Batch 1: one weight row a tile for rows of up to
// kLongRowK values, 4 for longer ones (Zen 4, 2 threads, from DRAM: Q4_K 1536x1536 17.6 GB/s with
// 4 rows, 25.6 with 1; Q8_0 1536x8960 25.6 with 4, 23.9 with 1).
constexpr int MT_B32 = 4, NT_B32 = 2, MT_K = 4, NT_K = 4, NT_M1 = 1, NT_M1_LONG = 4, ONE_PASS_ROWS = 5;
// the formats this level has tiles for; any other of the table runs on the generic level
template <int QT> constexpr bool kHas = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == Q8_0 ||
                                        QT == Q2_K || QT == Q3_K || QT == Q4_K || QT == Q5_K || QT == Q6_K;
#include "tile_driver.inc"
#include "prefill_avx512.inc"

const Kernels kTable = {quantize32, quantize256, matmul, has, set_knob, knob, prefill};

}  // namespace
}  // namespace wb

extern "C" const wb::Kernels* wb_kernels_avx512() { return &wb::kTable; }

#pragma GCC pop_options

#else
extern "C" const wb::Kernels* wb_kernels_avx512() { return nullptr; }
#endif
