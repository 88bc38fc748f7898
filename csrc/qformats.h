// The GGUF block formats the kernels run: one row each, the only place a format's facts live.
// Everything else (the QType numbers, block sizes and bytes in C++, the row layout and the list
// of supported types in Python through `_C.formats()`, the cases of each level's matmul) is made
// from this table. A plain macro table, not inline functions: this header reaches translation
// units built for different CPUs (qkernels.h), and a shared function could be linked as one copy.
//
// X(name, GGML type number, values a block, bytes a block, float16 fields a 32-block starts with
//   (1: d; 2: d and m), the offset of its unsigned codes (w = d (q + offset); 0: signed codes or a
//   min), the code fields of a block in the row layout's group order (qblocks.inc, bytes each))
#pragma once

#define WB_FORMATS(X)                   \
  X(Q4_0, 2, 32, 18, 1, -8, "16")       \
  X(Q4_1, 3, 32, 20, 2, 0, "16")        \
  X(Q5_0, 6, 32, 22, 1, -16, "2,2,16")  \
  X(Q5_1, 7, 32, 24, 2, 0, "2,2,16")    \
  X(Q8_0, 8, 32, 34, 1, 0, "16,16")     \
  X(Q2_K, 10, 256, 84, 0, 0, "")        \
  X(Q3_K, 11, 256, 110, 0, 0, "")       \
  X(Q4_K, 12, 256, 144, 0, 0, "")       \
  X(Q5_K, 13, 256, 176, 0, 0, "")       \
  X(Q6_K, 14, 256, 210, 0, 0, "")

namespace wb {

struct FormatFacts {
  int qtype, block_size, block_bytes, halves, offset;
};

inline constexpr FormatFacts kFormats[] = {
#define WB_FACTS(name, qt, bs, bb, halves, offset, fields) {qt, bs, bb, halves, offset},
    WB_FORMATS(WB_FACTS)
#undef WB_FACTS
};

// Compile time only (consteval: never emitted as code), for the kernels' template constants.
consteval FormatFacts format_facts(int qt) {
  for (const auto& f : kFormats)
    if (f.qtype == qt) return f;
  return {qt, 0, 0, 0, 0};
}

}  // namespace wb
