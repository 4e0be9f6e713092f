/*
 * decode_sched: continuous batching over td_engine (see decode_sched.h). Each sequence is
 * a context (prompt ++ generated) of which kv.n_tokens are cached; a step feeds the
 * uncached rest (one token when generating, a chunk when prefilling) and samples where
 * the context's end is reached. Preemption drops the KV only; the context and the sampler
 * stay, so recomputation is invisible in the output.
 */
#include "decode_sched.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "td_kv.h"
#include "td_log.h"
#include "td_sched_defaults.h"
#include "td_util.h"

typedef struct dseq {
    uint64_t id;
    uint64_t arrival;       /* admission order: larger = younger */
    int32_t *ctx;           /* [cap_ctx] prompt then generated tokens */
    int32_t n_ctx, cap_ctx;
    int32_t n_prompt;
    int32_t n_gen;          /* tokens of the output so far */
    int32_t replay_end;     /* ctx[n_prompt..replay_end) replayed one row per step (a
                               migrated stream's earlier output); n_prompt when none */
    int32_t max_new;        /* min(max_tokens, model length - n_prompt) */
    td_kv_seq_t kv;         /* KV of ctx[0..kv.n_tokens) */
    bool pending_first;     /* adopted: ctx[n_ctx - 1] came from the prefill node, unreported */
    td_sampler_t *sampler;
    td_stop_t *stop;        /* NULL without stop strings */
    td_detok_t detok;
    int32_t *stop_ids;
    int32_t n_stop_ids;
    int64_t deadline_ns;
    bool logprobs;          /* decode_request_t's */
    int32_t top_logprobs;
    bool ignore_eos;        /* decode_request_t's: EOS ids are not stops */
    double tpot_s;          /* decode_request_t's tpot_objective_s (0: none) */
    td_spec_adapt_t adapt;  /* speculative decoding: the size of its next draft */
    td_kv_seq_t dkv;        /* with a draft model: its KV of (a prefix of) ctx, in the draft
                               engine's pool; dropped with kv (drop_kv) */
    int32_t draft[TD_SPEC_MAX_DRAFT]; /* this step's drafts (also in ctx after n_ctx) */
    int32_t n_draft;
    td_gram_matcher_t *gm;  /* structured output: the grammar (cfg.gram_cache's), or NULL */
    td_gram_state_t *gst;   /* where ctx[n_prompt..n_ctx) stands in it */
    bool kv_out;            /* decode_request_t's: prefilled for another node; once its first
                               token is sampled it moves to held and generates nothing here */
} dseq_t;

typedef struct pending_finish {
    uint64_t id;
    decode_finish_t finish;
} pending_finish_t;

/* An event while its text sits in the arena (pointers are set when the step returns). */
typedef struct ev_build {
    decode_event_t ev;
    size_t text_off;
} ev_build_t;

struct decode_sched {
    td_engine_t *eng;
    td_kv_cache_t *kv;
    const td_tokenizer_t *tok;
    const td_model_config_t *mc;
    decode_sched_config_t cfg;
    dseq_t **running;       /* [max_batch] */
    int32_t n_running;
    dseq_t **waiting;       /* [max_waiting + max_batch], by arrival */
    int32_t n_waiting, cap_waiting;
    dseq_t **held;          /* [max_waiting + max_batch] kv_out sequences whose prompt's KV is
                               complete, holding their blocks for the caller's transfer until
                               decode_sched_release (never preempted, no deadline) */
    int32_t n_held;
    pending_finish_t *pending; /* cancels since the last step */
    int32_t n_pending, cap_pending;
    ev_build_t *evb;        /* this step's events */
    decode_event_t *events;
    int32_t n_events, cap_events;
    char *arena;            /* this step's text */
    size_t arena_len, arena_cap;
    td_engine_item_t *items; /* [max_batch] */
    dseq_t **owners;         /* [max_batch] */
    float *logits;           /* [logit_rows][vocab] */
    uint32_t *mask;          /* [td_gram_mask_words(vocab)] a constrained row's allowed tokens */
    int32_t logit_rows;      /* max_batch, plus room for drafts with speculation */
    uint64_t next_arrival;
    uint64_t preemptions, tokens_generated, steps;
    td_spec_stats_t spec;
    td_stepcost_t cost;      /* the steps' times against what they carried (decode_sched_note_step_time) */
    td_stepcost_fit_t fit;   /* its fit after the last note: sizes the chunks under a TPOT objective */
    int32_t last_seqs, last_prefill; /* the last step's one-row items and prompt tokens, */
    int64_t last_context;    /* its sequences' context before it, */
    bool last_ran;           /* and whether an engine step ran (not yet noted) */
};

const char *decode_finish_name(decode_finish_t f)
{
    switch (f) {
    case DECODE_FINISH_STOP: return "stop";
    case DECODE_FINISH_LENGTH: return "length";
    case DECODE_FINISH_CANCELLED: return "cancelled";
    case DECODE_FINISH_DEADLINE: return "deadline";
    case DECODE_FINISH_ERROR: return "error";
    case DECODE_FINISH_KV_OUT: return "kv_out";
    default: return "";
    }
}

decode_sched_config_t decode_sched_config_default(void)
{
    return (decode_sched_config_t){
        .max_batch = TD_DECODE_MAX_BATCH,
        .max_batch_tokens = TD_DECODE_MAX_BATCH_TOKENS,
        .prefill_chunk = TD_DECODE_PREFILL_CHUNK,
        .max_waiting = 256,
        .admit_reserve = 0,
        .spec = td_spec_config_default(),
    };
}

/* ---- sequences ---------------------------------------------------------------------- */

/* Takes back every block q holds, in the pool and in the draft engine's: the one release of
 * a sequence's KV, whether it ends or is preempted (then it recomputes later from ctx). */
static void drop_kv(decode_sched_t *s, dseq_t *q)
{
    td_engine_seq_end(s->eng, &q->kv);
    if (s->cfg.draft)
        td_spec_draft_seq_end(s->cfg.draft, &q->dkv);
}

