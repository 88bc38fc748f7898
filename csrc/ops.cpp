// The torch-facing side of the quantized matmul: argument checks, output allocation, activation
// quantization, the split of weight rows over threads (at::parallel_for, so torch.set_num_threads
// governs it) and the choice of kernel level. The kernels themselves (kernels_*.cpp) see raw pointers.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "qkernels.h"
#include "torch_ops.h"

namespace wb {
namespace {
#include "qblocks.inc"  // block_size_of, block_bytes_of (from the format table)
}  // namespace
}  // namespace wb

extern "C" bool wb_dequant_bf16_avx512(int qt, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                                       int64_t K, uint16_t* out, int64_t ldo);

namespace {

// The x86 levels nest (a CPU that runs avx512 runs avx2); arm stands beside them (runs_here).
enum Level : int { GENERIC = 0, AVX2 = 1, AVX512 = 2, ARM = 3 };
constexpr int kLevels = 4;
const char* kNames[kLevels] = {"generic", "avx2", "avx512", "arm"};

int cpu_level() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (wb_kernels_avx512() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return AVX512;
  if (wb_kernels_avx2() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return AVX2;
#endif
  if (wb_kernels_arm() && (wb_arm_features() & WB_ARM_DOTPROD)) return ARM;  // aarch64 with dotprod
  return GENERIC;
}

// Whether this CPU runs level l: generic and its best; below an x86 best, the x86 levels under it.
bool runs_here(int l) {
  const int best = cpu_level();
  return l == GENERIC || l == best || (best != ARM && l != ARM && l < best);
}

int parse_level(const std::string& name) {
  for (int i = 0; i < kLevels; i++)
    if (name == kNames[i]) return i;
  return -1;
}

std::atomic<int> g_level{-1};
std::once_flag g_once;

void init_level() {
  int level = cpu_level();
  // ATen's own switch first (avx2 -> our avx2, default -> generic), then ours, which wins.
  if (const char* aten = std::getenv("ATEN_CPU_CAPABILITY")) {
    const std::string v(aten);
    if (v == "default") level = GENERIC;
    else if (v == "avx2" && level == AVX512) level = AVX2;
  }
  if (const char* ours = std::getenv("WALLBREAKER_CPU_ISA")) {
    const int want = parse_level(ours);
    TORCH_CHECK(want >= 0, "WALLBREAKER_CPU_ISA=", ours, ": expected avx512, avx2, arm or generic");
    TORCH_CHECK(runs_here(want), "WALLBREAKER_CPU_ISA=", ours, ": this CPU supports at most ",
                kNames[cpu_level()]);
    level = want;
  }
  g_level.store(level);
}

int level() {
  std::call_once(g_once, init_level);
  return g_level.load();
}

const wb::Kernels* kernels() {
  switch (level()) {
    case AVX512: return wb_kernels_avx512();
    case AVX2: return wb_kernels_avx2();
    case ARM: return wb_kernels_arm();
    default: return wb_kernels_generic();
  }
}

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// One quantized activation buffer per calling thread, grown as needed and reused.
struct Workspace {
  std::vector<uint8_t> bytes;
  uint8_t* get(size_t n) {
    if (bytes.size() < n + 64) bytes.resize(n + 64);
    return reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<int64_t>(bytes.data()), 64));
  }
};
thread_local Workspace t_work;

// Formats sent to the generic level's kernel whatever the level (`_C.set_generic_formats`): how
// tests and benchmarks see the fallback that a format without tiles at a level takes.
std::atomic<uint64_t> g_generic_formats{0};

bool level_has(const wb::Kernels* k, int64_t qt) {
  return k->has((int)qt) && !(qt < 64 && (g_generic_formats.load() >> qt) & 1);
}

// Below this (weight bytes x rows) one thread is faster: the fork and join of a second one costs
// about what it saves. Q4_1, batch 1, from DRAM, min of 9 passes (Zen 4/5, 2 threads): 202 KB 8.0 us
// on one thread, 9.6 on two; 338 KB 12.3 and 12.0; 540 KB 18.5 and 15.3.
constexpr int64_t kSingleThreadBytes = 320 * 1024;

}  // namespace

