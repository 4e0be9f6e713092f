/*
 * td_rate: a token bucket, for a request rate per key. Holds `burst` tokens, refilled at
 * `rate` a second; a request takes one or is told how long until there is one. Tokens are
 * counted in billionths (integers: no drift from adding fractions), the time is passed in
 * (pure: unit-testable, no clock read here). Caller-allocated, zeroed = full.
 */
#ifndef TD_RATE_H
#define TD_RATE_H

#include <stdbool.h>
#include <stdint.h>

#define TD_RATE_ONE 1000000000ll /* one token in the bucket's units */

typedef struct td_rate {
    int64_t tokens;  /* billionths of a token, as of last_ns */
    int64_t last_ns; /* when tokens was last brought up to date; 0 = never (full) */
} td_rate_t;

/*
 * Takes one token at now_ns of a bucket refilled at rate (> 0) a second up to burst (>= 1)
 * tokens: true when there was one; false, nothing taken, and *wait_ms_p (rounded up, >= 1)
 * until there will be. Time going backwards counts as none passing.
 */
static inline bool td_rate_take(td_rate_t *b, double rate, double burst, int64_t now_ns, int64_t *wait_ms_p)
{
    int64_t full = (int64_t)(burst * (double)TD_RATE_ONE);
    if (!b->last_ns) {
        b->tokens = full;
        b->last_ns = now_ns;
    } else if (now_ns > b->last_ns) {
        double add = (double)(now_ns - b->last_ns) * rate; /* ns x tokens/s = billionths */
        b->tokens = add >= (double)(full - b->tokens) ? full : b->tokens + (int64_t)add;
        b->last_ns = now_ns;
    }
    if (b->tokens >= TD_RATE_ONE) {
        b->tokens -= TD_RATE_ONE;
        return true;
    }
    double ms = (double)(TD_RATE_ONE - b->tokens) / rate / 1e6;
    int64_t w = (int64_t)ms;
    if ((double)w < ms)
        w++; /* rounded up */
    *wait_ms_p = w < 1 ? 1 : w;
    return false;
}

#endif /* TD_RATE_H */