static void seq_destroy(decode_sched_t *s, dseq_t *q)
{
    if (!q)
        return;
    drop_kv(s, q);
    td_sampler_destroy(q->sampler);
    td_gram_state_destroy(q->gst);
    if (q->gm)
        td_gram_cache_release(s->cfg.gram_cache, q->gm);
    td_stop_destroy(q->stop);
    td_detok_free(&q->detok);
    free(q->stop_ids);
    free(q->ctx);
    free(q);
}

static bool is_stop_id(const decode_sched_t *s, const dseq_t *q, int32_t id)
{
    if (q->gst && td_gram_vocab_kind(s->cfg.gram_vocab, id) == TD_GRAM_TOK_EOS)
        return true; /* the mask allowed it only where the grammar may end */
    for (int32_t i = 0; i < s->mc->n_eos && !q->ignore_eos; i++)
        if (s->mc->eos_ids[i] == id)
            return true;
    for (int32_t i = 0; i < q->n_stop_ids; i++)
        if (q->stop_ids[i] == id)
            return true;
    return false;
}

/* ---- events ------------------------------------------------------------------------- */

static td_status_t arena_put(decode_sched_t *s, const char *text, size_t len)
{
    if (s->arena_len + len > s->arena_cap) {
        size_t cap = TD_MAX(s->arena_cap * 2, s->arena_len + len + 256);
        char *a = realloc(s->arena, cap);
        if (!a)
            return td_errorf(TD_ERR_NOMEM, "decode sched: out of memory for step text");
        s->arena = a;
        s->arena_cap = cap;
    }
    if (len)
        memcpy(s->arena + s->arena_len, text, len);
    s->arena_len += len;
    return TD_OK;
}

/* Appends an event; its text is whatever arena_put adds until the next event. */
static td_status_t event_add(decode_sched_t *s, uint64_t id, int32_t token, int32_t index,
                             decode_finish_t finish, td_status_t status)
{
    if (s->n_events == s->cap_events) {
        int32_t cap = TD_MAX(64, s->cap_events * 2);
        ev_build_t *e = realloc(s->evb, (size_t)cap * sizeof *e);
        if (!e)
            return td_errorf(TD_ERR_NOMEM, "decode sched: out of memory for step events");
        s->evb = e;
        decode_event_t *d = realloc(s->events, (size_t)cap * sizeof *d);
        if (!d)
            return td_errorf(TD_ERR_NOMEM, "decode sched: out of memory for step events");
        s->events = d;
        s->cap_events = cap;
    }
    s->evb[s->n_events++] = (ev_build_t){
        .ev = {.id = id, .token = token, .index = index, .finish = finish, .status = status},
        .text_off = s->arena_len,
    };
    return TD_OK;
}

/* Ends the stream's text: the detokenizer's and the stop matcher's held bytes. */
static td_status_t flush_text(decode_sched_t *s, dseq_t *q)
{
    if (!s->tok)
        return TD_OK;
    const char *text;
    size_t len;
    td_status_t st = td_detok_flush(&q->detok, &text, &len);
    if (st != TD_OK)
        return st;
    if (!q->stop)
        return arena_put(s, text, len);
    td_stop_result_t r;
    if ((st = td_stop_feed(q->stop, text, len, &r)) != TD_OK)
        return st;
    if ((st = arena_put(s, r.emit, r.emit_len)) != TD_OK || r.matched)
        return st;
    td_stop_flush(q->stop, &text, &len);
    return arena_put(s, text, len);
}

/*
 * A new token for q (sampled here, or the prefill node's first token): records it,
 * reports it (with its log-probability lp, when sampled here for a request that asks; else
 * NULL) and decides whether q ends. *finish_p = the reason, or NONE.
 */
static td_status_t take_token(decode_sched_t *s, dseq_t *q, int32_t token, const td_token_logprob_t *lp,
                              decode_finish_t *finish_p)
{
    td_status_t st;
    *finish_p = DECODE_FINISH_NONE;
    if (is_stop_id(s, q, token)) {
        *finish_p = DECODE_FINISH_STOP;
        if ((st = event_add(s, q->id, -1, -1, DECODE_FINISH_STOP, TD_OK)) != TD_OK)
            return st;
        return flush_text(s, q);
    }
    if ((st = td_sampler_accept(q->sampler, token)) != TD_OK)
        return st;
    if (!q->pending_first) {
        TD_ASSERT(q->n_ctx < q->cap_ctx);
        q->ctx[q->n_ctx++] = token;
    }
    q->pending_first = false;
    q->n_gen++;
    s->tokens_generated++;
    if ((st = event_add(s, q->id, token, q->n_gen - 1, DECODE_FINISH_NONE, TD_OK)) != TD_OK)
        return st;
    decode_event_t *ev = &s->evb[s->n_events - 1].ev;
    if (lp) {
        ev->has_logprob = true;
        ev->logprob = *lp;
    }
    if (s->tok) {
        const char *text;
        size_t len;
        if ((st = td_detok_push(&q->detok, token, &text, &len)) != TD_OK)
            return st;
        if (q->stop) {
            td_stop_result_t r;
            if ((st = td_stop_feed(q->stop, text, len, &r)) != TD_OK)
                return st;
            if ((st = arena_put(s, r.emit, r.emit_len)) != TD_OK)
                return st;
            if (r.matched) {
                ev->finish = *finish_p = DECODE_FINISH_STOP;
                return TD_OK;
            }
        } else if ((st = arena_put(s, text, len)) != TD_OK) {
            return st;
        }
    }
    if (q->n_gen >= q->max_new) {
        ev->finish = *finish_p = DECODE_FINISH_LENGTH;
        return flush_text(s, q);
    }
    return TD_OK;
}

/* ---- queues ------------------------------------------------------------------------- */

static void waiting_insert(decode_sched_t *s, dseq_t *q)
{
    TD_ASSERT(s->n_waiting < s->cap_waiting);
    int32_t i = s->n_waiting;
    while (i > 0 && s->waiting[i - 1]->arrival > q->arrival) {
        s->waiting[i] = s->waiting[i - 1];
        i--;
    }
    s->waiting[i] = q;
    s->n_waiting++;
}

static void remove_at(dseq_t **arr, int32_t *n, int32_t i)
{
    memmove(&arr[i], &arr[i + 1], (size_t)(*n - i - 1) * sizeof *arr);
    (*n)--;
}

/* ---- create / admit / cancel -------------------------------------------------------- */

