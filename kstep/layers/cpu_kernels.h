// The library's interface (cpu_kernels.c, cpu_draw.c and cpu_decode.c, built as one by cpu_kernels.py): every
// exported function and the structs passed across it, which cpu_decode.py mirrors with ctypes
// (checked at load through kstep_decode_layout; tests/test_cpu_interface.py checks that every
// non-static function of the two files is declared here, and the ctypes argtypes against these).
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

// ---- cpu_kernels.c ----
// y (m, out) = x (m, in) @ w (out, in).T (+ bias), float32
void kstep_gemv_f32(const float *x, long m, const float *w, const float *bias, float *y, long out, long in,
                    int threads);
// the same over bfloat16 x, w, bias and y (float32 sums)
void kstep_gemv_bf16(const uint16_t *x, long m, const uint16_t *w, const uint16_t *bias, uint16_t *y, long out,
                     long in, int threads);
// the same over int8 codes w with a float32 scale per row; x float32, rounded to int16 per block
void kstep_gemv_i8(const float *x, long m, const int8_t *w, const float *scales, const float *bias, float *y,
                   long out, long in, int threads);
// y = RMSNorm(x + delta) over m rows of dim (delta NULL: of x; else x + delta also into sum); y may be x
void kstep_rms_norm_f32(const float *x, const float *delta, float *sum, const float *weight, float *y, long m,
                        long dim, float eps);
// the same over bfloat16 rows, rounded where kstep's torch RMSNorm rounds
void kstep_rms_norm_bf16(const uint16_t *x, const uint16_t *delta, uint16_t *sum, const uint16_t *weight,
                         uint16_t *y, long m, long dim, float eps);
// int8 codes (rows, cols) and a float32 scale per row of a float32 weight
void kstep_quantize_i8(const float *w, long rows, long cols, int8_t *codes, float *scales, int threads);

// ---- cpu_draw.c ----
// out[r] = torch.multinomial(probs, 1)[r] for float32 probs (rows, width), torch's generator drawn from
// its get_state() bytes (advanced in place); returns how many of its uniforms were 0 (then replay torch's),
// -1 for a state it does not recognise
long kstep_draw(uint8_t *state, const float *probs, long rows, long width, long *out);
// out[r] = torch.argmax(x, -1)[r] for float32 x (rows, width): the first largest, or the first NaN
void kstep_argmax_rows(const float *x, long rows, long width, long *out, int threads);

// ---- cpu_decode.c ----
// One projection y[0:out] = x @ W.T (+ bias): float32 W (out, in), or int8 codes with a float32 scale
// per row (`scales` not NULL).
typedef struct {
    const void *weight;
    const float *scales;
    const float *bias;
    long out;
} kstep_proj;

#define MAX_PARTS 7

typedef struct {
    long dim, heads, kv_heads, head_dim, rotary_width, ffn;
    float norm_eps, qk_norm_eps;
    const float *attn_norm, *mlp_norm, *q_norm, *k_norm;  // q_norm, k_norm: NULL without them
    int qkv_parts, gate_up_parts;  // proj: the q/k/v parts (their rows in that order), o, gate/up parts, down
    kstep_proj proj[MAX_PARTS];
} kstep_layer;

// One transformer block for one token against a KV cache (see cpu_decode.c).
void kstep_decode_layer(const kstep_layer *L, const float *x, float *y, const float *cos_, const float *sin_,
                        float *k_cache, float *v_cache, long cache_slots, const long *slots, long slot, long length,
                        int threads);
// The two structs' layout as this compiler lays them out: writes up to n of sizeof(kstep_proj), its
// fields' (offset, size) pairs in declaration order, then the same for kstep_layer, into out; returns
// how many there are.
long kstep_decode_layout(long *out, long n);
#endif
