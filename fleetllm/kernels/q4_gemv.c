/* Q4_1 GEMV for narrow CPU steps: y[M, N] = x[M, K] @ W[N, K]^T with W as 4-bit levels and fp32 scales.
 *
 * Weight layout (fleetllm/kernels/q4.py packs it): per output row n and group g of 32 inputs, w = d * q + m
 * with q in 0..15; `packed` is [N, K/32, 16] bytes, byte i < 8 of a group holding q[i] (low nibble) and
 * q[8 + i] (high nibble), byte 8 + i holding q[16 + i] and q[24 + i]; `d` and `m` are [N, K/32] fp32.
 * Eight bytes widen to eight int32 lanes with one vpmovzxbd: the low nibbles are 8 consecutive inputs, the
 * high nibbles the next 8, so no shuffles are needed.
 *
 * Per group sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j: the group sums of x are computed once
 * per activation row and reused for every output row. Activations and accumulation are fp32, so the result
 * is the fp32 GEMV's up to summation order. Each group's levels are widened to floats once and used for all
 * M activation rows (M up to 8 per pass); per activation row the group's partial dot product is scaled by d
 * into a vector accumulator, reduced once per output row (a horizontal sum per group would chain every
 * group's latency). With one or two activation rows, two output rows are computed together (shared
 * activation loads, independent FMA chains). Output rows are split over OpenMP threads. AVX2 + FMA is chosen at run time; a scalar
 * path covers other CPUs.
 */
#include <stdint.h>
#include "simd.h"
#include "gemv_common.h"

#define MAX_ROWS 8

int q4_gemv_isa(void) {
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

static void group_sums(const float *x, long ldx, int rows, int groups, float *xsum) {
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < groups; g++) {
            const float *xg = x + r * ldx + 32 * g;
            float s = 0.f;
            for (int i = 0; i < 32; i++) s += xg[i];
            xsum[r * groups + g] = s;
        }
}

static void row_scalar(int rows, const uint8_t *w, const float *d, const float *m, const float *x, long ldx,
                       const float *xsum, int groups, float *out, long ldy) {
    for (int r = 0; r < rows; r++) {
        float acc = 0.f;
        for (int g = 0; g < groups; g++) {
            const uint8_t *b = w + 16 * g;
            const float *xg = x + r * ldx + 32 * g;
            float dot = 0.f;
            for (int i = 0; i < 8; i++)
                dot += (b[i] & 15) * xg[i] + (b[i] >> 4) * xg[8 + i]
                     + (b[8 + i] & 15) * xg[16 + i] + (b[8 + i] >> 4) * xg[24 + i];
            acc += d[g] * dot + m[g] * xsum[r * groups + g];
        }
        out[r * ldy] = acc;
    }
}

/* sum_g m[g] * xs[g]: the zero-point term of one output row for one activation row. */
#if FLEETLLM_X86
__attribute__((target("avx2,fma")))
static inline float dot_avx2(const float *m, const float *xs, int groups) {
    __m256 acc = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(xs + g), acc);
    float s = hsum8(acc);
    for (; g < groups; g++) s += m[g] * xs[g];
    return s;
}

/* `outs` (1 or 2) consecutive output rows for `rows` activation rows, both compile-time constants once
 * inlined. Two output rows share each activation load and give the FMA chains of a one-row step a second,
 * independent accumulator. */