// For attention_ops.cpp and vec_math.h: 0 generic, 1 avx2, 2 avx512. They have no arm variants
// yet, so the arm level runs their generic ones (GCC's vector extension lowers those to NEON).
int wb_kernel_level() { return level() == ARM ? GENERIC : level(); }

std::string get_isa() { return kNames[level()]; }

std::string cpu_isa() { return kNames[cpu_level()]; }

void set_isa(const std::string& name) {
  level();  // the environment is read once, before any override
  const int want = name.empty() ? cpu_level() : parse_level(name);
  TORCH_CHECK(want >= 0, "unknown kernel level '", name, "': expected avx512, avx2, arm or generic");
  TORCH_CHECK(runs_here(want), "kernel level '", name, "' needs CPU features this machine lacks (it supports ",
              kNames[cpu_level()], ")");
  g_level.store(want);
}

// The segments' checks (each W_i [N_i, row_bytes_i] uint8 of a known qtype, rows of K values);
// returns sum N_i and which activation block sizes they need.
// Checks the segments (types, shapes, row bytes); returns their rows in all.
int64_t check_segments(const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& qtypes, int64_t K) {
  int64_t N = 0;
  for (size_t i = 0; i < weights.size(); i++) {
    const auto& w = weights[i];
    const int bs = wb::block_size_of(qtypes[i]);
    TORCH_CHECK(bs, "qmatmul: unsupported qtype ", qtypes[i]);
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
                "qmatmul: weight ", i, " must be a contiguous 2-d uint8 CPU tensor");
    TORCH_CHECK(K % bs == 0 && w.size(1) == K / bs * wb::block_bytes_of(qtypes[i]), "qmatmul: weight ", i, " has ",
                w.size(1), " bytes a row, expected ", K / bs * wb::block_bytes_of(qtypes[i]), " for K=", K);
    N += w.size(0);
  }
  return N;
}

