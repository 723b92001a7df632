// One transformer block (kstep/models/transformer.py's Block: pre-norm attention over a KV cache,
// then a pre-norm SwiGLU) for one token in float32, in one call: a decode step's layer, built into
// the same library as cpu_kernels.c and driven by cpu_decode.py.
//
// Why: on a 2-core CPU the weights' GEMVs take ~85% of a 0.5B model's step, and the rest is about
// 20 small torch ops per layer, each 10-40 us right after a GEMV has streamed the weights through the
// caches (the dispatcher's and the interpreter's code and data are evicted: a torch.empty costs 1.4 us
// warm and 11 us there). Here those steps are a few loops over a few KB.
//
// The same operations and roundings as the torch path, up to the order of the sums in the norms and
// the attention (its softmax uses libm's expf, torch a vectorized exp): the GEMVs are cpu_kernels.c's,
// rotary is x * cos + rotated * sin with the products rounded before the sum, as torch's three ops
// (cpu_kernels.py builds this file with -ffp-contract=off).
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

// The layout of kstep_proj and kstep_layer (cpu_kernels.h) that cpu_decode.py compares with its
// ctypes mirrors at load: a field added, moved or retyped on one side only disables the C block
// instead of handing it misplaced pointers.
#define FIELD(type, field) (long)offsetof(type, field), (long)sizeof(((type *)0)->field)
static const long layout[] = {
    sizeof(kstep_proj), FIELD(kstep_proj, weight), FIELD(kstep_proj, scales), FIELD(kstep_proj, bias),
    FIELD(kstep_proj, out),
    sizeof(kstep_layer), FIELD(kstep_layer, dim), FIELD(kstep_layer, heads), FIELD(kstep_layer, kv_heads),
    FIELD(kstep_layer, head_dim), FIELD(kstep_layer, rotary_width), FIELD(kstep_layer, ffn),
    FIELD(kstep_layer, norm_eps), FIELD(kstep_layer, qk_norm_eps), FIELD(kstep_layer, attn_norm),
    FIELD(kstep_layer, mlp_norm), FIELD(kstep_layer, q_norm), FIELD(kstep_layer, k_norm),
    FIELD(kstep_layer, qkv_parts), FIELD(kstep_layer, gate_up_parts), FIELD(kstep_layer, proj),
};

long kstep_decode_layout(long *out, long n) {
    long count = sizeof(layout) / sizeof(layout[0]);
    for (long i = 0; i < n && i < count; i++) out[i] = layout[i];
    return count;
}

// The parts' outputs one after another in y, each from x (in wide).
static void project(const kstep_proj *parts, int n, const float *x, long in, float *y, int threads) {
    for (int p = 0; p < n; p++) {
        const kstep_proj *q = &parts[p];
        if (q->scales)
            kstep_gemv_i8(x, 1, q->weight, q->scales, q->bias, y, q->out, in, threads);
        else
            kstep_gemv_f32(x, 1, q->weight, q->bias, y, q->out, in, threads);
        y += q->out;
    }
}

// Rotary in the half-split layout over the first `width` dims (apply_rotary): x * cos + rotated * sin,
// rotated = (-x2, x1).
static void rotate(float *v, const float *cos_, const float *sin_, long width) {
    long half = width / 2;
    float tmp[width];
    for (long i = 0; i < width; i++) {
        float other = i < half ? -v[i + half] : v[i - half];
        float a = v[i] * cos_[i], b = other * sin_[i];
        tmp[i] = a + b;
    }
    memcpy(v, tmp, sizeof(float) * width);
}

