/* Prefill attention on the CPU: a chunk of n_q queries of one sequence attends causally to the n_ctx
 * positions before its end, reading keys and values in place from the paged cache (flash-attention style:
 * an online softmax over blocks of keys, so no [n_q, n_ctx] score matrix and no gather).
 *
 * Query i sits at position n_ctx - n_q + i and sees positions (pos - window, pos] (window 0: all of [0, pos]).
 * Layout as in paged_attention.c: one layer's cache is [num_blocks * block_size, kv_heads, row] (fp32, fp16 or
 * bf16: row = head_dim; int8 / fp8: KV8_ROW(head_dim) bytes, the values then their groups' scales: kv8.h); position p lives in slot
 * table[p / block_size] * block_size + p % block_size. Keys and values of a narrower cache are widened (8-bit
 * ones times their scale) block by block into the thread's 64-row buffers as the block is read.
 *
 * A task is a tile of queries under one KV head: its g = heads / kv_heads query heads times up to 48 / g
 * queries make the tile's ROWS rows, so every key and value is loaded once for all heads that share it (GQA).
 * Per block of 64 keys: scores S = Q K^T (key-major, 8 keys x 48 rows of accumulators in registers), the
 * causal / window mask only on blocks that cross the diagonal, the online-softmax update in base 2 (queries
 * are pre-scaled by scale * log2(e)), then O += P V (6 rows x 64 dims of accumulators). Keys beyond a tile's
 * last query are never read: causal blocks are skipped, not masked. All arithmetic is fp32.
 *
 * AVX-512F and BW only (chosen at run time); prefill_attention_isa() says whether this CPU has it, and callers keep
 * their eager path (SDPA) where it does not. Plain C with no torch headers (see fleetllm/kernels/build.py).
 */
#include "simd.h"
#include "kv8.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


#define ROWS 48       /* (query, head) rows of a tile: three vectors of 16 */
#define RV (ROWS / 16)
#define KEYS 64       /* keys per block */
#define KG 8          /* keys per score micro-tile: KG x RV accumulators */
#define PR 6          /* rows per value micro-tile: PR x 4 accumulators over 64 dims */
#define MAX_D 256     /* largest head_dim; head_dim must be a multiple of 16 */
#define PARALLEL_MIN_WORK 16384L  /* query-key pairs below which one thread is faster */
#define LOG2E 1.4426950408889634f

typedef struct {
    const float *q; long q_row_stride;       /* q[i * q_row_stride + head * head_dim + d] */
    const void *k_cache, *v_cache; int kv_dtype;
    const int32_t *table;                    /* the sequence's block table */
    float *out; long out_row_stride;
    int n_q, n_ctx, heads, kv_heads, head_dim, block_size, window;
    float scale;
    int row;  /* elements of one (slot, kv head) row: head_dim, or KV8_ROW(head_dim) bytes (8-bit) */
} Args;

typedef struct {  /* one thread's scratch (about 240 KB: L2-resident) */
    float qt[MAX_D][ROWS];            /* the tile's queries, transposed and scaled by scale * log2(e) */
    float s[KEYS][ROWS];              /* a block's scores, then its probabilities, key-major */
    float o[ROWS][MAX_D];             /* unnormalised outputs */
    float kbuf[KEYS][MAX_D], vbuf[KEYS][MAX_D];  /* fp32 copies of a block's keys and values (narrower caches) */
    float m[ROWS], l[ROWS], alpha[ROWS];         /* running max (base 2), running sum, this block's rescale */
    int32_t pos[ROWS];                /* each row's query position */
} Scratch;

static const float ZEROS[MAX_D] __attribute__((aligned(64)));

/* 2^x for x <= 0 (clamped at -126: no subnormals): x = n + f, |f| <= 1/2, 2^f by its degree-7 Taylor series
 * (relative error < 1e-8), scaled by 2^n with vscalefps. */