// y[M, sum N_i] = x[M, K] @ concat_i(W_i)^T, W_i [N_i, row_bytes_i] uint8 GGUF blocks of qtypes[i].
// prompt: the level's prompt tiles (Kernels::prefill) where it has them for the format.
torch::Tensor qmatmul(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                      const std::vector<int64_t>& qtypes, bool prompt) {
  TORCH_CHECK(weights.size() == qtypes.size() && !weights.empty(), "qmatmul: one qtype per weight segment");
  TORCH_CHECK(x_in.dim() == 2, "qmatmul: x must be [M, K]");
  TORCH_CHECK(x_in.device().is_cpu(), "qmatmul: CPU tensors only");
  auto x = x_in.scalar_type() == torch::kFloat ? x_in : x_in.to(torch::kFloat);
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const wb::Kernels *k = kernels(), *generic = wb_kernels_generic();
  const int64_t N = check_segments(weights, qtypes, K);
  // Which activations the segments need: 32-block ones quantized by the level (need32) or, for a
  // format it has no kernel for, by the generic level in its own order (need32g); 256-block ones
  // (both levels read the natural order these keep).
  bool need32 = false, need32g = false, need256 = false;
  for (auto qt : qtypes) (wb::block_size_of(qt) == 256 ? need256 : level_has(k, qt) ? need32 : need32g) = true;
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  if (M == 0 || N == 0) return out;

  // Quantized activations: [q32 | d32 | s32 | q256 | qk256 | d256 | bsums256 | bsums32_256 | the generic
  // level's q32 | d32 | s32], each part 64-byte aligned. d and s rows are zero-padded to 16 blocks:
  // the kernels read them 8 or 16 at a time.
  const int64_t ldq = round_up(K, 64), ldb32 = round_up(K / 32, 16), ldb256 = K / 256;
  size_t off = 0;
  auto take = [&](size_t n) { size_t at = off; off += round_up((int64_t)n, 64); return at; };
  const size_t oq32 = need32 ? take(M * ldq) : 0, od32 = need32 ? take(M * ldb32 * 4) : 0,
               os32 = need32 ? take(M * ldb32 * 4) : 0;
  const size_t oq256 = need256 ? take(M * ldq) : 0, ok256 = need256 ? take(M * ldq) : 0,
               od256 = need256 ? take(M * ldb256 * 4) : 0, ob256 = need256 ? take(M * ldb256 * 32) : 0,
               oc256 = need256 ? take(M * ldb256 * 16) : 0;
  const size_t gq32 = need32g ? take(M * ldq) : 0, gd32 = need32g ? take(M * ldb32 * 4) : 0,
               gs32 = need32g ? take(M * ldb32 * 4) : 0;
  uint8_t* ws = t_work.get(off);
  wb::ActQ8 a32{}, a32g{}, a256{};
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  if (need32) {
    memset(ws + od32, 0, 2 * (os32 - od32));  // d32 and s32 (adjacent, same size)
    a32 = {(int8_t*)(ws + oq32), nullptr, (float*)(ws + od32), (float*)(ws + os32), nullptr, nullptr, ldq, ldb32};
  }
  if (need32g) {
    memset(ws + gd32, 0, 2 * (gs32 - gd32));
    a32g = {(int8_t*)(ws + gq32), nullptr, (float*)(ws + gd32), (float*)(ws + gs32), nullptr, nullptr, ldq, ldb32};
  }
  if (need256) {
    a256 = {(int8_t*)(ws + oq256), (int8_t*)(ws + ok256), (float*)(ws + od256), nullptr, (int16_t*)(ws + ob256),
            (int16_t*)(ws + oc256), ldq, ldb256};
  }
  auto quantize = [&](int64_t m0, int64_t m1) {
    if (need32) k->quantize32(xp, ldx, m0, m1, K, (int8_t*)a32.q, ldq, (float*)a32.d, (float*)a32.s, ldb32);
    if (need32g)
      generic->quantize32(xp, ldx, m0, m1, K, (int8_t*)a32g.q, ldq, (float*)a32g.d, (float*)a32g.s, ldb32);
    if (need256)
      k->quantize256(xp, ldx, m0, m1, K, (int8_t*)a256.q, (int8_t*)a256.qk, ldq, (float*)a256.d,
                     (int16_t*)a256.bsums, (int16_t*)a256.bsums32, ldb256);
  };
  if (M >= 16) at::parallel_for(0, M, 8, quantize);
  else quantize(0, M);

  // Split the rows of all segments by bytes into one contiguous range per thread.
  int64_t total = 0;
  for (auto& w : weights) total += w.size(0) * w.size(1);
  const int64_t threads = total * M < kSingleThreadBytes ? 1 : at::get_num_threads();
  float* op = out.data_ptr<float>();
  bool ok = true;
  auto run_part = [&](int64_t t) {
    const int64_t lo = total * t / threads, hi = total * (t + 1) / threads;
    int64_t seg_start = 0, col = 0;
    for (size_t i = 0; i < weights.size(); i++) {
      const auto& w = weights[i];
      const int64_t rows = w.size(0), rb = w.size(1), seg_end = seg_start + rows * rb;
      // rows of this segment whose first byte falls in [lo, hi), in multiples of a tile's weight rows
      auto row_at = [&](int64_t pos) {
        if (pos <= seg_start) return (int64_t)0;
        if (pos >= seg_end) return rows;
        const int64_t r = round_up((pos - seg_start + rb - 1) / rb, prompt ? 32 : 4);
        return r < rows ? r : rows;
      };
      const int64_t n0 = row_at(lo), n1 = row_at(hi);
      if (n1 > n0) {
        const bool own = level_has(k, qtypes[i]);  // else the generic level's kernel
        const wb::ActQ8* act = wb::block_size_of(qtypes[i]) == 256 ? &a256 : own ? &a32 : &a32g;
        const uint8_t* wp = w.data_ptr<uint8_t>();
        if (!(own && prompt && k->prefill && k->prefill((int)qtypes[i], wp, rb, n0, n1, K, act, M, op + col + n0, N)) &&
            !(own ? k : generic)->matmul((int)qtypes[i], wp, rb, n0, n1, K, act, M, op + col + n0, N))
          ok = false;
      }
      seg_start = seg_end;
      col += rows;
    }
  };
  if (threads == 1) {
    run_part(0);
  } else {
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; t++) run_part(t);
    });
  }
  TORCH_CHECK(ok, "qmatmul: the kernel refused its arguments (K too large?)");
  return out;
}

