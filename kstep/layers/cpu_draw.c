// The exact draw's random stream (kstep/decoding/exact_draw.py): torch's CPU generator, a 32-bit
// Mersenne Twister, continued here on the bytes of its get_state() (torch's own layout: `left` at
// byte 8, `next` at 16, the 624 words as 64-bit slots from 24), one float64 uniform per element as
// torch's uniform_ makes it ((first word << 32 | second word), its low 53 bits times 2^-53). torch
// draws them one element at a time through a generic loop; here the same words come about 4x
// faster, and the draw itself follows in the same loop (no float64 copy of the probabilities, no
// second pass). exact_draw.py checks once per process that this equals torch's multinomial (ids and
// generator state) and uses torch otherwise.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu_kernels.h"

#define MT_N 624
#define MT_M 397

typedef struct {
    int32_t left;
    uint32_t next;
    uint32_t s[MT_N];
} mt_state;

static void mt_load(const uint8_t *bytes, mt_state *mt) {
    uint64_t next, word;
    memcpy(&mt->left, bytes + 8, 4);
    memcpy(&next, bytes + 16, 8);
    mt->next = (uint32_t)next;
    for (int i = 0; i < MT_N; i++) {
        memcpy(&word, bytes + 24 + 8 * i, 8);
        mt->s[i] = (uint32_t)word;
    }
}

static void mt_store(uint8_t *bytes, const mt_state *mt) {
    uint64_t next = mt->next, word;
    memcpy(bytes + 8, &mt->left, 4);
    memcpy(bytes + 16, &next, 8);
    for (int i = 0; i < MT_N; i++) {
        word = mt->s[i];
        memcpy(bytes + 24 + 8 * i, &word, 8);
    }
}

static inline uint32_t twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((0u - (v & 1u)) & 0x9908b0dfu);
}

// Written over indices (not a walking pointer) so the compiler vectorizes both loops: the first
// reads words 397 ahead, which it never writes; the second reads words written 227 earlier.
static void mt_refill(mt_state *mt) {
    uint32_t *s = mt->s;
    mt->left = MT_N;
    mt->next = 0;
    int i = 0;
    for (; i < MT_N - MT_M; i++) s[i] = s[i + MT_M] ^ twist(s[i], s[i + 1]);
    for (; i < MT_N - 1; i++) s[i] = s[i + MT_M - MT_N] ^ twist(s[i], s[i + 1]);
    s[MT_N - 1] = s[MT_M - 1] ^ twist(s[MT_N - 1], s[0]);
}

// n tempered words of the stream into out, as n calls of torch's engine would return them: a call
// refills the state when its `left` counts down to 0, then takes state[next++].
static void mt_words(mt_state *mt, uint32_t *out, long n) {
    while (n > 0) {
        if (mt->left == 1) {  // the next call refills, and takes word 0 (its left stays 624)
            mt_refill(mt);
            mt->left = MT_N + 1;
        }
        long k = mt->left - 1 < n ? mt->left - 1 : n;
        const uint32_t *s = mt->s + mt->next;
        for (long i = 0; i < k; i++) {
            uint32_t y = s[i];
            y ^= y >> 11;
            y ^= (y << 7) & 0x9d2c5680u;
            y ^= (y << 15) & 0xefc60000u;
            y ^= y >> 18;
            out[i] = y;
        }
        mt->next += (uint32_t)k;
        mt->left -= (int32_t)k;
        out += k;
        n -= k;
    }
}

#define CHUNK 1024  // uniforms per batch of words

typedef struct {
    float best;      // the best exact ratio so far
    double floor;    // best * margin: a token whose bound p / u is below it cannot win
    float floor32;   // floor, rounded down to a float32 with room to spare: the vector test's
    long at, zeros;
} race;

static const double MARGIN = 1.0 - 4.0 * 1.1920928955078125e-07;  // float32's eps, as exact_draw.py's

