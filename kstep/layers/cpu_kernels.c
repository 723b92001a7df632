// kstep's CPU kernels for a CPU with AVX2 and FMA, built and loaded by cpu_kernels.py.
// The matrix-vector products: y (m, out) = x (m, in) @ w (out, in).T for the few rows of a decode
// step, where a pass is bound by reading the weights once. Each thread takes a contiguous range of
// weight rows and runs every x row against a row (float32: a group of four rows) while it is in
// cache, so the weights stream from memory once per call. Float32 reads a group's four rows side by
// side (four streams, as llama.cpp's tinyBLAS does): 4% faster over a 0.5B model's weights at one x
// row, 12% at four (interleaved medians of 10 rounds); 8 or 12 rows were level with 4 on an AVX-512
// Xeon and 16 7% slower, so GROUP stays 4. bf16 and int8, which are bound by their
// conversions more than by memory here, lost 25-34% that way: they read one row at a time, which
// keeps one long sequential stream per thread (their rows are short: 1.8 and 0.9 KB at width 896).
#include <stdlib.h>
#include <math.h>

#include "cpu_kernels.h"

static inline __m256 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    return _mm256_add_ps(_mm256_add_ps(a, b), _mm256_add_ps(c, d));
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch rounds
    union { float f; uint32_t u; } v = { f };
    if (isnan(f)) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);
}

void kstep_gemv_f32(const float *x, long m, const float *w, const float *bias, float *y, long out, long in,
                    int threads) {
    long groups = (out + GROUP - 1) / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long g = 0; g < groups; g++) {
        long o = g * GROUP, n = out - o < GROUP ? out - o : GROUP;
        for (long r = 0; r < m; r++) {
            float s[GROUP];
            kstep_dot_f32(w + o * in, n, in, x + r * in, s);
            for (long k = 0; k < n; k++) y[r * out + o + k] = s[k] + (bias ? bias[o + k] : 0.0f);
        }
    }
}

// ---- bfloat16 weights and activations, float32 sums, bfloat16 out ----
// 16 bf16 weights load as 8 32-bit words: shifted left they are the even elements as float32, masked
// the odd ones; x is laid out once per call in the same even/odd order, so the loop has no shuffles.
void kstep_gemv_bf16(const uint16_t *x, long m, const uint16_t *w, const uint16_t *bias, uint16_t *y, long out,
                     long in, int threads) {
    long vec = in & ~15L;
    float *xs = malloc(sizeof(float) * m * in);
    for (long r = 0; r < m; r++) {
        const uint16_t *xr = x + r * in;
        float *d = xs + r * in;
        for (long i = 0; i < vec; i += 16)
            for (int j = 0; j < 8; j++) {
                d[i + j] = bf16_to_f32(xr[i + 2 * j]);
                d[i + 8 + j] = bf16_to_f32(xr[i + 2 * j + 1]);
            }
        for (long i = vec; i < in; i++) d[i] = bf16_to_f32(xr[i]);
    }
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < out; o++) {
        const uint16_t *wr = w + o * in;
        for (long r = 0; r < m; r++) {
            const float *xr = xs + r * in;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            long i = 0;
            for (; i + 32 <= vec; i += 32) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(wr + i));
                __m256i u = _mm256_loadu_si256((const __m256i *)(wr + i + 16));
                a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_loadu_ps(xr + i), a0);
                a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), _mm256_loadu_ps(xr + i + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)), _mm256_loadu_ps(xr + i + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(u, high)), _mm256_loadu_ps(xr + i + 24), a3);
            }
            for (; i < vec; i += 16) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(wr + i));
                a0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), _mm256_loadu_ps(xr + i), a0);
                a1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), _mm256_loadu_ps(xr + i + 8), a1);
            }
            float s = hsum(sum4(a0, a1, a2, a3));
            for (; i < in; i++) s += bf16_to_f32(wr[i]) * xr[i];
            y[r * out + o] = f32_to_bf16(s + (bias ? bf16_to_f32(bias[o]) : 0.0f));
        }
    }
    free(xs);
}

// ---- int8 weights (one float scale per output row), float32 activations ----
// x rounded to int16 per block (kstep_quantize_i16), each row's sums in kstep_dot_i8 (cpu_kernels.h).
void kstep_gemv_i8(const float *x, long m, const int8_t *w, const float *scales, const float *bias, float *y,
                   long out, long in, int threads) {
    long nq = (in + QBLOCK - 1) / QBLOCK;
    int16_t *xq = malloc(sizeof(int16_t) * m * in + 32);
    float *xscale = malloc(sizeof(float) * m * nq);
    for (long r = 0; r < m; r++) kstep_quantize_i16(x + r * in, in, xq + r * in, xscale + r * nq);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < out; o++)
        for (long r = 0; r < m; r++) {
            float v = kstep_dot_i8(w + o * in, xq + r * in, xscale + r * nq, x + r * in, in);
            y[r * out + o] = v * scales[o] + (bias ? bias[o] : 0.0f);
        }
    free(xscale);
    free(xq);
}

