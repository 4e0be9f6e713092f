/*
 * prefill_sched: a prefill node's batcher around one td_engine.
 *
 * Prompts wait in a bounded queue in arrival order. Each step packs them into one engine
 * step up to a token budget: the oldest unfinished prompt first, each taking as many of
 * its remaining tokens as the budget leaves (chunked prefill: a long prompt runs over
 * several steps, its chunks in order, and never starves those behind it for more than its
 * own length). A prompt starts by attaching the longest cached prefix
 * (td_engine_seq_start), so repeated system prompts are computed once.
 *
 * When a prompt's last chunk has run, the step samples its first token with the
 * request's sampler (and, when asked, computes its log-probability; with prompt
 * log-probabilities every chunk of that prompt asks the engine for all its rows, within the
 * step's logit rows, and the prompt does not attach a cached prefix, whose positions would
 * have no logits) and reports it with the sequence (td_kv_seq_t: block ids in position
 * order) so that the data plane can push the blocks to the decode node. The sequence keeps
 * its blocks until the caller calls prefill_sched_release(); full blocks then stay in the
 * prefix cache for later prompts.
 *
 * Layer-wise push: with a layer hook set (prefill_sched_set_layer_hook), a step that runs
 * the last chunk of one or more prompts reports, after each layer, that layer's K/V of
 * those whole prompts is in the engine's pool (earlier chunks wrote their blocks in
 * earlier steps), with each prompt's block table, so the data plane can push layer L
 * while layer L+1 computes. Such a prompt is "pushed": from then on its blocks are held
 * until prefill_sched_release(), even if it fails afterwards (output.held), so nothing
 * overwrites them while a transfer may still read them.
 *
 * When the pool runs out mid-step the youngest started prompt gives its blocks back and
 * restarts later; a prompt larger than the whole pool fails with TD_ERR_EXHAUSTED rather
 * than waiting forever (unless finished, unreleased prompts still hold blocks: then the
 * step makes no progress until the caller releases them).
 *
 * Time is passed in (now_ns); no I/O. Threads: one thread at a time with its engine.
 */
#ifndef PREFILL_SCHED_H
#define PREFILL_SCHED_H

#include <stdbool.h>
#include <stdint.h>

#include "td_engine.h"
#include "td_gram.h"
#include "td_sampler.h"
#include "td_status.h"

typedef struct prefill_sched_config {
    int32_t max_queue;          /* prompts waiting or in progress (256) */
    int64_t max_queued_tokens;  /* their prompt tokens in all (1 << 20) */
    int32_t max_batch_tokens;   /* tokens in one step (2048; capped by the engine's) */
    int32_t max_batch;          /* prompts in one step (64; capped by the engine's max_seqs
                                   and max_logit_rows) */
    td_gram_cache_t *gram_cache; /* structured output: compiled grammars over the model's
                                   vocabulary (the caller's, outliving the scheduler); NULL:
                                   a prompt with a grammar is refused (no tokenizer here) */
} prefill_sched_config_t;

prefill_sched_config_t prefill_sched_config_default(void);

/* One prompt to queue. Valid: the node checked it where it came in (prefill_admit.c), once,
 * and the scheduler does not check again: the ranges below are its precondition (the scalar
 * ones asserted; an id outside the vocabulary reaches the engine, which refuses the step). */
typedef struct prefill_request {
    uint64_t id;              /* unique among live requests */
    const int32_t *prompt;    /* [n_prompt], copied; ids in [0, vocabulary) */
    int32_t n_prompt;         /* 1 .. model length - 1 */
    td_sampling_t sampling;   /* for the first token; valid (td_sampling_validate) */
    int64_t deadline_ns;      /* 0 = none */
    td_logprobs_want_t logprobs; /* on: the first token's log-probability, top in [0,
                                    TD_LOGPROBS_MAX_TOP]; prompt: also the prompt's (n_prompt <=
                                    TD_LOGPROBS_MAX_PROMPT) */
    uint64_t cache_salt;      /* seeds its prefix-cache hashes (td_kv_seq_t.salt): its tenant's;
                                 0 = none */
    const char *grammar;      /* GBNF the first token must follow (sampled under its mask:
                                 compiled on the stepping thread, cfg.gram_cache), or NULL */
} prefill_request_t;

