// Internal helpers shared by the C core.
#pragma once

#include "dflash.h"
#include "dflash_format.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

// Tokens one block of the drafter drafts (dflash_format.h).
static inline int32_t dflash_max_draft(const struct dflash_drafter_info * hp) {
    return (int32_t) (DFLASH_MAX_DRAFT_EXPR);
}

// Write a one-line message into a caller's buffer (may be NULL).
static inline void dflash_seterr(char * err, size_t err_len, const char * fmt, ...) {
    if (!err || err_len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
}

static inline double dflash_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// xoshiro256** seeded through splitmix64: the rejection sampler's random numbers.
static inline uint64_t dflash_splitmix64(uint64_t * x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline void dflash_rng_seed(struct dflash_rng * r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = dflash_splitmix64(&seed);
}

static inline uint64_t dflash_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// Uniform in [0, 1) with 53 random bits.
static inline double dflash_rng_uniform(struct dflash_rng * r) {
    uint64_t * s = r->s;
    const uint64_t out = dflash_rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = dflash_rotl(s[3], 45);
    return (out >> 11) * 0x1.0p-53;
}
