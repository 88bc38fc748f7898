// RWKV-7's elementwise work around its WKV update (layers/rwkv7.py), one op before it and one after.
// At batch-1 decode a layer's ~30 small PyTorch ops on [1, hidden] rows (the decay, the in-context
// learning rate, the normalized key, the value residual, the group norm, the bonus and the gate) cost
// more in dispatch and allocation than in arithmetic: together about a tenth of a 1.5B model's step on
// two cores. Rows are independent, so a row's numbers do not depend on the batch or the chunking.
// float32 throughout; sigmoid and exp by the same polynomial as the other fused ops (vec_math.h).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "torch_ops.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>

namespace {

constexpr int kLanes = 16;
constexpr float kDecayScale = -0.606531f;  // -exp(-0.5): the decay is exp(kDecayScale sigmoid(.)) in (0.545, 1)
constexpr float kL2Eps = 1e-12f;           // F.normalize's

template <typename F>
inline __attribute__((always_inline)) F load(const float* p) {
  F x;
  memcpy(&x, p, sizeof x);
  return x;
}

template <typename F>
inline __attribute__((always_inline)) void store(float* p, F x) {
  memcpy(p, &x, sizeof x);
}

template <typename F, typename I>
inline __attribute__((always_inline)) F sigmoid_of(F x) {
  return 1.0f / (exp_poly<F, I>(F{} - x) + 1.0f);
}

// One row's pointers: inputs [C] (vl, vf null where the layer keeps its own value), outputs [C].
struct MixRow {
  const float *k, *v, *wl, *al, *vl, *vf;
  const float *w0, *a0, *v0, *k_k, *k_a;
  float *decay, *k_out, *v_out, *a_out, *b_out;
};

// Elements j..j+lanes: everything but the per-head norm, which needs the head's whole k * k_k (kept in
// a_out) and the rate (kept in b_out) until `mix_head` finishes them.
template <typename F, typename I>
inline __attribute__((always_inline)) void mix_lanes(const MixRow& m, int64_t j) {
  const F k = load<F>(m.k + j), a = sigmoid_of<F, I>(load<F>(m.a0 + j) + load<F>(m.al + j));
  store(m.decay + j, exp_poly<F, I>(kDecayScale * sigmoid_of<F, I>(load<F>(m.w0 + j) + load<F>(m.wl + j))));
  store(m.a_out + j, k * load<F>(m.k_k + j));
  store(m.b_out + j, a);
  store(m.k_out + j, k * ((a - 1.0f) * load<F>(m.k_a + j) + 1.0f));
  F v = load<F>(m.v + j);
  if (m.vl) v = v + (load<F>(m.vf + j) - v) * sigmoid_of<F, I>(load<F>(m.v0 + j) + load<F>(m.vl + j));
  store(m.v_out + j, v);
}

// The head's kk = k k_k / max(|k k_k|, eps) (a_out holds k k_k, b_out the rate): a_out = -kk, b_out = kk a.
inline __attribute__((always_inline)) void mix_head(float* a_out, float* b_out, int64_t N) {
  Lanes16 part = {};
  int64_t j = 0;
  for (; j + kLanes <= N; j += kLanes) {
    const Lanes16 x = load<Lanes16>(a_out + j);
    part += x * x;
  }
  float lanes[kLanes];
  memcpy(lanes, &part, sizeof lanes);
  for (int l = 0; j < N; ++j, ++l) lanes[l] += a_out[j] * a_out[j];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  const float denom = std::max(std::sqrt(sum), kL2Eps);
  for (j = 0; j < N; ++j) {
    const float kk = a_out[j] / denom;
    a_out[j] = -kk;
    b_out[j] = kk * b_out[j];
  }
}

#define WB_RWKV7_MIX_ROW(name, target)                                              \
  target void name(const MixRow& m, int64_t C, int64_t N) {                         \
    int64_t j = 0;                                                                  \
    for (; j + kLanes <= C; j += kLanes) mix_lanes<Lanes16, Ints16>(m, j);          \
    for (; j < C; ++j) mix_lanes<float, int32_t>(m, j);                             \
    for (int64_t h = 0; h < C; h += N) mix_head(m.a_out + h, m.b_out + h, N);       \
  }
WB_VARIANTS(WB_RWKV7_MIX_ROW, mix_row)

// One head of the output: (group_norm(y) ln_w + ln_b + (sum r k r_k) v) g, over the head's N elements.
#define WB_RWKV7_OUT_HEAD(name, target)                                                                    \
  target void name(const float* y, const float* r, const float* k, const float* v, const float* g,         \
                   const float* ln_w, const float* ln_b, const float* r_k, int64_t N, float eps, float* out) { \
    float mean = 0.f, var = 0.f, bonus = 0.f;                                                              \
    for (int64_t j = 0; j < N; ++j) mean += y[j];                                                          \
    mean /= N;                                                                                             \
    for (int64_t j = 0; j < N; ++j) {                                                                      \
      var += (y[j] - mean) * (y[j] - mean);                                                                \
      bonus += r[j] * k[j] * r_k[j];                                                                       \
    }                                                                                                      \
    const float rstd = 1.0f / std::sqrt(var / N + eps);                                                    \
    for (int64_t j = 0; j < N; ++j) out[j] = ((y[j] - mean) * rstd * ln_w[j] + ln_b[j] + bonus * v[j]) * g[j]; \
  }
WB_VARIANTS(WB_RWKV7_OUT_HEAD, out_head)

void check_rows(const torch::Tensor& t, int64_t rows, int64_t C, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == C,
              "rwkv7: ", name, " must be a contiguous float32 [", rows, ", ", C, "] tensor, got ", t.sizes());
}