#if FLEETLLM_X86
__attribute__((target("avx512f"), always_inline))
static inline __m512 exp2_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* An 8-bit row (d values, then a float16 scale per KV8_GROUP stored times 2^KV8_SHIFT) as fp32 values: fp8
 * through fp16 as paged_attention.c reads it (e4m3 as value / 256, 256 folded into the scales' unit). */
__attribute__((target("avx512f,avx512bw,avx2,f16c")))
static void widen_8bit(int dtype, const uint8_t *row, int d, float *out) {
    const float unit = kv8_read_unit(dtype);
    for (int i = 0; i < d; i += 16) {
        uint16_t h[2];
        memcpy(h, row + d + KV8_SCALE_BYTES * (i / KV8_GROUP), sizeof h);  /* the two groups of these 16 */
        const __m512 scale = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(_cvtsh_ss(h[0]) * unit),
                                                  _mm512_set1_ps(_cvtsh_ss(h[1]) * unit));
        const __m128i b = _mm_loadu_si128((const __m128i *)(row + i));
        __m512 f;
        if (dtype == KV_I8) {
            f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
        } else {
            const __m256i x = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
            f = _mm512_cvtph_ps(dtype == KV_E5M2 ? x : _mm256_and_si256(_mm256_srai_epi16(x, 1), _mm256_set1_epi16((short)0xbfff)));
        }
        _mm512_storeu_ps(out + i, _mm512_mul_ps(f, scale));
    }
}

/* Key or value rows of positions [k0, k0 + KEYS): pointers into an fp32 cache, or rows converted into `buf`;
 * rows past `nk` point at zeros. */
__attribute__((target("avx512f")))
static void block_rows(const Args *a, const void *cache, int kvh, int k0, int nk, float (*buf)[MAX_D],
                       const float **rows) {
    const int d = a->head_dim;
    for (int j = 0; j < KEYS; j++) {
        if (j >= nk) { rows[j] = ZEROS; continue; }
        const int p = k0 + j;
        const long at = (((long)a->table[p / a->block_size] * a->block_size + p % a->block_size) * a->kv_heads + kvh) * a->row;
        if (a->kv_dtype == KV_F32) { rows[j] = (const float *)cache + at; continue; }
        rows[j] = buf[j];
        if (a->kv_dtype >= KV_I8) { widen_8bit(a->kv_dtype, (const uint8_t *)cache + at, d, buf[j]); continue; }
        const uint16_t *h = (const uint16_t *)cache + at;
        for (int i = 0; i < d; i += 16) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(h + i));
            const __m512 f = a->kv_dtype == KV_F16 ? _mm512_cvtph_ps(x)
                : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
            _mm512_storeu_ps(buf[j] + i, f);
        }
    }
}

/* s[j][r] = sum_d qt[d][r] * k_j[d] for the block's KEYS keys, KG keys at a time, rows 16 * rv; rv is a
 * constant once inlined. */
__attribute__((target("avx512f"), always_inline))
static inline void scores_rv(const Args *a, Scratch *w, const float **krows, const int rv) {
    for (int j0 = 0; j0 < KEYS; j0 += KG) {
        __m512 acc[KG][RV];
        for (int j = 0; j < KG; j++)
            for (int v = 0; v < rv; v++) acc[j][v] = _mm512_setzero_ps();
        for (int d = 0; d < a->head_dim; d++) {
            __m512 q[RV];
            for (int v = 0; v < rv; v++) q[v] = _mm512_load_ps(w->qt[d] + 16 * v);
            for (int j = 0; j < KG; j++) {
                const __m512 k = _mm512_set1_ps(krows[j0 + j][d]);
                for (int v = 0; v < rv; v++) acc[j][v] = _mm512_fmadd_ps(k, q[v], acc[j][v]);
            }
        }
        for (int j = 0; j < KG; j++)
            for (int v = 0; v < rv; v++) _mm512_store_ps(w->s[j0 + j] + 16 * v, acc[j][v]);
    }
}

/* The scores of a tile's first 16 * rv rows only: a short chunk over a long context (a speculative verify of a
 * few drafts: 4 heads x 5 queries fill 20 of the 48 rows) does not compute the empty rows' dot products. */
__attribute__((target("avx512f")))
static void scores(const Args *a, Scratch *w, const float **krows, int rv) {
    if (rv == 1) scores_rv(a, w, krows, 1);
    else if (rv == 2) scores_rv(a, w, krows, 2);
    else scores_rv(a, w, krows, RV);
}

/* -inf where key k0 + j is after a row's query or before its window. */
__attribute__((target("avx512f")))
static void mask(const Args *a, Scratch *w, int k0, int rv) {
    for (int v = 0; v < rv; v++) {
        const __m512i pos = _mm512_load_si512((const void *)(w->pos + 16 * v));
        for (int j = 0; j < KEYS; j++) {
            const __m512i kp = _mm512_set1_epi32(k0 + j);
            __mmask16 ok = _mm512_cmp_epi32_mask(kp, pos, _MM_CMPINT_LE);
            if (a->window > 0)
                ok &= _mm512_cmp_epi32_mask(_mm512_add_epi32(kp, _mm512_set1_epi32(a->window)), pos, _MM_CMPINT_NLE);
            float *s = w->s[j] + 16 * v;
            _mm512_store_ps(s, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), ok, _mm512_load_ps(s)));
        }
    }
}

