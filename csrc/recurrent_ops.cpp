// Token-by-token recurrences of decode and verification steps, read from and written to the state
// pool by slot (layers/recurrent.py, kv/state_pool.py), without the gather and scatter copies that
// PyTorch would make. Per (sequence, head) the work is a few multiply-adds per state element, so
// a step is bound by reading and writing the states once its loops run on whole vectors: the
// running state stays in a thread's buffer from token to token, and each state kept is streamed
// to its slot. A verification of 4 drafts keeps five states a sequence where a decode step keeps
// one (Granite-4.0-H-1B's shape: 55 MB a state); Mamba2's logs four of them (SsmLog below).
// float32 throughout, as the pool is.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "torch_ops.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

void check_pool(const torch::Tensor& pool, const torch::Tensor& src, const torch::Tensor& dst, int64_t batch,
                int64_t steps, const char* what) {
  TORCH_CHECK(pool.dim() == 4 && pool.scalar_type() == torch::kFloat32 && pool.is_contiguous(), what,
              ": the pool must be a contiguous float32 [slots, heads, rows, cols] tensor");
  TORCH_CHECK(src.scalar_type() == torch::kInt64 && dst.scalar_type() == torch::kInt64 && src.numel() == batch &&
                  dst.numel() == batch * steps && src.is_contiguous() && dst.is_contiguous(),
              what, ": src must be int64 [batch] and dst int64 [batch, steps] slot indices");
  const int64_t slots = pool.size(0);
  auto s = src.data_ptr<int64_t>(), d = dst.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(s[b] >= 0 && s[b] < slots, what, ": slot out of range");
    for (int64_t t = 0; t < steps; ++t) {
      const int64_t slot = d[b * steps + t];
      TORCH_CHECK(slot >= -1 && slot < slots, what, ": slot out of range");
      TORCH_CHECK(slot != s[b], what, ": a step may not write the slot it reads (states are written out of place)");
    }
  }
}

void check_f32(const torch::Tensor& t, std::initializer_list<int64_t> shape, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.sizes() == c10::IntArrayRef(shape),
              name, " must be a contiguous float32 tensor of shape ", c10::IntArrayRef(shape), ", got ", t.sizes());
}

// One row of the Mamba2 state, row_out[n] = row_in[n] decay + xdt b[n], and its dot product with
// c, in 16 lanes (lane l takes every 16th term) added in a fixed order at the end: the loop runs
// on whole vectors, where one running sum is a chain of dependent adds (4 cycles a state
// element). row_in may be row_out. GCC's vector extension lowers the 16 lanes to what the
// variant's target has (1 AVX-512 register, 2 AVX2, 4 SSE2); the variants differ only in that
// (and in fused multiply-adds), so the kernel level picks one (ops.cpp) as it picks the matmul's.
constexpr int kLanes = 16;