void check_vector(const torch::Tensor& t, int64_t C, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.numel() == C, "rwkv7: ", name,
              " must be a contiguous float32 tensor of ", C, " elements, got ", t.sizes());
}

constexpr int64_t kRowsPerTask = 8;  // a decode step's few rows stay on the calling thread

}  // namespace

// decay, k, v, a (= -kk) and b (= kk * rate) of T rows, as one [5, T, C] tensor; k, v: the projections;
// w_low, a_low, v_low: the low-rank pairs' outputs before their biases w0, a0, v0; v_low, v_first, v0
// all given (a later layer's value residual) or all None (layer 0's).
torch::Tensor rwkv7_mix(torch::Tensor k, torch::Tensor v, torch::Tensor w_low, torch::Tensor a_low,
                        c10::optional<torch::Tensor> v_low, c10::optional<torch::Tensor> v_first, torch::Tensor w0,
                        torch::Tensor a0, c10::optional<torch::Tensor> v0, torch::Tensor k_k, torch::Tensor k_a,
                        int64_t head_size) {
  const int64_t T = k.size(0), C = k.dim() == 2 ? k.size(1) : 0, N = head_size;
  TORCH_CHECK(N > 0 && C % N == 0, "rwkv7_mix: the width must be a multiple of the head size");
  check_rows(k, T, C, "k");
  check_rows(v, T, C, "v");
  check_rows(w_low, T, C, "w_low");
  check_rows(a_low, T, C, "a_low");
  const bool residual = v_low.has_value();
  TORCH_CHECK(residual == v_first.has_value() && residual == v0.has_value(),
              "rwkv7_mix: v_low, v_first and v0 are given together or not at all");
  if (residual) {
    check_rows(*v_low, T, C, "v_low");
    check_rows(*v_first, T, C, "v_first");
    check_vector(*v0, C, "v0");
  }
  check_vector(w0, C, "w0");
  check_vector(a0, C, "a0");
  check_vector(k_k, C, "k_k");
  check_vector(k_a, C, "k_a");
  auto out = torch::empty({5, T, C}, k.options());
  float* o = out.data_ptr<float>();
  const int64_t plane = T * C;
  const auto row = mix_row_for_level();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t off = t * C;
      const MixRow m{k.data_ptr<float>() + off, v.data_ptr<float>() + off, w_low.data_ptr<float>() + off,
                     a_low.data_ptr<float>() + off, residual ? v_low->data_ptr<float>() + off : nullptr,
                     residual ? v_first->data_ptr<float>() + off : nullptr, w0.data_ptr<float>(),
                     a0.data_ptr<float>(), residual ? v0->data_ptr<float>() : nullptr, k_k.data_ptr<float>(),
                     k_a.data_ptr<float>(), o + off, o + plane + off, o + 2 * plane + off, o + 3 * plane + off,
                     o + 4 * plane + off};
      row(m, C, N);
    }
  });
  return out;
}

// (group_norm(y) per head, ln_w and ln_b + (sum over the head of r k r_k) v) * g, for T rows [T, C].
torch::Tensor rwkv7_out(torch::Tensor y, torch::Tensor r, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                        torch::Tensor ln_w, torch::Tensor ln_b, torch::Tensor r_k, int64_t head_size, double eps) {
  const int64_t T = y.size(0), C = y.dim() == 2 ? y.size(1) : 0, N = head_size;
  TORCH_CHECK(N > 0 && C % N == 0, "rwkv7_out: the width must be a multiple of the head size");
  const torch::Tensor* rows[] = {&y, &r, &k, &v, &g};
  const char* names[] = {"y", "r", "k", "v", "g"};
  for (int i = 0; i < 5; ++i) check_rows(*rows[i], T, C, names[i]);
  check_vector(ln_w, C, "ln_w");
  check_vector(ln_b, C, "ln_b");
  check_vector(r_k, C, "r_k");
  auto out = torch::empty_like(y);
  const auto head = out_head_for_level();
  const float *y_p = y.data_ptr<float>(), *r_p = r.data_ptr<float>(), *k_p = k.data_ptr<float>();
  const float *v_p = v.data_ptr<float>(), *g_p = g.data_ptr<float>(), *w_p = ln_w.data_ptr<float>();
  const float *b_p = ln_b.data_ptr<float>(), *rk_p = r_k.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < C; h += N) {
        const int64_t off = t * C + h;
        head(y_p + off, r_p + off, k_p + off, v_p + off, g_p + off, w_p + h, b_p + h, rk_p + h, N, (float)eps,
             o + off);
      }
  });
  return out;
}
