// FP8 E4M3 (OCP "fn" variant: no infinities, 0x7F and 0xFF are NaN), as torch.float8_e4m3fn.
// static: each ISA file gets its own copy, compiled for its own CPU (see qkernels.h).
#pragma once
#include <math.h>
#include <stdint.h>

namespace wb {

// Decoded by arithmetic, so that it can be checked against torch's own conversion.
static inline float fp8_e4m3_to_float(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xF, man = b & 0x7;
  float v;
  if (exp == 0xF && man == 0x7) v = NAN;
  else if (exp == 0) v = ldexpf((float)man, -9);  // subnormal: man/8 * 2^-6
  else v = ldexpf((float)(8 + man), exp - 10);     // (1 + man/8) * 2^(exp-7)
  return sign ? -v : v;
}

}  // namespace wb
