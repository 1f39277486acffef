/* Q8_0 weight rows against fp32 activation rows: one output row's dot products for up to MAX_ROWS activation
 * rows, each group's levels widened once and used for every row (q8_gemv.c's fp32-activation path: SmolLM2's
 * recovered Q8_0 head; a GGUF's kept Q8_0 weights and the experts take q8_i16_rows.h). Per activation row the
 * group's partial dot product is scaled by d into a vector accumulator, reduced once per output row, so a row's
 * result does not depend on the other rows of its pass (batch-invariant). */
#ifndef FLEETLLM_Q8_ROWS_H
#define FLEETLLM_Q8_ROWS_H
#include <stdint.h>
#include "simd.h"
#include "gemv_common.h"

#define MAX_ROWS 8

static inline void row_scalar(int rows, const int8_t *w, const float *d, const float *x, long ldx, int groups,
                              float *out, long ldy) {
    for (int r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int g = 0; g < groups; g++) {
            const int8_t *b = w + 32 * g;
            const float *xg = x + r * ldx + 32 * g;
            float dot = 0.f;
            for (int i = 0; i < 32; i++) dot += b[i] * xg[i];
            acc += d[g] * dot;
        }
        out[r * ldy] = acc;
    }
}

#if FLEETLLM_X86
__attribute__((target("avx2,fma"), always_inline))
static inline __m256 widen8(const int8_t *b) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)b)));
}

/* One output row for `rows` activation rows, a compile-time constant once inlined. Unlike the Q4 kernel,
 * two output rows at a time are slower here (M = 1: 2.0 against 0.9 ms for the 49152x576 LM head). */
__attribute__((target("avx2,fma"), always_inline))
static inline void row_avx2(const int rows, const int8_t *w, const float *d, const float *x, long ldx,
                            int groups, float *out, long ldy) {
    __m256 acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const int8_t *b = w + 32L * g;
        const __m256 q0 = widen8(b), q1 = widen8(b + 8), q2 = widen8(b + 16), q3 = widen8(b + 24);
        const __m256 dg = _mm256_broadcast_ss(d + g);
        for (int r = 0; r < rows; r++) {
            const float *xg = x + r * ldx + 32 * g;
            __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xg));
            t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xg + 8), t);
            t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xg + 16), t);
            t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xg + 24), t);
            acc[r] = _mm256_fmadd_ps(dg, t, acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) out[r * ldy] = hsum8(acc[r]);
}

/* row_avx2 for any `rows` up to MAX_ROWS, each count unrolled on its own. */
__attribute__((target("avx2,fma")))
static inline void row_avx2_any(int rows, const int8_t *w, const float *d, const float *x, long ldx, int groups,
                                float *out, long ldy) {
    switch (rows) {
        case 1: row_avx2(1, w, d, x, ldx, groups, out, ldy); break;
        case 2: row_avx2(2, w, d, x, ldx, groups, out, ldy); break;
        case 3: row_avx2(3, w, d, x, ldx, groups, out, ldy); break;
        case 4: row_avx2(4, w, d, x, ldx, groups, out, ldy); break;
        case 5: row_avx2(5, w, d, x, ldx, groups, out, ldy); break;
        case 6: row_avx2(6, w, d, x, ldx, groups, out, ldy); break;
        case 7: row_avx2(7, w, d, x, ldx, groups, out, ldy); break;
        default: row_avx2(8, w, d, x, ldx, groups, out, ldy); break;
    }
}
#endif  /* FLEETLLM_X86 */
#endif
