// The small per-layer steps between the matmuls, each one call instead of a handful of PyTorch
// ops: a decode step of a 30-layer model ran ~25 ops a layer, and at batch 1 their dispatch cost
// as much as the weights' bytes. Plain C++ over float32 rows (the work is a few thousand values a
// token); rows split over threads when there are many (prefill).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "torch_ops.h"
#include "vec_math.h"

namespace {

constexpr int64_t kRowsPerTask = 16;

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's float -> bfloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

inline float inv_rms(const float* x, int64_t n, float eps) {
  double ss = 0.0;  // double: the same sum whatever the order, close to torch's float32 result
  for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
  return (float)(1.0 / std::sqrt(ss / n + eps));
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 2 && t.stride(1) == 1 && t.device().is_cpu(), name,
              " must be a float32 [rows, n] CPU tensor with contiguous rows");
}

}  // namespace

// x += delta (in place), then returns rms_norm(x) * w: a residual add and the next norm in one pass.
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& w, double eps) {
  check_rows(x, "add_rms_norm_: x");
  auto d = delta.to(torch::kFloat).contiguous();
  TORCH_CHECK(d.sizes() == x.sizes() && w.numel() == x.size(1) && w.scalar_type() == torch::kFloat,
              "add_rms_norm_: shapes do not match");
  auto y = torch::empty_like(x);
  const int64_t n = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* wp = w.contiguous().data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t lx = x.stride(0);
  at::parallel_for(0, x.size(0), kRowsPerTask, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
      float* xr = xp + r * lx;
      const float* dr = dp + r * n;
      for (int64_t i = 0; i < n; i++) xr[i] += dr[i];
      const float s = inv_rms(xr, n, (float)eps);
      float* yr = yp + r * n;
      for (int64_t i = 0; i < n; i++) yr[i] = xr[i] * s * wp[i];
    }
  });
  return y;
}

// act(gate) * up for a fused [rows, 2 I] projection: SwiGLU ("silu") or GeGLU ("gelu_tanh").
// The activation's exp runs on whole vectors (GCC's vector extension, lowered to what each kernel
// level's variant targets, as in recurrent_ops.cpp): libm's exp one value at a time took 2.5 ns an
// element, 0.4 ms a Granite-4.0-H-1B step at one row and 5.9 ms at sixteen. Cephes' expf (2^n times
// a degree-6 polynomial, within 2 ulp of libm's) keeps the path's parity with PyTorch's silu/gelu
// to float32 rounding. Every element takes the same path wherever its row is: batch-invariant.
namespace {

#define WB_GATED_ROW(name, target)                                                              \
  target void name(const float* g, const float* u, float* o, int64_t n, bool silu) {           \
    int64_t i = 0;                                                                             \
    for (; i + 16 <= n; i += 16) {                                                             \
      Lanes16 gv, uv;                                                                          \
      memcpy(&gv, g + i, sizeof gv);                                                           \
      memcpy(&uv, u + i, sizeof uv);                                                           \
      const Lanes16 ov = act_of<Lanes16, Ints16>(gv, silu) * uv;                               \
      memcpy(o + i, &ov, sizeof ov);                                                           \
    }                                                                                          \
    for (; i < n; i++) o[i] = act_of<float, int32_t>(g[i], silu) * u[i];                      \
  }
WB_VARIANTS(WB_GATED_ROW, gated_row)

}  // namespace

torch::Tensor gated_act(const torch::Tensor& gate_up_in, const std::string& act) {
  auto gate_up = gate_up_in.to(torch::kFloat).contiguous();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gated_act: [rows, 2 * inter]");
  TORCH_CHECK(act == "silu" || act == "gelu_tanh", "gated_act: unknown activation ", act);
  const bool silu = act == "silu";
  const int64_t I = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto row = gated_row_for_level();
  at::parallel_for(0, gate_up.size(0), kRowsPerTask, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) row(gp + r * 2 * I, gp + r * 2 * I + I, op + r * I, I, silu);
  });
  return out;
}

