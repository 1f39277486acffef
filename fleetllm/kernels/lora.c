/* LoRA per row: y[r] += B[s_r] @ (A[s_r] @ x[r]) for each row r whose slot s_r >= 0 (S-LoRA's and Punica's
 * gathered shrink-then-expand, on the CPU).
 *
 * `a` is [n_slots, rank, in] and `b` [n_slots, out, rank], fp32, the adapters' scaling folded into b and zeros
 * beyond each adapter's own rank (fleetllm/lora/tables.py's layout). The rows are first grouped by slot (a
 * counting sort), so each adapter's A and B are read from memory once per call however many of the step's rows
 * use it: at decode widths the update is memory-bound (rank 16 over a 576-wide projection: 37 KB of A and as much
 * of B per adapter, against a few hundred FMAs a row). Shrink: per group and rank index j, A[s, j] is read once and
 * dotted with up to four of the group's rows at a time into mid [rows, rank]; expand: per group and tile of eight
 * outputs, the eight B rows are dotted with each row's mid and the eight sums (one horizontal-add tree) added to y.
 *
 * Work is split over OpenMP threads (group x rank index for the shrink, group x output tile for the expand) only
 * when the adapters' bytes are worth a parallel region: a rank-16 update of a single adapter reads ~70 KB, a few
 * microseconds on one core, less than waking the other threads costs. AVX2 + FMA at run time (the update streams
 * memory: AVX-512 would not read it faster), else a scalar path, also reachable with `vector = 0` (the tests').
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#define OUT_TILE 64  /* expand: outputs per work item */
#define ROW_BLOCK 4  /* shrink: a group's rows per work item */
#define WIDE_GROUP 4  /* expand: from this many rows a group transposes its B tile (see expand_wide_avx2) */
#define PARALLEL_BYTES (512 * 1024)  /* below this much adapter weight a call runs on the calling thread */

typedef struct { int slot, first, count; } Group;  /* rows order[first .. first + count) all use `slot` */

typedef struct {
    const float *x, *a, *b;
    float *y, *mid;  /* mid: [rows, rank_pad], zero past rank */
    long ldx, ldy;
    int rank, rank_pad, in, out;
    const int *order;
    const Group *groups;
    int n_groups;
} Call;

/* The rows with a slot, grouped by slot in `order`; returns the number of groups, or -1 for a slot >= n_slots. */
static int group_rows(const int32_t *slots, int rows, int n_slots, int *order, Group *groups, int *count) {
    memset(count, 0, sizeof(int) * n_slots);
    for (int r = 0; r < rows; r++) {
        if (slots[r] >= n_slots) return -1;
        if (slots[r] >= 0) count[slots[r]]++;
    }
    int n = 0, first = 0;
    for (int s = 0; s < n_slots; s++) {
        if (count[s]) groups[n++] = (Group){s, first, 0};
        first += count[s];
    }
    int *at = count;  /* reused: the next free position of each slot's group */
    for (int g = 0; g < n; g++) at[groups[g].slot] = groups[g].first;
    for (int r = 0; r < rows; r++)
        if (slots[r] >= 0) order[at[slots[r]]++] = r;
    for (int g = 0; g < n; g++) groups[g].count = at[groups[g].slot] - groups[g].first;
    return n;
}

/* mid[r] = A[s] @ x[r] for the group's rows i0 .. i0 + n. */
static void shrink_scalar(const Call *c, const Group *g, int i0, int n) {
    for (int i = i0; i < i0 + n; i++) {
        const int r = c->order[g->first + i];
        const float *xr = c->x + r * c->ldx;
        for (int j = 0; j < c->rank; j++) {
            const float *aj = c->a + ((long)g->slot * c->rank + j) * c->in;
            float s = 0.f;
            for (int k = 0; k < c->in; k++) s += aj[k] * xr[k];
            c->mid[(long)r * c->rank_pad + j] = s;
        }
    }
}

static void expand_scalar(const Call *c, const Group *g, int o0, int o1) {
    for (int i = 0; i < g->count; i++) {
        const int r = c->order[g->first + i];
        const float *m = c->mid + (long)r * c->rank_pad;
        for (int o = o0; o < o1; o++) {
            const float *bo = c->b + ((long)g->slot * c->out + o) * c->rank;
            float s = 0.f;
            for (int j = 0; j < c->rank; j++) s += bo[j] * m[j];
            c->y[r * c->ldy + o] += s;
        }
    }
}

#if FLEETLLM_X86
int lora_isa(void) {
    static int isa = -1;
    if (isa < 0) {
        __builtin_cpu_init();
        isa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 2 : 0;
    }
    return isa;
}

