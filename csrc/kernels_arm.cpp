// The arm level: aarch64 NEON with the dot-product extension (vdotq_s32; Armv8.2-A+, e.g. Apple M1
// and later, Neoverse N1/V1/N2/V2 (Graviton 2-4), Cortex-A76+). Chosen at run time by the CPU's
// features (wb_arm_features: getauxval on Linux, sysctlbyname on macOS), the portable level the
// fallback. No torch header here, and everything has internal linkage (see qblocks.inc).
//
// Bit for bit the portable level's results (kernels_generic.cpp): the integer dot products are
// exact in any order, and the float steps are the generic level's, in its order, lane by lane:
//   32-blocks, per block:  acc += (d_w·d_x)·float(dot) [+ c·s]   (4 weight rows in the 4 lanes)
//   256-blocks, per block: acc += d_x·(D·float(isum) − Dm·float(imin))
// without fused multiply-adds (this file and the generic one are built with fp-contract off: GCC
// contracts a·b + c into fmadd on aarch64 by default, which rounds once where x86's portable
// level rounds twice). The activations keep the generic level's natural order and bytes.
#include "qkernels.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <math.h>
#include <string.h>
#if defined(__linux__)
#include <sys/auxv.h>
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#include <sys/types.h>
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#pragma clang attribute push(__attribute__((target("dotprod,i8mm"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")
#pragma GCC optimize("fp-contract=off")
#endif

namespace wb {
namespace {

inline float half_neon(const uint8_t* p) {
  __fp16 h;
  memcpy(&h, p, 2);
  return (float)h;  // exact, subnormals included: the same value as qblocks.inc's conversion
}
#define WB_HALF(p) half_neon(p)
#include "qblocks.inc"
#include "tuning.inc"

// ---- activations: the generic level's bytes (natural order), in NEON ----------------------------
inline float block_scale(const float* xb, int n, float& id) {
  float32x4_t mx = vdupq_n_f32(0.0f);
  for (int i = 0; i < n; i += 4) mx = vmaxq_f32(mx, vabsq_f32(vld1q_f32(xb + i)));
  const float amax = vmaxvq_f32(mx);
  id = amax != 0.0f ? 127.0f / amax : 0.0f;
  return amax / 127.0f;
}

// 16 values -> 16 int8, x·id rounded to nearest even (the generic level's rne of the rounded product)
inline int8x16_t q16(const float* x, float id) {
  const int32x4_t a = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x), id));
  const int32x4_t b = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + 4), id));
  const int32x4_t c = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + 8), id));
  const int32x4_t d = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + 12), id));
  const int16x8_t ab = vcombine_s16(vqmovn_s32(a), vqmovn_s32(b)), cd = vcombine_s16(vqmovn_s32(c), vqmovn_s32(d));
  return vcombine_s8(vqmovn_s16(ab), vqmovn_s16(cd));
}

inline int sum16(int8x16_t v) { return vaddlvq_s8(v); }

void quantize32(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int64_t ldq, float* d,
                float* s, int64_t ldb) {
  for (int64_t m = m0; m < m1; m++)
    for (int64_t b = 0; b < K / 32; b++) {
      const float* xb = x + m * ldx + b * 32;
      float id;
      const float dd = block_scale(xb, 32, id);
      const int8x16_t lo = q16(xb, id), hi = q16(xb + 16, id);
      vst1q_s8(q + m * ldq + b * 32, lo);
      vst1q_s8(q + m * ldq + b * 32 + 16, hi);
      d[m * ldb + b] = dd;
      s[m * ldb + b] = dd * (float)(sum16(lo) + sum16(hi));
    }
}

void quantize256(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int8_t*, int64_t ldq,
                 float* d, int16_t* bsums, int16_t* bsums32, int64_t ldb) {
  for (int64_t m = m0; m < m1; m++)
    for (int64_t b = 0; b < K / 256; b++) {
      const float* xb = x + m * ldx + b * 256;
      float id;
      const float dd = block_scale(xb, 256, id);
      int16_t* bs = bsums + (m * ldb + b) * 16;
      int16_t* bs32 = bsums32 + (m * ldb + b) * 8;
      for (int j = 0; j < 16; j++) {
        const int8x16_t v = q16(xb + 16 * j, id);
        vst1q_s8(q + m * ldq + b * 256 + 16 * j, v);
        bs[j] = (int16_t)sum16(v);
      }
      for (int j = 0; j < 8; j++) bs32[j] = (int16_t)(bs[2 * j] + bs[2 * j + 1]);
      d[m * ldb + b] = dd;
    }
}

// ---- 32-blocks --------------------------------------------------------------------------------
// Row layout: qblocks.inc. NT (<= 4) weight rows in the 4 lanes of the float steps.

// The float16 at off of rows 0..NT-1 (row j in lane j, zeros past NT) as float32.
template <int NT>
inline float32x4_t halves4(const uint8_t* w, int64_t row_bytes, int64_t off) {
  uint16x4_t v = vdup_n_u16(0);
  v = vld1_lane_u16((const uint16_t*)(w + off), v, 0);
  if (NT > 1) v = vld1_lane_u16((const uint16_t*)(w + row_bytes + off), v, 1);
  if (NT > 2) v = vld1_lane_u16((const uint16_t*)(w + 2 * row_bytes + off), v, 2);
  if (NT > 3) v = vld1_lane_u16((const uint16_t*)(w + 3 * row_bytes + off), v, 3);
  return vcvt_f32_f16(vreinterpret_f16_u16(v));
}

