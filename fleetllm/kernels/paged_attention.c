/* Paged attention on the CPU: each query reads its keys and values straight from the KV blocks its
 * block table names, with no gather into a contiguous tensor first.
 *
 * Plain C with no torch headers, so it builds in about a second (see fleetllm/kernels/build.py); Python
 * hands it data pointers of contiguous tensors through ctypes.
 *
 * Layout: the cache of one layer is [num_blocks * block_size, kv_heads, row] (fp32, fp16 or bf16: row =
 * head_dim; 8-bit int8 / fp8 e4m3 / fp8 e5m2: row = KV8_ROW(head_dim) bytes, the values then a float16 scale
 * per KV8_GROUP of them, see kv8.h); key position p of a sequence lives in slot table[p / block_size] * block_size + p % block_size. A query
 * row r reads the table row table_of[r] (r when table_of is NULL) and attends to positions [max(0, len - window), len) with
 * len = context_lens[r]: a decode step has one row per sequence, a chunk of n queries over cached context
 * has n rows sharing one table with lengths n_ctx - n + 1 ... n_ctx (causal by construction).
 *
 * Work is split over (query row, KV head) with OpenMP: the g = heads / kv_heads query heads that share a
 * KV head are computed together, so every key and value vector is loaded once for all of them (GQA). The
 * queries of one chunk (a speculative verification's, up to MAX_GROUP) over the same keys share a task on the
 * 16/32-bit vector path: each K row read from memory once for all of them, V from L2 after the first; every
 * query's arithmetic (so its floats) as when it runs alone.
 * Softmax is exact two-pass over a per-task score buffer: scores, then max, exp and sum, then weighted
 * values. A context longer than PART_KEYS keys is split into partitions of PART_KEYS keys (flash-decoding):
 * each partition's unnormalised output, max and sum, then one combine per (row, KV head). So a long context
 * runs on every thread even with one row and one KV head (Gemma 3's global layers), and the g passes over a
 * partition's values hit the L2 cache instead of memory. The partitions depend on the row's length and window
 * only: the result does not change with the batch or the thread count. Vector code (AVX2 + FMA, F16C for fp16 keys) is chosen at run time; a scalar path covers the rest.
 *
 * 8-bit rows are read in place and widened in registers, each vector (8 or 16 channels: one group or two) times
 * its groups' scales as it is widened: one multiply per vector of a key or value row, shared by the query heads
 * that read it (GQA); the AVX-512 path widens a row's 8 float16 scales per 64 channels at once and spreads them
 * over its vectors with a permute each. fp8 goes through F16C: an
 * e5m2 byte is the top byte of an fp16, an e4m3 byte shifted into an fp16's exponent and mantissa is its
 * value / 256 (subnormals included), so 256 is folded into its scale.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#include "kv8.h"
#include "gemv_common.h"  /* hsum8, exp8 */


