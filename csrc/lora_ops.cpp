// LoRA beside a linear layer's matmul (layers/lora.py): y[t] += B_s (A_s x[t]) for each row t whose
// adapter slot s is not 0, A_s and B_s being slot s's `width` rows of a [slots * width, in] and of
// b_t [slots * width, out] (Bᵀ, the scale folded in). A row reads only its own slot's weights and sums
// them in one fixed order, so its bits depend on nothing else in the batch, and a step reads each
// slot's weights once however many of its rows use it: vLLM's punica (grouped small matmuls) done as
// two loops. PyTorch's form of the same (one matmul over every slot's columns, masked to each row's)
// multiplied every slot for every row, needed calls of fixed shape for batch invariance, and took
// a third of a 16-sequence SmolLM2 step over 4 adapters.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "torch_ops.h"
#include "vec_math.h"

namespace {

constexpr int64_t kColumnsPerTask = 256;

// sum_i a[i] x[i], sixteen lanes then the lanes in order: the same sum for a row wherever it is.
#define WB_LORA_DOT(name, target)                                  \
  target float name(const float* a, const float* x, int64_t n) {   \
    Lanes16 acc{};                                                 \
    int64_t i = 0;                                                 \
    for (; i + 16 <= n; i += 16) {                                 \
      Lanes16 av, xv;                                              \
      memcpy(&av, a + i, sizeof av);                               \
      memcpy(&xv, x + i, sizeof xv);                               \
      acc += av * xv;                                              \
    }                                                              \
    float s = 0.0f;                                                \
    for (int j = 0; j < 16; j++) s += acc[j];                      \
    for (; i < n; i++) s += a[i] * x[i];                           \
    return s;                                                      \
  }
WB_VARIANTS(WB_LORA_DOT, lora_dot)

// y[i] += sum_k h[k] b[k * ld + i] for i in [0, n): one row's columns of B h, k in order.
#define WB_LORA_UP(name, target)                                                     \
  target void name(const float* h, int64_t w, const float* b, int64_t ld, float* y, int64_t n) { \
    int64_t i = 0;                                                                   \
    for (; i + 16 <= n; i += 16) {                                                   \
      Lanes16 acc{};                                                                 \
      for (int64_t k = 0; k < w; k++) {                                              \
        Lanes16 bv;                                                                  \
        memcpy(&bv, b + k * ld + i, sizeof bv);                                      \
        acc += h[k] * bv;                                                            \
      }                                                                              \
      Lanes16 yv;                                                                    \
      memcpy(&yv, y + i, sizeof yv);                                                 \
      yv += acc;                                                                     \
      memcpy(y + i, &yv, sizeof yv);                                                 \
    }                                                                                \
    for (; i < n; i++) {                                                             \
      float acc = 0.0f;                                                              \
      for (int64_t k = 0; k < w; k++) acc += h[k] * b[k * ld + i];                   \
      y[i] += acc;                                                                   \
    }                                                                                \
  }
WB_VARIANTS(WB_LORA_UP, lora_up)

}  // namespace

void lora_add_(torch::Tensor& y, const torch::Tensor& x_in, const torch::Tensor& a, const torch::Tensor& b_t,
               const torch::Tensor& slots_in, int64_t width) {
  auto x = x_in.to(torch::kFloat).contiguous();
  auto slots = slots_in.to(torch::kLong).contiguous();
  const int64_t T = x.size(0), in = x.size(1), out = y.size(1);
  TORCH_CHECK(y.scalar_type() == torch::kFloat && y.dim() == 2 && y.stride(1) == 1 && y.size(0) == T,
              "lora_add_: y must be float32 [rows, out] with contiguous rows");
  TORCH_CHECK(a.scalar_type() == torch::kFloat && b_t.scalar_type() == torch::kFloat && a.is_contiguous() &&
                  b_t.is_contiguous() && width > 0 && a.size(0) % width == 0 && a.size(1) == in &&
                  b_t.size(0) == a.size(0) && b_t.size(1) == out && slots.numel() == T,
              "lora_add_: a [slots * width, in] and b_t [slots * width, out] float32, one slot a row");
  const int64_t num_slots = a.size(0) / width;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) TORCH_CHECK(sp[t] >= 0 && sp[t] <= num_slots, "lora_add_: slot out of range");
  auto h = torch::empty({T, width}, x.options());
  const float *xp = x.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = b_t.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ly = y.stride(0);
  const auto dot = lora_dot_for_level();
  const auto up = lora_up_for_level();
  at::parallel_for(0, T * width, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t t = i / width, k = i % width;
      if (sp[t] != 0) hp[i] = dot(ap + ((sp[t] - 1) * width + k) * in, xp + t * in, in);
    }
  });
  at::parallel_for(0, (out + kColumnsPerTask - 1) / kColumnsPerTask, 1, [&](int64_t c0, int64_t c1) {
    const int64_t o0 = c0 * kColumnsPerTask, o1 = std::min(out, c1 * kColumnsPerTask);
    for (int64_t t = 0; t < T; t++) {
      if (sp[t] == 0) continue;
      up(hp + t * width, width, bp + (sp[t] - 1) * width * out + o0, out, yp + t * ly + o0, o1 - o0);
    }
  });
}