__attribute__((target("avx2,fma")))
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* mid[r] = A[s] @ x[r] for the group's rows i0 .. i0 + n (n <= 4): two A rows against four x rows at a time (eight
 * independent sums), so each A row is read once per block of rows and each x vector once per two A rows. */
__attribute__((target("avx2,fma")))
static void shrink_avx2(const Call *c, const Group *g, int i0, int n) {
    const int n8 = c->in / 8 * 8;
    const float *xr[4];
    for (int i = 0; i < 4; i++) xr[i] = c->x + c->order[g->first + i0 + (i < n ? i : 0)] * c->ldx;
    for (int j = 0; j < c->rank; j += 2) {
        const int pair = j + 1 < c->rank ? 2 : 1;
        const float *aj[2] = {c->a + ((long)g->slot * c->rank + j) * c->in, NULL};
        aj[1] = pair == 2 ? aj[0] + c->in : aj[0];
        __m256 acc[2][4];
        for (int t = 0; t < 2; t++)
            for (int i = 0; i < 4; i++) acc[t][i] = _mm256_setzero_ps();
        for (int k = 0; k < n8; k += 8) {
            const __m256 a0 = _mm256_loadu_ps(aj[0] + k), a1 = _mm256_loadu_ps(aj[1] + k);
            for (int i = 0; i < 4; i++) {
                const __m256 xv = _mm256_loadu_ps(xr[i] + k);
                acc[0][i] = _mm256_fmadd_ps(a0, xv, acc[0][i]);
                acc[1][i] = _mm256_fmadd_ps(a1, xv, acc[1][i]);
            }
        }
        for (int t = 0; t < pair; t++)
            for (int i = 0; i < n; i++) {
                float s = hsum(acc[t][i]);
                for (int k = n8; k < c->in; k++) s += aj[t][k] * xr[i][k];
                c->mid[(long)c->order[g->first + i0 + i] * c->rank_pad + j + t] = s;
            }
    }
}

/* The eight lanes' sums of v[0..7], as one vector (lane i: the sum of v[i]'s lanes). */
__attribute__((target("avx2,fma")))
static inline __m256 sums8(const __m256 v[8]) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* y[r, o0 .. o1) += sum_j mid[r, j] * B[s, o0 .. o1, j] for a group of many rows: the tile of B transposed once
 * into bt [rank][OUT_TILE], then per row eight output vectors accumulate rank broadcast FMAs, no horizontal sums. */
__attribute__((target("avx2,fma")))
static void expand_wide_avx2(const Call *c, const Group *g, int o0, int o1) {
    const int rank = c->rank, w = o1 - o0;
    const float *bs = c->b + ((long)g->slot * c->out + o0) * rank;
    float bt[rank * OUT_TILE];
    for (int o = 0; o < w; o++)
        for (int j = 0; j < rank; j++) bt[j * OUT_TILE + o] = bs[(long)o * rank + j];
    for (int i = 0; i < g->count; i++) {
        const int r = c->order[g->first + i];
        const float *m = c->mid + (long)r * c->rank_pad;
        float *yr = c->y + r * c->ldy + o0;
        __m256 acc[OUT_TILE / 8];
        for (int v = 0; v < OUT_TILE / 8; v++) acc[v] = _mm256_setzero_ps();
        for (int j = 0; j < rank; j++) {
            const __m256 mj = _mm256_broadcast_ss(m + j);
            for (int v = 0; v < OUT_TILE / 8; v++) acc[v] = _mm256_fmadd_ps(mj, _mm256_loadu_ps(bt + j * OUT_TILE + 8 * v), acc[v]);
        }
        float sums[OUT_TILE];  /* acc indexed by constants only, so it stays in registers */
        for (int v = 0; v < OUT_TILE / 8; v++) _mm256_storeu_ps(sums + 8 * v, acc[v]);
        for (int o = 0; o < w; o++) yr[o] += sums[o];
    }
}

