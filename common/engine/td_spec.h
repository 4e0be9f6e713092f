/*
 * td_spec: speculative decoding's drafters and its controller. A drafter guesses the next
 * few tokens of a sequence cheaply; the target model checks them all in one verify step
 * (td_engine_item_t.verify: k drafts plus the last sampled token, k + 1 rows whose logits
 * are bit-identical to k + 1 one-row steps), and the caller samples the rows in order with
 * the sequence's own sampler, accepting a draft while the sampled token equals it. The
 * first mismatch yields the sampler's token; the rows after it are rolled back
 * (td_engine_seq_rollback). So the output, logprobs and the sampler's random stream are
 * exactly those of decoding one token per step: speculation only changes how many steps
 * it takes (docs/correctness.md "Speculative decoding").
 *
 * Two drafters:
 *   prompt lookup  the longest recent n-gram (ngram_max down to ngram_min tokens) ending
 *                  the context is looked up earlier in the context (prompt and output);
 *                  the tokens that followed its latest earlier occurrence are the draft.
 *                  No model; pays off when the output repeats the prompt (code edits,
 *                  summaries that quote, RAG answers).
 *   draft model    a small model sharing the target's vocabulary (td_spec_draft_t) decodes
 *                  k tokens greedily on its own engine and KV cache.
 *
 * The controller (td_spec_adapt_t) sizes each sequence's next draft from how its last ones
 * fared: a fully accepted draft doubles k (up to k_max), a partly accepted one shrinks it to
 * the accepted count plus one, and a draft of which nothing was accepted backs off drafting
 * for 4, 16, then 64 steps, so a sequence whose drafts never land costs one verify step in
 * dozens (the no-slowdown goal: docs/scheduling.md "Speculative decoding").
 *
 * Threads: every object here is used by one thread at a time (the caller's decode loop).
 */
#ifndef TD_SPEC_H
#define TD_SPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_engine.h"
#include "td_kv.h"
#include "td_status.h"
#include "td_tokenizer.h"

typedef enum td_spec_mode {
    TD_SPEC_OFF = 0,
    TD_SPEC_PROMPT_LOOKUP, /* "prompt-lookup" */
    TD_SPEC_DRAFT_MODEL,   /* "draft-model" */
} td_spec_mode_t;

#define TD_SPEC_MAX_DRAFT 16 /* draft tokens per verify at most (--draft-tokens) */

typedef struct td_spec_config {
    td_spec_mode_t mode;
    int32_t k_max;     /* draft tokens at most per verify step, 1..TD_SPEC_MAX_DRAFT (8) */
    int32_t ngram_max; /* prompt lookup: longest n-gram matched (3) */
    int32_t ngram_min; /* prompt lookup: shortest (1) */
    bool adaptive;     /* the controller sizes drafts and backs off (true); false: always k_max */
} td_spec_config_t;

td_spec_config_t td_spec_config_default(void);

/* "off", "prompt-lookup", "draft-model" -> *mode_p; TD_ERR_INVALID (message naming the
 * choices, not logged) otherwise. */
td_status_t td_spec_parse_mode(const char *s, td_spec_mode_t *mode_p);
const char *td_spec_mode_name(td_spec_mode_t mode);

/* --spec and --draft-model together, the one rule every command applies: a draft model given
 * with the mode off makes it draft-model; draft-model needs a draft model; a draft model
 * drafts for draft-model only. TD_ERR_INVALID (a message naming the flags, not logged). */
td_status_t td_spec_resolve_mode(td_spec_mode_t *mode, bool have_draft_model);

/* Checks a config's ranges: TD_ERR_INVALID naming the field (not logged). */
td_status_t td_spec_config_validate(const td_spec_config_t *cfg);

/*
 * Prompt lookup: finds the latest earlier occurrence of the last n tokens of ctx[0..n_ctx)
 * (n from ngram_max down to ngram_min, the first n that matches) and copies up to k of the
 * tokens that followed it into draft. Returns the draft's length (0: no match). Pure.
 */