// A full group's 4 float16 at off of 4 rows, transposed: v[i] = block i's value of rows 0..3 (the
// lanes halves4<4> gives block by block, in 4 loads where that takes 16).
inline void halves4x4(const uint8_t* w, int64_t row_bytes, int64_t off, float32x4_t* v) {
  const float32x4_t r0 = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(w + off)));
  const float32x4_t r1 = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(w + row_bytes + off)));
  const float32x4_t r2 = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(w + 2 * row_bytes + off)));
  const float32x4_t r3 = vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(w + 3 * row_bytes + off)));
  const float32x4_t t0 = vtrn1q_f32(r0, r1), t1 = vtrn2q_f32(r0, r1), t2 = vtrn1q_f32(r2, r3), t3 = vtrn2q_f32(r2, r3);
  v[0] = vreinterpretq_f32_f64(vzip1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
  v[1] = vreinterpretq_f32_f64(vzip1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
  v[2] = vreinterpretq_f32_f64(vzip2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
  v[3] = vreinterpretq_f32_f64(vzip2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}

// 16 bits at p (little-endian) -> 16 bytes, byte t = 0x10 where bit t is set.
inline uint8x16_t bits16_x10(const uint8_t* p) {
  // the two bytes to every lane by a load (no general-register to vector moves), then byte 0 to
  // lanes 0-7 and byte 1 to lanes 8-15
  const uint8x16_t both = vreinterpretq_u8_u16(vld1q_dup_u16((const uint16_t*)p));
  const uint8x16_t spread = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
  const uint8x16_t v = vqtbl1q_u8(both, spread);
  const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  return vandq_u8(vtstq_u8(v, bit), vdupq_n_u8(0x10));
}

// Codes of block i of a group of G (c: the group's codes in the row layout): lo = values 0..15,
// hi = values 16..31 (unsigned but for Q8_0's, all within int8).
template <int QT>
inline void codes32(const uint8_t* c, int64_t G, int64_t i, int8x16_t& lo, int8x16_t& hi) {
  if (QT == Q8_0) {
    lo = vld1q_s8((const int8_t*)(c + 16 * i));
    hi = vld1q_s8((const int8_t*)(c + 16 * G + 16 * i));
    return;
  }
  const uint8_t* qs = (QT == Q5_0 || QT == Q5_1) ? c + 4 * G : c;
  const uint8x16_t v = vld1q_u8(qs + 16 * i);
  uint8x16_t l = vandq_u8(v, vdupq_n_u8(0x0F)), h = vshrq_n_u8(v, 4);
  if (QT == Q5_0 || QT == Q5_1) {
    l = vorrq_u8(l, bits16_x10(c + 2 * i));
    h = vorrq_u8(h, bits16_x10(c + 2 * G + 2 * i));
  }
  lo = vreinterpretq_s8_u8(l);
  hi = vreinterpretq_s8_u8(h);
}

// Whether this CPU has i8mm (vmmlaq_s32), read once; the tiles below take it where they can.
const bool g_i8mm = (wb_arm_features() & WB_ARM_I8MM) != 0;

// i8mm: 2 weight rows x 2 activation rows a vmmlaq_s32 (8 values of each: 32 products, twice a
// vdotq_s32's), lanes (j, r), (j, r + 1), (j + 1, r), (j + 1, r + 1); the float steps of each lane
// are the generic level's as in tile_b32. MT and NT even.
template <int QT, int MT, int NT>
void tile_b32_mm(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out,
                 int64_t ldo) {
  static_assert(MT % 2 == 0 && NT % 2 == 0 && NT <= 4, "pairs of rows");
  constexpr int QB = kQB<QT>;
  const int64_t qoff = (kHasMin<QT> ? 4 : 2) * nb, groups = (nb + 3) / 4;
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  float32x4_t acc[MT / 2][NT / 2];
  for (int r = 0; r < MT / 2; r++)
    for (int j = 0; j < NT / 2; j++) acc[r][j] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < groups; g++) {
    const int64_t G = nb - 4 * g < 4 ? nb - 4 * g : 4;
    prefetch_tile_share(w, NT * row_bytes, groups, g, pf);
    for (int64_t i = 0; i < G; i++) {
      const int64_t b = 4 * g + i;
      int8x16_t wq[NT / 2][4];  // a pair's codes: values 0-7, 8-15, 16-23, 24-31 of both rows
      for (int j = 0; j < NT; j += 2) {
        int8x16_t lo0, hi0, lo1, hi1;
        codes32<QT>(w + j * row_bytes + qoff + 4 * g * QB, G, i, lo0, hi0);
        codes32<QT>(w + (j + 1) * row_bytes + qoff + 4 * g * QB, G, i, lo1, hi1);
        wq[j / 2][0] = vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(lo0), vreinterpretq_s64_s8(lo1)));
        wq[j / 2][1] = vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(lo0), vreinterpretq_s64_s8(lo1)));
        wq[j / 2][2] = vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(hi0), vreinterpretq_s64_s8(hi1)));
        wq[j / 2][3] = vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(hi0), vreinterpretq_s64_s8(hi1)));
      }
      const float32x4_t d4 = halves4<NT>(w, row_bytes, 2 * b);  // rows 0..3
      float32x4_t c4 = vdupq_n_f32(0.0f);
      if (QT == Q4_0 || QT == Q5_0) c4 = vmulq_n_f32(d4, (float)format_facts(QT).offset);
      if (kHasMin<QT>) c4 = halves4<NT>(w, row_bytes, 2 * nb + 2 * b);
      // per pair of weight rows: [d_j, d_j, d_j+1, d_j+1]
      const float32x4_t dw[2] = {vzip1q_f32(d4, d4), vzip2q_f32(d4, d4)};
      const float32x4_t cw[2] = {vzip1q_f32(c4, c4), vzip2q_f32(c4, c4)};
      for (int r = 0; r < MT; r += 2) {
        const int8_t* x0 = a.q + (m + r) * a.ldq + 32 * b;
        const int8_t* x1 = x0 + a.ldq;
        const int64x2_t l0 = vreinterpretq_s64_s8(vld1q_s8(x0)), l1 = vreinterpretq_s64_s8(vld1q_s8(x1));
        const int64x2_t h0 = vreinterpretq_s64_s8(vld1q_s8(x0 + 16)), h1 = vreinterpretq_s64_s8(vld1q_s8(x1 + 16));
        const int8x16_t xq[4] = {vreinterpretq_s8_s64(vzip1q_s64(l0, l1)), vreinterpretq_s8_s64(vzip2q_s64(l0, l1)),
                                 vreinterpretq_s8_s64(vzip1q_s64(h0, h1)), vreinterpretq_s8_s64(vzip2q_s64(h0, h1))};
        const int64_t ab = (m + r) * a.ldb + b;
        const float32x2_t dx2 = {a.d[ab], a.d[ab + a.ldb]};
        const float32x4_t dx = vcombine_f32(dx2, dx2);  // [dx_r, dx_r+1, dx_r, dx_r+1]
        float32x4_t sx = vdupq_n_f32(0.0f);
        if (QT != Q8_0) {
          const float32x2_t s2 = {a.s[ab], a.s[ab + a.ldb]};
          sx = vcombine_f32(s2, s2);
        }
        for (int j = 0; j < NT / 2; j++) {
          int32x4_t sum = vdupq_n_s32(0);
          for (int k = 0; k < 4; k++) sum = vmmlaq_s32(sum, wq[j][k], xq[k]);
          float32x4_t t = vmulq_f32(vmulq_f32(dw[j], dx), vcvtq_f32_s32(sum));
          if (QT != Q8_0) t = vaddq_f32(t, vmulq_f32(cw[j], sx));
          acc[r / 2][j] = vaddq_f32(acc[r / 2][j], t);
        }
      }
    }
  }
  for (int r = 0; r < MT / 2; r++)
    for (int j = 0; j < NT / 2; j++) {
      float v[4];
      vst1q_f32(v, acc[r][j]);
      out[(m + 2 * r) * ldo + 2 * j] = v[0];
      out[(m + 2 * r + 1) * ldo + 2 * j] = v[1];
      out[(m + 2 * r) * ldo + 2 * j + 1] = v[2];
      out[(m + 2 * r + 1) * ldo + 2 * j + 1] = v[3];
    }
}

