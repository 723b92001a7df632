// The library's interface (cpu_kernels.c, cpu_draw.c and cpu_decode.c, built as one by cpu_kernels.py): every
// exported function and the structs passed across it, which cpu_decode.py mirrors with ctypes
// (checked at load through kstep_decode_layout; tests/test_cpu_interface.py checks that every
// non-static function of the two files is declared here, and the ctypes argtypes against these).
#ifndef KSTEP_CPU_KERNELS_H
#define KSTEP_CPU_KERNELS_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ---- the GEMVs' inner loops, shared by cpu_kernels.c's GEMVs and cpu_decode.c's layers: one copy of
// each sum, so a projection gives the same bits through either (static inline: not exported) ----
#define GROUP 4     // float32 weight rows read side by side
#define QBLOCK 256  // x elements rounded to int16 with one scale (int8 weights)

// The `n` (<= GROUP) float32 rows from w, `in` apart, against x: sums into s[0..n).
static inline void kstep_dot_f32(const float *w, long n, long in, const float *x, float *s) {
    const float *r[GROUP];
    for (int k = 0; k < GROUP; k++) r[k] = w + (k < n ? k : 0) * in;  // a short group repeats row 0, unused
    __m256 a[GROUP];
    for (int k = 0; k < GROUP; k++) a[k] = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= in; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        for (int k = 0; k < GROUP; k++) a[k] = _mm256_fmadd_ps(_mm256_loadu_ps(r[k] + i), xv, a[k]);
    }
    for (int k = 0; k < n; k++) {
        float t = hsum(a[k]);
        for (long j = i; j < in; j++) t += r[k][j] * x[j];
        s[k] = t;
    }
}

// x (in) rounded to int16 per block of QBLOCK (xscale: a scale each, max|x| / 32767, relative error under
// 2e-5 of the block's largest value): a weight then costs a sign extension and half a multiply-add of
// 16-bit pairs instead of two conversions to float. Vectorized, the same values as the scalar
// lrintf(x * (1 / scale)) (round to nearest even); max ignores NaNs as fmaxf does.
static inline void kstep_quantize_i16(const float *x, long in, int16_t *xq, float *xscale) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long lo = 0, q = 0; lo < in; lo += QBLOCK, q++) {
        long hi = lo + QBLOCK < in ? lo + QBLOCK : in, i = lo;
        __m256 m = _mm256_setzero_ps();
        for (; i + 8 <= hi; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), m);
        float lanes[8], amax = 0.0f;
        _mm256_storeu_ps(lanes, m);
        for (int k = 0; k < 8; k++) amax = fmaxf(amax, lanes[k]);
        for (; i < hi; i++) amax = fmaxf(amax, fabsf(x[i]));
        float s = amax > 0.0f ? amax / 32767.0f : 1.0f, inv = 1.0f / s;
        xscale[q] = s;
        __m256 vinv = _mm256_set1_ps(inv);
        for (i = lo; i + 8 <= hi; i += 8) {
            __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv));
            _mm_storeu_si128((__m128i *)(xq + i),
                             _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
        }
        for (; i < hi; i++) xq[i] = (int16_t)lrintf(x[i] * inv);
    }
}

static inline __m256i kstep_madd_i8_i16(const int8_t *w, const int16_t *x) {
    return _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)),
                             _mm256_loadu_si256((const __m256i *)x));
}

// One int8 row wr (in) against x (in; xq, xscale: its int16 form): int32 sums per block (no overflow:
// 127 * 32767 * QBLOCK / 8), scaled and summed in float32; the last in % 16 elements against x itself.
static inline float kstep_dot_i8(const int8_t *wr, const int16_t *xq, const float *xscale, const float *x, long in) {
    long vec = in & ~15L;
    __m256 acc = _mm256_setzero_ps();
    for (long q = 0, i = 0; i < vec; q++) {
        long hi = i + QBLOCK < vec ? i + QBLOCK : vec;
        __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
        for (; i + 64 <= hi; i += 64) {
            s0 = _mm256_add_epi32(s0, kstep_madd_i8_i16(wr + i, xq + i));
            s1 = _mm256_add_epi32(s1, kstep_madd_i8_i16(wr + i + 16, xq + i + 16));
            s2 = _mm256_add_epi32(s2, kstep_madd_i8_i16(wr + i + 32, xq + i + 32));
            s3 = _mm256_add_epi32(s3, kstep_madd_i8_i16(wr + i + 48, xq + i + 48));
        }
        for (; i < hi; i += 16) s0 = _mm256_add_epi32(s0, kstep_madd_i8_i16(wr + i, xq + i));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(s0, s1), _mm256_add_epi32(s2, s3));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(xscale[q]), acc);
    }
    float v = hsum(acc);
    for (long i = vec; i < in; i++) v += (float)wr[i] * x[i];
    return v;
}