typedef struct {
    const float *q; long q_row_stride;        /* q[row * q_row_stride + head * head_dim + i] */
    const void *k_cache, *v_cache; int kv_dtype;
    const int32_t *tables; int table_stride;  /* block table rows, table_stride entries apart */
    const int32_t *table_of, *context_lens;   /* per query row: its table row and context length */
    float *out; long out_row_stride;
    int heads, kv_heads, head_dim, block_size, window;
    float scale;
    int row;  /* elements of one (slot, kv head) row: head_dim, or KV8_ROW(head_dim) bytes (8-bit) */
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

/* An element as stored: 8-bit ones without their group's scale (see group_scale). */
static inline float load_scalar(const void *base, long idx, int dtype) {
    if (dtype == KV_F32) return ((const float *)base)[idx];
    if (dtype == KV_I8) return ((const int8_t *)base)[idx];
    if (IS_8BIT(dtype)) {
        const uint16_t b = ((const uint8_t *)base)[idx];
        return half_to_float(dtype == KV_E5M2 ? b << 8 : ((b & 0x7f) << 7) | ((b & 0x80) << 8));
    }
    uint16_t h = ((const uint16_t *)base)[idx];
    if (dtype == KV_F16) return half_to_float(h);
    uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f;
}

static inline long slot_of(const PagedArgs *a, const int32_t *table, int pos) {
    return (long)table[pos / a->block_size] * a->block_size + pos % a->block_size;
}

/* Slots of consecutive positions from `first`: one division to start, none per key (an integer division per
 * key costs as much as reading an 8-bit row). The next block's table entry is read only when it is reached. */
typedef struct { const int32_t *table; long slot; int block, left, block_size; } Slots;

static inline Slots slots_from(const PagedArgs *a, const int32_t *table, int first) {
    const int b = first / a->block_size, off = first % a->block_size;
    return (Slots){table, (long)table[b] * a->block_size + off, b, a->block_size - off, a->block_size};
}

static inline long next_slot(Slots *it) {
    if (it->left == 0) {
        it->slot = (long)it->table[++it->block] * it->block_size;
        it->left = it->block_size;
    }
    it->left--;
    return it->slot++;
}

#if FLEETLLM_X86
#define AHEAD_ROWS 16  /* 8-bit rows between a row's prefetch and its use (8: 4% slower at 8k, 32: 2%) */
/* Slots that also prefetch the row AHEAD_ROWS positions on that this KV head reads (8-bit rows; never past the
 * n positions asked): blocks lie anywhere in the pool, so the hardware prefetcher, which follows a block's rows
 * once it has seen a few, misses the start of every block, and an 8-bit row is too little work to hide a miss.
 * One row a step keeps a steady few misses in flight (a whole block's at once filled the miss buffers and
 * stalled the loads behind them). `also` (or NULL): the same row of a second cache, into L2 (the score pass
 * asks for V's, which the value pass reads next). */
typedef struct {
    Slots at, ahead; const uint8_t *cache, *also; long head, stride; int row_bytes, left;
} AheadSlots;

static inline void prefetch_row(const AheadSlots *it, long slot) {
    const long off = slot * it->stride + it->head;
    _mm_prefetch((const char *)it->cache + off, _MM_HINT_T0);
    _mm_prefetch((const char *)it->cache + off + it->row_bytes - 1, _MM_HINT_T0);
    if (!it->also) return;
    _mm_prefetch((const char *)it->also + off, _MM_HINT_T1);
    _mm_prefetch((const char *)it->also + off + it->row_bytes - 1, _MM_HINT_T1);
}

static inline AheadSlots ahead_from(const PagedArgs *a, const int32_t *table, int first, int n, const void *cache,
                                    const void *also, int kvh) {
    AheadSlots it = {slots_from(a, table, first), slots_from(a, table, first), (const uint8_t *)cache,
                     (const uint8_t *)also, (long)kvh * a->row, (long)a->kv_heads * a->row, a->row, n};
    for (int i = 0; i < AHEAD_ROWS && it.left > 0; i++, it.left--) prefetch_row(&it, next_slot(&it.ahead));
    return it;
}

static inline long next_ahead(AheadSlots *it) {
    if (it->left > 0) {
        prefetch_row(it, next_slot(&it->ahead));
        it->left--;
    }
    return next_slot(&it->at);
}
#endif

/* The stored float16 scale of element i's group in the 8-bit row at `base`. */
static inline uint16_t stored_scale(const void *cache, long base, int head_dim, int i) {
    uint16_t h;
    memcpy(&h, (const uint8_t *)cache + base + head_dim + KV8_SCALE_BYTES * (i / KV8_GROUP), KV8_SCALE_BYTES);
    return h;
}

/* What element i of the row at `base` is multiplied by: 1 for fp32/fp16/bf16, its group's scale for 8-bit. */
static inline float group_scale(const void *cache, long base, int head_dim, int dtype, int i) {
    return IS_8BIT(dtype) ? half_to_float(stored_scale(cache, base, head_dim, i)) * kv8_read_unit(dtype) : 1.f;
}

#define PART_KEYS 256  /* keys of one partition: 256 KB of fp32 values at head_dim 256, L2-resident */
#define MAX_GROUP 8  /* rows of one chunk whose scores one pass over K computes (see group_rows) */

/* One task: a query row's g heads under KV head kvh over keys [first, first + n), into out (g * head_dim
 * floats): normalised when ml is NULL, else unnormalised with each head's max and sum in ml[2h], ml[2h + 1]. */
typedef struct {
    int row, kvh, first, n;
    float *out, *ml;
} Part;

static inline const int32_t *table_of_row(const PagedArgs *a, int row) {
    return a->tables + (long)(a->table_of ? a->table_of[row] : row) * a->table_stride;
}

/* ---- scalar path ---------------------------------------------------------------------------------- */

static void task_scalar(const PagedArgs *a, const Part *t, float *scores) {
    const int d = a->head_dim, g = a->heads / a->kv_heads, kvh = t->kvh, first = t->first, n = t->n;
    const int32_t *table = table_of_row(a, t->row);
    const float *q = a->q + t->row * a->q_row_stride + (long)kvh * g * d;
    float *out = t->out;
    for (int j = 0; j < n; j++) {
        long base = (slot_of(a, table, first + j) * a->kv_heads + kvh) * a->row;
        for (int h = 0; h < g; h++) {
            float s = 0.f;
            for (int i = 0; i < d; i++)
                s += q[h * d + i] * (load_scalar(a->k_cache, base + i, a->kv_dtype) *
                                     group_scale(a->k_cache, base, d, a->kv_dtype, i));
            scores[h * n + j] = s * a->scale;
        }
    }
    for (int h = 0; h < g; h++) {
        float *sc = scores + h * n, m = -INFINITY, sum = 0.f;
        for (int j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
        for (int j = 0; j < n; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
        if (t->ml) { t->ml[2 * h] = m; t->ml[2 * h + 1] = sum; continue; }
        for (int j = 0; j < n; j++) sc[j] /= sum;
    }
    memset(out, 0, sizeof(float) * g * d);
    for (int j = 0; j < n; j++) {
        long base = (slot_of(a, table, first + j) * a->kv_heads + kvh) * a->row;
        for (int i = 0; i < d; i++) {
            float v = load_scalar(a->v_cache, base + i, a->kv_dtype) * group_scale(a->v_cache, base, d, a->kv_dtype, i);
            for (int h = 0; h < g; h++) out[h * d + i] += scores[h * n + j] * v;
        }
    }
}

/* ---- AVX2 path: head_dim a multiple of 8 ---------------------------------------------------------- */

/* Each of the g rows of n scores into its softmax, in place (with ml: exp(score - max), unnormalised; see Part). 8-bit caches take e^x 8 lanes at a time (libm's
 * expf, one score at a time, costs a third of an 8-bit read at 8k positions); fp32, fp16 and bf16 keep expf, so
 * their outputs stay bit for bit what they were (near-ties in greedy tests compare paths through them). */
__attribute__((target("avx2,fma")))
static void softmax_rows(float *scores, int g, int n, int vector, float *ml) {
    for (int h = 0; h < g; h++) {
        float *sc = scores + h * n, m = -INFINITY, sum = 0.f;
        for (int j = 0; j < n; j++) m = sc[j] > m ? sc[j] : m;
        if (!vector) {
            for (int j = 0; j < n; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
            if (ml) { ml[2 * h] = m; ml[2 * h + 1] = sum; continue; }
            const float inv = 1.f / sum;
            for (int j = 0; j < n; j++) sc[j] *= inv;
            continue;
        }
        __m256 acc = _mm256_setzero_ps();
        const __m256 mv = _mm256_set1_ps(m);
        int j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
            _mm256_storeu_ps(sc + j, e);
            acc = _mm256_add_ps(acc, e);
        }
        for (; j < n; j++) { sc[j] = expf(sc[j] - m); sum += sc[j]; }
        if (ml) { ml[2 * h] = m; ml[2 * h + 1] = sum + hsum8(acc); continue; }
        const float inv = 1.f / (sum + hsum8(acc));
        for (j = 0; j < n; j++) sc[j] *= inv;
    }
}

#define BLOCK_VECS 8  /* vectors of head_dim (64 floats) held in registers at once: all of a 64-wide head */
#define PARALLEL_MIN_KEYS 4096  /* (position, kv head) pairs below which one thread is faster */

#if FLEETLLM_X86
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 load8(const void *base, long idx, int dtype) {
    if (dtype == KV_F32) return _mm256_loadu_ps((const float *)base + idx);
    if (IS_8BIT(dtype)) {  /* 8 bytes widened in registers (their group's scale applied by load8s) */
        const __m128i b = _mm_loadl_epi64((const __m128i *)((const uint8_t *)base + idx));
        if (dtype == KV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);  /* the byte atop a 16-bit lane */
        if (dtype == KV_E5M2) return _mm256_cvtph_ps(h);
        /* e4m3: exponent and mantissa one bit lower; the arithmetic shift copies the sign into bit 14, cleared */
        return _mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(h, 1), _mm_set1_epi16((short)0xbfff)));
    }
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx));
    if (dtype == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The 8 elements from i of the row at `row` (one group), 8-bit ones times their group's scale. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 load8s(const void *cache, long row, int head_dim, int i, int dtype) {
    const __m256 x = load8(cache, row + i, dtype);
    if (!IS_8BIT(dtype)) return x;
    const float s = _cvtsh_ss(stored_scale(cache, row, head_dim, i)) * kv8_read_unit(dtype);
    return _mm256_mul_ps(x, _mm256_set1_ps(s));
}

