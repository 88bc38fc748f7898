// The kernel harness: the matmul kernels of csrc/ (which include no torch header) built into a
// plain binary with its own main, so they can be checked where no torch runs, e.g. an aarch64
// build under qemu-aarch64-static (`make test-arm`), as well as natively (tests/test_kernel_harness.py).
//
// For every kernel level this CPU runs, every format of the table (csrc/qformats.h):
//  1. against the portable level, on random rows of many lengths (each kind of short group and
//     long rows past kLongRowK), 1..9, 16 and 17 activation rows, a row range not starting at 0,
//     and every value of every tuning knob (every tile shape a call can take):
//       levels that claim it (arm) bit for bit, and their quantized activations byte for byte;
//       the others (avx2, avx512: their float sums run in another order) within the bound below,
//       and bit for bit equal to their own default tiles whatever the knobs (batch invariance);
//  2. against dequantized values made by the `gguf` package (make_data.py, --data DIR): every
//     level within the bound of tests/test_kernels.py: activations rounded to 8 bits per block
//     move each output by at most sum_b (d_x,b / 2) sum|w_b|, plus 2^-17 sum|w||x| of float steps.
//
//  3. paged attention, the portable kernel (every level's on aarch64), against float64;
//  4. with --dump FILE, the generic level's quantized activations and matmul outputs on the gguf
//     data, which run.sh compares between the x86-64 and the aarch64 build: the same bytes.
//
//   harness [--data DIR] [--level NAME] [--dump FILE]   exit 0: all passed
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>
#include <vector>

#include "attention.h"
#include "qkernels.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

