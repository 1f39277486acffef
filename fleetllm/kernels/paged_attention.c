/* Paged attention on the CPU: each query reads its keys and values straight from the KV blocks its
 * block table names, with no gather into a contiguous tensor first.
 *
 * Plain C with no torch headers, so it builds in about a second (see fleetllm/kernels/build.py); Python
 * hands it data pointers of contiguous tensors through ctypes.
 *
 * Layout: the cache of one layer is [num_blocks * block_size, kv_heads, head_dim] (fp32, fp16 or bf16);
 * key position p of a sequence lives in slot table[p / block_size] * block_size + p % block_size. A query
 * row r reads the table row table_of[r] (r when table_of is NULL) and attends to positions [max(0, len - window), len) with
 * len = context_lens[r]: a decode step has one row per sequence, a chunk of n queries over cached context
 * has n rows sharing one table with lengths n_ctx - n + 1 ... n_ctx (causal by construction).
 *
 * Work is split over (query row, KV head) with OpenMP: the g = heads / kv_heads query heads that share a
 * KV head are computed together, so every key and value vector is loaded once for all of them (GQA).
 * Softmax is exact two-pass over a per-task score buffer: scores, then max, exp and sum, then weighted
 * values. Vector code (AVX2 + FMA, F16C for fp16 keys) is chosen at run time; a scalar path covers the rest.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#include "gemv_common.h"  /* hsum8 */

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

typedef struct {
    const float *q; long q_row_stride;        /* q[row * q_row_stride + head * head_dim + i] */
    const void *k_cache, *v_cache; int kv_dtype;
    const int32_t *tables; int table_stride;  /* block table rows, table_stride entries apart */
    const int32_t *table_of, *context_lens;   /* per query row: its table row and context length */
    float *out; long out_row_stride;
    int heads, kv_heads, head_dim, block_size, window;
    float scale;
} PagedArgs;

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) { bits = sign; }
        else {  /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) { bits = sign | 0x7f800000u | (man << 13); }
    else { bits = sign | ((exp + 127 - 15) << 23) | (man << 13); }
    float f; memcpy(&f, &bits, 4); return f;
}

static inline float load_scalar(const void *base, long idx, int dtype) {
    if (dtype == KV_F32) return ((const float *)base)[idx];
    uint16_t h = ((const uint16_t *)base)[idx];
    if (dtype == KV_F16) return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f;
}

static inline long slot_of(const PagedArgs *a, const int32_t *table, int pos) {
    return (long)table[pos / a->block_size] * a->block_size + pos % a->block_size;
}

/* ---- scalar path ---------------------------------------------------------------------------------- */