/* Scores of the g heads over the keys for head_dim's vectors v0 .. v0 + nb - 1: each key's vectors are loaded
 * into registers once for all g heads (written by the first block, added to by the others). Inlined with nb and
 * dtype constants, so the full block's loops unroll and its loads do not branch on the cache's type. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void score_block(const PagedArgs *a, const int32_t *table, int first, int n, int kvh, const float *q,
                               float *scores, int v0, const int nb, const int dtype) {
    const int d = a->head_dim, g = a->heads / a->kv_heads;
    /* 8-bit rows prefetched as on the AVX-512 path (see AheadSlots: 1.6x as fast at 8k); the others' reads as they were */
    AheadSlots it = ahead_from(a, table, first, IS_8BIT(dtype) ? n : 0, a->k_cache, a->v_cache, kvh);
    for (int j = 0; j < n; j++) {
        const long row = (next_ahead(&it) * a->kv_heads + kvh) * a->row;
        const float ks = a->scale;
        __m256 k[BLOCK_VECS];
        for (int v = 0; v < nb; v++) k[v] = load8s(a->k_cache, row, d, 8 * (v0 + v), dtype);
        for (int h = 0; h < g; h++) {
            const float *qh = q + h * d + 8 * v0;
            __m256 acc = _mm256_setzero_ps();
            for (int v = 0; v < nb; v++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * v), k[v], acc);
            const float s = hsum8(acc) * ks;
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
        AheadSlots it = ahead_from(a, table, first, IS_8BIT(dtype) ? n : 0, a->v_cache, NULL, kvh);  /* see score_block */
        for (int j = 0; j < n; j++) {
            const long row = (next_ahead(&it) * a->kv_heads + kvh) * a->row;
            const __m256 p = _mm256_set1_ps(scores[h * n + j]);
            for (int v = 0; v < nb; v++) acc[v] = _mm256_fmadd_ps(p, load8s(a->v_cache, row, d, 8 * (v0 + v), dtype), acc[v]);
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
    else if (a->kv_dtype == KV_BF16) CALL(BLOCK_VECS, KV_BF16); \
    else if (a->kv_dtype == KV_I8) CALL(BLOCK_VECS, KV_I8); \
    else if (a->kv_dtype == KV_E4M3) CALL(BLOCK_VECS, KV_E4M3); \
    else CALL(BLOCK_VECS, KV_E5M2); } while (0)

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

/* ---- 16- and 32-bit caches: the scores key by key, K and V fetched ahead ----------------------------- */

#define AHEAD_KEYS 8  /* keys between a row's prefetch and its use: ~8 KB of fp32 K at head_dim 256 */

/* Asks for the (slot, kv head) row's cache lines of K (into L1) and V (into L2: the value pass reads it after
 * the scores, several times per head). */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void prefetch_kv_row(const PagedArgs *a, long slot, int kvh, const int elem) {
    const long off = (slot * a->kv_heads + kvh) * (long)a->row * elem, bytes = (long)a->head_dim * elem;
    const char *k = (const char *)a->k_cache + off, *v = (const char *)a->v_cache + off;
    for (long b = 0; b < bytes; b += 64) {
        _mm_prefetch(k + b, _MM_HINT_T0);
        _mm_prefetch(v + b, _MM_HINT_T1);
    }
}

/* One key's scores for the g heads over head_dim's vectors v0 .. v0 + nb - 1, added to `s` (g floats) as
 * score_block adds them: the block's register sum, horizontally summed, times the scale. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void score_key(const PagedArgs *a, long base, const float *q, float *s, int v0, const int nb,
                             const int dtype) {
    const int d = a->head_dim, g = a->heads / a->kv_heads;
    __m256 k[BLOCK_VECS];
    for (int v = 0; v < nb; v++) k[v] = load8(a->k_cache, base + 8 * v, dtype);
    for (int h = 0; h < g; h++) {
        const float *qh = q + h * d + 8 * v0;
        __m256 acc = _mm256_setzero_ps();
        for (int v = 0; v < nb; v++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * v), k[v], acc);
        const float x = hsum8(acc) * a->scale;
        s[h] = v0 == 0 ? x : s[h] + x;
    }
}

/* The scores of the g heads over n keys from `first` with score_block's arithmetic (the same floats), but key
 * by key: each K row is read whole and in order, so K streams from memory once instead of once per 64 dims,
 * and the rows AHEAD_KEYS on are prefetched, K and V (a pool's blocks lie anywhere: the hardware prefetcher
 * loses the stream at every block's start). Inlined per cache type; 16- and 32-bit caches only (no scale). */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void scores_by_key(const PagedArgs *a, const int32_t *table, int first, int n, int kvh,
                                 const float *q, float *scores, const int dtype) {
    const int nv = a->head_dim / 8, g = a->heads / a->kv_heads, elem = dtype == KV_F32 ? 4 : 2;
    Slots it = slots_from(a, table, first), ahead = slots_from(a, table, first);
    int fetched = 0;
    for (; fetched < n && fetched < AHEAD_KEYS; fetched++) prefetch_kv_row(a, next_slot(&ahead), kvh, elem);
    float s[64];  /* heads per KV head: at most 64 (checked by the caller) */
    for (int j = 0; j < n; j++) {
        if (fetched < n) { prefetch_kv_row(a, next_slot(&ahead), kvh, elem); fetched++; }
        const long base = (next_slot(&it) * a->kv_heads + kvh) * a->row;
        for (int v0 = 0; v0 < nv; v0 += BLOCK_VECS) {
            if (nv - v0 >= BLOCK_VECS) score_key(a, base + 8 * v0, q, s, v0, BLOCK_VECS, dtype);
            else score_key(a, base + 8 * v0, q, s, v0, nv - v0, dtype);
        }
        for (int h = 0; h < g; h++) scores[h * n + j] = s[h];
    }
}

__attribute__((target("avx2,fma,f16c")))
static void scores_wide(const PagedArgs *a, const int32_t *table, int first, int n, int kvh, const float *q,
                        float *scores) {
    if (a->kv_dtype == KV_F32) scores_by_key(a, table, first, n, kvh, q, scores, KV_F32);
    else if (a->kv_dtype == KV_F16) scores_by_key(a, table, first, n, kvh, q, scores, KV_F16);
    else scores_by_key(a, table, first, n, kvh, q, scores, KV_BF16);
}

/* One key's scores for the g heads of each of m query rows (qs[r]; rows whose n[r] the key is past skip it), the
 * key's vectors loaded once for all of them: the same floats as score_key's, row by row. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void score_key_rows(const PagedArgs *a, long base, const float *const *qs, float *s, int m,
                                  const int *live, int v0, const int nb, const int dtype) {
    const int d = a->head_dim, g = a->heads / a->kv_heads;
    __m256 k[BLOCK_VECS];
    for (int v = 0; v < nb; v++) k[v] = load8(a->k_cache, base + 8 * v, dtype);
    for (int r = 0; r < m; r++) {
        if (!live[r]) continue;
        for (int h = 0; h < g; h++) {
            const float *qh = qs[r] + h * d + 8 * v0;
            __m256 acc = _mm256_setzero_ps();
            for (int v = 0; v < nb; v++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * v), k[v], acc);
            const float x = hsum8(acc) * a->scale;
            s[r * g + h] = v0 == 0 ? x : s[r * g + h] + x;
        }
    }
}

/* scores_by_key for the m rows of a chunk (see task_rows): each K row read from memory once for all of them,
 * row r's scores (its n[r] keys from `first`) into scores + r * stride, laid out as scores_by_key lays them. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void scores_by_key_rows(const PagedArgs *a, const int32_t *table, int first, const int *n, int m,
                                      int kvh, const float *const *qs, float *scores, long stride, const int dtype) {
    const int nv = a->head_dim / 8, g = a->heads / a->kv_heads, elem = dtype == KV_F32 ? 4 : 2;
    int keys = 0, live[MAX_GROUP];
    for (int r = 0; r < m; r++) keys = n[r] > keys ? n[r] : keys;
    Slots it = slots_from(a, table, first), ahead = slots_from(a, table, first);
    int fetched = 0;
    for (; fetched < keys && fetched < AHEAD_KEYS; fetched++) prefetch_kv_row(a, next_slot(&ahead), kvh, elem);
    float s[64 * MAX_GROUP];  /* g <= 64 (checked by the caller) */
    for (int j = 0; j < keys; j++) {
        if (fetched < keys) { prefetch_kv_row(a, next_slot(&ahead), kvh, elem); fetched++; }
        const long base = (next_slot(&it) * a->kv_heads + kvh) * a->row;
        for (int r = 0; r < m; r++) live[r] = j < n[r];
        for (int v0 = 0; v0 < nv; v0 += BLOCK_VECS) {
            if (nv - v0 >= BLOCK_VECS) score_key_rows(a, base + 8 * v0, qs, s, m, live, v0, BLOCK_VECS, dtype);
            else score_key_rows(a, base + 8 * v0, qs, s, m, live, v0, nv - v0, dtype);
        }
        for (int r = 0; r < m; r++)
            if (live[r])
                for (int h = 0; h < g; h++) scores[r * stride + h * n[r] + j] = s[r * g + h];
    }
}