/* The online-softmax step: new running max, probabilities in place of scores (0 where masked), the running
 * sums and the factor alpha that rescales what the rows had accumulated. */
__attribute__((target("avx512f")))
static void softmax_step(Scratch *w, int rv) {
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < rv; v++) {
        __m512 mx = neg_inf;
        for (int j = 0; j < KEYS; j++) mx = _mm512_max_ps(mx, _mm512_load_ps(w->s[j] + 16 * v));
        const __m512 m_old = _mm512_load_ps(w->m + 16 * v), m_new = _mm512_max_ps(m_old, mx);
        /* a row that has seen no key yet keeps m = -inf; subtract 0 there so nothing becomes NaN */
        const __m512 m_use = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ), _mm512_setzero_ps());
        const __m512 alpha = exp2_neg(_mm512_sub_ps(m_old, m_use));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < KEYS; j++) {
            float *s = w->s[j] + 16 * v;
            const __m512 x = _mm512_load_ps(s);
            const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ), exp2_neg(_mm512_sub_ps(x, m_use)));
            _mm512_store_ps(s, p);
            sum = _mm512_add_ps(sum, p);
        }
        _mm512_store_ps(w->m + 16 * v, m_new);
        _mm512_store_ps(w->alpha + 16 * v, alpha);
        _mm512_store_ps(w->l + 16 * v, _mm512_fmadd_ps(_mm512_load_ps(w->l + 16 * v), alpha, sum));
    }
}

/* o[r][d0 .. d0 + 16 nv) = alpha[r] o[r] + sum_j p[j][r] v_j for PR rows from r0; nv is a constant once inlined. */
__attribute__((target("avx512f"), always_inline))
static inline void values_slice(Scratch *w, const float **vrows, int nk, int r0, int d0, const int nv) {
    __m512 acc[PR][4];
    for (int i = 0; i < PR; i++) {
        const __m512 al = _mm512_set1_ps(w->alpha[r0 + i]);
        for (int x = 0; x < nv; x++) acc[i][x] = _mm512_mul_ps(al, _mm512_loadu_ps(w->o[r0 + i] + d0 + 16 * x));
    }
    for (int j = 0; j < nk; j++) {
        __m512 vv[4];
        for (int x = 0; x < nv; x++) vv[x] = _mm512_loadu_ps(vrows[j] + d0 + 16 * x);
        for (int i = 0; i < PR; i++) {
            const __m512 p = _mm512_set1_ps(w->s[j][r0 + i]);
            for (int x = 0; x < nv; x++) acc[i][x] = _mm512_fmadd_ps(p, vv[x], acc[i][x]);
        }
    }
    for (int i = 0; i < PR; i++)
        for (int x = 0; x < nv; x++) _mm512_storeu_ps(w->o[r0 + i] + d0 + 16 * x, acc[i][x]);
}

__attribute__((target("avx512f")))
static void values(const Args *a, Scratch *w, const float **vrows, int nk, int rows) {
    for (int r0 = 0; r0 < rows; r0 += PR)
        for (int d0 = 0; d0 < a->head_dim; d0 += 64) {
            const int nv = (a->head_dim - d0) / 16;
            if (nv >= 4) values_slice(w, vrows, nk, r0, d0, 4);
            else if (nv == 3) values_slice(w, vrows, nk, r0, d0, 3);
            else if (nv == 2) values_slice(w, vrows, nk, r0, d0, 2);
            else values_slice(w, vrows, nk, r0, d0, 1);
        }
}