template <int QT, int MT, int NT>
void tile_b32(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  static_assert(NT <= 4, "weight rows are the 4 lanes");
  if constexpr (MT % 2 == 0 && NT % 2 == 0) {
    if (g_i8mm) return tile_b32_mm<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
  }
  constexpr int QB = kQB<QT>;
  const int64_t qoff = (kHasMin<QT> ? 4 : 2) * nb, groups = (nb + 3) / 4;
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  float32x4_t acc[MT];
  for (int r = 0; r < MT; r++) acc[r] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < groups; g++) {
    const int64_t G = nb - 4 * g < 4 ? nb - 4 * g : 4;
    prefetch_tile_share(w, NT * row_bytes, groups, g, pf);
    float32x4_t dg[4], mg[4];  // a full group's d (and m) of 4 rows, by block
    const bool by_group = NT == 4 && G == 4;
    if (by_group) {
      halves4x4(w, row_bytes, 8 * g, dg);
      if (kHasMin<QT>) halves4x4(w, row_bytes, 2 * nb + 8 * g, mg);
    }
    for (int64_t i = 0; i < G; i++) {
      const int64_t b = 4 * g + i;
      int8x16_t lo[NT], hi[NT];
      for (int j = 0; j < NT; j++) codes32<QT>(w + j * row_bytes + qoff + 4 * g * QB, G, i, lo[j], hi[j]);
      const float32x4_t dw = by_group ? dg[i] : halves4<NT>(w, row_bytes, 2 * b);
      // c of w = d q + c: Q4_0 -8 d, Q5_0 -16 d (exact), Q4_1/Q5_1 the stored m
      float32x4_t cw = vdupq_n_f32(0.0f);
      if (QT == Q4_0 || QT == Q5_0) cw = vmulq_n_f32(dw, (float)format_facts(QT).offset);
      if (kHasMin<QT>) cw = by_group ? mg[i] : halves4<NT>(w, row_bytes, 2 * nb + 2 * b);
      for (int r = 0; r < MT; r++) {
        const int8_t* xq = a.q + (m + r) * a.ldq + 32 * b;
        const int8x16_t xl = vld1q_s8(xq), xh = vld1q_s8(xq + 16);
        int32x4_t s[4];
        for (int j = 0; j < 4; j++) s[j] = vdupq_n_s32(0);
        for (int j = 0; j < NT; j++) s[j] = vdotq_s32(vdotq_s32(s[j], lo[j], xl), hi[j], xh);
        const int32x4_t sums = vpaddq_s32(vpaddq_s32(s[0], s[1]), vpaddq_s32(s[2], s[3]));  // lane j: row j
        const int64_t ab = (m + r) * a.ldb + b;
        float32x4_t t = vmulq_f32(vmulq_n_f32(dw, a.d[ab]), vcvtq_f32_s32(sums));
        if (QT != Q8_0) t = vaddq_f32(t, vmulq_n_f32(cw, a.s[ab]));
        acc[r] = vaddq_f32(acc[r], t);
      }
    }
  }
  for (int r = 0; r < MT; r++) {
    float v[4];
    vst1q_f32(v, acc[r]);
    for (int j = 0; j < NT; j++) out[(m + r) * ldo + j] = v[j];
  }
}