inline __attribute__((always_inline)) float ssm_row(const float* row_in, float* row_out, const float* b,
                                                    const float* c, float decay, float xdt, int64_t n_state) {
  Lanes16 part = {};
  int64_t n = 0;
  for (; n + kLanes <= n_state; n += kLanes) {
    Lanes16 in, bv, cv;
    memcpy(&in, row_in + n, sizeof in);
    memcpy(&bv, b + n, sizeof bv);
    memcpy(&cv, c + n, sizeof cv);
    const Lanes16 st = in * decay + xdt * bv;
    memcpy(row_out + n, &st, sizeof st);
    part += st * cv;
  }
  float lanes[kLanes];
  memcpy(lanes, &part, sizeof lanes);
  for (int l = 0; n < n_state; ++n, ++l) {
    const float st = row_in[n] * decay + xdt * b[n];
    row_out[n] = st;
    lanes[l] += st * c[n];
  }
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// One (sequence, head) token: the state [head_dim, d_state] from `in` to `out` (may be `in`), y.
#define WB_SSM_HEAD(name, target)                                                                      \
  target void name(const float* in, float* out, const float* x, const float* b, const float* c, float dt, \
                   float decay, float d, int64_t head_dim, int64_t d_state, float* y) {                \
    for (int64_t p = 0; p < head_dim; ++p)                                                              \
      y[p] = ssm_row(in + p * d_state, out + p * d_state, b, c, decay, x[p] * dt, d_state) + d * x[p];   \
  }
WB_VARIANTS(WB_SSM_HEAD, ssm_head)

// One token of a causal depthwise convolution over C channels: out[c] = bias[c] + sum_k w[k][c]
// win[k][c] (win: the K - 1 inputs before the token, oldest first, then the token's own), SiLU
// after where asked. The sum goes tap by tap, as the PyTorch form adds them.
#define WB_CONV_ROW(name, target)                                                                   \
  target void name(const float* const* win, const float* w, const float* bias, int64_t K, int64_t C, \
                   bool silu, float* out) {                                                         \
    int64_t c = 0;                                                                                  \
    for (; c + 16 <= C; c += 16) {                                                                  \
      Lanes16 acc = {}, wv, xv;                                                                     \
      for (int64_t k = 0; k < K; ++k) {                                                             \
        memcpy(&wv, w + k * C + c, sizeof wv);                                                      \
        memcpy(&xv, win[k] + c, sizeof xv);                                                         \
        acc += wv * xv;                                                                             \
      }                                                                                             \
      if (bias) {                                                                                   \
        memcpy(&wv, bias + c, sizeof wv);                                                           \
        acc = wv + acc;                                                                             \
      }                                                                                             \
      if (silu) acc = act_of<Lanes16, Ints16>(acc, true);                                           \
      memcpy(out + c, &acc, sizeof acc);                                                            \
    }                                                                                               \
    for (; c < C; ++c) {                                                                            \
      float acc = 0.f;                                                                              \
      for (int64_t k = 0; k < K; ++k) acc += w[k * C + c] * win[k][c];                              \
      if (bias) acc = bias[c] + acc;                                                                \
      out[c] = silu ? act_of<float, int32_t>(acc, true) : acc;                                      \
    }                                                                                               \
  }
WB_VARIANTS(WB_CONV_ROW, conv_row)

// A new state goes to its pool slot with streaming stores: the slot is not read again this step,
// so the stores bypass the cache and skip reading the line first (a slot written per token is the
// step's largest traffic after the weights). The SSE2 forms: every x86-64 CPU has them.
inline void store_state(float* out, const float* state, int64_t count) {
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(out) % 16 == 0 && count % 4 == 0) {
    for (int64_t i = 0; i < count; i += 4) _mm_stream_ps(out + i, _mm_loadu_ps(state + i));
    return;
  }
#endif
  std::copy(state, state + count, out);
}

inline void store_fence() {
#if defined(__SSE2__)
  _mm_sfence();  // streamed stores are visible before the parallel region's join
#endif
}

}  // namespace

// Both kernels run T tokens of each of B sequences (T = 1: a decode step; 1 + drafts: a speculative
// verification), the state carried from token to token in cache, and written to the pool after
// token t where dst[b, t] >= 0 (the states a step keeps: layers/recurrent.py). The first token
// reads slot src[b]; no slot it reads is written.