td_status_t decode_sched_create(td_engine_t *eng, const td_tokenizer_t *tok,
                                const decode_sched_config_t *cfg, decode_sched_t **sched_p)
{
    if (cfg->spec.mode != TD_SPEC_OFF && td_spec_config_validate(&cfg->spec) != TD_OK)
        return td_errorf(TD_ERR_INVALID, "decode sched: %s", td_last_error());
    if ((cfg->spec.mode == TD_SPEC_DRAFT_MODEL) != (cfg->draft != NULL))
        return td_errorf(TD_ERR_INVALID, "decode sched: spec %s with%s a drafter: a draft model drafts for "
                         "draft-model, which needs one", td_spec_mode_name(cfg->spec.mode), cfg->draft ? "" : "out");
    if (cfg->max_batch <= 0 || cfg->max_batch_tokens <= 0 || cfg->prefill_chunk <= 0 ||
        cfg->max_waiting <= 0 || cfg->admit_reserve < 0)
        return td_errorf(TD_ERR_INVALID,
                         "decode sched: max_batch %d, max_batch_tokens %d, prefill_chunk %d and "
                         "max_waiting %d must be > 0, admit_reserve %d >= 0",
                         cfg->max_batch, cfg->max_batch_tokens, cfg->prefill_chunk,
                         cfg->max_waiting, cfg->admit_reserve);
    decode_sched_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_errorf(TD_ERR_NOMEM, "decode sched: out of memory");
    td_stepcost_init(&s->cost);
    const td_engine_config_t *ec = td_engine_config(eng);
    s->eng = eng;
    s->kv = td_engine_kv(eng);
    s->tok = tok;
    s->mc = td_engine_model_config(eng);
    s->cfg = *cfg;
    /* the engine's limits bound ours: one step must always be a legal engine step */
    s->cfg.max_batch = TD_MIN(TD_MIN(cfg->max_batch, ec->max_seqs), ec->max_logit_rows);
    s->cfg.max_batch_tokens = TD_MIN(cfg->max_batch_tokens, ec->max_batch_tokens);
    s->cap_waiting = s->cfg.max_waiting + s->cfg.max_batch; /* + room for the preempted */
    s->running = calloc((size_t)s->cfg.max_batch, sizeof *s->running);
    s->waiting = calloc((size_t)s->cap_waiting, sizeof *s->waiting);
    s->held = calloc((size_t)(s->cap_waiting + s->cfg.max_batch), sizeof *s->held);
    s->items = calloc((size_t)s->cfg.max_batch, sizeof *s->items);
    s->owners = calloc((size_t)s->cfg.max_batch, sizeof *s->owners);
    /* verify items' rows: as many as the engine returns, within what the batch can draft */
    s->logit_rows = s->cfg.max_batch;
    if (cfg->spec.mode != TD_SPEC_OFF)
        s->logit_rows = (int32_t)TD_MIN((int64_t)ec->max_logit_rows, (int64_t)s->cfg.max_batch * (cfg->spec.k_max + 1));
    s->logits = malloc((size_t)s->logit_rows * s->mc->vocab_size * sizeof(float));
    s->mask = malloc(td_gram_mask_words(s->mc->vocab_size) * sizeof *s->mask);
    if (!s->running || !s->waiting || !s->held || !s->items || !s->owners || !s->logits || !s->mask) {
        decode_sched_destroy(s);
        return td_errorf(TD_ERR_NOMEM, "decode sched: out of memory for a batch of %d",
                         cfg->max_batch);
    }
    *sched_p = s;
    return TD_OK;
}

void decode_sched_destroy(decode_sched_t *s)
{
    if (!s)
        return;
    for (int32_t i = 0; i < s->n_running; i++)
        seq_destroy(s, s->running[i]);
    for (int32_t i = 0; i < s->n_waiting; i++)
        seq_destroy(s, s->waiting[i]);
    for (int32_t i = 0; i < s->n_held; i++)
        seq_destroy(s, s->held[i]);
    free(s->running), free(s->waiting), free(s->held), free(s->items), free(s->owners), free(s->logits);
    free(s->mask);
    free(s->pending), free(s->evb), free(s->events), free(s->arena);
    free(s);
}

static dseq_t *find(decode_sched_t *s, uint64_t id, dseq_t ***arr_p, int32_t **n_p, int32_t *i_p)
{
    for (int32_t i = 0; i < s->n_running; i++)
        if (s->running[i]->id == id) {
            *arr_p = s->running, *n_p = &s->n_running, *i_p = i;
            return s->running[i];
        }
    for (int32_t i = 0; i < s->n_waiting; i++)
        if (s->waiting[i]->id == id) {
            *arr_p = s->waiting, *n_p = &s->n_waiting, *i_p = i;
            return s->waiting[i];
        }
    for (int32_t i = 0; i < s->n_held; i++)
        if (s->held[i]->id == id) {
            *arr_p = s->held, *n_p = &s->n_held, *i_p = i;
            return s->held[i];
        }
    return NULL;
}

/* q's grammar (req->grammar) from the cache, its state advanced over what the output holds
 * already: a migrated stream's replay, or the prefill node's first token, so the next mask
 * is the one an uninterrupted stream would have. A token the grammar refuses there is the
 * sender's error (TD_ERR_INVALID, named). Runs on the compute thread: a grammar not cached
 * yet is compiled here, bounded by td_gram's limits (TD_GRAM_MAX_SOURCE, _ELEMS). */
static td_status_t grammar_start(decode_sched_t *s, dseq_t *q, const decode_request_t *req)
{
    td_status_t st = td_gram_cache_get(s->cfg.gram_cache, TD_GRAM_GBNF, req->grammar, strlen(req->grammar), &q->gm);
    if (st != TD_OK)
        return st == TD_ERR_NOMEM ? st : td_errorf_quiet(TD_ERR_INVALID, "grammar: %s", td_last_error());
    if ((st = td_gram_state_create(td_gram_matcher_grammar(q->gm), &q->gst)) != TD_OK)
        return st;
    for (int32_t i = 0; i < req->n_replay; i++)
        if ((st = td_gram_accept_token(q->gm, q->gst, req->replay[i])) != TD_OK)
            return st == TD_ERR_NOMEM ? st : td_errorf_quiet(TD_ERR_INVALID, "replay_ids[%d] = %d does not follow "
                                                             "the grammar", i, req->replay[i]);
    if (req->kv_blocks && !req->n_replay && (st = td_gram_accept_token(q->gm, q->gst, req->first_token)) != TD_OK)
        return st == TD_ERR_NOMEM ? st : td_errorf_quiet(TD_ERR_INVALID, "the prefill node's first token %d does "
                                                         "not follow the grammar", req->first_token);
    return TD_OK;
}

