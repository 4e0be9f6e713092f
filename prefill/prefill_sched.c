/*
 * prefill_sched: FIFO chunked-prefill batching over td_engine (see prefill_sched.h).
 * Two lists: `queue` (arrival order, not yet complete) and `done` (complete, or failed
 * after being pushed, holding their blocks until released). The layer hook rides on the
 * engine's per-layer hook, set only around steps that finish a prompt.
 */
#include "prefill_sched.h"

#include <stdlib.h>
#include <string.h>

#include "td_kv.h"
#include "td_sched_defaults.h"
#include "td_util.h"

typedef struct pseq {
    uint64_t id;
    int32_t *prompt;
    int32_t n_prompt;
    td_kv_seq_t kv;       /* KV of prompt[0..kv.n_tokens) */
    bool started;         /* prefix attached */
    int32_t n_cached;
    td_sampler_t *sampler;
    int64_t deadline_ns;
    bool pushed;          /* its layers went to the layer hook: blocks held until release */
    bool last_chunk;      /* its item in the running step ends the prompt */
    td_logprobs_want_t lpw;
    td_token_logprob_t *lps; /* with lpw.on: [n_prompt + 1] (lpw.prompt) or [1] */
    td_gram_matcher_t *gm;   /* structured output: the first token's grammar, or NULL */
    td_gram_state_t *gst;    /* its start state */
} pseq_t;

struct prefill_sched {
    td_engine_t *eng;
    const td_model_config_t *mc;
    prefill_sched_config_t cfg;
    pseq_t **queue;
    int32_t n_queue;
    pseq_t **done;        /* [max_queue] */
    int32_t n_done;
    int64_t queued_tokens;
    prefill_output_t *outputs; /* [max_queue] */
    int32_t n_outputs;
    td_engine_item_t *items;   /* [max_batch] */
    pseq_t **owners;
    float *logits;
    uint32_t *mask;            /* [td_gram_mask_words(vocab)] a constrained first token's */
    int32_t block_size;
    prefill_layer_cb hook;
    void *hook_arg;
    prefill_finishing_t *fin;  /* [max_batch] the running step's finishing prompts */
    int32_t n_fin;
    int32_t n_step_items;      /* items of the running engine step */
    bool hook_fired;           /* the running step called the hook at least once */
};

prefill_sched_config_t prefill_sched_config_default(void)
{
    return (prefill_sched_config_t){
        .max_queue = 256,
        .max_queued_tokens = (int64_t)1 << 20,
        .max_batch_tokens = TD_PREFILL_MAX_BATCH_TOKENS,
        .max_batch = TD_PREFILL_MAX_BATCH,
    };
}

static void pseq_destroy(prefill_sched_t *s, pseq_t *q)
{
    if (!q)
        return;
    td_engine_seq_end(s->eng, &q->kv);
    td_sampler_destroy(q->sampler);
    td_gram_state_destroy(q->gst);
    if (q->gm)
        td_gram_cache_release(s->cfg.gram_cache, q->gm);
    free(q->lps);
    free(q->prompt);
    free(q);
}

