// Attention for prompt chunks (issue 49): a blocked, flash-style kernel over bfloat16 pages, for CPUs
// with AVX-512 BF16. PyTorch's SDPA reached about a third of this CPU's float32 FMA rate on a chunk's
// attention (Zen 5, 2 threads), and in batch-invariant mode its calls of one shape also compute keys
// that the mask then drops; at 8k tokens attention is most of a prompt's time.
//
// Each query reads the keys it sees in blocks of kKeys aligned at key 0, and only those blocks; per
// block: its scores by vdpbf16ps (the block's K transposed to [dim pair][key][2]), the online
// softmax (running max and sum, the output rescaled), and the weighted sum of V by vdpbf16ps (the
// block's V interleaved by pairs of keys, the weights rounded to bfloat16 as SDPA's bfloat16 path
// does). A block's K and V are rearranged once for all the query heads of a tile of queries, but
// every query's arithmetic is its own: the same operations in the same order whatever the chunk,
// the tile or the thread, so a prompt token's attention has the same bits however it is chunked.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <math.h>
#include <string.h>

#include <vector>

#include "torch_ops.h"

int wb_kernel_level();  // ops.cpp: 0 generic, 1 avx2, 2 avx512

#if defined(__x86_64__)
#include <immintrin.h>

namespace {

constexpr int kKeys = 32;       // keys a block
constexpr int kMaxDim = 256;    // head_dim up to this, a multiple of 32
constexpr int64_t kQueries = 8;  // queries a tile (all their query heads of one KV head share its blocks)

#define WB_FLASH_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// e^x for the online softmax (the polynomial of vec_math.h's exp_poly); exp(-inf) = 0.
WB_FLASH_TARGET inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.9875691500e-4f), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

#pragma GCC push_options
#pragma GCC target("avx512f")
#include "transpose16.inc"
#pragma GCC pop_options

struct Tile {
  // the block's K as [D / 2][kKeys][2] and V as [kKeys / 2][D][2] (pairs of keys), bfloat16
  alignas(64) uint16_t kt[kMaxDim / 2 * kKeys * 2];
  alignas(64) uint16_t vt[kKeys / 2 * kMaxDim * 2];
  alignas(64) uint16_t p[4 * kKeys];  // up to 4 rows' weights, bfloat16
};

// Rows of (query, head): query bf16 pairs, running max and sum, and the output sums in the order the
// V layout leaves the dimensions (put back in `finish`).
struct Rows {
  std::vector<uint16_t> q;  // [rows, D] bfloat16
  std::vector<float> m, l, o;  // [rows], [rows], [rows, D]
};

// Gather block [k0, k0 + kKeys) of a sequence (keys past `ctx` zero) into the tile's layouts.
WB_FLASH_TARGET void load_block(const uint16_t* kp, const uint16_t* vp, const int64_t* slots, int64_t k0, int64_t ctx,
                                int64_t D, Tile& t) {
  const int64_t n = ctx - k0 < kKeys ? ctx - k0 : kKeys;
  const uint32_t* kr[kKeys];
  static const uint32_t zeros[kMaxDim / 2] = {};
  for (int j = 0; j < kKeys; j++) kr[j] = j < n ? (const uint32_t*)(kp + slots[k0 + j] * D) : zeros;
  uint32_t* kt = (uint32_t*)t.kt;  // [D / 2][kKeys] pairs: 16 keys x 16 pairs at a time, transposed
  for (int kg = 0; kg < kKeys; kg += 16)
    for (int64_t dg = 0; dg < D / 2; dg += 16) {
      __m512i v[16];
      for (int j = 0; j < 16; j++) v[j] = _mm512_loadu_si512(kr[kg + j] + dg);
      transpose16(v);
      for (int e = 0; e < 16; e++) _mm512_store_si512(kt + (dg + e) * kKeys + kg, v[e]);
    }
  // V: keys 2i and 2i + 1 interleaved dimension by dimension, 32 dimensions (one zmm of pairs) at a time
  for (int i = 0; i < kKeys / 2; i++) {
    const int64_t a = 2 * i, b = 2 * i + 1;
    for (int64_t c = 0; c < D; c += 32) {
      const __m512i ra = a < n ? _mm512_loadu_si512(vp + slots[k0 + a] * D + c) : _mm512_setzero_si512();
      const __m512i rb = b < n ? _mm512_loadu_si512(vp + slots[k0 + b] * D + c) : _mm512_setzero_si512();
      // lo: dims c + 8 L + 0..3 of each 128-bit lane L, hi: c + 8 L + 4..7 (finish puts them back)
      _mm512_store_si512(t.vt + (i * D + c) * 2, _mm512_unpacklo_epi16(ra, rb));
      _mm512_store_si512(t.vt + (i * D + c) * 2 + 32, _mm512_unpackhi_epi16(ra, rb));
    }
  }
}