/* Each of a chunk's m rows' queries (its KV head's group of heads) and keys to score. */
static void chunk_rows(const PagedArgs *a, const Part *t, int m, const float **qs, int *n) {
    const int g = a->heads / a->kv_heads;
    for (int r = 0; r < m; r++) {
        qs[r] = a->q + t[r].row * a->q_row_stride + (long)t[r].kvh * g * a->head_dim;
        n[r] = t[r].n;
    }
}

/* m rows of one chunk over the same partition of the same table (see group_rows): the scores of all of them in
 * one pass over K, then each row's softmax and values as task_avx2 takes them (V, prefetched into L2 by the
 * score pass, read from there). Each row's floats are task_avx2's. 16- and 32-bit caches, g <= 64. */
__attribute__((target("avx2,fma,f16c")))
static void task_avx2_rows(const PagedArgs *a, const Part *t, int m, float *scores, long stride) {
    const int g = a->heads / a->kv_heads;
    const int32_t *table = table_of_row(a, t[0].row);
    const float *qs[MAX_GROUP];
    int n[MAX_GROUP];
    chunk_rows(a, t, m, qs, n);
    if (a->kv_dtype == KV_F32) scores_by_key_rows(a, table, t[0].first, n, m, t[0].kvh, qs, scores, stride, KV_F32);
    else if (a->kv_dtype == KV_F16) scores_by_key_rows(a, table, t[0].first, n, m, t[0].kvh, qs, scores, stride, KV_F16);
    else scores_by_key_rows(a, table, t[0].first, n, m, t[0].kvh, qs, scores, stride, KV_BF16);
    for (int r = 0; r < m; r++) {
        softmax_rows(scores + r * stride, g, n[r], 0, t[r].ml);
        by_blocks_avx2(a, table, t[r].first, n[r], t[r].kvh, qs[r], scores + r * stride, t[r].out, 1);
    }
}

__attribute__((target("avx2,fma,f16c")))
static void task_avx2(const PagedArgs *a, const Part *t, float *scores) {
    const int g = a->heads / a->kv_heads;
    const int32_t *table = table_of_row(a, t->row);
    const float *q = a->q + t->row * a->q_row_stride + (long)t->kvh * g * a->head_dim;
    if (!IS_8BIT(a->kv_dtype) && g <= 64) scores_wide(a, table, t->first, t->n, t->kvh, q, scores);
    else by_blocks_avx2(a, table, t->first, t->n, t->kvh, q, scores, NULL, 0);
    softmax_rows(scores, g, t->n, IS_8BIT(a->kv_dtype), t->ml);
    by_blocks_avx2(a, table, t->first, t->n, t->kvh, q, scores, t->out, 1);
}

/* ---- AVX-512 path: head_dim a multiple of 16 ------------------------------------------------------ */
/* The same two passes 16 lanes wide, for 8-bit caches: the score pass widens each key once for up to SH heads
 * and sums SK keys' dot products across lanes together; the value pass widens each value row once for up to HG
 * heads (the AVX2 pass reads it once per head). Both prefetch row by row AHEAD_ROWS keys on, the score pass V's
 * rows too (into L2): an 8-bit row is so little arithmetic that the misses, not the widening, set the pace
 * (prefetching a whole block as it started took 1.6x as long at 8k). fp32, fp16 and bf16 caches keep the AVX2
 * path: memory-bound, they gain little here, and their summation order (so greedy near-ties in tests) stays
 * what it was. */

#define ZV 4  /* vectors of head_dim (64 floats) per pass */
#define HG 4  /* heads per value pass: HG x ZV accumulators */
#define SK 4  /* keys per score group */
#define SH 3  /* heads per score group: SH x SK accumulators */
#define AVX512 "avx512f,avx512bw,avx2,fma,f16c"

__attribute__((target(AVX512), always_inline))
static inline __m512 load16(const void *base, long idx, const int dtype) {
    if (dtype == KV_F32) return _mm512_loadu_ps((const float *)base + idx);
    if (dtype == KV_F16 || dtype == KV_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx));
        return dtype == KV_F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)base + idx));
    if (dtype == KV_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);  /* as load8: fp8 through fp16 */
    if (dtype == KV_E5M2) return _mm512_cvtph_ps(h);
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16((short)0xbfff)));
}

/* The scales of an 8-bit row at `row` for head_dim's vectors v0 .. v0 + nb - 1 (16 channels, two groups each):
 * lanes 2v and 2v + 1 hold vector v0 + v's, as stored (lanes from 2 nb: 0; from 8: undefined): the passes
 * multiply their sums by kv8_read_unit instead (a power of two, so the same floats). One 16-byte load and one
 * conversion for a pass's 64 channels. */
__attribute__((target(AVX512), always_inline))
static inline __m512 row_scales(const void *cache, long row, int head_dim, int v0, const int nb, const int dtype) {
    const uint8_t *at = (const uint8_t *)cache + row + head_dim + KV8_SCALE_BYTES * (16 / KV8_GROUP) * v0;
    __m128i h;
    if (nb == ZV) {
        h = _mm_loadu_si128((const __m128i *)at);
    } else {  /* a last pass under 64 channels: its scales end the row */
        uint16_t t[8] = {0};
        memcpy(t, at, KV8_SCALE_BYTES * (16 / KV8_GROUP) * nb);
        h = _mm_loadu_si128((const __m128i *)t);
    }
    return _mm512_castps256_ps512(_mm256_cvtph_ps(h));
}

