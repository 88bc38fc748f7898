// A measured prototype of issue 49's prefill tile, not part of the engine: a Q8_0 GEMM over weights
// interleaved by block, ROWS weight rows a group (16: AVX-512 VNNI, one vpdpbusd makes 16 rows' dot
// of 4 values; 8: AVX2, maddubs on |w| and sign(x, w), then madd). A block's int32 sums are scaled once
// per group (d_w of its rows in one register, d_x broadcast) and nothing is summed horizontally, where
// the engine's integer tiles (csrc/kernels_avx512.cpp, kernels_avx2.cpp) scale per pair of rows.
// Layout per group and block b: ROWS float scales, then for k4 = 0..7 the group's 4 codes a row
// (+128, unsigned, for vpdpbusd at 16 rows; signed at 8). Activations as the engine quantizes them:
// Q8_0 codes, d, and -128 d sum(codes) (the offset of the shifted codes).
//
// Built and run by benchmarks/prototypes/interleaved_gemm.py, which times the engine's tiles beside
// it; prints one JSON line: the variant, shape, threads, median ms, GOP/s and the largest error
// against a float64 reference, relative to the product's scale.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <chrono>
#include <vector>
#include <algorithm>

struct Packed { int64_t N, K, nb; std::vector<uint8_t> bytes; };
#ifndef ROWS
#define ROWS 16
#endif
static const int64_t GB = 4 * ROWS + 32 * ROWS;  // bytes per (group, block)

Packed pack(const int8_t* q, const float* d, int64_t N, int64_t K) {
  Packed p{N, K, K / 32, {}};
  p.bytes.resize((N / ROWS) * p.nb * GB);
  for (int64_t g = 0; g < N / ROWS; g++)
    for (int64_t b = 0; b < p.nb; b++) {
      uint8_t* o = p.bytes.data() + (g * p.nb + b) * GB;
      for (int r = 0; r < ROWS; r++) memcpy(o + 4 * r, &d[(g * ROWS + r) * p.nb + b], 4);
      for (int k4 = 0; k4 < 8; k4++)
        for (int r = 0; r < ROWS; r++)
          for (int j = 0; j < 4; j++)
            o[4 * ROWS + k4 * 4 * ROWS + r * 4 + j] = (uint8_t)(q[(g * ROWS + r) * K + b * 32 + k4 * 4 + j] + (ROWS == 16 ? 128 : 0));
    }
  return p;
}

template <int MT, int NG>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
inline void tile(const Packed& w, int64_t g0, const int8_t* xq, const float* xd, const float* xs, int64_t m0,
                 float* y, int64_t ldy) {
  const int64_t nb = w.nb, K = w.K;
  __m512 acc[MT][NG];
  for (int i = 0; i < MT; i++) for (int g = 0; g < NG; g++) acc[i][g] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    __m512i is[MT][NG];
    for (int i = 0; i < MT; i++) for (int g = 0; g < NG; g++) is[i][g] = _mm512_setzero_si512();
    const uint8_t* wb[NG];
    for (int g = 0; g < NG; g++) wb[g] = w.bytes.data() + ((g0 + g) * nb + b) * GB;
#pragma GCC unroll 8
    for (int k4 = 0; k4 < 8; k4++) {
      __m512i W[NG];
      for (int g = 0; g < NG; g++) W[g] = _mm512_loadu_si512(wb[g] + 64 + 64 * k4);
#pragma GCC unroll 8
      for (int i = 0; i < MT; i++) {
        int32_t xv;
        memcpy(&xv, xq + (m0 + i) * K + b * 32 + 4 * k4, 4);
        const __m512i X = _mm512_set1_epi32(xv);
        for (int g = 0; g < NG; g++) is[i][g] = _mm512_dpbusd_epi32(is[i][g], W[g], X);
      }
    }
    for (int i = 0; i < MT; i++) {
      const __m512 dx = _mm512_set1_ps(xd[(m0 + i) * nb + b]), sx = _mm512_set1_ps(xs[(m0 + i) * nb + b]);
      for (int g = 0; g < NG; g++) {
        const __m512 dw = _mm512_loadu_ps((const float*)wb[g]);
        acc[i][g] = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i][g]), dx, sx), dw, acc[i][g]);
      }
    }
  }
  for (int i = 0; i < MT; i++) for (int g = 0; g < NG; g++) _mm512_storeu_ps(y + (m0 + i) * ldy + (g0 + g) * 16, acc[i][g]);
}

