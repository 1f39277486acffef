/* KV cache dtypes as the C kernels number them, and the 8-bit rows' layout (see fleetllm/kernels/kv8.py).
 *
 * An 8-bit (int8, fp8 e4m3, fp8 e5m2) row of one (token, KV head) holds its head_dim values in 8 bits, then one
 * float32 scale per KV8_GROUP channels (the last group may be shorter): element i is value[i] * scale[i / KV8_GROUP].
 * Per group rather than per row because keys have outlier channels: a row-wide scale set by one of them rounds
 * every other channel of the row coarsely. KV8_GROUP is a multiple of 8 and 16, so an AVX2 or AVX-512 vector of
 * a row never straddles two groups. Keep it equal to kv8.GROUP. */
#ifndef FLEETLLM_KV8_H
#define FLEETLLM_KV8_H

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3, KV_E4M3 = 4, KV_E5M2 = 5 };
#define IS_8BIT(dt) ((dt) >= KV_I8)

#define KV8_GROUP 16
#define KV8_SCALES(d) (((d) + KV8_GROUP - 1) / KV8_GROUP)
#define KV8_ROW(d) ((d) + 4 * KV8_SCALES(d))  /* bytes of an 8-bit row */

#endif