__attribute__((target("avx2,fma"), always_inline))
static inline void row_avx2(const int rows, const int outs, const uint8_t *w, const float *d, const float *m,
                            const float *x, long ldx, const float *xsum, int groups, float *out, long ldy) {
    __m256 acc[2][MAX_ROWS];
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++) acc[o][r] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi32(15);
    for (int g = 0; g < groups; g++) {
        for (int o = 0; o < outs; o++) {
            const uint8_t *b = w + 16L * (o * groups + g);
            const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
            const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8)));
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v0, mask));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
            const __m256 q2 = _mm256_cvtepi32_ps(_mm256_and_si256(v1, mask));
            const __m256 q3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
            const __m256 dg = _mm256_broadcast_ss(d + o * groups + g);
            for (int r = 0; r < rows; r++) {
                const float *xg = x + r * ldx + 32 * g;
                __m256 t = _mm256_mul_ps(q0, _mm256_loadu_ps(xg));
                t = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xg + 8), t);
                t = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xg + 16), t);
                t = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xg + 24), t);
                acc[o][r] = _mm256_fmadd_ps(dg, t, acc[o][r]);
            }
        }
    }
    for (int o = 0; o < outs; o++)
        for (int r = 0; r < rows; r++)
            out[r * ldy + o] = hsum8(acc[o][r]) + dot_avx2(m + o * groups, xsum + r * groups, groups);
}

/* Output rows [0, n) for `rows` activation rows, the counts fixed per call site so each is unrolled: pairs
 * of output rows for one or two activation rows (then the odd last one alone), single ones from three. */
#define ROWS_AVX2(R) { \
    const int outs = (R) <= 2 ? 2 : 1; \
    _Pragma("omp parallel for num_threads(threads) schedule(static)") \
    for (int j = 0; j < n / outs; j++) { \
        const long first = (long)j * outs; \
        row_avx2(R, (R) <= 2 ? 2 : 1, w + first * groups * 16, d + first * groups, m + first * groups, x, ldx, \
                 xsum, groups, y + first, ldy); \
    } \
    if (outs == 2 && n % 2) \
        row_avx2(R, 1, w + (n - 1L) * groups * 16, d + (n - 1L) * groups, m + (n - 1L) * groups, x, ldx, xsum, \
                 groups, y + n - 1, ldy); }

__attribute__((target("avx2,fma")))
static void pass_avx2(int rows, const uint8_t *w, const float *d, const float *m, const float *x, long ldx,
                      const float *xsum, float *y, long ldy, int n, int groups, int threads) {
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

static void pass_scalar(int rows, const uint8_t *w, const float *d, const float *m, const float *x, long ldx,
                        const float *xsum, float *y, long ldy, int n, int groups, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int j = 0; j < n; j++)
        row_scalar(rows, w + (long)j * groups * 16, d + (long)j * groups, m + (long)j * groups, x, ldx, xsum,
                   groups, y + j, ldy);
}

/* Weight rows as fp32 for the wide path (gemv_common.h): d * q + m, exactly the loader's weight. */
#if FLEETLLM_X86
__attribute__((target("avx2,fma")))
static void dequantize_q4(const void *wv, const float *d, const float *m, long first, int count, int groups,
                         float *buf) {
    const __m256i mask = _mm256_set1_epi32(15);
    const uint8_t *w = (const uint8_t *)wv + first * groups * 16;
    d += first * groups, m += first * groups;
    for (long g = 0; g < (long)count * groups; g++) {
        const uint8_t *b = w + 16 * g;
        const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
        const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8)));
        const __m256 dg = _mm256_broadcast_ss(d + g), mg = _mm256_broadcast_ss(m + g);
        float *o = buf + 32 * g;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_and_si256(v0, mask))), mg));
        _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4))), mg));
        _mm256_storeu_ps(o + 16, _mm256_add_ps(_mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_and_si256(v1, mask))), mg));
        _mm256_storeu_ps(o + 24, _mm256_add_ps(_mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4))), mg));
    }
}
#endif  /* FLEETLLM_X86 */

/* y[r * ldy + j] = sum_k x[r * ldx + k] * W[j, k] for r < rows, j < n; k_in a multiple of 32. Rows go in
 * passes of up to MAX_ROWS, each reading the weights once; `vector` 0 forces the scalar path (tests).
 * Returns 0, or -1 for a k_in it cannot take. */
