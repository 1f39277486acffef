/* Q8_0 weight rows against int16 activation rows: the experts' arithmetic in moe_experts.c.
 *
 * Why integers: at a few rows an expert, widening each int8 weight to fp32 (two conversions per 8 weights)
 * cost more than the FMAs that use it, and the experts' products were bound by that widening, not by memory.
 * Here each activation row is rounded once per group of 32 inputs to int16 (scale max|x| / 32767, as the q4
 * default's Q4_1 linears round theirs: q4_int_gemm.c's quantize_row16), the weights' int8 levels widen to int16
 * once per group (vpmovsxbw), and the products are integer multiply-adds summed exactly in int32 (AVX-512 VNNI's
 * vpdpwssd, or AVX2's vpmaddwd and an add: the same sums). Only the rounding of x departs from fp32, by at most
 * 1/65534 of its group's largest input.
 *
 * Per activation row, group g's eight int32 lanes (lane l: inputs 2l, 2l + 1, 16 + 2l, 17 + 2l) become fp32 and
 * meet d_w[g] * s_x[g] in one FMA per lane into a vector accumulator, reduced once per output row (hsum8's
 * order). The scalar path computes the same lanes in the same order with fmaf: every path gives the same bits,
 * and a row's result depends on that row alone (batch-invariant).
 */
#ifndef FLEETLLM_Q8_I16_ROWS_H
#define FLEETLLM_Q8_I16_ROWS_H
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"
#include "gemv_common.h"

#define I16_PASS 8  /* activation rows per pass over a weight row */
/* Weight rows read ahead of the one being multiplied. The hardware prefetchers stop at 4 KB pages, and a row of
 * 1,024 levels is a quarter of one, so without this every fourth row waited for memory: on the realistic MoE
 * shape (experts of 1024 x 512, one layer's step, 2 threads, best of 5 alternating) 4 rows ahead took 0.48 ms
 * against 0.60 at one token and 3.1 against 3.6 ms at eight; 16 ahead 0.51 and 3.4. */
#define PREFETCH_ROWS 4

/* Asks for weight row j's levels (`k_in` bytes from `w`) and its scales (`k_in / 32` floats from `d`). */
static inline void prefetch_row(const int8_t *w, const float *d, int k_in) {
    for (int c = 0; c < k_in; c += 64) __builtin_prefetch(w + c);
    __builtin_prefetch(d);
}

/* One activation row's n inputs (a multiple of 32) as int16 levels `q` and one fp32 scale per group `s`. A group
 * holding a NaN or an infinity gets levels 0 and scale NaN, so that the products it enters are NaN. */
static inline void quantize_i16_scalar(const float *x, int n, int16_t *q, float *s) {
    for (int g = 0; g < n / 32; g++) {
        const float *xg = x + 32 * g;
        float top = 0.f;
        int bad = 0;
        for (int i = 0; i < 32; i++) {
            const float a = fabsf(xg[i]);
            bad |= !(a <= FLT_MAX);
            top = a > top ? a : top;
        }
        if (bad) {
            s[g] = NAN;
            memset(q + 32 * g, 0, 32 * sizeof(int16_t));
            continue;
        }
        const float inv = top > 0.f ? 32767.f / top : 0.f;
        s[g] = top / 32767.f;
        for (int i = 0; i < 32; i++) q[32 * g + i] = (int16_t)nearbyintf(xg[i] * inv);
    }
}

/* The eight lanes' sum in hsum8's order. */
static inline float hsum8_scalar(const float a[8]) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static inline void row_i16_scalar(int rows, const int8_t *w, const float *d, const int16_t *const *xq,
                                  const float *const *sx, int groups, float *out, long ldy) {
    for (int r = 0; r < rows; r++) {
        float acc[8] = {0.f};
        for (int g = 0; g < groups; g++) {
            const int8_t *b = w + 32L * g;
            const int16_t *x = xq[r] + 32L * g;
            const float scale = d[g] * sx[r][g];
            for (int l = 0; l < 8; l++) {
                const int32_t p = b[2 * l] * x[2 * l] + b[2 * l + 1] * x[2 * l + 1] + b[16 + 2 * l] * x[16 + 2 * l]
                                  + b[17 + 2 * l] * x[17 + 2 * l];
                acc[l] = fmaf((float)p, scale, acc[l]);
            }
        }
        out[r * ldy] = hsum8_scalar(acc);
    }
}