namespace {

// A logged Mamba2 state (docs/recurrent.md, "speculative decoding"): where a verification keeps the
// state after a draft, it writes the inputs of the drafts up to it (x and dt of each head, B of each
// group) into the slot's own room, not the state (8192 floats a head at Granite-4.0-H's shape), and
// the slot's state is the root slot's advanced by them. A verification of 4 drafts then writes one
// whole state, as a decode step does; the step that reads a logged slot replays its entries (the
// same `head` call, so the same bits) before its own tokens. A head's room holds, for up to
// `capacity` entries: x [capacity, head_dim], then (the group's first head only) B [capacity,
// d_state], then dt [capacity]; whole rows, so that they stream as the states do.
struct SsmLog {
  const int64_t* p;  // [batch, 3]: root slot (-1: src holds a whole state), src's entries, first logged t
  int64_t capacity;
  int64_t root(int64_t b) const { return p ? p[b * 3] : -1; }
  int64_t entries(int64_t b) const { return p ? p[b * 3 + 1] : 0; }
  int64_t from(int64_t b, int64_t steps) const { return p ? p[b * 3 + 2] : steps; }
  int64_t b_at(int64_t head_dim) const { return capacity * head_dim; }
  int64_t dt_at(int64_t head_dim, int64_t d_state) const { return capacity * (head_dim + d_state); }
};

SsmLog check_log(const c10::optional<torch::Tensor>& logged, const torch::Tensor& pool, const torch::Tensor& src,
                 const torch::Tensor& dst, int64_t batch, int64_t steps) {
  const int64_t capacity = pool.size(2) * pool.size(3) / (pool.size(2) + pool.size(3) + 1);
  if (!logged) return {nullptr, capacity};
  const auto& l = *logged;
  TORCH_CHECK(l.scalar_type() == torch::kInt64 && l.is_contiguous() && l.sizes() == c10::IntArrayRef({batch, 3}),
              "ssm_step: logged must be int64 [batch, 3] (root slot, src's entries, first logged token)");
  const int64_t slots = pool.size(0);
  const int64_t *lp = l.data_ptr<int64_t>(), *s = src.data_ptr<int64_t>(), *d = dst.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t root = lp[b * 3], entries = lp[b * 3 + 1], from = lp[b * 3 + 2];
    TORCH_CHECK(root >= -1 && root < slots && root != s[b], "ssm_step: a logged slot's root is out of range");
    TORCH_CHECK(root < 0 ? entries == 0 : entries > 0 && entries <= capacity,
                "ssm_step: a logged slot holds 1 to ", capacity, " entries at this shape");
    TORCH_CHECK(from >= 0 && from <= steps && steps - from <= capacity, "ssm_step: too many logged tokens");
    bool logs = false;
    for (int64_t t = 0; t < steps; ++t) {
      TORCH_CHECK(root < 0 || d[b * steps + t] != root, "ssm_step: a step may not write the root it reads");
      logs |= t >= from && d[b * steps + t] >= 0;
    }
    TORCH_CHECK(!logs || (from > 0 && d[b * steps + from - 1] >= 0),
                "ssm_step: a logged state needs the state before its first entry saved whole");
  }
  return {lp, capacity};
}

}  // namespace

// Mamba2: state[h, p, n] <- state[h, p, n] * exp(dt[h] A[h]) + dt[h] x[h, p] B[g(h), n];
// y[h, p] = sum_n state[h, p, n] C[g(h), n] + D[h] x[h, p]. `dt` is after softplus and its limits.
// `logged`: which slots hold logs (SsmLog above); None: every slot holds a whole state.
torch::Tensor ssm_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor x,
                       torch::Tensor B, torch::Tensor C, torch::Tensor dt, torch::Tensor A, torch::Tensor D,
                       c10::optional<torch::Tensor> logged) {
  const int64_t batch = x.size(0), steps = x.size(1);
  const int64_t heads = pool.size(1), head_dim = pool.size(2), d_state = pool.size(3);
  check_pool(pool, src, dst, batch, steps, "ssm_step");
  const int64_t groups = B.size(2);
  TORCH_CHECK(groups > 0 && heads % groups == 0, "ssm_step: heads must be a multiple of groups");
  check_f32(x, {batch, steps, heads, head_dim}, "x");
  check_f32(B, {batch, steps, groups, d_state}, "B");
  check_f32(C, {batch, steps, groups, d_state}, "C");
  check_f32(dt, {batch, steps, heads}, "dt");
  check_f32(A, {heads}, "A");
  check_f32(D, {heads}, "D");
  const SsmLog log = check_log(logged, pool, src, dst, batch, steps);
  auto y = torch::empty_like(x);
  float* pool_p = pool.data_ptr<float>();
  const float *x_p = x.data_ptr<float>(), *B_p = B.data_ptr<float>(), *C_p = C.data_ptr<float>();
  const float *dt_p = dt.data_ptr<float>(), *A_p = A.data_ptr<float>(), *D_p = D.data_ptr<float>();
  const int64_t *src_p = src.data_ptr<int64_t>(), *dst_p = dst.data_ptr<int64_t>();
  float* y_p = y.data_ptr<float>();
  const int64_t per_group = heads / groups, state_size = head_dim * d_state;
  const int64_t b_at = log.b_at(head_dim), dt_at = log.dt_at(head_dim, d_state);
  const auto head = ssm_head_for_level();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> state(state_size);  // the running state, token to token, in cache
    std::vector<float> scratch(d_state + head_dim);  // a replayed entry's C (zeros) and y (not used)
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads, g = h / per_group;
      const float* in = pool_p + (src_p[b] * heads + h) * state_size;
      if (const int64_t root = log.root(b); root >= 0) {
        const float* room = in;
        const float* group_room = pool_p + (src_p[b] * heads + g * per_group) * state_size;
        in = pool_p + (root * heads + h) * state_size;
        for (int64_t e = 0; e < log.entries(b); ++e, in = state.data()) {
          const float dtv = room[dt_at + e];
          head(in, state.data(), room + e * head_dim, group_room + b_at + e * d_state, scratch.data(), dtv,
               std::exp(dtv * A_p[h]), 0.f, head_dim, d_state, scratch.data() + d_state);
        }
      }
      const int64_t from = log.from(b, steps);
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t bt = b * steps + t, slot = dst_p[bt];
        const float* bv = B_p + (bt * groups + g) * d_state;
        const float* cv = C_p + (bt * groups + g) * d_state;
        const float dtv = dt_p[bt * heads + h], decay = std::exp(dtv * A_p[h]), d = D_p[h];
        const float* xs = x_p + (bt * heads + h) * head_dim;
        float* ys = y_p + (bt * heads + h) * head_dim;
        head(t == 0 ? in : state.data(), state.data(), xs, bv, cv, dtv, decay, d, head_dim, d_state, ys);
        if (slot < 0) continue;
        float* out = pool_p + (slot * heads + h) * state_size;
        if (t < from) {
          store_state(out, state.data(), state_size);
          continue;
        }
        for (int64_t u = from; u <= t; ++u) {  // the entries of tokens from..t
          const int64_t bu = b * steps + u, e = u - from;
          store_state(out + e * head_dim, x_p + (bu * heads + h) * head_dim, head_dim);
          if (h % per_group == 0) store_state(out + b_at + e * d_state, B_p + (bu * groups + g) * d_state, d_state);
          out[dt_at + e] = dt_p[bu * heads + h];
        }
      }
    }
    store_fence();
  });
  return y;
}

