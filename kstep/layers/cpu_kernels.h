// What cpu_kernels.c shares with cpu_decode.c (one library, built by cpu_kernels.py).
#ifndef KSTEP_CPU_KERNELS_H
#define KSTEP_CPU_KERNELS_H
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void kstep_gemv_f32(const float *x, long m, const float *w, const float *bias, float *y, long out, long in,
                    int threads);
void kstep_gemv_i8(const float *x, long m, const int8_t *w, const float *scales, const float *bias, float *y,
                   long out, long in, int threads);
// y = RMSNorm(x + delta) over m rows of dim (delta NULL: of x; else x + delta also into sum); y may be x
void kstep_rms_norm_f32(const float *x, const float *delta, float *sum, const float *weight, float *y, long m,
                        long dim, float eps);
#endif
