/*
 * test_decode_sched: the decode scheduler on the real stories260K checkpoint. Requests
 * admitted at different steps with different lengths yield exactly the greedy tokens each
 * yields alone through the engine; finish reasons are right; cancel and deadlines give
 * every block back at once; a pool too small for everyone preempts and recomputes without
 * changing a token or leaking a block; KV adopted from "elsewhere" continues correctly.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode_sched.h"
#include "td_backend.h"
#include "td_engine.h"
#include "td_kv.h"
#include "td_model.h"

static const char *stories_path(void)
{
    static char path[4096];
    const char *d = getenv("TANDEM_TEST_MODELS");
    snprintf(path, sizeof path, "%s/stories260K/stories260K.bin",
             d ? d : TD_SOURCE_DIR "/../shared/models");
    return path;
}

static void skip_without_model(void)
{
    FILE *f = fopen(stories_path(), "rb");
    if (!f)
        cr_skip_test("skipped: %s not found (set TANDEM_TEST_MODELS to the shared models folder)",
                     stories_path());
    fclose(f);
}

typedef struct fixture {
    td_model_t *model;
    td_backend_t *be;
    td_engine_t *eng;
    int vocab;
} fixture_t;

static void fx_open(fixture_t *fx, int n_blocks, bool prefix_cache)
{
    cr_assert_eq(td_model_load(stories_path(), &fx->model), TD_OK, "%s", td_last_error());
    td_cpu_config_t cc = {.n_threads = 1};
    cr_assert_eq(td_backend_cpu_create(&cc, &fx->be), TD_OK);
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = n_blocks;
    ec.prefix_cache = prefix_cache;
    cr_assert_eq(td_engine_create(fx->model, fx->be, &ec, &fx->eng), TD_OK, "%s", td_last_error());
    fx->vocab = fx->model->config.vocab_size;
}

static void fx_close(fixture_t *fx)
{
    td_engine_destroy(fx->eng);
    td_backend_destroy(fx->be);
    td_model_destroy(fx->model);
}

static int argmax(const float *v, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b])
            b = i;
    return b;
}

static bool is_eos(const fixture_t *fx, int t)
{
    for (int i = 0; i < fx->model->config.n_eos; i++)
        if (fx->model->config.eos_ids[i] == t)
            return true;
    return false;
}

/* The request alone through the engine (whole prompt in one step, greedy): returns the
 * number of output tokens; *eos_p when an EOS ended it. */
static int alone(fixture_t *fx, const int32_t *prompt, int n_prompt, int max_tokens, int32_t *out,
                 bool *eos_p)
{
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    float *logits = malloc((size_t)fx->vocab * sizeof(float));
    td_engine_item_t it = {.seq = &seq, .tokens = prompt, .n_tokens = n_prompt, .n_logits = 1};
    cr_assert_eq(td_engine_step(fx->eng, &it, 1, logits), TD_OK, "%s", td_last_error());
    int n = 0;
    *eos_p = false;
    int limit = max_tokens < fx->model->config.max_seq_len - n_prompt
                    ? max_tokens : fx->model->config.max_seq_len - n_prompt;
    for (;;) {
        int32_t t = argmax(logits, fx->vocab);
        if (is_eos(fx, t)) {
            *eos_p = true;
            break;
        }
        out[n++] = t;
        if (n == limit)
            break;
        it = (td_engine_item_t){.seq = &seq, .tokens = &out[n - 1], .n_tokens = 1, .n_logits = 1};
        cr_assert_eq(td_engine_step(fx->eng, &it, 1, logits), TD_OK, "%s", td_last_error());
    }
    td_engine_seq_end(fx->eng, &seq);
    free(logits);
    return n;
}

static unsigned rng_next(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return (*s >> 8) & 0xffffff;
}

static void random_prompt(unsigned *s, int32_t *p, int n)
{
    p[0] = 1;
    for (int i = 1; i < n; i++)
        p[i] = 3 + (int32_t)(rng_next(s) % 509);
}

enum { MAXN = 16, MAXT = 600 };

typedef struct outcome {
    int32_t tokens[MAXT];
    int n;
    decode_finish_t finish;
    td_status_t status;
    int finish_events;
} outcome_t;

