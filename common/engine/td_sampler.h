/*
 * td_sampler: turns one sequence's logits into its next token, and watches the streamed
 * text for stop strings.
 *
 * Sampling parameters travel with a request (td_sampling_t, defaults from
 * td_sampling_default(), checked by td_sampling_validate() once in each process, where the
 * request comes in: at the front doors as part of td_gen_params_validate(), by a node on
 * what arrives over the wire; everything after that takes them as valid). Each sequence
 * owns a td_sampler_t: its own PRNG seeded from the request's seed (so the same seed gives
 * the same tokens whatever else is in the batch), a window of recent tokens (prompt and
 * generated) for the repetition penalty, the count of each generated token id for OpenAI's
 * presence and frequency penalties, and scratch memory sized to the vocabulary on first use
 * (no allocation per token afterwards).
 *
 * Order of operations (temperature > 0): the logit bias (OpenAI's logit_bias, added to the
 * model's logits), the token mask of a grammar, if one is given
 * (td_sampler_sample_masked: forbidden tokens become -inf), repetition penalty, presence and frequency
 * penalties (logit -= presence * (count > 0) + frequency * count, over the generated tokens
 * only, as OpenAI and vLLM define them), temperature, top-k, softmax, top-p, min-p, draw.
 * Temperature 0 is greedy: the argmax of the biased, masked and penalized logits, lowest id
 * on ties, no randomness consumed.
 *
 * Log-probabilities (td_sampler_logprobs) are of the model's raw distribution,
 * log_softmax(logits), before the bias, penalties, temperature and truncation, as vLLM returns them
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

/* Limits of the sampling parameters (the ranges in TD_SAMPLING_FIELDS). */
#define TD_SAMPLING_MAX_TEMPERATURE 100.0f
#define TD_SAMPLING_MAX_PENALTY 100.0f
#define TD_SAMPLING_MAX_WINDOW 8192
#define TD_SAMPLING_MAX_OPENAI_PENALTY 2.0f /* presence/frequency in [-2, 2], OpenAI's range */
#define TD_SAMPLING_MAX_LOGIT_BIAS 300     /* logit_bias entries at most (OpenAI's limit) */
#define TD_SAMPLING_MAX_BIAS 100.0f        /* a bias in [-100, 100] (OpenAI's range) */

/*
 * The sampling parameters, one row each: the one place a parameter is declared.
 *
 *     X(ID, C type, name, default, the rest of its td_sampling_field_desc_t)
 *
 * The rows give td_sampling_t (a field `name`, in row order), td_sampling_default(), the ids
 * td_sampling_check reports (checked in row order) and one descriptor per field, which each
 * edge reads instead of naming the fields:
 *   .lo .hi .lo_open .hi_open  the range td_sampling_check enforces, "[lo, hi]" unless open
 *                              at an end; a float must also be finite
 *   .note                      what the range message adds: "1 = off"
 *   .wire                      tandem.v1.SamplingParams carries it in the field of the same
 *                              name (proto/tandem.proto; converted in common/node/td_node.c,
 *                              where 0 on the wire means the default: proto3 has no unset)
 *   .openai                    its key in an OpenAI request body (router/router_openai.c)
 *   .flag .arg .help           its flag in `tandem generate` and `tandem chat` (cli/cli_gen.c)
 * (left out: NULL or false, that edge does not have it). The types are float, int32_t and
 * uint64_t; the edges switch on td_sampling_type_t, so a parameter of another type adds a
 * case to each. What the sampler does with a parameter is its own code (td_sampler.c).
 */
