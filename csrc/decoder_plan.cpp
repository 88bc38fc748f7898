// A Llama-family decoder stack run from C++ for steps of a few tokens per sequence (decode,
// speculative verification): the same ops as models/llama.py's DecoderLayer, in the same order,
// with no Python between them.
//
// Why: a SmolLM2 decode step makes some 240 calls from Python into these ops, ~1 ms of a ~5 ms
// step at 2 threads on a Xeon. The plan holds each layer's tensors (built once, models/llama.py
// `DecoderPlan`), and a step passes only its own metadata; the GIL is released for the whole
// stack, so a server's threads run meanwhile. Bit-identical to the Python path (the same kernels on
// the same inputs): tests/test_decoder_plan.py.
#include <torch/extension.h>

#include <string>
#include <vector>

// ops.cpp, attention_ops.cpp, fused_ops.cpp
torch::Tensor qmatmul(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                      const std::vector<int64_t>& qtypes);
torch::Tensor qmatmul_dense(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                            const std::vector<int64_t>& qtypes, int64_t tile);
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                              const c10::optional<torch::Tensor>& k_offset,
                              const c10::optional<torch::Tensor>& v_offset, const torch::Tensor& block_tables,
                              const torch::Tensor& query_start, const torch::Tensor& context_lens, int64_t block_size,
                              double scale, int64_t window, double softcap);
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& w, double eps);
torch::Tensor gated_act(const torch::Tensor& gate_up, const std::string& act);
torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                            int64_t H, int64_t KVH, const c10::optional<torch::Tensor>& q_norm,
                            const c10::optional<torch::Tensor>& k_norm, double eps,
                            const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                            const c10::optional<torch::Tensor>& k_offset,
                            const c10::optional<torch::Tensor>& v_offset);

namespace {

// Where a call takes the dense path (layers/linear.py QuantLinear): from `min_rows` rows (0: never),
// `tile_rows` weight rows decoded at a time.
struct Dense {
  int64_t min_rows, tile_rows;
};

// A quantized linear layer: its segments (fused projections) and their GGML types, and a bias.
struct Linear {
  std::vector<torch::Tensor> blocks;
  std::vector<int64_t> qtypes;
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x, const Dense& dense) const {
    auto y = dense.min_rows > 0 && x.size(0) >= dense.min_rows ? qmatmul_dense(x, blocks, qtypes, dense.tile_rows)
                                                               : qmatmul(x, blocks, qtypes);
    return bias ? y + *bias : y;
  }
};

struct Layer {
  torch::Tensor attn_norm, mlp_norm;
  double attn_eps, mlp_eps;
  Linear qkv, o, gate_up, down;
  c10::optional<torch::Tensor> q_norm, k_norm;
  double qk_eps;
  int64_t heads, kv_heads;
  torch::Tensor k, v;
  c10::optional<torch::Tensor> k_scale, v_scale, k_offset, v_offset;
  double scale;
  int64_t window;
  double softcap;
  std::string act;
};

Linear linear_of(const py::object& module) {
  Linear l;
  l.blocks = module.attr("blocks").cast<std::vector<torch::Tensor>>();
  l.qtypes = module.attr("qtypes").cast<std::vector<int64_t>>();
  l.bias = module.attr("_bias").cast<c10::optional<torch::Tensor>>();
  return l;
}

c10::optional<torch::Tensor> norm_weight(const py::object& norm) {
  if (norm.is_none()) return c10::nullopt;
  return norm.attr("weight").cast<torch::Tensor>();
}