td_status_t prefill_sched_create(td_engine_t *eng, const prefill_sched_config_t *cfg,
                                 prefill_sched_t **sched_p)
{
    if (cfg->max_queue <= 0 || cfg->max_queued_tokens <= 0 || cfg->max_batch_tokens <= 0 ||
        cfg->max_batch <= 0)
        return td_errorf(TD_ERR_INVALID, "prefill sched: max_queue %d, max_queued_tokens %lld, "
                         "max_batch_tokens %d and max_batch %d must be > 0", cfg->max_queue,
                         (long long)cfg->max_queued_tokens, cfg->max_batch_tokens, cfg->max_batch);
    prefill_sched_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_errorf(TD_ERR_NOMEM, "prefill sched: out of memory");
    const td_engine_config_t *ec = td_engine_config(eng);
    s->eng = eng;
    s->mc = td_engine_model_config(eng);
    s->cfg = *cfg;
    s->cfg.max_batch = TD_MIN(TD_MIN(cfg->max_batch, ec->max_seqs), ec->max_logit_rows);
    s->cfg.max_batch_tokens = TD_MIN(cfg->max_batch_tokens, ec->max_batch_tokens);
    s->block_size = ec->block_size;
    s->queue = calloc((size_t)cfg->max_queue, sizeof *s->queue);
    s->done = calloc((size_t)cfg->max_queue, sizeof *s->done);
    s->outputs = calloc((size_t)cfg->max_queue, sizeof *s->outputs);
    s->items = calloc((size_t)s->cfg.max_batch, sizeof *s->items);
    s->owners = calloc((size_t)s->cfg.max_batch, sizeof *s->owners);
    s->fin = calloc((size_t)s->cfg.max_batch, sizeof *s->fin);
    s->logits = malloc((size_t)s->cfg.max_batch * s->mc->vocab_size * sizeof(float));
    s->mask = malloc(td_gram_mask_words(s->mc->vocab_size) * sizeof *s->mask);
    if (!s->queue || !s->done || !s->outputs || !s->items || !s->owners || !s->logits || !s->fin || !s->mask) {
        prefill_sched_destroy(s);
        return td_errorf(TD_ERR_NOMEM, "prefill sched: out of memory for a queue of %d",
                         cfg->max_queue);
    }
    *sched_p = s;
    return TD_OK;
}

void prefill_sched_destroy(prefill_sched_t *s)
{
    if (!s)
        return;
    for (int32_t i = 0; i < s->n_queue; i++)
        pseq_destroy(s, s->queue[i]);
    for (int32_t i = 0; i < s->n_done; i++)
        pseq_destroy(s, s->done[i]);
    free(s->queue), free(s->done), free(s->outputs), free(s->items), free(s->owners), free(s->fin);
    free(s->logits);
    free(s->mask);
    free(s);
}

static int32_t index_of(pseq_t *const *arr, int32_t n, uint64_t id)
{
    for (int32_t i = 0; i < n; i++)
        if (arr[i]->id == id)
            return i;
    return -1;
}

static void remove_at(pseq_t **arr, int32_t *n, int32_t i)
{
    memmove(&arr[i], &arr[i + 1], (size_t)(*n - i - 1) * sizeof *arr);
    (*n)--;
}

td_status_t prefill_sched_submit(prefill_sched_t *s, const prefill_request_t *req)
{
    unsigned long long rid = (unsigned long long)req->id;
    /* the request was checked at the node's edge (prefill_sched.h, "valid"): what is cheap to
       restate is restated, the per-token and sampling checks are not run twice */
    const td_logprobs_want_t *w = &req->logprobs;
    TD_ASSERT(req->prompt && req->n_prompt >= 1 && req->n_prompt < s->mc->max_seq_len);
    TD_ASSERT(!w->on || (w->top >= 0 && w->top <= TD_LOGPROBS_MAX_TOP &&
                         (!w->prompt || req->n_prompt <= TD_LOGPROBS_MAX_PROMPT)));
    if (index_of(s->queue, s->n_queue, req->id) >= 0 || index_of(s->done, s->n_done, req->id) >= 0)
        return td_errorf_quiet(TD_ERR_INVALID, "request %llu: id already live", rid);
    if (s->n_queue + s->n_done >= s->cfg.max_queue ||
        s->queued_tokens + req->n_prompt > s->cfg.max_queued_tokens)
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "request %llu: prefill queue full (%d prompts, "
                               "%lld tokens)", rid, s->n_queue + s->n_done,
                               (long long)s->queued_tokens);
    td_status_t st;
    pseq_t *q = calloc(1, sizeof *q);
    if (!q)
        return td_errorf(TD_ERR_NOMEM, "request %llu: out of memory", rid);
    td_kv_seq_init(&q->kv);
    q->kv.salt = req->cache_salt; /* kept when a restart frees the sequence */
    q->id = req->id;
    q->n_prompt = req->n_prompt;
    q->deadline_ns = req->deadline_ns;
    q->lpw = req->logprobs.on ? req->logprobs : (td_logprobs_want_t){0};
    q->prompt = malloc((size_t)req->n_prompt * sizeof *q->prompt);
    if (q->lpw.on)
        q->lps = malloc((size_t)(q->lpw.prompt ? req->n_prompt + 1 : 1) * sizeof *q->lps);
    if (!q->prompt || (q->lpw.on && !q->lps) || (st = td_sampler_create(&req->sampling, &q->sampler)) != TD_OK) {
        pseq_destroy(s, q);
        return td_errorf(TD_ERR_NOMEM, "request %llu: out of memory", rid);
    }
    memcpy(q->prompt, req->prompt, (size_t)req->n_prompt * sizeof *q->prompt);
    if (req->grammar) { /* a repeat is a cache hit; a new one compiles here, within td_gram's bounds */
        st = s->cfg.gram_cache ? td_gram_cache_get(s->cfg.gram_cache, TD_GRAM_GBNF, req->grammar,
                                                   strlen(req->grammar), &q->gm)
                               : td_errorf_quiet(TD_ERR_INVALID, "no tokenizer on this node for a grammar");
        if (st == TD_OK)
            st = td_gram_state_create(td_gram_matcher_grammar(q->gm), &q->gst);
        if (st != TD_OK) {
            pseq_destroy(s, q);
            return st == TD_ERR_NOMEM ? td_errorf(st, "request %llu: out of memory", rid)
                                      : td_errorf_quiet(TD_ERR_INVALID, "request %llu: grammar: %s", rid,
                                                        td_last_error());
        }
    }
    for (int32_t i = 0; i < req->n_prompt; i++)
        td_sampler_accept_prompt(q->sampler, req->prompt[i]);
    s->queue[s->n_queue++] = q;
    s->queued_tokens += q->n_prompt;
    return TD_OK;
}

