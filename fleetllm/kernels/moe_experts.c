/* A mixture-of-experts block's narrow steps in one call: router, top-k, the chosen experts' Q8_0 SwiGLU MLPs
 * and their weighted sum, for every row of the step.
 *
 * PyTorch's path (fleetllm/models/moe.py) dispatches about a dozen ops per active expert and thirty more per
 * layer around them: at one token that is more time than the 12 MB of expert weights take to read, and at
 * eight tokens (~40 distinct experts a layer) several times more. Here, per row: the router's fp32 logits,
 * softmax over all experts, the top k by probability (the lower expert id first on ties), renormalised to sum
 * to 1 when `norm_topk` (Qwen3-MoE, Mixtral); the choices sorted by expert id. The step's (row, choice) pairs
 * are then grouped by expert (rows in order), and each active expert's gate_up and down products run once over
 * all of its rows, in passes of up to MAX_ROWS rows that read each weight row once. An expert no row chose is
 * never read. SiLU(gate) * up between them; each row's output is its choices' outputs times their weights,
 * added in ascending expert order (each product rounded, then the sum, as PyTorch's ops round them).
 *
 * Activations stay fp32 and each row's products are the Q8_0 GEMV's own (q8_rows.h): the weights the file
 * holds, fp32 activations, the op-by-op path's numerics up to the router's and SiLU's rounding.
 *
 * One OpenMP region per call, three barriers: after the router's logits, after routing and grouping (a few
 * microseconds on one thread), after the experts, each active expert a work item handed out dynamically (see
 * experts_step: on a shared machine a barrier per product cost more than the products). Each row's result depends on that row alone: batch-invariant.
 * AVX2 + FMA is chosen at run time; a scalar path covers other CPUs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#include "gemv_common.h"
#include "q8_rows.h"

#define MAX_TOP_K 64

/* One layer's experts: the router's fp32 weight, and each expert's Q8_0 gate_up ([2I, H]: gate rows, then up)
 * and down ([H, I]) as int8 levels and fp32 scales (one per 32 inputs), by expert id. */
typedef struct {
    const float *router;  /* [E, H] */
    const int8_t *const *gate_up;
    const float *const *gate_up_d;
    const int8_t *const *down;
    const float *const *down_d;
    int experts, top_k, hidden, inter, norm_topk;
} MoeLayer;

/* The step's pairs grouped by expert: slot s (of rows * k) holds one pair, and `slot_of[r * k + j]` is the
 * slot of row r's j-th choice (in ascending expert order). */
typedef struct {
    int *ids, *slot_of;  /* per pair: its expert, its slot */
    int *active, *first, *count;  /* the active experts, their first slot and number of rows */
    float *weight, *xs, *gu, *act, *ys;  /* per pair: routing weight; per slot: input, gate_up, SiLU * up, output */
    int n_active;
} Plan;

int moe_experts_isa(void) {
#if FLEETLLM_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 0;
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

/* Output row j of an expert's weight (`w`, `d`: its levels and scales, `k_in` inputs) for its `n` rows of
 * `x` (k_in apart) into `y` (ldy apart), in passes of MAX_ROWS. */
static void expert_row(const int8_t *w, const float *d, int k_in, int j, const float *x, int n, float *y, long ldy,
                       int vec) {
    const int groups = k_in / 32;
    const int8_t *wj = w + (long)j * k_in;
    const float *dj = d + (long)j * groups;
    for (int r0 = 0; r0 < n; r0 += MAX_ROWS) {
        const int r = n - r0 < MAX_ROWS ? n - r0 : MAX_ROWS;
#if FLEETLLM_X86
        if (vec) {
            row_avx2_any(r, wj, dj, x + (long)r0 * k_in, k_in, groups, y + r0 * ldy + j, ldy);
            continue;
        }
#endif
        row_scalar(r, wj, dj, x + (long)r0 * k_in, k_in, groups, y + r0 * ldy + j, ldy);
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
static void plan_step(const MoeLayer *ly, const float *x, const float *logits, int rows, Plan *pl, int64_t *counts) {
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
        const int s = next[ids[p]]++;
        pl->slot_of[p] = s;
        memcpy(pl->xs + (long)s * H, x + (long)(p / k) * H, sizeof(float) * H);
    }
}

/* The step's expert products and the weighted sum, inside the caller's parallel region. Each active expert is
 * one work item, handed out dynamically: its gate_up rows, SiLU * up, its down rows, on one thread with no
 * barrier in between; a thread the OS takes away for a while holds up the others only by the expert it is on. */
static void experts_step(const MoeLayer *ly, const Plan *pl, int rows, float *out, int vec) {
    const int k = ly->top_k, H = ly->hidden, I = ly->inter;
    #pragma omp for schedule(dynamic, 1)
    for (int a = 0; a < pl->n_active; a++) {
        const int e = pl->active[a], s = pl->first[a], n = pl->count[a];
        float *gu = pl->gu + (long)s * 2 * I, *act = pl->act + (long)s * I;
        for (int j = 0; j < 2 * I; j++)
            expert_row(ly->gate_up[e], ly->gate_up_d[e], H, j, pl->xs + (long)s * H, n, gu, 2 * I, vec);
        for (int r = 0; r < n; r++)
            silu_mul(gu + (long)r * 2 * I, gu + (long)r * 2 * I + I, I, act + (long)r * I, vec);
        for (int j = 0; j < H; j++)
            expert_row(ly->down[e], ly->down_d[e], I, j, act, n, pl->ys + (long)s * H, H, vec);
    }
    #pragma omp for schedule(static)
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

/* out[rows, H] = the MoE block of x[rows, H]; `counts` (NULL: none) gains each expert's pairs. Returns 0, -1
 * for a shape it does not take (H or I not a multiple of 32, k outside 1..min(E, 64)), -2 without memory;
 * `vector` 0 forces the scalar path (tests). */
int moe_experts(const MoeLayer *ly, const float *x, int rows, float *out, int64_t *counts, int threads, int vector) {
    const int k = ly->top_k, E = ly->experts, H = ly->hidden, I = ly->inter;
    const long pairs = (long)rows * k;
    if (H % 32 || I % 32 || H <= 0 || I <= 0 || k < 1 || k > E || k > MAX_TOP_K || rows < 1) return -1;
    const int vec = vector && moe_experts_isa() == 2;
    float *buf = malloc(sizeof(float) * (rows * (long)E + pairs * (1 + H + 2 * I + I + H)));
    int *ints = malloc(sizeof(int) * (2 * pairs + 3L * E));
    if (buf == NULL || ints == NULL) {
        free(buf), free(ints);
        return -2;
    }
    Plan pl = {.ids = ints, .slot_of = ints + pairs, .active = ints + 2 * pairs};
    pl.first = pl.active + E, pl.count = pl.first + E;
    float *logits = buf;
    pl.weight = logits + rows * (long)E, pl.xs = pl.weight + pairs, pl.gu = pl.xs + pairs * H;
    pl.act = pl.gu + pairs * 2 * I, pl.ys = pl.act + pairs * I;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int i = 0; i < rows * E; i++)
            logits[i] = dot(x + (long)(i / E) * H, ly->router + (long)(i % E) * H, H, vec);
        #pragma omp single
        plan_step(ly, x, logits, rows, &pl, counts);
        experts_step(ly, &pl, rows, out, vec);
    }
    free(buf), free(ints);
    return 0;
}