// ---- 256-blocks -------------------------------------------------------------------------------
// A block's 256 codes (unsigned, natural order) into q, by 16-byte vectors (the tiles of Q2_K and
// Q3_K, and the i8mm tiles of every K-quant).
template <int QT>
inline void codes256(const uint8_t* p, uint8_t* q) {
  const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(0x03);
  if (QT == Q4_K || QT == Q5_K) {
    const uint8_t* ql = p + (QT == Q4_K ? 16 : 48);
    const uint8x16_t h0 = vld1q_u8(p + 16), h1 = vld1q_u8(p + 32);  // Q5_K's high bits
    for (int c = 0; c < 4; c++) {
      const uint8x16_t v0 = vld1q_u8(ql + 32 * c), v1 = vld1q_u8(ql + 32 * c + 16);
      uint8x16_t a = vandq_u8(v0, m4), b = vandq_u8(v1, m4), e = vshrq_n_u8(v0, 4), f = vshrq_n_u8(v1, 4);
      if (QT == Q5_K) {  // bit 2c of qh[t] is bit 4 of value 64c + t's code, bit 2c + 1 of value 64c + 32 + t's
        const int8x16_t s0 = vdupq_n_s8((int8_t)(4 - 2 * c)), s1 = vdupq_n_s8((int8_t)(3 - 2 * c));
        const uint8x16_t b4 = vdupq_n_u8(0x10);
        a = vorrq_u8(a, vandq_u8(vshlq_u8(h0, s0), b4));
        b = vorrq_u8(b, vandq_u8(vshlq_u8(h1, s0), b4));
        e = vorrq_u8(e, vandq_u8(vshlq_u8(h0, s1), b4));
        f = vorrq_u8(f, vandq_u8(vshlq_u8(h1, s1), b4));
      }
      vst1q_u8(q + 64 * c, a);
      vst1q_u8(q + 64 * c + 16, b);
      vst1q_u8(q + 64 * c + 32, e);
      vst1q_u8(q + 64 * c + 48, f);
    }
  } else if (QT == Q6_K) {
    const uint8x16_t m30 = vdupq_n_u8(0x30);
    for (int h = 0; h < 2; h++) {
      const uint8_t* ql = p + 64 * h;
      const uint8x16_t l0 = vld1q_u8(ql), l1 = vld1q_u8(ql + 16), l2 = vld1q_u8(ql + 32), l3 = vld1q_u8(ql + 48);
      const uint8x16_t qh0 = vld1q_u8(p + 128 + 32 * h), qh1 = vld1q_u8(p + 128 + 32 * h + 16);
      uint8_t* o = q + 128 * h;
      vst1q_u8(o + 0, vorrq_u8(vandq_u8(l0, m4), vandq_u8(vshlq_n_u8(qh0, 4), m30)));
      vst1q_u8(o + 16, vorrq_u8(vandq_u8(l1, m4), vandq_u8(vshlq_n_u8(qh1, 4), m30)));
      vst1q_u8(o + 32, vorrq_u8(vandq_u8(l2, m4), vandq_u8(vshlq_n_u8(qh0, 2), m30)));
      vst1q_u8(o + 48, vorrq_u8(vandq_u8(l3, m4), vandq_u8(vshlq_n_u8(qh1, 2), m30)));
      vst1q_u8(o + 64, vorrq_u8(vshrq_n_u8(l0, 4), vandq_u8(qh0, m30)));
      vst1q_u8(o + 80, vorrq_u8(vshrq_n_u8(l1, 4), vandq_u8(qh1, m30)));
      vst1q_u8(o + 96, vorrq_u8(vshrq_n_u8(l2, 4), vandq_u8(vshrq_n_u8(qh0, 2), m30)));
      vst1q_u8(o + 112, vorrq_u8(vshrq_n_u8(l3, 4), vandq_u8(vshrq_n_u8(qh1, 2), m30)));
    }
  } else {  // Q2_K, Q3_K: value 128h + 32s + t: bits 2s of qs[32h + t]; Q3_K: + 4 x bit 4h + s of hmask[t]
    const uint8x16_t hm0 = vld1q_u8(p), hm1 = vld1q_u8(p + 16);
    for (int h = 0; h < 2; h++) {
      const uint8_t* qs = p + (QT == Q3_K ? 32 : 16) + 32 * h;
      const uint8x16_t v0 = vld1q_u8(qs), v1 = vld1q_u8(qs + 16);
      for (int s = 0; s < 4; s++) {
        const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * s));
        uint8x16_t a = vandq_u8(vshlq_u8(v0, sh), m3), b = vandq_u8(vshlq_u8(v1, sh), m3);
        if (QT == Q3_K) {
          const int8x16_t hs = vdupq_n_s8((int8_t)(2 - 4 * h - s));
          a = vorrq_u8(a, vandq_u8(vshlq_u8(hm0, hs), vdupq_n_u8(4)));
          b = vorrq_u8(b, vandq_u8(vshlq_u8(hm1, hs), vdupq_n_u8(4)));
        }
        vst1q_u8(q + 128 * h + 32 * s, a);
        vst1q_u8(q + 128 * h + 32 * s + 16, b);
      }
    }
  }
}