// R rows' block: scores, online softmax, weighted V. lo[r], hi[r]: the keys row r sees, inclusive.
// The rows share each load of K and V; each row's arithmetic is what it would be alone.
template <int R>
WB_FLASH_TARGET void rows_block(const uint16_t* const* q, int64_t D, const Tile& t, int64_t k0, const int64_t* lo,
                                const int64_t* hi, float scale, float* const* m, float* const* l, float* const* o,
                                uint16_t* pbuf) {
  __m512 s0[R], s1[R];
  for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_ps();
  const __m512bh* kt = (const __m512bh*)t.kt;
  for (int64_t d2 = 0; d2 < D / 2; d2++) {
    const __m512bh ka = kt[2 * d2], kb = kt[2 * d2 + 1];
    for (int r = 0; r < R; r++) {
      const __m512bh qq = (__m512bh)_mm512_set1_epi32(((const int32_t*)q[r])[d2]);
      s0[r] = _mm512_dpbf16_ps(s0[r], ka, qq);
      s1[r] = _mm512_dpbf16_ps(s1[r], kb, qq);
    }
  }
  const __m512i key = _mm512_add_epi32(_mm512_set1_epi32((int)k0), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i key1 = _mm512_add_epi32(key, _mm512_set1_epi32(16));
  const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
  __m512 alpha[R];
  for (int r = 0; r < R; r++) {
    const __m512i a = _mm512_set1_epi32((int)lo[r]), b = _mm512_set1_epi32((int)hi[r]);
    const __mmask16 v0 = _mm512_cmpge_epi32_mask(key, a) & _mm512_cmple_epi32_mask(key, b);
    const __mmask16 v1 = _mm512_cmpge_epi32_mask(key1, a) & _mm512_cmple_epi32_mask(key1, b);
    const __m512 x0 = _mm512_mask_mul_ps(ninf, v0, s0[r], sc), x1 = _mm512_mask_mul_ps(ninf, v1, s1[r], sc);
    const float bm = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
    const float mn = bm > *m[r] ? bm : *m[r];
    const float al = expf(*m[r] - mn);  // 0 at a row's first block (m = -inf)
    const __m512 mv = _mm512_set1_ps(mn);
    const __m512 p0 = _mm512_maskz_mov_ps(v0, exp512(_mm512_sub_ps(x0, mv)));
    const __m512 p1 = _mm512_maskz_mov_ps(v1, exp512(_mm512_sub_ps(x1, mv)));
    *l[r] = *l[r] * al + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    *m[r] = mn;
    alpha[r] = _mm512_set1_ps(al);
    _mm512_store_si512(pbuf + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // keys 0..15, then 16..31
  }
  const int32_t* pp = (const int32_t*)pbuf;
  for (int64_t c = 0; c < D; c += 64) {  // 4 output registers (64 dims) a row at a time
    const int regs = D - c >= 64 ? 4 : (int)(D - c) / 16;
    __m512 acc[R][4];
    for (int r = 0; r < R; r++)
      for (int j = 0; j < 4; j++) acc[r][j] = j < regs ? _mm512_mul_ps(_mm512_loadu_ps(o[r] + c + 16 * j), alpha[r]) : _mm512_setzero_ps();
    for (int i = 0; i < kKeys / 2; i++) {
      const __m512bh* vt = (const __m512bh*)(t.vt + (i * D + c) * 2);
      __m512bh vv[4];
      for (int j = 0; j < 4; j++) vv[j] = j < regs ? vt[j] : (__m512bh)_mm512_setzero_si512();
      for (int r = 0; r < R; r++) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pp[16 * r + i]);
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], vv[j], w);
      }
    }
    for (int r = 0; r < R; r++)
      for (int j = 0; j < regs; j++) _mm512_storeu_ps(o[r] + c + 16 * j, acc[r][j]);
  }
}

WB_FLASH_TARGET void to_bf16(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
    _mm512_storeu_si512(y + i, (__m512i)_mm512_cvtne2ps_pbh(b, a));
  }
}

// o / l, the dimensions back in order: register r of a 32-dimension group c holds, in lane i,
// dimension c + 8 (i / 4) + (i % 4) (r = 0, from unpacklo) or + 4 (r = 1).
void finish(const float* o, float l, int64_t D, float* out) {
  const float inv = 1.0f / l;
  for (int64_t c = 0; c < D; c += 32)
    for (int r = 0; r < 2; r++)
      for (int i = 0; i < 16; i++) out[c + 8 * (i / 4) + (i % 4) + 4 * r] = o[c + 16 * r + i] * inv;
}

}  // namespace

bool flash_prefill_supported() {
  __builtin_cpu_init();
  return wb_kernel_level() >= 2 && __builtin_cpu_supports("avx512bf16");
}

