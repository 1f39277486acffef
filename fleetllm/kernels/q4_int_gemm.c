/* Q4_1 weights times integer activations: y[M, N] = x[M, K] @ W[N, K]^T with integer dot products.
 *
 * The activations are quantised per row and group of 32 inputs on entry, symmetric, to int16 (scale
 * max|x| / 32767: q4_i16_gemm) or int8 (max|x| / 127, llama.cpp's Q8_0: q4_i8_gemm); the weights are the
 * GGUF's own 4-bit levels. Per group the product is d * sx * sum_i q_i qx_i + m * sum_i x_i: the first sum in
 * int32 (int8: u8 x s8, VNNI's vpdpbusd or AVX2's vpmaddubsw + vpmaddwd; int16: the levels widened, vpdpwssd
 * or vpmaddwd), the zero-point term from the exact fp32 sums of x. Only the rounding of x departs from the
 * fp32 GEMV.
 *
 * Weight layout ("blocked", fleetllm/kernels/q4_int.py builds it from the packed one): groups are padded with
 * zeros to a multiple of 4 and taken in blocks of 8 (a last block of 4). A block stores the packed bytes of
 * its groups interleaved 4 bytes at a time, chunk-major: in a full block chunk c (packed bytes 4c..4c+3) of
 * group j lies at c * 32 + j * 4, so one 32-byte load holds a chunk of all 8 groups and lane j of every int8
 * dot product belongs to group j: a block's 8 dot products accumulate per group without a horizontal sum, and
 * one vector of d * sx scales all 8 groups at once. In a block of 4 the chunk stride is 16: a 32-byte load
 * holds chunks 2k and 2k + 1, lanes j and 4 + j both group j, scaled by the same (repeated) factor. The int16
 * path reads a block as two quads of 4 groups (16 bytes a chunk, widened to 16 int16: lane pair 2j, 2j + 1 is
 * group j). The activations are written in the matching order: per block (or quad), vector v (low nibbles of
 * chunk c: v = 2c; high: v = 2c + 1) holds in lane j the 4 inputs of group j that those nibbles multiply.
 *
 * Weight rows go to OpenMP threads in tiles of ROW_TILE rows; each tile meets the activation rows in passes of up
 * to PASS rows held in registers (two weight rows at once for one or two activation rows). VNNI (AVX-512 VL)
 * or AVX2 is chosen at run time; the caller keeps its fp32 path on other CPUs.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#include "gemv_common.h"

#define PASS 8   /* activation rows per register pass */
#define ROW_TILE 16  /* weight rows per thread tile */
#define SERIAL_ROWS 4  /* up to this many rows are quantised by the calling thread */

static int isa_cap = 3;

#if FLEETLLM_X86
/* 3: AVX-512 VNNI + VL; 2: AVX2 + FMA + F16C; 0: neither (the caller must not call the GEMMs); at most the cap. */
int q4_int_isa(void) {
    static int isa = -1;
    if (isa < 0) {
        __builtin_cpu_init();
        const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        isa = !avx2 ? 0 : __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") ? 3 : 2;
    }
    return isa < isa_cap ? isa : isa_cap;
}

/* Caps the instruction set the GEMMs use (2: the AVX2 path on a VNNI CPU, for the tests); returns the new level. */
int q4_int_cap_isa(int cap) {
    isa_cap = cap < 2 ? 2 : cap;
    return q4_int_isa();
}

/* Where run s of a group's inputs (inputs 4s..4s+3) goes: the vector whose nibbles multiply it. Packed byte p
 * holds levels p (low) and 8 + p (high) for p < 8, 8 + p and 16 + p for p >= 8 (see q4.py). */
static const int RUN_VECTOR[8] = {0, 2, 1, 3, 4, 6, 5, 7};

/* The largest of v's lanes (hsum8, from gemv_common.h, is their sum). */
__attribute__((target("avx2,fma")))
static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* A group's 32 inputs as four vectors, with their largest magnitude and their sum. */
__attribute__((target("avx2,fma")))
static inline void group_stats(const float *xg, __m256 v[4], float *top, float *sum) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 amax = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int t = 0; t < 4; t++) {
        v[t] = _mm256_loadu_ps(xg + 8 * t);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[t]));
        total = _mm256_add_ps(total, v[t]);
    }
    *top = hmax(amax), *sum = hsum8(total);
}