// isum = sum_j sc[j] (codes . x over 16 values j), imin = sum_j mn[j] bsums[j]: exact int32.
inline void block_dot(const uint8_t* q, const int16_t* sc, const int16_t* mn, const int8_t* x, const int16_t* bs,
                      int& isum, int& imin) {
  int32x4_t acc = vdupq_n_s32(0);
  for (int j = 0; j < 16; j++) {
    const int32x4_t t = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(vld1q_u8(q + 16 * j)), vld1q_s8(x + 16 * j));
    acc = vmlaq_n_s32(acc, t, sc[j]);
  }
  isum = vaddvq_s32(acc);
  int32x4_t mm = vmull_s16(vld1_s16(mn), vld1_s16(bs));
  mm = vmlal_s16(mm, vld1_s16(mn + 4), vld1_s16(bs + 4));
  mm = vmlal_s16(mm, vld1_s16(mn + 8), vld1_s16(bs + 8));
  mm = vmlal_s16(mm, vld1_s16(mn + 12), vld1_s16(bs + 12));
  imin = vaddvq_s32(mm);
}

// Q2_K, Q3_K: a block's codes decoded into a buffer (codes256), its scales by qblocks.inc.
template <int QT, int MT, int NT>
void tile_k23(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  float acc[MT][NT];
  for (int r = 0; r < MT; r++)
    for (int j = 0; j < NT; j++) acc[r][j] = 0.0f;
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  alignas(16) uint8_t q[NT][256];
  KScales k[NT];
  for (int64_t b = 0; b < nb; b++) {
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    for (int j = 0; j < NT; j++) {
      const uint8_t* p = w + j * row_bytes + b * kBB<QT>;
      decode_kscales(QT, p, k[j]);
      codes256<QT>(p, q[j]);
    }
    for (int r = 0; r < MT; r++) {
      const int64_t ab = (m + r) * a.ldb + b;
      const float dx = a.d[ab];
      for (int j = 0; j < NT; j++) {
        int isum, imin;
        block_dot(q[j], k[j].sc, k[j].mn, a.q + (m + r) * a.ldq + b * 256, a.bsums + ab * 16, isum, imin);
        acc[r][j] += dx * (k[j].D * (float)isum - k[j].Dm * (float)imin);
      }
    }
  }
  for (int r = 0; r < MT; r++)
    for (int j = 0; j < NT; j++) out[(m + r) * ldo + j] = acc[r][j];
}

