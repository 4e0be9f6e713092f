/*
 * td_sampler: turns one sequence's logits into its next token, and watches the streamed
 * text for stop strings.
 *
 * Sampling parameters travel with a request (td_sampling_t, defaults from
 * td_sampling_default(), checked by td_sampling_validate(): at the front doors as part of
 * td_gen_params_validate(), again by the nodes on what the router forwards). Each sequence
 * owns a td_sampler_t: its own PRNG seeded from the request's seed (so the same seed gives
 * the same tokens whatever else is in the batch), a window of recent tokens (prompt and
 * generated) for the repetition penalty, the count of each generated token id for OpenAI's
 * presence and frequency penalties, and scratch memory sized to the vocabulary on first use
 * (no allocation per token afterwards).
 *
 * Order of operations (temperature > 0): repetition penalty, presence and frequency
 * penalties (logit -= presence * (count > 0) + frequency * count, over the generated tokens
 * only, as OpenAI and vLLM define them), temperature, top-k, softmax, top-p, min-p, draw.
 * Temperature 0 is greedy: the argmax of the penalized logits, lowest id on ties, no
 * randomness consumed.
 *
 * Log-probabilities (td_sampler_logprobs) are of the model's raw distribution,
 * log_softmax(logits), before penalties, temperature and truncation, as vLLM returns them
 * by default: a separate pure function of the logits, so a node computes them only for the
 * requests that ask, and for prompt rows as well as sampled ones.
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
    float presence_penalty;   /* OpenAI's: minus this once per id generated so far; 0 = off */
    float frequency_penalty;  /* OpenAI's: minus this times the id's generated count; 0 = off */
    uint64_t seed;            /* PRNG seed; equal seeds give equal draws */
} td_sampling_t;

/* Greedy (temperature 0), every filter off, penalty 1 over a window of 64, presence and
 * frequency penalties 0, seed 0. */
td_sampling_t td_sampling_default(void);

/* Limits enforced by td_sampling_validate. */
#define TD_SAMPLING_MAX_TEMPERATURE 100.0f
#define TD_SAMPLING_MAX_PENALTY 100.0f
#define TD_SAMPLING_MAX_WINDOW 8192
#define TD_SAMPLING_MAX_OPENAI_PENALTY 2.0f /* presence/frequency in [-2, 2], OpenAI's range */

/* The fields td_sampling_check reports, in the order it checks them. */
typedef enum td_sampling_field {
    TD_SAMPLING_FIELD_NONE = 0, /* all in range */
    TD_SAMPLING_FIELD_TEMPERATURE,
    TD_SAMPLING_FIELD_TOP_K,
    TD_SAMPLING_FIELD_TOP_P,
    TD_SAMPLING_FIELD_MIN_P,
    TD_SAMPLING_FIELD_REPETITION_PENALTY,
    TD_SAMPLING_FIELD_PENALTY_WINDOW,
    TD_SAMPLING_FIELD_PRESENCE_PENALTY,
    TD_SAMPLING_FIELD_FREQUENCY_PENALTY,
} td_sampling_field_t;

/* td_sampling_validate's check, returning which field failed (NONE: every one is in range)
 * with td_sampling_validate's message in why (if non-NULL); sets no last error. Pure. */
td_sampling_field_t td_sampling_check(const td_sampling_t *s, char *why, size_t why_cap);

/*
 * Checks every field: temperature in [0, 100], top_k >= 0, top_p in (0, 1], min_p in
 * [0, 1), repetition_penalty in (0, 100], penalty_window in [0, 8192], presence_penalty and
 * frequency_penalty in [-2, 2], all finite.
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

/*
 * Records a generated token: in the repetition-penalty window and, when a presence or
 * frequency penalty is set, in the generated-token counts. Errors: TD_ERR_NOMEM (only with
 * those penalties, when the count table must grow; the token is then in the window but not
 * counted).
 */
td_status_t td_sampler_accept(td_sampler_t *sampler, int32_t token);

/* Records a prompt token: in the repetition-penalty window only (presence and frequency
 * penalties look at generated tokens). */
void td_sampler_accept_prompt(td_sampler_t *sampler, int32_t token);

/* Forgets the penalty window and the generated counts, and reseeds the PRNG from
 * params->seed. */
void td_sampler_reset(td_sampler_t *sampler);

/* ---- log-probabilities -------------------------------------------------------------- */

#define TD_LOGPROBS_MAX_TOP 20 /* alternatives per position at most (OpenAI's limit) */
#define TD_LOGPROBS_MAX_PROMPT 4096 /* prompt tokens at most when their logprobs are asked:
                                       4096 x (20 alternatives) is about 1 MiB on the wire */

/* What log-probabilities a request wants (GenerateRequest.logprobs on the wire). */
typedef struct td_logprobs_want {
    bool on;      /* each generated token's log-probability */
    int32_t top;  /* with on: alternatives per position, [0, TD_LOGPROBS_MAX_TOP] */
    bool prompt;  /* with on: also the prompt's tokens (at most TD_LOGPROBS_MAX_PROMPT) */
} td_logprobs_want_t;

typedef struct td_top_logprob {
    int32_t token;
    float logprob;
} td_top_logprob_t;

/* One position: the log-probability of `token` and the n_top most likely ids. */
typedef struct td_token_logprob {
    int32_t token;
    float logprob;                          /* natural log; -inf for a NaN/-inf logit */
    int32_t n_top;                          /* [0, TD_LOGPROBS_MAX_TOP] */
    td_top_logprob_t top[TD_LOGPROBS_MAX_TOP]; /* most likely first, lower id on ties */
} td_token_logprob_t;

/*
 * log_softmax(logits)[token] and the n_top largest entries of log_softmax(logits), NaN
 * counted as -inf, in double precision for the normalizer. Two passes over the vocabulary
 * and an n_top-entry heap: no sort of the vocabulary, no allocation. Errors: TD_ERR_INVALID
 * (vocab <= 0, token outside [0, vocab), n_top outside [0, TD_LOGPROBS_MAX_TOP], no finite
 * logit). *out_p set on success. Pure; any thread.
 */
td_status_t td_sampler_logprobs(const float *logits, int32_t vocab, int32_t token, int32_t n_top,
                                td_token_logprob_t *out_p);

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