/* fp16 scales (the GGUF's own d and m, exactly) as fp32 lanes: 8, 4, or 4 repeated in both halves. */
__attribute__((target("avx2,fma,f16c")))
static inline __m256 halves8(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }

__attribute__((target("avx2,fma,f16c")))
static inline __m128 halves4(const uint16_t *h) { return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h)); }

__attribute__((target("avx2,fma,f16c")))
static inline __m256 halves4x2(const uint16_t *h) {
    const __m128 v = halves4(h);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(v), v, 1);
}

/* Row r's activations: int8 levels in the blocked order, per group the scale and the exact fp32 sum. */
__attribute__((target("avx2,fma")))
static void quantize_row(const float *x, int groups, int padded, int8_t *q, float *sx, float *xsum) {
    memset(q + 256L * (groups / 8), 0, 32L * padded - 256L * (groups / 8));  /* the lanes of padding groups */
    for (int g = groups; g < padded; g++) sx[g] = xsum[g] = 0.f;
    const int full = padded / 8;
    for (int g = 0; g < groups; g++) {
        __m256 v[4];
        float top;
        group_stats(x + 32L * g, v, &top, xsum + g);
        sx[g] = top / 127.f;
        const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
        const int b = g / 8, j = g % 8, half = b == full;
        int8_t *base = q + 256L * b;
        for (int t = 0; t < 4; t++) {
            const __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));
            const __m256i i8 = _mm256_packs_epi16(_mm256_packs_epi32(i32, i32), _mm256_setzero_si256());
            const int32_t runs[2] = {_mm256_cvtsi256_si32(i8), _mm256_extract_epi32(i8, 4)};
            for (int u = 0; u < 2; u++) {
                const int vec = RUN_VECTOR[2 * t + u];
                const long at = half ? (vec / 4 * 2 + vec % 2) * 32 + ((vec / 2) % 2 * 4 + j) * 4 : vec * 32 + j * 4;
                memcpy(base + at, &runs[u], 4);
            }
        }
    }
}

/* The integer dot of one weight row's block with one activation row's block, per lane (= per group). `nvec`
 * is 8 for a full block, 4 for a half one; `w` holds the unpacked levels. Two chains hide the latency. */
#define DOT_BLOCK(DOT, nvec, w, xq, out) { \
    __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256(); \
    for (int v = 0; v < (nvec); v += 2) { \
        p0 = DOT(p0, (w)[v], _mm256_loadu_si256((const __m256i *)((xq) + 32 * v))); \
        p1 = DOT(p1, (w)[v + 1], _mm256_loadu_si256((const __m256i *)((xq) + 32 * (v + 1)))); \
    } \
    out = _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)); }

/* One block (NV = 8 groups, or 4) of `outs` weight rows against `rows` activation rows, at group g. */
#define TILE_BLOCK(DOT, NV) { \
    __m256i wv[2][8]; \
    __m256 dv[2]; \
    for (int o = 0; o < outs; o++) { \
        for (int c = 0; c < (NV) / 2; c++) { \
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + o * wstride + 16L * g + 32 * c)); \
            wv[o][2 * c] = _mm256_and_si256(raw, low); \
            wv[o][2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low); \
        } \
        dv[o] = (NV) == 8 ? halves8(d + o * dstride + g) : halves4x2(d + o * dstride + g); \
    } \
    for (int r = 0; r < rows; r++) { \
        const __m256 s = (NV) == 8 ? _mm256_loadu_ps(sx + r * padded + g) \
                                   : _mm256_broadcast_ps((const __m128 *)(sx + r * padded + g)); \
        for (int o = 0; o < outs; o++) { \
            __m256 t; \
            DOT_BLOCK(DOT, NV, wv[o], xq + r * xstride + 32L * g, t) \
            acc[o][r] = _mm256_fmadd_ps(t, _mm256_mul_ps(dv[o], s), acc[o][r]); \
        } \
    } }

