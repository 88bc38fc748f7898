// Paged attention for a few queries per sequence (decode, speculative verification) over a KV
// pool of blocks: the interface between the torch-facing attention_ops.cpp and the per-ISA files.
// Plain C++ types only (see qkernels.h for why).
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace wb {

enum KVType : int { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8 = 3, KV_F16 = 4 };

struct AttnArgs {
  const float* q;  // [T, H, D] the queries, sequence after sequence
  float* out;      // [T, H, D]
  const void* k;   // [KVH, S, D] of kv_type: a layer's K for every slot of the pool
  const void* v;
  const float* k_scale;  // [KVH, S] per token and head (int8, fp8), else nullptr
  const float* v_scale;
  const float* k_offset;  // [KVH, D] added back to every dequantized K (V) row, else nullptr
  const float* v_offset;
  int kv_type;
  const int32_t* block_tables;  // [N, W] physical block ids
  int64_t block_table_stride;   // W
  const int32_t* query_start;   // [N + 1] sequence n's queries are rows query_start[n] .. query_start[n + 1]
  const int32_t* context_lens;  // [N] tokens in the cache after this step, the queries' own included
  int64_t num_heads, num_kv_heads, head_dim;
  int64_t slots;  // S
  int64_t block_size;
  float scale;
  int64_t window;  // a query at position p sees keys p - window < key <= p; 0: no window
  float softcap;   // scores -> softcap * tanh(score / softcap); 0: none
  const float* sinks;  // [H] gpt-oss's attention sinks: one more score per query head, of a key whose value
                       // is zero (it joins the softmax's denominator only); nullptr: none
  int64_t query_parts;  // work items per (sequence, KV head): part p takes query blocks p, p + parts, ...
};

constexpr int64_t kQueryBlock = 8;  // queries of one sequence that share each K and V row's load

// Work item i is part i % query_parts of (sequence, KV head) i / query_parts (sequence
// that / num_kv_heads, KV head that % num_kv_heads): its query heads, its share of the queries.
typedef void (*AttnFn)(const AttnArgs& args, int64_t item0, int64_t item1);

}  // namespace wb

extern "C" wb::AttnFn wb_attention_generic();
extern "C" wb::AttnFn wb_attention_avx2();  // nullptr where not built; also serves the avx512 level