/* The 16 elements of vector v of a pass (see row_scales) of an 8-bit row, each group times its scale. */
__attribute__((target(AVX512), always_inline))
static inline __m512 load16s(const void *cache, long row, int v0, int v, __m512 scales, const int dtype) {
    const __m512i lanes = _mm512_set_epi32(2 * v + 1, 2 * v + 1, 2 * v + 1, 2 * v + 1, 2 * v + 1, 2 * v + 1, 2 * v + 1,
                                           2 * v + 1, 2 * v, 2 * v, 2 * v, 2 * v, 2 * v, 2 * v, 2 * v, 2 * v);
    return _mm512_mul_ps(load16(cache, row + 16 * (v0 + v), dtype), _mm512_permutexvar_ps(lanes, scales));
}

/* out[h0 + h] = sum_j p[h0 + h, j] v_j over head_dim's vectors v0 .. v0 + nb - 1, for hg heads at once. */
__attribute__((target(AVX512), always_inline))
static inline void value_block16(const PagedArgs *a, const int32_t *table, int first, int n, int kvh,
                                 const float *scores, float *out, int v0, const int nb, int h0, const int hg,
                                 const int dtype) {
    const int d = a->head_dim;
    __m512 acc[HG][ZV];
    for (int h = 0; h < hg; h++)
        for (int v = 0; v < nb; v++) acc[h][v] = _mm512_setzero_ps();
    AheadSlots it = ahead_from(a, table, first, n, a->v_cache, NULL, kvh);
    for (int j = 0; j < n; j++) {
        const long row = (next_ahead(&it) * a->kv_heads + kvh) * a->row;
        __m512 x[ZV];
        const __m512 sc = row_scales(a->v_cache, row, d, v0, nb, dtype);
        for (int v = 0; v < nb; v++) x[v] = load16s(a->v_cache, row, v0, v, sc, dtype);
        for (int h = 0; h < hg; h++) {
            const __m512 p = _mm512_set1_ps(scores[(h0 + h) * n + j]);
            for (int v = 0; v < nb; v++) acc[h][v] = _mm512_fmadd_ps(p, x[v], acc[h][v]);
        }
    }
    const __m512 unit = _mm512_set1_ps(kv8_read_unit(dtype));  /* see row_scales */
    for (int h = 0; h < hg; h++)
        for (int v = 0; v < nb; v++)
            _mm512_storeu_ps(out + (h0 + h) * d + 16 * (v0 + v), _mm512_mul_ps(acc[h][v], unit));
}

/* Constants for the common shapes (64 dims a pass, 1-4 heads a value pass), per cache type; the rest (a last
 * pass under 64 dims) with its widths read at run time. */
#define BY_TYPE(CALL, NB, ...) do { \
    if (a->kv_dtype == KV_F32) CALL(NB, __VA_ARGS__, KV_F32); \
    else if (a->kv_dtype == KV_F16) CALL(NB, __VA_ARGS__, KV_F16); \
    else if (a->kv_dtype == KV_BF16) CALL(NB, __VA_ARGS__, KV_BF16); \
    else if (a->kv_dtype == KV_I8) CALL(NB, __VA_ARGS__, KV_I8); \
    else if (a->kv_dtype == KV_E4M3) CALL(NB, __VA_ARGS__, KV_E4M3); \
    else CALL(NB, __VA_ARGS__, KV_E5M2); } while (0)

/* 8 lanes of the sum of x's two halves. */
__attribute__((target(AVX512), always_inline))
static inline __m256 fold16(__m512 x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

/* Lane i: the sum of v[i]'s 8 lanes (i < 4). */
__attribute__((target(AVX512), always_inline))
static inline __m128 sum4x8(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
}

/* The SK x hn dot products' lanes summed and scaled into the heads' scores (the first m keys; added to what the
 * earlier vectors of head_dim gave after the first). */
__attribute__((target(AVX512), always_inline))
static inline void store_group(__m512 (*acc)[SK], const float *ks, int m, float *scores, int n, int j0, int v0,
                               int h0, const int hn) {
    const __m128 scale = _mm_loadu_ps(ks);
    for (int h = 0; h < hn; h++) {
        __m256 f[SK];
        float sum[SK], *out = scores + (h0 + h) * n + j0;
        for (int j = 0; j < SK; j++) f[j] = fold16(acc[h][j]);
        _mm_storeu_ps(sum, _mm_mul_ps(sum4x8(f), scale));
        for (int j = 0; j < m; j++) out[j] = v0 == 0 ? sum[j] : out[j] + sum[j];
    }
}

/* Scores of SK keys (rows[], the first m real; ks[]: the softmax scale times kv8_read_unit, 0 past m) for heads
 * h0 .. h0 + hn - 1, over head_dim's vectors v0 .. v0 + nb - 1: each key's vectors widened once for the hn
 * heads, and the SK x hn dot products summed across lanes together (one horizontal sum per key costs as much as
 * its FMAs). */
__attribute__((target(AVX512), always_inline))
static inline void score_group(const PagedArgs *a, const long *rows, const float *ks, int m, const float *q,
                               float *scores, int n, int j0, int v0, const int nb, int h0, const int hn,
                               const int dtype) {
    const int d = a->head_dim;
    __m512 acc[SH][SK];
    for (int j = 0; j < SK; j++) {
        __m512 k[ZV];
        const __m512 sc = row_scales(a->k_cache, rows[j], d, v0, nb, dtype);
        for (int v = 0; v < nb; v++) k[v] = load16s(a->k_cache, rows[j], v0, v, sc, dtype);
        for (int h = 0; h < hn; h++) {
            const float *qh = q + (h0 + h) * d + 16 * v0;
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
            for (int v = 1; v < nb; v++) s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * v), k[v], s);
            acc[h][j] = s;
        }
    }
    store_group(acc, ks, m, scores, n, j0, v0, h0, hn);
}

/* Every head's scores over the n keys from `first`, SK keys at a time. */
__attribute__((target(AVX512)))
static void scores_avx512(const PagedArgs *a, const int32_t *table, int first, int n, int kvh, const float *q,
                          float *scores) {
    const int d = a->head_dim, nv = d / 16, g = a->heads / a->kv_heads;
    AheadSlots it = ahead_from(a, table, first, n, a->k_cache, a->v_cache, kvh);
    const float key_scale = a->scale * kv8_read_unit(a->kv_dtype);  /* see row_scales */
    long rows[SK];
    float ks[SK];
    for (int j0 = 0; j0 < n; j0 += SK) {
        const int m = n - j0 < SK ? n - j0 : SK;
        for (int j = 0; j < SK; j++) {  /* a short last group repeats its first key, scaled by 0 and not stored */
            rows[j] = j < m ? (next_ahead(&it) * a->kv_heads + kvh) * a->row : rows[0];
            ks[j] = j < m ? key_scale : 0.f;
        }
        for (int v0 = 0; v0 < nv; v0 += ZV) {
            const int nb = nv - v0 < ZV ? nv - v0 : ZV;
            for (int h0 = 0; h0 < g; h0 += SH) {
                const int hn = g - h0 < SH ? g - h0 : SH;
#define GROUP(NB, HN, DT) score_group(a, rows, ks, m, q, scores, n, j0, v0, NB, h0, HN, DT)
                if (nb < ZV) GROUP(nb, hn, a->kv_dtype);
                else if (hn == 3) BY_TYPE(GROUP, ZV, 3);
                else if (hn == 2) BY_TYPE(GROUP, ZV, 2);
                else BY_TYPE(GROUP, ZV, 1);
#undef GROUP
            }
        }
    }
}

