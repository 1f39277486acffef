/* A decode step through a Llama-family decoder stack with Q4_1 weights, in one call from Python.
 *
 * Each of the step's rows is a query over its sequence's context: one sequence's next token, or one of a
 * short chunk's queries (a short prompt; speculative verification: the last token and its drafts), its own
 * K/V stored before attention reads it (causal by each row's context length). Per layer: RMSNorm, the fused qkv GEMV, RoPE (HF's
 * "rotate half" layout, each product and sum rounded as PyTorch's `q * cos + rotate_half(q) * sin` rounds
 * them), the new K/V written into the paged cache (fp32, fp16 or bf16; or 8-bit, int8 / fp8, each KV head's row
 * quantised with its scale as fleetllm/kernels/kv8.py quantises it, byte for byte), paged attention, the o GEMV and the
 * residual add; RMSNorm, the fused gate_up GEMV, SiLU(gate) * up, the down GEMV and the residual add. The
 * GEMVs (q4_int_gemm.c's, or bf16_gemm.c's for wide steps) and attention (paged_attention.c's) are those
 * libraries' own functions, passed in as pointers, so this file holds only the glue that PyTorch would otherwise dispatch op by op (about
 * forty ops a layer, which cost more than the arithmetic at narrow steps). Element-wise work runs on the
 * calling thread: at a few rows it is microseconds, and an OpenMP region would cost more to wake.
 * AVX2 + FMA is required (the caller checks `decode_stack_isa`); there is no scalar path: without AVX2 the
 * model takes its op-by-op path.
 *
 * Q8_0 models with experts (a Q8_0 GGUF of Qwen3-MoE): a layer may hold Q8_0 linears (int8 levels, fp32 scales:
 * q8_gemv.c's q8_i16_gemv, int16 activations, passed in as `gemv8`), q/k RMSNorm per head before RoPE (Qwen3), and a mixture-of-experts
 * block in place of the MLP (moe_experts.c's `moe_experts`: router, top-k, the chosen experts, their weighted
 * sum), whose per-expert row counts go to the step's `counts` (per layer, for the load-imbalance metrics).
 *
 * LoRA adapters (issue #39): a step whose rows use resident adapters passes per layer the adapted projections'
 * stacked A/B tables (fleetllm/lora/tables.py; NULL for a projection no adapter adapts) and each row's slot (-1:
 * none), and lora.c's `lora_apply` adds each row's update where the op-by-op path adds it: q, k and v into their
 * slices of the fused qkv output before RoPE and the cache write, o before the residual add, gate and up into
 * their halves of gate_up before SiLU * up, down before the residual add. A step without adapter rows has no
 * slots (NULL) and costs one pointer test per projection.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"
#include "kv8.h"
#include "gemv_common.h"  /* exp8 */

typedef int (*gemv_fn)(const float *x, long ldx, const uint8_t *w, const uint16_t *d, const uint16_t *m, float *y,
                       long ldy, int rows, int n, int k_in, int threads, int vector);
typedef int (*attend_fn)(const float *q, long q_row_stride, const void *k_cache, const void *v_cache,
                         int kv_dtype, const int32_t *tables, int table_stride, const int32_t *table_of,
                         const int32_t *context_lens, float *out, long out_row_stride, int rows, int heads,
                         int kv_heads, int head_dim, int block_size, int window, float scale, int threads);

typedef int (*gemv8_fn)(const float *x, long ldx, const int8_t *w, const float *d, float *y, long ldy, int rows,
                        int n, int k_in, int threads, int vector);
typedef int (*moe_fn)(const void *layer, const float *x, int rows, float *out, int64_t *counts, int threads,
                      int vector);

typedef int (*lora_fn)(const float *x, long ldx, float *y, long ldy, int rows, const int32_t *slots, int n_slots,
                       const float *a, const float *b, int rank, int in, int out, int threads, int vector);

enum { LQ, LK, LV, LO, LGATE, LUP, LDOWN, LORA_MODULES };  /* fleetllm/lora/tables.py's MODULES, in order */

/* One layer's LoRA tables per projection: a [n_slots, rank, in], b [n_slots, out, rank]; NULL: not adapted. */
typedef struct { const float *a[LORA_MODULES], *b[LORA_MODULES]; } LoraLayer;

/* blocked Q4_1 (see q4_int_gemm.c); in a Q8_0 layer `packed` points to int8 levels and `d` to fp32 scales */
typedef struct { const void *packed; const void *d, *m; } Q4;

typedef struct {
    const float *norm1, *norm2;  /* input and post-attention RMSNorm weights [hidden] */
    Q4 qkv, o, gate_up, down;    /* gate_up and down unused in a layer with experts */
    int q8;                      /* the linears are Q8_0 (gemv8), not Q4_1 (gemv) */
    const float *q_norm, *k_norm;  /* per-head RMSNorm weights [head_dim] (NULL: none) */
    const void *moe;             /* the layer's experts (moe_experts.c's MoeLayer; NULL: a dense MLP) */
} Layer;