/* y = the scaled lanes' sum + sum_g m_g * xsum_g, per weight and activation row of the tile. */
#define ZERO_POINT_TERM \
    for (int o = 0; o < outs; o++) \
        for (int r = 0; r < rows; r++) { \
            __m256 z = _mm256_setzero_ps(); \
            int g = 0; \
            for (; g + 8 <= padded; g += 8) \
                z = _mm256_fmadd_ps(halves8(m + o * dstride + g), _mm256_loadu_ps(xsum + r * padded + g), z); \
            float tail = 0.f; \
            for (; g < padded; g++) tail += _cvtsh_ss(m[o * dstride + g]) * xsum[r * padded + g]; \
            y[r * ldy + o] = hsum8(_mm256_add_ps(acc[o][r], z)) + tail; \
        }

/* Rows [0, rows) of the pass against weight rows [0, outs): unpacks each block once, then every activation
 * row's dot products; finally y = the scaled lanes' sum + the zero-point term. */
#define DEFINE_TILE(NAME, TARGET, DOT) \
__attribute__((target(TARGET), always_inline)) \
static inline void NAME(const int outs, const int rows, const uint8_t *w, long wstride, const uint16_t *d, \
                        const uint16_t *m, long dstride, const int8_t *xq, long xstride, const float *sx, \
                        const float *xsum, int padded, float *y, long ldy) { \
    const __m256i low = _mm256_set1_epi8(15); \
    __m256 acc[2][PASS]; \
    for (int o = 0; o < outs; o++) for (int r = 0; r < rows; r++) acc[o][r] = _mm256_setzero_ps(); \
    int g = 0; \
    for (; g + 8 <= padded; g += 8) TILE_BLOCK(DOT, 8) \
    if (g < padded) TILE_BLOCK(DOT, 4) \
    ZERO_POINT_TERM \
}

#define DOT_VNNI(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#define DOT_AVX2(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))

DEFINE_TILE(tile8_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", DOT_VNNI)
DEFINE_TILE(tile8_avx2, "avx2,fma,f16c", DOT_AVX2)

/* One pass (`rows` <= PASS activation rows) over weight rows [n0, n1), the counts fixed per call site. */
#define PASS_OVER(TILEFN, R) { \
    const int outs = (R) <= 2 ? 2 : 1; \
    int j = n0; \
    for (; j + outs <= n1; j += outs) \
        TILEFN(outs, R, w + j * wstride, wstride, d + j * padded, m + j * padded, padded, xq, xstride, sx, xsum, \
               padded, y + j, ldy); \
    for (; j < n1; j++) \
        TILEFN(1, R, w + j * wstride, wstride, d + j * padded, m + j * padded, padded, xq, xstride, sx, xsum, \
               padded, y + j, ldy); }

#define DEFINE_PASS(NAME, TARGET, TILEFN, XTYPE) \
__attribute__((target(TARGET))) \
static void NAME(int rows, const uint8_t *w, long wstride, const uint16_t *d, const uint16_t *m, int padded, \
                 const void *xv, long xbytes, const float *sx, const float *xsum, float *y, long ldy, \
                 int n0, int n1) { \
    const XTYPE *xq = xv; \
    const long xstride = xbytes / (long)sizeof(XTYPE); \
    switch (rows) { \
        case 1: PASS_OVER(TILEFN, 1) break; case 2: PASS_OVER(TILEFN, 2) break; \
        case 3: PASS_OVER(TILEFN, 3) break; case 4: PASS_OVER(TILEFN, 4) break; \
        case 5: PASS_OVER(TILEFN, 5) break; case 6: PASS_OVER(TILEFN, 6) break; \
        case 7: PASS_OVER(TILEFN, 7) break; default: PASS_OVER(TILEFN, 8) break; \
    } \
}