td_status_t decode_sched_admit(decode_sched_t *s, const decode_request_t *req)
{
    const td_model_config_t *mc = s->mc;
    dseq_t **arr;
    int32_t *n, idx;
    /* the request was checked at the node's edge (decode_sched.h, "valid"); what is cheap to
       restate is restated, the per-token checks are not run twice */
    TD_ASSERT(req->prompt && req->n_prompt >= 1 && req->n_prompt < mc->max_seq_len && req->max_tokens >= 1);
    TD_ASSERT(req->n_stop_ids >= 0 && (!req->n_stop_ids || req->stop_ids) && req->n_stops >= 0 &&
              (!req->n_stops || req->stops));
    TD_ASSERT(req->n_replay >= 0 && (!req->n_replay || req->replay) && req->n_replay < req->max_tokens &&
              req->n_replay < mc->max_seq_len - req->n_prompt);
    TD_ASSERT(!req->logprobs || (req->top_logprobs >= 0 && req->top_logprobs <= TD_LOGPROBS_MAX_TOP));
    TD_ASSERT(!req->kv_out || (!req->kv_blocks && !req->n_replay));
    if (find(s, req->id, &arr, &n, &idx))
        return td_errorf_quiet(TD_ERR_INVALID, "request %llu: id already live",
                               (unsigned long long)req->id);
    if (req->n_stops > 0 && !s->tok)
        return td_errorf_quiet(TD_ERR_INVALID, "request %llu: stop strings need a tokenizer on "
                               "this node", (unsigned long long)req->id);
    if (req->grammar && (!s->cfg.gram_cache || !s->cfg.gram_vocab))
        return td_errorf_quiet(TD_ERR_INVALID, "request %llu: structured output needs the model's tokenizer "
                               "on this node (none beside its model file)", (unsigned long long)req->id);
    if (req->kv_out && s->n_held + s->n_waiting >= s->cfg.max_waiting)
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "request %llu: %d prompts wait or hold their KV for a transfer "
                               "already", (unsigned long long)req->id, s->n_held + s->n_waiting);
    if (s->n_waiting >= s->cfg.max_waiting)
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "request %llu: %d requests wait already",
                               (unsigned long long)req->id, s->n_waiting);

    td_status_t st = TD_ERR_NOMEM;
    dseq_t *q = calloc(1, sizeof *q);
    if (!q)
        goto err_nomem;
    td_kv_seq_init(&q->kv);
    td_kv_seq_init(&q->dkv);
    q->kv.salt = q->dkv.salt = req->cache_salt; /* kept when drop_kv frees them (preemption) */
    q->id = req->id;
    q->n_prompt = req->n_prompt;
    q->max_new = TD_MIN(req->max_tokens, mc->max_seq_len - req->n_prompt);
    q->cap_ctx = req->n_prompt + q->max_new;
    q->deadline_ns = req->deadline_ns;
    q->logprobs = req->logprobs;
    q->top_logprobs = req->top_logprobs;
    q->ignore_eos = req->ignore_eos;
    q->tpot_s = req->tpot_objective_s > 0 && isfinite(req->tpot_objective_s) ? req->tpot_objective_s : 0;
    q->kv_out = req->kv_out;
    td_spec_adapt_init(&q->adapt, &s->cfg.spec);
    q->ctx = malloc((size_t)q->cap_ctx * sizeof *q->ctx);
    q->stop_ids = malloc((size_t)TD_MAX(req->n_stop_ids, 1) * sizeof *q->stop_ids);
    if (!q->ctx || !q->stop_ids)
        goto err_seq;
    memcpy(q->ctx, req->prompt, (size_t)req->n_prompt * sizeof *q->ctx);
    q->n_ctx = req->n_prompt;
    if (req->n_stop_ids)
        memcpy(q->stop_ids, req->stop_ids, (size_t)req->n_stop_ids * sizeof *q->stop_ids);
    q->n_stop_ids = req->n_stop_ids;
    if ((st = td_sampler_create(&req->sampling, &q->sampler)) != TD_OK)
        goto err_seq;
    if (req->n_stops > 0 && (st = td_stop_create(req->stops, req->n_stops, &q->stop)) != TD_OK)
        goto err_seq;
    if (s->tok)
        td_detok_init(&q->detok, s->tok);
    if (req->grammar && (st = grammar_start(s, q, req)) != TD_OK)
        goto err_seq;
    for (int32_t i = 0; i < req->n_prompt; i++)
        td_sampler_accept_prompt(q->sampler, req->prompt[i]);
    /* a migrated stream's earlier output: generated tokens to the sampler (whose draws
       were made elsewhere), context to feed, output already reported */
    for (int32_t i = 0; i < req->n_replay; i++) {
        if ((st = td_sampler_accept(q->sampler, req->replay[i])) != TD_OK)
            goto err_seq;
        const char *text; /* the detokenizer's state too (a character split across tokens) */
        size_t len;
        if (s->tok && (st = td_detok_push(&q->detok, req->replay[i], &text, &len)) != TD_OK)
            goto err_seq;
    }
    td_sampler_skip(q->sampler, req->n_replay);
    if (req->n_replay)
        memcpy(q->ctx + q->n_ctx, req->replay, (size_t)req->n_replay * sizeof *q->ctx);
    q->n_ctx += req->n_replay;
    q->n_gen = req->n_replay;
    q->replay_end = q->n_ctx;
    if (req->kv_blocks) {
        st = td_kv_seq_adopt(s->kv, &q->kv, req->kv_blocks, req->n_kv_blocks, req->prompt,
                             req->n_prompt);
        if (st != TD_OK)
            goto err_seq;
        if (!req->n_replay) {
            /* the first token is context (fed next) and output (reported by the next step);
               the prefill node drew it from this seed's stream: continue after that draw */
            td_sampler_skip(q->sampler, 1);
            q->ctx[q->n_ctx++] = req->first_token;
            q->pending_first = true;
        }
    }
    q->arrival = s->next_arrival++;
    waiting_insert(s, q);
    return TD_OK;