typedef struct {
    const Layer *layers;
    int n_layers, hidden, heads, kv_heads, head_dim, inter, block_size, kv_dtype;
    float eps, scale;
    const float *cos, *sin;  /* RoPE tables [positions, head_dim] */
    gemv_fn gemv;
    attend_fn attend;
    lora_fn lora;  /* lora.c's lora_apply (NULL when no step of this call has adapter rows) */
    gemv8_fn gemv8;  /* q8_gemv.c's q8_i16_gemv (NULL: no Q8_0 layer) */
    moe_fn moe;      /* moe_experts.c's moe_experts (NULL: no layer with experts) */
} Model;

typedef struct {
    float *h;  /* [rows, hidden] residual stream, updated in place */
    int rows, threads;
    const int64_t *positions, *slots;  /* per row: its position and the cache slot of its new K/V */
    const int32_t *tables, *lens;      /* block tables (table_stride apart); per row: context length */
    const int32_t *table_of;           /* per row: its table (NULL: row r reads table r) */
    int table_stride;
    void *const *k_caches, *const *v_caches;  /* per layer: [slots, kv_heads, head_dim] */
    float *scratch;  /* rows * (hidden + qkv width + heads * head_dim + 3 * inter) floats */
    const LoraLayer *lora;      /* per layer (NULL: no adapter rows in the step) */
    const int32_t *lora_slots;  /* per row: its adapter's slot, -1 for none */
    int lora_n_slots, lora_rank;
    int64_t *counts;  /* layer li's experts' row counts at counts + li * count_stride (NULL: not counted) */
    int count_stride;
    const volatile int *pause;  /* nonzero: stop after the layer being run (NULL: never; fleetllm/engine/step_pause.py) */
    int first_layer;            /* the layer to start from: 0, or where a paused call stopped */
    int next_layer;             /* out: n_layers when every layer ran, else the layer a paused call resumes at */
} Step;

#if FLEETLLM_X86
int decode_stack_isa(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") ? 2 : 0;
}

/* out = x * (1 / sqrt(mean(x^2) + eps)) * w, per row. */
__attribute__((target("avx2,fma")))
static void rms_norm(const float *x, const float *w, float eps, int rows, int n, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (long)r * n;
        float *o = out + (long)r * n;
        __m256 acc = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(xr + i), acc);
        float ss[8], s = 0.f;
        _mm256_storeu_ps(ss, acc);
        for (int j = 0; j < 8; j++) s += ss[j];
        for (; i < n; i++) s += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(s / n + eps);
        for (i = 0; i < n; i++) o[i] = xr[i] * inv * w[i];
    }
}

/* RoPE on `count` heads of one row, in place: v[i] * cos[i] + rotate_half(v)[i] * sin[i]. */
static void rope(float *v, int count, int dim, const float *cos, const float *sin) {
    const int half = dim / 2;
    float tmp[512];
    for (int hd = 0; hd < count; hd++) {
        float *x = v + (long)hd * dim;
        for (int i = 0; i < dim; i++) {
            const float rot = i < half ? -x[i + half] : x[i - half];
            const float a = x[i] * cos[i], b = rot * sin[i];
            tmp[i] = a + b;
        }
        memcpy(x, tmp, sizeof(float) * dim);
    }
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);  /* round to nearest even */
}

/* The fp8 byte of x (|x| within the format's range; `man` mantissa bits, exponent `bias`), rounded half to even
 * as PyTorch casts to float8_e4m3fn / float8_e5m2. */
static uint8_t to_fp8(float x, int man, int bias) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint8_t sign = (u >> 24) & 0x80;
    u &= 0x7fffffff;
    float a;
    memcpy(&a, &u, 4);
    if ((int)(u >> 23) - 127 < 1 - bias)  /* under the smallest normal: a multiple of the subnormal step */
        return sign | (uint8_t)nearbyintf(a * ldexpf(1.f, bias - 1 + man));
    const int shift = 23 - man;
    const uint32_t r = (u + (1u << (shift - 1)) - 1 + ((u >> shift) & 1)) >> shift;  /* exponent and mantissa */
    return sign | (uint8_t)((((int)(r >> man) - 127 + bias) << man) | (r & ((1u << man) - 1)));
}

/* One KV head's row of d values as 8-bit values, then one float16 scale (max |x| / qmax, stored times
 * 2^KV8_SHIFT) per KV8_GROUP of them: see kv8.quantize, whose bytes these are. */
