// A Llama-family or Gemma decoder stack run from C++ for steps of a few tokens per sequence
// (decode, speculative verification): the same ops as models/llama.py's DecoderLayer and
// models/gemma.py's GemmaDecoderLayer, in the same order, with no Python between them.
//
// Why: a SmolLM2 decode step makes some 240 calls from Python into these ops, ~1 ms of a ~5 ms
// step at 2 threads on a Xeon. The plan holds each layer's tensors (models/decoder_plan.py builds
// it), a step passes only its own metadata, and the GIL is released for the whole stack, so a
// server's threads run meanwhile. Bit-identical to the Python path (the same kernels on the same
// inputs): tests/test_decoder_plan.py.
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "torch_ops.h"

namespace {

// Where a call takes the dense path (layers/linear.py QuantLinear): from `min_rows` rows (0: never),
// `tile_rows` weight rows decoded at a time.
struct Dense {
  int64_t min_rows, tile_rows;
};

// Every adapter slot's A [slots * width, in] and Bᵀ [slots * width, out] of a layer (LoRAWeights).
struct Lora {
  torch::Tensor a, b_t;
  int64_t width;
};

// A quantized linear layer: its segments (fused projections) and their GGML types, a bias, and its
// LoRA adapters' weights where any adapter targets it.
struct Linear {
  std::vector<torch::Tensor> blocks;
  std::vector<int64_t> qtypes;
  c10::optional<torch::Tensor> bias;
  c10::optional<Lora> lora;

  // lora_slots: the step's rows' adapter slots (layers/lora.py), or undefined where no row has one
  torch::Tensor operator()(const torch::Tensor& x, const Dense& dense, const torch::Tensor& lora_slots) const {
    auto y = dense.min_rows > 0 && x.size(0) >= dense.min_rows ? qmatmul_dense(x, blocks, qtypes, dense.tile_rows)
                                                               : qmatmul(x, blocks, qtypes);
    if (lora_slots.defined() && lora) lora_add_(y, x, lora->a, lora->b_t, lora_slots, lora->width);
    return bias ? y + *bias : y;
  }
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm;
  double attn_eps, mlp_eps;
  c10::optional<torch::Tensor> post_attn_norm, post_mlp_norm;  // Gemma's sandwich norms
  double post_attn_eps = 0, post_mlp_eps = 0;
  Linear qkv, o, gate_up, down;
  c10::optional<torch::Tensor> q_norm, k_norm;
  double qk_eps = 0;
  int64_t heads, kv_heads;
  torch::Tensor k, v;
  c10::optional<torch::Tensor> k_scale, v_scale, k_offset, v_offset;
  double scale;
  int64_t window;
  double softcap;
  std::string act;
  size_t rope;
};

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return at::rms_norm(x, {x.size(1)}, w, eps);
}

Linear linear_of(const py::handle& spec) {
  const auto t = spec.cast<py::tuple>();  // (blocks, qtypes, bias, (lora A, lora Bᵀ, width) or None)
  c10::optional<Lora> lora;
  if (!t[3].is_none()) {
    const auto l = t[3].cast<py::tuple>();
    lora = Lora{l[0].cast<torch::Tensor>(), l[1].cast<torch::Tensor>(), l[2].cast<int64_t>()};
  }
  return {t[0].cast<std::vector<torch::Tensor>>(), t[1].cast<std::vector<int64_t>>(),
          t[2].cast<c10::optional<torch::Tensor>>(), lora};
}

// (weight, eps) or None
c10::optional<torch::Tensor> norm_of(const py::handle& spec, double& eps) {
  if (spec.is_none()) return c10::nullopt;
  const auto t = spec.cast<py::tuple>();
  eps = t[1].cast<double>();
  return t[0].cast<torch::Tensor>();
}

