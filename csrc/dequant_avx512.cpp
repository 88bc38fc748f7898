// Weight rows of GGUF blocks decoded to bfloat16, for the dense prefill path (ops.cpp,
// qmatmul_dense): on a CPU with AMX, a bfloat16 matmul of a decoded tile beats the integer tiles of
// kernels_avx512.cpp by several times once a call has a few dozen activation rows, and decoding
// costs once per call whatever the rows. Q4_K, Q6_K, Q8_0 and Q4_0/Q4_1 (the formats of the real
// models) are decoded 32 values at a time; the other formats through qblocks.inc's scalar decoding.
// Needs AVX-512 F/BW/VL with BF16 (every CPU with AMX has it). Values are those of gguf's
// dequantization, rounded to the nearest bfloat16 (ties to even). No torch header; internal linkage.
#include "qkernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <string.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace wb {
namespace {

inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#define WB_HALF(p) half_f16c(p)
#include "qblocks.inc"

// 32 codes (u8 in a ymm) times `scale` plus `bias`, 16 and 16 with their own scale/bias, stored as
// 32 bfloat16.
inline void store32(uint16_t* out, __m256i codes, __m512 s0, __m512 b0, __m512 s1, __m512 b1) {
  const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes))), s0, b0);
  const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1))), s1, b1);
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Signed codes (Q8_0): 16 and 16 from two xmm loads, one scale.
inline void store32s(uint16_t* out, __m128i a, __m128i b, __m512 s) {
  const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), s);
  const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s);
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

void row_q4k(const uint8_t* b, int64_t nb, uint16_t* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t i = 0; i < nb; i++, b += 144, out += 256) {
    uint8_t sc[8], mn[8];
    k4_scale_min(b + 4, sc, mn);
    const float D = WB_HALF(b), Dm = WB_HALF(b + 2);
    for (int j = 0; j < 4; j++) {
      const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 16 + 32 * j));
      const __m512 s0 = _mm512_set1_ps(D * sc[2 * j]), b0 = _mm512_set1_ps(-Dm * mn[2 * j]);
      const __m512 s1 = _mm512_set1_ps(D * sc[2 * j + 1]), b1 = _mm512_set1_ps(-Dm * mn[2 * j + 1]);
      store32(out + 64 * j, _mm256_and_si256(q, m4), s0, b0, s0, b0);
      store32(out + 64 * j + 32, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4), s1, b1, s1, b1);
    }
  }
}

void row_q6k(const uint8_t* b, int64_t nb, uint16_t* out) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
  for (int64_t i = 0; i < nb; i++, b += 210, out += 256) {
    const float D = WB_HALF(b + 208);
    const int8_t* sc = (const int8_t*)(b + 192);
    for (int h = 0; h < 2; h++) {
      const __m256i ql0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
      const __m256i lows[4] = {_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4),
                               _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4)};
      for (int g = 0; g < 4; g++) {  // values 128 h + 32 g ..: low nibbles | 2 high bits << 4, minus 32
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), m2);
        const __m256i q = _mm256_or_si256(lows[g], _mm256_slli_epi16(hi, 4));
        const int e = 128 * h + 32 * g;
        const float d0 = D * sc[e / 16], d1 = D * sc[e / 16 + 1];
        store32(out + e, q, _mm512_set1_ps(d0), _mm512_set1_ps(-32 * d0), _mm512_set1_ps(d1),
                _mm512_set1_ps(-32 * d1));
      }
    }
  }
}

// 32-block formats in the kernels' row layout (qblocks.inc): d of every block, (m of every block),
// then the codes in groups of 4 blocks.
void row_q8_0(const uint8_t* row, int64_t nb, uint16_t* out) {
  const uint8_t* codes = row + 2 * nb;
  for (int64_t g = 0; g * 4 < nb; g++) {
    const int64_t G = nb - 4 * g < 4 ? nb - 4 * g : 4;
    const uint8_t* p = codes + 4 * g * 32;
    for (int64_t i = 0; i < G; i++) {
      const int64_t blk = 4 * g + i;
      store32s(out + 32 * blk, _mm_loadu_si128((const __m128i*)(p + 16 * i)),
               _mm_loadu_si128((const __m128i*)(p + 16 * G + 16 * i)), _mm512_set1_ps(WB_HALF(row + 2 * blk)));
    }
  }
}

void row_q4_01(int qt, const uint8_t* row, int64_t nb, uint16_t* out) {
  const int sb = qt == Q4_1 ? 4 : 2;
  const uint8_t* codes = row + sb * nb;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  for (int64_t blk = 0; blk < nb; blk++) {
    const float d = WB_HALF(row + 2 * blk);
    const float c = qt == Q4_1 ? WB_HALF(row + 2 * nb + 2 * blk) : -8.0f * d;
    const __m128i q = _mm_loadu_si128((const __m128i*)(codes + 16 * blk));  // groups of 4 keep block order
    const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    const __m512 s = _mm512_set1_ps(d), o = _mm512_set1_ps(c);
    store32(out + 32 * blk, both, s, o, s, o);
  }
}

// Any other format: qblocks.inc's scalar decoding, then 16 values a conversion.
void row_scalar(int qt, const uint8_t* row, int64_t nb, uint16_t* out) {
  alignas(64) float f[256];
  if (block_size_of(qt) == 256) {
    const int bb = block_bytes_of(qt);
    for (int64_t i = 0; i < nb; i++) {
      const uint8_t* b = row + i * bb;
      KScales k;
      uint8_t q[256];
      decode_kscales(qt, b, k);
      decode_kcodes(qt, b, q);
      for (int e = 0; e < 256; e++) f[e] = k.D * k.sc[e / 16] * q[e] - k.Dm * k.mn[e / 16];
      for (int e = 0; e < 256; e += 32)
        _mm512_storeu_si512(out + 256 * i + e, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(f + e + 16), _mm512_load_ps(f + e)));
    }
  } else {
    for (int64_t blk = 0; blk < nb; blk++) {
      int8_t q[32];
      float d, c;
      decode_b32(qt, row, nb, blk, q, d, c);
      for (int t = 0; t < 32; t++) f[t] = qt == Q8_0 ? d * q[t] : d * (uint8_t)q[t] + c;
      _mm512_storeu_si512(out + 32 * blk, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(f + 16), _mm512_load_ps(f)));
    }
  }
}

}  // namespace
}  // namespace wb

// out[(n - n0) * ldo + k] = W[n, k] as bfloat16 bits, rows [n0, n1). False for an unknown qtype.
extern "C" bool wb_dequant_bf16_avx512(int qt, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                                       int64_t K, uint16_t* out, int64_t ldo) {
  using namespace wb;
  const int bs = block_size_of(qt);
  if (!bs) return false;
  const int64_t nb = K / bs;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    uint16_t* o = out + (n - n0) * ldo;
    switch (qt) {
      case Q4_K: row_q4k(row, nb, o); break;
      case Q6_K: row_q6k(row, nb, o); break;
      case Q8_0: row_q8_0(row, nb, o); break;
      case Q4_0: case Q4_1: row_q4_01(qt, row, nb, o); break;
      default: row_scalar(qt, row, nb, o); break;
    }
  }
  return true;
}

#pragma GCC pop_options

#else
extern "C" bool wb_dequant_bf16_avx512(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, uint16_t*, int64_t) {
  return false;
}
#endif
