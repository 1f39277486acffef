/* Prototype (issue 19 item 1b): a batch-1 int4 GEMV in plain C, to set against ATen's
 * _weight_int4pack_mm_for_cpu on SmolLM2-135M's shapes. Its own layout: row n, group g of 32 inputs is 16
 * bytes, low nibbles inputs 0-15 and high nibbles inputs 16-31; w = (q - 8) * scale + zero per (n, g). */
#include <stdint.h>
#include <immintrin.h>

__attribute__((target("avx2,fma")))
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma")))
void int4_gemv(const float *x, const uint8_t *w, const float *scale, const float *zero, float *y,
               int n_out, int k_in, int threads) {
    const int groups = k_in / 32;
    float xsum[groups];
    for (int g = 0; g < groups; g++) { float s = 0; for (int i = 0; i < 32; i++) s += x[32 * g + i]; xsum[g] = s; }
    const __m128i mask = _mm_set1_epi8(0x0f);
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < n_out; n++) {
        const uint8_t *row = w + (long)n * k_in / 2;
        float acc = 0.f;
        for (int g = 0; g < groups; g++) {
            __m128i b = _mm_loadu_si128((const __m128i *)(row + 16 * g));
            __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
            const float *xg = x + 32 * g;
            __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(xg));
            d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(xg + 8), d);
            d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(xg + 16), d);
            d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(xg + 24), d);
            const long sg = (long)n * groups + g;
            acc += scale[sg] * (hsum8(d) - 8.f * xsum[g]) + zero[sg] * xsum[g];
        }
        y[n] = acc;
    }
}