/* The weighted values of every head into `out`, 64 dims and HG heads at a time. */
__attribute__((target(AVX512)))
static void values_avx512(const PagedArgs *a, const int32_t *table, int first, int n, int kvh, const float *scores,
                          float *out) {
    const int nv = a->head_dim / 16, g = a->heads / a->kv_heads;
    for (int v0 = 0; v0 < nv; v0 += ZV) {
        const int nb = nv - v0 < ZV ? nv - v0 : ZV;
        for (int h0 = 0; h0 < g; h0 += HG) {
            const int hg = g - h0 < HG ? g - h0 : HG;
#define VALUES(NB, HGC, DT) value_block16(a, table, first, n, kvh, scores, out, v0, NB, h0, HGC, DT)
            if (nb < ZV) VALUES(nb, hg, a->kv_dtype);
            else if (hg == 4) BY_TYPE(VALUES, ZV, 4);
            else if (hg == 3) BY_TYPE(VALUES, ZV, 3);
            else if (hg == 2) BY_TYPE(VALUES, ZV, 2);
            else BY_TYPE(VALUES, ZV, 1);
#undef VALUES
        }
    }
}

/* ---- 8-bit K shared by the rows of a chunk (a speculative verify chunk's queries) ------------------- */
/* score_group split in two, so that SK keys' vectors are widened once for every row of a chunk: widen_keys
 * into `k` (in L1), then per row dots_group with score_group's arithmetic (the same floats as the row alone). */

__attribute__((target(AVX512), always_inline))
static inline void widen_keys(const PagedArgs *a, const long *rows, int v0, const int nb, const int dtype,
                              __m512 (*k)[ZV]) {
    for (int j = 0; j < SK; j++) {
        const __m512 sc = row_scales(a->k_cache, rows[j], a->head_dim, v0, nb, dtype);
        for (int v = 0; v < nb; v++) k[j][v] = load16s(a->k_cache, rows[j], v0, v, sc, dtype);
    }
}

__attribute__((target(AVX512), always_inline))
static inline void dots_group(const PagedArgs *a, __m512 (*k)[ZV], const float *ks, int m, const float *q,
                              float *scores, int n, int j0, int v0, const int nb, int h0, const int hn) {
    const int d = a->head_dim;
    __m512 acc[SH][SK];
    for (int j = 0; j < SK; j++)
        for (int h = 0; h < hn; h++) {
            const float *qh = q + (h0 + h) * d + 16 * v0;
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qh), k[j][0]);
            for (int v = 1; v < nb; v++) s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * v), k[j][v], s);
            acc[h][j] = s;
        }
    store_group(acc, ks, m, scores, n, j0, v0, h0, hn);
}

/* Row r's scores (its n[r] keys from `first`, query qs[r]) into scores + r * stride, as scores_avx512 lays
 * them, for the m rows of a chunk: each key widened once for all of them. */
__attribute__((target(AVX512)))
static void scores_avx512_rows(const PagedArgs *a, const int32_t *table, int first, const int *n, int m, int kvh,
                               const float *const *qs, float *scores, long stride) {
    const int nv = a->head_dim / 16, g = a->heads / a->kv_heads;
    int keys = 0;
    for (int r = 0; r < m; r++) keys = n[r] > keys ? n[r] : keys;
    AheadSlots it = ahead_from(a, table, first, keys, a->k_cache, a->v_cache, kvh);
    const float key_scale = a->scale * kv8_read_unit(a->kv_dtype);  /* see row_scales */
    long rows[SK];
    __m512 k[SK][ZV];
    for (int j0 = 0; j0 < keys; j0 += SK) {
        for (int j = 0; j < SK; j++)  /* past the last key: its first key again, scaled by 0 and not stored */
            rows[j] = j < keys - j0 ? (next_ahead(&it) * a->kv_heads + kvh) * a->row : rows[0];
        for (int v0 = 0; v0 < nv; v0 += ZV) {
            const int nb = nv - v0 < ZV ? nv - v0 : ZV;
#define WIDEN(NB, DT) widen_keys(a, rows, v0, NB, DT, k)
            if (nb < ZV) WIDEN(nb, a->kv_dtype);
            else if (a->kv_dtype == KV_I8) WIDEN(ZV, KV_I8);
            else if (a->kv_dtype == KV_E4M3) WIDEN(ZV, KV_E4M3);
            else WIDEN(ZV, KV_E5M2);
#undef WIDEN
            for (int r = 0; r < m; r++) {
                const int mr = n[r] - j0 < SK ? n[r] - j0 : SK;  /* row r's keys in this group */
                if (mr <= 0) continue;
                float ks[SK];
                for (int j = 0; j < SK; j++) ks[j] = j < mr ? key_scale : 0.f;
                for (int h0 = 0; h0 < g; h0 += SH) {
                    const int hn = g - h0 < SH ? g - h0 : SH;
#define DOTS(NB, HN) dots_group(a, k, ks, mr, qs[r], scores + r * stride, n[r], j0, v0, NB, h0, HN)
                    if (nb < ZV) DOTS(nb, hn);
                    else if (hn == 3) DOTS(ZV, 3);
                    else if (hn == 2) DOTS(ZV, 2);
                    else DOTS(ZV, 1);
#undef DOTS
                }
            }
        }
    }
}

#define VHC 16  /* (row, head) pairs of a chunk's value pass at once: VHC accumulators over 16 dims */

/* out[e] += sum_j p[e][j] v_j over head_dim's vector v (16 dims) for VHC (row, head) pairs, each value vector
 * widened once for all of them; pair e reads its first lim[e] keys (the rest weigh 0), and only the first vn
 * are stored. Each pair's sum is value_block16's, key by key from zero (the same floats as its row alone). */