namespace {

struct Format {
  const char* name;
  int qt, bs, bb, halves;
  std::vector<int> fields;  // code fields of a 32-block in the row layout's group order
};

std::vector<Format> formats() {
  std::vector<Format> out;
#define WB_ROW(name, qt, bs, bb, halves, offset, spans)                        \
  {                                                                            \
    Format f{#name, qt, bs, bb, halves, {}};                                   \
    for (const char* p = spans; *p;) {                                         \
      f.fields.push_back(atoi(p));                                             \
      while (*p && *p != ',') p++;                                             \
      if (*p) p++;                                                             \
    }                                                                          \
    out.push_back(f);                                                          \
  }
  WB_FORMATS(WB_ROW)
#undef WB_ROW
  return out;
}

// ---- data -------------------------------------------------------------------------------------
uint64_t g_rng = 0x9E3779B97F4A7C15ull;
uint64_t next_u64() {  // xorshift64*
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return g_rng * 2685821657736338717ull;
}
double uniform() { return (double)(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
// About standard normal (the sum of 12 uniforms, less 6), without libm: the data is then the same
// bits on every architecture (x86-64's and aarch64's glibc differ in the last bits of log and cos).
float normal() {
  double t = -6.0;
  for (int i = 0; i < 12; i++) t += uniform();
  return (float)t;
}

uint16_t to_half(float f) {  // round to nearest even, normal range (|f| in [2^-14, 65504]) or zero
  uint32_t b;
  memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int exp = (int)((b >> 23) & 0xff) - 127 + 15;
  if (exp <= 0) return (uint16_t)sign;
  uint32_t mant = b & 0x7fffffu, h = ((uint32_t)exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;
  return (uint16_t)(sign | h);
}

// Where a block's float16 scale fields sit (file order), as in make_data.py.
std::vector<int> half_fields(int qt) {
  switch (qt) {
    case wb::Q4_1: case wb::Q5_1: case wb::Q4_K: case wb::Q5_K: return {0, 2};
    case wb::Q2_K: return {80, 82};
    case wb::Q3_K: return {108};
    case wb::Q6_K: return {208};
    default: return {0};
  }
}

// n rows of random blocks in file order: random codes, float16 scales of sane size, both signs.
std::vector<uint8_t> random_rows(const Format& f, int64_t n, int64_t K) {
  const int64_t nb = K / f.bs;
  std::vector<uint8_t> raw(n * nb * f.bb);
  for (auto& b : raw) b = (uint8_t)(next_u64() >> 56);
  for (int64_t blk = 0; blk < n * nb; blk++)
    for (int off : half_fields(f.qt)) {
      const uint16_t h = to_half(normal() * 0.02f);
      memcpy(&raw[blk * f.bb + off], &h, 2);
    }
  return raw;
}

// File order -> the kernels' row layout (csrc/qblocks.inc; kernels.pack_rows in Python).
std::vector<uint8_t> pack_rows(const Format& f, const std::vector<uint8_t>& raw, int64_t n, int64_t K) {
  if (f.bs != 32) return raw;
  const int64_t nb = K / 32, rb = nb * f.bb;
  std::vector<uint8_t> out(raw.size());
  for (int64_t r = 0; r < n; r++) {
    const uint8_t* src = &raw[r * rb];
    uint8_t* dst = &out[r * rb];
    int64_t at = 0;
    for (int h = 0; h < f.halves; h++)
      for (int64_t b = 0; b < nb; b++, at += 2) memcpy(dst + at, src + b * f.bb + 2 * h, 2);
    for (int64_t g = 0; g < nb; g += 4) {
      const int64_t G = nb - g < 4 ? nb - g : 4;
      int start = 2 * f.halves;
      for (int field : f.fields) {
        for (int64_t i = 0; i < G; i++, at += field) memcpy(dst + at, src + (g + i) * f.bb + start, field);
        start += field;
      }
    }
  }
  return out;
}

// ---- running a level as ops.cpp does ------------------------------------------------------------
int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

struct Acts {  // quantized activations laid out as ops.cpp lays them out (d and s zero-padded)
  std::vector<int8_t> q, qk;
  std::vector<float> d, s;
  std::vector<int16_t> bsums, bsums32;
  wb::ActQ8 a{};
};

void quantize(const wb::Kernels* k, int bs, const std::vector<float>& x, int64_t M, int64_t K, Acts& o) {
  const int64_t ldq = round_up(K, 64);
  o.q.assign(M * ldq + 64, 0);
  if (bs == 32) {
    const int64_t ldb = round_up(K / 32, 16);
    o.d.assign(M * ldb + 16, 0.0f);
    o.s.assign(M * ldb + 16, 0.0f);
    k->quantize32(x.data(), K, 0, M, K, o.q.data(), ldq, o.d.data(), o.s.data(), ldb);
    o.a = {o.q.data(), nullptr, o.d.data(), o.s.data(), nullptr, nullptr, ldq, ldb};
  } else {
    const int64_t ldb = K / 256;
    o.qk.assign(M * ldq + 64, 0);
    o.d.assign(M * ldb + 16, 0.0f);
    o.bsums.assign(M * ldb * 16 + 16, 0);
    o.bsums32.assign(M * ldb * 8 + 16, 0);
    k->quantize256(x.data(), K, 0, M, K, o.q.data(), o.qk.data(), ldq, o.d.data(), o.bsums.data(), o.bsums32.data(),
                   ldb);
    o.a = {o.q.data(), o.qk.data(), o.d.data(), nullptr, o.bsums.data(), o.bsums32.data(), ldq, ldb};
  }
}

// y [M, n1 - n0] = x @ W[n0:n1]^T at level k, or an empty vector where the level refuses.
std::vector<float> matmul(const wb::Kernels* k, const Format& f, const std::vector<uint8_t>& w, int64_t n0, int64_t n1,
                          int64_t K, const Acts& acts, int64_t M) {
  std::vector<float> y(M * (n1 - n0), NAN);
  if (!k->matmul(f.qt, w.data(), K / f.bs * f.bb, n0, n1, K, &acts.a, M, y.data(), n1 - n0)) return {};
  return y;
}

struct Level {
  const char* name;
  const wb::Kernels* k;
  bool exact;  // bit for bit the portable level's results
};

std::vector<Level> levels_here() {
  std::vector<Level> out = {{"generic", wb_kernels_generic(), true}};
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (wb_kernels_avx2() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    out.push_back({"avx2", wb_kernels_avx2(), false});
  if (wb_kernels_avx512() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    out.push_back({"avx512", wb_kernels_avx512(), false});
#endif
  if (wb_kernels_arm() && (wb_arm_features() & WB_ARM_DOTPROD)) out.push_back({"arm", wb_kernels_arm(), true});
  return out;
}

// ---- checks -----------------------------------------------------------------------------------
int g_failures = 0;
long g_checks = 0;

void fail(const char* fmt, const char* a, const char* b, const char* c) {
  if (g_failures++ < 20) {
    printf("FAIL ");
    printf(fmt, a, b, c);
    printf("\n");
  }
}

// The bound of tests/test_kernels.py for y [M, N] against exact float64 products with weights wd.
bool within_bound(const std::vector<float>& y, const std::vector<float>& x, const std::vector<double>& wd, int64_t M,
                  int64_t N, int64_t K, int bs, const std::vector<double>* ref, double* worst) {
  bool ok = true;
  for (int64_t m = 0; m < M; m++)
    for (int64_t n = 0; n < N; n++) {
      double exact = 0, rounding = 0, mag = 0;
      for (int64_t b = 0; b < K / bs; b++) {
        double amax = 0, wabs = 0;
        for (int64_t i = b * bs; i < (b + 1) * bs; i++) {
          const double xv = x[m * K + i], wv = wd[n * K + i];
          exact += xv * wv;
          mag += fabs(xv) * fabs(wv);
          wabs += fabs(wv);
          amax = fmax(amax, fabs(xv));
        }
        rounding += amax / 127.0 / 2.0 * wabs;
      }
      const double bound = rounding + mag * ldexp(1.0, -17);
      const double err = fabs((double)y[m * N + n] - (ref ? (*ref)[m * N + n] : exact));
      if (!(err <= bound)) ok = false;
      if (worst && bound > 0) *worst = fmax(*worst, err / bound);
    }
  return ok;
}

// The weights as the portable level computes with them (for the bound of a level that is not bit
// for bit the portable one's, against the portable level's results).
std::vector<double> dequant_generic(const Format& f, const std::vector<uint8_t>& raw, int64_t N, int64_t K);

struct Knob {
  int knob, value;
};

std::vector<Knob> knob_settings(const wb::Kernels* k, int qt) {
  std::vector<Knob> out = {{-1, 0}};  // the defaults
  if (!k->knob(qt, wb::kRows)) return out;
  for (int r : wb::kWeightRowChoices)
    for (int which : {wb::kRows, wb::kRowsM1, wb::kRowsM1Long}) out.push_back({which, r});
  for (int p : wb::kPrefetchChoices) out.push_back({wb::kPrefetch, p});
  return out;
}

// Check 1: every format, row lengths, activation rows and tile shapes against the portable level.
void check_against_generic(const Level& lv, const Format& f) {
  const wb::Kernels* gen = wb_kernels_generic();
  if (!lv.k->has(f.qt)) {
    printf("  %-7s %s: no tiles at this level (the generic kernel runs)\n", f.name, lv.name);
    return;
  }
  const std::vector<int> blocks32 = {1, 2, 3, 4, 5, 8, 16, 17, 33, 136};  // 136: K = 4352 > kLongRowK
  const std::vector<int> blocks256 = {1, 2, 3, 17};                       // 17: K = 4352
  const std::vector<int> act_rows = {1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17};
  int compared = 0;
  double worst = 0;
  for (int nb : f.bs == 32 ? blocks32 : blocks256) {
    const int64_t K = (int64_t)nb * f.bs, N = 13;
    const std::vector<uint8_t> raw = random_rows(f, N, K), w = pack_rows(f, raw, N, K);
    const std::vector<double> wd = lv.exact ? std::vector<double>() : dequant_generic(f, raw, N, K);
    for (int64_t M : act_rows) {
      if (K > 1024 && M > 5) continue;  // long rows: batch 1 is the case of their own (and a few rows)
      std::vector<float> x(M * K);
      const float scale = 0.1f + 4.0f * (float)uniform();
      for (auto& v : x) v = normal() * scale;
      for (int64_t i = 0; i < K && i < 32; i++) x[i] = 0.0f;  // an all-zero first block: d_x = 0
      Acts ga, la;
      quantize(gen, f.bs, x, M, K, ga);
      quantize(lv.k, f.bs, x, M, K, la);
      if (lv.exact && (ga.q != la.q || ga.d != la.d || ga.s != la.s || ga.bsums != la.bsums || ga.bsums32 != la.bsums32))
        fail("%s %s: quantized activations differ from the generic level's (K=%s)", f.name, lv.name,
             std::to_string(K).c_str());
      const std::vector<float> ref = matmul(gen, f, w, 0, N, K, ga, M);
      std::vector<float> base;
      for (const Knob& kn : knob_settings(lv.k, f.qt)) {
        if (kn.knob >= 0) lv.k->set_knob(f.qt, kn.knob, kn.value);
        for (int64_t n0 : {0, 4}) {  // a thread's range starts at a multiple of 4 rows
          const std::vector<float> y = matmul(lv.k, f, w, n0, N, K, la, M);
          g_checks++;
          const std::string what = "K=" + std::to_string(K) + " M=" + std::to_string(M) + " n0=" + std::to_string(n0) +
                                   " knob " + std::to_string(kn.knob) + "=" + std::to_string(kn.value);
          if (y.empty()) {
            fail("%s %s: the level refused %s", f.name, lv.name, what.c_str());
            continue;
          }
          std::vector<float> r(M * (N - n0));
          for (int64_t m = 0; m < M; m++)
            for (int64_t n = n0; n < N; n++) r[m * (N - n0) + n - n0] = ref[m * N + n];
          if (lv.exact) {
            if (memcmp(y.data(), r.data(), y.size() * 4) != 0)
              fail("%s %s: not bit for bit the generic level's at %s", f.name, lv.name, what.c_str());
          } else {
            if (n0 == 0 && kn.knob < 0) {
              base = y;
              const std::vector<double> rd(r.begin(), r.end());
              if (!within_bound(y, x, wd, M, N, K, f.bs, &rd, &worst))
                fail("%s %s: outside the bound at %s", f.name, lv.name, what.c_str());
            } else {
              bool same = true;
              for (int64_t m = 0; m < M; m++)
                for (int64_t n = n0; n < N; n++) same &= memcmp(&y[m * (N - n0) + n - n0], &base[m * N + n], 4) == 0;
              if (!same) fail("%s %s: a knob or row range changed bits at %s", f.name, lv.name, what.c_str());
            }
          }
          compared++;
        }
        if (kn.knob >= 0) lv.k->set_knob(f.qt, kn.knob, 0);
      }
      // batch invariance: each row alone gets the bits it got among M rows
      if (M > 1) {
        const std::vector<float> all = matmul(lv.k, f, w, 0, N, K, la, M);
        for (int64_t m = 0; m < M; m++) {
          Acts one;
          std::vector<float> xm(x.begin() + m * K, x.begin() + (m + 1) * K);
          quantize(lv.k, f.bs, xm, 1, K, one);
          const std::vector<float> y1 = matmul(lv.k, f, w, 0, N, K, one, 1);
          if (memcmp(y1.data(), &all[m * N], N * 4) != 0)
            fail("%s %s: row alone differs from the row among others (K=%s)", f.name, lv.name,
                 std::to_string(K).c_str());
        }
      }
    }
  }
  if (lv.exact)
    printf("  %-7s %-7s %5d calls bit for bit the generic level's\n", f.name, lv.name, compared);
  else
    printf("  %-7s %-7s %5d calls within the bound (worst difference / bound %.1e), knobs bit-stable\n", f.name, lv.name,
           compared, worst);
}

std::vector<double> dequant_generic(const Format& f, const std::vector<uint8_t>& raw, int64_t N, int64_t K) {
  // Through the generic kernel itself: activation row k is 127 at k and 0 elsewhere (d_x = 1, so
  // the row's products are 127 w_k).
  const wb::Kernels* gen = wb_kernels_generic();
  const std::vector<uint8_t> w = pack_rows(f, raw, N, K);
  std::vector<double> out(N * K);
  const int64_t chunk = 64;
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t M = K - k0 < chunk ? K - k0 : chunk;
    std::vector<float> x(M * K, 0.0f);
    for (int64_t m = 0; m < M; m++) x[m * K + k0 + m] = 127.0f;
    Acts a;
    quantize(gen, f.bs, x, M, K, a);
    const std::vector<float> y = matmul(gen, f, w, 0, N, K, a, M);
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) out[n * K + k0 + m] = y[m * N + n] / 127.0;
  }
  return out;
}

// Check 2: every level against gguf's dequantization (make_data.py's files).
bool read_file(const std::string& path, void* dst, size_t bytes) {
  FILE* fp = fopen(path.c_str(), "rb");
  if (!fp) return false;
  const size_t got = fread(dst, 1, bytes, fp);
  fclose(fp);
  return got == bytes;
}

// --dump FILE: the generic level's quantized activations and outputs on the gguf data, for every
// format, so that two builds (x86-64 and aarch64) can be compared byte for byte (run.sh).
void append(std::vector<uint8_t>& out, const void* p, size_t n) {
  out.insert(out.end(), (const uint8_t*)p, (const uint8_t*)p + n);
}

void check_against_gguf(const std::vector<Level>& levels, const std::vector<Format>& fmts, const std::string& dir,
                        std::vector<uint8_t>* dump) {
  FILE* fp = fopen((dir + "/manifest.txt").c_str(), "r");
  if (!fp) {
    printf("FAIL no %s/manifest.txt (make it with tests/kernel_harness/make_data.py)\n", dir.c_str());
    g_failures++;
    return;
  }
  char name[32];
  int qt;
  long N, K, M;
  int seen = 0;
  while (fscanf(fp, "%31s %d %ld %ld %ld", name, &qt, &N, &K, &M) == 5) {
    const Format* f = nullptr;
    for (const auto& c : fmts)
      if (c.qt == qt) f = &c;
    if (!f) continue;
    seen++;
    std::vector<uint8_t> raw(N * (K / f->bs) * f->bb);
    std::vector<float> deq(N * K), x(M * K);
    if (!read_file(dir + "/" + name + ".w", raw.data(), raw.size()) ||
        !read_file(dir + "/" + name + ".deq", deq.data(), deq.size() * 4) ||
        !read_file(dir + "/" + name + ".x", x.data(), x.size() * 4)) {
      fail("%s: reference files missing or short in %s%s", name, dir.c_str(), "");
      continue;
    }
    const std::vector<uint8_t> w = pack_rows(*f, raw, N, K);
    const std::vector<double> wd(deq.begin(), deq.end());
    if (dump) {
      Acts a;
      quantize(wb_kernels_generic(), f->bs, x, M, K, a);
      const std::vector<float> y = matmul(wb_kernels_generic(), *f, w, 0, N, K, a, M);
      append(*dump, a.q.data(), a.q.size());
      append(*dump, a.d.data(), a.d.size() * 4);
      append(*dump, a.s.data(), a.s.size() * 4);
      append(*dump, a.bsums.data(), a.bsums.size() * 2);
      append(*dump, y.data(), y.size() * 4);
    }
    for (const Level& lv : levels) {
      double worst = 0;
      if (!lv.k->has(qt)) continue;  // the generic kernel runs there: checked as generic
      for (int64_t m = 1; m <= M; m++) {  // every activation tile shape and its tails
        Acts a;
        quantize(lv.k, f->bs, x, m, K, a);
        const std::vector<float> y = matmul(lv.k, *f, w, 0, N, K, a, m);
        g_checks++;
        if (!within_bound(y, x, wd, m, N, K, f->bs, nullptr, &worst))
          fail("%s %s: outside the bound of gguf's dequantization (M=%s)", name, lv.name, std::to_string(m).c_str());
      }
      printf("  %-7s %-7s within the bound of gguf's dequantization, M = 1..%ld (worst error / bound %.3f)\n", name,
             lv.name, M, worst);
    }
  }
  fclose(fp);
  if (seen != (int)fmts.size()) {
    printf("FAIL the manifest has %d of the table's %zu formats\n", seen, fmts.size());
    g_failures++;
  }
}

// Check 3: paged attention. No level has an arm variant of it: the arm level runs the portable one
// (attention_generic.cpp), checked here against a float64 reference (decode, verification and
// prefill-chunk queries, GQA, a block table out of order, a window with a soft cap; KV float32
// and int8 with scales and offsets). Not in the dump: its softmax and soft cap go through libm's
// expf and tanhf, whose last bits differ between x86-64's glibc (an FMA variant, chosen at run
// time) and aarch64's.
void check_attention() {
  g_rng = 0x2545F4914F6CDD1Dull;  // the same data whatever ran before
  const int64_t H = 4, KVH = 2, D = 64, bs = 16, N = 3, blocks = 12, S = blocks * bs;
  const int32_t ctx[N] = {5, 37, 70}, nq[N] = {1, 5, 9};
  int32_t qstart[N + 1] = {0};
  for (int n = 0; n < N; n++) qstart[n + 1] = qstart[n] + nq[n];
  const int64_t T = qstart[N], W = 5;
  std::vector<int32_t> table(N * W);
  for (int64_t i = 0; i < N * W; i++) table[i] = (int32_t)((i * 7 + 3) % blocks);  // distinct, out of order
  std::vector<float> q(T * H * D), kf(KVH * S * D), vf(KVH * S * D), ks(KVH * S), vs(KVH * S), ko(KVH * D), vo(KVH * D);
  std::vector<int8_t> k8(KVH * S * D), v8(KVH * S * D);
  for (auto& v : q) v = normal();
  for (size_t i = 0; i < kf.size(); i++) {
    kf[i] = normal();
    vf[i] = normal();
    k8[i] = (int8_t)(next_u64() % 255 - 127);
    v8[i] = (int8_t)(next_u64() % 255 - 127);
  }
  for (size_t i = 0; i < ks.size(); i++) {
    ks[i] = 0.01f + 0.02f * (float)uniform();
    vs[i] = 0.01f + 0.02f * (float)uniform();
  }
  for (size_t i = 0; i < ko.size(); i++) {
    ko[i] = 0.1f * normal();
    vo[i] = 0.1f * normal();
  }
  for (int kv_type : {wb::KV_F32, wb::KV_INT8})
    for (int variant = 0; variant < 2; variant++) {
      const bool i8 = kv_type == wb::KV_INT8;
      wb::AttnArgs a{};
      std::vector<float> out(T * H * D, NAN);
      a.q = q.data();
      a.out = out.data();
      a.k = i8 ? (const void*)k8.data() : (const void*)kf.data();
      a.v = i8 ? (const void*)v8.data() : (const void*)vf.data();
      a.k_scale = i8 ? ks.data() : nullptr;
      a.v_scale = i8 ? vs.data() : nullptr;
      a.k_offset = i8 ? ko.data() : nullptr;
      a.v_offset = i8 ? vo.data() : nullptr;
      a.kv_type = kv_type;
      a.block_tables = table.data();
      a.block_table_stride = W;
      a.query_start = qstart;
      a.context_lens = ctx;
      a.num_heads = H;
      a.num_kv_heads = KVH;
      a.head_dim = D;
      a.slots = S;
      a.block_size = bs;
      a.scale = 0.125f;
      a.window = variant ? 24 : 0;
      a.softcap = variant ? 20.0f : 0.0f;
      a.query_parts = 1;
      wb_attention_generic()(a, 0, N * KVH);
      double worst = 0;
      for (int64_t n = 0; n < N; n++)
        for (int64_t i = 0; i < nq[n]; i++)
          for (int64_t h = 0; h < H; h++) {
            const int64_t t = qstart[n] + i, p = ctx[n] - nq[n] + i, kvh = h / (H / KVH);
            const int64_t lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
            std::vector<double> sc, o(D, 0.0);
            double mx = -1e300, sum = 0;
            for (int64_t pos = lo; pos <= p; pos++) {
              const int64_t slot = (int64_t)table[n * W + pos / bs] * bs + pos % bs, r = kvh * S + slot;
              double dot = 0;
              for (int64_t d = 0; d < D; d++)
                dot += (double)q[(t * H + h) * D + d] *
                       (i8 ? (double)k8[r * D + d] * ks[r] + ko[kvh * D + d] : (double)kf[r * D + d]);
              double v = dot * a.scale;
              if (a.softcap > 0) v = a.softcap * tanh(v / a.softcap);
              sc.push_back(v);
              mx = fmax(mx, v);
            }
            for (size_t j = 0; j < sc.size(); j++) {
              sc[j] = exp(sc[j] - mx);
              sum += sc[j];
            }
            for (int64_t pos = lo, j = 0; pos <= p; pos++, j++) {
              const int64_t slot = (int64_t)table[n * W + pos / bs] * bs + pos % bs, r = kvh * S + slot;
              for (int64_t d = 0; d < D; d++)
                o[d] += sc[j] / sum * (i8 ? (double)v8[r * D + d] * vs[r] + vo[kvh * D + d] : (double)vf[r * D + d]);
            }
            for (int64_t d = 0; d < D; d++) {
              const double e = fabs(out[(t * H + h) * D + d] - o[d]);
              if (!(e <= worst)) worst = e;  // NaN too
            }
          }
      g_checks++;
      const char* what = i8 ? "int8 KV with scales and offsets" : "float32 KV";
      if (!(worst <= 2e-5))
        fail("attention (%s%s): off the float64 reference by %s", what, variant ? ", window and soft cap" : "",
             std::to_string(worst).c_str());
      printf("  attention, %s%s: generic within %.1e of float64\n", what, variant ? ", window 24, soft cap 20" : "",
             worst);
    }
}

}  // namespace

int main(int argc, char** argv) {
  std::string data, only, dump_path;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--data") && i + 1 < argc) data = argv[++i];
    else if (!strcmp(argv[i], "--level") && i + 1 < argc) only = argv[++i];
    else if (!strcmp(argv[i], "--dump") && i + 1 < argc) dump_path = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--data DIR] [--level NAME] [--dump FILE]\n", argv[0]);
      return 2;
    }
  }
  std::vector<Level> levels;
  for (const Level& lv : levels_here())
    if (only.empty() || only == lv.name || !strcmp(lv.name, "generic")) levels.push_back(lv);
  if (!only.empty() && levels.back().name != only) {
    printf("FAIL level %s is not available on this CPU\n", only.c_str());
    return 1;
  }
  printf("levels on this CPU:");
  for (const Level& lv : levels) printf(" %s", lv.name);
#if defined(__aarch64__)
  printf("  (arm features: dotprod %d, i8mm %d)", !!(wb_arm_features() & WB_ARM_DOTPROD),
         !!(wb_arm_features() & WB_ARM_I8MM));
#endif
  printf("\n");
  const std::vector<Format> fmts = formats();
  for (const Level& lv : levels) {
    if (!strcmp(lv.name, "generic")) continue;
    printf("%s against the generic level:\n", lv.name);
    for (const Format& f : fmts) check_against_generic(lv, f);
  }
  std::vector<uint8_t> dump;
  printf("paged attention (every level runs the portable kernel on aarch64):\n");
  check_attention();
  if (!data.empty()) {
    printf("against gguf's dequantization (%s):\n", data.c_str());
    check_against_gguf(levels, fmts, data, dump_path.empty() ? nullptr : &dump);
    if (!dump_path.empty()) {
      FILE* fp = fopen(dump_path.c_str(), "wb");
      if (!fp || fwrite(dump.data(), 1, dump.size(), fp) != dump.size()) {
        printf("FAIL could not write %s\n", dump_path.c_str());
        g_failures++;
      }
      if (fp) fclose(fp);
    }
  }
  printf("%s: %ld checks, %d failures\n", g_failures ? "FAILED" : "passed", g_checks, g_failures);
  return g_failures ? 1 : 0;
}