bool dense_supported() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

// W_i's rows [n0, n1) decoded to bfloat16 [n1 - n0, K] (the dense path's tiles; tests).
torch::Tensor dequant_bf16(const torch::Tensor& w, int64_t qtype, int64_t K, int64_t n0, int64_t n1) {
  TORCH_CHECK(dense_supported(), "dequant_bf16: needs AVX-512 with BF16");
  check_segments({w}, {qtype}, K);
  TORCH_CHECK(0 <= n0 && n0 <= n1 && n1 <= w.size(0), "dequant_bf16: rows [", n0, ", ", n1, ") out of range");
  auto out = torch::empty({n1 - n0, K}, w.options().dtype(torch::kBFloat16));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    wb_dequant_bf16_avx512((int)qtype, wp, w.size(1), a, b, K, op + (a - n0) * K, K);
  });
  return out;
}

// The dense prefill path: y = x @ concat(W_i)^T as qmatmul, but by decoding `tile` weight rows at a
// time to bfloat16 and multiplying in PyTorch's bfloat16 matmul (oneDNN; AMX where the CPU has it).
// Decoding costs once per call whatever M, so it pays from a few dozen rows on. Activations and the
// products are rounded to bfloat16 (oneDNN's CPU matmul has no float32 output for bfloat16 inputs),
// where qmatmul rounds activations to 8 bits per block; float32 out.
//
// `chunk` > 0: the matmuls run over exactly `chunk` rows at a time, the last chunk padded with zeros.
// oneDNN picks its kernel (and so its order of summation) by the shape of the call: a row among 33
// to ~500 rows gets other bits than the same row among 32 or among 512 (Xeon with AMX, torch 2.13),
// so only calls of one shape give a row the same bits whatever else the call holds (batch-invariant
// mode, layers/linear.py); each runs on one thread, since the kernel also depends on the threads.
// 0: one matmul over all M rows.
constexpr int64_t kDenseColumns = 256;  // columns of one matmul block of qmatmul_dense's chunked form

