/*
 * decode_sched: continuous batching for a decode node, around one td_engine.
 *
 * Requests are admitted with their prompt and either KV computed elsewhere (blocks a
 * prefill node wrote, adopted with td_kv_seq_adopt, plus the first token it sampled) or
 * nothing (the local-prefill fallback: the prompt is prefilled here in chunks). Admitted
 * requests wait in arrival order; each step moves the oldest waiting ones into the running
 * set while it is under max_batch and the KV pool can hold them, then runs ONE engine step
 * over every running sequence: one token each for those generating, a prompt chunk within
 * the token budget for those still prefilling. Each sequence is sampled with its own
 * sampler (its own seed), and the step's result lists every new token of every sequence
 * and every request that finished, with its reason.
 *
 * A sequence's state is its context (prompt, then the tokens generated so far) and the
 * part of it whose KV is in the cache; the step feeds the rest (one token while
 * generating). So a sequence that was preempted (its blocks taken back when the pool ran
 * out, TD_ERR_EXHAUSTED) is simply requeued and recomputes its context later, with the
 * same sampler state: it yields the same tokens as if never preempted. The youngest
 * block holder is preempted first. When no sequence here holds blocks to take, the pool is
 * held outside the scheduler (a decode node's leases: KV landing from prefill nodes, which
 * return as admitted sequences or when the lease ends): the step runs nothing and says so
 * (decode_step_result_t.stalled), every sequence keeps its place and blocks, and an admitted
 * request is never dropped for it. Only a sequence whose step needs more blocks than the
 * whole pool ends, with DECODE_FINISH_ERROR, rather than waiting forever.
 *
 * The same scheduler serves the unified role (decode_main.c, `tandem unified`): every request
 * is admitted without KV and prefilled here, its prompt chunks packed after the step's
 * decode tokens up to max_batch_tokens (Sarathi-style chunked prefill), so a long prompt
 * never stalls the running sequences for more than one chunk's worth of a step.
 *
 * TPOT objectives (conditional disaggregation, docs/scheduling.md): a request may carry one
 * (decode_request_t.tpot_objective_s). While any running sequence has one, a step's prompt
 * chunks, all together, are bounded so that the step stays within the tightest of them: the
 * scheduler fits its own step time against what each step carried (td_stepcost: the decoding
 * rows, their context, the prompt tokens; the caller times each step and says so with
 * decode_sched_note_step_time) and feeds the most prompt tokens the fit allows beside the
 * step's decodes, at least one (a prompt admitted here always moves on); before the fit has
 * seen enough steps with prompt tokens, TD_DECODE_PROBE_CHUNK (td_sched_defaults.h). The node
 * decides how much a step carries; the router decides where a prompt is prefilled, from the
 * same fit, reported in the heartbeat.
 *
 * Prefill for another node (kv_out; docs/scheduling.md "Roles that follow the load"): a request
 * admitted with decode_request_t.kv_out is prefilled here like a local prefill (chunked beside
 * the running streams, within the TPOT objectives above, preemptible while it computes), but
 * generates nothing here: the step that computes its last chunk samples its first token (as a
 * prefill node does: a fresh sampler of the request's seed, its grammar and logprobs) and
 * reports it with DECODE_FINISH_KV_OUT and the sequence's block table. From then on the sequence
 * is held: its blocks stay whole (no sliding-window release: the transfer reads every block of the
 * prompt, as a prefill node's does) and in its block table (holder SEQ), it is never preempted
 * and has no deadline, until the caller, once no transfer reads the blocks any more, ends it with
 * decode_sched_release (or decode_sched_cancel). Held sequences do not make the scheduler busy.
 *
 * A migrated stream (its first decode node was lost; the router moved it) is admitted with
 * the tokens its client already has (decode_request_t.replay): they follow the prompt in
 * the context and are fed one row per step, as they were fed when generated, so their KV
 * and the next logits are the same floats; the sampler starts as after them. Its events
 * then go on from output index n_replay.
 *
 * Stop conditions, checked in this order on each new token: an EOS id of the model or a
 * stop id of the request (the token is not part of the output, as in `tandem generate`),
 * a stop string (with a tokenizer: the streaming detokenizer feeds td_stop, text before
 * the stop string is emitted, the rest withheld), max tokens or the model's length.
 * Cancellation and deadlines end a request at once and release all its blocks.
 *
 * Speculative decoding (cfg.spec): in a step with no prompt chunk, each generating sequence
 * may bring drafts (sized by its own td_spec_adapt_t: prompt lookup over its context, or the
 * draft model's greedy tokens, cfg.draft) after its token: one verify item (td_engine_item_t.verify) whose rows are
 * sampled in order with the sequence's sampler, a draft taken while the sampled token equals
 * it, every token through the same take_token as a one-row step's, and the KV of rejected
 * drafts rolled back. Output, logprobs and random streams are those of one token per step.
 * Drafts count against max_batch_tokens and the engine's logit rows; a step that would not
 * fit the pool with them runs without them before anyone is preempted. With a draft model
 * each sequence also holds a sequence of the draft engine's KV (td_spec_draft_run feeds it
 * what of the context it lacks, so it follows rollbacks and recomputes by itself); it goes
 * with the sequence's own KV, in the one place that drops that (finish, cancel, deadline,
 * error, preemption). A sequence that the draft pool cannot hold, or whose draft run fails
 * (the engine logged why), drafts nothing and backs off as after a rejected draft:
 * speculation is never an error. Drafting runs the draft engine for one sequence at a time,
 * and a sequence's first draft (or its first after a preemption) feeds its whole context.
 *
 * Time is passed in (now_ns, any monotonic clock, the one deadlines use); no I/O.
 * Threads: a scheduler and its engine are used by one thread at a time (the node's
 * compute thread).
 */