/* Takes q out of the queue (its remaining tokens no longer count). */
static void unqueue(prefill_sched_t *s, int32_t i)
{
    pseq_t *q = s->queue[i];
    s->queued_tokens -= q->n_prompt - q->kv.n_tokens;
    remove_at(s->queue, &s->n_queue, i);
}

td_status_t prefill_sched_cancel(prefill_sched_t *s, uint64_t id)
{
    int32_t i = index_of(s->queue, s->n_queue, id);
    if (i >= 0) {
        pseq_t *q = s->queue[i];
        unqueue(s, i);
        pseq_destroy(s, q);
        return TD_OK;
    }
    return prefill_sched_release(s, id);
}

td_status_t prefill_sched_release(prefill_sched_t *s, uint64_t id)
{
    int32_t i = index_of(s->done, s->n_done, id);
    if (i < 0)
        return td_errorf_quiet(TD_ERR_NOT_FOUND, "request %llu: no such prefill",
                               (unsigned long long)id);
    pseq_t *q = s->done[i];
    remove_at(s->done, &s->n_done, i);
    pseq_destroy(s, q);
    return TD_OK;
}

bool prefill_sched_pending(const prefill_sched_t *s, uint64_t id)
{
    return index_of(s->queue, s->n_queue, id) >= 0;
}

void prefill_sched_set_layer_hook(prefill_sched_t *s, prefill_layer_cb cb, void *arg)
{
    s->hook = cb;
    s->hook_arg = cb ? arg : NULL;
}

/* Fails queue[i]: an output with `st`, everything released, except that a pushed prompt
 * keeps its blocks (a transfer may be reading them) until the caller releases it. */
static void fail_at(prefill_sched_t *s, int32_t i, td_status_t st)
{
    pseq_t *q = s->queue[i];
    s->outputs[s->n_outputs++] = (prefill_output_t){.id = q->id, .status = st, .first_token = -1,
                                                    .held = q->pushed};
    unqueue(s, i);
    if (q->pushed)
        s->done[s->n_done++] = q;
    else
        pseq_destroy(s, q);
}

/* The engine's per-layer hook during a step that finishes prompts. */
static void on_engine_layer(void *arg, uint32_t layer)
{
    prefill_sched_t *s = arg;
    if (!s->hook_fired) {
        s->hook_fired = true;
        s->n_fin = 0;
        for (int32_t k = 0; k < s->n_step_items; k++) {
            pseq_t *q = s->owners[k];
            if (!q->last_chunk)
                continue;
            q->pushed = true;
            s->fin[s->n_fin++] = (prefill_finishing_t){
                .id = q->id, .blocks = q->kv.blocks,
                .n_blocks = (int32_t)TD_DIV_CEIL(q->n_prompt, s->block_size), .n_prompt = q->n_prompt};
        }
    }
    s->hook(s->hook_arg, layer, s->fin, s->n_fin);
}