/* Folds a step's events into per-request outcomes (ids are 0..MAXN-1). */
static void collect(const decode_step_result_t *r, outcome_t *oc)
{
    for (int i = 0; i < r->n_events; i++) {
        const decode_event_t *e = &r->events[i];
        cr_assert_lt(e->id, (uint64_t)MAXN);
        outcome_t *o = &oc[e->id];
        cr_assert_eq(o->finish_events, 0, "request %llu has events after its finish",
                     (unsigned long long)e->id);
        if (e->token >= 0) {
            cr_assert_eq(e->index, o->n, "request %llu: token index %d, expected %d",
                         (unsigned long long)e->id, e->index, o->n);
            o->tokens[o->n++] = e->token;
        }
        if (e->finish != DECODE_FINISH_NONE) {
            o->finish = e->finish;
            o->status = e->status;
            o->finish_events++;
        }
    }
}

static decode_request_t greedy_request(uint64_t id, const int32_t *prompt, int n_prompt, int max_tokens)
{
    return (decode_request_t){.id = id, .prompt = prompt, .n_prompt = n_prompt,
                              .sampling = td_sampling_default(), .max_tokens = max_tokens};
}

static void assert_no_leak(fixture_t *fx, decode_sched_t *ds)
{
    decode_sched_stats_t st;
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.used_blocks, 0, "%d blocks still referenced after every request ended",
                 st.used_blocks);
    cr_assert_eq(td_kv_cache_check(td_engine_kv(fx->eng)), TD_OK, "%s", td_last_error());
}

/* N staggered requests; returns preemptions seen. */
static uint64_t run_staggered(fixture_t *fx, const decode_sched_config_t *cfg, int n, unsigned seed,
                              int max_prompt, int max_gen, int every)
{
    static int32_t prompts[MAXN][MAXT], want[MAXN][MAXT];
    int n_prompt[MAXN], max_tokens[MAXN], n_want[MAXN];
    bool eos[MAXN];
    static outcome_t oc[MAXN];
    memset(oc, 0, sizeof oc);
    unsigned s = seed;
    for (int i = 0; i < n; i++) {
        n_prompt[i] = 1 + (int)(rng_next(&s) % (unsigned)max_prompt);
        random_prompt(&s, prompts[i], n_prompt[i]);
        max_tokens[i] = 1 + (int)(rng_next(&s) % (unsigned)max_gen);
        n_want[i] = alone(fx, prompts[i], n_prompt[i], max_tokens[i], want[i], &eos[i]);
    }
    decode_sched_t *ds;
    cr_assert_eq(decode_sched_create(fx->eng, NULL, cfg, &ds), TD_OK);
    int admitted = 0;
    for (int step = 0; step < 10000 && (admitted < n || decode_sched_busy(ds)); step++) {
        if (admitted < n && step % every == 0) {
            decode_request_t rq = greedy_request((uint64_t)admitted, prompts[admitted],
                                                 n_prompt[admitted], max_tokens[admitted]);
            cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
            admitted++;
        }
        decode_step_result_t r;
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        cr_assert_leq(r.n_tokens, cfg->max_batch_tokens);
        cr_assert_leq(r.n_seqs, cfg->max_batch);
        collect(&r, oc);
    }
    cr_assert(!decode_sched_busy(ds), "requests left after 10000 steps");
    for (int i = 0; i < n; i++) {
        cr_assert_eq(oc[i].finish_events, 1, "request %d finished %d times", i, oc[i].finish_events);
        cr_assert_eq(oc[i].finish, eos[i] ? DECODE_FINISH_STOP : DECODE_FINISH_LENGTH,
                     "request %d: finish %s", i, decode_finish_name(oc[i].finish));
        cr_assert_eq(oc[i].n, n_want[i], "request %d: %d tokens, alone %d", i, oc[i].n, n_want[i]);
        for (int t = 0; t < n_want[i]; t++)
            cr_assert_eq(oc[i].tokens[t], want[i][t], "request %d token %d: %d, alone %d", i, t,
                         oc[i].tokens[t], want[i][t]);
    }
    assert_no_leak(fx, ds);
    decode_sched_stats_t st;
    decode_sched_stats(ds, &st);
    decode_sched_destroy(ds);
    return st.preemptions;
}

Test(decode_sched, staggered_requests_match_alone, .timeout = 300)
{
    skip_without_model();
    fixture_t fx;
    fx_open(&fx, 1024, true);
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.max_batch = 6;          /* fewer slots than requests: some wait */
    cfg.max_batch_tokens = 48;  /* prompts are chunked and share steps with decodes */
    cfg.prefill_chunk = 20;
    uint64_t pre = run_staggered(&fx, &cfg, MAXN, 11, 120, 80, 3);
    cr_assert_eq(pre, 0, "a roomy pool preempted");
    fx_close(&fx);
}