__attribute__((target(AVX512), always_inline))
static inline void values_slice(const PagedArgs *a, const int32_t *table, int first, int keys, int kvh,
                                const float *const *p, const int *lim, float *const *out, int vn, int v,
                                const int dtype) {
    const int d = a->head_dim;
    const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[VHC];
    int common = keys;  /* keys every stored pair reads */
    for (int e = 0; e < VHC; e++) acc[e] = _mm512_setzero_ps();
    for (int e = 0; e < vn; e++) common = lim[e] < common ? lim[e] : common;
    Slots it = slots_from(a, table, first);
    for (int j = 0; j < keys; j++) {
        const long row = (next_slot(&it) * a->kv_heads + kvh) * a->row;
        uint32_t two;  /* the float16 scales of this vector's two groups */
        memcpy(&two, (const uint8_t *)a->v_cache + row + d + KV8_SCALE_BYTES * (16 / KV8_GROUP) * v, sizeof two);
        const __m512 sc = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)two))));
        const __m512 x = _mm512_mul_ps(load16(a->v_cache, row + 16 * v, dtype), sc);
        if (j < common) {
            for (int e = 0; e < VHC; e++) acc[e] = _mm512_fmadd_ps(_mm512_set1_ps(p[e][j]), x, acc[e]);
        } else {
            for (int e = 0; e < VHC; e++)
                acc[e] = _mm512_fmadd_ps(_mm512_set1_ps(j < lim[e] ? p[e][j] : 0.f), x, acc[e]);
        }
    }
    const __m512 unit = _mm512_set1_ps(kv8_read_unit(dtype));  /* see row_scales */
    for (int e = 0; e < vn; e++) _mm512_storeu_ps(out[e] + 16 * v, _mm512_mul_ps(acc[e], unit));
}

/* The weighted values of the m rows of a chunk (row r's probabilities at scores + r * stride, its output
 * t[r].out), their (row, head) pairs VHC at a time (see values_slice). */
__attribute__((target(AVX512)))
static void values_avx512_rows(const PagedArgs *a, const int32_t *table, int first, const int *n, int m, int kvh,
                               const float *scores, long stride, const Part *t) {
    const int g = a->heads / a->kv_heads, d = a->head_dim, pairs = m * g;
    int keys = 0;
    for (int r = 0; r < m; r++) keys = n[r] > keys ? n[r] : keys;
    for (int e0 = 0; e0 < pairs; e0 += VHC) {
        const int vn = pairs - e0 < VHC ? pairs - e0 : VHC;
        const float *p[VHC];
        float *out[VHC];
        int lim[VHC];
        for (int e = 0; e < VHC; e++) {  /* pairs past vn: the first one again, weighing nothing, not stored */
            const int k = e0 + (e < vn ? e : 0), r = k / g, h = k % g;
            p[e] = scores + r * stride + (long)h * n[r];
            out[e] = t[r].out + (long)h * d;
            lim[e] = e < vn ? n[r] : 0;
        }
        for (int v = 0; v < d / 16; v++) {
            if (a->kv_dtype == KV_I8) values_slice(a, table, first, keys, kvh, p, lim, out, vn, v, KV_I8);
            else if (a->kv_dtype == KV_E4M3) values_slice(a, table, first, keys, kvh, p, lim, out, vn, v, KV_E4M3);
            else values_slice(a, table, first, keys, kvh, p, lim, out, vn, v, KV_E5M2);
        }
    }
}

/* m rows of one chunk over the same partition of the same table (see group_rows), 8-bit: the scores of all of
 * them in one pass over K, each row's softmax, then the values of all of them with each V vector widened once
 * (V from L2, prefetched by the score pass). Each row's floats are task_avx512's. */
__attribute__((target(AVX512)))
static void task_avx512_rows(const PagedArgs *a, const Part *t, int m, float *scores, long stride) {
    const int g = a->heads / a->kv_heads;
    const int32_t *table = table_of_row(a, t[0].row);
    const float *qs[MAX_GROUP];
    int n[MAX_GROUP];
    chunk_rows(a, t, m, qs, n);
    scores_avx512_rows(a, table, t[0].first, n, m, t[0].kvh, qs, scores, stride);
    for (int r = 0; r < m; r++) softmax_rows(scores + r * stride, g, n[r], 1, t[r].ml);
    values_avx512_rows(a, table, t[0].first, n, m, t[0].kvh, scores, stride, t);
}

__attribute__((target(AVX512)))
static void task_avx512(const PagedArgs *a, const Part *t, float *scores) {
    const int g = a->heads / a->kv_heads;
    const int32_t *table = table_of_row(a, t->row);
    const float *q = a->q + t->row * a->q_row_stride + (long)t->kvh * g * a->head_dim;
    scores_avx512(a, table, t->first, t->n, t->kvh, q, scores);
    softmax_rows(scores, g, t->n, IS_8BIT(a->kv_dtype), t->ml);
    values_avx512(a, table, t->first, t->n, t->kvh, scores, t->out);
}
#endif  /* FLEETLLM_X86 */

/* ---- partitions ----------------------------------------------------------------------------------- */

/* The first key a row reads and how many (its window of its context). */
static inline int keys_of(const PagedArgs *a, int row, int *first) {
    const int len = a->context_lens[row];
    *first = a->window > 0 && len > a->window ? len - a->window : 0;
    return len - *first;
}

static inline int parts_of(int n) {
    return n > PART_KEYS ? (n + PART_KEYS - 1) / PART_KEYS : 1;
}

/* Partition i of row `row` under KV head kvh (rows numbered their partitions from part0[row]): a row of one
 * partition writes its output in place; a split row's partitions write into buf for combine(). */
static Part row_part(const PagedArgs *a, const int *part0, int row, int i, int kvh, float *buf) {
    const int g = a->heads / a->kv_heads, d = a->head_dim;
    int first, n = keys_of(a, row, &first);
    Part t = {row, kvh, first, n, a->out + row * a->out_row_stride + (long)kvh * g * d, NULL};
    if (part0[row + 1] - part0[row] > 1) {
        t.first = first + i * PART_KEYS;
        t.n = n - i * PART_KEYS < PART_KEYS ? n - i * PART_KEYS : PART_KEYS;
        t.out = buf + ((long)(part0[row] + i) * a->kv_heads + kvh) * g * (d + 2);
        t.ml = t.out + g * d;
    }
    return t;
}

/* Groups of consecutive rows that read the same keys: rows of one chunk (the same table row, the same first key
 * and as many partitions; a speculative verify chunk's queries) up to MAX_GROUP of them when `share` (the path
 * that reads K once for a group), else one row each. Group u is rows group0[u] .. group0[u + 1] - 1; returns
 * the number of groups. */
static int group_rows(const PagedArgs *a, const int *part0, int rows, int share, int *group0) {
    int groups = 0, lead_first = 0;
    for (int r = 0; r < rows; r++) {
        int first;
        keys_of(a, r, &first);
        const int lead = groups ? group0[groups - 1] : 0;
        const int joins = share && groups && a->table_of && a->table_of[r] == a->table_of[lead] && r - lead < MAX_GROUP
                          && first == lead_first && part0[r + 1] - part0[r] == part0[lead + 1] - part0[lead];
        if (!joins) { group0[groups++] = r; lead_first = first; }
    }
    group0[groups] = rows;
    return groups;
}

/* Task p of the groups' partitions (numbered group by group from gpart0[u], a group's count its rows'), under
 * KV head kvh: partition i of each of group u's rows into t; returns how many rows. */