/* A prompt that is done (or failed). */
typedef struct prefill_output {
    uint64_t id;
    td_status_t status;       /* TD_OK, TD_ERR_TIMEOUT (deadline), TD_ERR_EXHAUSTED (larger
                                 than the pool) or the engine's or sampler's error */
    int32_t first_token;      /* when TD_OK */
    const td_kv_seq_t *seq;   /* when TD_OK: the prompt's KV, valid until prefill_sched_release */
    int32_t n_cached;         /* prompt tokens that came from the prefix cache */
    bool held;                /* failed after its layers were handed to the layer hook: its
                                 blocks stay until prefill_sched_release (TD_OK: always) */
    td_token_logprob_t *logprobs; /* when TD_OK and asked: [n_logprobs], the prompt's
                                 positions (with logprobs.prompt; position 0 has logprob 0
                                 and no alternatives) then the first token's; the caller
                                 owns it (free()) */
    int32_t n_logprobs;
} prefill_output_t;

typedef struct prefill_step_result {
    const prefill_output_t *outputs; /* owned by the scheduler, valid until its next step */
    int32_t n_outputs;
    int32_t n_seqs;          /* prompts in the engine step */
    int32_t n_tokens;        /* tokens the engine step computed */
    int32_t n_restarted;     /* prompts that gave their blocks back (pool exhausted) */
} prefill_step_result_t;

typedef struct prefill_sched prefill_sched_t;

/* A prompt whose last chunk is in the running step. */
typedef struct prefill_finishing {
    uint64_t id;
    const int32_t *blocks;    /* [n_blocks] its block table in position order; valid
                                 during the callback (copy it to keep it) */
    int32_t n_blocks;         /* ceil(n_prompt / block_size) */
    int32_t n_prompt;         /* tokens whose K/V the blocks hold once the step is done */
} prefill_finishing_t;

/* After layer `layer` of a step that finishes fin[0..n_fin) (n_fin >= 1): that layer's K/V
 * of those whole prompts is in the engine's pool. Layers come in order 0 .. n_layers-1,
 * once each; the same fin list (same order) for every layer of the step. Runs on the
 * stepping thread inside prefill_sched_step; must not call the scheduler or the engine. */
typedef void (*prefill_layer_cb)(void *arg, uint32_t layer, const prefill_finishing_t *fin,
                                 int32_t n_fin);

/* Errors: TD_ERR_INVALID (a limit <= 0), TD_ERR_NOMEM. `eng` must outlive the scheduler. */
td_status_t prefill_sched_create(td_engine_t *eng, const prefill_sched_config_t *cfg,
                                 prefill_sched_t **sched_p);
/* Releases every prompt (done or not) and frees the scheduler. */
void prefill_sched_destroy(prefill_sched_t *sched);

/*
 * Queues a valid prompt (prefill_request_t). What is refused is what only the scheduler
 * knows. Errors (quiet; the RPC edge reports them): TD_ERR_INVALID (an id already live),
 * TD_ERR_EXHAUSTED (queue or token bound reached), TD_ERR_NOMEM.
 */
td_status_t prefill_sched_submit(prefill_sched_t *sched, const prefill_request_t *req);

/* Drops a queued or in-progress prompt and its blocks, or releases a done one. Quiet
 * TD_ERR_NOT_FOUND for an unknown id. */
td_status_t prefill_sched_cancel(prefill_sched_t *sched, uint64_t id);

/* True while `id` is queued or in progress (not done, not failed): cancelling it then
 * frees blocks no transfer has seen. */
bool prefill_sched_pending(const prefill_sched_t *sched, uint64_t id);

/* Sets (cb NULL: removes) the layer hook. Steps without a finishing prompt call nothing. */
void prefill_sched_set_layer_hook(prefill_sched_t *sched, prefill_layer_cb cb, void *arg);

/* The caller has pushed a done prompt's KV (or gave up on a held failed one): its
 * sequence ends (blocks back, full ones cached). Quiet TD_ERR_NOT_FOUND when id is not a
 * done or held prompt. */
td_status_t prefill_sched_release(prefill_sched_t *sched, uint64_t id);

/*
 * Runs one step at now_ns: fails expired prompts, packs the queue into one engine step,
 * samples the first token of every prompt that completes. Errors: TD_ERR_NOMEM (per-prompt
 * failures are outputs, not step errors).
 */
td_status_t prefill_sched_step(prefill_sched_t *sched, int64_t now_ns, prefill_step_result_t *res);

/* Prompt tokens still to compute (for heartbeats), and prompts queued or in progress. */
int64_t prefill_sched_queued_tokens(const prefill_sched_t *sched);
int32_t prefill_sched_queued(const prefill_sched_t *sched);
/* Done prompts not yet released. */
int32_t prefill_sched_unreleased(const prefill_sched_t *sched);

#endif /* PREFILL_SCHED_H */