// q [L, H, D] float32; k_pages, v_pages [KVH, S, D] bfloat16; slots [ctx] int64 (the sequence's keys'
// slots in order); first, last [L] int64: the keys query i sees, inclusive. Returns [L, H, D] float32.
torch::Tensor flash_prefill(const torch::Tensor& q_in, const torch::Tensor& k_pages, const torch::Tensor& v_pages,
                            const torch::Tensor& slots, const torch::Tensor& first, const torch::Tensor& last,
                            double scale) {
  TORCH_CHECK(flash_prefill_supported(), "flash_prefill: needs the avx512 level and AVX-512 BF16");
  auto q = q_in.to(torch::kFloat).contiguous();
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 3 && v_pages.sizes() == k_pages.sizes(), "flash_prefill: shapes");
  TORCH_CHECK(k_pages.scalar_type() == torch::kBFloat16 && v_pages.scalar_type() == torch::kBFloat16 &&
              k_pages.is_contiguous() && v_pages.is_contiguous(), "flash_prefill: bfloat16 contiguous pages");
  const int64_t L = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pages.size(0), S = k_pages.size(1);
  TORCH_CHECK(k_pages.size(2) == D && D % 32 == 0 && D <= kMaxDim && H % KVH == 0, "flash_prefill: head shapes");
  for (const auto* t : {&slots, &first, &last})
    TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous() && t->dim() == 1, "flash_prefill: int64 vectors");
  TORCH_CHECK(first.size(0) == L && last.size(0) == L, "flash_prefill: a key range per query");
  const int64_t ctx = slots.size(0), G = H / KVH;
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t *fi = first.data_ptr<int64_t>(), *la = last.data_ptr<int64_t>();
  for (int64_t i = 0; i < L; i++) TORCH_CHECK(0 <= fi[i] && fi[i] <= la[i] && la[i] < ctx, "flash_prefill: key ranges");
  for (int64_t j = 0; j < ctx; j++) TORCH_CHECK(0 <= sl[j] && sl[j] < S, "flash_prefill: slot out of range");
  auto out = torch::empty({L, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const uint16_t* kp = (const uint16_t*)k_pages.data_ptr();
  const uint16_t* vp = (const uint16_t*)v_pages.data_ptr();
  const int64_t tiles = (L + kQueries - 1) / kQueries;
  at::parallel_for(0, KVH * tiles, 1, [&](int64_t begin, int64_t end) {
    Tile* t = (Tile*)aligned_alloc(64, sizeof(Tile));
    Rows rows;
    for (int64_t item = begin; item < end; item++) {
      // tiles in the order 0, last, 1, last - 1, ..: a thread's contiguous share of the items holds
      // early (short) and late (long) queries alike
      const int64_t order = item / KVH, tile = order % 2 ? tiles - 1 - order / 2 : order / 2;
      const int64_t h = item % KVH, i0 = tile * kQueries, i1 = i0 + kQueries < L ? i0 + kQueries : L;
      const int64_t n = (i1 - i0) * G;  // rows: query i0 + r / G, head h G + r % G
      rows.q.resize(n * D);
      rows.m.assign(n, -INFINITY);
      rows.l.assign(n, 0.0f);
      rows.o.assign(n * D, 0.0f);
      int64_t lo = ctx, hi = 0;
      for (int64_t i = i0; i < i1; i++) {
        lo = fi[i] < lo ? fi[i] : lo;
        hi = la[i] > hi ? la[i] : hi;
        for (int64_t g = 0; g < G; g++) to_bf16(qp + (i * H + h * G + g) * D, D, rows.q.data() + ((i - i0) * G + g) * D);
      }
      const uint16_t* kh = kp + h * S * D;
      const uint16_t* vh = vp + h * S * D;
      for (int64_t k0 = lo / kKeys * kKeys; k0 <= hi; k0 += kKeys) {
        load_block(kh, vh, sl, k0, ctx, D, *t);
        // the rows that see this block, 4 at a time
        const uint16_t* qs[4];
        int64_t los[4], his[4];
        float *ms[4], *ls[4], *os[4];
        int k = 0;
        for (int64_t r = 0; r < n; r++) {
          const int64_t i = i0 + r / G;
          if (la[i] < k0 || fi[i] >= k0 + kKeys) continue;  // a block this query does not see
          qs[k] = rows.q.data() + r * D, los[k] = fi[i], his[k] = la[i];
          ms[k] = &rows.m[r], ls[k] = &rows.l[r], os[k] = rows.o.data() + r * D;
          if (++k == 4) {
            rows_block<4>(qs, D, *t, k0, los, his, (float)scale, ms, ls, os, t->p);
            k = 0;
          }
        }
        switch (k) {
          case 1: rows_block<1>(qs, D, *t, k0, los, his, (float)scale, ms, ls, os, t->p); break;
          case 2: rows_block<2>(qs, D, *t, k0, los, his, (float)scale, ms, ls, os, t->p); break;
          case 3: rows_block<3>(qs, D, *t, k0, los, his, (float)scale, ms, ls, os, t->p); break;
          default: break;
        }
      }
      for (int64_t r = 0; r < n; r++)
        finish(rows.o.data() + r * D, rows.l[r], D, op + ((i0 + r / G) * H + h * G + r % G) * D);
    }
    free(t);
  });
  return out;
}

#else
bool flash_prefill_supported() { return false; }
torch::Tensor flash_prefill(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                            const torch::Tensor&, const torch::Tensor&, double) {
  TORCH_CHECK(false, "flash_prefill: x86-64 only");
}
#endif