DEFINE_PASS(pass_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", tile8_vnni, int8_t)
DEFINE_PASS(pass_avx2, "avx2,fma,f16c", tile8_avx2, int8_t)

/* ---- int16 activations: the same weights, 2^15 levels per group instead of 2^7 ----------------------------
 * Per quad of 4 groups and row: 8 vectors of 16 int16 (vector v as above, lane pair 2j, 2j + 1 group j of the
 * quad), multiplied by the widened weight levels with vpdpwssd (VNNI) or vpmaddwd (AVX2); the scales come
 * duplicated per lane pair. Half the integer throughput of int8, and the rounding of x is 256x finer. */
__attribute__((target("avx2,fma")))
static void quantize_row16(const float *x, int groups, int padded, int16_t *q, float *sxd, float *xsum) {
    memset(q + 128L * (groups / 4), 0, 2 * (32L * padded - 128L * (groups / 4)));  /* the lanes of padding groups */
    for (int g = groups; g < padded; g++) sxd[2 * g] = sxd[2 * g + 1] = xsum[g] = 0.f;
    for (int g = 0; g < groups; g++) {
        __m256 v[4];
        float top;
        group_stats(x + 32L * g, v, &top, xsum + g);
        sxd[2 * g] = sxd[2 * g + 1] = top / 32767.f;
        const __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
        int16_t *base = q + 128L * (g / 4) + 4 * (g % 4);
        for (int t = 0; t < 4; t++) {
            const __m256i i32 = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], inv));
            const __m256i i16 = _mm256_packs_epi32(i32, i32);
            const int64_t runs[2] = {_mm256_extract_epi64(i16, 0), _mm256_extract_epi64(i16, 2)};
            for (int u = 0; u < 2; u++) memcpy(base + 16 * RUN_VECTOR[2 * t + u], &runs[u], 8);
        }
    }
}

#define DEFINE_TILE16(NAME, TARGET, DOT) \
__attribute__((target(TARGET), always_inline)) \
static inline void NAME(const int outs, const int rows, const uint8_t *w, long wstride, const uint16_t *d, \
                        const uint16_t *m, long dstride, const int16_t *xq, long xstride, const float *sxd, \
                        const float *xsum, int padded, float *y, long ldy) { \
    const __m128i low = _mm_set1_epi8(15); \
    const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3); \
    const int full = padded / 8; \
    __m256 acc[2][PASS]; \
    for (int o = 0; o < outs; o++) for (int r = 0; r < rows; r++) acc[o][r] = _mm256_setzero_ps(); \
    for (int q = 0; q < padded / 4; q++) { \
        const long base = q / 2 < full ? 128L * (q / 2) + 16 * (q % 2) : 128L * full; \
        const int cs = q / 2 < full ? 32 : 16; \
        __m256i wv[2][8]; \
        __m256 dv[2]; \
        for (int o = 0; o < outs; o++) { \
            for (int c = 0; c < 4; c++) { \
                const __m128i raw = _mm_loadu_si128((const __m128i *)(w + o * wstride + base + cs * c)); \
                wv[o][2 * c] = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low)); \
                wv[o][2 * c + 1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low)); \
            } \
            dv[o] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(halves4(d + o * dstride + 4 * q)), pairs); \
        } \
        for (int r = 0; r < rows; r++) { \
            const __m256 s = _mm256_loadu_ps(sxd + r * 2L * padded + 8 * q); \
            for (int o = 0; o < outs; o++) { \
                __m256 t; \
                DOT_BLOCK(DOT, 8, wv[o], (const int8_t *)(xq + r * xstride + 128L * q), t) \
                acc[o][r] = _mm256_fmadd_ps(t, _mm256_mul_ps(dv[o], s), acc[o][r]); \
            } \
        } \
    } \
    ZERO_POINT_TERM \
}

#define DOT16_VNNI(acc, w, x) _mm256_dpwssd_epi32(acc, w, x)
#define DOT16_AVX2(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))