// From the fused q|k|v projection [T, (H + 2 KVH) D]: per head RMSNorm of q and k where the model
// has one (Gemma 3), rotate-half RoPE of q and k with cos / sign-folded sin [T, D], and K and V
// written into the layer's cache [KVH, slots, D] at each token's slot: float32, bfloat16 or
// float16 as they are; int8 (symmetric, scale = amax / 127) or fp8 e4m3 (scale = amax / 448) with
// one scale per token and head, written to k_scale / v_scale [KVH, slots]. With k_offset / v_offset
// [KVH, D], a quantized page holds (x - offset) / scale: the part every token shares is left out of
// the rounding (paged attention adds it back).
// Returns q [T, H, D] float32.
torch::Tensor rope_write_kv(const torch::Tensor& qkv_in, const torch::Tensor& cos, const torch::Tensor& sin,
                            torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                            int64_t H, int64_t KVH, const c10::optional<torch::Tensor>& q_norm,
                            const c10::optional<torch::Tensor>& k_norm, double eps,
                            const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                            const c10::optional<torch::Tensor>& k_offset,
                            const c10::optional<torch::Tensor>& v_offset) {
  auto qkv = qkv_in.to(torch::kFloat).contiguous();
  const int64_t T = qkv.size(0), D = k_cache.size(2);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * KVH) * D, "rope_write_kv: qkv must be [T, (H + 2 KVH) D]");
  TORCH_CHECK(D % 2 == 0 && cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "rope_write_kv: cos and sin must be float32 [T, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(0) == KVH && k_cache.scalar_type() == v_cache.scalar_type(),
              "rope_write_kv: caches must be contiguous [KVH, slots, D] of one dtype");
  const auto kv_dtype = k_cache.scalar_type();
  const bool quantized = kv_dtype == torch::kChar || kv_dtype == torch::kFloat8_e4m3fn;
  TORCH_CHECK(quantized || kv_dtype == torch::kFloat || kv_dtype == torch::kBFloat16 || kv_dtype == torch::kHalf,
              "rope_write_kv: float32, bfloat16, float16, int8 or fp8 (e4m3) caches");
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()),
              "rope_write_kv: int8 and fp8 caches need their scales, the others none");
  if (quantized)
    for (const auto* t : {&k_scale, &v_scale})
      TORCH_CHECK((*t)->scalar_type() == torch::kFloat && (*t)->is_contiguous() && (*t)->dim() == 2 &&
                      (*t)->size(0) == KVH && (*t)->size(1) == k_cache.size(1),
                  "rope_write_kv: scales must be float32 [KVH, slots]");
  TORCH_CHECK(k_offset.has_value() == v_offset.has_value() && (quantized || !k_offset.has_value()),
              "rope_write_kv: offsets come in pairs, with int8 and fp8 caches");
  for (const auto* t : {&k_offset, &v_offset})
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == torch::kFloat && (*t)->is_contiguous() &&
                                    (*t)->dim() == 2 && (*t)->size(0) == KVH && (*t)->size(1) == k_cache.size(2)),
                "rope_write_kv: offsets must be float32 [KVH, D]");
  const float* kop = k_offset.has_value() ? k_offset->data_ptr<float>() : nullptr;
  const float* vop = v_offset.has_value() ? v_offset->data_ptr<float>() : nullptr;
  float* ksp = quantized ? k_scale->data_ptr<float>() : nullptr;
  float* vsp = quantized ? v_scale->data_ptr<float>() : nullptr;
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "rope_write_kv: one slot a token");
  const int64_t S = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "rope_write_kv: slot out of range");
  for (const auto* w : {&q_norm, &k_norm})
    TORCH_CHECK(!w->has_value() || ((*w)->numel() == D && (*w)->scalar_type() == torch::kFloat),
                "rope_write_kv: q/k norm weights must be float32 [D]");
  const float* qn = q_norm.has_value() ? q_norm->contiguous().data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->contiguous().data_ptr<float>() : nullptr;

  auto q = torch::empty({T, H, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t elem = kv_dtype == torch::kFloat ? 4 : quantized ? 1 : 2, half = D / 2, width = (H + 2 * KVH) * D;

  auto store = [&](char* base, float* scales, const float* offsets, int64_t head, int64_t slot, const float* x) {
    char* dst = base + ((head * S) + slot) * D * elem;
    if (quantized) {
      float shifted[1024];
      if (offsets) {
        for (int64_t i = 0; i < D; i++) shifted[i] = x[i] - offsets[head * D + i];
        x = shifted;
      }
      float amax = 0.0f;
      for (int64_t i = 0; i < D; i++) amax = std::max(amax, std::fabs(x[i]));
      const bool int8 = kv_dtype == torch::kChar;
      const float scale = amax / (int8 ? 127.0f : 448.0f);
      const float inv = scale > 0 ? 1.0f / scale : 0.0f;
      scales[head * S + slot] = scale;
      if (int8) {
        int8_t* d = reinterpret_cast<int8_t*>(dst);
        for (int64_t i = 0; i < D; i++) d[i] = (int8_t)std::nearbyint(std::clamp(x[i] * inv, -127.0f, 127.0f));
      } else {
        c10::Float8_e4m3fn* d = reinterpret_cast<c10::Float8_e4m3fn*>(dst);
        for (int64_t i = 0; i < D; i++) d[i] = c10::Float8_e4m3fn(std::clamp(x[i] * inv, -448.0f, 448.0f));
      }
    } else if (kv_dtype == torch::kBFloat16) {
      uint16_t* d = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < D; i++) d[i] = to_bf16(x[i]);
    } else if (kv_dtype == torch::kHalf) {
      c10::Half* d = reinterpret_cast<c10::Half*>(dst);
      for (int64_t i = 0; i < D; i++) d[i] = c10::Half(x[i]);
    } else {
      std::memcpy(dst, x, sizeof(float) * D);
    }
  };
  // y = norm(x) rotated: y = x * cos + rotate_half(x) * sin (sin's first half already negated)
  auto rope = [&](const float* x, const float* norm, const float* c, const float* s, float* y) {
    float buf[1024];
    const float* in = x;
    if (norm) {
      const float r = inv_rms(x, D, (float)eps);
      for (int64_t i = 0; i < D; i++) buf[i] = x[i] * r * norm[i];
      in = buf;
    }
    for (int64_t i = 0; i < D; i++) y[i] = in[i] * c[i] + in[i < half ? i + half : i - half] * s[i];
  };
  TORCH_CHECK(D <= 1024, "rope_write_kv: head_dim above 1024");
  at::parallel_for(0, T, kRowsPerTask, [&](int64_t t0, int64_t t1) {
    float k_rot[1024];
    for (int64_t t = t0; t < t1; t++) {
      const float* row = src + t * width;
      const float* c = cp + t * D;
      const float* s = snp + t * D;
      for (int64_t h = 0; h < H; h++) rope(row + h * D, qn, c, s, qp + (t * H + h) * D);
      for (int64_t h = 0; h < KVH; h++) {
        rope(row + (H + h) * D, kn, c, s, k_rot);
        store(kc, ksp, kop, h, sp[t], k_rot);
        store(vc, vsp, vop, h, sp[t], row + (H + KVH + h) * D);
      }
    }
  });
  return q;
}