// Q4_K, Q5_K: 64 values (32 code bytes) a step, both nibbles; the 6-bit scales and mins of a block
// unpacked in NEON registers, the scale of each 32 values applied by vmlaq_laneq_s32 to its dot
// products, the mins against the activations' sums of 32 (bsums32).
template <int QT, int MT, int NT>
void tile_k45(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  float acc[MT][NT];
  for (int r = 0; r < MT; r++)
    for (int j = 0; j < NT; j++) acc[r][j] = 0.0f;
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  const uint8x16_t m4 = vdupq_n_u8(0x0F), b4 = vdupq_n_u8(0x10);
  for (int64_t b = 0; b < nb; b++) {
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    for (int j = 0; j < NT; j++) {
      const uint8_t* p = w + j * row_bytes + b * kBB<QT>;
      uint32_t u[3];
      memcpy(u, p + 4, 12);
      const uint32_t s03 = u[0] & 0x3f3f3f3fu, m03 = u[1] & 0x3f3f3f3fu;
      const uint32_t s47 = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
      const uint32_t m47 = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
      const uint16x8_t sc16 = vmovl_u8(vcreate_u8((uint64_t)s03 | ((uint64_t)s47 << 32)));
      const int16x8_t mn16 = vreinterpretq_s16_u16(vmovl_u8(vcreate_u8((uint64_t)m03 | ((uint64_t)m47 << 32))));
      const int32x4_t sc_lo = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(sc16)));
      const int32x4_t sc_hi = vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(sc16)));
      const float D = WB_HALF(p), Dm = WB_HALF(p + 2);
      const uint8_t* ql = p + (QT == Q4_K ? 16 : 48);
      uint8x16_t h0, h1;
      if (QT == Q5_K) {
        h0 = vld1q_u8(p + 16);
        h1 = vld1q_u8(p + 32);
      }
      int32x4_t isum[MT];
      for (int r = 0; r < MT; r++) isum[r] = vdupq_n_s32(0);
      for (int c = 0; c < 4; c++) {
        const uint8x16_t v0 = vld1q_u8(ql + 32 * c), v1 = vld1q_u8(ql + 32 * c + 16);
        uint8x16_t q0 = vandq_u8(v0, m4), q1 = vandq_u8(v1, m4), q2 = vshrq_n_u8(v0, 4), q3 = vshrq_n_u8(v1, 4);
        if (QT == Q5_K) {  // bit 2c (2c + 1) of qh[t]: bit 4 of value 64c + t's (64c + 32 + t's) code
          const int8x16_t s0 = vdupq_n_s8((int8_t)(4 - 2 * c)), s1 = vdupq_n_s8((int8_t)(3 - 2 * c));
          q0 = vorrq_u8(q0, vandq_u8(vshlq_u8(h0, s0), b4));
          q1 = vorrq_u8(q1, vandq_u8(vshlq_u8(h1, s0), b4));
          q2 = vorrq_u8(q2, vandq_u8(vshlq_u8(h0, s1), b4));
          q3 = vorrq_u8(q3, vandq_u8(vshlq_u8(h1, s1), b4));
        }
        for (int r = 0; r < MT; r++) {
          const int8_t* x = a.q + (m + r) * a.ldq + b * 256 + 64 * c;
          const int32x4_t d0 = vdotq_s32(vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(q0), vld1q_s8(x)),
                                         vreinterpretq_s8_u8(q1), vld1q_s8(x + 16));
          const int32x4_t d1 = vdotq_s32(vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(q2), vld1q_s8(x + 32)),
                                         vreinterpretq_s8_u8(q3), vld1q_s8(x + 48));
          // scales 2c and 2c + 1: lanes of sc_lo (c < 2) or sc_hi
          switch (c) {
            case 0: isum[r] = vmlaq_laneq_s32(vmlaq_laneq_s32(isum[r], d0, sc_lo, 0), d1, sc_lo, 1); break;
            case 1: isum[r] = vmlaq_laneq_s32(vmlaq_laneq_s32(isum[r], d0, sc_lo, 2), d1, sc_lo, 3); break;
            case 2: isum[r] = vmlaq_laneq_s32(vmlaq_laneq_s32(isum[r], d0, sc_hi, 0), d1, sc_hi, 1); break;
            default: isum[r] = vmlaq_laneq_s32(vmlaq_laneq_s32(isum[r], d0, sc_hi, 2), d1, sc_hi, 3); break;
          }
        }
      }
      for (int r = 0; r < MT; r++) {
        const int64_t ab = (m + r) * a.ldb + b;
        const int16x8_t bs = vld1q_s16(a.bsums32 + ab * 8);
        const int imin = vaddvq_s32(vmlal_high_s16(vmull_s16(vget_low_s16(mn16), vget_low_s16(bs)), mn16, bs));
        const float dx = a.d[ab];
        acc[r][j] += dx * (D * (float)vaddvq_s32(isum[r]) - Dm * (float)imin);
      }
    }
  }
  for (int r = 0; r < MT; r++)
    for (int j = 0; j < NT; j++) out[(m + r) * ldo + j] = acc[r][j];
}