// ---- int4 weights (Int4Linear's layout), float32 activations: x rounded to int16 as for int8, then
// laid out in the codes' order (kstep_int4_x), each row's sums in kstep_dot_i4 (cpu_kernels.h) ----
void kstep_gemv_i4(const float *x, long m, const uint8_t *w, const float *scale, const float *low, const float *bias,
                   float *y, long out, long in, int threads) {
    long nq = (in + QBLOCK - 1) / QBLOCK, groups = in / I4GROUP;
    int16_t *xq = malloc(sizeof(int16_t) * m * in + 32), *xq4 = malloc(sizeof(int16_t) * m * in + 32);
    float *xscale = malloc(sizeof(float) * m * nq), *xsum = malloc(sizeof(float) * m * groups);
    for (long r = 0; r < m; r++) {
        kstep_quantize_i16(x + r * in, in, xq + r * in, xscale + r * nq);
        kstep_int4_x(xq + r * in, x + r * in, in, xq4 + r * in, xsum + r * groups);
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long o = 0; o < out; o++)
        for (long r = 0; r < m; r++) {
            float v = kstep_dot_i4(w + o * in / 2, scale + o * groups, low + o * groups, xq4 + r * in,
                                   xscale + r * nq, xsum + r * groups, in);
            y[r * out + o] = v + (bias ? bias[o] : 0.0f);
        }
    free(xsum);
    free(xscale);
    free(xq4);
    free(xq);
}

// ---- RMSNorm of a decode step's few float32 rows: y = x / sqrt(mean(x^2) + eps) * weight ----
// With `delta`, x + delta first (the residual add before a norm), written to `sum`. One call instead
// of torch's two or three dispatches, which right after a GEMV has streamed the weights through the
// caches cost ~100 us each on this CPU (measured: a 0.5B model's 49 norms, 6 ms of a 115 ms step).
void kstep_rms_norm_f32(const float *x, const float *delta, float *sum, const float *weight, float *y, long m,
                        long dim, float eps) {
    for (long r = 0; r < m; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        if (delta) {
            const float *dr = delta + r * dim;
            float *sr = sum + r * dim;
            for (long i = 0; i < dim; i++) sr[i] = xr[i] + dr[i];
            xr = sr;
        }
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        long i = 0;
        for (; i + 16 <= dim; i += 16) {
            __m256 v = _mm256_loadu_ps(xr + i), u = _mm256_loadu_ps(xr + i + 8);
            a0 = _mm256_fmadd_ps(v, v, a0);
            a1 = _mm256_fmadd_ps(u, u, a1);
        }
        float ss = hsum(_mm256_add_ps(a0, a1));
        for (; i < dim; i++) ss += xr[i] * xr[i];
        float rstd = 1.0f / sqrtf(ss / (float)dim + eps);
        for (i = 0; i < dim; i++) yr[i] = xr[i] * rstd * weight[i];
    }
}

// ---- the same for bfloat16 rows, rounded where torch rounds: the sum x + delta to bf16, the
// statistics and the normalized row in float32, the row rounded to bf16 before the (bf16) weight
// multiply, whose product is rounded again (RMSNorm's bf16 path: weight * norm(x.float()).to(bf16)) ----
void kstep_rms_norm_bf16(const uint16_t *x, const uint16_t *delta, uint16_t *sum, const uint16_t *weight,
                         uint16_t *y, long m, long dim, float eps) {
    for (long r = 0; r < m; r++) {
        const uint16_t *xr = x + r * dim;
        uint16_t *yr = y + r * dim;
        if (delta) {
            const uint16_t *dr = delta + r * dim;
            uint16_t *sr = sum + r * dim;
            for (long i = 0; i < dim; i++) sr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
            xr = sr;
        }
        float ss = 0.0f;
        for (long i = 0; i < dim; i++) { float v = bf16_to_f32(xr[i]); ss += v * v; }
        float rstd = 1.0f / sqrtf(ss / (float)dim + eps);
        for (long i = 0; i < dim; i++)
            yr[i] = f32_to_bf16(bf16_to_f32(weight[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * rstd)));
    }
}

// ---- int8 quantization at load time, one pass per row: scale = max|w| / 127 (at least 1e-12),
// code = round-half-even(w / scale) clamped to [-127, 127]: the same float32 operations as
// Int8Linear's torch expression, so the same codes, in a tenth of its time (a 0.5B model: 2.9 s) ----
void kstep_quantize_i8(const float *w, long rows, long cols, int8_t *codes, float *scales, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *wr = w + r * cols;
        float amax = 0.0f;
        for (long i = 0; i < cols; i++) amax = fmaxf(amax, fabsf(wr[i]));
        float s = amax / 127.0f;
        if (s < 1e-12f) s = 1e-12f;
        scales[r] = s;
        for (long i = 0; i < cols; i++) {
            float q = nearbyintf(wr[i] / s);
            codes[r * cols + i] = (int8_t)(q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q));
        }
    }
}