#if FLEETLLM_X86
__attribute__((target("avx2,fma")))
static inline void quantize_i16_avx2(const float *x, int n, int16_t *q, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int g = 0; g < n / 32; g++) {
        const float *xg = x + 32 * g;
        __m256 v[4], amax = _mm256_setzero_ps();
        int bad = 0;
        for (int t = 0; t < 4; t++) {
            v[t] = _mm256_loadu_ps(xg + 8 * t);
            const __m256 a = _mm256_andnot_ps(sign, v[t]);
            bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(FLT_MAX), _CMP_NLE_UQ));
            amax = _mm256_max_ps(amax, a);
        }
        if (bad) {
            s[g] = NAN;
            memset(q + 32 * g, 0, 32 * sizeof(int16_t));
            continue;
        }
        float lanes[8], top = 0.f;
        _mm256_storeu_ps(lanes, amax);
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
        const __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
        s[g] = top / 32767.f;
        for (int t = 0; t < 4; t += 2) {
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));
            const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(v[t + 1], inv));
            /* packs works within 128-bit halves: put the eight values of a, then of b, back in order */
            const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8);
            _mm256_storeu_si256((__m256i *)(q + 32 * g + 8 * t), p);
        }
    }
}

/* The eight int32 lanes of one group's products (see the file's comment for which inputs each lane holds). */
#define DOT_I16_AVX2(wl, wh, x) _mm256_add_epi32(_mm256_madd_epi16(wl, _mm256_loadu_si256((const __m256i *)(x))), \
    _mm256_madd_epi16(wh, _mm256_loadu_si256((const __m256i *)((x) + 16))))
#define DOT_I16_VNNI(wl, wh, x) _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), wl, \
    _mm256_loadu_si256((const __m256i *)(x))), wh, _mm256_loadu_si256((const __m256i *)((x) + 16)))

/* One output row for `rows` activation rows (a compile-time constant once inlined): each group's levels widened
 * once and used for every row. */
#define DEFINE_ROW_I16(NAME, TARGET, DOT) \
__attribute__((target(TARGET), always_inline)) \
static inline void NAME(const int rows, const int8_t *w, const float *d, const int16_t *const *xq, \
                        const float *const *sx, int groups, float *out, long ldy) { \
    __m256 acc[I16_PASS]; \
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps(); \
    for (int g = 0; g < groups; g++) { \
        const __m256i wl = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 32L * g))); \
        const __m256i wh = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 32L * g + 16))); \
        const __m256 dg = _mm256_broadcast_ss(d + g); \
        for (int r = 0; r < rows; r++) { \
            const __m256i p = DOT(wl, wh, xq[r] + 32L * g); \
            const __m256 scale = _mm256_mul_ps(dg, _mm256_broadcast_ss(sx[r] + g)); \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]); \
        } \
    } \
    for (int r = 0; r < rows; r++) out[r * ldy] = hsum8(acc[r]); \
}

DEFINE_ROW_I16(row_i16_avx2, "avx2,fma", DOT_I16_AVX2)
DEFINE_ROW_I16(row_i16_vnni, "avx2,fma,avx512vnni,avx512vl", DOT_I16_VNNI)

/* ROW for any `rows` up to I16_PASS, each count unrolled on its own. */
#define DEFINE_ROW_I16_ANY(NAME, TARGET, ROW) \
__attribute__((target(TARGET))) \
static void NAME(int rows, const int8_t *w, const float *d, const int16_t *const *xq, const float *const *sx, \
                 int groups, float *out, long ldy) { \
    switch (rows) { \
        case 1: ROW(1, w, d, xq, sx, groups, out, ldy); break; \
        case 2: ROW(2, w, d, xq, sx, groups, out, ldy); break; \
        case 3: ROW(3, w, d, xq, sx, groups, out, ldy); break; \
        case 4: ROW(4, w, d, xq, sx, groups, out, ldy); break; \
        case 5: ROW(5, w, d, xq, sx, groups, out, ldy); break; \
        case 6: ROW(6, w, d, xq, sx, groups, out, ldy); break; \
        case 7: ROW(7, w, d, xq, sx, groups, out, ldy); break; \
        default: ROW(8, w, d, xq, sx, groups, out, ldy); break; \
    } \
}

DEFINE_ROW_I16_ANY(row_i16_avx2_any, "avx2,fma", row_i16_avx2)
DEFINE_ROW_I16_ANY(row_i16_vnni_any, "avx2,fma,avx512vnni,avx512vl", row_i16_vnni)
#endif  /* FLEETLLM_X86 */
#endif
