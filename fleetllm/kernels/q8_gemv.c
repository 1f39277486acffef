/* Q8_0 GEMV for narrow CPU steps: y[M, N] = x[M, K] @ W[N, K]^T with W as int8 levels and fp32 scales.
 *
 * Weight layout (fleetllm/kernels/q8.py recovers it): per output row n and group g of 32 inputs, w = d * q
 * with q in -127..127; `q` is [N, K] int8 and `d` is [N, K/32] fp32. Eight levels widen to eight int32
 * lanes with one vpmovsxbd. Activations and accumulation are fp32, so the result is the fp32 GEMV's up to
 * summation order. Each group's levels are widened to floats once and used for all M activation rows (M up
 * to 8 per pass); per activation row the group's partial dot product is scaled by d into a vector
 * accumulator, reduced once per output row. Output rows are split over OpenMP threads.
 * AVX2 + FMA is chosen at run time; a scalar path covers other CPUs.
 */
#include <stdint.h>
#include <stdlib.h>
#include "simd.h"
#include "gemv_common.h"
#include "q8_rows.h"
#include "q8_i16_rows.h"

int q8_gemv_isa(void) {
    static int isa = -1;
    if (isa < 0) {
#if FLEETLLM_X86
        __builtin_cpu_init();
        isa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 0;
#else
        isa = 0;
#endif
    }
    return isa;
}

#if FLEETLLM_X86
/* Output rows [0, n) for `rows` activation rows, the count fixed per call site so each is unrolled. */
#define ROWS_AVX2(R) { \
    _Pragma("omp parallel for num_threads(threads) schedule(static)") \
    for (int j = 0; j < n; j++) \
        row_avx2(R, w + (long)j * groups * 32, d + (long)j * groups, x, ldx, groups, y + j, ldy); }

__attribute__((target("avx2,fma")))
static void pass_avx2(int rows, const int8_t *w, const float *d, const float *x, long ldx, float *y, long ldy,
                      int n, int groups, int threads) {
    switch (rows) {
        case 1: ROWS_AVX2(1) break;
        case 2: ROWS_AVX2(2) break;
        case 3: ROWS_AVX2(3) break;
        case 4: ROWS_AVX2(4) break;
        case 5: ROWS_AVX2(5) break;
        case 6: ROWS_AVX2(6) break;
        case 7: ROWS_AVX2(7) break;
        default: ROWS_AVX2(8) break;
    }
}
#endif  /* FLEETLLM_X86 */

static void pass_scalar(int rows, const int8_t *w, const float *d, const float *x, long ldx, float *y, long ldy,
                        int n, int groups, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int j = 0; j < n; j++)
        row_scalar(rows, w + (long)j * groups * 32, d + (long)j * groups, x, ldx, groups, y + j, ldy);
}

/* y[r * ldy + j] = sum_k x[r * ldx + k] * W[j, k] for r < rows, j < n; k_in a multiple of 32. Rows go in
 * passes of up to MAX_ROWS, each reading the weights once; `vector` 0 forces the scalar path (tests).
 * Returns 0, or -1 for a k_in it cannot take. */
int q8_gemv(const float *x, long ldx, const int8_t *w, const float *d, float *y, long ldy, int rows, int n,
            int k_in, int threads, int vector) {
    if (k_in % 32 != 0 || k_in <= 0) return -1;
    const int groups = k_in / 32, vec = vector && q8_gemv_isa() == 2;
    for (int r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int r = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
        const float *xr = x + r0 * ldx;
#if FLEETLLM_X86
        if (vec) pass_avx2(r, w, d, xr, ldx, y + r0 * ldy, ldy, n, groups, threads);
        else
#endif
        pass_scalar(r, w, d, xr, ldx, y + r0 * ldy, ldy, n, groups, threads);
    }
    return 0;
}

/* 3 with AVX-512 VNNI (+ VL) besides AVX2 + FMA, else q8_gemv_isa's level: the int16 GEMV's best path. */
static int q8_i16_isa(void) {
#if FLEETLLM_X86
    if (q8_gemv_isa() == 2 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) return 3;
#endif
    return q8_gemv_isa();
}

/* Output rows [0, n) for `rows` (up to I16_PASS) quantised activation rows on the level's row kernel. */
static void pass_i16(int level, int rows, const int8_t *w, const float *d, const int16_t *const *xq,
                     const float *const *sx, float *y, long ldy, int n, int groups, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int j = 0; j < n; j++) {
        const int8_t *wj = w + (long)j * groups * 32;
        if (j + PREFETCH_ROWS < n)  /* within this thread's rows but for its last few: see q8_i16_rows.h */
            prefetch_row(wj + (long)PREFETCH_ROWS * groups * 32, d + (long)(j + PREFETCH_ROWS) * groups, groups * 32);
#if FLEETLLM_X86
        if (level >= 3) row_i16_vnni_any(rows, wj, d + (long)j * groups, xq, sx, groups, y + j, ldy);
        else if (level == 2) row_i16_avx2_any(rows, wj, d + (long)j * groups, xq, sx, groups, y + j, ldy);
        else
#endif
        row_i16_scalar(rows, wj, d + (long)j * groups, xq, sx, groups, y + j, ldy);
    }
}

