/* A mixture-of-experts block's narrow steps in one call: router, top-k, the chosen experts' Q8_0 SwiGLU MLPs
 * and their weighted sum, for every row of the step.
 *
 * PyTorch's path (fleetllm/models/moe.py) dispatches about a dozen ops per active expert and thirty more per
 * layer around them: at one token that is more time than the 12 MB of expert weights take to read, and at
 * eight tokens (~40 distinct experts a layer) several times more. Here, per row: the router's fp32 logits,
 * softmax over all experts, the top k by probability (the lower expert id first on ties), renormalised to sum
 * to 1 when `norm_topk` (Qwen3-MoE, Mixtral); the choices sorted by expert id. The step's (row, choice) pairs
 * are then grouped by expert (rows in order), and each active expert's gate_up and down products run once over
 * all of its rows, in passes of up to I16_PASS rows that read each weight row once. An expert no row chose is
 * never read. SiLU(gate) * up between them; each row's output is its choices' outputs times their weights,
 * added in ascending expert order (each product rounded, then the sum, as PyTorch's ops round them).
 *
 * The products are q8_i16_rows.h's (Q8_0 weights) or q4_i16_rows.h's (4-bit: a GGUF's Q4_0, Q4_1, Q4_K): the weights the file holds, each row's input rounded to int16 per group of
 * 32 once (and each pair's SiLU * up once), integer dot products summed exactly: the q4 default's contract for
 * narrow steps, the same as the op-by-op path's Q8_0 GEMV (q8_i16_gemv) up to the router's and SiLU's rounding.
 *
 * One OpenMP region per call, three barriers: after the router's logits, after routing and grouping (a few
 * microseconds on one thread), after the experts, each active expert a work item handed out dynamically (see
 * experts_step: on a shared machine a barrier per product cost more than the products); the weighted sum ends
 * with the region. Each row's result depends on that row alone: batch-invariant. AVX-512 VNNI or AVX2 + FMA is
 * chosen at run time (the same bits); a scalar path covers other CPUs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#include "gemv_common.h"
#include "q8_i16_rows.h"
#include "q4_i16_rows.h"

#define MAX_TOP_K 64

/* One layer's experts: the router's fp32 weight, and each expert's gate_up ([2I, H]: gate rows, then up) and down
 * ([H, I]), by expert id, each either Q8_0 (int8 levels and fp32 scales, one per 32 inputs; factors NULL) or 4-bit
 * (q4_i16_rows.h's levels two a byte, uint8 factors, fp32 scales per 2^shift groups). */
typedef struct {
    const float *router;  /* [E, H] */
    const void *const *gate_up;
    const float *const *gate_up_d;
    const uint8_t *const *gate_up_f;  /* NULL: gate_up is Q8_0 */
    int gate_up_shift;
    const void *const *down;
    const float *const *down_d;
    const uint8_t *const *down_f;  /* NULL: down is Q8_0 */
    int down_shift;
    int experts, top_k, hidden, inter, norm_topk;
} MoeLayer;

/* The step's pairs grouped by expert: slot s (of rows * k) holds one pair, and `slot_of[r * k + j]` is the
 * slot of row r's j-th choice (in ascending expert order). */
typedef struct {
    int *ids, *slot_of;  /* per pair: its expert, its slot */
    int *active, *first, *count;  /* the active experts, their first slot and number of rows */
    float *weight, *gu, *act, *ys;  /* per pair: routing weight; per slot: gate_up, SiLU * up, output */
    int16_t *xq, *actq;  /* per row: its input's int16 levels; per slot: SiLU * up's */
    float *xs, *acts;    /* their scales, one per 32 inputs */
    float *xsum, *actsum;  /* their groups' sums (group_sums), for 4-bit weights' offsets */
    const int16_t **x_of, **act_of;  /* per slot: its row's input levels, its own SiLU * up levels */
    const float **xs_of, **acts_of;  /* and their scales */
    const float **xsum_of, **actsum_of;  /* and their groups' sums */
    int n_active;
} Plan;

/* 3: AVX-512 VNNI (+ VL) and AVX2 + FMA; 2: AVX2 + FMA; 0: neither (the scalar path). */
int moe_experts_isa(void) {
#if FLEETLLM_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") ? 3 : 2;
#else
    return 0;
#endif
}

#if FLEETLLM_X86
__attribute__((target("avx2,fma")))
static float dot_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

__attribute__((target("avx2,fma")))
static void silu_mul_avx2(const float *g, const float *u, int n, float *out) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (int i = 0; i < n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, sign))));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
}
#endif