class DecoderPlan {
 public:
  // `layers`: models/llama.py DecoderLayer modules whose linears are QuantLinear and whose
  // attention has its KV pages bound (the caller checks both).
  explicit DecoderPlan(const py::list& layers) {
    for (const auto& obj : layers) {
      const py::object layer = py::reinterpret_borrow<py::object>(obj);
      const py::object attn = layer.attr("attn"), mlp = layer.attr("mlp"), kv = attn.attr("kv");
      Layer l;
      l.attn_norm = layer.attr("attn_norm").attr("weight").cast<torch::Tensor>();
      l.attn_eps = layer.attr("attn_norm").attr("eps").cast<double>();
      l.mlp_norm = layer.attr("mlp_norm").attr("weight").cast<torch::Tensor>();
      l.mlp_eps = layer.attr("mlp_norm").attr("eps").cast<double>();
      l.qkv = linear_of(attn.attr("qkv"));
      l.o = linear_of(attn.attr("o"));
      l.gate_up = linear_of(mlp.attr("gate_up"));
      l.down = linear_of(mlp.attr("down"));
      l.q_norm = norm_weight(attn.attr("q_norm"));
      l.k_norm = norm_weight(attn.attr("k_norm"));
      l.qk_eps = attn.attr("q_norm").is_none() ? 0.0 : attn.attr("q_norm").attr("eps").cast<double>();
      l.heads = attn.attr("num_heads").cast<int64_t>();
      l.kv_heads = attn.attr("num_kv_heads").cast<int64_t>();
      l.k = kv.attr("k").cast<torch::Tensor>();
      l.v = kv.attr("v").cast<torch::Tensor>();
      l.k_scale = kv.attr("k_scale").cast<c10::optional<torch::Tensor>>();
      l.v_scale = kv.attr("v_scale").cast<c10::optional<torch::Tensor>>();
      l.k_offset = kv.attr("k_offset").cast<c10::optional<torch::Tensor>>();
      l.v_offset = kv.attr("v_offset").cast<c10::optional<torch::Tensor>>();
      l.scale = attn.attr("scale").cast<double>();
      const py::object window = attn.attr("sliding_window"), softcap = attn.attr("softcap");
      l.window = window.is_none() ? 0 : window.cast<int64_t>();
      l.softcap = softcap.is_none() ? 0.0 : softcap.cast<double>();
      l.act = mlp.attr("act").cast<std::string>();
      layers_.push_back(std::move(l));
    }
  }

  // h [T, hidden] float32 (added to in place, as the Python path does), delta: the residual the
  // first layer's norm adds (None: h is the embedding). Returns (h, delta) after the last layer.
  // dense_min_rows: as QuantLinear, calls of that many rows take the dense path (0: none does).
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor h, c10::optional<torch::Tensor> delta,
                                               const torch::Tensor& cos, const torch::Tensor& sin,
                                               const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                               const torch::Tensor& query_start, const torch::Tensor& context_lens,
                                               int64_t block_size, int64_t dense_min_rows, int64_t dense_tile_rows) {
    const Dense dense{dense_min_rows, dense_tile_rows};
    torch::Tensor d = delta ? *delta : torch::Tensor();
    for (auto& l : layers_) {
      const auto x = d.defined() ? add_rms_norm_(h, d, l.attn_norm, l.attn_eps)
                                 : at::rms_norm(h, {h.size(1)}, l.attn_norm, l.attn_eps);
      const auto q = rope_write_kv(l.qkv(x, dense), cos, sin, l.k, l.v, slot_mapping, l.heads, l.kv_heads, l.q_norm,
                                   l.k_norm, l.qk_eps, l.k_scale, l.v_scale, l.k_offset, l.v_offset);
      const auto a = paged_attention(q, l.k, l.v, l.k_scale, l.v_scale, l.k_offset, l.v_offset, block_tables,
                                     query_start, context_lens, block_size, l.scale, l.window, l.softcap);
      const auto x2 = add_rms_norm_(h, l.o(a.flatten(1), dense), l.mlp_norm, l.mlp_eps);
      d = l.down(gated_act(l.gate_up(x2, dense), l.act), dense);
    }
    return {h, d};
  }

  size_t size() const { return layers_.size(); }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

void bind_decoder_plan(py::module& m) {
  py::class_<DecoderPlan>(m, "DecoderPlan", "a Llama-family layer stack run from C++ (csrc/decoder_plan.cpp)")
      .def(py::init<const py::list&>(), py::arg("layers"))
      .def("run", &DecoderPlan::run, "(h, delta) through every layer", py::arg("h"), py::arg("delta"),
           py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"), py::arg("block_tables"), py::arg("query_start"),
           py::arg("context_lens"), py::arg("block_size"), py::arg("dense_min_rows"), py::arg("dense_tile_rows"),
           py::call_guard<py::gil_scoped_release>())
      .def("__len__", &DecoderPlan::size);
}
