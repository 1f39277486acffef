/* 4-bit weight rows against int16 activation rows: moe_experts.c's arithmetic for experts kept in 4 bits.
 *
 * The weight layout (fleetllm/models/expert_quant.py): per group of 32 inputs, 16 bytes of levels q in 0..15
 * (byte j: input j in the low nibble, input j + 16 in the high one, as Q4_0 packs them) and two uint8 factors sc,
 * mn; per super-block of 2^shift groups two fp32 scales d, dmin; the weight is (d * sc) * q - dmin * mn. A GGUF's
 * Q4_K (shift 3), Q4_0 and Q4_1 (shift 0) experts are all this, bit for bit.
 *
 * The activations are q8_i16_rows.h's: each row rounded once to int16 per group of 32 (levels xq, scale sx), and
 * the group's sum sx * sum(xq) formed once per row (group_sums). A group's product is then
 * (d * sc) * sx * sum(q * xq) - (dmin * mn) * sx * sum(xq): the first the Q8_0 path's integer lanes on the
 * unpacked levels (the same eight lanes, the same FMA per lane), the second one scalar FMA per group into a
 * running sum taken from the lanes' reduction. The scalar path computes both in the same order: every path gives the same bits, and a
 * row's result depends on that row alone (batch-invariant).
 */
#ifndef FLEETLLM_Q4_I16_ROWS_H
#define FLEETLLM_Q4_I16_ROWS_H
#include <math.h>
#include <stdint.h>
#include "simd.h"
#include "gemv_common.h"
#include "q8_i16_rows.h"

/* out[g] = s[g] * (the sum of group g's int16 levels), for the n / 32 groups of one row. */
static inline void group_sums(const int16_t *q, const float *s, int n, float *out) {
    for (int g = 0; g < n / 32; g++) {
        int32_t t = 0;
        for (int i = 0; i < 32; i++) t += q[32 * g + i];
        out[g] = s[g] * (float)t;
    }
}

/* Asks for 4-bit weight row j's levels (`k_in / 2` bytes from `w`), factors (`k_in / 16` bytes) and scales. */
static inline void prefetch_row4(const uint8_t *w, const uint8_t *f, const float *d, int k_in) {
    for (int c = 0; c < k_in / 2; c += 64) __builtin_prefetch(w + c);
    for (int c = 0; c < k_in / 16; c += 64) __builtin_prefetch(f + c);
    __builtin_prefetch(d);
}

static inline void row_q4_scalar(int rows, const uint8_t *w, const uint8_t *f, const float *d, int shift,
                                 const int16_t *const *xq, const float *const *sx, const float *const *xsum,
                                 int groups, float *out, long ldy) {
    for (int r = 0; r < rows; r++) {
        float acc[8] = {0.f}, mins = 0.f;
        for (int g = 0; g < groups; g++) {
            int8_t b[32];
            for (int i = 0; i < 16; i++) b[i] = w[16L * g + i] & 0x0F, b[16 + i] = w[16L * g + i] >> 4;
            const int16_t *x = xq[r] + 32L * g;
            const float *sb = d + 2 * (g >> shift), dg = sb[0] * (float)f[2 * g], mg = sb[1] * (float)f[2 * g + 1];
            const float scale = dg * sx[r][g];
            for (int l = 0; l < 8; l++) {
                const int32_t p = b[2 * l] * x[2 * l] + b[2 * l + 1] * x[2 * l + 1] + b[16 + 2 * l] * x[16 + 2 * l]
                                  + b[17 + 2 * l] * x[17 + 2 * l];
                acc[l] = fmaf((float)p, scale, acc[l]);
            }
            mins = fmaf(mg, xsum[r][g], mins);
        }
        out[r * ldy] = hsum8_scalar(acc) - mins;
    }
}

#if FLEETLLM_X86
/* One output row for `rows` activation rows: each group's levels unpacked once and used for every row. */
#define DEFINE_ROW_Q4(NAME, TARGET, DOT) \
__attribute__((target(TARGET), always_inline)) \
static inline void NAME(const int rows, const uint8_t *w, const uint8_t *f, const float *d, int shift, \
                        const int16_t *const *xq, const float *const *sx, const float *const *xsum, int groups, \
                        float *out, long ldy) { \
    __m256 acc[I16_PASS]; \
    float mins[I16_PASS]; \
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps(), mins[r] = 0.f; \
    const __m128i low = _mm_set1_epi8(0x0F); \
    for (int g = 0; g < groups; g++) { \
        const __m128i b = _mm_loadu_si128((const __m128i *)(w + 16L * g)); \
        const __m256i wl = _mm256_cvtepu8_epi16(_mm_and_si128(b, low)); \
        const __m256i wh = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low)); \
        const float *sb = d + 2 * (g >> shift), mg = sb[1] * (float)f[2 * g + 1]; \
        const __m256 dg = _mm256_set1_ps(sb[0] * (float)f[2 * g]); \
        for (int r = 0; r < rows; r++) { \
            const __m256i p = DOT(wl, wh, xq[r] + 32L * g); \
            const __m256 scale = _mm256_mul_ps(dg, _mm256_broadcast_ss(sx[r] + g)); \
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]); \
            mins[r] = fmaf(mg, xsum[r][g], mins[r]); \
        } \
    } \
    for (int r = 0; r < rows; r++) out[r * ldy] = hsum8(acc[r]) - mins[r]; \
}

DEFINE_ROW_Q4(row_q4_avx2, "avx2,fma", DOT_I16_AVX2)
DEFINE_ROW_Q4(row_q4_vnni, "avx2,fma,avx512vnni,avx512vl", DOT_I16_VNNI)

#define DEFINE_ROW_Q4_ANY(NAME, TARGET, ROW) \
__attribute__((target(TARGET))) \
static void NAME(int rows, const uint8_t *w, const uint8_t *f, const float *d, int shift, \
                 const int16_t *const *xq, const float *const *sx, const float *const *xsum, int groups, float *out, \
                 long ldy) { \
    switch (rows) { \
        case 1: ROW(1, w, f, d, shift, xq, sx, xsum, groups, out, ldy); break; \
        case 2: ROW(2, w, f, d, shift, xq, sx, xsum, groups, out, ldy); break; \
        case 3: ROW(3, w, f, d, shift, xq, sx, xsum, groups, out, ldy); break; \
        case 4: ROW(4, w, f, d, shift, xq, sx, xsum, groups, out, ldy); break; \
        case 5: ROW(5, w, f, d, shift, xq, sx, xsum, groups, out, ldy); break; \
        case 6: ROW(6, w, f, d, shift, xq, sx, xsum, groups, out, ldy); break; \
        case 7: ROW(7, w, f, d, shift, xq, sx, xsum, groups, out, ldy); break; \
        default: ROW(8, w, f, d, shift, xq, sx, xsum, groups, out, ldy); break; \
    } \
}

DEFINE_ROW_Q4_ANY(row_q4_avx2_any, "avx2,fma", row_q4_avx2)
DEFINE_ROW_Q4_ANY(row_q4_vnni_any, "avx2,fma,avx512vnni,avx512vl", row_q4_vnni)
#endif  /* FLEETLLM_X86 */
#endif