class DecoderPlan {
 public:
  // `specs`: one dict a layer, as models/llama.py `block_spec` writes it, plus "kv" (the layer's
  // LayerKV) and "rope" (the index of its cos/sin pair among those `run` receives).
  explicit DecoderPlan(const py::list& specs) {
    for (const auto& item : specs) {
      const auto s = item.cast<py::dict>();
      Layer l;
      l.attn_norm = *norm_of(s["attn_norm"], l.attn_eps);
      l.mlp_norm = *norm_of(s["mlp_norm"], l.mlp_eps);
      l.post_attn_norm = norm_of(s["post_attn_norm"], l.post_attn_eps);
      l.post_mlp_norm = norm_of(s["post_mlp_norm"], l.post_mlp_eps);
      l.qkv = linear_of(s["qkv"]);
      l.o = linear_of(s["o"]);
      l.gate_up = linear_of(s["gate_up"]);
      l.down = linear_of(s["down"]);
      l.q_norm = norm_of(s["q_norm"], l.qk_eps);
      l.k_norm = norm_of(s["k_norm"], l.qk_eps);
      l.heads = s["heads"].cast<int64_t>();
      l.kv_heads = s["kv_heads"].cast<int64_t>();
      const auto kv = s["kv"].cast<py::tuple>();  // k, v, k_scale, v_scale, k_offset, v_offset
      l.k = kv[0].cast<torch::Tensor>();
      l.v = kv[1].cast<torch::Tensor>();
      l.k_scale = kv[2].cast<c10::optional<torch::Tensor>>();
      l.v_scale = kv[3].cast<c10::optional<torch::Tensor>>();
      l.k_offset = kv[4].cast<c10::optional<torch::Tensor>>();
      l.v_offset = kv[5].cast<c10::optional<torch::Tensor>>();
      l.scale = s["scale"].cast<double>();
      l.window = s["window"].cast<int64_t>();
      l.softcap = s["softcap"].cast<double>();
      l.act = s["act"].cast<std::string>();
      l.rope = s["rope"].cast<size_t>();
      layers_.push_back(std::move(l));
    }
  }

  // h [T, hidden] float32: the embedded tokens, added to in place as the Python path does. Returns
  // (h, delta) after the last layer (its output is h + delta, the final norm adds them).
  // dense_min_rows: as QuantLinear, calls of that many rows take the dense path (0: none does).
  // lora_slots: each row's adapter slot where some row uses a LoRA adapter (layers/lora.py), else None.
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor h, const std::vector<torch::Tensor>& cos,
                                               const std::vector<torch::Tensor>& sin,
                                               const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                               const torch::Tensor& query_start, const torch::Tensor& context_lens,
                                               int64_t block_size, int64_t dense_min_rows, int64_t dense_tile_rows,
                                               const c10::optional<torch::Tensor>& lora_slots) {
    const Dense dense{dense_min_rows, dense_tile_rows};
    const torch::Tensor step = lora_slots ? *lora_slots : torch::Tensor();
    torch::Tensor d;  // the residual the next norm adds (none before the first layer)
    for (auto& l : layers_) {
      const auto x = d.defined() ? add_rms_norm_(h, d, l.attn_norm, l.attn_eps) : rms_norm(h, l.attn_norm, l.attn_eps);
      const auto q = rope_write_kv(l.qkv(x, dense, step), cos.at(l.rope), sin.at(l.rope), l.k, l.v, slot_mapping, l.heads, l.kv_heads, l.q_norm,
                                   l.k_norm, l.qk_eps, l.k_scale, l.v_scale, l.k_offset, l.v_offset);
      const auto a = paged_attention(q, l.k, l.v, l.k_scale, l.v_scale, l.k_offset, l.v_offset, block_tables,
                                     query_start, context_lens, block_size, l.scale, l.window, l.softcap);
      auto attn = l.o(a.flatten(1), dense, step);
      if (l.post_attn_norm) attn = rms_norm(attn, *l.post_attn_norm, l.post_attn_eps);
      const auto x2 = add_rms_norm_(h, attn, l.mlp_norm, l.mlp_eps);
      d = l.down(gated_act(l.gate_up(x2, dense, step), l.act), dense, step);
      if (l.post_mlp_norm) d = rms_norm(d, *l.post_mlp_norm, l.post_mlp_eps);
    }
    return {h, d};
  }

  size_t size() const { return layers_.size(); }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decoder_plan(py::module& m) {
  py::class_<DecoderPlan>(m, "DecoderPlan", "a Llama-family or Gemma layer stack run from C++ (csrc/decoder_plan.cpp)")
      .def(py::init<const py::list&>(), py::arg("specs"))
      .def("run", &DecoderPlan::run, "(h, delta) through every layer", py::arg("h"), py::arg("cos"), py::arg("sin"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("query_start"), py::arg("context_lens"),
           py::arg("block_size"), py::arg("dense_min_rows"), py::arg("dense_tile_rows"), py::arg("lora_slots"),
           py::call_guard<py::gil_scoped_release>())
      .def("__len__", &DecoderPlan::size);
}