// Q6_K: 128 values (64 low-nibble bytes, 32 bytes of high bits) a step; the int8 scale of each
// 16 values by vmlaq_laneq_s32; the offset 32 as 32 x sum_j sc_j bsums_j.
template <int QT, int MT, int NT>
void tile_k6(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  float acc[MT][NT];
  for (int r = 0; r < MT; r++)
    for (int j = 0; j < NT; j++) acc[r][j] = 0.0f;
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  const uint8x16_t m4 = vdupq_n_u8(0x0F), m30 = vdupq_n_u8(0x30);
  for (int64_t b = 0; b < nb; b++) {
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    for (int j = 0; j < NT; j++) {
      const uint8_t* p = w + j * row_bytes + b * kBB<QT>;
      const int8x16_t s8 = vld1q_s8((const int8_t*)(p + 192));
      const int16x8_t s16a = vmovl_s8(vget_low_s8(s8)), s16b = vmovl_high_s8(s8);
      int32x4_t sc[4] = {vmovl_s16(vget_low_s16(s16a)), vmovl_high_s16(s16a), vmovl_s16(vget_low_s16(s16b)),
                         vmovl_high_s16(s16b)};
      const float D = WB_HALF(p + 208);
      int32x4_t isum[MT];
      for (int r = 0; r < MT; r++) isum[r] = vdupq_n_s32(0);
      for (int h = 0; h < 2; h++) {
        const uint8_t* ql = p + 64 * h;
        const uint8x16_t l0 = vld1q_u8(ql), l1 = vld1q_u8(ql + 16), l2 = vld1q_u8(ql + 32), l3 = vld1q_u8(ql + 48);
        const uint8x16_t qh0 = vld1q_u8(p + 128 + 32 * h), qh1 = vld1q_u8(p + 128 + 32 * h + 16);
        int8x16_t q[8];  // values 128h + 16i
        q[0] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(l0, m4), vandq_u8(vshlq_n_u8(qh0, 4), m30)));
        q[1] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(l1, m4), vandq_u8(vshlq_n_u8(qh1, 4), m30)));
        q[2] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(l2, m4), vandq_u8(vshlq_n_u8(qh0, 2), m30)));
        q[3] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(l3, m4), vandq_u8(vshlq_n_u8(qh1, 2), m30)));
        q[4] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(l0, 4), vandq_u8(qh0, m30)));
        q[5] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(l1, 4), vandq_u8(qh1, m30)));
        q[6] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(l2, 4), vandq_u8(vshrq_n_u8(qh0, 2), m30)));
        q[7] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(l3, 4), vandq_u8(vshrq_n_u8(qh1, 2), m30)));
        const int32x4_t sa = sc[2 * h], sb = sc[2 * h + 1];  // scales 8h..8h+3, 8h+4..8h+7
        for (int r = 0; r < MT; r++) {
          const int8_t* x = a.q + (m + r) * a.ldq + b * 256 + 128 * h;
          int32x4_t t = isum[r];
          t = vmlaq_laneq_s32(t, vdotq_s32(vdupq_n_s32(0), q[0], vld1q_s8(x)), sa, 0);
          t = vmlaq_laneq_s32(t, vdotq_s32(vdupq_n_s32(0), q[1], vld1q_s8(x + 16)), sa, 1);
          t = vmlaq_laneq_s32(t, vdotq_s32(vdupq_n_s32(0), q[2], vld1q_s8(x + 32)), sa, 2);
          t = vmlaq_laneq_s32(t, vdotq_s32(vdupq_n_s32(0), q[3], vld1q_s8(x + 48)), sa, 3);
          t = vmlaq_laneq_s32(t, vdotq_s32(vdupq_n_s32(0), q[4], vld1q_s8(x + 64)), sb, 0);
          t = vmlaq_laneq_s32(t, vdotq_s32(vdupq_n_s32(0), q[5], vld1q_s8(x + 80)), sb, 1);
          t = vmlaq_laneq_s32(t, vdotq_s32(vdupq_n_s32(0), q[6], vld1q_s8(x + 96)), sb, 2);
          t = vmlaq_laneq_s32(t, vdotq_s32(vdupq_n_s32(0), q[7], vld1q_s8(x + 112)), sb, 3);
          isum[r] = t;
        }
      }
      for (int r = 0; r < MT; r++) {
        const int64_t ab = (m + r) * a.ldb + b;
        const int16x8_t bs0 = vld1q_s16(a.bsums + ab * 16), bs1 = vld1q_s16(a.bsums + ab * 16 + 8);
        int32x4_t mm = vmull_s16(vget_low_s16(s16a), vget_low_s16(bs0));
        mm = vmlal_high_s16(mm, s16a, bs0);
        mm = vmlal_s16(mm, vget_low_s16(s16b), vget_low_s16(bs1));
        mm = vmlal_high_s16(mm, s16b, bs1);
        const int imin = 32 * vaddvq_s32(mm);
        const float dx = a.d[ab];
        acc[r][j] += dx * (D * (float)vaddvq_s32(isum[r]) - D * (float)imin);
      }
    }
  }
  for (int r = 0; r < MT; r++)
    for (int j = 0; j < NT; j++) out[(m + r) * ldo + j] = acc[r][j];
}

