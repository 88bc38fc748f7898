// The arm level (aarch64 with the dot-product extension): placeholder, filled in below.
#include "qkernels.h"

extern "C" const wb::Kernels* wb_kernels_arm() { return nullptr; }
extern "C" int wb_arm_features() { return 0; }