Test(decode_sched, preemption_under_a_tiny_pool_keeps_tokens_and_blocks, .timeout = 300)
{
    skip_without_model();
    fixture_t fx;
    fx_open(&fx, 16, true); /* 256 tokens for 8 requests of up to 60 + 120 */
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.max_batch = 8;
    cfg.max_batch_tokens = 64;
    cfg.prefill_chunk = 32;
    uint64_t pre = run_staggered(&fx, &cfg, 8, 5, 60, 120, 1);
    cr_assert_gt(pre, 0, "the tiny pool never preempted: the test does not test preemption");
    fx_close(&fx);

    fx_open(&fx, 16, false); /* and without the prefix cache to lean on */
    pre = run_staggered(&fx, &cfg, 8, 6, 60, 120, 1);
    cr_assert_gt(pre, 0);
    fx_close(&fx);
}

Test(decode_sched, cancel_and_deadline_return_every_block, .timeout = 120)
{
    skip_without_model();
    fixture_t fx;
    fx_open(&fx, 256, true);
    decode_sched_t *ds;
    decode_sched_config_t cfg = decode_sched_config_default();
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_OK);
    int32_t p0[40], p1[40];
    unsigned s = 3;
    random_prompt(&s, p0, 40);
    random_prompt(&s, p1, 40);
    /* a long-running neighbour whose blocks stay */
    decode_request_t other = greedy_request(7, p1, 40, 200);
    cr_assert_eq(decode_sched_admit(ds, &other), TD_OK);
    decode_step_result_t r;
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    decode_sched_stats_t st;
    static outcome_t oc[MAXN];
    memset(oc, 0, sizeof oc);
    collect(&r, oc);

    decode_request_t rq = greedy_request(1, p0, 40, 200);
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_ERR_INVALID, "duplicate id accepted");
    for (int i = 0; i < 30; i++) {
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        collect(&r, oc);
    }
    cr_assert_eq(oc[7].finish_events + oc[1].finish_events, 0, "random prompts ended early: "
                 "change the seed");
    /* the neighbour holds the KV of its prompt and all but its last token */
    int32_t before = (40 + oc[7].n - 1 + 15) / 16;
    decode_sched_stats(ds, &st);
    cr_assert_gt(st.used_blocks, before);
    cr_assert_eq(decode_sched_cancel(ds, 1), TD_OK);
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.used_blocks, before, "after cancel %d blocks used, %d before the request",
                 st.used_blocks, before);
    cr_assert_eq(decode_sched_cancel(ds, 1), TD_ERR_NOT_FOUND);
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    int cancelled = 0;
    for (int i = 0; i < r.n_events; i++) {
        if (r.events[i].id == 1) {
            cr_assert_eq(r.events[i].finish, DECODE_FINISH_CANCELLED);
            cr_assert_eq(r.events[i].token, -1);
            cancelled++;
        } else {
            cr_assert_eq(r.events[i].id, 7);
        }
    }
    cr_assert_eq(cancelled, 1);

    /* a deadline: the step at or after it ends the request and frees its blocks */
    rq.id = 2;
    rq.deadline_ns = 1000;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    for (int i = 0; i < 10; i++)
        cr_assert_eq(decode_sched_step(ds, 999, &r), TD_OK);
    memset(oc, 0, sizeof oc);
    cr_assert_eq(decode_sched_step(ds, 1000, &r), TD_OK);
    decode_sched_stats(ds, &st);
    before = st.used_blocks; /* the neighbour alone, measured after the deadline step */
    bool deadline = false;
    for (int i = 0; i < r.n_events; i++)
        if (r.events[i].id == 2) {
            cr_assert_eq(r.events[i].finish, DECODE_FINISH_DEADLINE);
            cr_assert_eq(r.events[i].status, TD_ERR_TIMEOUT);
            deadline = true;
        }
    cr_assert(deadline);
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.used_blocks, before);
    cr_assert_eq(decode_sched_cancel(ds, 7), TD_OK);
    assert_no_leak(&fx, ds);
    decode_sched_destroy(ds);
    fx_close(&fx);
}