template <int MT, int NG>
__attribute__((target("avx2,fma")))
inline void tile2(const Packed& w, int64_t g0, const int8_t* xq, const float* xd, const float* xs, int64_t m0,
                  float* y, int64_t ldy) {
  const int64_t nb = w.nb, K = w.K;
  __m256 acc[MT][NG];
  const __m256i ones = _mm256_set1_epi16(1);
  for (int i = 0; i < MT; i++) for (int g = 0; g < NG; g++) acc[i][g] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    __m256i is[MT][NG];
    for (int i = 0; i < MT; i++) for (int g = 0; g < NG; g++) is[i][g] = _mm256_setzero_si256();
    const uint8_t* wb[NG];
    for (int g = 0; g < NG; g++) wb[g] = w.bytes.data() + ((g0 + g) * nb + b) * GB;
#pragma GCC unroll 8
    for (int k4 = 0; k4 < 8; k4++) {
      __m256i W[NG], A[NG];
      for (int g = 0; g < NG; g++) {
        W[g] = _mm256_loadu_si256((const __m256i*)(wb[g] + 32 + 32 * k4));
        A[g] = _mm256_sign_epi8(W[g], W[g]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MT; i++) {
        int32_t xv;
        memcpy(&xv, xq + (m0 + i) * K + b * 32 + 4 * k4, 4);
        const __m256i X = _mm256_set1_epi32(xv);
        for (int g = 0; g < NG; g++)
          is[i][g] = _mm256_add_epi32(is[i][g], _mm256_madd_epi16(_mm256_maddubs_epi16(A[g], _mm256_sign_epi8(X, W[g])), ones));
      }
    }
    for (int i = 0; i < MT; i++) {
      const __m256 dx = _mm256_set1_ps(xd[(m0 + i) * nb + b]);
      for (int g = 0; g < NG; g++) {
        const __m256 dw = _mm256_loadu_ps((const float*)wb[g]);
        acc[i][g] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(is[i][g]), dx), dw, acc[i][g]);
      }
    }
  }
  for (int i = 0; i < MT; i++) for (int g = 0; g < NG; g++) _mm256_storeu_ps(y + (m0 + i) * ldy + (g0 + g) * 8, acc[i][g]);
}

template <int MT, int NG>
void gemm(const Packed& w, const int8_t* xq, const float* xd, const float* xs, int64_t M, float* y, int threads) {
  const int64_t groups = w.N / ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t g = 0; g < groups; g += NG)
    for (int64_t m = 0; m < M; m += MT) {
      if constexpr (ROWS == 16) tile<MT, NG>(w, g, xq, xd, xs, m, y, w.N);
      else tile2<MT, NG>(w, g, xq, xd, xs, m, y, w.N);
    }
}

int main(int argc, char** argv) {
  const int64_t M = argc > 1 ? atoll(argv[1]) : 512, N = argc > 2 ? atoll(argv[2]) : 1536, K = argc > 3 ? atoll(argv[3]) : 1536;
  const int threads = argc > 4 ? atoi(argv[4]) : 2;
  const int64_t nb = K / 32;
  std::vector<int8_t> wq(N * K), xq(M * K);
  std::vector<float> wd(N * nb), xd(M * nb), xs(M * nb);
  srand(1);
  for (auto& v : wq) v = (int8_t)(rand() % 255 - 127);
  for (auto& v : xq) v = (int8_t)(rand() % 255 - 127);
  for (auto& v : wd) v = 0.001f * (1 + rand() % 100);
  for (auto& v : xd) v = 0.01f * (1 + rand() % 100);
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < nb; b++) {
      int s = 0;
      for (int k = 0; k < 32; k++) s += xq[m * K + b * 32 + k];
      xs[m * nb + b] = -128.0f * xd[m * nb + b] * s;
    }
  Packed p = pack(wq.data(), wd.data(), N, K);
  std::vector<float> y(M * N);
  const char* v = argc > 5 ? argv[5] : "4x2";
  auto run = [&] {
    if (!strcmp(v, "4x2")) gemm<4, 2>(p, xq.data(), xd.data(), xs.data(), M, y.data(), threads);
    else if (!strcmp(v, "8x1")) gemm<8, 1>(p, xq.data(), xd.data(), xs.data(), M, y.data(), threads);
    else if (!strcmp(v, "4x3")) gemm<4, 3>(p, xq.data(), xd.data(), xs.data(), M, y.data(), threads);
    else if (!strcmp(v, "2x4")) gemm<2, 4>(p, xq.data(), xd.data(), xs.data(), M, y.data(), threads);
    else if (!strcmp(v, "8x2")) gemm<8, 2>(p, xq.data(), xd.data(), xs.data(), M, y.data(), threads);
    else if (!strcmp(v, "4x4")) gemm<4, 4>(p, xq.data(), xd.data(), xs.data(), M, y.data(), threads);
  };
  run();
  double maxrel = 0;
  for (int64_t m = 0; m < M; m += 37)
    for (int64_t n = 0; n < N; n += 13) {
      double ref = 0;
      for (int64_t b = 0; b < nb; b++) {
        int64_t s = 0;
        for (int k = 0; k < 32; k++) s += (int)wq[n * K + b * 32 + k] * xq[m * K + b * 32 + k];
        ref += (double)wd[n * nb + b] * xd[m * nb + b] * s;
      }
      double scale = 0;
      for (int64_t b = 0; b < nb; b++) scale += fabs(wd[n * nb + b] * xd[m * nb + b]) * 32 * 127 * 127 / 10;
      maxrel = std::max(maxrel, fabs(y[m * N + n] - ref) / scale);
    }
  std::vector<double> ts;
  for (int r = 0; r < 7; r++) {
    auto t0 = std::chrono::steady_clock::now();
    run();
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  printf("{\"variant\": \"%s\", \"rows_interleaved\": %d, \"M\": %ld, \"N\": %ld, \"K\": %ld, \"threads\": %d, "
         "\"ms\": %.4f, \"gops\": %.1f, \"max_rel_err\": %.3e}\n", v, ROWS, (long)M, (long)N, (long)K, threads,
         ts[3] * 1e3, 2.0 * M * N * K / ts[3] / 1e9, maxrel);
}