static float dot(const float *a, const float *b, int n, int vec) {
#if FLEETLLM_X86
    if (vec) return dot_avx2(a, b, n);
#endif
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void silu_mul(const float *g, const float *u, int n, float *out, int vec) {
#if FLEETLLM_X86
    if (vec) {
        silu_mul_avx2(g, u, n, out);
        return;
    }
#endif
    for (int i = 0; i < n; i++) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

/* One output row of an expert's weight for up to I16_PASS activation rows, on the level's row kernel. */
typedef void row_fn(int rows, const int8_t *w, const float *d, const int16_t *const *xq, const float *const *sx,
                    int groups, float *out, long ldy);

static row_fn *row_kernel(int level) {
#if FLEETLLM_X86
    if (level >= 3) return row_i16_vnni_any;
    if (level == 2) return row_i16_avx2_any;
#endif
    return row_i16_scalar;
}

static void quantize_i16(const float *x, int n, int16_t *q, float *s, int level) {
#if FLEETLLM_X86
    if (level >= 2) {
        quantize_i16_avx2(x, n, q, s);
        return;
    }
#endif
    quantize_i16_scalar(x, n, q, s);
}

/* One output row of a 4-bit weight for up to I16_PASS activation rows (q4_i16_rows.h). */
typedef void row4_fn(int rows, const uint8_t *w, const uint8_t *f, const float *d, int shift,
                     const int16_t *const *xq, const float *const *sx, const float *const *xsum, int groups,
                     float *out, long ldy);

static row4_fn *row4_kernel(int level) {
#if FLEETLLM_X86
    if (level >= 3) return row_q4_vnni_any;
    if (level == 2) return row_q4_avx2_any;
#endif
    return row_q4_scalar;
}

/* One expert's weight as the products read it: Q8_0 when `f` is NULL, else 4-bit. */
typedef struct {
    const void *w;
    const float *d;
    const uint8_t *f;
    int shift;
} Weight;

/* y[r, j] (ldy apart) = row j of an expert's weight (`k_in` inputs) times its `n` activation rows (levels `xq[r]`,
 * scales `sx[r]`, group sums `xsum[r]`), each weight row read once per pass of I16_PASS rows. */
static void expert_product(int level, Weight wt, int k_in, int n_out, const int16_t *const *xq,
                           const float *const *sx, const float *const *xsum, int n, float *y, long ldy) {
    const int groups = k_in / 32;
    if (wt.f == NULL) {
        row_fn *row = row_kernel(level);
        const int8_t *w = wt.w;
        for (int j = 0; j < n_out; j++) {
            if (j + PREFETCH_ROWS < n_out)
                prefetch_row(w + (long)(j + PREFETCH_ROWS) * k_in, wt.d + (long)(j + PREFETCH_ROWS) * groups, k_in);
            for (int r0 = 0; r0 < n; r0 += I16_PASS)
                row(n - r0 < I16_PASS ? n - r0 : I16_PASS, w + (long)j * k_in, wt.d + (long)j * groups, xq + r0,
                    sx + r0, groups, y + r0 * ldy + j, ldy);
        }
        return;
    }
    row4_fn *row = row4_kernel(level);
    const uint8_t *w = wt.w;
    const int scales = 2 * (groups >> wt.shift);  /* per row */
    for (int j = 0; j < n_out; j++) {
        const long ahead = j + PREFETCH_ROWS;
        if (ahead < n_out) prefetch_row4(w + ahead * groups * 16, wt.f + ahead * groups * 2, wt.d + ahead * scales, k_in);
        for (int r0 = 0; r0 < n; r0 += I16_PASS)
            row(n - r0 < I16_PASS ? n - r0 : I16_PASS, w + (long)j * groups * 16, wt.f + (long)j * groups * 2,
                wt.d + (long)j * scales, wt.shift, xq + r0, sx + r0, xsum + r0, groups, y + r0 * ldy + j, ldy);
    }
}

/* Row r's choices from its logits: expert ids ascending in `ids`, their weights in `w`. */
static void route(const float *logits, int e_count, int k, int norm, int *ids, float *w) {
    float p[e_count], top = logits[0], sum = 0.f;
    for (int e = 1; e < e_count; e++) top = logits[e] > top ? logits[e] : top;
    for (int e = 0; e < e_count; e++) sum += p[e] = expf(logits[e] - top);
    for (int e = 0; e < e_count; e++) {
        p[e] /= sum;
        p[e] = p[e] == p[e] ? p[e] : 0.f;  /* NaN logits: never an id outside the experts (the output is NaN) */
    }
    float chosen = 0.f;
    for (int j = 0; j < k; j++) {  /* k passes: k is small */
        int best = -1;
        for (int e = 0; e < e_count; e++)
            if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
        ids[j] = best, w[j] = p[best], p[best] = -1.f;
        chosen += w[j];
    }
    for (int j = 1; j < k; j++)  /* insertion sort by expert id: the order the outputs are added in */
        for (int i = j; i > 0 && ids[i - 1] > ids[i]; i--) {
            const int t = ids[i]; ids[i] = ids[i - 1]; ids[i - 1] = t;
            const float u = w[i]; w[i] = w[i - 1]; w[i - 1] = u;
        }
    if (norm)
        for (int j = 0; j < k; j++) w[j] /= chosen;
}

/* Routes every row and groups the pairs by expert (one thread); adds each expert's pairs to `counts`. */
static void plan_step(const MoeLayer *ly, const float *logits, int rows, Plan *pl, int64_t *counts) {
    const int k = ly->top_k, E = ly->experts, H = ly->hidden;
    int *ids = pl->ids, per[E], next[E];
    memset(per, 0, sizeof(per));
    for (int r = 0; r < rows; r++) {
        route(logits + (long)r * E, E, k, ly->norm_topk, ids + r * k, pl->weight + r * k);
        for (int j = 0; j < k; j++) per[ids[r * k + j]]++;
    }
    pl->n_active = 0;
    for (int e = 0, at_slot = 0; e < E; e++) {
        next[e] = at_slot;
        if (per[e]) {
            pl->active[pl->n_active] = e, pl->first[pl->n_active] = at_slot, pl->count[pl->n_active++] = per[e];
            if (counts) counts[e] += per[e];
        }
        at_slot += per[e];
    }
    for (int p = 0; p < rows * k; p++) {  /* rows in order within each expert */
        const int s = next[ids[p]]++, r = p / k;
        pl->slot_of[p] = s;
        pl->x_of[s] = pl->xq + (long)r * H, pl->xs_of[s] = pl->xs + (long)r * (H / 32);
        pl->xsum_of[s] = pl->xsum + (long)r * (H / 32);
    }
}

/* The step's expert products and the weighted sum, inside the caller's parallel region. Each active expert is
 * one work item, handed out dynamically: its gate_up rows, SiLU * up, its down rows, on one thread with no
 * barrier in between; a thread the OS takes away for a while holds up the others only by the expert it is on. */
static void experts_step(const MoeLayer *ly, const Plan *pl, int rows, float *out, int level) {
    const int k = ly->top_k, H = ly->hidden, I = ly->inter;
    #pragma omp for schedule(dynamic, 1)
    for (int a = 0; a < pl->n_active; a++) {
        const int e = pl->active[a], s = pl->first[a], n = pl->count[a];
        float *gu = pl->gu + (long)s * 2 * I, *act = pl->act + (long)s * I;
        const Weight gate_up = {ly->gate_up[e], ly->gate_up_d[e], ly->gate_up_f ? ly->gate_up_f[e] : NULL,
                                ly->gate_up_shift};
        const Weight down = {ly->down[e], ly->down_d[e], ly->down_f ? ly->down_f[e] : NULL, ly->down_shift};
        expert_product(level, gate_up, H, 2 * I, pl->x_of + s, pl->xs_of + s, pl->xsum_of + s, n, gu, 2 * I);
        for (int r = 0; r < n; r++) {
            int16_t *q = (int16_t *)pl->act_of[s + r];
            float *sc = (float *)pl->acts_of[s + r];
            silu_mul(gu + (long)r * 2 * I, gu + (long)r * 2 * I + I, I, act + (long)r * I, level >= 2);
            quantize_i16(act + (long)r * I, I, q, sc, level);
            if (down.f) group_sums(q, sc, I, (float *)pl->actsum_of[s + r]);
        }
        expert_product(level, down, I, H, pl->act_of + s, pl->acts_of + s, pl->actsum_of + s, n,
                       pl->ys + (long)s * H, H);
    }
    #pragma omp for schedule(static) nowait  /* the region's end is the barrier */
    for (int h0 = 0; h0 < H; h0 += 64) {
        const int h1 = h0 + 64 < H ? h0 + 64 : H;
        for (int r = 0; r < rows; r++) {
            float *o = out + (long)r * H;
            for (int j = 0; j < k; j++) {
                const float w = pl->weight[r * k + j], *y = pl->ys + (long)pl->slot_of[r * k + j] * H;
                for (int h = h0; h < h1; h++) {
                    const float t = w * y[h];
                    o[h] = j ? o[h] + t : t;
                }
            }
        }
    }
}

/* Points the plan into `floats`, `levels` and `ptrs` (sized by plan_sizes) and each slot at its own SiLU * up. */
static void plan_layout(Plan *pl, int rows, int E, int H, int I, int k, float *floats, int16_t *levels,
                        void **ptrs) {
    const long pairs = (long)rows * k;
    pl->weight = floats + rows * (long)E, pl->xs = pl->weight + pairs, pl->gu = pl->xs + rows * (long)(H / 32);
    pl->act = pl->gu + pairs * 2 * I, pl->acts = pl->act + pairs * I, pl->ys = pl->acts + pairs * (I / 32);
    pl->xsum = pl->ys + pairs * H, pl->actsum = pl->xsum + rows * (long)(H / 32);
    pl->xq = levels, pl->actq = levels + rows * (long)H;
    pl->x_of = (const int16_t **)ptrs, pl->act_of = pl->x_of + pairs;
    pl->xs_of = (const float **)(ptrs + 2 * pairs), pl->acts_of = pl->xs_of + pairs;
    pl->xsum_of = (const float **)(ptrs + 4 * pairs), pl->actsum_of = pl->xsum_of + pairs;
    for (long s = 0; s < pairs; s++) {
        pl->act_of[s] = pl->actq + s * I, pl->acts_of[s] = pl->acts + s * (I / 32);
        pl->actsum_of[s] = pl->actsum + s * (I / 32);
    }
}

/* out[rows, H] = the MoE block of x[rows, H]; `counts` (NULL: none) gains each expert's pairs. Returns 0, -1
 * for a shape it does not take (H or I not a multiple of 32, k outside 1..min(E, 64)), -2 without memory.
 * `vector` picks the instruction set (tests): 0 the scalar path, 2 AVX2, any other the best this CPU has. The
 * experts' products are the same bits at every level; AVX2 and VNNI give the same output, the scalar path rounds
 * the router's dot products and SiLU its own way. */
int moe_experts(const MoeLayer *ly, const float *x, int rows, float *out, int64_t *counts, int threads, int vector) {
    const int k = ly->top_k, E = ly->experts, H = ly->hidden, I = ly->inter;
    const long pairs = (long)rows * k;
    if (H % 32 || I % 32 || H <= 0 || I <= 0 || k < 1 || k > E || k > MAX_TOP_K || rows < 1) return -1;
    const int isa = moe_experts_isa(), level = vector == 0 ? 0 : vector == 2 && isa > 2 ? 2 : isa;
    float *floats = malloc(sizeof(float) * (rows * (long)E + pairs + 2 * rows * (long)(H / 32)
                                            + pairs * (2 * I + I + 2 * (I / 32) + H)));
    int16_t *levels = malloc(sizeof(int16_t) * (rows * (long)H + pairs * I));
    void **ptrs = malloc(sizeof(void *) * 6 * pairs);
    int *ints = malloc(sizeof(int) * (2 * pairs + 3L * E));
    if (floats == NULL || levels == NULL || ptrs == NULL || ints == NULL) {
        free(floats), free(levels), free(ptrs), free(ints);
        return -2;
    }
    Plan pl = {.ids = ints, .slot_of = ints + pairs, .active = ints + 2 * pairs};
    pl.first = pl.active + E, pl.count = pl.first + E;
    plan_layout(&pl, rows, E, H, I, k, floats, levels, ptrs);
    const float *logits = floats;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static) nowait
        for (int r = 0; r < rows; r++) {
            int16_t *q = pl.xq + (long)r * H;
            float *sc = pl.xs + (long)r * (H / 32);
            quantize_i16(x + (long)r * H, H, q, sc, level);
            if (ly->gate_up_f) group_sums(q, sc, H, pl.xsum + (long)r * (H / 32));
        }
        #pragma omp for schedule(static)
        for (int i = 0; i < rows * E; i++)
            floats[i] = dot(x + (long)(i / E) * H, ly->router + (long)(i % E) * H, H, level >= 2);
        #pragma omp single
        plan_step(ly, logits, rows, &pl, counts);
        experts_step(ly, &pl, rows, out, level);
    }
    free(floats), free(levels), free(ptrs), free(ints);
    return 0;
}