err_seq:
    seq_destroy(s, q);
    if (st != TD_ERR_NOMEM)
        return td_errorf_quiet(st, "request %llu: %s", (unsigned long long)req->id, td_last_error());
err_nomem:
    return td_errorf(TD_ERR_NOMEM, "request %llu: out of memory", (unsigned long long)req->id);
}

static td_status_t pending_add(decode_sched_t *s, uint64_t id, decode_finish_t f)
{
    if (s->n_pending == s->cap_pending) {
        int32_t cap = TD_MAX(16, s->cap_pending * 2);
        pending_finish_t *p = realloc(s->pending, (size_t)cap * sizeof *p);
        if (!p)
            return td_errorf(TD_ERR_NOMEM, "decode sched: out of memory");
        s->pending = p;
        s->cap_pending = cap;
    }
    s->pending[s->n_pending++] = (pending_finish_t){.id = id, .finish = f};
    return TD_OK;
}

td_status_t decode_sched_cancel(decode_sched_t *s, uint64_t id)
{
    dseq_t **arr;
    int32_t *n, i;
    dseq_t *q = find(s, id, &arr, &n, &i);
    if (!q)
        return td_errorf_quiet(TD_ERR_NOT_FOUND, "request %llu: not running here",
                               (unsigned long long)id);
    td_status_t st = pending_add(s, id, DECODE_FINISH_CANCELLED);
    if (st != TD_OK)
        return st;
    remove_at(arr, n, i);
    seq_destroy(s, q);
    return TD_OK;
}

int32_t decode_sched_cancel_all(decode_sched_t *s)
{
    int32_t n = 0;
    dseq_t **arr[] = {s->running, s->waiting};
    int32_t *cnt[] = {&s->n_running, &s->n_waiting};
    for (size_t a = 0; a < TD_ARRAY_LEN(arr); a++)
        for (int32_t i = *cnt[a] - 1; i >= 0; i--) {
            dseq_t *q = arr[a][i];
            if (q->kv_out)
                continue;
            (void)pending_add(s, q->id, DECODE_FINISH_CANCELLED); /* NOMEM: it ends without its event */
            remove_at(arr[a], cnt[a], i);
            seq_destroy(s, q);
            n++;
        }
    return n;
}

/* ---- the step ----------------------------------------------------------------------- */

/* Ends running[i] or waiting[i] (per arr) with an event, releasing everything. */
static td_status_t finish_at(decode_sched_t *s, dseq_t **arr, int32_t *n, int32_t i,
                             decode_finish_t f, td_status_t cause)
{
    dseq_t *q = arr[i];
    td_status_t st = event_add(s, q->id, -1, -1, f, cause);
    remove_at(arr, n, i);
    seq_destroy(s, q);
    return st;
}

/* Moves waiting requests into the running set, oldest first, while they fit. */
static void admit_waiting(decode_sched_t *s)
{
    while (s->n_waiting > 0 && s->n_running < s->cfg.max_batch) {
        dseq_t *q = s->waiting[0];
        bool fresh = q->kv.n_tokens == 0;
        if (fresh) {
            int32_t cached = 0; /* prefix-cache hits on recompute and local prefill */
            if (td_engine_seq_start(s->eng, &q->kv, q->ctx, q->n_ctx, &cached) != TD_OK)
                drop_kv(s, q);
        }
        int32_t need = td_kv_seq_blocks_needed(s->kv, &q->kv, q->n_ctx + 1);
        /* with nothing running the head always goes in: the engine says if it cannot fit */
        if (s->n_running > 0 && need + s->cfg.admit_reserve > td_kv_available(s->kv)) {
            if (fresh)
                drop_kv(s, q); /* do not pin cached blocks while waiting */
            break;
        }
        remove_at(s->waiting, &s->n_waiting, 0);
        s->running[s->n_running++] = q;
    }
}

/* Up to k drafts for q in q->draft: prompt lookup over its context, or the draft model's
 * greedy tokens after it. A draft run that yields nothing (the draft pool is full: it gave
 * the sequence's draft blocks back) or fails (the engine logged why; its draft KV is not
 * trusted, dropped, and the next run refeeds the context) counts as a draft of which nothing
 * was accepted: the sequence backs off 4, 16, 64 steps rather than refeeding its whole
 * context into the draft engine every step, and never fails for it. */
static int32_t propose(decode_sched_t *s, dseq_t *q, int32_t k)
{
    const td_spec_config_t *sc = &s->cfg.spec;
    if (sc->mode == TD_SPEC_PROMPT_LOOKUP)
        return td_spec_lookup(q->ctx, q->n_ctx, sc->ngram_min, sc->ngram_max, k, q->draft);
    int32_t m = 0;
    if (td_spec_draft_run(s->cfg.draft, &q->dkv, q->ctx, q->n_ctx, k, q->draft, &m) != TD_OK)
        td_spec_draft_seq_end(s->cfg.draft, &q->dkv);
    if (m == 0)
        td_spec_adapt_update(&q->adapt, sc, k, 0);
    return m;
}

/* Speculation in a batch of one-row items only: each generating sequence past its replay
 * may turn its item into a verify item of its token and its drafts (propose), within
 * the token budget and the logit rows. The drafts are written after the context's end
 * (ctx has room for max_new tokens) so the item's tokens stay contiguous. Returns the
 * tokens added. */
static int32_t add_drafts(decode_sched_t *s, int32_t n_items, int32_t budget)
{
    const td_spec_config_t *sc = &s->cfg.spec;
    int32_t added = 0, rows = n_items;
    for (int32_t j = 0; j < n_items && budget > 0; j++) {
        dseq_t *q = s->owners[j];
        td_engine_item_t *it = &s->items[j];
        if (it->n_tokens != 1 || it->n_logits != 1 || q->kv.n_tokens < q->replay_end)
            continue;
        int32_t k = td_spec_adapt_want(&q->adapt, sc);
        k = TD_MIN(TD_MIN(k, q->max_new - q->n_gen - 1), TD_MIN(budget, s->logit_rows - rows));
        if (k <= 0)
            continue;
        int32_t m = propose(s, q, k);
        if (m <= 0)
            continue;
        TD_ASSERT(q->n_ctx + m <= q->cap_ctx);
        memcpy(q->ctx + q->n_ctx, q->draft, (size_t)m * sizeof *q->draft);
        q->n_draft = m;
        *it = (td_engine_item_t){.seq = &q->kv, .tokens = q->ctx + q->kv.n_tokens, .n_tokens = 1 + m,
                                 .n_logits = 1 + m, .verify = true};
        budget -= m;
        added += m;
        rows += m;
    }
    return added;
}