/* y[r, o0 .. o1) += B[s, o] . mid[r] for the group's rows, eight outputs at a time. */
__attribute__((target("avx2,fma")))
static void expand_avx2(const Call *c, const Group *g, int o0, int o1) {
    if (g->count >= WIDE_GROUP) {
        expand_wide_avx2(c, g, o0, o1);
        return;
    }
    const int rank = c->rank, tail = rank % 8, full = rank - tail;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const float *bs = c->b + (long)g->slot * c->out * rank;
    int o = o0;
    for (; o + 8 <= o1; o += 8) {
        for (int i = 0; i < g->count; i++) {
            const int r = c->order[g->first + i];
            const float *m = c->mid + (long)r * c->rank_pad;
            __m256 acc[8];
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();
            for (int j = 0; j < full; j += 8) {
                const __m256 mv = _mm256_loadu_ps(m + j);
                for (int t = 0; t < 8; t++)
                    acc[t] = _mm256_fmadd_ps(_mm256_loadu_ps(bs + (long)(o + t) * rank + j), mv, acc[t]);
            }
            if (tail) {
                const __m256 mv = _mm256_loadu_ps(m + full);  /* zero past rank */
                for (int t = 0; t < 8; t++)
                    acc[t] = _mm256_fmadd_ps(_mm256_maskload_ps(bs + (long)(o + t) * rank + full, mask), mv, acc[t]);
            }
            float *yr = c->y + r * c->ldy + o;
            _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), sums8(acc)));
        }
    }
    if (o < o1) expand_scalar(c, g, o, o1);
}
#else
int lora_isa(void) {
    return 0;
}
#define shrink_avx2 shrink_scalar
#define expand_avx2 expand_scalar
#endif  /* FLEETLLM_X86 */

/* The group of shrink item `item` (a block of up to ROW_BLOCK of a group's rows) and the block's first row in it. */
static const Group *block_of(const Call *c, int item, int *i0) {
    const Group *g = c->groups;
    for (int blocks; item >= (blocks = (g->count + ROW_BLOCK - 1) / ROW_BLOCK); g++) item -= blocks;
    *i0 = item * ROW_BLOCK;
    return g;
}

/* Both phases over the groups, on `threads` threads (the expand reads mid, so a barrier between them). */
static void run(const Call *c, int threads, int vector) {
    const int tiles = (c->out + OUT_TILE - 1) / OUT_TILE;
    int blocks = 0;
    for (int g = 0; g < c->n_groups; g++) blocks += (c->groups[g].count + ROW_BLOCK - 1) / ROW_BLOCK;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int item = 0; item < blocks; item++) {
            int i0;
            const Group *g = block_of(c, item, &i0);
            const int n = g->count - i0 < ROW_BLOCK ? g->count - i0 : ROW_BLOCK;
            if (vector) shrink_avx2(c, g, i0, n);
            else shrink_scalar(c, g, i0, n);
        }
        #pragma omp for schedule(static)
        for (int item = 0; item < c->n_groups * tiles; item++) {
            const Group *g = c->groups + item / tiles;
            const int o0 = item % tiles * OUT_TILE, o1 = o0 + OUT_TILE < c->out ? o0 + OUT_TILE : c->out;
            if (vector) expand_avx2(c, g, o0, o1);
            else expand_scalar(c, g, o0, o1);
        }
    }
}

/* y[r * ldy + o] += sum_j b[s, o, j] * sum_k a[s, j, k] * x[r * ldx + k] for each row r < rows with slot
 * s = slots[r] >= 0 (slot -1: no adapter, the row is left alone). `vector` 0 takes the scalar path. Returns 0, -1
 * for a slot >= n_slots or a shape it does not take, -2 without memory for its scratch. */
int lora_apply(const float *x, long ldx, float *y, long ldy, int rows, const int32_t *slots, int n_slots,
               const float *a, const float *b, int rank, int in, int out, int threads, int vector) {
    if (rows <= 0 || rank <= 0) return rows < 0 || rank < 0 ? -1 : 0;
    if (n_slots <= 0 || in <= 0 || out <= 0) return -1;
    const int rank_pad = (rank + 7) / 8 * 8;
    char *scratch = calloc(1, sizeof(int) * ((size_t)rows + n_slots) + sizeof(Group) * (size_t)n_slots
                              + sizeof(float) * (size_t)rows * rank_pad);
    if (scratch == NULL) return -2;
    float *mid = (float *)scratch;
    Group *groups = (Group *)(mid + (size_t)rows * rank_pad);
    int *order = (int *)(groups + n_slots), *count = order + rows;
    const int n_groups = group_rows(slots, rows, n_slots, order, groups, count);
    if (n_groups > 0) {
        const Call c = {x, a, b, y, mid, ldx, ldy, rank, rank_pad, in, out, order, groups, n_groups};
        const double bytes = 4.0 * n_groups * rank * ((double)in + out);
        run(&c, bytes < PARALLEL_BYTES ? 1 : threads, vector && lora_isa() == 2);
    }
    free(scratch);
    return n_groups < 0 ? -1 : 0;
}