#define TD_SAMPLING_FIELDS(X)                                                                               \
    X(TEMPERATURE, float, temperature, 0.0f, /* 0 = greedy; else logits are divided by it */                \
      .lo = 0, .hi = TD_SAMPLING_MAX_TEMPERATURE, .note = "0 = greedy", .wire = true,                       \
      .openai = "temperature", .flag = "--temperature", .arg = "T", .help = "0 = greedy (default 0)")       \
    X(TOP_K, int32_t, top_k, 0, /* keep the k most likely tokens; 0 = off */                                \
      .lo = 0, .hi = INT32_MAX, .note = "0 = off", .wire = true,                                            \
      .openai = "top_k", .flag = "--top-k", .arg = "K",                                                     \
      .help = "sample from the K most likely tokens (default 0: off)")                                      \
    X(TOP_P, float, top_p, 1.0f, /* keep the smallest set with probability >= top_p; 1 = off */             \
      .lo = 0, .lo_open = true, .hi = 1, .note = "1 = off", .wire = true,                                   \
      .openai = "top_p", .flag = "--top-p", .arg = "P",                                                     \
      .help = "nucleus sampling: the smallest set of probability >= P (default 1: off)")                    \
    X(MIN_P, float, min_p, 0.0f, /* drop tokens with p < min_p * p_max; 0 = off */                          \
      .lo = 0, .hi = 1, .hi_open = true, .note = "0 = off", .wire = true,                                   \
      .openai = "min_p", .flag = "--min-p", .arg = "P",                                                     \
      .help = "drop tokens below P times the most likely one's probability (default 0: off)")               \
    X(REPETITION_PENALTY, float, repetition_penalty, 1.0f, /* CTRL-style, recent window; 1 = off */         \
      .lo = 0, .lo_open = true, .hi = TD_SAMPLING_MAX_PENALTY, .note = "1 = off", .wire = true,             \
      .openai = "repetition_penalty", .flag = "--repetition-penalty", .arg = "R",                           \
      .help = "penalty on recently seen tokens (default 1: off)")                                           \
    X(PENALTY_WINDOW, int32_t, penalty_window, 64, /* recent accepted tokens the penalty looks at */        \
      .lo = 0, .hi = TD_SAMPLING_MAX_WINDOW) /* not a request's: the sampler's own */                       \
    X(PRESENCE_PENALTY, float, presence_penalty, 0.0f, /* OpenAI's: minus this once per id generated */     \
      .lo = -TD_SAMPLING_MAX_OPENAI_PENALTY, .hi = TD_SAMPLING_MAX_OPENAI_PENALTY, .note = "0 = off",       \
      .wire = true, .openai = "presence_penalty", .flag = "--presence-penalty", .arg = "P",                 \
      .help = "OpenAI's: subtract P from the logit of every token generated so far\n"                       \
              "(-2..2, default 0: off)")                                                                    \
    X(FREQUENCY_PENALTY, float, frequency_penalty, 0.0f, /* OpenAI's: minus this times the count */         \
      .lo = -TD_SAMPLING_MAX_OPENAI_PENALTY, .hi = TD_SAMPLING_MAX_OPENAI_PENALTY, .note = "0 = off",       \
      .wire = true, .openai = "frequency_penalty", .flag = "--frequency-penalty", .arg = "F",               \
      .help = "OpenAI's: subtract F times the number of times a token was generated\n"                      \
              "(-2..2, default 0: off)")                                                                    \
    X(SEED, uint64_t, seed, 0, /* PRNG seed; equal seeds give equal draws */                                \
      .lo = 0, .hi = (double)UINT64_MAX, .wire = true, .openai = "seed", .flag = "--seed", .arg = "S",      \
      .help = "sampling seed (default 0)") /* any value */

typedef struct td_sampling {
#define TD_SAMPLING_MEMBER(ID, ctype, field, def, ...) ctype field;
    TD_SAMPLING_FIELDS(TD_SAMPLING_MEMBER)
#undef TD_SAMPLING_MEMBER
    /* OpenAI's logit_bias: bias[i] is added to the logit of token ids[i] before anything
     * else (td_sampler_sample_masked). A list, so not a row of TD_SAMPLING_FIELDS: checked by
     * td_sampling_check_bias, carried as SamplingParams.logit_bias_ids / logit_bias (two
     * parallel packed arrays, td_node.c), read by router_openai.c and cli_gen.c by name.
     * Value semantics like every other field (a copy carries it): 2.4 KB at most. */
    int32_t n_logit_bias;                           /* [0, TD_SAMPLING_MAX_LOGIT_BIAS]; as read
                                                       from the wire, -1 (its two lists differ in
                                                       length) or more than the maximum (only
                                                       that many entries copied): refused */
    int32_t logit_bias_ids[TD_SAMPLING_MAX_LOGIT_BIAS]; /* [n_logit_bias] distinct ids >= 0 */
    float logit_bias[TD_SAMPLING_MAX_LOGIT_BIAS];   /* [n_logit_bias] in [-100, 100] */
} td_sampling_t;

/* Every field at its TD_SAMPLING_FIELDS default: greedy (temperature 0), every filter off,
 * penalty 1 over a window of 64, presence and frequency penalties 0, seed 0, no logit bias. */
td_sampling_t td_sampling_default(void);

/* The fields, as td_sampling_check reports them: [1, TD_SAMPLING_FIELD_END), in row order. */
typedef enum td_sampling_field {
    TD_SAMPLING_FIELD_NONE = 0, /* all in range */
#define TD_SAMPLING_FIELD_ENUM(ID, ...) TD_SAMPLING_FIELD_##ID,
    TD_SAMPLING_FIELDS(TD_SAMPLING_FIELD_ENUM)
#undef TD_SAMPLING_FIELD_ENUM
    TD_SAMPLING_FIELD_END
} td_sampling_field_t;