/* The most prompt tokens a step of n_rows one-row items may carry, all chunks together: the
 * chunks of a prompt prefilled here stay within the tightest TPOT objective of the running
 * sequences (the streams beside them, and the prompt's own once it generates), by the step-cost
 * fit (td_stepcost_chunk), at least TD_DECODE_PAST_OBJECTIVE_CHUNK (one token), so that a prompt
 * admitted here always moves on even where its node's decodes alone pass the objective; without
 * an objective, unbounded. Before the fit has seen enough steps with prompt tokens (a fresh
 * node), TD_DECODE_PROBE_CHUNK (td_stepcost_probe: half of it every other step where those
 * steps gave no fit). */
static int32_t prefill_cap(const decode_sched_t *s, int32_t n_rows)
{
    double objective = 0;
    int64_t context = 0;
    for (int32_t i = 0; i < s->n_running; i++) {
        const dseq_t *q = s->running[i];
        context += q->kv.n_tokens;
        if (q->tpot_s > 0 && (objective <= 0 || q->tpot_s < objective))
            objective = q->tpot_s;
    }
    if (objective <= 0)
        return INT32_MAX;
    int64_t cap = td_stepcost_chunk(&s->fit, n_rows, context, objective);
    if (cap < 0) /* no fit yet */
        return (int32_t)td_stepcost_probe(&s->cost, TD_DECODE_PROBE_CHUNK);
    return (int32_t)TD_MIN(TD_MAX(cap, (int64_t)TD_DECODE_PAST_OBJECTIVE_CHUNK), (int64_t)INT32_MAX);
}

/* Builds the engine batch: one token for each generating sequence, then prompt chunks
 * in arrival order within the token budget and prefill_cap; with speculation on (draft) and
 * no prompt chunk, drafts after the one-row items' tokens. *context_p: the context the
 * items' sequences hold before the step (the step-cost model's C). */
static int32_t build_batch(decode_sched_t *s, bool draft, int32_t *n_tokens_p, int32_t *n_prefill_p,
                           int64_t *context_p)
{
    int32_t k = 0, budget = s->cfg.max_batch_tokens, prefill = 0, cap = INT32_MAX;
    int64_t context = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            cap = prefill_cap(s, k);
        for (int32_t i = 0; i < s->n_running && budget > 0; i++) {
            dseq_t *q = s->running[i];
            int32_t rest = q->n_ctx - q->kv.n_tokens, rows = rest;
            TD_ASSERT(rest >= 1);
            /* a replay: the prompt in chunks that end where it ends, then one row per step */
            if (q->kv.n_tokens < q->replay_end && q->replay_end > q->n_prompt)
                rows = q->kv.n_tokens < q->n_prompt ? q->n_prompt - q->kv.n_tokens : 1;
            if ((rows == 1) != (pass == 0))
                continue;
            int32_t n = TD_MIN(TD_MIN(rows, s->cfg.prefill_chunk), budget);
            if (pass == 1) {
                n = TD_MIN(n, cap - prefill);
                if (n <= 0)
                    continue;
            }
            s->items[k] = (td_engine_item_t){.seq = &q->kv, .tokens = q->ctx + q->kv.n_tokens,
                                             .n_tokens = n, .n_logits = n == rest};
            s->owners[k++] = q;
            budget -= n;
            prefill += pass == 1 ? n : 0;
            context += q->kv.n_tokens;
        }
    }
    for (int32_t j = 0; j < k; j++)
        s->owners[j]->n_draft = 0;
    if (prefill == 0 && draft)
        budget -= add_drafts(s, k, budget);
    *n_tokens_p = s->cfg.max_batch_tokens - budget;
    *n_prefill_p = prefill;
    *context_p = context;
    return k;
}

/* Pool exhausted: takes the blocks of the youngest sequence holding any. Returns false
 * when the only holder is the one sequence left (it cannot fit: the caller ends it). */
static bool preempt_youngest(decode_sched_t *s, int32_t *n_preempted)
{
    dseq_t *victim = NULL;
    int32_t holders = 0;
    for (int32_t i = 0; i < s->n_running; i++)
        if (s->running[i]->kv.n_blocks > 0) {
            holders++;
            if (!victim || s->running[i]->arrival > victim->arrival)
                victim = s->running[i];
        }
    for (int32_t i = 0; i < s->n_waiting; i++)
        if (s->waiting[i]->kv.n_blocks > 0) {
            holders++;
            if (!victim || s->waiting[i]->arrival > victim->arrival)
                victim = s->waiting[i];
        }
    /* nobody to take from, or only the lone running sequence itself: it cannot fit */
    if (!victim || (holders == 1 && s->n_running == 1 && s->running[0] == victim))
        return false;
    drop_kv(s, victim);
    for (int32_t i = 0; i < s->n_running; i++)
        if (s->running[i] == victim) {
            remove_at(s->running, &s->n_running, i);
            waiting_insert(s, victim);
            break;
        }
    s->preemptions++;
    (*n_preempted)++;
    td_debug("decode sched: request %llu preempted (pool exhausted)",
             (unsigned long long)victim->id);
    return true;
}

/* A kv_out sequence's prompt is computed and its first token sampled: it reports the token
 * (DECODE_FINISH_KV_OUT, with its block table) and moves from running to held, where its
 * blocks stay, whole (no window release), until the caller's decode_sched_release. */