/* Queries [i0, i0 + nq) under KV head kvh: load the tile, run its key blocks, write its normalised outputs. */
__attribute__((target("avx512f")))
static void tile(const Args *a, Scratch *w, int kvh, int i0, int nq) {
    const int d = a->head_dim, g = a->heads / a->kv_heads, rows = nq * g, first_pos = a->n_ctx - a->n_q + i0;
    const int last_pos = first_pos + nq - 1, k_lo = a->window > 0 && first_pos >= a->window ? first_pos - a->window + 1 : 0;
    const float qs = a->scale * LOG2E;
    /* vectors of 16 rows the block passes compute: every row the value pass reads (PR at a time) */
    const int rv = ((rows + PR - 1) / PR * PR + 15) / 16 < RV ? ((rows + PR - 1) / PR * PR + 15) / 16 : RV;
    for (int r = 0; r < ROWS; r++) {
        const int i = r / g, h = r % g;
        const float *q = a->q + (long)(i0 + i) * a->q_row_stride + (long)(kvh * g + h) * d;
        for (int x = 0; x < d; x++) w->qt[x][r] = r < rows ? q[x] * qs : 0.f;
        w->pos[r] = r < rows ? first_pos + i : last_pos;  /* padding rows: any valid position, output unused */
        w->m[r] = -INFINITY;
        w->l[r] = 0.f;
        memset(w->o[r], 0, sizeof(float) * d);
    }
    const float *krows[KEYS], *vrows[KEYS];
    for (int k0 = k_lo; k0 <= last_pos; k0 += KEYS) {
        const int nk = last_pos + 1 - k0 < KEYS ? last_pos + 1 - k0 : KEYS;
        block_rows(a, a->k_cache, kvh, k0, nk, w->kbuf, krows);
        block_rows(a, a->v_cache, kvh, k0, nk, w->vbuf, vrows);
        scores(a, w, krows, rv);
        const int crosses_diagonal = k0 + KEYS - 1 > first_pos, before_window = a->window > 0 && k0 <= last_pos - a->window;
        if (crosses_diagonal || before_window) mask(a, w, k0, rv);
        softmax_step(w, rv);
        values(a, w, vrows, nk, rows);
    }
    for (int r = 0; r < rows; r++) {
        float *out = a->out + (long)(i0 + r / g) * a->out_row_stride + (long)(kvh * g + r % g) * d;
        const float inv = 1.f / w->l[r];
        for (int x = 0; x < d; x++) out[x] = w->o[r][x] * inv;
    }
}

/* 1 when this CPU runs the kernel (AVX-512F and BW), else 0: callers then keep their eager path. */
int prefill_attention_isa(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 1 : 0;
}

/* Returns 0; -1 for a head_dim the kernel does not take (not a multiple of 16, or over MAX_D), a GQA group
 * wider than a tile, or a CPU without AVX-512F and BW; -2 when a thread's scratch could not be allocated. */
int prefill_attention(const float *q, long q_row_stride, const void *k_cache, const void *v_cache, int kv_dtype,
                      const int32_t *table, float *out, long out_row_stride, int n_q, int n_ctx, int heads,
                      int kv_heads, int head_dim, int block_size, int window, float scale, int threads) {
    const int g = heads / kv_heads;
    if (head_dim % 16 || head_dim > MAX_D || g > ROWS || !prefill_attention_isa()) return -1;
    const Args a = {q, q_row_stride, k_cache, v_cache, kv_dtype, table, out, out_row_stride,
                    n_q, n_ctx, heads, kv_heads, head_dim, block_size, window, scale,
                    IS_8BIT(kv_dtype) ? KV8_ROW(head_dim) : head_dim};
    const int per_tile = ROWS / g, tiles = (n_q + per_tile - 1) / per_tile, tasks = tiles * kv_heads;
    const long work = (long)n_q * n_ctx * kv_heads;
    int failed = 0;
    #pragma omp parallel num_threads(threads) if(threads > 1 && work >= PARALLEL_MIN_WORK) reduction(|:failed)
    {
        Scratch *w = aligned_alloc(64, sizeof(Scratch));
        if (!w) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; t++) {  /* the last tiles read the most keys: hand them out first */
            if (!w) continue;
            const int tl = tiles - 1 - t / kv_heads, i0 = tl * per_tile;
            tile(&a, w, t % kv_heads, i0, n_q - i0 < per_tile ? n_q - i0 : per_tile);
        }
        free(w);
    }
    return failed ? -2 : 0;
}

#else  /* not x86: no vector path, so no kernel (the callers keep their PyTorch paths) */
int prefill_attention_isa(void) {
    return 0;
}
int prefill_attention(const float *q, long q_row_stride, const void *k_cache, const void *v_cache, int kv_dtype,
                      const int32_t *table, float *out, long out_row_stride, int n_q, int n_ctx, int heads,
                      int kv_heads, int head_dim, int block_size, int window, float scale, int threads) {
    return -1;
}
#endif  /* FLEETLLM_X86 */
