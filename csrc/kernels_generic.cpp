// The portable level: plain C++, the same arithmetic as the SIMD levels (integer dot products of
// 8-bit activations with the stored codes, one float scale step per block).
#include <math.h>
#include <string.h>

#include "qkernels.h"

// No fused multiply-adds: the float steps round as written, on every CPU (GCC contracts a*b + c into
// one fmadd by default where the target has it, e.g. aarch64, and clang within an expression), so
// that this level's bits are the same on x86-64 and aarch64, and the arm level can match them.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__) && !defined(__x86_64__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace wb {
namespace {

#include "qblocks.inc"

// Round half to even without libm: valid for |v| < 2^22 (here |v| <= 127).
inline int rne(float v) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  const float t = v + magic;
  return (int)(t - magic);
}

void quantize_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int bs, int8_t* q, int64_t ldq,
                   float* d, float* s, int16_t* bsums, int16_t* bsums32, int64_t ldb) {
  for (int64_t m = m0; m < m1; m++) {
    const float* xr = x + m * ldx;
    for (int64_t b = 0; b < K / bs; b++) {
      const float* xb = xr + b * bs;
      float amax = 0.0f;
      for (int i = 0; i < bs; i++) amax = fmaxf(amax, fabsf(xb[i]));
      const float dd = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qb = q + m * ldq + b * bs;
      int sum = 0;
      for (int i = 0; i < bs; i++) {
        qb[i] = (int8_t)rne(xb[i] * id);
        sum += qb[i];
      }
      d[m * ldb + b] = dd;
      if (s) s[m * ldb + b] = dd * (float)sum;
      if (bsums) {
        for (int j = 0; j < bs / 16; j++) {
          int t = 0;
          for (int i = 0; i < 16; i++) t += qb[16 * j + i];
          bsums[(m * ldb + b) * 16 + j] = (int16_t)t;
        }
        for (int j = 0; j < bs / 32; j++)
          bsums32[(m * ldb + b) * 8 + j] = (int16_t)(bsums[(m * ldb + b) * 16 + 2 * j] + bsums[(m * ldb + b) * 16 + 2 * j + 1]);
      }
    }
  }
}

void quantize32(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int64_t ldq, float* d,
                float* s, int64_t ldb) {
  quantize_rows(x, ldx, m0, m1, K, 32, q, ldq, d, s, nullptr, nullptr, ldb);
}

void quantize256(const float* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, int8_t* q, int8_t*, int64_t ldq,
                 float* d, int16_t* bsums, int16_t* bsums32, int64_t ldb) {
  quantize_rows(x, ldx, m0, m1, K, 256, q, ldq, d, nullptr, bsums, bsums32, ldb);
}

void matmul_b32(int qt, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, const ActQ8& a,
                int64_t M, float* out, int64_t ldo) {
  const int64_t nb = K / 32;
  int8_t q[32];
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m = 0; m < M; m++) out[m * ldo + (n - n0)] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
      float d, c;
      decode_b32(qt, row, nb, b, q, d, c);
      for (int64_t m = 0; m < M; m++) {
        const int8_t* x = a.q + m * a.ldq + b * 32;
        int sum = 0;
        if (qt == Q8_0) {
          for (int i = 0; i < 32; i++) sum += (int)q[i] * x[i];
        } else {
          for (int i = 0; i < 32; i++) sum += (int)(uint8_t)q[i] * x[i];
        }
        float r = d * a.d[m * a.ldb + b] * (float)sum;
        if (qt != Q8_0) r += c * a.s[m * a.ldb + b];
        out[m * ldo + (n - n0)] += r;
      }
    }
  }
}

void matmul_k(int qt, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, const ActQ8& a,
              int64_t M, float* out, int64_t ldo) {
  const int64_t nb = K / 256, bb = block_bytes_of(qt);
  uint8_t q[256];
  KScales k;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m = 0; m < M; m++) out[m * ldo + (n - n0)] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
      decode_kscales(qt, row + b * bb, k);
      decode_kcodes(qt, row + b * bb, q);
      for (int64_t m = 0; m < M; m++) {
        const int8_t* x = a.q + m * a.ldq + b * 256;
        const int16_t* bs = a.bsums + (m * a.ldb + b) * 16;
        int isum = 0, imin = 0;
        for (int j = 0; j < 16; j++) {
          int t = 0;
          for (int i = 0; i < 16; i++) t += (int)q[16 * j + i] * x[16 * j + i];
          isum += k.sc[j] * t;
          imin += k.mn[j] * bs[j];
        }
        const float dx = a.d[m * a.ldb + b];
        out[m * ldo + (n - n0)] += dx * (k.D * (float)isum - k.Dm * (float)imin);
      }
    }
  }
}

bool matmul(int qt, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t K, const ActQ8* a,
            int64_t M, float* out, int64_t ldo) {
  const int bs = block_size_of(qt);
  if (bs == 32) {
    matmul_b32(qt, w, row_bytes, n0, n1, K, *a, M, out, ldo);
  } else if (bs == 256) {
    matmul_k(qt, w, row_bytes, n0, n1, K, *a, M, out, ldo);
  } else {
    return false;
  }
  return true;
}

bool has(int qt) { return block_size_of(qt) != 0; }  // every format of the table

bool set_knob(int, int, int) { return false; }  // one loop per format, no tiles to tune
int knob(int, int) { return 0; }

const Kernels kTable = {quantize32, quantize256, matmul, has, set_knob, knob, nullptr};

}  // namespace
}  // namespace wb

extern "C" const wb::Kernels* wb_kernels_generic() { return &wb::kTable; }