static td_status_t hold_kv_out(decode_sched_t *s, dseq_t *q, int32_t token, const td_token_logprob_t *lp)
{
    td_status_t st = event_add(s, q->id, token, 0, DECODE_FINISH_KV_OUT, TD_OK);
    if (st != TD_OK)
        return st;
    decode_event_t *ev = &s->evb[s->n_events - 1].ev;
    ev->kv_blocks = q->kv.blocks;
    ev->n_kv_blocks = TD_DIV_CEIL(q->kv.n_tokens, td_kv_block_size(s->kv));
    ev->n_kv_tokens = q->kv.n_tokens;
    if (lp) {
        ev->has_logprob = true;
        ev->logprob = *lp;
    }
    TD_ASSERT(q->kv.n_released == 0 && q->kv.n_tokens == q->n_prompt);
    for (int32_t i = 0; i < s->n_running; i++)
        if (s->running[i] == q) {
            remove_at(s->running, &s->n_running, i);
            TD_ASSERT(s->n_held < s->cap_waiting + s->cfg.max_batch);
            s->held[s->n_held++] = q;
            return TD_OK;
        }
    TD_ASSERT(!"kv_out sequence not running");
    return TD_ERR_INTERNAL;
}

static void end_running(decode_sched_t *s, dseq_t *q)
{
    for (int32_t i = 0; i < s->n_running; i++)
        if (s->running[i] == q) {
            remove_at(s->running, &s->n_running, i);
            seq_destroy(s, q);
            return;
        }
    TD_ASSERT(!"finished sequence not running");
}

/* The pool ran out and no sequence of the scheduler holds blocks it could take: the rest
 * are held outside it (on a decode node, the leases of KV still landing from prefill
 * nodes, which come back as admitted sequences or when their lease ends). A sequence whose
 * step fits the whole pool keeps its blocks and its place and waits for them; one that
 * needs more than the whole pool can never run and ends with DECODE_FINISH_ERROR.
 * Returns how many of the step's sequences wait (*st: an event could not be added). */
static int32_t wait_for_blocks(decode_sched_t *s, int32_t n_items, td_status_t *st)
{
    td_kv_stats_t ks;
    td_kv_get_stats(s->kv, &ks);
    int32_t waiting = 0;
    for (int32_t j = 0; j < n_items && *st == TD_OK; j++) {
        dseq_t *q = s->owners[j];
        const td_engine_item_t *it = &s->items[j];
        int32_t held = q->kv.n_blocks - q->kv.n_released;
        int32_t need = td_kv_seq_blocks_needed(s->kv, &q->kv, q->kv.n_tokens + it->n_tokens);
        if (held + need <= ks.n_blocks) {
            waiting++;
            continue;
        }
        td_status_t es = td_errorf(TD_ERR_EXHAUSTED, "decode sched: request %llu needs %d KV blocks, more than the "
                                   "pool's %d: raise --kv-seqs, --kv-mem or --kv-blocks",
                                   (unsigned long long)q->id, held + need, ks.n_blocks);
        if ((*st = event_add(s, q->id, -1, -1, DECODE_FINISH_ERROR, es)) == TD_OK)
            end_running(s, q);
    }
    return waiting;
}