Test(decode_sched, stop_ids_and_limits, .timeout = 120)
{
    skip_without_model();
    fixture_t fx;
    fx_open(&fx, 256, true);
    int32_t p[30], want[64];
    unsigned s = 9;
    random_prompt(&s, p, 30);
    bool eos;
    int n = alone(&fx, p, 30, 20, want, &eos);
    cr_assert_geq(n, 6, "prompt too short-lived for the test");
    decode_sched_t *ds;
    decode_sched_config_t cfg = decode_sched_config_default();
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_OK);
    /* the 6th token as a stop id: 5 tokens, then STOP without the stop token */
    decode_request_t rq = greedy_request(3, p, 30, 20);
    int32_t stop_id = want[5];
    bool earlier = false;
    for (int i = 0; i < 5; i++)
        earlier |= want[i] == stop_id;
    rq.stop_ids = &stop_id;
    rq.n_stop_ids = 1;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    outcome_t oc[MAXN] = {0};
    while (decode_sched_busy(ds)) {
        decode_step_result_t r;
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        collect(&r, oc);
    }
    cr_assert_eq(oc[3].finish, DECODE_FINISH_STOP);
    if (!earlier)
        cr_assert_eq(oc[3].n, 5);
    for (int i = 0; i < oc[3].n; i++)
        cr_assert_eq(oc[3].tokens[i], want[i]);
    /* invalid requests are refused without side effects */
    rq = greedy_request(4, p, 30, 0);
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_ERR_INVALID);
    int32_t bad = 100000;
    rq = greedy_request(4, &bad, 1, 5);
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_ERR_INVALID);
    const char *stops[] = {"x"};
    rq = greedy_request(4, p, 30, 5);
    rq.stops = stops;
    rq.n_stops = 1;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_ERR_INVALID, "stop strings without a tokenizer");
    static int32_t longp[4096];
    rq = greedy_request(4, longp, fx.model->config.max_seq_len, 5);
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_ERR_RANGE);
    /* the model's length caps max_tokens: LENGTH at max_seq_len */
    int L = fx.model->config.max_seq_len;
    rq = greedy_request(5, longp, L - 4, 100);
    for (int i = 0; i < L - 4; i++)
        longp[i] = 3 + i % 500;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    memset(oc, 0, sizeof oc);
    while (decode_sched_busy(ds)) {
        decode_step_result_t r;
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        collect(&r, oc);
    }
    cr_assert(oc[5].finish == DECODE_FINISH_LENGTH || oc[5].finish == DECODE_FINISH_STOP);
    if (oc[5].finish == DECODE_FINISH_LENGTH)
        cr_assert_eq(oc[5].n, 4);
    assert_no_leak(&fx, ds);
    decode_sched_destroy(ds);
    fx_close(&fx);
}

/* KV computed "elsewhere" (another sequence in the same pool, as a prefill node's push
 * would leave it) is adopted and the generation continues as if local. */
Test(decode_sched, adopted_kv_continues_the_generation, .timeout = 120)
{
    skip_without_model();
    fixture_t fx;
    fx_open(&fx, 256, false); /* adopt needs private, unregistered blocks */
    int32_t p[50], want[64];
    unsigned s = 21;
    random_prompt(&s, p, 50);
    bool eos;
    int n = alone(&fx, p, 50, 30, want, &eos);
    cr_assert_geq(n, 2);

    td_kv_seq_t pre;
    td_kv_seq_init(&pre);
    float *logits = malloc((size_t)fx.vocab * sizeof(float));
    td_engine_item_t it = {.seq = &pre, .tokens = p, .n_tokens = 50, .n_logits = 1};
    cr_assert_eq(td_engine_step(fx.eng, &it, 1, logits), TD_OK);
    int32_t first = argmax(logits, fx.vocab);
    cr_assert_eq(first, want[0]);

    decode_sched_t *ds;
    decode_sched_config_t cfg = decode_sched_config_default();
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_OK);
    decode_request_t rq = greedy_request(9, p, 50, 30);
    rq.kv_blocks = pre.blocks;
    rq.n_kv_blocks = pre.n_blocks;
    rq.first_token = first;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
    /* the references moved to the scheduler: drop the husk without unref */
    free(pre.blocks);
    free(pre.tokens);
    outcome_t oc[MAXN] = {0};
    while (decode_sched_busy(ds)) {
        decode_step_result_t r;
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        collect(&r, oc);
    }
    cr_assert_eq(oc[9].n, n);
    for (int i = 0; i < n; i++)
        cr_assert_eq(oc[9].tokens[i], want[i], "token %d: %d, alone %d", i, oc[9].tokens[i], want[i]);
    cr_assert_eq(oc[9].finish, eos ? DECODE_FINISH_STOP : DECODE_FINISH_LENGTH);
    assert_no_leak(&fx, ds);
    decode_sched_destroy(ds);
    free(logits);
    fx_close(&fx);
}