#ifndef DECODE_SCHED_H
#define DECODE_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_engine.h"
#include "td_gram.h"
#include "td_sampler.h"
#include "td_spec.h"
#include "td_status.h"
#include "td_stepcost.h"
#include "td_tokenizer.h"

typedef struct decode_sched_config {
    int32_t max_batch;        /* running sequences at most (64; capped by the engine's max_seqs
                                 and max_logit_rows) */
    int32_t max_batch_tokens; /* tokens fed in one step, all sequences (512; capped by the
                                 engine's max_batch_tokens) */
    int32_t prefill_chunk;    /* prompt tokens one sequence feeds in one step (256) */
    int32_t max_waiting;      /* admitted requests not yet running (256) */
    int32_t admit_reserve;    /* free blocks kept back when moving a waiting request in,
                                 so running ones can grow (0) */
    td_spec_config_t spec;    /* speculative decoding (off; see "Speculative decoding" above) */
    td_spec_draft_t *draft;   /* spec.mode draft-model: the drafter, over an engine of its own
                                 (the caller's, outliving the scheduler and used by nobody else
                                 meanwhile); NULL otherwise */
    td_gram_cache_t *gram_cache; /* structured output: compiled grammars over gram_vocab (the
                                 caller's, outliving the scheduler); NULL: a request with a
                                 grammar is refused (the node has no tokenizer) */
    const td_gram_vocab_t *gram_vocab; /* the model's grammar vocabulary (td_constrain_vocab) */
} decode_sched_config_t;

decode_sched_config_t decode_sched_config_default(void);

typedef enum decode_finish {
    DECODE_FINISH_NONE = 0,  /* still running */
    DECODE_FINISH_STOP,      /* EOS, stop id or stop string */
    DECODE_FINISH_LENGTH,    /* max tokens or the model's maximum length */
    DECODE_FINISH_CANCELLED, /* decode_sched_cancel */
    DECODE_FINISH_DEADLINE,  /* deadline passed */
    DECODE_FINISH_ERROR,     /* see the event's status */
    DECODE_FINISH_KV_OUT,    /* a kv_out request's KV is complete and held (event: its first
                                token and block table) until decode_sched_release */
} decode_finish_t;

/* "stop", "length", "cancelled", "deadline", "error", "kv_out" ("" for NONE). */
const char *decode_finish_name(decode_finish_t f);

/*
 * One request to admit. Every array is copied by decode_sched_admit. Valid: the node checked
 * it where it came in (decode_admit.c: an AdmitRequest's fields, its ids against the
 * vocabulary, its sampling and logprobs; a kv-ready's token count and first token), once, and
 * the scheduler does not check again: the ranges below are its precondition (the scalar ones
 * asserted; an id outside the vocabulary reaches the engine, which refuses the step).
 */
