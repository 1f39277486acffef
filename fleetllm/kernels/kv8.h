/* KV cache dtypes as the C kernels number them, and the 8-bit rows' layout (see fleetllm/kernels/kv8.py).
 *
 * An 8-bit (int8, fp8 e4m3, fp8 e5m2) row of one (token, KV head) holds its head_dim values in 8 bits, then one
 * float16 per KV8_GROUP channels (the last group may be shorter): the group's scale times 2^KV8_SHIFT(dtype), so
 * element i is value[i] * half(stored[i / KV8_GROUP]) * 2^-KV8_SHIFT. Per group rather than per row because keys
 * have outlier channels: a row-wide scale set by one of them rounds every other channel of the row coarsely. The
 * shift puts a stored scale near an eighth of its group's largest |value| (scale = max / qmax, qmax 127 ~ 2^7,
 * 448 ~ 2^9, 57344 ~ 2^16; shifts 4, 6, 13), where a float16 is normal for a largest |value| from about 5e-4 to
 * 4.6e5: an fp8 scale itself would be subnormal below 0.03 (e4m3) or 3.5 (e5m2). KV8_GROUP is 8: an AVX2 vector
 * of a row is one group, an AVX-512 one two. Keep these equal to kv8.GROUP, kv8.SCALE_BYTES and kv8.SHIFT. */
#ifndef FLEETLLM_KV8_H
#define FLEETLLM_KV8_H

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3, KV_E4M3 = 4, KV_E5M2 = 5 };
#define IS_8BIT(dt) ((dt) >= KV_I8)

#define KV8_GROUP 8
#define KV8_SCALE_BYTES 2  /* a float16 */
#define KV8_SCALES(d) (((d) + KV8_GROUP - 1) / KV8_GROUP)
#define KV8_ROW(d) ((d) + KV8_SCALE_BYTES * KV8_SCALES(d))  /* bytes of an 8-bit row */
#define KV8_SHIFT(dt) ((dt) == KV_I8 ? 4 : (dt) == KV_E4M3 ? 6 : 13)

/* What a reader multiplies a stored scale by: 2^-KV8_SHIFT, times 256 for e4m3 (paged_attention.c and
 * prefill_attention.c widen an e4m3 byte as an fp16 of value / 256). Powers of two: the products are exact. */
static inline float kv8_read_unit(int dt) {
    return (dt == KV_E4M3 ? 256.f : 1.f) / (float)(1 << KV8_SHIFT(dt));
}

#endif