/* q8_gemv's product with each activation row rounded first to int16 per group of 32 (q8_i16_rows.h): integer
 * dot products, the contract of the q4 default's narrow linears. Same signature as q8_gemv (the decode stack
 * takes either); `vector` picks the instruction set: 0 the scalar path, 2 AVX2, any other the best. Returns 0,
 * -1 for a k_in it cannot take, -2 without memory for the rounded rows. */
int q8_i16_gemv(const float *x, long ldx, const int8_t *w, const float *d, float *y, long ldy, int rows, int n,
                int k_in, int threads, int vector) {
    if (k_in % 32 != 0 || k_in <= 0) return -1;
    const int groups = k_in / 32, isa = q8_i16_isa(), level = vector == 0 ? 0 : vector == 2 && isa > 2 ? 2 : isa;
    int16_t *xq = malloc(sizeof(int16_t) * (long)rows * k_in);
    float *sx = malloc(sizeof(float) * (long)rows * groups);
    if (xq == NULL || sx == NULL) {
        free(xq), free(sx);
        return -2;
    }
    const int16_t *xr[I16_PASS];
    const float *sr[I16_PASS];
    for (int r0 = 0; r0 < rows; r0 += I16_PASS) {
        const int r = rows - r0 < I16_PASS ? rows - r0 : I16_PASS;
        for (int i = 0; i < r; i++) {
            int16_t *q = xq + (long)(r0 + i) * k_in;
            float *s = sx + (long)(r0 + i) * groups;
#if FLEETLLM_X86
            if (level >= 2) quantize_i16_avx2(x + (r0 + i) * ldx, k_in, q, s);
            else
#endif
            quantize_i16_scalar(x + (r0 + i) * ldx, k_in, q, s);
            xr[i] = q, sr[i] = s;
        }
        pass_i16(level, r, w, d, xr, sr, y + r0 * ldy, ldy, n, groups, threads);
    }
    free(xq), free(sx);
    return 0;
}

/* The group's levels from its fp32 weights (see q8.py's recover_q8_0, which this computes in one pass, bit for
 * bit the same: d = max |w| / 127 rounded to fp16, q = round(w / d) in -127..127); returns 1 when d * q gives
 * every weight back, 0 when not, -1 when d is not finite (the whole weight is then refused). */
#if FLEETLLM_X86
__attribute__((target("avx2,fma,f16c")))
static int recover_group(const float *w, int8_t *q_out, float *d_out) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], top = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(w + 8 * j);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[j]));
    }
    float t8[8], a = 0.f;
    _mm256_storeu_ps(t8, top);
    for (int i = 0; i < 8; i++) a = t8[i] > a ? t8[i] : a;
    for (int i = 0; i < 32; i++)
        if (w[i] != w[i]) a = w[i];  /* a NaN: max ignores it, amax keeps it */
    const float d = _cvtsh_ss(_cvtss_sh(a / 127.f, _MM_FROUND_TO_NEAREST_INT));
    if (d - d != 0.f) return -1;
    const __m256 vd = _mm256_set1_ps(d), step = _mm256_set1_ps(d > 0.f ? d : 1.f);
    int exact = 1, q[32];
    for (int j = 0; j < 4; j++) {
        __m256 t = _mm256_round_ps(_mm256_div_ps(v[j], step), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
        exact &= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(vd, t), v[j], _CMP_EQ_OQ)) == 0xff;
        _mm256_storeu_si256((__m256i *)(q + 8 * j), _mm256_cvtps_epi32(t));
    }
    for (int i = 0; i < 32; i++) q_out[i] = (int8_t)q[i];
    *d_out = d;
    return exact;
}

/* Fills `q` [N, K] and `d` [N, K/32] from `w` [N, K] row-major. Returns 1 when every weight is rebuilt
 * exactly, 0 when not (or a scale is not finite), -1 when this CPU or K cannot take it (the caller recovers
 * in PyTorch). */
int q8_recover(const float *w, long n, int k_in, int8_t *q, float *d, int threads) {
    if (k_in % 32 != 0 || k_in <= 0 || q8_gemv_isa() != 2 || !__builtin_cpu_supports("f16c")) return -1;
    const long groups = (long)n * (k_in / 32);
    int exact = 1;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(&:exact)
    for (long g = 0; g < groups; g++)
        exact &= recover_group(w + 32 * g, q + 32 * g, d + g) == 1;
    return exact;
}
#else
int q8_recover(const float *w, long n, int k_in, int8_t *q, float *d, int threads) {
    return -1;  /* no vector path here: the caller recovers in PyTorch */
}
#endif  /* FLEETLLM_X86 */