typedef struct decode_request {
    uint64_t id;                 /* unique among live requests */
    const int32_t *prompt;       /* [n_prompt] */
    int32_t n_prompt;            /* 1 .. model length - 1; ids in [0, vocabulary) */
    /* KV from a prefill node: blocks of this engine's pool holding prompt[0..n_prompt), one
       reference each handed over on success (kept by the caller on failure), and the first
       token that node sampled with the same sampling seed (this request's sampler continues
       that random stream after its draw). kv_blocks NULL = prefill here. */
    const int32_t *kv_blocks;
    int32_t n_kv_blocks;
    int32_t first_token;         /* with kv_blocks: in [0, vocabulary) */
    td_sampling_t sampling;      /* valid (td_sampling_validate) */
    int32_t max_tokens;          /* >= 1; also capped by the model's length */
    const int32_t *stop_ids;     /* [n_stop_ids] besides the model's EOS ids; n_stop_ids >= 0 */
    int32_t n_stop_ids;
    const char *const *stops;    /* [n_stops] stop strings (needs a tokenizer) */
    int32_t n_stops;
    int64_t deadline_ns;         /* 0 = none */
    bool logprobs;               /* report each sampled token's log-probability (not the
                                    prefill node's first token's: that node reports it) */
    int32_t top_logprobs;        /* with logprobs: alternatives per token, [0, TD_LOGPROBS_MAX_TOP] */
    bool ignore_eos;             /* the model's EOS ids do not stop it (stop ids still do) */
    /* A migrated stream (the router's, docs/cluster.md "Migration"): the n_replay tokens the
       request already generated elsewhere, [0, max_tokens) of them. They follow the prompt in
       the context, are fed one row per step (the decode kernel, as when they were generated,
       so their KV and the next logits are the same floats) and count as output already
       reported: the sampler starts as after them (counted as generated by the presence and
       frequency penalties, n_replay draws consumed) and the first event is output token
       n_replay. With kv_blocks, first_token (the prefill node's token 0 again) is ignored.
       Ids in [0, vocabulary); n_replay below max_tokens and model length - n_prompt. */
    const int32_t *replay;
    int32_t n_replay;
    uint64_t cache_salt;         /* seeds its sequences' prefix-cache hashes (td_kv_seq_t.salt): its
                                    tenant's; 0 = none */
    /* Structured output: GBNF every output token follows (docs/grammar.md), or NULL. Compiled
       at admission (cfg.gram_cache: a repeat is a cache hit), advanced over the replay and the
       prefill node's first token; each step samples under its mask; an EOS the mask allowed
       ends the request (ignore_eos does not apply). */
    const char *grammar;
    /* Its TPOT objective in seconds (0: none; the router's, or the client's: conditional
       disaggregation). While it runs, every step's prompt chunks together stay within the
       tightest objective of the running sequences by the step-cost fit (see "TPOT objectives"
       above). */
    double tpot_objective_s;
    /* Prefilled here for another node (see "Prefill for another node" above): no kv_blocks, no
       replay; max_tokens and the stops are unused (the receiving node applies them). */
    bool kv_out;
} decode_request_t;

/* Something that happened to one request in a step. */
typedef struct decode_event {
    uint64_t id;
    int32_t token;          /* the new token, or -1 when the event only ends the request */
    int32_t index;          /* the token's position in the output (0 = first), -1 if none */
    const char *text;       /* text that may be sent now (with a tokenizer; else NULL) */
    size_t text_len;
    decode_finish_t finish; /* NONE while the request runs on */
    td_status_t status;     /* for DECODE_FINISH_ERROR: the cause */
    bool has_logprob;       /* the request asked and this node sampled the token */
    td_token_logprob_t logprob; /* when has_logprob: of the raw logits (td_sampler_logprobs) */
    /* DECODE_FINISH_KV_OUT: the held sequence's block table (blocks of the engine's pool holding
       prompt[0..n_kv_tokens), in position order; the scheduler's, valid until the request is
       released or cancelled) and token is the first token, index 0 */
    const int32_t *kv_blocks;
    int32_t n_kv_blocks;
    int32_t n_kv_tokens;
} decode_event_t;

/* What one step did. Owned by the scheduler, valid until its next call. */
typedef struct decode_step_result {
    const decode_event_t *events; /* every new token and every finish of this step */
    int32_t n_events;
    int32_t n_seqs;               /* sequences in the engine step */
    int32_t n_tokens;             /* tokens the engine step fed */
    int32_t n_prefill_tokens;     /* of them, context chunks (prompts, recomputes) beside the
                                     one-token decodes */
    int32_t n_preempted;          /* sequences preempted in this step */
    int32_t n_running, n_waiting; /* after the step */
    bool stalled;                 /* no engine step ran: the pool is held outside the scheduler
                                     (leases of KV still landing); the running sequences wait
                                     for it, so the caller should wait for a command or a
                                     short while before the next step rather than spin */
} decode_step_result_t;