// i8mm, every K-quant: 2 weight rows x 2 activation rows a vmmlaq_s32, lanes (j, r), (j, r + 1),
// (j + 1, r), (j + 1, r + 1); each pair's codes decoded into a buffer (codes256) and its scales by
// qblocks.inc once a block for the MT activation rows; the sub-block scale of each 16 values by
// vmlaq_s32 with the pair's [sc_j, sc_j, sc_j+1, sc_j+1]; the float steps the generic level's.
template <int QT, int MT, int NT>
void tile_k_mm(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out,
               int64_t ldo) {
  static_assert(MT % 2 == 0 && NT % 2 == 0, "pairs of rows");
  float32x4_t acc[MT / 2][NT / 2];
  for (int r = 0; r < MT / 2; r++)
    for (int j = 0; j < NT / 2; j++) acc[r][j] = vdupq_n_f32(0.0f);
  const int64_t pf = prefetch_distance<QT>(NT * row_bytes);
  alignas(16) uint8_t q[2][256];
  for (int64_t b = 0; b < nb; b++) {
    prefetch_tile_share(w, NT * row_bytes, nb, b, pf);
    for (int j = 0; j < NT; j += 2) {
      KScales k[2];
      for (int t = 0; t < 2; t++) {
        const uint8_t* p = w + (j + t) * row_bytes + b * kBB<QT>;
        decode_kscales(QT, p, k[t]);
        codes256<QT>(p, q[t]);
      }
      int32x4_t sc[16];  // [sc_j, sc_j, sc_j+1, sc_j+1] of each 16 values
      for (int i = 0; i < 16; i++) sc[i] = (int32x4_t){k[0].sc[i], k[0].sc[i], k[1].sc[i], k[1].sc[i]};
      const float32x4_t D = {k[0].D, k[0].D, k[1].D, k[1].D}, Dm = {k[0].Dm, k[0].Dm, k[1].Dm, k[1].Dm};
      for (int r = 0; r < MT; r += 2) {
        const int8_t* x0 = a.q + (m + r) * a.ldq + b * 256;
        const int8_t* x1 = x0 + a.ldq;
        int32x4_t isum = vdupq_n_s32(0);
        for (int i = 0; i < 16; i++) {
          const int64x2_t w0 = vreinterpretq_s64_u8(vld1q_u8(q[0] + 16 * i)), w1 = vreinterpretq_s64_u8(vld1q_u8(q[1] + 16 * i));
          const int64x2_t y0 = vreinterpretq_s64_s8(vld1q_s8(x0 + 16 * i)), y1 = vreinterpretq_s64_s8(vld1q_s8(x1 + 16 * i));
          int32x4_t d = vmmlaq_s32(vdupq_n_s32(0), vreinterpretq_s8_s64(vzip1q_s64(w0, w1)),
                                   vreinterpretq_s8_s64(vzip1q_s64(y0, y1)));
          d = vmmlaq_s32(d, vreinterpretq_s8_s64(vzip2q_s64(w0, w1)), vreinterpretq_s8_s64(vzip2q_s64(y0, y1)));
          isum = vmlaq_s32(isum, d, sc[i]);
        }
        const int64_t ab = (m + r) * a.ldb + b;
        int imin[2][2];  // [weight row][activation row]: sum of mn x bsums, the generic level's integers
        for (int t = 0; t < 2; t++)
          for (int u = 0; u < 2; u++) {
            const int16_t* bs = a.bsums + (ab + u * a.ldb) * 16;
            const int16x8_t mn0 = vld1q_s16(k[t].mn), mn1 = vld1q_s16(k[t].mn + 8);
            const int16x8_t b0 = vld1q_s16(bs), b1 = vld1q_s16(bs + 8);
            int32x4_t mm = vmull_s16(vget_low_s16(mn0), vget_low_s16(b0));
            mm = vmlal_high_s16(mm, mn0, b0);
            mm = vmlal_s16(mm, vget_low_s16(mn1), vget_low_s16(b1));
            imin[t][u] = vaddvq_s32(vmlal_high_s16(mm, mn1, b1));
          }
        const int32x4_t im = {imin[0][0], imin[0][1], imin[1][0], imin[1][1]};
        const float32x4_t dx = {a.d[ab], a.d[ab + a.ldb], a.d[ab], a.d[ab + a.ldb]};
        const float32x4_t t = vmulq_f32(dx, vsubq_f32(vmulq_f32(D, vcvtq_f32_s32(isum)), vmulq_f32(Dm, vcvtq_f32_s32(im))));
        acc[r / 2][j / 2] = vaddq_f32(acc[r / 2][j / 2], t);
      }
    }
  }
  for (int r = 0; r < MT / 2; r++)
    for (int j = 0; j < NT / 2; j++) {
      float v[4];
      vst1q_f32(v, acc[r][j]);
      out[(m + 2 * r) * ldo + 2 * j] = v[0];
      out[(m + 2 * r + 1) * ldo + 2 * j] = v[1];
      out[(m + 2 * r) * ldo + 2 * j + 1] = v[2];
      out[(m + 2 * r + 1) * ldo + 2 * j + 1] = v[3];
    }
}

template <int QT, int MT, int NT>
void tile_k(const uint8_t* w, int64_t row_bytes, int64_t nb, const ActQ8& a, int64_t m, float* out, int64_t ldo) {
  if constexpr (MT % 2 == 0 && NT % 2 == 0) {
    if (g_i8mm) return tile_k_mm<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
  }
  if constexpr (QT == Q4_K || QT == Q5_K) tile_k45<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
  else if constexpr (QT == Q6_K) tile_k6<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
  else tile_k23<QT, MT, NT>(w, row_bytes, nb, a, m, out, ldo);
}

// Register budget (32 NEON registers): 4 activation rows a tile; in calls of several rows 4 weight
// rows a tile by default for 32-blocks (the lanes of their float steps), 2 for K-quants (a pair for
// the i8mm tiles); at batch 1 4 weight rows. Untuned: no ARM host has timed them (kernels/tuning.py
// would, on one).
constexpr int MT_B32 = 4, NT_B32 = 4, MT_K = 4, NT_K = 2, NT_M1 = 4, NT_M1_LONG = 4, ONE_PASS_ROWS = 0;
template <int QT> constexpr bool kHas = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == Q8_0 ||
                                        QT == Q2_K || QT == Q3_K || QT == Q4_K || QT == Q5_K || QT == Q6_K;
#include "tile_driver.inc"

const Kernels kTable = {quantize32, quantize256, matmul, has, set_knob, knob, nullptr};

}  // namespace
}  // namespace wb

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

extern "C" const wb::Kernels* wb_kernels_arm() { return &wb::kTable; }

extern "C" int wb_arm_features() {
  int f = 0;
#if defined(__linux__)
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
  if (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) f |= WB_ARM_DOTPROD;
  if (getauxval(AT_HWCAP2) & HWCAP2_I8MM) f |= WB_ARM_I8MM;
#elif defined(__APPLE__)
  int v = 0;
  size_t n = sizeof v;
  if (sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &n, nullptr, 0) == 0 && v) f |= WB_ARM_DOTPROD;
  v = 0;
  n = sizeof v;
  if (sysctlbyname("hw.optional.arm.FEAT_I8MM", &v, &n, nullptr, 0) == 0 && v) f |= WB_ARM_I8MM;
#endif
  return f;
}

#else
extern "C" const wb::Kernels* wb_kernels_arm() { return nullptr; }
extern "C" int wb_arm_features() { return 0; }
#endif