// ---- int4 weights (Int4Linear): codes 0..15 two to a byte (an even element in the low nibble, the
// next odd one in the high), a float32 scale and low per group of I4GROUP along a row: w = code * scale + low ----
#define I4GROUP 32  // divides QBLOCK: a group's x shares one int16 scale

// x's int16 codes (kstep_quantize_i16) in the int4 rows' order: each group's 16 even elements, then its
// 16 odd ones; xsum: each group's float32 sum of x (the lows' term).
static inline void kstep_int4_x(const int16_t *xq, const float *x, long in, int16_t *xq4, float *xsum) {
    for (long g = 0; g < in / I4GROUP; g++) {
        const int16_t *src = xq + g * I4GROUP;
        int16_t *dst = xq4 + g * I4GROUP;
        float s = 0.0f;
        for (int k = 0; k < I4GROUP / 2; k++) {
            dst[k] = src[2 * k];
            dst[I4GROUP / 2 + k] = src[2 * k + 1];
        }
        for (int k = 0; k < I4GROUP; k++) s += x[g * I4GROUP + k];
        xsum[g] = s;
    }
}

// The int32 sums of one group's 32 codes (as 16 bytes: the even elements' low nibbles, the odd ones'
// high) against x's int16 codes in kstep_int4_x's order.
static inline __m256i kstep_group_i4(__m128i bytes, const int16_t *xg) {
    const __m128i nibble = _mm_set1_epi8(15);
    __m128i even = _mm_and_si128(bytes, nibble), odd = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    return _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_cvtepu8_epi16(even), _mm256_loadu_si256((const __m256i *)xg)),
        _mm256_madd_epi16(_mm256_cvtepu8_epi16(odd), _mm256_loadu_si256((const __m256i *)(xg + 16))));
}

// One int4 row (in / 2 bytes; in a multiple of I4GROUP) against x in kstep_int4_x's form: per group the
// codes' int32 sum against x's int16 codes times the group's scale, summed over x's block and times
// its scale; plus each group's low times its sum of x.
static inline float kstep_dot_i4(const uint8_t *wr, const float *scale, const float *low, const int16_t *xq4,
                                 const float *xscale, const float *xsum, long in) {
    const long per_block = QBLOCK / I4GROUP, groups = in / I4GROUP;
    __m256 acc = _mm256_setzero_ps(), lows = _mm256_setzero_ps();
    for (long g = 0; g < groups; g += per_block) {
        long end = g + per_block < groups ? g + per_block : groups, k = g;
        __m256 even = _mm256_setzero_ps(), odd = even;  // two chains of multiply-adds, not one
        for (; k + 2 <= end; k += 2) {  // two groups' 32 bytes at once
            __m256i v = _mm256_loadu_si256((const __m256i *)(wr + k * I4GROUP / 2));
            __m256i s0 = kstep_group_i4(_mm256_castsi256_si128(v), xq4 + k * I4GROUP);
            __m256i s1 = kstep_group_i4(_mm256_extracti128_si256(v, 1), xq4 + (k + 1) * I4GROUP);
            even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_broadcast_ss(scale + k), even);
            odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_broadcast_ss(scale + k + 1), odd);
        }
        if (k < end) {
            __m256i s0 = kstep_group_i4(_mm_loadu_si128((const __m128i *)(wr + k * I4GROUP / 2)), xq4 + k * I4GROUP);
            even = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_broadcast_ss(scale + k), even);
        }
        acc = _mm256_fmadd_ps(_mm256_add_ps(even, odd), _mm256_set1_ps(xscale[g / per_block]), acc);
    }
    long g = 0;
    for (; g + 8 <= groups; g += 8) lows = _mm256_fmadd_ps(_mm256_loadu_ps(low + g), _mm256_loadu_ps(xsum + g), lows);
    float rest = 0.0f;
    for (; g < groups; g++) rest += low[g] * xsum[g];
    return hsum(acc) + hsum(lows) + rest;
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
// the same over int4 codes w (out, in / 2) with a float32 scale and low per group of I4GROUP (in a multiple of it)
void kstep_gemv_i4(const float *x, long m, const uint8_t *w, const float *scale, const float *low, const float *bias,
                   float *y, long out, long in, int threads);
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
// One projection y[0:out] = x @ W.T (+ bias): float32 W (out, in); int8 codes with a float32 scale per
// row (`scales` not NULL, `low` NULL); or int4 codes with a scale and low per group (both not NULL).
typedef struct {
    const void *weight;
    const float *scales;
    const float *low;
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

// A run of transformer blocks for one token, each against its KV cache, x updated in place (see cpu_decode.c).
void kstep_decode_layers(const kstep_layer *layers, long n, float *x, const float *cos_, const float *sin_,
                         float *const *k_caches, float *const *v_caches, const long *cache_slots, const long *slots,
                         long slot, long length, int threads);
// The two structs' layout as this compiler lays them out: writes up to n of sizeof(kstep_proj), its
// fields' (offset, size) pairs in declaration order, then the same for kstep_layer, into out; returns
// how many there are.
long kstep_decode_layout(long *out, long n);
#endif