// Mamba (v1), per channel d: state[d, n] <- state[d, n] exp(dt[d] A[d, n]) + dt[d] x[d] B[n];
// y[d] = sum_n state[d, n] C[n] (the D skip and the gate are the caller's). Its decay is per state
// element, so each row takes its own exp of 16 lanes (vec_math.h's), where Mamba2 has one a head.
namespace {

#define WB_SSM1_ROW(name, target)                                                                      \
  target float name(const float* in, float* out, const float* a, const float* b, const float* c, float dt, \
                    float xdt, int64_t n_state) {                                                      \
    Lanes16 part = {};                                                                                 \
    int64_t n = 0;                                                                                     \
    for (; n + kLanes <= n_state; n += kLanes) {                                                       \
      Lanes16 iv, av, bv, cv;                                                                          \
      memcpy(&iv, in + n, sizeof iv);                                                                  \
      memcpy(&av, a + n, sizeof av);                                                                   \
      memcpy(&bv, b + n, sizeof bv);                                                                   \
      memcpy(&cv, c + n, sizeof cv);                                                                   \
      const Lanes16 st = iv * exp_poly<Lanes16, Ints16>(av * dt) + xdt * bv;                           \
      memcpy(out + n, &st, sizeof st);                                                                 \
      part += st * cv;                                                                                 \
    }                                                                                                  \
    float lanes[kLanes];                                                                               \
    memcpy(lanes, &part, sizeof lanes);                                                                \
    for (int l = 0; n < n_state; ++n, ++l) {                                                           \
      const float st = in[n] * exp_poly<float, int32_t>(a[n] * dt) + xdt * b[n];                       \
      out[n] = st;                                                                                     \
      lanes[l] += st * c[n];                                                                           \
    }                                                                                                  \
    float sum = 0.f;                                                                                   \
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];                                                  \
    return sum;                                                                                        \
  }
WB_VARIANTS(WB_SSM1_ROW, ssm1_row)

constexpr int64_t kSsm1Channels = 64;  // channels a task: its running states stay in a thread's cache

}  // namespace