/* Runs the engine step over items[0..n_items), with the layer hook when it finishes a
 * prompt. */
static td_status_t engine_step(prefill_sched_t *s, int32_t n_items)
{
    bool finishing = false;
    for (int32_t k = 0; k < n_items; k++)
        finishing |= s->owners[k]->last_chunk;
    s->hook_fired = false;
    s->n_step_items = n_items;
    bool hooked = s->hook && finishing;
    if (hooked)
        td_engine_set_layer_hook(s->eng, on_engine_layer, s);
    td_status_t st = td_engine_step(s->eng, s->items, n_items, s->logits);
    if (hooked)
        td_engine_set_layer_hook(s->eng, NULL, NULL);
    return st;
}

/* Packs the queue into items: a token budget, and a logit-row budget (the logits buffer's
 * max_batch rows): a finishing chunk takes one row, a prompt-logprobs chunk one per token. */
static int32_t build_batch(prefill_sched_t *s, int32_t max_items, int32_t *n_tokens_p)
{
    int32_t k = 0, budget = s->cfg.max_batch_tokens, rows = s->cfg.max_batch;
    for (int32_t i = 0; i < s->n_queue && k < max_items && budget > 0 && rows > 0; i++) {
        pseq_t *q = s->queue[i];
        if (!q->started && q->lpw.prompt) {
            q->started = true; /* no cached prefix: every position's logits are computed */
            q->n_cached = 0;
        } else if (!q->started) {
            int32_t cached = 0;
            if (td_engine_seq_start(s->eng, &q->kv, q->prompt, q->n_prompt, &cached) != TD_OK) {
                td_engine_seq_end(s->eng, &q->kv); /* empty again, its salt kept */
                cached = 0;
            }
            q->started = true;
            q->n_cached = cached;
            s->queued_tokens -= cached;
        }
        int32_t rest = q->n_prompt - q->kv.n_tokens;
        int32_t n = TD_MIN(rest, budget);
        if (q->lpw.prompt)
            n = TD_MIN(n, rows);
        int32_t n_logits = q->lpw.prompt ? n : n == rest;
        q->last_chunk = n == rest;
        s->items[k] = (td_engine_item_t){.seq = &q->kv, .tokens = q->prompt + q->kv.n_tokens,
                                         .n_tokens = n, .n_logits = n_logits};
        s->owners[k++] = q;
        budget -= n;
        rows -= n_logits;
    }
    *n_tokens_p = s->cfg.max_batch_tokens - budget;
    return k;
}

/* Restarts the youngest started prompt (its blocks back to the pool). */
static void restart_youngest(prefill_sched_t *s)
{
    for (int32_t i = s->n_queue - 1; i >= 0; i--) {
        pseq_t *q = s->queue[i];
        if (!q->started)
            continue;
        s->queued_tokens += q->kv.n_tokens;
        td_engine_seq_end(s->eng, &q->kv); /* empty again, its salt kept */
        q->started = false;
        q->n_cached = 0;
        return;
    }
}

