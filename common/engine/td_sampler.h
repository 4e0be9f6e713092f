/*
 * td_sampler: turns one sequence's logits into its next token, and watches the streamed
 * text for stop strings.
 *
 * Sampling parameters travel with a request (td_sampling_t, defaults from
 * td_sampling_default(), checked by td_sampling_validate(): at the front doors as part of
 * td_gen_params_validate(), again by the nodes on what the router forwards). Each sequence
 * owns a td_sampler_t: its own PRNG seeded from the request's seed (so the same seed gives
 * the same tokens whatever else is in the batch), a window of recent tokens for the
 * repetition penalty, and scratch memory sized to the vocabulary on first use (no
 * allocation per token afterwards).
 *
 * Order of operations (temperature > 0): repetition penalty, temperature, top-k, softmax,
 * top-p, min-p, draw. Temperature 0 is greedy: the argmax of the penalized logits, lowest
 * id on ties, no randomness consumed.
 *
 * The stop matcher (td_stop_t) takes the detokenized text of each step and says how many
 * bytes may be sent to the client now: text that could still turn out to be the start of
 * a stop string is held back until it is decided, so a stop string split across several
 * tokens is never partly emitted.
 *
 * Threads: a sampler or a stop matcher is used by one thread at a time.
 */
#ifndef TD_SAMPLER_H
#define TD_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

typedef struct td_sampling {
    float temperature;        /* 0 = greedy; else logits are divided by it */
    int32_t top_k;            /* keep the k most likely tokens; 0 = off */
    float top_p;              /* keep the smallest set with probability >= top_p; 1 = off */
    float min_p;              /* drop tokens with p < min_p * p_max; 0 = off */
    float repetition_penalty; /* CTRL-style, on tokens of the recent window; 1 = off */
    int32_t penalty_window;   /* how many recent accepted tokens the penalty looks at */
    uint64_t seed;            /* PRNG seed; equal seeds give equal draws */
} td_sampling_t;

/* Greedy (temperature 0), every filter off, penalty 1 over a window of 64, seed 0. */
td_sampling_t td_sampling_default(void);

/* Limits enforced by td_sampling_validate. */
#define TD_SAMPLING_MAX_TEMPERATURE 100.0f
#define TD_SAMPLING_MAX_PENALTY 100.0f
#define TD_SAMPLING_MAX_WINDOW 8192

/*
 * Checks every field: temperature in [0, 100], top_k >= 0, top_p in (0, 1], min_p in
 * [0, 1), repetition_penalty in (0, 100], penalty_window in [0, 8192], all finite.
 * TD_OK or TD_ERR_INVALID with a message naming the field, its value and the range (in
 * `why` if non-NULL, and as this thread's last error). Does not log: bad requests are the
 * client's error, reported by the RPC edge.
 */
td_status_t td_sampling_validate(const td_sampling_t *s, char *why, size_t why_cap);

typedef struct td_sampler td_sampler_t;

/* Creates a sampler for one sequence. params must be valid (td_sampling_validate); they
 * are copied. Errors: TD_ERR_INVALID, TD_ERR_NOMEM. */
td_status_t td_sampler_create(const td_sampling_t *params, td_sampler_t **sampler_p);
void td_sampler_destroy(td_sampler_t *sampler);

/* The parameters the sampler was created with. */
const td_sampling_t *td_sampler_params(const td_sampler_t *sampler);

/*
 * Picks the next token from logits[0..vocab). Does not record it: call
 * td_sampler_accept() with the token the sequence actually continues with. NaN logits
 * count as -inf. Errors: TD_ERR_INVALID (vocab <= 0, or no finite logit), TD_ERR_NOMEM
 * (only when the vocabulary grows past what the scratch holds). *token_p set on success.
 */
td_status_t td_sampler_sample(td_sampler_t *sampler, const float *logits, int32_t vocab,
                              int32_t *token_p);

/* Records a token (generated, or from the prompt) in the repetition-penalty window. */
void td_sampler_accept(td_sampler_t *sampler, int32_t token);

/* Forgets the penalty window and reseeds the PRNG from params->seed. */
void td_sampler_reset(td_sampler_t *sampler);

/* ---- stop strings ------------------------------------------------------------------ */

#define TD_STOP_MAX_STRINGS 16
#define TD_STOP_MAX_LEN 256

typedef struct td_stop td_stop_t;

/* What one td_stop_feed() call decided. */
typedef struct td_stop_result {
    const char *emit;   /* bytes that may be sent now (inside the matcher; valid until the
                           next call on it); never NULL, "" when there are none */
    size_t emit_len;
    bool matched;       /* a stop string completed: emit is the text before it; stop now */
    int32_t which;      /* index of the stop string that matched, -1 if none */
} td_stop_result_t;

/*
 * Creates a matcher for n stop strings (copied; empty strings are ignored). Errors:
 * TD_ERR_INVALID for more than TD_STOP_MAX_STRINGS strings or one longer than
 * TD_STOP_MAX_LEN bytes, TD_ERR_NOMEM.
 */
td_status_t td_stop_create(const char *const *stops, int32_t n, td_stop_t **stop_p);
void td_stop_destroy(td_stop_t *stop);

/*
 * Appends a step's text. On a match, emit is everything before the earliest match (among
 * equal starts, the first listed string wins) and the stop string itself is not emitted;
 * feeding after a match is an error. Otherwise emit is the text up to the longest suffix
 * that is a prefix of some stop string, which stays held back. Errors: TD_ERR_INVALID
 * after a match, TD_ERR_NOMEM.
 */
td_status_t td_stop_feed(td_stop_t *stop, const char *text, size_t len, td_stop_result_t *res);

/* The generation ended without a match: returns the held-back text (valid until the next
 * call). */
void td_stop_flush(td_stop_t *stop, const char **text_p, size_t *len_p);

/* Bytes currently held back. */
size_t td_stop_held(const td_stop_t *stop);

/* ---- additions ---- */

/*
 * Advances the PRNG as n_tokens successful td_sampler_sample calls would (one draw per
 * token when temperature > 0, none when greedy), without sampling: a decode node continues
 * the random stream of a request whose first token a prefill node sampled with the same
 * seed, so a seeded cluster generation equals a single-process one.
 */
void td_sampler_skip(td_sampler_t *sampler, int32_t n_tokens);

#endif /* TD_SAMPLER_H */
