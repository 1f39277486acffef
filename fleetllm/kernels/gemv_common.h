/* Shared by the C kernels: a horizontal sum (all three), an 8-lane e^x (decode_stack.c, paged_attention.c), and q4_gemv.c's wide-step GEMM, which
 * dequantises a few weight rows at a time into an L1 buffer and multiplies them with blocks of activation
 * rows. Included by each kernel's source; fleetllm/kernels/build.py hashes included files into the cache key.
 *
 * Why the wide path: reading the quantised levels for every pass of 8 activation rows spends a fifth of the
 * FMAs on scaling by d. From 8 rows on each thread instead dequantises CHUNK weight rows (exactly the fp32
 * weights: d * q is exact in fp32, and any zero point is added after, as the GGUF reader computes it) and
 * multiplies them with blocks of 4 activation rows: 2 weight rows x 4 activation rows = 8 independent
 * accumulators, each loaded weight vector used 4 times and each activation vector twice. */
#ifndef FLEETLLM_GEMV_COMMON_H
#define FLEETLLM_GEMV_COMMON_H
#include "simd.h"

#define CHUNK 4  /* weight rows dequantised at a time */
/* Rows from which the dequantise-then-GEMM path runs. Measured against the level-reading passes over a step
 * of SmolLM2's Q4_1 decoder linears (2 threads, AMD EPYC): 0.94-1.00x at 8 rows, 1.03-1.10x at 16, 1.09-1.16x
 * at 24, 1.12-1.18x at 32, 1.16-1.22x at 64. The Q8_0 LM head (49152 rows of 576) keeps its passes: there
 * the buffer's write and read cost more than they save (0.77x at 8 rows, 0.93x at 32). */
#define WIDE_FROM 24

/* Writes `count` weight rows starting at row `first`, `groups` groups of 32 each, as fp32 into `buf`. */
typedef void (*dequantize_fn)(const void *w, const float *d, const float *m, long first, int count, int groups,
                              float *buf);

#if FLEETLLM_X86
/* e^x for 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-6 polynomial), ~1 ulp. */
__attribute__((target("avx2,fma")))
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365478515625f));
    const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma")))
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[r * ldy + o] = w_o . x_r for `outs` (1-2) fp32 weight rows `w` (k apart) and `rows` (1-4) activation
 * rows, both compile-time constants once inlined; k a multiple of 8. */
__attribute__((target("avx2,fma"), always_inline))
static inline void tile_avx2(const int outs, const int rows, const float *w, int k, const float *x, long ldx,
                             float *out, long ldy) {
    __m256 acc[2][4];
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++) acc[o][r] = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 8) {
        __m256 wv[2];
        for (int o = 0; o < outs; o++) wv[o] = _mm256_loadu_ps(w + (long)o * k + i);
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
            for (int o = 0; o < outs; o++) acc[o][r] = _mm256_fmadd_ps(wv[o], xv, acc[o][r]);
        }
    }
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++) out[r * ldy + o] = hsum8(acc[o][r]);
}

#define TILE(O, R) tile_avx2(O, R, w, k, x, ldx, out, ldy)

__attribute__((target("avx2,fma")))
static inline void tile_any(int outs, int rows, const float *w, int k, const float *x, long ldx, float *out, long ldy) {
    if (outs == 2) {
        switch (rows) { case 1: TILE(2, 1); break; case 2: TILE(2, 2); break; case 3: TILE(2, 3); break; default: TILE(2, 4); }
    } else {
        switch (rows) { case 1: TILE(1, 1); break; case 2: TILE(1, 2); break; case 3: TILE(1, 3); break; default: TILE(1, 4); }
    }
}

/* y = x @ W^T for `rows` activation rows (any count; meant for WIDE_FROM and more) and `n` weight rows. */
__attribute__((target("avx2,fma")))
static inline void wide_avx2(dequantize_fn dequantize, const void *w, const float *d, const float *m, const float *x,
                      long ldx, float *y, long ldy, int rows, int n, int groups, int threads) {
    const int k = groups * 32, chunks = (n + CHUNK - 1) / CHUNK;
    #pragma omp parallel num_threads(threads)
    {
        float buf[CHUNK * k];
        #pragma omp for schedule(static)
        for (int c = 0; c < chunks; c++) {
            const int first = c * CHUNK, count = n - first < CHUNK ? n - first : CHUNK;
            dequantize(w, d, m, first, count, groups, buf);
            for (int r0 = 0; r0 < rows; r0 += 4)
                for (int o = 0; o < count; o += 2)
                    tile_any(count - o < 2 ? 1 : 2, rows - r0 < 4 ? rows - r0 : 4, buf + (long)o * k, k,
                             x + r0 * ldx, ldx, y + r0 * ldy + first + o, ldy);
        }
    }
}

#endif  /* FLEETLLM_X86 */
#endif