td_status_t prefill_sched_step(prefill_sched_t *s, int64_t now_ns, prefill_step_result_t *res)
{
    s->n_outputs = 0;
    int32_t n_items = 0, n_tokens = 0, n_restarted = 0;
    for (int32_t i = s->n_queue - 1; i >= 0; i--)
        if (s->queue[i]->deadline_ns && now_ns >= s->queue[i]->deadline_ns)
            fail_at(s, i, TD_ERR_TIMEOUT);

    int32_t max_items = s->cfg.max_batch;
    for (;;) {
        n_items = build_batch(s, max_items, &n_tokens);
        if (n_items == 0)
            break;
        td_status_t es = engine_step(s, n_items);
        if (es == TD_OK)
            break;
        if (es == TD_ERR_EXHAUSTED && s->hook_fired) /* not the reservation: a real failure */
            es = td_errorf(TD_ERR_INTERNAL, "prefill sched: the engine ran out of blocks after "
                           "reserving them");
        if (es == TD_ERR_EXHAUSTED && n_items > 1) {
            /* the batch's youngest gives its blocks back and sits this step out */
            restart_youngest(s);
            n_restarted++;
            max_items = n_items - 1;
            continue;
        }
        int32_t n_fail = n_items;
        n_items = 0;
        if (es == TD_ERR_EXHAUSTED && s->n_done > 0)
            break; /* done prompts still hold blocks: wait for their release */
        if (es == TD_ERR_EXHAUSTED)
            td_errorf(es, "prefill sched: request %llu: a prompt of %d tokens does not fit the KV "
                      "pool", (unsigned long long)s->owners[0]->id, s->owners[0]->n_prompt);
        /* a lone prompt larger than the pool, or a failing engine: the step's prompts fail */
        for (int32_t j = 0; j < n_fail; j++)
            fail_at(s, index_of(s->queue, s->n_queue, s->owners[j]->id), es);
        break;
    }

    int32_t row = 0;
    const int32_t vocab = s->mc->vocab_size;
    for (int32_t j = 0; j < n_items; j++) {
        pseq_t *q = s->owners[j];
        const td_engine_item_t *it = &s->items[j];
        s->queued_tokens -= it->n_tokens;
        const float *rows = s->logits + (size_t)row * vocab;
        row += it->n_logits;
        td_status_t ss = TD_OK;
        if (q->lpw.prompt) {
            /* row r of this chunk follows token start + r: it scores the next prompt token */
            int32_t start = (int32_t)(it->tokens - q->prompt);
            if (start == 0)
                q->lps[0] = (td_token_logprob_t){.token = q->prompt[0]}; /* no context */
            for (int32_t r = 0; r < it->n_logits && ss == TD_OK; r++) {
                int32_t pos = start + r + 1;
                if (pos < q->n_prompt)
                    ss = td_sampler_logprobs(rows + (size_t)r * vocab, vocab, q->prompt[pos], q->lpw.top,
                                             &q->lps[pos]);
            }
            rows += (size_t)(it->n_logits - 1) * vocab; /* the last row gives the first token */
        }
        if (!q->last_chunk && ss == TD_OK)
            continue;
        int32_t token = -1;
        if (ss == TD_OK && q->gst)
            ss = td_gram_fill_mask(q->gm, q->gst, s->mask);
        if (ss == TD_OK)
            ss = td_sampler_sample_masked(q->sampler, rows, vocab, q->gst ? s->mask : NULL, &token);
        if (ss == TD_OK && q->lpw.on)
            ss = td_sampler_logprobs(rows, vocab, token, q->lpw.top, &q->lps[q->lpw.prompt ? q->n_prompt : 0]);
        int32_t i = index_of(s->queue, s->n_queue, q->id);
        TD_ASSERT(i >= 0);
        if (ss != TD_OK) {
            fail_at(s, i, ss);
            continue;
        }
        remove_at(s->queue, &s->n_queue, i);
        s->done[s->n_done++] = q;
        s->outputs[s->n_outputs++] = (prefill_output_t){
            .id = q->id, .status = TD_OK, .first_token = token, .seq = &q->kv,
            .n_cached = q->n_cached, .logprobs = q->lps,
            .n_logprobs = q->lpw.on ? (q->lpw.prompt ? q->n_prompt + 1 : 1) : 0};
        q->lps = NULL; /* the caller's now */
    }
    *res = (prefill_step_result_t){
        .outputs = s->outputs,
        .n_outputs = s->n_outputs,
        .n_seqs = n_items,
        .n_tokens = n_items ? n_tokens : 0,
        .n_restarted = n_restarted,
    };
    return TD_OK;
}

int64_t prefill_sched_queued_tokens(const prefill_sched_t *s)
{
    return s->queued_tokens;
}

int32_t prefill_sched_queued(const prefill_sched_t *s)
{
    return s->n_queue;
}

int32_t prefill_sched_unreleased(const prefill_sched_t *s)
{
    return s->n_done;
}