torch::Tensor qmatmul_dense(const torch::Tensor& x_in, const std::vector<torch::Tensor>& weights,
                            const std::vector<int64_t>& qtypes, int64_t tile, int64_t chunk) {
  TORCH_CHECK(dense_supported(), "qmatmul_dense: needs AVX-512 with BF16");
  TORCH_CHECK(weights.size() == qtypes.size() && !weights.empty(), "qmatmul: one qtype per weight segment");
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu(), "qmatmul: x must be a [M, K] CPU tensor");
  TORCH_CHECK(tile > 0, "qmatmul_dense: tile must be positive");
  TORCH_CHECK(chunk >= 0, "qmatmul_dense: chunk must be 0 or positive");
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const int64_t N = check_segments(weights, qtypes, K);
  const int64_t step = chunk > 0 ? chunk : std::max<int64_t>(M, 1);
  const int64_t padded = (M + step - 1) / step * step;
  auto xb = x_in.to(torch::kBFloat16);
  if (padded != M) xb = at::constant_pad_nd(xb, {0, 0, 0, padded - M});
  xb = xb.contiguous();
  auto y = torch::empty({padded, N}, x_in.options().dtype(torch::kBFloat16));
  auto buf = torch::empty({std::min(tile, N), K}, y.options());
  uint16_t* bp = reinterpret_cast<uint16_t*>(buf.data_ptr<at::BFloat16>());
  int64_t col = 0;
  for (size_t i = 0; i < weights.size(); i++) {
    const auto& w = weights[i];
    const uint8_t* wp = w.data_ptr<uint8_t>();
    for (int64_t r0 = 0; r0 < w.size(0); r0 += tile) {
      const int64_t rows = std::min(tile, w.size(0) - r0);
      at::parallel_for(r0, r0 + rows, 16, [&](int64_t a, int64_t b) {
        wb_dequant_bf16_avx512((int)qtypes[i], wp, w.size(1), a, b, K, bp + (a - r0) * K, K);
      });
      auto dst = y.narrow(1, col + r0, rows);  // the tile's columns, in place (oneDNN takes the row stride)
      if (chunk == 0) {
        at::mm_out(dst, xb, buf.narrow(0, 0, rows).t());
      } else {
        // Blocks of `chunk` rows x kDenseColumns columns, each one matmul on one thread inside our
        // own OpenMP region (where oneDNN runs sequentially): a block's shape and its thread count
        // are the same whatever M and whatever threads the engine gives the step (oneDNN's kernel
        // for 512 rows gives other bits on 1 thread than on 2).
        // an even number of blocks of equal width (a multiple of 16), so that two threads share a tile
        // evenly; the widths depend only on the tile's rows
        int64_t blocks = (rows + kDenseColumns - 1) / kDenseColumns;
        blocks += blocks % 2;
        const int64_t width = ((rows + blocks - 1) / blocks + 15) / 16 * 16;
        blocks = (rows + width - 1) / width;
        const int64_t items = padded / step * blocks;
        const at::ThreadLocalState state;  // inference mode and the like, as at::parallel_for carries them
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
        for (int64_t t = 0; t < items; t++) {
          const at::ThreadLocalStateGuard guard(state);
          const int64_t m0 = t / blocks * step, c0 = t % blocks * width;
          const int64_t cols = std::min(width, rows - c0);
          auto part = dst.narrow(0, m0, step).narrow(1, c0, cols);
          at::mm_out(part, xb.narrow(0, m0, step), buf.narrow(0, c0, cols).t());
        }
      }
    }
    col += w.size(0);
  }
  return (padded == M ? y : y.narrow(0, 0, M)).to(torch::kFloat);
}

// The format table (qformats.h) for Python: (name, GGML type, values a block, bytes a block,
// float16 fields a 32-block starts with, offset of its codes, its code fields in group order).
py::list formats() {
  py::list out;
#define WB_ROW(name, qt, bs, bb, halves, offset, fields) out.append(py::make_tuple(#name, qt, bs, bb, halves, offset, fields));
  WB_FORMATS(WB_ROW)
#undef WB_ROW
  return out;
}

void set_generic_formats(const std::vector<int64_t>& qtypes) {
  uint64_t mask = 0;
  for (auto qt : qtypes) {
    TORCH_CHECK(wb::block_size_of(qt), "set_generic_formats: unsupported qtype ", qt);
    mask |= 1ull << qt;
  }
  g_generic_formats.store(mask);
}

// The kernel level's tuning knobs (qkernels.h: Knob), by name; kernels/tuning.py sets them.
const char* const kKnobNames[wb::kKnobs] = {"rows", "rows_m1", "rows_m1_long", "prefetch"};

int knob_index(const std::string& name) {
  for (int i = 0; i < wb::kKnobs; i++)
    if (name == kKnobNames[i]) return i;
  TORCH_CHECK(false, "unknown tuning knob '", name, "': expected rows, rows_m1, rows_m1_long or prefetch");
  return -1;
}

void set_tuning(int64_t qt, const std::string& knob, int64_t value) {
  TORCH_CHECK(kernels()->set_knob((int)qt, knob_index(knob), (int)value), "set_tuning: the ", get_isa(),
              " level has no ", knob, " choice ", value, " for qtype ", qt);
}

int64_t tuning(int64_t qt, const std::string& knob) { return kernels()->knob((int)qt, knob_index(knob)); }

std::vector<int64_t> tuning_choices(const std::string& knob) {
  if (knob_index(knob) == wb::kPrefetch)
    return std::vector<int64_t>(std::begin(wb::kPrefetchChoices), std::end(wb::kPrefetchChoices));
  return std::vector<int64_t>(std::begin(wb::kWeightRowChoices), std::end(wb::kWeightRowChoices));
}