int32_t td_spec_lookup(const int32_t *ctx, int32_t n_ctx, int32_t ngram_min, int32_t ngram_max, int32_t k,
                       int32_t *draft);

/* ---- the controller ------------------------------------------------------------------ */

typedef struct td_spec_adapt {
    int32_t k;        /* the next draft's size */
    int32_t backoff;  /* steps left without drafting */
    int32_t misses;   /* verify steps in a row that accepted nothing */
} td_spec_adapt_t;

void td_spec_adapt_init(td_spec_adapt_t *a, const td_spec_config_t *cfg);

/* How many tokens to draft this step (0: a plain one-row step); counts a backoff step down. */
int32_t td_spec_adapt_want(td_spec_adapt_t *a, const td_spec_config_t *cfg);

/* Records a verify step: `proposed` drafts, `accepted` of them taken. */
void td_spec_adapt_update(td_spec_adapt_t *a, const td_spec_config_t *cfg, int32_t proposed, int32_t accepted);

/* ---- counters ------------------------------------------------------------------------ */

typedef struct td_spec_stats {
    uint64_t verify_steps;    /* sequence-steps that verified a draft */
    uint64_t plain_steps;     /* sequence-steps without a draft */
    uint64_t drafted;         /* draft tokens proposed */
    uint64_t accepted;        /* of them accepted */
    uint64_t tokens;          /* tokens emitted by verify steps (accepted + the sampler's own) */
} td_spec_stats_t;

/* accepted / drafted (0 when nothing was drafted). */
double td_spec_acceptance(const td_spec_stats_t *s);

/* ---- the draft model ----------------------------------------------------------------- */

typedef struct td_spec_draft td_spec_draft_t;

/*
 * Whether `draft` (loaded from draft_path, which messages name) speaks `target`'s tokens: the
 * same vocabulary size and, when both have a tokenizer, the same piece for every id. `tok` is
 * the target's tokenizer, or NULL: then the target's own (its tokenizer_path) is loaded for
 * the check when it has one. Errors (logged): TD_ERR_INVALID saying what differs; the
 * tokenizer loader's.
 */
td_status_t td_spec_draft_check(const td_model_t *target, const td_tokenizer_t *tok, const td_model_t *draft,
                                const char *draft_path);

/*
 * A drafter over `eng`, an engine of the draft model (owned by the caller, outliving the
 * drafter, used by nobody else meanwhile). target_vocab is the target model's vocabulary
 * size: a draft model whose vocabulary differs is TD_ERR_INVALID with a message saying so
 * (logged). Errors: TD_ERR_NOMEM.
 */
td_status_t td_spec_draft_create(td_engine_t *eng, int32_t target_vocab, td_spec_draft_t **d_p);
void td_spec_draft_destroy(td_spec_draft_t *d);

/*
 * Drafts up to k tokens after ctx[0..n_ctx) for the sequence slot `seq` (a td_kv_seq_t of
 * the draft engine that the caller keeps per target sequence: initialise it with
 * td_kv_seq_init, release it with td_spec_draft_seq_end). The slot keeps the KV of the
 * context drafted last time; what still matches ctx is reused and only the rest is fed.
 * Greedy (the draft's argmax). Returns the count in *n_p (0 when the draft pool is full:
 * speculation just skips a step). Errors: the engine's (logged there).
 */
td_status_t td_spec_draft_run(td_spec_draft_t *d, td_kv_seq_t *seq, const int32_t *ctx, int32_t n_ctx, int32_t k,
                              int32_t *draft, int32_t *n_p);

/* Releases a slot's blocks in the draft engine. */
void td_spec_draft_seq_end(td_spec_draft_t *d, td_kv_seq_t *seq);

/* The greedy token of a logits row: the index of its largest value, the lowest on ties (the
 * sampler's greedy rule), for drafts and for greedy figures in benchmarks. */
int32_t td_spec_argmax(const float *v, int32_t n);

#endif /* TD_SPEC_H */
