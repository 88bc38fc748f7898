// The torch-facing side of paged attention: argument checks, the output, and the split of
// (sequence, KV head) items over threads. The kernels (attention_*.cpp) see raw pointers.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention.h"
#include "torch_ops.h"

int wb_kernel_level();  // ops.cpp: 0 generic, 1 avx2, 2 avx512

namespace {

int kv_type_of(const torch::Tensor& cache) {
  switch (cache.scalar_type()) {
    case torch::kFloat: return wb::KV_F32;
    case torch::kBFloat16: return wb::KV_BF16;
    case torch::kHalf: return wb::KV_F16;
    case torch::kChar: return wb::KV_INT8;
    case torch::kFloat8_e4m3fn: return wb::KV_FP8;
    default: TORCH_CHECK(false, "paged_attention: unsupported KV cache dtype ", cache.scalar_type());
  }
}

}  // namespace

// q [T, H, D] float32; k_cache, v_cache [KVH, S, D]; scales [KVH, S] float32 for int8/fp8 pages,
// and optionally offsets [KVH, D] float32 (a row then stands for page * scale + offset);
// block_tables [N, W] int32; query_start [N + 1] int32; context_lens [N] int32; sinks [H] float32
// or none (gpt-oss: a score per query head in the softmax's denominator). Returns [T, H, D].
torch::Tensor paged_attention(const torch::Tensor& q_in, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                              const c10::optional<torch::Tensor>& k_offset,
                              const c10::optional<torch::Tensor>& v_offset, const torch::Tensor& block_tables,
                              const torch::Tensor& query_start, const torch::Tensor& context_lens, int64_t block_size,
                              double scale, int64_t window, double softcap,
                              const c10::optional<torch::Tensor>& sinks) {
  auto q = q_in.to(torch::kFloat).contiguous();
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "paged_attention: q [T, H, D], caches [KVH, S, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_attention: the caches must be contiguous and of one dtype");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(0), S = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D && H % KVH == 0 && H / KVH <= 64, "paged_attention: head shapes do not match");
  const int kv_type = kv_type_of(k_cache);
  const bool scaled = kv_type == wb::KV_INT8 || kv_type == wb::KV_FP8;
  TORCH_CHECK(scaled == (k_scale.has_value() && v_scale.has_value()), "paged_attention: int8/fp8 pages need scales");
  TORCH_CHECK(k_offset.has_value() == v_offset.has_value() && (scaled || !k_offset.has_value()),
              "paged_attention: offsets come in pairs, with int8/fp8 pages");
  for (const auto* t : {&k_offset, &v_offset})
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == torch::kFloat && (*t)->is_contiguous() &&
                                    (*t)->dim() == 2 && (*t)->size(0) == KVH && (*t)->size(1) == D),
                "paged_attention: offsets must be float32 [KVH, D]");
  for (const auto* t : {&block_tables, &query_start, &context_lens})
    TORCH_CHECK(t->scalar_type() == torch::kInt && t->is_contiguous(), "paged_attention: int32 tables");
  const int64_t N = context_lens.size(0);
  TORCH_CHECK(query_start.size(0) == N + 1 && block_tables.dim() == 2 && block_tables.size(0) == N,
              "paged_attention: one table row, context length and query range per sequence");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == torch::kFloat && sinks->is_contiguous() &&
                                      sinks->dim() == 1 && sinks->size(0) == H),
              "paged_attention: sinks must be float32 [H]");
  auto out = torch::empty_like(q);
  wb::AttnArgs a{};
  a.q = q.data_ptr<float>();
  a.out = out.data_ptr<float>();
  a.k = k_cache.data_ptr();
  a.v = v_cache.data_ptr();
  a.k_scale = scaled ? k_scale->data_ptr<float>() : nullptr;
  a.v_scale = scaled ? v_scale->data_ptr<float>() : nullptr;
  a.k_offset = k_offset.has_value() ? k_offset->data_ptr<float>() : nullptr;
  a.v_offset = v_offset.has_value() ? v_offset->data_ptr<float>() : nullptr;
  a.kv_type = kv_type;
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.block_table_stride = block_tables.size(1);
  a.query_start = query_start.data_ptr<int32_t>();
  a.context_lens = context_lens.data_ptr<int32_t>();
  a.num_heads = H;
  a.num_kv_heads = KVH;
  a.head_dim = D;
  a.slots = S;
  a.block_size = block_size;
  a.scale = (float)scale;
  a.window = window;
  a.softcap = (float)softcap;
  a.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  wb::AttnFn fn = wb_kernel_level() >= 1 && D % 8 == 0 && wb_attention_avx2() ? wb_attention_avx2()
                                                                                : wb_attention_generic();
  // Few (sequence, KV head) pairs for the threads (one long prefill chunk): each pair's query
  // blocks are split over a few work items, so that no thread waits on another's share.
  const int64_t pairs = N * KVH, threads = at::get_num_threads();
  int64_t longest = 0;
  const int32_t* qs = query_start.data_ptr<int32_t>();
  for (int64_t n = 0; n < N; n++) longest = std::max<int64_t>(longest, qs[n + 1] - qs[n]);
  const int64_t blocks = (longest + wb::kQueryBlock - 1) / wb::kQueryBlock;
  a.query_parts = pairs >= 2 * threads ? 1 : std::max<int64_t>(1, std::min<int64_t>(blocks, (2 * threads + pairs - 1) / pairs));
  const int64_t items = pairs * a.query_parts;
  if (items == 0) return out;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) { fn(a, i0, i1); });
  return out;
}