static void task_scalar(const PagedArgs *a, int row, int kvh, float *scores) {
    const int d = a->head_dim, g = a->heads / a->kv_heads, len = a->context_lens[row];
    const int first = a->window > 0 && len > a->window ? len - a->window : 0, n = len - first;
    const int32_t *table = a->tables + (long)(a->table_of ? a->table_of[row] : row) * a->table_stride;
    const float *q = a->q + row * a->q_row_stride + (long)kvh * g * d;
    float *out = a->out + row * a->out_row_stride + (long)kvh * g * d;
    for (int j = 0; j < n; j++) {
        long base = (slot_of(a, table, first + j) * a->kv_heads + kvh) * d;
        for (int h = 0; h < g; h++) {
            float s = 0.f;
            for (int i = 0; i < d; i++) s += q[h * d + i] * load_scalar(a->k_cache, base + i, a->kv_dtype);
            scores[h * n + j] = s * a->scale;
        }
    }
    for (int h = 0; h < g; h++) {
        float *sc = scores + h * n, m = -INFINITY, sum = 0.f;
        for (int j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
        for (int j = 0; j < n; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
        for (int j = 0; j < n; j++) sc[j] /= sum;
    }
    memset(out, 0, sizeof(float) * g * d);
    for (int j = 0; j < n; j++) {
        long base = (slot_of(a, table, first + j) * a->kv_heads + kvh) * d;
        for (int i = 0; i < d; i++) {
            float v = load_scalar(a->v_cache, base + i, a->kv_dtype);
            for (int h = 0; h < g; h++) out[h * d + i] += scores[h * n + j] * v;
        }
    }
}

/* ---- AVX2 path: head_dim a multiple of 8 ---------------------------------------------------------- */

#define BLOCK_VECS 8  /* vectors of head_dim (64 floats) held in registers at once: all of a 64-wide head */
#define PARALLEL_MIN_KEYS 4096  /* (position, kv head) pairs below which one thread is faster */

#if FLEETLLM_X86
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 load8(const void *base, long idx, int dtype) {
    if (dtype == KV_F32) return _mm256_loadu_ps((const float *)base + idx);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx));
    if (dtype == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Scores of the g heads over the keys for head_dim's vectors v0 .. v0 + nb - 1: each key's vectors are loaded
 * into registers once for all g heads (written by the first block, added to by the others). Inlined with nb and
 * dtype constants, so the full block's loops unroll and its loads do not branch on the cache's type. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void score_block(const PagedArgs *a, const int32_t *table, int first, int n, int kvh, const float *q,
                               float *scores, int v0, const int nb, const int dtype) {
    const int d = a->head_dim, g = a->heads / a->kv_heads;
    for (int j = 0; j < n; j++) {
        const long base = (slot_of(a, table, first + j) * a->kv_heads + kvh) * d + 8 * v0;
        __m256 k[BLOCK_VECS];
        for (int v = 0; v < nb; v++) k[v] = load8(a->k_cache, base + 8 * v, dtype);
        for (int h = 0; h < g; h++) {
            const float *qh = q + h * d + 8 * v0;
            __m256 acc = _mm256_setzero_ps();
            for (int v = 0; v < nb; v++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * v), k[v], acc);
            const float s = hsum8(acc) * a->scale;
            scores[h * n + j] = v0 == 0 ? s : scores[h * n + j] + s;
        }
    }
}

/* out[h] += sum_j p[h, j] v_j over head_dim's vectors v0 .. v0 + nb - 1, in nb register accumulators per head. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void value_block(const PagedArgs *a, const int32_t *table, int first, int n, int kvh,
                               const float *scores, float *out, int v0, const int nb, const int dtype) {
    const int d = a->head_dim, g = a->heads / a->kv_heads;
    for (int h = 0; h < g; h++) {
        __m256 acc[BLOCK_VECS];
        for (int v = 0; v < nb; v++) acc[v] = _mm256_setzero_ps();
        for (int j = 0; j < n; j++) {
            const long base = (slot_of(a, table, first + j) * a->kv_heads + kvh) * d + 8 * v0;
            const __m256 p = _mm256_set1_ps(scores[h * n + j]);
            for (int v = 0; v < nb; v++) acc[v] = _mm256_fmadd_ps(p, load8(a->v_cache, base + 8 * v, dtype), acc[v]);
        }
        for (int v = 0; v < nb; v++) _mm256_storeu_ps(out + h * d + 8 * (v0 + v), acc[v]);
    }
}

/* A full block per cache type with everything constant; a last partial block (head_dim not a multiple of 64)
 * with its width and type read at run time. */
#define BY_BLOCK(CALL) do { \
    if (nb < BLOCK_VECS) CALL(nb, a->kv_dtype); \
    else if (a->kv_dtype == KV_F32) CALL(BLOCK_VECS, KV_F32); \
    else if (a->kv_dtype == KV_F16) CALL(BLOCK_VECS, KV_F16); \
    else CALL(BLOCK_VECS, KV_BF16); } while (0)