torch::Tensor ssm1_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor x,
                        torch::Tensor dt, torch::Tensor B, torch::Tensor C, torch::Tensor A) {
  const int64_t batch = x.size(0), steps = x.size(1);
  TORCH_CHECK(pool.dim() == 3, "ssm1_step: the pool must be [slots, channels, d_state]");
  const int64_t channels = pool.size(1), d_state = pool.size(2);
  check_pool(pool.unsqueeze(1), src, dst, batch, steps, "ssm1_step");
  check_f32(x, {batch, steps, channels}, "x");
  check_f32(dt, {batch, steps, channels}, "dt");
  check_f32(B, {batch, steps, d_state}, "B");
  check_f32(C, {batch, steps, d_state}, "C");
  check_f32(A, {channels, d_state}, "A");
  auto y = torch::empty_like(x);
  float* pool_p = pool.data_ptr<float>();
  const float *x_p = x.data_ptr<float>(), *dt_p = dt.data_ptr<float>(), *B_p = B.data_ptr<float>();
  const float *C_p = C.data_ptr<float>(), *A_p = A.data_ptr<float>();
  const int64_t *src_p = src.data_ptr<int64_t>(), *dst_p = dst.data_ptr<int64_t>();
  float* y_p = y.data_ptr<float>();
  const int64_t blocks = (channels + kSsm1Channels - 1) / kSsm1Channels, state_size = channels * d_state;
  const auto row = ssm1_row_for_level();
  at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> state(kSsm1Channels * d_state);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / blocks, d0 = i % blocks * kSsm1Channels, d1 = std::min(channels, d0 + kSsm1Channels);
      const float* in = pool_p + src_p[b] * state_size + d0 * d_state;
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t bt = b * steps + t, slot = dst_p[bt];
        const float *bv = B_p + bt * d_state, *cv = C_p + bt * d_state;
        for (int64_t d = d0; d < d1; ++d) {
          const float dtv = dt_p[bt * channels + d];
          float* out = state.data() + (d - d0) * d_state;
          y_p[bt * channels + d] = row(t == 0 ? in + (d - d0) * d_state : out, out, A_p + d * d_state, bv, cv, dtv,
                                       dtv * x_p[bt * channels + d], d_state);
        }
        if (slot >= 0) store_state(pool_p + slot * state_size + d0 * d_state, state.data(), (d1 - d0) * d_state);
      }
    }
    store_fence();
  });
  return y;
}

// The gated delta rule (Qwen3-Next), state [heads, k_dim, v_dim]: S <- S exp(g);
// delta = (v - S^T k) beta; S <- S + k delta^T; o = S^T q. q and k come normalized and scaled.
torch::Tensor delta_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor q,
                         torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta) {
  const int64_t batch = q.size(0), steps = q.size(1);
  const int64_t heads = pool.size(1), k_dim = pool.size(2), v_dim = pool.size(3);
  check_pool(pool, src, dst, batch, steps, "delta_step");
  check_f32(q, {batch, steps, heads, k_dim}, "q");
  check_f32(k, {batch, steps, heads, k_dim}, "k");
  check_f32(v, {batch, steps, heads, v_dim}, "v");
  check_f32(g, {batch, steps, heads}, "g");
  check_f32(beta, {batch, steps, heads}, "beta");
  auto o = torch::empty_like(v);
  float* pool_p = pool.data_ptr<float>();
  const float *q_p = q.data_ptr<float>(), *k_p = k.data_ptr<float>(), *v_p = v.data_ptr<float>();
  const float *g_p = g.data_ptr<float>(), *beta_p = beta.data_ptr<float>();
  const int64_t *src_p = src.data_ptr<int64_t>(), *dst_p = dst.data_ptr<int64_t>();
  float* o_p = o.data_ptr<float>();
  const int64_t state_size = k_dim * v_dim;
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> delta(v_dim), acc(v_dim), state(state_size);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads;
      const float* in = pool_p + (src_p[b] * heads + h) * state_size;
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t bt = b * steps + t, slot = dst_p[bt], row_i = bt * heads + h;
        const float *qv = q_p + row_i * k_dim, *kv = k_p + row_i * k_dim, *vv = v_p + row_i * v_dim;
        const float decay = std::exp(g_p[row_i]), bt_ = beta_p[row_i];
        const float* from = t == 0 ? in : state.data();
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t r = 0; r < k_dim; ++r) {
          const float* row = from + r * v_dim;
          const float kr = kv[r];
          for (int64_t c = 0; c < v_dim; ++c) acc[c] += row[c] * decay * kr;
        }
        for (int64_t c = 0; c < v_dim; ++c) delta[c] = (vv[c] - acc[c]) * bt_;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t r = 0; r < k_dim; ++r) {
          const float* row = from + r * v_dim;
          float* row_out = state.data() + r * v_dim;
          const float kr = kv[r], qr = qv[r];
          for (int64_t c = 0; c < v_dim; ++c) {
            const float s = row[c] * decay + kr * delta[c];
            row_out[c] = s;
            acc[c] += s * qr;
          }
        }
        std::copy(acc.begin(), acc.end(), o_p + row_i * v_dim);
        if (slot >= 0) store_state(pool_p + (slot * heads + h) * state_size, state.data(), state_size);
      }
    }
    store_fence();
  });
  return o;
}

