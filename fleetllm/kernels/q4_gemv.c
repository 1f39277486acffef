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
#include <immintrin.h>

#define MAX_ROWS 8

int q4_gemv_isa(void) {
    static int isa = -1;
    if (isa < 0) {
        __builtin_cpu_init();
        isa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 0;
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

__attribute__((target("avx2,fma")))
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum_g m[g] * xs[g]: the zero-point term of one output row for one activation row. */
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

static void pass_scalar(int rows, const uint8_t *w, const float *d, const float *m, const float *x, long ldx,
                        const float *xsum, float *y, long ldy, int n, int groups, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int j = 0; j < n; j++)
        row_scalar(rows, w + (long)j * groups * 16, d + (long)j * groups, m + (long)j * groups, x, ldx, xsum,
                   groups, y + j, ldy);
}

/* y[r * ldy + j] = sum_k x[r * ldx + k] * W[j, k] for r < rows, j < n; k_in a multiple of 32. Rows go in
 * passes of up to MAX_ROWS, each reading the weights once; `vector` 0 forces the scalar path (tests).
 * Returns 0, or -1 for a k_in it cannot take. */
int q4_gemv(const float *x, long ldx, const uint8_t *w, const float *d, const float *m, float *y, long ldy,
            int rows, int n, int k_in, int threads, int vector) {
    if (k_in % 32 != 0 || k_in <= 0) return -1;
    const int groups = k_in / 32, vec = vector && q4_gemv_isa() == 2;
    float xsum[MAX_ROWS * groups];
    for (int r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int r = rows - r0 < MAX_ROWS ? rows - r0 : MAX_ROWS;
        const float *xr = x + r0 * ldx;
        group_sums(xr, ldx, r, groups, xsum);
        if (vec) pass_avx2(r, w, d, m, xr, ldx, xsum, y + r0 * ldy, ldy, n, groups, threads);
        else pass_scalar(r, w, d, m, xr, ldx, xsum, y + r0 * ldy, ldy, n, groups, threads);
    }
    return 0;
}