typedef struct decode_sched_stats {
    int32_t running, waiting;
    int64_t context_tokens;    /* context the running and waiting sequences still have to feed
                                  beyond their next token: prompts being (or to be) prefilled
                                  here, recomputes after preemption, replays (a unified node's
                                  queued prompt work, reported to the router) */
    int32_t free_blocks;       /* blocks an allocation could get (free + cached) */
    int32_t used_blocks;
    uint64_t preemptions;      /* since creation */
    uint64_t tokens_generated;
    uint64_t steps;
    uint64_t window_released;  /* KV blocks sequences gave back past their sliding window */
    td_spec_stats_t spec;      /* speculative decoding's counters since creation */
    double tpot_objective_s;   /* the tightest TPOT objective of the running and waiting
                                  sequences (0: none has one) */
    int32_t kv_out_held;       /* kv_out sequences holding their KV for a transfer */
} decode_sched_stats_t;

typedef struct decode_sched decode_sched_t;

/*
 * Creates a scheduler around `eng` (which must outlive it and not be driven by anyone
 * else meanwhile). `tok` may be NULL: then no text and no stop strings. Errors:
 * TD_ERR_INVALID (a limit <= 0, a bad spec config, draft-model without cfg.draft),
 * TD_ERR_NOMEM.
 */
td_status_t decode_sched_create(td_engine_t *eng, const td_tokenizer_t *tok,
                                const decode_sched_config_t *cfg, decode_sched_t **sched_p);
/* Ends every request (releasing its blocks) and frees the scheduler. */
void decode_sched_destroy(decode_sched_t *sched);

/*
 * Admits a valid request (decode_request_t; it waits until a step moves it into the running
 * set). What is refused is what only the scheduler knows. Errors (quiet: the RPC edge
 * reports them to the client): TD_ERR_INVALID (an id already live, stop strings on a
 * scheduler without a tokenizer, blocks that adopt refuses), TD_ERR_EXHAUSTED (max_waiting
 * requests wait already), TD_ERR_NOMEM.
 */
td_status_t decode_sched_admit(decode_sched_t *sched, const decode_request_t *req);

/*
 * Ends a request now: its blocks are released before this returns, and the next step's
 * result carries its DECODE_FINISH_CANCELLED event. TD_ERR_NOT_FOUND (quiet) when no
 * live request has this id.
 */
td_status_t decode_sched_cancel(decode_sched_t *sched, uint64_t id);

/*
 * Ends every running and waiting request but the kv_out ones (their blocks may be under the
 * caller's transfer: it cancels or releases each itself), as decode_sched_cancel does each:
 * blocks released before this returns, a DECODE_FINISH_CANCELLED event each in the next step's
 * result (dropped, the requests still ended, when memory for the events is short). For a node
 * whose router dropped it (every request it gave is failed or moved there). Returns how many
 * ended.
 */
int32_t decode_sched_cancel_all(decode_sched_t *sched);

/*
 * Runs one step at time now_ns: expires deadlines, moves waiting requests in, runs the
 * engine over the running set, samples, checks stops, releases finished requests. With
 * nothing to run it returns at once with only pending finish events. Engine failures
 * other than an exhausted pool end the sequences of that step with DECODE_FINISH_ERROR
 * (the step still returns TD_OK so the caller streams them). Errors: TD_ERR_NOMEM.
 */
td_status_t decode_sched_step(decode_sched_t *sched, int64_t now_ns, decode_step_result_t *res);

/*
 * Ends a held kv_out request (its DECODE_FINISH_KV_OUT came): its blocks go back (those another
 * sequence or the prefix cache shares stay there), no event. Call it only once no transfer reads
 * them. TD_ERR_NOT_FOUND (quiet) when no held request has this id.
 */
td_status_t decode_sched_release(decode_sched_t *sched, uint64_t id);

/* True when some request is running or waiting (or a finish event is pending); held kv_out
 * requests wait for their caller, not for a step. */
bool decode_sched_busy(const decode_sched_t *sched);

void decode_sched_stats(const decode_sched_t *sched, decode_sched_stats_t *st);

/* The last decode_sched_step's engine step took `seconds` (the caller's clock): a sample of the
 * step-cost fit. Ignored when that step ran no engine step, or was noted already. */
void decode_sched_note_step_time(decode_sched_t *sched, double seconds);

/* The step-cost fit over the noted steps (valid = false until enough steps carried prompt
 * tokens): the node's local prefill rate (1 / per_prefill_s) and pace for its heartbeat. */
td_stepcost_fit_t decode_sched_step_cost(const decode_sched_t *sched);

#endif /* DECODE_SCHED_H */
