/*
 * td_rng: the project's seedable pseudo-random generators (Blackman & Vigna), the same on
 * every machine, so equal seeds give equal runs: splitmix64 (one 64-bit state; also what
 * seeds xoshiro) and xoshiro256** (four words). Header-only: both are a few operations and
 * sit in loops (the sampler draws once per token, the synthesizer once per weight).
 */
#ifndef TD_RNG_H
#define TD_RNG_H

#include <stdint.h>

/* The next splitmix64 output; advances *x. */
static inline uint64_t td_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t td_rng_rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* The next xoshiro256** output; advances s (seed it with td_splitmix64, never all zero). */
static inline uint64_t td_xoshiro256ss(uint64_t s[4])
{
    uint64_t out = td_rng_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = td_rng_rotl(s[3], 45);
    return out;
}

#endif /* TD_RNG_H */
