/* x86 SIMD, or none. Every kernel's vector paths are x86 (AVX2, AVX-512, chosen at run time); on other
 * architectures (aarch64) the portable build keeps the scalar paths, and a kernel that has none reports no
 * instruction set, so its callers keep their PyTorch paths. fleetllm/kernels/variants.py names the builds. */
#ifndef FLEETLLM_SIMD_H
#define FLEETLLM_SIMD_H
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FLEETLLM_X86 1
#else
#define FLEETLLM_X86 0
#endif
#endif