// A causal depthwise convolution (LFM2's short convolution, Mamba2's conv1d) over T tokens of
// each of B sequences, x [B, T, C] (rows may be strided, channels contiguous), weight [K, C] (tap
// k multiplies the input K - 1 - k tokens back), bias [C] or none, SiLU after where asked. The
// state, the K - 1 inputs before the next token [K - 1, C], is read from pool slot src[b]; the
// state after token t is written to slot dst[b, t] where that is >= 0. Returns [B, T, C].
torch::Tensor conv_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor x,
                        torch::Tensor weight, c10::optional<torch::Tensor> bias, bool silu) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1,
              "conv_step: x must be float32 [batch, steps, channels] with contiguous channels");
  const int64_t batch = x.size(0), steps = x.size(1), C = x.size(2);
  TORCH_CHECK(pool.dim() == 3 && pool.scalar_type() == torch::kFloat32 && pool.is_contiguous() && pool.size(2) == C,
              "conv_step: the pool must be a contiguous float32 [slots, kernel - 1, channels] tensor");
  const int64_t K = pool.size(1) + 1;
  check_pool(pool.unsqueeze(-1), src, dst, batch, steps, "conv_step");
  check_f32(weight, {K, C}, "weight");
  if (bias) check_f32(*bias, {C}, "bias");
  auto out = torch::empty({batch, steps, C}, x.options());
  float* pool_p = pool.data_ptr<float>();
  const float* x_p = x.data_ptr<float>();
  const float *w_p = weight.data_ptr<float>(), *b_p = bias ? bias->data_ptr<float>() : nullptr;
  const int64_t *src_p = src.data_ptr<int64_t>(), *dst_p = dst.data_ptr<int64_t>();
  const int64_t sb = x.stride(0), st = x.stride(1), state = (K - 1) * C;
  float* out_p = out.data_ptr<float>();
  const auto row = conv_row_for_level();
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<const float*> seq(K - 1 + steps);  // the state's rows, then the tokens'
    for (int64_t b = begin; b < end; ++b) {
      const float* in = pool_p + src_p[b] * state;
      for (int64_t j = 0; j < K - 1; ++j) seq[j] = in + j * C;
      for (int64_t t = 0; t < steps; ++t) seq[K - 1 + t] = x_p + b * sb + t * st;
      for (int64_t t = 0; t < steps; ++t) {
        row(seq.data() + t, w_p, b_p, K, C, silu, out_p + (b * steps + t) * C);
        const int64_t slot = dst_p[b * steps + t];
        if (slot >= 0)
          for (int64_t j = 0; j < K - 1; ++j) memcpy(pool_p + slot * state + j * C, seq[t + 1 + j], C * sizeof(float));
      }
    }
  });
  return out;
}

