// The exact draw's random stream (kstep/decoding/exact_draw.py): torch's CPU generator, a 32-bit
// Mersenne Twister, continued here on the bytes of its get_state() (torch's own layout: `left` at
// byte 8, `next` at 16, the 624 words as 64-bit slots from 24), one float64 uniform per element as
// torch's uniform_ makes it ((first word << 32 | second word), its low 53 bits times 2^-53). torch
// draws them one element at a time through a generic loop; here the same words come about 4x
// faster, and the draw itself follows in the same loop (no float64 copy of the probabilities, no
// second pass). exact_draw.py checks once per process that this equals torch's multinomial (ids and
// generator state) and uses torch otherwise.
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
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((v & 1u) ? 0x9908b0dfu : 0u);
}

static void mt_refill(mt_state *mt) {
    uint32_t *p = mt->s;
    mt->left = MT_N;
    mt->next = 0;
    for (int j = MT_N - MT_M + 1; --j; p++) *p = p[MT_M] ^ twist(p[0], p[1]);
    for (int j = MT_M; --j; p++) *p = p[MT_M - MT_N] ^ twist(p[0], p[1]);
    *p = p[MT_M - MT_N] ^ twist(p[0], mt->s[0]);
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

// One draw per row, as torch.multinomial(probs, 1): u as torch's float64 uniform_ makes it (its words:
// first << 32 | second, the low 53 bits times 2^-53), q = float(-log1p(-u)) as its exponential_
// rounds it, the winner the first index of the largest float p / q. p / u bounds p / q from above,
// so a token's exact ratio is computed only when its bound reaches the best exact ratio so far (less
// a margin for the roundings): a few tokens a row. The generator's bytes are advanced in place;
// returns how many u were 0 (the caller then replays torch's own draw: a ratio of infinity), or -1
// for a state it does not recognise.
long kstep_draw(uint8_t *state, const float *probs, long rows, long width, long *out) {
    mt_state mt;
    mt_load(state, &mt);
    if (mt.left < 1 || mt.left > MT_N + 1 || mt.next + (uint32_t)(mt.left - 1) > MT_N)
        return -1;  // not the layout this reads (another torch): the caller draws with torch
    uint32_t words[2 * CHUNK];
    const double margin = 1.0 - 4.0 * 1.1920928955078125e-07;  // float32's eps, as exact_draw.py's
    long zeros = 0;
    for (long r = 0; r < rows; r++) {
        const float *p = probs + r * width;
        float best = -1.0f;
        double floor = 0.0;  // best * margin: a token whose bound p / u is below it cannot win
        long at = 0;
        for (long c0 = 0; c0 < width; c0 += CHUNK) {
            long n = width - c0 < CHUNK ? width - c0 : CHUNK;
            mt_words(&mt, words, 2 * n);
            for (long i = 0; i < n; i++) {
                uint64_t bits = (((uint64_t)words[2 * i] << 32) | words[2 * i + 1]) & ((1ull << 53) - 1);
                double u = (double)bits * (1.0 / 9007199254740992.0);
                double pc = (double)p[c0 + i];
                if (pc < floor * u) continue;
                if (u == 0.0) {
                    zeros++;
                    continue;
                }
                float q = (float)(-log1p(-u));
                float ratio = p[c0 + i] / q;
                if (ratio > best) {
                    best = ratio;
                    at = c0 + i;
                    floor = (double)best * margin;
                }
            }
        }
        out[r] = at;
    }
    mt_store(state, &mt);
    return zeros;
}