// Let glibc's malloc keep the memory a step frees, for the next step, instead of handing it back
// to the kernel and faulting it in again, zeroed, page by page. By default an allocation of 32 MiB
// or more is its own mmap, unmapped when freed, and so is a heap top of 128 KiB or more: a prompt
// chunk's activations (Qwen2.5-1.5B, 512 tokens: gate_up's output alone is 37 MB) were mapped,
// faulted and unmapped once a layer (Zen 5: a tenth of perf's samples in the kernel's fault and unmap
// paths; 330 tokens/s of prefill without this call, 392 with it). This is what
// vLLM's CPU backend gets from TCMalloc by LD_PRELOAD, with no other allocator. Where not glibc,
// false and nothing changes.
bool retain_freed_memory(int64_t bytes) {
  TORCH_CHECK(bytes > 0 && bytes <= INT32_MAX, "retain_freed_memory: bytes must be in (0, 2^31)");
#if defined(__GLIBC__)
  malloc_trim(0);  // what loading the model left freed goes back first: only step memory stays
  return mallopt(M_MMAP_THRESHOLD, (int)bytes) == 1 && mallopt(M_TRIM_THRESHOLD, (int)bytes) == 1;
#else
  (void)bytes;
  return false;
#endif
}

// decoder_plan.cpp
void bind_decoder_plan(py::module& m);