typedef enum td_sampling_type {
    TD_SAMPLING_F32, /* float */
    TD_SAMPLING_I32, /* int32_t */
    TD_SAMPLING_U64, /* uint64_t */
} td_sampling_type_t;

/* One row of TD_SAMPLING_FIELDS, for the code that handles every field alike. */
typedef struct td_sampling_field_desc {
    td_sampling_field_t id;
    const char *name;         /* the C field, the wire field, the word messages begin with */
    td_sampling_type_t type;
    size_t offset;            /* in td_sampling_t */
    double lo, hi;            /* the range, closed unless lo_open / hi_open */
    bool lo_open, hi_open;
    const char *note;         /* after the range in a message, in parentheses (NULL none) */
    bool wire;                /* a field of tandem.v1.SamplingParams, of the same name */
    const char *openai;       /* the OpenAI request key (NULL none) */
    const char *flag;         /* tandem generate's and chat's flag, "--top-p" (NULL none) */
    const char *arg;          /* the flag's value in --help ("P") */
    const char *help;         /* the flag's --help text */
} td_sampling_field_desc_t;

/* The descriptor of field f; NULL for NONE and values outside the fields. */
const td_sampling_field_desc_t *td_sampling_field_desc(td_sampling_field_t f);

/* Where field d lives in *s (a float *, int32_t * or uint64_t * by d->type). */
static inline void *td_sampling_field_ptr(td_sampling_t *s, const td_sampling_field_desc_t *d)
{
    return (char *)s + d->offset;
}

/* td_sampling_validate's check, returning which field failed (NONE: every one is in range)
 * with td_sampling_validate's message in why (if non-NULL); sets no last error. Pure. */
td_sampling_field_t td_sampling_check(const td_sampling_t *s, char *why, size_t why_cap);

/*
 * The logit bias's check: at most TD_SAMPLING_MAX_LOGIT_BIAS entries, each bias finite in
 * [-100, 100], each id >= 0, below `vocab` when vocab > 0 (0: the vocabulary is not known
 * here; whoever knows it calls again with it), and no id twice. True when it holds; else
 * false with the message in why (if non-NULL): "logit_bias token 60000 is outside the
 * vocabulary (49152 ids)". Sets no last error. Pure.
 */
bool td_sampling_check_bias(const td_sampling_t *s, int32_t vocab, char *why, size_t why_cap);

/*
 * Checks every field against its TD_SAMPLING_FIELDS range: temperature in [0, 100], top_k
 * >= 0, top_p in (0, 1], min_p in [0, 1), repetition_penalty in (0, 100], penalty_window in
 * [0, 8192], presence_penalty and frequency_penalty in [-2, 2], all finite; then the logit
 * bias (td_sampling_check_bias without a vocabulary). TD_OK or TD_ERR_INVALID with a message naming the field, its value and the range ("top_p
 * -0.5 is out of range (0, 1] (1 = off)"; in `why` if non-NULL, and as this thread's last
 * error), the first field in row order that fails. Does not log: bad requests are the
 * client's error, reported by the RPC edge.
 */
td_status_t td_sampling_validate(const td_sampling_t *s, char *why, size_t why_cap);

typedef struct td_sampler td_sampler_t;

/* Creates a sampler for one sequence. params must be valid: the process checked them at its
 * edge (td_sampling_validate); here that is asserted, not checked again. They are copied.
 * Errors: TD_ERR_NOMEM. */
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
 * td_sampler_sample under a token mask (a grammar's, td_gram_fill_mask): bit (i % 32) of
 * allowed[i / 32] set means token i may be drawn; NULL allows every token. The mask is
 * applied after the logit bias (so a bias never revives a forbidden token) and before the penalties, temperature, top-k, top-p and min-p, so the filters
 * and the draw see only allowed tokens (min-p is relative to the most likely allowed one)
 * and greedy picks the most likely allowed token. A draw consumes the same one random
 * number as without a mask, so a seed gives the same stream position either way.
 * td_sampler_logprobs is not affected: reported log-probabilities stay the model's own,
 * log_softmax over the whole vocabulary before the mask (as vLLM reports them).
 * Errors: td_sampler_sample's; TD_ERR_INVALID also when no allowed token has a finite logit.
 */
td_status_t td_sampler_sample_masked(td_sampler_t *sampler, const float *logits, int32_t vocab,
                                     const uint32_t *allowed, int32_t *token_p);

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
