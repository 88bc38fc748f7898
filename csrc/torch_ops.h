// The torch-facing functions of the extension's files, for the files that call one another's
// (ops.cpp binds them all; decoder_plan.cpp runs a layer stack through them).
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

// ops.cpp
torch::Tensor qmatmul(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                      const std::vector<int64_t>& qtypes, bool prompt = false);
torch::Tensor qmatmul_dense(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                            const std::vector<int64_t>& qtypes, int64_t tile, int64_t chunk = 0);

// flash_prefill.cpp
bool flash_prefill_supported();
torch::Tensor flash_prefill(const torch::Tensor& q_in, const torch::Tensor& k_pages, const torch::Tensor& v_pages,
                            const torch::Tensor& slots, const torch::Tensor& first, const torch::Tensor& last,
                            double scale);

// attention_ops.cpp
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                              const c10::optional<torch::Tensor>& k_offset,
                              const c10::optional<torch::Tensor>& v_offset, const torch::Tensor& block_tables,
                              const torch::Tensor& query_start, const torch::Tensor& context_lens, int64_t block_size,
                              double scale, int64_t window, double softcap,
                              const c10::optional<torch::Tensor>& sinks = c10::nullopt);

// recurrent_ops.cpp
torch::Tensor ssm_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor x, torch::Tensor B,
                       torch::Tensor C, torch::Tensor dt, torch::Tensor A, torch::Tensor D,
                       c10::optional<torch::Tensor> logged = c10::nullopt);
torch::Tensor ssm1_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor x,
                        torch::Tensor dt, torch::Tensor B, torch::Tensor C, torch::Tensor A);
torch::Tensor conv_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor x,
                        torch::Tensor weight, c10::optional<torch::Tensor> bias, bool silu);
torch::Tensor delta_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor q, torch::Tensor k,
                         torch::Tensor v, torch::Tensor g, torch::Tensor beta);
torch::Tensor wkv7_step(torch::Tensor pool, torch::Tensor src, torch::Tensor dst, torch::Tensor r, torch::Tensor w,
                        torch::Tensor k, torch::Tensor v, torch::Tensor a, torch::Tensor b);

// rwkv7_ops.cpp
torch::Tensor rwkv7_mix(torch::Tensor k, torch::Tensor v, torch::Tensor w_low, torch::Tensor a_low,
                        c10::optional<torch::Tensor> v_low, c10::optional<torch::Tensor> v_first, torch::Tensor w0,
                        torch::Tensor a0, c10::optional<torch::Tensor> v0, torch::Tensor k_k, torch::Tensor k_a,
                        int64_t head_size);
torch::Tensor rwkv7_out(torch::Tensor y, torch::Tensor r, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                        torch::Tensor ln_w, torch::Tensor ln_b, torch::Tensor r_k, int64_t head_size, double eps);

// fused_ops.cpp
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& w, double eps);
torch::Tensor gated_act(const torch::Tensor& gate_up, const std::string& act);
torch::Tensor rope_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                            torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slot_mapping,
                            int64_t H, int64_t KVH, const c10::optional<torch::Tensor>& q_norm,
                            const c10::optional<torch::Tensor>& k_norm, double eps,
                            const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                            const c10::optional<torch::Tensor>& k_offset,
                            const c10::optional<torch::Tensor>& v_offset);

// lora_ops.cpp
void lora_add_(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b_t,
               const torch::Tensor& slots, int64_t width);