DEFINE_TILE16(tile16_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", DOT16_VNNI)
DEFINE_TILE16(tile16_avx2, "avx2,fma,f16c", DOT16_AVX2)
DEFINE_PASS(pass16_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", tile16_vnni, int16_t)
DEFINE_PASS(pass16_avx2, "avx2,fma,f16c", tile16_avx2, int16_t)

/* One pass's function (a DEFINE_PASS): `xbytes` apart, the quantised activation rows of either width. */
typedef void pass_fn(int rows, const uint8_t *w, long wstride, const uint16_t *d, const uint16_t *m, int padded,
                     const void *xv, long xbytes, const float *sx, const float *xsum, float *y, long ldy, int n0, int n1);

/* Quantises the rows (`bits` 8 or 16), then runs the passes over each thread's weight tiles. */
static int gemm(int bits, const float *x, long ldx, const uint8_t *w, const uint16_t *d, const uint16_t *m, float *y,
                long ldy, int rows, int n, int k_in, int threads) {
    if (k_in % 32 != 0 || k_in <= 0) return -1;
    const int isa = q4_int_isa(), groups = k_in / 32, padded = (groups + 3) / 4 * 4, scales = bits == 8 ? 1 : 2;
    if (isa == 0) return -2;
    const long xstride = 32L * padded * (bits / 8), wstride = 16L * padded, per_row = scales * padded;
    char *xq = malloc((size_t)rows * xstride + sizeof(float) * (size_t)rows * (per_row + padded) + 64);
    if (xq == NULL) return -2;
    float *sx = (float *)(xq + ((size_t)rows * xstride + 63) / 64 * 64), *xsum = sx + rows * per_row;
    const int tiles = (n + ROW_TILE - 1) / ROW_TILE;
    pass_fn *const pass = bits == 8 ? (isa == 3 ? pass_vnni : pass_avx2) : (isa == 3 ? pass16_vnni : pass16_avx2);
    /* a few rows are quantised here: splitting them would cost the threads a barrier more than it saves */
    #pragma omp parallel num_threads(rows > SERIAL_ROWS ? threads : 1)
    #pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        if (bits == 8)
            quantize_row(x + r * ldx, groups, padded, (int8_t *)(xq + r * xstride), sx + r * per_row, xsum + (long)r * padded);
        else
            quantize_row16(x + r * ldx, groups, padded, (int16_t *)(xq + r * xstride), sx + r * per_row, xsum + (long)r * padded);
    }
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int t = 0; t < tiles; t++) {
            const int n0 = t * ROW_TILE, n1 = n0 + ROW_TILE < n ? n0 + ROW_TILE : n;
            for (int r0 = 0; r0 < rows; r0 += PASS) {
                const int r = rows - r0 < PASS ? rows - r0 : PASS;
                const void *xr = xq + r0 * xstride;
                pass(r, w, wstride, d, m, padded, xr, xstride, sx + r0 * per_row, xsum + (long)r0 * padded,
                     y + r0 * ldy, ldy, n0, n1);
            }
        }
    }
    free(xq);
    return 0;
}

/* y[r * ldy + j] = sum_k x[r * ldx + k] * W[j, k] for r < rows, j < n, with W blocked as above: `w` [n,
 * padded * 16] bytes, `d` and `m` [n, padded] fp16 (zeros past the real groups), padded = K/32 rounded up to 4.
 * Activations in int8 (q4_i8_gemm) or int16 (q4_i16_gemm). `vector` is ignored (the signature is the decode
 * stack's GEMV pointer's). Returns 0, -1 for a K it cannot take, -2 without AVX2 or memory. */
int q4_i8_gemm(const float *x, long ldx, const uint8_t *w, const uint16_t *d, const uint16_t *m, float *y, long ldy,
               int rows, int n, int k_in, int threads, int vector) {
    (void)vector;
    return gemm(8, x, ldx, w, d, m, y, ldy, rows, n, k_in, threads);
}

int q4_i16_gemm(const float *x, long ldx, const uint8_t *w, const uint16_t *d, const uint16_t *m, float *y, long ldy,
                int rows, int n, int k_in, int threads, int vector) {
    (void)vector;
    return gemm(16, x, ldx, w, d, m, y, ldy, rows, n, k_in, threads);
}

#else  /* not x86: no vector path, so no kernel (the callers keep their PyTorch paths) */
int q4_int_isa(void) {
    return 0;
}
int q4_int_cap_isa(int cap) {
    return 0;
}
int q4_i8_gemm(const float *x, long ldx, const uint8_t *w, const uint16_t *d, const uint16_t *m, float *y, long ldy,
               int rows, int n, int k_in, int threads, int vector) {
    return -2;
}
int q4_i16_gemm(const float *x, long ldx, const uint8_t *w, const uint16_t *d, const uint16_t *m, float *y, long ldy,
                int rows, int n, int k_in, int threads, int vector) {
    return -2;
}
#endif  /* FLEETLLM_X86 */
