/* bf16 weights times activations rounded to bf16, accumulated in fp32: y[M, N] = x[M, K] @ W[N, K]^T.
 *
 * For compute-bound steps (wide decode batches, prefill chunks) on CPUs with AVX-512 BF16: one vdpbf16ps does
 * 32 multiply-adds, twice an fp32 FMA's, and the weights need no unpacking (the Q4 kernel widens 4-bit levels
 * before every multiply). Each activation is rounded to bf16 (round to nearest even) on entry, each weight was
 * rounded so once; products and sums are fp32, and y is written in fp32.
 *
 * Weight layout ("paired", fleetllm/kernels/bf16.py builds it): outputs in panels of 16; a panel stores, for each
 * pair of inputs (2p, 2p + 1), its 16 outputs' two weights side by side: [N / 16][K / 2][16][2] bf16. So one
 * 64-byte load is the operand of one vdpbf16ps against a broadcast pair of x, and lane j gains
 * x[2p] W[j, 2p] + x[2p + 1] W[j, 2p + 1]. K is even and N a multiple of 16 (the caller's shapes are).
 *
 * Threads take tiles of TILE_PANELS panels (48 outputs); each tile meets the activations in passes of up to
 * PASS rows, its PASS x TILE_PANELS accumulators in registers, the pair of x broadcast from memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#define PASS 8         /* activation rows per register pass */
#define TILE_PANELS 3  /* panels of 16 outputs per tile: 8 x 3 accumulators + 3 weight vectors in 32 registers */
#define SERIAL_ROWS 4  /* up to this many rows are rounded to bf16 by the calling thread */
#define ISA "avx512f,avx512bw,avx512vl,avx512bf16"

/* 1 where AVX-512 BF16 (with F, BW, VL) runs, else 0 (the caller must not call bf16_gemm). */
#if FLEETLLM_X86
int bf16_gemm_isa(void) {
    static int isa = -1;  /* checked once: every GEMM asks */
    if (isa < 0) {
        __builtin_cpu_init();
        isa = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
    }
    return isa;
}

/* fp32 -> bf16, round to nearest even (NaN kept a NaN): the scalar form of vcvtne2ps2bf16. */
static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

__attribute__((target(ISA)))
static void row_to_bf16(const float *x, int k, uint16_t *out) {
    int i = 0;
    for (; i + 32 <= k; i += 32) {
        __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
        _mm512_storeu_si512(out + i, (__m512i)v);
    }
    for (; i < k; i++) out[i] = round_bf16(x[i]);
}

/* rows x (panels * 16) outputs of y from `pairs` pairs of inputs: xb's rows `xs` apart, w's panels `ps` apart. */
__attribute__((target(ISA), always_inline))
static inline void tile(const int rows, const int panels, const uint16_t *xb, long xs, const uint16_t *w, long ps,
                        int pairs, float *y, long ldy) {
    __m512 acc[PASS][TILE_PANELS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++) acc[r][c] = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        __m512bh wv[TILE_PANELS];
        for (int c = 0; c < panels; c++) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * ps + 32L * p);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, xb + r * xs + 2L * p, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < panels; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < panels; c++) _mm512_storeu_ps(y + r * ldy + 16 * c, acc[r][c]);
}

#define ROWS_CASES(P) switch (rows) { \
    case 1: tile(1, P, xb, xs, w, ps, pairs, y, ldy); break; case 2: tile(2, P, xb, xs, w, ps, pairs, y, ldy); break; \
    case 3: tile(3, P, xb, xs, w, ps, pairs, y, ldy); break; case 4: tile(4, P, xb, xs, w, ps, pairs, y, ldy); break; \
    case 5: tile(5, P, xb, xs, w, ps, pairs, y, ldy); break; case 6: tile(6, P, xb, xs, w, ps, pairs, y, ldy); break; \
    case 7: tile(7, P, xb, xs, w, ps, pairs, y, ldy); break; default: tile(8, P, xb, xs, w, ps, pairs, y, ldy); }

/* One register pass: each (rows, panels) pair compiled with its accumulators unrolled. */
__attribute__((target(ISA)))
static void pass(int rows, int panels, const uint16_t *xb, long xs, const uint16_t *w, long ps, int pairs, float *y,
                 long ldy) {
    if (panels == 3) { ROWS_CASES(3) } else if (panels == 2) { ROWS_CASES(2) } else { ROWS_CASES(1) }
}

/* y[r * ldy + j] = sum_k x[r * ldx + k] * W[j, k] for r < rows, j < n, with W paired as above (`w`: n * k bf16).
 * d, m and `vector` are ignored: the signature is the decode stack's GEMM pointer's. Returns 0; -1 for an odd K or
 * an N not a multiple of 16; -2 without AVX-512 BF16 or memory. */
int bf16_gemm(const float *x, long ldx, const uint8_t *wbytes, const uint16_t *d, const uint16_t *m, float *y,
              long ldy, int rows, int n, int k, int threads, int vector) {
    (void)d, (void)m, (void)vector;
    if (k <= 0 || k % 2 != 0 || n % 16 != 0) return -1;
    if (!bf16_gemm_isa()) return -2;
    const long xs = (k + 31) / 32 * 32;
    uint16_t *xb = aligned_alloc(64, (size_t)rows * xs * 2);
    if (xb == NULL) return -2;
    #pragma omp parallel for num_threads(rows > SERIAL_ROWS ? threads : 1) schedule(static)
    for (int r = 0; r < rows; r++) row_to_bf16(x + r * ldx, k, xb + r * xs);
    const uint16_t *w = (const uint16_t *)wbytes;
    const long ps = 16L * k;  /* elements per panel */
    const int panels = n / 16, tiles = (panels + TILE_PANELS - 1) / TILE_PANELS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < tiles; t++) {
        const int p0 = t * TILE_PANELS, np = panels - p0 < TILE_PANELS ? panels - p0 : TILE_PANELS;
        for (int r0 = 0; r0 < rows; r0 += PASS)
            pass(rows - r0 < PASS ? rows - r0 : PASS, np, xb + r0 * xs, xs, w + p0 * ps, ps, k / 2, y + r0 * ldy + 16 * p0,
                 ldy);
    }
    free(xb);
    return 0;
}

#else  /* not x86: no vector path, so no kernel (the callers keep their PyTorch paths) */
int bf16_gemm_isa(void) {
    return 0;
}
int bf16_gemm(const float *x, long ldx, const uint8_t *wbytes, const uint16_t *d, const uint16_t *m, float *y,
              long ldy, int rows, int n, int k, int threads, int vector) {
    return -2;
}
#endif  /* FLEETLLM_X86 */