static int group_at(const PagedArgs *a, const int *part0, const int *group0, const int *gpart0, int groups, int p,
                    int kvh, float *buf, Part *t) {
    int lo = 0, hi = groups - 1;
    while (lo < hi) {  /* the last group whose first partition is at or before p */
        const int mid = (lo + hi + 1) / 2;
        if (gpart0[mid] <= p) lo = mid; else hi = mid - 1;
    }
    const int m = group0[lo + 1] - group0[lo];
    for (int r = 0; r < m; r++) t[r] = row_part(a, part0, group0[lo] + r, p - gpart0[lo], kvh, buf);
    return m;
}

/* A split row's output under KV head kvh from its partitions' (see part_at): each partition's sum and
 * output weighted by exp(its max - the overall max). */
static void combine(const PagedArgs *a, const int *part0, int row, int kvh, const float *buf) {
    const int g = a->heads / a->kv_heads, d = a->head_dim, p0 = part0[row], np = part0[row + 1] - p0;
    float *out = a->out + row * a->out_row_stride + (long)kvh * g * d;
    for (int h = 0; h < g; h++) {
        float m = -INFINITY, sum = 0.f;
        for (int p = 0; p < np; p++) {
            const float *ml = buf + ((long)(p0 + p) * a->kv_heads + kvh) * g * (d + 2) + g * d;
            m = ml[2 * h] > m ? ml[2 * h] : m;
        }
        for (int i = 0; i < d; i++) out[h * d + i] = 0.f;
        for (int p = 0; p < np; p++) {
            const float *o = buf + ((long)(p0 + p) * a->kv_heads + kvh) * g * (d + 2), *ml = o + g * d;
            const float w = expf(ml[2 * h] - m);
            sum += w * ml[2 * h + 1];
            for (int i = 0; i < d; i++) out[h * d + i] += w * o[h * d + i];
        }
        const float inv = 1.f / sum;
        for (int i = 0; i < d; i++) out[h * d + i] *= inv;
    }
}

/* ---- entry points --------------------------------------------------------------------------------- */

/* 3 when the AVX-512 path runs on this CPU (for 8-bit caches with head_dim a multiple of 16), 2 for the AVX2
 * one, 0 for the scalar one (reported by Python, and used by tests). */
int paged_attention_isa(void) {
#if FLEETLLM_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 3 : 2;
#else
    return 0;
#endif
}

/* One task's rows (a group of several only on the path that shares their pass over K, see group_rows). */
static void run_task(const PagedArgs *a, const Part *t, int m, float *scores, long stride, int vec512, int vec) {
#if FLEETLLM_X86
    if (m > 1 && vec512) { task_avx512_rows(a, t, m, scores, stride); return; }
    if (m > 1) { task_avx2_rows(a, t, m, scores, stride); return; }
    if (vec512) { task_avx512(a, t, scores); return; }
    if (vec) { task_avx2(a, t, scores); return; }
#endif
    (void)stride, (void)vec512, (void)vec;
    for (int r = 0; r < m; r++) task_scalar(a, &t[r], scores);
}

/* Each row's partitions (part0) and the groups of rows (group0, their partitions gpart0; see group_rows); sets
 * the most keys a row reads and the keys of all rows. Returns the number of groups. */
static int plan_rows(const PagedArgs *a, int rows, int share, int *part0, int *group0, int *gpart0, int *max_n,
                     long *keys) {
    part0[0] = 0;
    for (int r = 0; r < rows; r++) {
        int first, n = keys_of(a, r, &first);
        part0[r + 1] = part0[r] + parts_of(n);
        *max_n = n > *max_n ? n : *max_n;
        *keys += n;
    }
    const int groups = group_rows(a, part0, rows, share, group0);
    gpart0[0] = 0;
    for (int u = 0; u < groups; u++) gpart0[u + 1] = gpart0[u] + part0[group0[u] + 1] - part0[group0[u]];
    return groups;
}

/* Returns 0, or -1 when a buffer could not be allocated. Runs on `threads` OpenMP threads, or on the
 * caller's alone when the step reads few keys: waking a team costs more than a short decode's attention. */
int paged_attention(const float *q, long q_row_stride, const void *k_cache, const void *v_cache, int kv_dtype,
                    const int32_t *tables, int table_stride, const int32_t *table_of, const int32_t *context_lens,
                    float *out, long out_row_stride, int rows, int heads, int kv_heads, int head_dim,
                    int block_size, int window, float scale, int threads) {
    PagedArgs a = {q, q_row_stride, k_cache, v_cache, kv_dtype, tables, table_stride, table_of, context_lens,
                   out, out_row_stride, heads, kv_heads, head_dim, block_size, window, scale,
                   IS_8BIT(kv_dtype) ? KV8_ROW(head_dim) : head_dim};
    const int isa = paged_attention_isa(), vec = isa >= 2 && head_dim % 8 == 0;
    const int vec512 = isa == 3 && head_dim % 16 == 0 && IS_8BIT(kv_dtype);  /* see the AVX-512 section */
    /* rows of a chunk share their pass over K: task_avx2_rows (16/32-bit), task_avx512_rows (8-bit) */
    const int g = heads / kv_heads, share = vec && (!IS_8BIT(kv_dtype) || vec512) && g <= 64;
    int *part0 = malloc(sizeof(int) * (3 * (long)rows + 3)), max_n = 1, failed = 0;
    if (!part0) return -1;
    int *group0 = part0 + rows + 1, *gpart0 = group0 + rows + 1;
    long keys = 0;
    const int groups = plan_rows(&a, rows, share, part0, group0, gpart0, &max_n, &keys);
    const int parts = part0[rows], tasks = gpart0[groups] * kv_heads;
    float *buf = parts > rows ? malloc(sizeof(float) * parts * kv_heads * g * (head_dim + 2)) : NULL;
    if (parts > rows && !buf) { free(part0); return -1; }
    const long stride = (long)g * (max_n < PART_KEYS ? max_n : PART_KEYS), scratch = stride * (share ? MAX_GROUP : 1);
    #pragma omp parallel num_threads(threads) if(threads > 1 && keys * kv_heads >= PARALLEL_MIN_KEYS) reduction(|:failed)
    {
        float *scores = malloc(sizeof(float) * scratch);
        if (!scores) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; t++) {
            if (!scores) continue;
            Part p[MAX_GROUP];
            const int m = group_at(&a, part0, group0, gpart0, groups, t / kv_heads, t % kv_heads, buf, p);
            run_task(&a, p, m, scores, stride, vec512, vec);
        }
        free(scores);
        if (buf) {
            #pragma omp for schedule(static)
            for (int t = 0; t < rows * kv_heads; t++)
                if (part0[t / kv_heads + 1] - part0[t / kv_heads] > 1) combine(&a, part0, t / kv_heads, t % kv_heads, buf);
        }
    }
    free(buf);
    free(part0);
    return failed ? -1 : 0;
}