__attribute__((target("f16c")))
static void store_8bit(uint8_t *o, int dtype, const float *x, int d) {
    const float qmax = dtype == KV_I8 ? 127.f : dtype == KV_E4M3 ? 448.f : 57344.f;
    const float unit = ldexpf(1.f, KV8_SHIFT(dtype));
    for (int g0 = 0; g0 < d; g0 += KV8_GROUP) {
        const int g1 = g0 + KV8_GROUP < d ? g0 + KV8_GROUP : d;
        float amax = 0.f;
        for (int i = g0; i < g1; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        const float want = amax / qmax * unit;
        uint16_t stored = _cvtss_sh(want < 65504.f ? want : 65504.f, _MM_FROUND_TO_NEAREST_INT);
        stored = stored ? stored : 0x3c00;  /* 1.0: an all-zero group (or one too small for a float16) */
        const float scale = _cvtsh_ss(stored) / unit;
        for (int i = g0; i < g1; i++) {
            float y = x[i] / scale;  /* a division, as PyTorch's x / scale */
            y = y > qmax ? qmax : y < -qmax ? -qmax : y;
            o[i] = dtype == KV_I8 ? (uint8_t)(int8_t)nearbyintf(y) : dtype == KV_E4M3 ? to_fp8(y, 3, 7) : to_fp8(y, 2, 15);
        }
        memcpy(o + d + KV8_SCALE_BYTES * (g0 / KV8_GROUP), &stored, KV8_SCALE_BYTES);
    }
}

/* The n = kv_heads * d values of one token's K (or V) into its slot. */
__attribute__((target("f16c")))
static void store_kv(void *cache, int dtype, long slot, const float *x, int n, int d) {
    if (dtype == KV_F32) {
        memcpy((float *)cache + slot * n, x, sizeof(float) * n);
    } else if (dtype == KV_F16) {
        uint16_t *o = (uint16_t *)cache + slot * n;
        for (int i = 0; i < n; i++) o[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
    } else if (dtype == KV_BF16) {
        uint16_t *o = (uint16_t *)cache + slot * n;
        for (int i = 0; i < n; i++) o[i] = to_bf16(x[i]);
    } else {
        const int heads = n / d;
        uint8_t *o = (uint8_t *)cache + slot * heads * KV8_ROW(d);
        for (int h = 0; h < heads; h++) store_8bit(o + h * KV8_ROW(d), dtype, x + h * d, d);
    }
}

/* act[r, i] = silu(gu[r, i]) * gu[r, inter + i]: gate and up are the two halves of the fused output. */
__attribute__((target("avx2,fma")))
static void silu_mul(const float *gu, int rows, int inter, float *act) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (long)r * 2 * inter, *u = g + inter;
        float *a = act + (long)r * inter;
        int i = 0;
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_xor_ps(x, sign))));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) a[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

static void add_into(float *h, const float *x, long n) {
    for (long i = 0; i < n; i++) h[i] += x[i];
}

/* Adds projection m's adapter updates of layer li's rows (x: its input, y: its output), when any adapts it. */
static int lora_add(const Model *md, const Step *st, int li, int m, const float *x, long ldx, float *y, long ldy,
                    int in, int out) {
    if (st->lora == NULL || st->lora[li].a[m] == NULL) return 0;
    return md->lora(x, ldx, y, ldy, st->rows, st->lora_slots, st->lora_n_slots, st->lora[li].a[m], st->lora[li].b[m],
                    st->lora_rank, in, out, st->threads, 1);
}

/* y = x @ W^T for `rows` rows through the layer's GEMV (Q4_1 or Q8_0). */
static int linear(const Model *md, const Layer *ly, const Q4 *w, const float *x, long ldx, float *y, long ldy, int rows,
                  int n, int k_in, int threads) {
    if (ly->q8) return md->gemv8(x, ldx, w->packed, w->d, y, ldy, rows, n, k_in, threads, 1);
    return md->gemv(x, ldx, w->packed, w->d, w->m, y, ldy, rows, n, k_in, threads, 1);
}

/* The MLP half of a layer: RMSNorm'd `xn` through the experts or the dense SwiGLU MLP, added to the residual. */
static int mlp(const Model *md, const Layer *ly, const Step *st, int li, float *xn, float *gu, float *act) {
    const int R = st->rows, H = md->hidden;
    int rc = 0;
    if (ly->moe != NULL) {
        int64_t *counts = st->counts == NULL ? NULL : st->counts + (long)li * st->count_stride;
        rc |= md->moe(ly->moe, xn, R, gu, counts, st->threads, 1);
        add_into(st->h, gu, (long)R * H);
        return rc;
    }
    rc |= linear(md, ly, &ly->gate_up, xn, H, gu, 2 * md->inter, R, 2 * md->inter, H, st->threads);
    rc |= lora_add(md, st, li, LGATE, xn, H, gu, 2 * md->inter, H, md->inter);
    rc |= lora_add(md, st, li, LUP, xn, H, gu + md->inter, 2 * md->inter, H, md->inter);
    silu_mul(gu, R, md->inter, act);
    rc |= linear(md, ly, &ly->down, act, md->inter, xn, H, R, H, md->inter, st->threads);
    rc |= lora_add(md, st, li, LDOWN, act, md->inter, xn, H, md->inter, H);
    add_into(st->h, xn, (long)R * H);
    return rc;
}

/* One layer for every row of the step; returns the first nonzero status of a GEMV or attention call. */
static int layer(const Model *md, const Layer *ly, const Step *st, int li, float *xn, float *qkv, float *attn,
                 float *gu, float *act) {
    const int R = st->rows, H = md->hidden, D = md->head_dim, kvw = md->kv_heads * D;
    const int qw = md->heads * D, width = qw + 2 * kvw;
    int rc = 0;
    rms_norm(st->h, ly->norm1, md->eps, R, H, xn);
    rc |= linear(md, ly, &ly->qkv, xn, H, qkv, width, R, width, H, st->threads);
    rc |= lora_add(md, st, li, LQ, xn, H, qkv, width, H, qw);
    rc |= lora_add(md, st, li, LK, xn, H, qkv + qw, width, H, kvw);
    rc |= lora_add(md, st, li, LV, xn, H, qkv + qw + kvw, width, H, kvw);
    for (int r = 0; r < R; r++) {
        float *row = qkv + (long)r * width;
        const float *c = md->cos + st->positions[r] * D, *s = md->sin + st->positions[r] * D;
        if (ly->q_norm != NULL) {  /* Qwen3: each q and k head RMSNorm'd before RoPE */
            rms_norm(row, ly->q_norm, md->eps, md->heads, D, row);
            rms_norm(row + qw, ly->k_norm, md->eps, md->kv_heads, D, row + qw);
        }
        rope(row, md->heads + md->kv_heads, D, c, s);  /* q heads, then the k heads right after them */
        store_kv(st->k_caches[li], md->kv_dtype, st->slots[r], row + qw, kvw, D);
        store_kv(st->v_caches[li], md->kv_dtype, st->slots[r], row + qw + kvw, kvw, D);
    }
    rc |= md->attend(qkv, width, st->k_caches[li], st->v_caches[li], md->kv_dtype, st->tables, st->table_stride,
                     st->table_of, st->lens, attn, qw, R, md->heads, md->kv_heads, D, md->block_size, 0, md->scale, st->threads);
    rc |= linear(md, ly, &ly->o, attn, qw, xn, H, R, H, qw, st->threads);
    rc |= lora_add(md, st, li, LO, attn, qw, xn, H, qw, H);
    add_into(st->h, xn, (long)R * H);
    rms_norm(st->h, ly->norm2, md->eps, R, H, xn);
    rc |= mlp(md, ly, st, li, xn, gu, act);
    return rc;
}

/* Rows of K (or V) stored as a step stores them: row r's n = kv_heads * d values into slot slots[r]. The step
 * calls store_kv itself; this entry point lets tests hold its bytes against kv8.quantize's. */
void decode_stack_store(void *cache, int dtype, const int64_t *slots, const float *x, int rows, int n, int d) {
    for (int r = 0; r < rows; r++) store_kv(cache, dtype, slots[r], x + (long)r * n, n, d);
}

/* The model's layers over the step's rows, from st->first_layer on; stops early, after a layer, when *st->pause
 * is set (another thread asks for the core: a more urgent request's first token), leaving in st->next_layer the
 * layer to resume at: the state between two layers is the residual stream st->h alone, so a call resumed there
 * computes what one uninterrupted call computes. Returns 0, or nonzero when a kernel call failed. */
int decode_stack(const Model *md, Step *st) {
    const int R = st->rows, D = md->head_dim;
    if (D > 512 || D % 2) return -2;
    float *xn = st->scratch, *qkv = xn + (long)R * md->hidden;
    float *attn = qkv + (long)R * (md->heads + 2 * md->kv_heads) * D, *gu = attn + (long)R * md->heads * D;
    float *act = gu + (long)R * 2 * md->inter;
    for (int li = st->first_layer; li < md->n_layers; li++) {
        const int rc = layer(md, md->layers + li, st, li, xn, qkv, attn, gu, act);
        if (rc) return rc;
        if (st->pause != NULL && *st->pause && li + 1 < md->n_layers) {
            st->next_layer = li + 1;
            return 0;
        }
    }
    st->next_layer = md->n_layers;
    return 0;
}

#else  /* not x86: no vector path, so no kernel (the callers keep their PyTorch paths) */
int decode_stack_isa(void) {
    return 0;
}
int decode_stack(const Model *md, Step *st) {
    return -2;
}
void decode_stack_store(void *cache, int dtype, const int64_t *slots, const float *x, int rows, int n, int d) {
}
#endif  /* FLEETLLM_X86 */
