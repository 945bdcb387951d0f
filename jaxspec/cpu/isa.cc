// For Python's instruction-set detection (jaxspec.cpu.kernels, through ctypes).
#include "common.h"

extern "C" int jaxspec_cpu_supports(int64_t isa) { return jaxspec_cpu::cpu_supports(isa) ? 1 : 0; }