/* The scores (values == 0, into `scores`) or the weighted values (values == 1, into `out`), block by block. */
__attribute__((target("avx2,fma,f16c")))
static void by_blocks_avx2(const PagedArgs *a, const int32_t *table, int first, int n, int kvh, const float *q,
                           float *scores, float *out, int values) {
    const int nv = a->head_dim / 8;
    for (int v0 = 0; v0 < nv; v0 += BLOCK_VECS) {
        const int nb = nv - v0 < BLOCK_VECS ? nv - v0 : BLOCK_VECS;
#define SCORES(NB, DT) score_block(a, table, first, n, kvh, q, scores, v0, NB, DT)
#define VALUES(NB, DT) value_block(a, table, first, n, kvh, scores, out, v0, NB, DT)
        if (values) BY_BLOCK(VALUES);
        else BY_BLOCK(SCORES);
#undef SCORES
#undef VALUES
    }
}

__attribute__((target("avx2,fma,f16c")))
static void task_avx2(const PagedArgs *a, int row, int kvh, float *scores) {
    const int d = a->head_dim, g = a->heads / a->kv_heads, len = a->context_lens[row];
    const int first = a->window > 0 && len > a->window ? len - a->window : 0, n = len - first;
    const int32_t *table = a->tables + (long)(a->table_of ? a->table_of[row] : row) * a->table_stride;
    const float *q = a->q + row * a->q_row_stride + (long)kvh * g * d;
    by_blocks_avx2(a, table, first, n, kvh, q, scores, NULL, 0);
    for (int h = 0; h < g; h++) {
        float *sc = scores + h * n, m = -INFINITY, sum = 0.f;
        for (int j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
        for (int j = 0; j < n; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
        float inv = 1.f / sum;
        for (int j = 0; j < n; j++) sc[j] *= inv;
    }
    by_blocks_avx2(a, table, first, n, kvh, q, scores, a->out + row * a->out_row_stride + (long)kvh * g * d, 1);
}
#endif  /* FLEETLLM_X86 */

/* ---- entry points --------------------------------------------------------------------------------- */

/* 2 when the AVX2 path runs on this CPU, 0 for the scalar one (reported by Python, and used by tests). */
int paged_attention_isa(void) {
#if FLEETLLM_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") ? 2 : 0;
#else
    return 0;
#endif
}

/* Returns 0, or -1 when a score buffer could not be allocated. Runs on `threads` OpenMP threads, or on the
 * caller's alone when the step reads few keys: waking a team costs more than a short decode's attention. */
int paged_attention(const float *q, long q_row_stride, const void *k_cache, const void *v_cache, int kv_dtype,
                    const int32_t *tables, int table_stride, const int32_t *table_of, const int32_t *context_lens,
                    float *out, long out_row_stride, int rows, int heads, int kv_heads, int head_dim,
                    int block_size, int window, float scale, int threads) {
    PagedArgs a = {q, q_row_stride, k_cache, v_cache, kv_dtype, tables, table_stride, table_of, context_lens,
                   out, out_row_stride, heads, kv_heads, head_dim, block_size, window, scale};
    const int vec = paged_attention_isa() == 2 && head_dim % 8 == 0;
    int max_len = 0, failed = 0;
    long keys = 0;
    for (int r = 0; r < rows; r++) {
        max_len = context_lens[r] > max_len ? context_lens[r] : max_len;
        keys += context_lens[r];
    }
    const long scratch = (long)(heads / kv_heads) * (max_len > 0 ? max_len : 1);
    const int tasks = rows * kv_heads;
    #pragma omp parallel num_threads(threads) if(threads > 1 && keys * kv_heads >= PARALLEL_MIN_KEYS) reduction(|:failed)
    {
        float *scores = malloc(sizeof(float) * scratch);
        if (!scores) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; t++) {
            if (!scores) continue;
#if FLEETLLM_X86
            if (vec) task_avx2(&a, t / kv_heads, t % kv_heads, scores);
            else
#endif
            task_scalar(&a, t / kv_heads, t % kv_heads, scores);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