// peak_probe.cpp
namespace wb {
double peak_ops(const std::string& kind, int64_t threads, double seconds, int64_t trials);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decoder_plan(m);
  m.def("qmatmul", &qmatmul, "y = x @ concat(W_i)^T over GGUF blocks", py::arg("x"), py::arg("weights"),
        py::arg("qtypes"), py::arg("prompt") = false);
  m.def("qmatmul_dense", &qmatmul_dense, "qmatmul by bfloat16 tiles of decoded weights", py::arg("x"),
        py::arg("weights"), py::arg("qtypes"), py::arg("tile"), py::arg("chunk") = 0);
  m.def("flash_prefill", &flash_prefill, "a prompt chunk's attention over bfloat16 pages (flash_prefill.cpp)",
        py::arg("q"), py::arg("k_pages"), py::arg("v_pages"), py::arg("slots"), py::arg("first"), py::arg("last"),
        py::arg("scale"));
  m.def("flash_prefill_supported", &flash_prefill_supported, "whether flash_prefill runs here (avx512 level, AVX-512 BF16)");
  m.def("dequant_bf16", &dequant_bf16, "rows [n0, n1) of GGUF blocks as bfloat16", py::arg("w"), py::arg("qtype"),
        py::arg("k"), py::arg("n0"), py::arg("n1"));
  m.def("peak_ops", &wb::peak_ops, "ops/s of one multiply-accumulate loop ('vnni512', 'avx2', 'amx_int8', "
        "'amx_bf16') on `threads` threads at once, best of `trials` runs of ~`seconds`; 0 where the CPU has none",
        py::arg("kind"), py::arg("threads"), py::arg("seconds") = 0.2, py::arg("trials") = 3);
  m.def("retain_freed_memory", &retain_freed_memory, "malloc keeps freed allocations under `bytes` for reuse "
        "(glibc; false elsewhere)", py::arg("bytes"));
  m.def("dense_supported", &dense_supported, "whether this CPU runs qmatmul_dense (AVX-512 with BF16)");
  m.def("formats", &formats, "the kernels' format table (csrc/qformats.h)");
  m.def("set_generic_formats", &set_generic_formats, "formats sent to the generic level's kernel at every level",
        py::arg("qtypes"));
  m.def("set_tuning", &set_tuning, "a tuning knob's value for qtype at the level in use (0: its default)",
        py::arg("qtype"), py::arg("knob"), py::arg("value"));
  m.def("tuning", &tuning, "a tuning knob's value for qtype at the level in use (0: no tiles)", py::arg("qtype"),
        py::arg("knob"));
  m.def("tuning_knobs", [] { return std::vector<std::string>(std::begin(kKnobNames), std::end(kKnobNames)); },
        "the knobs kernels/tuning.py sets per format");
  m.def("tuning_choices", &tuning_choices, "the values a tuning knob may take", py::arg("knob"));
  m.def("isa", &get_isa, "the kernel level in use");
  m.def("cpu_isa", &cpu_isa, "the best kernel level this CPU supports");
  m.def("set_isa", &set_isa, "force a kernel level ('' for the best this CPU has)", py::arg("level"));
  m.def("paged_attention", &paged_attention, "attention of a few queries a sequence over paged K/V",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("k_offset"), py::arg("v_offset"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("context_lens"), py::arg("block_size"), py::arg("scale"), py::arg("window"), py::arg("softcap"),
        py::arg("sinks") = py::none());
  m.def("add_rms_norm_", &add_rms_norm_, "x += delta; rms_norm(x) * w", py::arg("x"), py::arg("delta"),
        py::arg("weight"), py::arg("eps"));
  m.def("gated_act", &gated_act, "act(gate) * up of a fused [rows, 2 I] projection", py::arg("gate_up"),
        py::arg("act"));
  m.def("rope_write_kv", &rope_write_kv, "q/k norm, RoPE and the K/V cache write of a fused qkv projection",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("q_norm"),
        py::arg("k_norm"), py::arg("eps"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("k_offset") = py::none(), py::arg("v_offset") = py::none());
  m.def("ssm_step", &ssm_step, "Mamba2's one-token SSM update, state read from slot src and written to slot dst",
        py::arg("pool"), py::arg("src"), py::arg("dst"), py::arg("x"), py::arg("B"), py::arg("C"), py::arg("dt"),
        py::arg("A"), py::arg("D"), py::arg("logged") = py::none());
  m.def("conv_step", &conv_step, "a causal depthwise convolution over a few tokens of each sequence, its state read "
        "from slot src and the state after each token written to slot dst", py::arg("pool"), py::arg("src"),
        py::arg("dst"), py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("silu"));
  m.def("ssm1_step", &ssm1_step, "Mamba (v1)'s SSM update over a few tokens of each sequence, from slot src to slots dst",
        py::arg("pool"), py::arg("src"), py::arg("dst"), py::arg("x"), py::arg("dt"), py::arg("B"), py::arg("C"),
        py::arg("A"));
  m.def("delta_step", &delta_step, "the gated delta rule's one-token update, from slot src to slot dst",
        py::arg("pool"), py::arg("src"), py::arg("dst"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"),
        py::arg("beta"));
  m.def("wkv7_step", &wkv7_step, "RWKV-7's WKV update over a few tokens of each sequence, from slot src to slots dst",
        py::arg("pool"), py::arg("src"), py::arg("dst"), py::arg("r"), py::arg("w"), py::arg("k"), py::arg("v"),
        py::arg("a"), py::arg("b"));
  m.def("rwkv7_mix", &rwkv7_mix, "RWKV-7's decay, key, value and WKV a, b of T rows, as one [5, T, C] tensor",
        py::arg("k"), py::arg("v"), py::arg("w_low"), py::arg("a_low"), py::arg("v_low"), py::arg("v_first"),
        py::arg("w0"), py::arg("a0"), py::arg("v0"), py::arg("k_k"), py::arg("k_a"), py::arg("head_size"));
  m.def("rwkv7_out", &rwkv7_out, "RWKV-7's group norm, bonus and gate after the WKV update, [T, C]", py::arg("y"),
        py::arg("r"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("ln_w"), py::arg("ln_b"), py::arg("r_k"),
        py::arg("head_size"), py::arg("eps"));
  m.def("lora_add_", &lora_add_, "y[t] += B_s A_s x[t] for each row's LoRA adapter slot s (0: none)", py::arg("y"),
        py::arg("x"), py::arg("a"), py::arg("b_t"), py::arg("slots"), py::arg("width"));
}