namespace {

// A dot product of two rows in 16 lanes, added in a fixed order at the end (as ssm_row's).
inline __attribute__((always_inline)) float dot_lanes(const float* x, const float* y, int64_t n_cols) {
  Lanes16 part = {};
  int64_t n = 0;
  for (; n + kLanes <= n_cols; n += kLanes) {
    Lanes16 xv, yv;
    memcpy(&xv, x + n, sizeof xv);
    memcpy(&yv, y + n, sizeof yv);
    part += xv * yv;
  }
  float lanes[kLanes];
  memcpy(lanes, &part, sizeof lanes);
  for (int l = 0; n < n_cols; ++n, ++l) lanes[l] += x[n] * y[n];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// One (sequence, head) token of RWKV-7's WKV state [N values, N keys], from `in` to `out` (may be
// `in`): each row i, with sa = S[i] . a, becomes S[i][j] w[j] + sa b[j] + v[i] k[j]; y[i] = S'[i] . r.
#define WB_WKV7_HEAD(name, target)                                                                       \
  target void name(const float* in, float* out, const float* r, const float* w, const float* k,          \
                   const float* v, const float* a, const float* b, int64_t N, float* y) {                \
    for (int64_t i = 0; i < N; ++i) {                                                                     \
      const float* row = in + i * N;                                                                      \
      float* row_out = out + i * N;                                                                       \
      const float sa = dot_lanes(row, a, N), vi = v[i];                                                   \
      int64_t j = 0;                                                                                      \
      for (; j + kLanes <= N; j += kLanes) {                                                              \
        Lanes16 s, wv, bv, kv;                                                                            \
        memcpy(&s, row + j, sizeof s);                                                                    \
        memcpy(&wv, w + j, sizeof wv);                                                                    \
        memcpy(&bv, b + j, sizeof bv);                                                                    \
        memcpy(&kv, k + j, sizeof kv);                                                                    \
        s = s * wv + sa * bv + vi * kv;                                                                   \
        memcpy(row_out + j, &s, sizeof s);                                                                \
      }                                                                                                   \
      for (; j < N; ++j) row_out[j] = row[j] * w[j] + sa * b[j] + vi * k[j];                              \
      y[i] = dot_lanes(row_out, r, N);                                                                    \
    }                                                                                                     \
  }
WB_VARIANTS(WB_WKV7_HEAD, wkv7_head)

}  // namespace

// RWKV-7's WKV (the generalized delta rule), state [heads, N values, N keys] per sequence:
// S <- S diag(w) + (S a) b^T + v k^T; y = S r. w is the decay after its exp (in (0, 1)); a and b
// are llama.cpp's: -kk and kk * iclr. r, w, k, v, a, b: [B, T, heads, N]; returns y [B, T, heads, N].
torch::Tensor wkv7_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor r,
                        torch::Tensor w, torch::Tensor k, torch::Tensor v, torch::Tensor a, torch::Tensor b) {
  const int64_t batch = r.size(0), steps = r.size(1);
  const int64_t heads = pool.size(1), N = pool.size(2);
  check_pool(pool, src, dst, batch, steps, "wkv7_step");
  TORCH_CHECK(pool.size(3) == N, "wkv7_step: the state must be square [heads, N, N]");
  const torch::Tensor* inputs[] = {&r, &w, &k, &v, &a, &b};
  const char* names[] = {"r", "w", "k", "v", "a", "b"};
  for (int n = 0; n < 6; ++n) check_f32(*inputs[n], {batch, steps, heads, N}, names[n]);
  auto y = torch::empty_like(r);
  float* pool_p = pool.data_ptr<float>();
  const float *r_p = r.data_ptr<float>(), *w_p = w.data_ptr<float>(), *k_p = k.data_ptr<float>();
  const float *v_p = v.data_ptr<float>(), *a_p = a.data_ptr<float>(), *b_p = b.data_ptr<float>();
  const int64_t *src_p = src.data_ptr<int64_t>(), *dst_p = dst.data_ptr<int64_t>();
  float* y_p = y.data_ptr<float>();
  const int64_t state_size = N * N;
  const auto head = wkv7_head_for_level();
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> state(state_size);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t bi = i / heads, h = i % heads;
      const float* in = pool_p + (src_p[bi] * heads + h) * state_size;
      for (int64_t t = 0; t < steps; ++t) {
        const int64_t bt = bi * steps + t, slot = dst_p[bt], o = (bt * heads + h) * N;
        head(t == 0 ? in : state.data(), state.data(), r_p + o, w_p + o, k_p + o, v_p + o, a_p + o, b_p + o, N,
             y_p + o);
        if (slot >= 0) store_state(pool_p + (slot * heads + h) * state_size, state.data(), state_size);
      }
    }
    store_fence();
  });
  return y;
}