// One token of the race: u as torch's uniform_ makes it from its two words, its exact ratio where
// its bound reaches the floor.
static inline void consider(race *r, const uint32_t *two, const float *p, long index) {
    uint64_t bits = (((uint64_t)two[0] << 32) | two[1]) & ((1ull << 53) - 1);
    double u = (double)bits * (1.0 / 9007199254740992.0);
    double pc = (double)*p;
    if (pc < r->floor * u) return;
    if (u == 0.0) {
        r->zeros++;
        return;
    }
    float q = (float)(-log1p(-u));
    float ratio = *p / q;
    if (ratio > r->best) {
        r->best = ratio;
        r->at = index;
        r->floor = (double)ratio * MARGIN;
        r->floor32 = (float)(r->floor * (1.0 - 1e-6));
    }
}

// Whether none of 8 tokens can win, from their first words alone: u >= ulo = (first word's low 21
// bits) * 2^-21 (u's top bits), so p < floor32 * ulo (a float32 product) means p < floor * u.
static inline int none_can_win(const race *r, const uint32_t *words, const float *p) {
    __m256i a = _mm256_loadu_si256((const __m256i *)words);
    __m256i b = _mm256_loadu_si256((const __m256i *)(words + 8));
    __m256 firsts = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), _MM_SHUFFLE(2, 0, 2, 0));
    __m256i ordered = _mm256_castpd_si256(_mm256_permute4x64_pd(_mm256_castps_pd(firsts), 0xD8));
    __m256 ulo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(ordered, _mm256_set1_epi32(0x1fffff))),
                               _mm256_set1_ps(1.0f / 2097152.0f));
    __m256 below = _mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_mul_ps(ulo, _mm256_set1_ps(r->floor32)), _CMP_LT_OQ);
    return _mm256_movemask_ps(below) == 0xff;
}

// One draw per row, as torch.multinomial(probs, 1): u as torch's float64 uniform_ makes it (its words:
// first << 32 | second, the low 53 bits times 2^-53), q = float(-log1p(-u)) as its exponential_
// rounds it, the winner the first index of the largest float p / q. p / u bounds p / q from above,
// so a token's exact ratio is computed only when its bound reaches the best exact ratio so far (less
// a margin for the roundings): a few tokens a row; eight tokens at a time are ruled out together
// first (none_can_win). The generator's bytes are advanced in place; returns how many u were 0 (the
// caller then replays torch's own draw: a ratio of infinity), or -1 for a state it does not recognise.
long kstep_draw(uint8_t *state, const float *probs, long rows, long width, long *out) {
    mt_state mt;
    mt_load(state, &mt);
    if (mt.left < 1 || mt.left > MT_N + 1 || mt.next + (uint32_t)(mt.left - 1) > MT_N)
        return -1;  // not the layout this reads (another torch): the caller draws with torch
    uint32_t words[2 * CHUNK];
    long zeros = 0;
    for (long row = 0; row < rows; row++) {
        const float *p = probs + row * width;
        race r = {-1.0f, 0.0, 0.0f, 0, 0};
        for (long c0 = 0; c0 < width; c0 += CHUNK) {
            long n = width - c0 < CHUNK ? width - c0 : CHUNK, i = 0;
            mt_words(&mt, words, 2 * n);
            for (; i + 8 <= n; i += 8)
                if (!none_can_win(&r, words + 2 * i, p + c0 + i))
                    for (long k = i; k < i + 8; k++) consider(&r, words + 2 * k, p + c0 + k, c0 + k);
            for (; i < n; i++) consider(&r, words + 2 * i, p + c0 + i, c0 + i);
        }
        out[row] = r.at;
        zeros += r.zeros;
    }
    mt_store(state, &mt);
    return zeros;
}

// torch.argmax(x, -1) of each row of a (rows, width) float32 array: the first index of the largest
// value, the first NaN where there is one (torch's order puts NaN above every number). Exact: only
// comparisons.
void kstep_argmax_rows(const float *x, long rows, long width, long *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long row = 0; row < rows; row++) {
        const float *v = x + row * width;
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= width; i += 8) {
            __m256 y = _mm256_loadu_ps(v + i);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
            top = _mm256_max_ps(top, y);
        }
        float lanes[8], m = -INFINITY;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        _mm256_storeu_ps(lanes, top);
        for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
        for (; i < width; i++) {
            has_nan |= isnan(v[i]);
            m = v[i] > m ? v[i] : m;
        }
        long at = 0;
        for (long j = 0; j < width; j++)
            if (has_nan ? isnan(v[j]) : v[j] == m) {
                at = j;
                break;
            }
        out[row] = at;
    }
}