int q4_gemv(const float *x, long ldx, const uint8_t *w, const float *d, const float *m, float *y, long ldy,
            int rows, int n, int k_in, int threads, int vector) {
    if (k_in % 32 != 0 || k_in <= 0) return -1;
    const int groups = k_in / 32, vec = vector && q4_gemv_isa() == 2;
#if FLEETLLM_X86
    if (vec && rows >= WIDE_FROM) {
        wide_avx2(dequantize_q4, w, d, m, x, ldx, y, ldy, rows, n, groups, threads);
        return 0;
    }
#endif
    float xsum[MAX_ROWS * groups];
    for (int r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int r = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
        const float *xr = x + r0 * ldx;
        group_sums(xr, ldx, r, groups, xsum);
#if FLEETLLM_X86
        if (vec) pass_avx2(r, w, d, m, xr, ldx, xsum, y + r0 * ldy, ldy, n, groups, threads);
        else
#endif
        pass_scalar(r, w, d, m, xr, ldx, xsum, y + r0 * ldy, ldy, n, groups, threads);
    }
    return 0;
}

/* The group's levels from its fp32 weights (see q4.py's recover_q4_1, which this computes in one pass, bit for
 * bit the same: m = min, d = (max - min) / 15 rounded to fp16, q = round((w - m) / d) in 0..15); returns
 * whether d * q + m gives every weight back (a product then a sum, each rounded, as the GGUF reader does). */
#if FLEETLLM_X86
__attribute__((target("avx2,fma,f16c")))
static int recover_group(const float *w, uint8_t *packed, float *d_out, float *m_out) {
    __m256 v[4], lo = _mm256_loadu_ps(w), hi = lo;
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(w + 8 * j);
        lo = _mm256_min_ps(lo, v[j]);
        hi = _mm256_max_ps(hi, v[j]);
    }
    float l[8], h[8], m, x;
    _mm256_storeu_ps(l, lo);
    _mm256_storeu_ps(h, hi);
    m = l[0], x = h[0];
    for (int i = 1; i < 8; i++) {
        m = l[i] < m ? l[i] : m;
        x = h[i] > x ? h[i] : x;
    }
    const float d = _cvtsh_ss(_cvtss_sh((x - m) / 15.f, _MM_FROUND_TO_NEAREST_INT));
    const __m256 vm = _mm256_set1_ps(m), vd = _mm256_set1_ps(d), step = _mm256_set1_ps(d > 0.f ? d : 1.f);
    int exact = 1, q[32];
    for (int j = 0; j < 4; j++) {
        __m256 t = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(v[j], vm), step),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        t = _mm256_min_ps(_mm256_max_ps(t, _mm256_setzero_ps()), _mm256_set1_ps(15.f));
        const __m256 back = _mm256_add_ps(_mm256_mul_ps(vd, t), vm);
        exact &= _mm256_movemask_ps(_mm256_cmp_ps(back, v[j], _CMP_EQ_OQ)) == 0xff;
        _mm256_storeu_si256((__m256i *)(q + 8 * j), _mm256_cvtps_epi32(t));
    }
    for (int i = 0; i < 8; i++) {
        packed[i] = (uint8_t)(q[i] | q[8 + i] << 4);
        packed[8 + i] = (uint8_t)(q[16 + i] | q[24 + i] << 4);
    }
    *d_out = d, *m_out = m;
    return exact;
}

/* Fills `packed` [N, K/32, 16], `d` and `m` [N, K/32] from `w` [N, K] row-major. Returns 1 when every weight
 * is rebuilt exactly, 0 when not, -1 when this CPU or K cannot take it (the caller recovers in PyTorch). */
int q4_recover(const float *w, long n, int k_in, uint8_t *packed, float *d, float *m, int threads) {
    if (k_in % 32 != 0 || k_in <= 0 || q4_gemv_isa() != 2 || !__builtin_cpu_supports("f16c")) return -1;
    const long groups = (long)n * (k_in / 32);
    int exact = 1;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(&:exact)
    for (long g = 0; g < groups; g++)
        exact &= recover_group(w + 32 * g, packed + 16 * g, d + g, m + g);
    return exact;
}
#else
int q4_recover(const float *w, long n, int k_in, uint8_t *packed, float *d, float *m, int threads) {
    return -1;  /* no vector path here: the caller recovers in PyTorch */
}
#endif  /* FLEETLLM_X86 */