td_status_t decode_sched_step(decode_sched_t *s, int64_t now_ns, decode_step_result_t *res)
{
    td_status_t st = TD_OK;
    s->n_events = 0;
    s->arena_len = 0;
    int32_t n_preempted = 0, n_items = 0, n_tokens = 0, n_prefill = 0;
    int64_t n_context = 0;
    bool stalled = false;
    s->last_ran = false;

    for (int32_t i = 0; i < s->n_pending && st == TD_OK; i++)
        st = event_add(s, s->pending[i].id, -1, -1, s->pending[i].finish, TD_OK);
    s->n_pending = 0;
    for (int32_t i = s->n_running - 1; i >= 0 && st == TD_OK; i--)
        if (s->running[i]->deadline_ns && now_ns >= s->running[i]->deadline_ns)
            st = finish_at(s, s->running, &s->n_running, i, DECODE_FINISH_DEADLINE, TD_ERR_TIMEOUT);
    for (int32_t i = s->n_waiting - 1; i >= 0 && st == TD_OK; i--)
        if (s->waiting[i]->deadline_ns && now_ns >= s->waiting[i]->deadline_ns)
            st = finish_at(s, s->waiting, &s->n_waiting, i, DECODE_FINISH_DEADLINE, TD_ERR_TIMEOUT);
    if (st != TD_OK)
        return st;

    admit_waiting(s);

    /* first tokens from prefill nodes: reported (and stop-checked) before being fed */
    for (int32_t i = s->n_running - 1; i >= 0; i--) {
        dseq_t *q = s->running[i];
        if (!q->pending_first)
            continue;
        decode_finish_t f;
        if ((st = take_token(s, q, q->ctx[q->n_ctx - 1], NULL, &f)) != TD_OK)
            return st;
        if (f != DECODE_FINISH_NONE)
            end_running(s, q);
    }

    bool draft = s->cfg.spec.mode != TD_SPEC_OFF;
    for (;;) {
        n_items = build_batch(s, draft, &n_tokens, &n_prefill, &n_context);
        if (n_items == 0)
            break;
        td_status_t es = td_engine_step(s->eng, s->items, n_items, s->logits);
        if (es == TD_OK)
            break;
        if (es == TD_ERR_EXHAUSTED && draft) { /* drafts go before anyone is preempted */
            draft = false;
            continue;
        }
        if (es == TD_ERR_EXHAUSTED && preempt_youngest(s, &n_preempted))
            continue;
        if (es == TD_ERR_EXHAUSTED) {
            stalled = wait_for_blocks(s, n_items, &st) > 0;
            if (st != TD_OK)
                return st;
            n_items = 0;
            break;
        }
        /* cannot proceed: a failing engine */
        for (int32_t j = 0; j < n_items; j++) {
            dseq_t *q = s->owners[j];
            if ((st = event_add(s, q->id, -1, -1, DECODE_FINISH_ERROR, es)) != TD_OK)
                return st;
            end_running(s, q);
        }
        n_items = 0;
        break;
    }

    /* sliding window: each sequence's blocks behind every layer's window go back to the pool
       once its step is settled (after a verify step's rollback: the window follows the tokens
       kept, not the drafts), before a sequence that finishes gives back the rest */
    int32_t row = 0;
    for (int32_t j = 0; j < n_items; j++) {
        dseq_t *q = s->owners[j];
        const td_engine_item_t *it = &s->items[j];
        if (!it->n_logits) {
            if (!q->kv_out) /* its transfer reads every block of the prompt (as a prefill node's) */
                td_engine_seq_release_window(s->eng, it->seq);
            continue;
        }
        /* row i follows the token fed at i: sampled in order, on while it equals draft i */
        int32_t kv_before = q->kv.n_tokens - it->n_tokens, taken = 0, accepted = 0;
        decode_finish_t f = DECODE_FINISH_NONE;
        for (int32_t i = 0; i < it->n_logits && f == DECODE_FINISH_NONE; i++) {
            const float *lg = s->logits + (size_t)(row + i) * s->mc->vocab_size;
            int32_t token;
            td_token_logprob_t lp;
            td_status_t ss = q->gst ? td_gram_fill_mask(q->gm, q->gst, s->mask) : TD_OK;
            if (ss == TD_OK)
                ss = td_sampler_sample_masked(q->sampler, lg, s->mc->vocab_size, q->gst ? s->mask : NULL, &token);
            if (ss == TD_OK && q->gst) /* the mask allowed it; an EOS leaves the state as it is */
                ss = td_gram_accept_token(q->gm, q->gst, token) == TD_OK
                         ? TD_OK : td_errorf(TD_ERR_INTERNAL, "grammar: token %d was in the mask but the grammar "
                                             "refused it", token);
            if (ss == TD_OK && q->logprobs)
                ss = td_sampler_logprobs(lg, s->mc->vocab_size, token, q->top_logprobs, &lp);
            if (ss != TD_OK) {
                if ((st = event_add(s, q->id, -1, -1, DECODE_FINISH_ERROR, ss)) != TD_OK)
                    return st;
                f = DECODE_FINISH_ERROR;
            } else if (q->kv_out) { /* the first token goes with the KV, as a prefill node's */
                if ((st = hold_kv_out(s, q, token, q->logprobs ? &lp : NULL)) != TD_OK)
                    return st;
                f = DECODE_FINISH_KV_OUT;
            } else if ((st = take_token(s, q, token, q->logprobs ? &lp : NULL, &f)) != TD_OK) {
                return st;
            }
            taken++;
            if (i == q->n_draft || token != q->draft[i])
                break;
            accepted++;
        }
        row += it->n_logits;
        if (it->verify) {
            td_engine_seq_rollback(s->eng, &q->kv, kv_before + taken);
            td_spec_adapt_update(&q->adapt, &s->cfg.spec, q->n_draft, accepted);
            s->spec.verify_steps++;
            s->spec.drafted += (uint64_t)q->n_draft;
            s->spec.accepted += (uint64_t)accepted;
            s->spec.tokens += (uint64_t)taken;
        } else if (s->cfg.spec.mode != TD_SPEC_OFF) {
            s->spec.plain_steps++;
        }
        q->n_draft = 0;
        if (f == DECODE_FINISH_KV_OUT)
            continue; /* held, whole, for the caller's transfer */
        td_engine_seq_release_window(s->eng, it->seq);
        if (f != DECODE_FINISH_NONE)
            end_running(s, q);
    }

    for (int32_t i = 0; i < s->n_events; i++) {
        s->events[i] = s->evb[i].ev;
        size_t end = i + 1 < s->n_events ? s->evb[i + 1].text_off : s->arena_len;
        s->events[i].text = s->tok ? s->arena + s->evb[i].text_off : NULL;
        s->events[i].text_len = end - s->evb[i].text_off;
    }
    s->steps++;
    if (n_items) {
        s->last_ran = true;
        s->last_seqs = n_tokens - n_prefill;
        s->last_prefill = n_prefill;
        s->last_context = n_context;
    }
    *res = (decode_step_result_t){
        .events = s->events,
        .n_events = s->n_events,
        .n_seqs = n_items,
        .n_tokens = n_items ? n_tokens : 0,
        .n_prefill_tokens = n_items ? n_prefill : 0,
        .n_preempted = n_preempted,
        .n_running = s->n_running,
        .n_waiting = s->n_waiting,
        .stalled = stalled,
    };
    return TD_OK;
}

td_status_t decode_sched_release(decode_sched_t *s, uint64_t id)
{
    for (int32_t i = 0; i < s->n_held; i++)
        if (s->held[i]->id == id) {
            dseq_t *q = s->held[i];
            remove_at(s->held, &s->n_held, i);
            seq_destroy(s, q);
            return TD_OK;
        }
    return td_errorf_quiet(TD_ERR_NOT_FOUND, "request %llu: no KV held here for a transfer", (unsigned long long)id);
}

bool decode_sched_busy(const decode_sched_t *s)
{
    return s->n_running > 0 || s->n_waiting > 0 || s->n_pending > 0;
}

void decode_sched_stats(const decode_sched_t *s, decode_sched_stats_t *st)
{
    td_kv_stats_t ks;
    td_kv_get_stats(s->kv, &ks);
    int64_t context = 0; /* bounded by max_batch + max_waiting sequences */
    double tpot = 0;
    for (int32_t i = 0; i < s->n_running + s->n_waiting; i++) {
        const dseq_t *q = i < s->n_running ? s->running[i] : s->waiting[i - s->n_running];
        context += q->n_ctx - q->kv.n_tokens - 1;
        if (q->tpot_s > 0 && (tpot <= 0 || q->tpot_s < tpot))
            tpot = q->tpot_s;
    }
    *st = (decode_sched_stats_t){
        .running = s->n_running,
        .waiting = s->n_waiting,
        .context_tokens = context,
        .free_blocks = ks.free + ks.cached,
        .used_blocks = ks.used,
        .preemptions = s->preemptions,
        .tokens_generated = s->tokens_generated,
        .steps = s->steps,
        .window_released = ks.window_released,
        .spec = s->spec,
        .tpot_objective_s = tpot,
        .kv_out_held = s->n_held,
    };
}

void decode_sched_note_step_time(decode_sched_t *s, double seconds)
{
    if (!s->last_ran)
        return;
    s->last_ran = false;
    td_stepcost_note(&s->cost, s->last_seqs, s->last_context, s->last_prefill, seconds);
    s->fit = td_stepcost_fit(&s->cost);
}

td_stepcost_fit_t decode_sched_step_cost(const decode_sched_t *s)
{
    return s->fit;
}
