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

#include <omp.h>

#include "cpu_kernels.h"

// The layout of kstep_proj and kstep_layer (cpu_kernels.h) that cpu_decode.py compares with its
// ctypes mirrors at load: a field added, moved or retyped on one side only disables the C block
// instead of handing it misplaced pointers.
#define FIELD(type, field) (long)offsetof(type, field), (long)sizeof(((type *)0)->field)
static const long layout[] = {
    sizeof(kstep_proj), FIELD(kstep_proj, weight), FIELD(kstep_proj, scales), FIELD(kstep_proj, low),
    FIELD(kstep_proj, bias),
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

// A stage's input in the forms its parts read: x itself (float32 weights), its int16 codes per block
// (int8 and int4 weights), and those in the int4 rows' order with each group's sum (int4 weights).
typedef struct {
    const float *x;
    int16_t *xq, *xq4;
    float *xscale, *xsum;
} stage_input;

// Makes the forms of x (in wide) the parts need (one thread).
static void prepare_input(const kstep_proj *parts, int n, const float *x, long in, stage_input *s) {
    int codes = 0, int4 = 0;
    for (int p = 0; p < n; p++) {
        codes |= parts[p].scales != NULL;
        int4 |= parts[p].low != NULL;
    }
    s->x = x;
    if (codes) kstep_quantize_i16(x, in, s->xq, s->xscale);
    if (int4) kstep_int4_x(s->xq, x, in, s->xq4, s->xsum);
}

// The rows of one stage's parts (outputs one after another in y) from its input (in wide), this
// thread's share: the parts' groups of GROUP rows, split evenly over the team. Each row's sum is the
// GEMVs' own (cpu_kernels.h), so the split never changes a bit.
static void project_share(const kstep_proj *parts, int n, const stage_input *s, long in, float *y) {
    long units = 0, groups4 = in / I4GROUP;
    for (int p = 0; p < n; p++) units += (parts[p].out + GROUP - 1) / GROUP;
    int t = omp_get_thread_num(), team = omp_get_num_threads();
    long lo = units * t / team, hi = units * (t + 1) / team, base = 0;
    for (int p = 0; p < n && base < hi; p++) {
        const kstep_proj *q = &parts[p];
        long groups = (q->out + GROUP - 1) / GROUP, first = lo > base ? lo - base : 0;
        long last = hi - base < groups ? hi - base : groups;
        for (long g = first; g < last; g++) {
            long o = g * GROUP, rows = q->out - o < GROUP ? q->out - o : GROUP;
            if (q->low) {
                for (long k = o; k < o + rows; k++) {
                    float v = kstep_dot_i4((const uint8_t *)q->weight + k * in / 2, q->scales + k * groups4,
                                           q->low + k * groups4, s->xq4, s->xscale, s->xsum, in);
                    y[k] = v + (q->bias ? q->bias[k] : 0.0f);
                }
            } else if (q->scales) {
                for (long k = o; k < o + rows; k++) {
                    float v = kstep_dot_i8((const int8_t *)q->weight + k * in, s->xq, s->xscale, s->x, in);
                    y[k] = v * q->scales[k] + (q->bias ? q->bias[k] : 0.0f);
                }
            } else {
                float sums[GROUP];
                kstep_dot_f32((const float *)q->weight + o * in, rows, in, s->x, sums);
                for (long k = 0; k < rows; k++) y[o + k] = sums[k] + (q->bias ? q->bias[o + k] : 0.0f);
            }
        }
        base += groups;
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

// x (dim) -> x through layers[0..n) for the token at cache slot `slot`, each attending to slots
// [0, length) of its cache (k_caches[l], v_caches[l]: (kv_heads, cache_slots[l], hd) with each head's
// slots contiguous); the token's keys and values are written there first. With `slots` (a page table's
// physical slot of each logical one, at least `length` of them), logical slot j is row slots[j]: the
// pages need not be in a run. cos, sin: the token's rotary rows (rotary_width).
//
// One OpenMP team for all the layers, which splits each stage's rows and the attention's heads and
// meets at a barrier between stages (a fork and join per GEMV cost a small model 20% of its step); the
// few-KB steps between (norms, rotary, the cache write, SiLU, rounding x to int16) run on one thread.
void kstep_decode_layers(const kstep_layer *layers, long n, float *x, const float *cos_, const float *sin_,
                         float *const *k_caches, float *const *v_caches, const long *cache_slots, const long *slots,
                         long slot, long length, int threads) {
    long most = 0, score_room = 0;  // the widest vector any stage reads or writes, the attention's scores
    for (long l = 0; l < n; l++) {
        const kstep_layer *L = &layers[l];
        long widths[] = {L->dim, (L->heads + 2 * L->kv_heads) * L->head_dim, L->heads * L->head_dim, 2 * L->ffn};
        for (int i = 0; i < 4; i++) most = widths[i] > most ? widths[i] : most;
        score_room = L->heads * length > score_room ? L->heads * length : score_room;
    }
    float *buf = malloc(sizeof(float) * (6 * most + score_room + most / QBLOCK + 1 + most / I4GROUP));
    int16_t *codes = malloc(sizeof(int16_t) * 2 * most + 64);
    float *h = buf, *x1 = h + most, *qkv = x1 + most, *att = qkv + most, *gu = att + most, *o = gu + most;
    float *scores = o + most;
    stage_input in = {NULL, codes, codes + most + 16, scores + score_room, scores + score_room + most / QBLOCK + 1};
    long row = slots ? slots[slot] : slot;
#pragma omp parallel num_threads(threads)
    for (long l = 0; l < n; l++) {
        const kstep_layer *L = &layers[l];
        long d = L->dim, H = L->heads, Hkv = L->kv_heads, hd = L->head_dim, ffn = L->ffn, group = H / Hkv;
        const kstep_proj *qkv_parts = L->proj, *o_proj = qkv_parts + L->qkv_parts, *gate_up = o_proj + 1;
        const kstep_proj *down = gate_up + L->gate_up_parts;
        float *q = qkv, *k = qkv + H * hd, *v = k + Hkv * hd, *k_cache = k_caches[l], *v_cache = v_caches[l];
#pragma omp single
        {
            kstep_rms_norm_f32(x, NULL, NULL, L->attn_norm, h, 1, d, L->norm_eps);
            prepare_input(qkv_parts, L->qkv_parts, h, d, &in);
        }
        project_share(qkv_parts, L->qkv_parts, &in, d, qkv);
#pragma omp barrier
#pragma omp single
        {
            if (L->q_norm) {  // Qwen3's RMSNorm over each query and key head, in place
                kstep_rms_norm_f32(q, NULL, NULL, L->q_norm, q, H, hd, L->qk_norm_eps);
                kstep_rms_norm_f32(k, NULL, NULL, L->k_norm, k, Hkv, hd, L->qk_norm_eps);
            }
            for (long i = 0; i < H + Hkv; i++) rotate(qkv + i * hd, cos_, sin_, L->rotary_width);  // queries, keys
            for (long g = 0; g < Hkv; g++) {
                memcpy(k_cache + (g * cache_slots[l] + row) * hd, k + g * hd, sizeof(float) * hd);
                memcpy(v_cache + (g * cache_slots[l] + row) * hd, v + g * hd, sizeof(float) * hd);
            }
        }
        float scale = 1.0f / sqrtf((float)hd);
#pragma omp for schedule(static)
        for (long i = 0; i < H; i++) {
            long g = i / group;
            attend_head(q + i * hd, k_cache + g * cache_slots[l] * hd, v_cache + g * cache_slots[l] * hd, slots,
                        length, hd, scale, scores + i * length, att + i * hd);
        }
#pragma omp single
        prepare_input(o_proj, 1, att, H * hd, &in);
        project_share(o_proj, 1, &in, H * hd, o);
#pragma omp barrier
#pragma omp single
        {
            kstep_rms_norm_f32(x, o, x1, L->mlp_norm, h, 1, d, L->norm_eps);  // x1 = x + attention, h = its norm
            prepare_input(gate_up, L->gate_up_parts, h, d, &in);
        }
        project_share(gate_up, L->gate_up_parts, &in, d, gu);
#pragma omp barrier
#pragma omp for schedule(static)
        for (long i = 0; i < ffn; i++) {  // silu(gate) * up, each rounded as torch's two ops
            float gate = gu[i], act = gate / (1.0f + expf(-gate));
            gu[i] = act * gu[ffn + i];
        }
#pragma omp single
        prepare_input(down, 1, gu, ffn, &in);
        project_share(down, 1, &in, ffn, o);
#pragma omp barrier
#pragma omp single
        for (long i = 0; i < d; i++) x[i] = x1[i] + o[i];
    }
    free(codes);
    free(buf);
}