static inline float dot(const float *a, const float *b, long n) {
    __m256 s = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float r = hsum(s);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

// out (hd) = softmax(q . k_j * scale over the keys j < length) . v_j, for one query head against its
// key/value head (k, v: that head's (S_max, hd) rows in the cache; key j in row slots[j], or row j
// when slots is NULL).
static void attend_head(const float *q, const float *k, const float *v, const long *slots, long length, long hd,
                        float scale, float *scores, float *out) {
    float top = -INFINITY;
    for (long j = 0; j < length; j++) {
        scores[j] = dot(q, k + (slots ? slots[j] : j) * hd, hd) * scale;
        if (scores[j] > top) top = scores[j];
    }
    float total = 0.0f;
    for (long j = 0; j < length; j++) {
        scores[j] = expf(scores[j] - top);
        total += scores[j];
    }
    for (long i = 0; i < hd; i++) out[i] = 0.0f;
    for (long j = 0; j < length; j++) {
        const float *vj = v + (slots ? slots[j] : j) * hd;
        float p = scores[j] / total;
        for (long i = 0; i < hd; i++) out[i] += p * vj[i];
    }
}

// x (dim) -> y (dim) through the block for the token at cache slot `slot`, attending to slots
// [0, length) of this layer's cache (k_cache, v_cache: (kv_heads, S_max, hd), contiguous); its keys and
// values are written there first. With `slots` (a page table's physical slot of each logical one, at
// least `length` of them), logical slot j is row slots[j] of the cache: the pages need not be in a
// run. cos, sin: the token's rotary rows (rotary_width).
void kstep_decode_layer(const kstep_layer *L, const float *x, float *y, const float *cos_, const float *sin_,
                        float *k_cache, float *v_cache, long cache_slots, const long *slots, long slot, long length,
                        int threads) {
    long d = L->dim, H = L->heads, Hkv = L->kv_heads, hd = L->head_dim, ffn = L->ffn;
    long qkv_width = (H + 2 * Hkv) * hd;
    float *buf = malloc(sizeof(float) * (2 * d + qkv_width + H * hd + 2 * ffn + d + H * length));
    float *h = buf, *x1 = h + d, *qkv = x1 + d, *att = qkv + qkv_width, *gu = att + H * hd, *o = gu + 2 * ffn;
    float *scores = o + d;

    kstep_rms_norm_f32(x, NULL, NULL, L->attn_norm, h, 1, d, L->norm_eps);
    project(L->proj, L->qkv_parts, h, d, qkv, threads);
    float *q = qkv, *k = qkv + H * hd, *v = k + Hkv * hd;
    if (L->q_norm) {  // Qwen3's RMSNorm over each query and key head, in place
        kstep_rms_norm_f32(q, NULL, NULL, L->q_norm, q, H, hd, L->qk_norm_eps);
        kstep_rms_norm_f32(k, NULL, NULL, L->k_norm, k, Hkv, hd, L->qk_norm_eps);
    }
    for (long i = 0; i < H + Hkv; i++) rotate(qkv + i * hd, cos_, sin_, L->rotary_width);  // queries, then keys
    long row = slots ? slots[slot] : slot;
    for (long g = 0; g < Hkv; g++) {
        memcpy(k_cache + (g * cache_slots + row) * hd, k + g * hd, sizeof(float) * hd);
        memcpy(v_cache + (g * cache_slots + row) * hd, v + g * hd, sizeof(float) * hd);
    }
    float scale = 1.0f / sqrtf((float)hd);
    long group = H / Hkv;
#pragma omp parallel for num_threads(threads) schedule(static) if (H * length * hd > 65536)
    for (long i = 0; i < H; i++) {
        long g = i / group;
        attend_head(q + i * hd, k_cache + g * cache_slots * hd, v_cache + g * cache_slots * hd, slots, length, hd,
                    scale, scores + i * length, att + i * hd);
    }
    const kstep_proj *o_proj = &L->proj[L->qkv_parts];
    project(o_proj, 1, att, H * hd, o, threads);
    kstep_rms_norm_f32(x, o, x1, L->mlp_norm, h, 1, d, L->norm_eps);  // x1 = x + attention, h = its norm
    project(o_proj + 1, L->gate_up_parts, h, d, gu, threads);
    for (long i = 0; i < ffn; i++) {  // silu(gate) * up, each rounded as torch's two ops
        float g = gu[i], act = g / (1.0f + expf(-g));
        gu[i] = act * gu[ffn + i];
    }
    project(o_proj + 1 + L->gate_up_parts, 1, gu, ffn, o, threads);
    for (long i = 0; i < d; i++) y[i] = x1[i] + o[i];
    free(buf);
}
