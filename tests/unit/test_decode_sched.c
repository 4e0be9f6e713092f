/*
 * test_decode_sched: the decode scheduler on the real stories260K checkpoint. Requests
 * admitted at different steps with different lengths yield exactly the greedy tokens each
 * yields alone through the engine; finish reasons are right; cancel and deadlines give
 * every block back at once; a pool too small for everyone preempts and recomputes without
 * changing a token or leaking a block; KV adopted from "elsewhere" continues correctly,
 * and with a seed continues the random stream the "prefill" sampler began; presence and
 * frequency penalties and log-probabilities equal one process's sampler; a migrated
 * stream (its earlier tokens replayed one row per step) continues with the one-process
 * tokens and the same logprob floats; KV pushed
 * through td_xfer lands in the engine's own pool (the decode node's one-pool arrangement)
 * and every leased block returns on finish, cancel, expiry and sender failure.
 *
 * The unified role (`tandem unified`) runs this scheduler with every request prefilled
 * here: its tests (unified_*) check that a step carries every running sequence's token
 * first and prompt chunks only within the token budget (a long prompt never stalls the
 * decodes: Sarathi-style chunked prefill), that ignore_eos runs past EOS to max_tokens, and
 * that a cancel in the middle of a chunked prefill gives every block back at once, and that
 * cancel_all (a node the router dropped) ends every sequence but the kv_out ones.
 *
 * Speculative decoding (speculation_*, draft_model_*): prompt lookup and a draft model change
 * the number of steps, not the tokens or logprob floats, and a draft model's blocks go back
 * with the sequence's own on finish, cancel, deadline and preemption.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "decode_sched.h"
#include "td_backend.h"
#include "td_engine.h"
#include "td_kv.h"
#include "td_model.h"
#include "td_test_models.h"
#include "td_sampler.h"
#include "td_sched_defaults.h"
#include "td_util.h"
#include "td_xfer.h"
#include "td_xfer_testkit.h"

static bool is_eos(const td_test_engine_t *fx, int t)
{
    for (int i = 0; i < fx->model->config.n_eos; i++)
        if (fx->model->config.eos_ids[i] == t)
            return true;
    return false;
}

/* The request alone through the engine (whole prompt in one step, greedy): returns the
 * number of output tokens; *eos_p when an EOS ended it. */
static int alone(td_test_engine_t *fx, const int32_t *prompt, int n_prompt, int max_tokens, int32_t *out,
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
        int32_t t = td_test_argmax(logits, fx->vocab);
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
    float lps[MAXT];        /* tokens[i]'s log-probability, when the event had one */
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
            o->lps[o->n] = e->has_logprob ? e->logprob.logprob : 0.0f;
            o->tokens[o->n++] = e->token;
        }
        if (e->finish != DECODE_FINISH_NONE) {
            o->finish = e->finish;
            o->status = e->status;
            o->finish_events++;
        }
    }
}

/* Steps (at time 0) until nothing is left, folding every event into oc. */
static void run_to_end(decode_sched_t *ds, outcome_t *oc)
{
    while (decode_sched_busy(ds)) {
        decode_step_result_t r;
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        collect(&r, oc);
    }
}

static decode_request_t greedy_request(uint64_t id, const int32_t *prompt, int n_prompt, int max_tokens)
{
    return (decode_request_t){.id = id, .prompt = prompt, .n_prompt = n_prompt,
                              .sampling = td_sampling_default(), .max_tokens = max_tokens};
}

static void assert_no_leak(td_test_engine_t *fx, decode_sched_t *ds)
{
    decode_sched_stats_t st;
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.used_blocks, 0, "%d blocks still referenced after every request ended",
                 st.used_blocks);
    cr_assert_eq(td_kv_cache_check(td_engine_kv(fx->eng)), TD_OK, "%s", td_last_error());
}

/* A scheduler on eng with the default config. */
static decode_sched_t *sched_default(td_engine_t *eng)
{
    decode_sched_t *ds;
    decode_sched_config_t cfg = decode_sched_config_default();
    cr_assert_eq(decode_sched_create(eng, NULL, &cfg, &ds), TD_OK, "%s", td_last_error());
    return ds;
}

/* Every request ended: assert_no_leak, then the scheduler goes. */
static void sched_end(td_test_engine_t *fx, decode_sched_t *ds)
{
    assert_no_leak(fx, ds);
    decode_sched_destroy(ds);
}

/* N staggered requests; returns preemptions seen. */
static uint64_t run_staggered(td_test_engine_t *fx, const decode_sched_config_t *cfg, int n, unsigned seed,
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
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 1024, true);
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.max_batch = 6;          /* fewer slots than requests: some wait */
    cfg.max_batch_tokens = 48;  /* prompts are chunked and share steps with decodes */
    cfg.prefill_chunk = 20;
    uint64_t pre = run_staggered(&fx, &cfg, MAXN, 11, 120, 80, 3);
    cr_assert_eq(pre, 0, "a roomy pool preempted");
    td_test_engine_close(&fx);
}

Test(decode_sched, preemption_under_a_tiny_pool_keeps_tokens_and_blocks, .timeout = 300)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 16, true); /* 256 tokens for 8 requests of up to 60 + 120 */
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.max_batch = 8;
    cfg.max_batch_tokens = 64;
    cfg.prefill_chunk = 32;
    uint64_t pre = run_staggered(&fx, &cfg, 8, 5, 60, 120, 1);
    cr_assert_gt(pre, 0, "the tiny pool never preempted: the test does not test preemption");
    td_test_engine_close(&fx);

    td_test_engine_open_cpu(&fx, 1, 16, false); /* and without the prefix cache to lean on */
    pre = run_staggered(&fx, &cfg, 8, 6, 60, 120, 1);
    cr_assert_gt(pre, 0);
    td_test_engine_close(&fx);
}

/* Sliding window: the scheduler gives blocks behind every layer's window back after each
   step, so a pool that makes full attention preempt runs the same requests without
   preempting, and the tokens (prompts chunked across the window) equal each alone. */
Test(decode_sched, sliding_window_releases_blocks_instead_of_preempting, .timeout = 300)
{
    td_test_skip_without_stories();
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.max_batch = 8;
    cfg.max_batch_tokens = 64;
    cfg.prefill_chunk = 20;
    for (int window = 0; window <= 24; window += 24) {
        td_test_engine_t fx;
        td_test_model_open(&fx, 1);
        td_model_config_set_window(&fx.model->config, window);
        td_engine_config_t ec = td_engine_config_default();
        ec.n_blocks = 16; /* 256 tokens for 8 requests of up to 60 + 120 */
        cr_assert_eq(td_engine_create(fx.model, fx.be, &ec, &fx.eng), TD_OK, "%s", td_last_error());
        uint64_t pre = run_staggered(&fx, &cfg, 8, 5, 60, 120, 1);
        td_kv_stats_t ks;
        td_kv_get_stats(td_engine_kv(fx.eng), &ks);
        if (window) {
            cr_assert_eq(pre, 0, "window %d: %llu preemptions", window, (unsigned long long)pre);
            cr_assert_gt(ks.window_released, 0);
        } else {
            cr_assert_gt(pre, 0, "full attention never preempted: the pool does not test the window");
            cr_assert_eq(ks.window_released, 0);
        }
        td_test_engine_close(&fx);
    }
}

/* Blocks held outside the scheduler (a decode node's leases of KV still landing) leave a
 * lone sequence without room: it waits (stalled steps, no event), keeping its blocks, and
 * goes on with the tokens it yields alone once they come back. Only a sequence larger than
 * the whole pool ends, with an error that names the flags. (A decode pool of 4 x 512
 * tokens under 32 streams failed a request this way: test_cluster_scale.) */
Test(decode_sched, pool_held_by_leases_makes_a_sequence_wait_not_fail, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 16, false); /* 16 blocks x 16 tokens */
    td_kv_cache_t *kv = td_engine_kv(fx.eng);
    int32_t p[40], want[MAXT];
    unsigned s = 21;
    random_prompt(&s, p, 40);
    bool eos;
    int n = alone(&fx, p, 40, 100, want, &eos);
    cr_assert_gt(n, 40, "the request must outgrow 64 tokens of KV for the test (it made %d)", n);
    int32_t leased[12];
    cr_assert_eq(td_kv_alloc_blocks(kv, 12, leased), TD_OK); /* 4 blocks = 64 tokens left */
    decode_sched_t *ds = sched_default(fx.eng);
    decode_request_t rq = greedy_request(1, p, 40, 100);
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    static outcome_t oc[MAXN];
    memset(oc, 0, sizeof oc);
    int stalled = 0;
    for (int step = 0; step < 200; step++) {
        decode_step_result_t r;
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        collect(&r, oc);
        cr_assert_eq(oc[1].finish_events, 0, "the request ended (%s) while the pool was leased",
                     decode_finish_name(oc[1].finish));
        stalled += r.stalled;
        cr_assert(!r.stalled || r.n_seqs == 0, "a stalled step ran %d sequences", r.n_seqs);
    }
    cr_assert_gt(stalled, 150, "the request did not wait for the leased blocks (%d stalled steps)", stalled);
    cr_assert_lt(oc[1].n, n, "the request finished inside 64 tokens: the test shows nothing");
    for (int i = 0; i < 12; i++) /* the leases end (or land and are adopted elsewhere) */
        td_kv_unref_block(kv, leased[i]);
    run_to_end(ds, oc);
    cr_assert_eq(oc[1].finish, eos ? DECODE_FINISH_STOP : DECODE_FINISH_LENGTH, "finish %s",
                 decode_finish_name(oc[1].finish));
    cr_assert_eq(oc[1].n, n, "%d tokens, alone %d", oc[1].n, n);
    for (int t = 0; t < n; t++)
        cr_assert_eq(oc[1].tokens[t], want[t], "token %d: %d, alone %d", t, oc[1].tokens[t], want[t]);

    /* larger than the whole pool (40 + 240 tokens > 256): an error, never a wait */
    rq = greedy_request(2, p, 40, 240);
    rq.ignore_eos = true;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    memset(oc, 0, sizeof oc);
    run_to_end(ds, oc);
    cr_assert_eq(oc[2].finish, DECODE_FINISH_ERROR, "finish %s", decode_finish_name(oc[2].finish));
    cr_assert_eq(oc[2].status, TD_ERR_EXHAUSTED);
    sched_end(&fx, ds);
    td_test_engine_close(&fx);
}

Test(decode_sched, cancel_and_deadline_return_every_block, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, true);
    decode_sched_t *ds = sched_default(fx.eng);
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
    sched_end(&fx, ds);
    td_test_engine_close(&fx);
}

Test(decode_sched, stop_ids_and_limits, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, true);
    int32_t p[30], want[64];
    unsigned s = 9;
    random_prompt(&s, p, 30);
    bool eos;
    int n = alone(&fx, p, 30, 20, want, &eos);
    cr_assert_geq(n, 6, "prompt too short-lived for the test");
    decode_sched_t *ds = sched_default(fx.eng);
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
    run_to_end(ds, oc);
    cr_assert_eq(oc[3].finish, DECODE_FINISH_STOP);
    if (!earlier)
        cr_assert_eq(oc[3].n, 5);
    for (int i = 0; i < oc[3].n; i++)
        cr_assert_eq(oc[3].tokens[i], want[i]);
    /* what only the scheduler knows is refused without side effects (max_tokens 0, ids outside
       the vocabulary, a prompt of the model's length: the node's edge refuses those,
       test_node_admit.c) */
    const char *stops[] = {"x"};
    rq = greedy_request(4, p, 30, 5);
    rq.stops = stops;
    rq.n_stops = 1;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_ERR_INVALID, "stop strings without a tokenizer");
    static int32_t longp[4096];
    /* the model's length caps max_tokens: LENGTH at max_seq_len */
    int L = fx.model->config.max_seq_len;
    rq = greedy_request(5, longp, L - 4, 100);
    for (int i = 0; i < L - 4; i++)
        longp[i] = 3 + i % 500;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    memset(oc, 0, sizeof oc);
    run_to_end(ds, oc);
    cr_assert(oc[5].finish == DECODE_FINISH_LENGTH || oc[5].finish == DECODE_FINISH_STOP);
    if (oc[5].finish == DECODE_FINISH_LENGTH)
        cr_assert_eq(oc[5].n, 4);
    sched_end(&fx, ds);
    td_test_engine_close(&fx);
}

/* KV computed "elsewhere" (another sequence in the same pool, as a prefill node's push
 * would leave it) is adopted and the generation continues as if local. */
Test(decode_sched, adopted_kv_continues_the_generation, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, false); /* adopt needs private, unregistered blocks */
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
    int32_t first = td_test_argmax(logits, fx.vocab);
    cr_assert_eq(first, want[0]);

    decode_sched_t *ds = sched_default(fx.eng);
    decode_request_t rq = greedy_request(9, p, 50, 30);
    /* the prefill side's sequence gives its references up, as a lease's land (td_kv "Owners") */
    td_kv_pass_blocks(td_engine_kv(fx.eng), pre.blocks, pre.n_blocks, TD_KV_HOLDER_SEQ, TD_KV_HOLDER_LANDED);
    rq.kv_blocks = pre.blocks;
    rq.n_kv_blocks = pre.n_blocks;
    rq.first_token = first;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
    /* the references moved to the scheduler: drop the husk without unref */
    free(pre.blocks);
    free(pre.tokens);
    outcome_t oc[MAXN] = {0};
    run_to_end(ds, oc);
    cr_assert_eq(oc[9].n, n);
    for (int i = 0; i < n; i++)
        cr_assert_eq(oc[9].tokens[i], want[i], "token %d: %d, alone %d", i, oc[9].tokens[i], want[i]);
    cr_assert_eq(oc[9].finish, eos ? DECODE_FINISH_STOP : DECODE_FINISH_LENGTH);
    sched_end(&fx, ds);
    free(logits);
    td_test_engine_close(&fx);
}

/* ---- penalties and log-probabilities ------------------------------------------------- */

/* Greedy with OpenAI's penalties, logprobs asked: every token and its log-probability (of
 * the raw logits) equal one process's sampler loop; a request that does not ask gets none. */
Test(decode_sched, penalties_and_logprobs_equal_one_process, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, false);
    td_sampling_t sp = td_sampling_default();
    sp.presence_penalty = 1.5f;
    sp.frequency_penalty = 2.0f;
    enum { NP = 16, NG = 30, TOP = 4 };
    int32_t p[NP], want[NG];
    td_token_logprob_t want_lp[NG];
    unsigned s = 9;
    random_prompt(&s, p, NP);

    td_sampler_t *one;
    cr_assert_eq(td_sampler_create(&sp, &one), TD_OK);
    for (int i = 0; i < NP; i++)
        td_sampler_accept_prompt(one, p[i]);
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    float *logits = malloc((size_t)fx.vocab * sizeof(float));
    td_engine_item_t it = {.seq = &seq, .tokens = p, .n_tokens = NP, .n_logits = 1};
    cr_assert_eq(td_engine_step(fx.eng, &it, 1, logits), TD_OK);
    int n = 0, unpenalized = 0;
    while (n < NG) {
        int32_t t;
        cr_assert_eq(td_sampler_sample(one, logits, fx.vocab, &t), TD_OK);
        if (is_eos(&fx, t))
            break;
        unpenalized += t != td_test_argmax(logits, fx.vocab);
        cr_assert_eq(td_sampler_logprobs(logits, fx.vocab, t, TOP, &want_lp[n]), TD_OK);
        cr_assert_eq(td_sampler_accept(one, t), TD_OK);
        want[n++] = t;
        it = (td_engine_item_t){.seq = &seq, .tokens = &want[n - 1], .n_tokens = 1, .n_logits = 1};
        cr_assert_eq(td_engine_step(fx.eng, &it, 1, logits), TD_OK);
    }
    td_engine_seq_end(fx.eng, &seq);
    td_sampler_destroy(one);
    cr_assert_gt(unpenalized, 0, "the penalties never changed a greedy pick: the test shows nothing");

    decode_sched_t *ds = sched_default(fx.eng);
    decode_request_t rq = {.id = 1, .prompt = p, .n_prompt = NP, .sampling = sp, .max_tokens = n,
                           .logprobs = true, .top_logprobs = TOP};
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
    rq.id = 2;
    rq.logprobs = false;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
    int got = 0, got2 = 0;
    while (decode_sched_busy(ds)) {
        decode_step_result_t r;
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        for (int32_t i = 0; i < r.n_events; i++) {
            const decode_event_t *e = &r.events[i];
            if (e->token < 0)
                continue;
            if (e->id == 2) {
                cr_assert(!e->has_logprob);
                cr_assert_eq(e->token, want[got2++]);
                continue;
            }
            cr_assert_lt(got, n);
            cr_assert_eq(e->token, want[got], "token %d: %d, one process %d", got, e->token, want[got]);
            cr_assert(e->has_logprob);
            cr_assert_eq(e->logprob.token, e->token);
            cr_assert(fabsf(e->logprob.logprob - want_lp[got].logprob) < 1e-4f, "token %d: logprob %g vs %g", got,
                      (double)e->logprob.logprob, (double)want_lp[got].logprob);
            cr_assert_eq(e->logprob.n_top, TOP);
            for (int k = 0; k < TOP; k++)
                cr_assert_eq(e->logprob.top[k].token, want_lp[got].top[k].token);
            got++;
        }
    }
    cr_assert_eq(got, n);
    cr_assert_eq(got2, n);
    /* top_logprobs past TD_LOGPROBS_MAX_TOP: refused at the node's edge (test_node_admit.c) */
    sched_end(&fx, ds);
    free(logits);
    td_test_engine_close(&fx);
}

/* ---- seeded sampling across the prefill/decode split ---------------------------------- */

/* A seeded temperature > 0 generation split as the cluster splits it (the first token
 * sampled by a "prefill" sampler, the rest by the scheduler after adopting the KV) draws
 * the same tokens as one sampler in one process, as `tandem generate --seed` does. */
Test(decode_sched, seeded_split_generation_equals_one_process, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, false);
    td_sampling_t sp = td_sampling_default();
    sp.temperature = 1.0f;
    sp.seed = 12345;
    int32_t p[20], want[40];
    unsigned s = 5;
    random_prompt(&s, p, 20);

    /* one process: prompt, then sample / accept / step (cmd_generate's loop) */
    td_sampler_t *one;
    cr_assert_eq(td_sampler_create(&sp, &one), TD_OK);
    for (int i = 0; i < 20; i++)
        td_sampler_accept_prompt(one, p[i]);
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    float *logits = malloc((size_t)fx.vocab * sizeof(float));
    td_engine_item_t it = {.seq = &seq, .tokens = p, .n_tokens = 20, .n_logits = 1};
    cr_assert_eq(td_engine_step(fx.eng, &it, 1, logits), TD_OK);
    int n = 0;
    while (n < 40) {
        int32_t t;
        cr_assert_eq(td_sampler_sample(one, logits, fx.vocab, &t), TD_OK);
        if (is_eos(&fx, t))
            break;
        td_sampler_accept(one, t);
        want[n++] = t;
        it = (td_engine_item_t){.seq = &seq, .tokens = &want[n - 1], .n_tokens = 1, .n_logits = 1};
        cr_assert_eq(td_engine_step(fx.eng, &it, 1, logits), TD_OK);
    }
    td_engine_seq_end(fx.eng, &seq);
    td_sampler_destroy(one);
    cr_assert_geq(n, 8, "the seeded reference generation is too short to compare (%d tokens)", n);

    /* split: "prefill" samples the first token with a fresh sampler of the same seed */
    td_kv_seq_t pre;
    td_kv_seq_init(&pre);
    it = (td_engine_item_t){.seq = &pre, .tokens = p, .n_tokens = 20, .n_logits = 1};
    cr_assert_eq(td_engine_step(fx.eng, &it, 1, logits), TD_OK);
    td_sampler_t *pf;
    cr_assert_eq(td_sampler_create(&sp, &pf), TD_OK);
    for (int i = 0; i < 20; i++)
        td_sampler_accept_prompt(pf, p[i]);
    int32_t first;
    cr_assert_eq(td_sampler_sample(pf, logits, fx.vocab, &first), TD_OK);
    td_sampler_destroy(pf);
    cr_assert_eq(first, want[0]);

    decode_sched_t *ds = sched_default(fx.eng);
    td_kv_pass_blocks(td_engine_kv(fx.eng), pre.blocks, pre.n_blocks, TD_KV_HOLDER_SEQ, TD_KV_HOLDER_LANDED);
    decode_request_t rq = {.id = 3, .prompt = p, .n_prompt = 20, .kv_blocks = pre.blocks,
                           .n_kv_blocks = pre.n_blocks, .first_token = first, .sampling = sp,
                           .max_tokens = n};
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
    free(pre.blocks); /* the references moved to the scheduler */
    free(pre.tokens);
    outcome_t oc[MAXN] = {0};
    run_to_end(ds, oc);
    cr_assert_eq(oc[3].n, n);
    for (int i = 0; i < n; i++)
        cr_assert_eq(oc[3].tokens[i], want[i], "token %d: split %d, one process %d", i, oc[3].tokens[i],
                     want[i]);
    sched_end(&fx, ds);
    free(logits);
    td_test_engine_close(&fx);
}

/* A migrated stream (the router re-prefills the prompt elsewhere and replays the tokens the
 * client already has, decode_request_t.replay): the rest of the generation equals one
 * process's, for a seeded sampler with repetition, presence and frequency penalties, after
 * 1, a few and half of the tokens, with the prompt's KV from a "prefill node" or prefilled
 * here (a unified node), beside another sequence. */
Test(decode_sched, migrated_generation_equals_one_process, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, false);
    td_sampling_t sp = td_sampling_default();
    sp.temperature = 0.9f;
    sp.seed = 777;
    sp.repetition_penalty = 1.3f;
    sp.presence_penalty = 0.5f;
    sp.frequency_penalty = 0.3f;
    enum { NP = 21, NT = 48 };
    int32_t p[NP], want[NT];
    float want_lp[NT]; /* of the raw logits: equal floats only if the logits are the same bits */
    unsigned s = 9;
    random_prompt(&s, p, NP);

    td_sampler_t *one;
    cr_assert_eq(td_sampler_create(&sp, &one), TD_OK);
    for (int i = 0; i < NP; i++)
        td_sampler_accept_prompt(one, p[i]);
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    float *logits = malloc((size_t)fx.vocab * sizeof(float));
    td_engine_item_t it = {.seq = &seq, .tokens = p, .n_tokens = NP, .n_logits = 1};
    cr_assert_eq(td_engine_step(fx.eng, &it, 1, logits), TD_OK);
    int n = 0;
    while (n < NT) {
        int32_t t;
        cr_assert_eq(td_sampler_sample(one, logits, fx.vocab, &t), TD_OK);
        if (is_eos(&fx, t))
            break;
        td_sampler_accept(one, t);
        td_token_logprob_t lp;
        cr_assert_eq(td_sampler_logprobs(logits, fx.vocab, t, 0, &lp), TD_OK);
        want_lp[n] = lp.logprob;
        want[n++] = t;
        it = (td_engine_item_t){.seq = &seq, .tokens = &want[n - 1], .n_tokens = 1, .n_logits = 1};
        cr_assert_eq(td_engine_step(fx.eng, &it, 1, logits), TD_OK);
    }
    td_engine_seq_end(fx.eng, &seq);
    td_sampler_destroy(one);
    cr_assert_geq(n, 8, "the seeded reference generation is too short to compare (%d tokens)", n);

    const int ks[] = {1, 3, n / 2};
    for (int home = 0; home < 2; home++) {
        for (size_t j = 0; j < TD_ARRAY_LEN(ks); j++) {
            int k = ks[j];
            decode_sched_t *ds = sched_default(fx.eng);
            /* a neighbour decoding in the same steps (its prompt computed before: a step
               with a chunk of several rows runs the prefill kernel for all its rows) */
            decode_request_t other = {.id = 1, .prompt = p + 3, .n_prompt = 9, .sampling = sp, .max_tokens = 20};
            cr_assert_eq(decode_sched_admit(ds, &other), TD_OK, "%s", td_last_error());
            decode_step_result_t r0;
            cr_assert_eq(decode_sched_step(ds, 0, &r0), TD_OK);
            outcome_t oc[MAXN] = {0};
            collect(&r0, oc);
            td_kv_seq_t pre;
            td_kv_seq_init(&pre);
            decode_request_t rq = {.id = 3, .prompt = p, .n_prompt = NP, .sampling = sp, .max_tokens = n,
                                   .replay = want, .n_replay = k, .logprobs = true};
            if (!home) { /* the prompt's KV from a prefill node, which sampled token 0 again */
                it = (td_engine_item_t){.seq = &pre, .tokens = p, .n_tokens = NP, .n_logits = 1};
                cr_assert_eq(td_engine_step(fx.eng, &it, 1, logits), TD_OK);
                td_kv_pass_blocks(td_engine_kv(fx.eng), pre.blocks, pre.n_blocks, TD_KV_HOLDER_SEQ,
                                  TD_KV_HOLDER_LANDED);
                rq.kv_blocks = pre.blocks;
                rq.n_kv_blocks = pre.n_blocks;
                rq.first_token = want[0];
            }
            cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
            free(pre.blocks);
            free(pre.tokens);
            memcpy(oc[3].tokens, want, (size_t)k * sizeof *want); /* events go on at index k */
            oc[3].n = k;
            run_to_end(ds, oc);
            cr_assert_eq(oc[3].n, n, "home %d, %d replayed: %d tokens, want %d", home, k, oc[3].n, n);
            for (int i = k; i < n; i++) {
                cr_assert_eq(oc[3].tokens[i], want[i], "home %d, %d replayed: token %d is %d, one process %d",
                             home, k, i, oc[3].tokens[i], want[i]);
                /* the same bits: the replayed rows ran the decode kernel, as when generated */
                cr_assert(oc[3].lps[i] == want_lp[i], "home %d, %d replayed: token %d's logprob %.9g, one process "
                          "%.9g", home, k, i, (double)oc[3].lps[i], (double)want_lp[i]);
            }
            sched_end(&fx, ds);
        }
    }
    /* a replay that leaves nothing to generate: refused at the node's edge (test_node_admit.c) */
    free(logits);
    td_test_engine_close(&fx);
}

/* ---- one pool: leases of td_xfer on the engine's own blocks ---------------------------- */
/* (kv_out, a decode node prefilling for another node's lease, is tested below with this fixture) */

/* The decode node's arrangement: td_xfer has UCX allocate the pool, the engine runs on
 * that memory, leases take blocks of the engine's block manager, and KV pushed by a
 * sender lands straight in the blocks the sequence then adopts. A second engine plays
 * the prefill node (its own pool), a second td_xfer on the same loop the sender. */
typedef struct shared_fx {
    td_test_engine_t fx;        /* the decode engine, on the xfer pool */
    td_engine_t *pre;    /* the "prefill" engine, its own pool */
    uv_loop_t loop;
    td_xfer_t *rx, *tx;
    td_xfer_peer_t *peer;
    td_kv_cache_t *kv;
    int32_t initial;     /* blocks available before anything */
    int ready, done;
    td_status_t done_st;
    td_xfer_ready_t last; /* of the last kv-ready (blocks copied) */
    int32_t ready_blocks[64];
    void (*ready_hook)(void *arg, const td_xfer_ready_t *r); /* set: kv-ready goes there instead */
    void *hook_arg;
} shared_fx_t;

static void shared_on_ready(void *arg, const td_xfer_ready_t *r)
{
    shared_fx_t *f = arg;
    if (f->ready_hook) {
        f->ready++;
        f->ready_hook(f->hook_arg, r);
        return;
    }
    cr_assert_leq(r->n_blocks, 64);
    f->last = *r;
    memcpy(f->ready_blocks, r->blocks, (size_t)r->n_blocks * sizeof(int32_t));
    f->last.blocks = f->ready_blocks;
    f->ready++;
}

static void shared_on_done(void *arg, uint64_t request_id, td_status_t st)
{
    shared_fx_t *f = arg;
    f->done++;
    f->done_st = st;
}

static void shared_run_until(shared_fx_t *f, const int *counter, int want, double timeout_s)
{
    double end = td_now_s() + timeout_s;
    while (*counter < want && td_now_s() < end)
        uv_run(&f->loop, UV_RUN_ONCE);
}

/* window > 0: the model attends within a sliding window of that many tokens (both engines). */
static void shared_open_window(shared_fx_t *f, const char *tls, int32_t window)
{
    memset(f, 0, sizeof *f);
    td_xfer_testkit_env(tls);
    td_test_engine_t *fx = &f->fx;
    td_test_model_open(fx, 1);
    if (window > 0)
        td_model_config_set_window(&fx->model->config, window);
    uv_loop_init(&f->loop);

    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 64;
    td_kv_layout_t layout;
    td_engine_kv_layout_for(fx->model, &ec, &layout);
    td_xfer_config_t xc = td_xfer_config_default();
    xc.name = "decode-test";
    cr_assert_eq(td_xfer_create(&f->loop, &xc, &f->rx), TD_OK, "%s", td_last_error());
    td_xfer_pool_t xp = {.layout = layout, .base = NULL, .n_blocks = 64, .mem = TD_XFER_MEM_HOST};
    cr_assert_eq(td_xfer_register_pool(f->rx, &xp, shared_on_ready, f), TD_OK, "%s", td_last_error());
    ec.kv_pool = td_xfer_pool_base(f->rx);
    cr_assert_not_null(ec.kv_pool);
    cr_assert_eq(td_engine_create(fx->model, fx->be, &ec, &fx->eng), TD_OK, "%s", td_last_error());
    f->kv = td_engine_kv(fx->eng);
    cr_assert_eq(td_xfer_pool_set_kv(f->rx, f->kv), TD_OK);
    f->initial = td_kv_available(f->kv);
    cr_assert_eq(f->initial, 64);

    td_engine_config_t pc = td_engine_config_default();
    pc.n_blocks = 64;
    cr_assert_eq(td_engine_create(fx->model, fx->be, &pc, &f->pre), TD_OK, "%s", td_last_error());
    td_xfer_config_t tc = td_xfer_config_default();
    tc.name = "prefill-test";
    tc.listen_ip = NULL;
    cr_assert_eq(td_xfer_create(&f->loop, &tc, &f->tx), TD_OK, "%s", td_last_error());
    uint8_t desc[TD_XFER_DESC_MAX];
    size_t len;
    cr_assert_eq(td_xfer_describe(f->rx, desc, sizeof desc, &len), TD_OK);
    cr_assert_eq(td_xfer_connect(f->tx, desc, len, td_engine_kv_layout(f->pre), &f->peer), TD_OK, "%s",
                 td_last_error());
}

static void shared_open(shared_fx_t *f, const char *tls)
{
    shared_open_window(f, tls, 0);
}

static void shared_close(shared_fx_t *f)
{
    td_xfer_destroy(f->tx);
    td_xfer_destroy(f->rx);
    uv_run(&f->loop, UV_RUN_DEFAULT); /* td_xfer's shutdown runs on the loop until its handles close */
    cr_assert_eq(uv_loop_close(&f->loop), 0, "a handle of td_xfer is still open");
    td_engine_destroy(f->pre);
    td_test_engine_close(&f->fx);
}

/* Prefills p on the "prefill" engine and pushes its KV into the lease (layer by layer
 * from that engine's pool, as a prefill node does). Returns the first (greedy) token. */
static int32_t shared_push(shared_fx_t *f, uint64_t lease_id, const td_xfer_token_t *tok, const int32_t *blocks,
                           int32_t n_blocks, const int32_t *p, int n_prompt)
{
    td_kv_seq_t pre;
    td_kv_seq_init(&pre);
    float *logits = malloc((size_t)f->fx.vocab * sizeof(float));
    td_engine_item_t it = {.seq = &pre, .tokens = p, .n_tokens = n_prompt, .n_logits = 1};
    cr_assert_eq(td_engine_step(f->pre, &it, 1, logits), TD_OK);
    int32_t first = td_test_argmax(logits, f->fx.vocab);
    free(logits);
    td_xfer_send_params_t sp = {.request_id = lease_id, .lease_id = lease_id, .token = *tok, .dst_blocks = blocks,
                                .n_dst_blocks = n_blocks, .n_tokens = (uint32_t)n_prompt, .checksum = true,
                                .mem = TD_XFER_MEM_HOST, .done = shared_on_done, .arg = f};
    td_xfer_send_t *snd;
    cr_assert_eq(td_xfer_send_begin(f->tx, f->peer, &sp, &snd), TD_OK, "%s", td_last_error());
    const td_kv_layout_t *L = td_engine_kv_layout(f->pre);
    int32_t pool_blocks;
    uint8_t *pool = td_engine_kv_pool(f->pre, &pool_blocks);
    for (uint32_t l = 0; l < L->n_layers; l++)
        cr_assert_eq(td_xfer_send_layer(snd, l, pool + td_kv_block_offset(L, (uint32_t)pool_blocks, l, 0),
                                        pre.blocks),
                     TD_OK);
    td_xfer_send_finish(snd, first);
    int want_done = f->done + 1;
    shared_run_until(f, &f->done, want_done, 10);
    cr_assert_eq(f->done, want_done, "no verdict for the transfer");
    td_engine_seq_end(f->pre, &pre);
    return first;
}

static void shared_leases_return_every_block(const char *tls)
{
    td_test_skip_without_stories();
    shared_fx_t *f = calloc(1, sizeof *f);
    shared_open(f, tls);
    decode_sched_t *ds = sched_default(f->fx.eng);
    int32_t p[40], want[24], blocks[8];
    unsigned s = 77;
    random_prompt(&s, p, 40);
    bool eos;
    int n = alone(&f->fx, p, 40, 24, want, &eos);
    cr_assert_eq(td_kv_available(f->kv), f->initial, "the reference run leaked");

    /* finish: leased, pushed, adopted without a copy, generated, finished */
    uint64_t lease;
    td_xfer_token_t tok;
    cr_assert_eq(td_xfer_lease_create(f->rx, 1, 3, 5000, blocks, &lease, &tok), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_kv_available(f->kv), f->initial - 3, "a lease takes blocks of the engine's pool");
    int32_t first = shared_push(f, lease, &tok, blocks, 3, p, 40);
    cr_assert_eq(f->done_st, TD_OK, "%s", td_strerror(f->done_st));
    shared_run_until(f, &f->ready, 1, 5);
    cr_assert_eq(f->ready, 1);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(f->last.blocks[i], blocks[i], "kv-ready names the leased blocks");
    decode_request_t rq = greedy_request(1, p, 40, 24);
    rq.kv_blocks = f->last.blocks;
    rq.n_kv_blocks = f->last.n_blocks;
    rq.first_token = first;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
    outcome_t oc[MAXN] = {0};
    run_to_end(ds, oc);
    cr_assert_eq(oc[1].n, n);
    for (int i = 0; i < n; i++)
        cr_assert_eq(oc[1].tokens[i], want[i], "token %d: %d, alone %d (the landed KV is what the engine read)",
                     i, oc[1].tokens[i], want[i]);
    cr_assert_eq(td_kv_available(f->kv), f->initial, "finish: blocks back");

    /* cancel after adoption (the scheduler holds them) */
    cr_assert_eq(td_xfer_lease_create(f->rx, 2, 3, 5000, blocks, &lease, &tok), TD_OK);
    first = shared_push(f, lease, &tok, blocks, 3, p, 40);
    shared_run_until(f, &f->ready, 2, 5);
    cr_assert_eq(f->ready, 2);
    rq.id = 2;
    rq.kv_blocks = f->last.blocks;
    rq.first_token = first;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
    decode_step_result_t r;
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    cr_assert_lt(td_kv_available(f->kv), f->initial);
    cr_assert_eq(decode_sched_cancel(ds, 2), TD_OK);
    cr_assert_eq(td_kv_available(f->kv), f->initial, "cancel after adoption: blocks back");
    while (decode_sched_busy(ds))
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);

    /* cancel before kv-ready (no writer bound: back at once) */
    cr_assert_eq(td_xfer_lease_create(f->rx, 3, 4, 5000, blocks, &lease, &tok), TD_OK);
    cr_assert_eq(td_kv_available(f->kv), f->initial - 4);
    cr_assert_eq(td_xfer_lease_cancel(f->rx, lease), TD_OK);
    cr_assert_eq(td_kv_available(f->kv), f->initial, "cancel before kv-ready: blocks back");
    cr_assert_eq(td_xfer_lease_cancel(f->rx, lease), TD_ERR_STALE, "a lease ends once");

    /* expiry: nothing comes, the tick returns the blocks */
    cr_assert_eq(td_xfer_lease_create(f->rx, 4, 5, 30, blocks, &lease, &tok), TD_OK);
    cr_assert_eq(td_kv_available(f->kv), f->initial - 5);
    td_xfer_stats_t xs;
    double end = td_now_s() + 2;
    do {
        uv_run(&f->loop, UV_RUN_ONCE);
        td_xfer_get_stats(f->rx, &xs);
    } while (xs.leases_expired == 0 && td_now_s() < end);
    cr_assert_eq(xs.leases_expired, 1);
    cr_assert_eq(td_kv_available(f->kv), f->initial, "expiry: blocks back");
    cr_assert_eq(xs.leases_created, 4);
    cr_assert_eq(xs.leases_adopted, 2);
    cr_assert_eq(xs.leases_cancelled, 1);
    cr_assert_eq(xs.leases_live, 0);

    td_xfer_get_stats(f->tx, &xs);
    cr_assert_gt(xs.ops_put + xs.ops_am, 0);
    if (strstr(tls, "sm"))
        cr_assert_eq(xs.ops_am, 0, "over shared memory the sender puts into the UCX-allocated engine pool "
                                   "(%llu AM operations)", (unsigned long long)xs.ops_am);

    /* sender failure: half the layers written, then the sender goes away (its endpoint
       closes): nothing is adopted and the blocks come back */
    cr_assert_eq(td_xfer_lease_create(f->rx, 5, 3, 60000, blocks, &lease, &tok), TD_OK); /* no expiry */
    cr_assert_eq(td_kv_available(f->kv), f->initial - 3);
    td_kv_seq_t pre;
    td_kv_seq_init(&pre);
    float *logits = malloc((size_t)f->fx.vocab * sizeof(float));
    td_engine_item_t it = {.seq = &pre, .tokens = p, .n_tokens = 40, .n_logits = 1};
    cr_assert_eq(td_engine_step(f->pre, &it, 1, logits), TD_OK);
    free(logits);
    td_xfer_send_params_t sp = {.request_id = 5, .lease_id = lease, .token = tok, .dst_blocks = blocks, .n_dst_blocks = 3,
                                .n_tokens = 40, .mem = TD_XFER_MEM_HOST, .done = shared_on_done, .arg = f};
    td_xfer_send_t *snd;
    cr_assert_eq(td_xfer_send_begin(f->tx, f->peer, &sp, &snd), TD_OK, "%s", td_last_error());
    const td_kv_layout_t *L = td_engine_kv_layout(f->pre);
    int32_t pool_blocks;
    uint8_t *pool = td_engine_kv_pool(f->pre, &pool_blocks);
    for (uint32_t l = 0; l < L->n_layers / 2; l++)
        cr_assert_eq(td_xfer_send_layer(snd, l, pool + td_kv_block_offset(L, (uint32_t)pool_blocks, l, 0),
                                        pre.blocks),
                     TD_OK);
    end = td_now_s() + 0.3;
    while (td_now_s() < end) /* the layers land (puts after bind, or rendezvous) */
        uv_run(&f->loop, UV_RUN_NOWAIT);
    int ready_before = f->ready;
    td_xfer_destroy(f->tx); /* the prefill node dies: its endpoint closes */
    f->tx = NULL;
    end = td_now_s() + 5;
    do {
        uv_run(&f->loop, UV_RUN_ONCE);
    } while (td_kv_available(f->kv) != f->initial && td_now_s() < end);
    cr_assert_eq(td_kv_available(f->kv), f->initial, "sender failure: blocks back");
    cr_assert_eq(f->ready, ready_before, "nothing adopted");
    td_xfer_get_stats(f->rx, &xs);
    cr_assert_eq(xs.leases_sender_lost, 1, "%llu leases released for a lost sender",
                 (unsigned long long)xs.leases_sender_lost);
    cr_assert_eq(xs.leases_live, 0);
    td_engine_seq_end(f->pre, &pre);
    sched_end(&f->fx, ds);
    shared_close(f);
    free(f);
}

/* Prefill for another node (kv_out, issue 37's "peer" placement): decode node B (the fixture's
 * second engine, here with a scheduler of its own) runs a stream of its own and is handed a
 * prompt to prefill for decode node A's lease. B chunks it beside its stream (which gets a token
 * every step), samples the first token and holds the prompt's blocks, whole, for the transfer;
 * B's blocks go over td_xfer into A's lease, A adopts them and generates exactly what the prompt
 * yields alone, B's stream too, and after decode_sched_release every block of both pools is back,
 * each through its holder. With a sliding window shorter than the prompt, B's chunks must not give
 * back the blocks behind the window (a released entry is -1 in the table: the transfer would read
 * a block id that is not the prompt's; the first version of this crashed there). */
static void kv_out_for_another_lease(int32_t window)
{
    td_test_skip_without_stories();
    shared_fx_t *f = calloc(1, sizeof *f);
    shared_open_window(f, "tcp", window);
    decode_sched_t *ds_a = sched_default(f->fx.eng), *ds_b;
    decode_sched_config_t cb = decode_sched_config_default();
    cb.prefill_chunk = 16; /* 60 prompt tokens in four chunks beside B's stream */
    cr_assert_eq(decode_sched_create(f->pre, NULL, &cb, &ds_b), TD_OK, "%s", td_last_error());
    td_kv_cache_t *kv_b = td_engine_kv(f->pre);
    int32_t initial_b = td_kv_available(kv_b);
    int32_t p[60], own[8], want[24], want_own[40];
    unsigned s = 91;
    random_prompt(&s, p, 60);
    random_prompt(&s, own, 8);
    bool eos;
    int n = alone(&f->fx, p, 60, 24, want, &eos), n_own = alone(&f->fx, own, 8, 40, want_own, &eos);
    cr_assert_geq(n_own, 12, "B's own stream is too short to run beside the prefill (%d tokens)", n_own);

    /* B's own stream runs; then the prompt for A comes as kv_out */
    outcome_t oc_b[MAXN] = {0};
    decode_request_t rq = greedy_request(1, own, 8, 40);
    cr_assert_eq(decode_sched_admit(ds_b, &rq), TD_OK, "%s", td_last_error());
    decode_step_result_t r;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(decode_sched_step(ds_b, 0, &r), TD_OK);
        collect(&r, oc_b);
    }
    decode_request_t ko = greedy_request(2, p, 60, 24);
    ko.kv_out = true;
    cr_assert_eq(decode_sched_admit(ds_b, &ko), TD_OK, "%s", td_last_error());
    int32_t first = -1, n_blocks = 0, table[8];
    int steps = 0;
    while (first < 0) {
        cr_assert_lt(++steps, 10, "no kv_out event after %d steps", steps);
        int had = oc_b[1].n;
        cr_assert_eq(decode_sched_step(ds_b, 0, &r), TD_OK);
        cr_assert_leq(r.n_prefill_tokens, 16);
        for (int i = 0; i < r.n_events; i++) {
            const decode_event_t *e = &r.events[i];
            if (e->id != 2) {
                collect(&(decode_step_result_t){.events = e, .n_events = 1}, oc_b);
                continue;
            }
            cr_assert_eq(e->finish, DECODE_FINISH_KV_OUT, "kv_out ended %s", decode_finish_name(e->finish));
            cr_assert_eq(e->index, 0);
            cr_assert_eq(e->n_kv_tokens, 60);
            cr_assert_eq(e->n_kv_blocks, 4, "60 tokens in blocks of 16");
            first = e->token;
            n_blocks = e->n_kv_blocks;
            memcpy(table, e->kv_blocks, (size_t)n_blocks * sizeof *table);
        }
        cr_assert_eq(oc_b[1].n, had + 1, "B's stream got no token in a step that chunked the prompt");
    }
    cr_assert_eq(first, want[0], "kv_out's first token %d, alone %d", first, want[0]);
    for (int i = 0; i < n_blocks; i++) {
        cr_assert_geq(table[i], 0, "window %d: block %d of the prompt was given back before its transfer",
                      window, i);
        cr_assert_eq(td_kv_block_holder(kv_b, table[i]), TD_KV_HOLDER_SEQ);
    }
    decode_sched_stats_t st;
    decode_sched_stats(ds_b, &st);
    cr_assert_eq(st.kv_out_held, 1);
    cr_assert_eq(st.running, 1, "the held prompt is not running");

    /* B steps on while its blocks are held (the transfer may take a while): they stay */
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(decode_sched_step(ds_b, 0, &r), TD_OK);
        collect(&r, oc_b);
    }
    for (int i = 0; i < n_blocks; i++)
        cr_assert_eq(td_kv_block_holder(kv_b, table[i]), TD_KV_HOLDER_SEQ, "a held block left the prompt");

    /* over td_xfer into A's lease, as a prefill node sends */
    uint64_t lease;
    td_xfer_token_t tok;
    int32_t dst[8];
    cr_assert_eq(td_xfer_lease_create(f->rx, 7, n_blocks, 5000, dst, &lease, &tok), TD_OK, "%s", td_last_error());
    td_xfer_send_params_t sp = {.request_id = 7, .lease_id = lease, .token = tok, .dst_blocks = dst,
                                .n_dst_blocks = n_blocks, .n_tokens = 60, .checksum = true,
                                .mem = TD_XFER_MEM_HOST, .done = shared_on_done, .arg = f};
    td_xfer_send_t *snd;
    cr_assert_eq(td_xfer_send_begin(f->tx, f->peer, &sp, &snd), TD_OK, "%s", td_last_error());
    const td_kv_layout_t *L = td_engine_kv_layout(f->pre);
    int32_t pool_blocks;
    uint8_t *pool = td_engine_kv_pool(f->pre, &pool_blocks);
    for (uint32_t l = 0; l < L->n_layers; l++)
        cr_assert_eq(td_xfer_send_layer(snd, l, pool + td_kv_block_offset(L, (uint32_t)pool_blocks, l, 0), table),
                     TD_OK);
    td_xfer_send_finish(snd, first);
    shared_run_until(f, &f->done, 1, 10);
    cr_assert_eq(f->done, 1, "no verdict for the transfer");
    cr_assert_eq(f->done_st, TD_OK, "%s", td_strerror(f->done_st));
    shared_run_until(f, &f->ready, 1, 5);
    cr_assert_eq(f->ready, 1);

    /* the transfer is done: B lets go of the prompt, once */
    cr_assert_eq(decode_sched_release(ds_b, 2), TD_OK);
    cr_assert_eq(decode_sched_release(ds_b, 2), TD_ERR_NOT_FOUND, "a held prompt is released once");
    decode_sched_stats(ds_b, &st);
    cr_assert_eq(st.kv_out_held, 0);

    /* A generates from the landed KV what the prompt yields alone */
    rq = greedy_request(2, p, 60, 24);
    rq.kv_blocks = f->last.blocks;
    rq.n_kv_blocks = f->last.n_blocks;
    rq.first_token = f->last.first_token;
    cr_assert_eq(decode_sched_admit(ds_a, &rq), TD_OK, "%s", td_last_error());
    outcome_t oc_a[MAXN] = {0};
    run_to_end(ds_a, oc_a);
    cr_assert_eq(oc_a[2].n, n);
    for (int i = 0; i < n; i++)
        cr_assert_eq(oc_a[2].tokens[i], want[i], "window %d: token %d on A: %d, alone %d", window, i,
                     oc_a[2].tokens[i], want[i]);
    run_to_end(ds_b, oc_b);
    cr_assert_eq(oc_b[1].n, n_own);
    for (int i = 0; i < n_own; i++)
        cr_assert_eq(oc_b[1].tokens[i], want_own[i], "B's stream token %d: %d, alone %d", i, oc_b[1].tokens[i],
                     want_own[i]);
    cr_assert_eq(oc_b[2].finish_events, 0, "a released kv_out request has no further event");
    cr_assert_eq(td_kv_available(f->kv), f->initial, "A: blocks back");
    cr_assert_eq(td_kv_available(kv_b), initial_b, "B: blocks back");
    cr_assert_eq(td_kv_cache_check(kv_b), TD_OK, "%s", td_last_error());
    decode_sched_destroy(ds_b);
    sched_end(&f->fx, ds_a);
    shared_close(f);
    free(f);
}

Test(decode_sched, kv_out_prefills_for_another_lease_beside_a_stream, .timeout = 120)
{
    kv_out_for_another_lease(0);
}

Test(decode_sched, kv_out_under_a_sliding_window_sends_every_block, .timeout = 120)
{
    kv_out_for_another_lease(16);
}

/* A kv_out prompt cancelled while it computes, and one cancelled while held (the transfer never
 * started), give every block back at once; a held one has no deadline: only its caller ends it. */
Test(decode_sched, kv_out_cancel_and_deadline_return_every_block, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 64, false);
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.prefill_chunk = 16;
    decode_sched_t *ds;
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_OK, "%s", td_last_error());
    int32_t p[50];
    unsigned s = 3;
    random_prompt(&s, p, 50);
    decode_request_t ko = greedy_request(1, p, 50, 4);
    ko.kv_out = true;
    ko.deadline_ns = 1000;
    cr_assert_eq(decode_sched_admit(ds, &ko), TD_OK, "%s", td_last_error());
    decode_step_result_t r;
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    cr_assert_eq(decode_sched_cancel(ds, 1), TD_OK);
    assert_no_leak(&fx, ds);
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    cr_assert_eq(r.n_events, 1);
    cr_assert_eq(r.events[0].finish, DECODE_FINISH_CANCELLED);

    ko.id = 2;
    cr_assert_eq(decode_sched_admit(ds, &ko), TD_OK, "%s", td_last_error());
    int kv_out = 0;
    for (int i = 0; i < 10 && !kv_out; i++) {
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        for (int k = 0; k < r.n_events; k++)
            kv_out += r.events[k].finish == DECODE_FINISH_KV_OUT;
    }
    cr_assert_eq(kv_out, 1);
    cr_assert(!decode_sched_busy(ds), "a held prompt waits for its caller, not for a step");
    cr_assert_eq(decode_sched_step(ds, 5000, &r), TD_OK); /* past its deadline */
    cr_assert_eq(r.n_events, 0, "a held prompt does not expire: its transfer may be reading it");
    decode_sched_stats_t st;
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.kv_out_held, 1);
    cr_assert_gt(st.used_blocks, 0);
    cr_assert_eq(decode_sched_cancel(ds, 2), TD_OK);
    assert_no_leak(&fx, ds);
    decode_sched_destroy(ds);
    td_test_engine_close(&fx);
}

/* A node the router dropped (decode_main.c on_forgotten): cancel_all ends every running and
 * waiting sequence, a local prefill in the middle of its prompt too, each with one CANCELLED
 * event and its blocks back at once, and leaves the kv_out prompts, computing or held, to
 * their caller (a transfer may read a held one's blocks). */
Test(decode_sched, cancel_all_ends_every_sequence_but_the_kv_out_ones, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 64, false);
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.prefill_chunk = 16;
    cfg.max_batch = 3;
    decode_sched_t *ds;
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_OK, "%s", td_last_error());
    int32_t p[4][50];
    unsigned s = 5;
    for (int i = 0; i < 4; i++)
        random_prompt(&s, p[i], 50);
    /* 4: a kv_out prompt whose KV is complete and held */
    decode_request_t held = greedy_request(4, p[3], 50, 4);
    held.kv_out = true;
    cr_assert_eq(decode_sched_admit(ds, &held), TD_OK, "%s", td_last_error());
    decode_step_result_t r;
    int kv_out = 0;
    for (int i = 0; i < 10 && !kv_out; i++) {
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        for (int k = 0; k < r.n_events; k++)
            kv_out += r.events[k].finish == DECODE_FINISH_KV_OUT;
    }
    cr_assert_eq(kv_out, 1);
    /* 1 generating, 2 a local prefill in its chunks, 3 a kv_out prompt computing, 5 waiting
       (max_batch 3) */
    decode_request_t rq[] = {greedy_request(1, p[0], 8, 200), greedy_request(2, p[1], 50, 200),
                             greedy_request(3, p[2], 50, 4), greedy_request(5, p[0], 20, 200)};
    rq[2].kv_out = true;
    for (size_t i = 0; i < TD_ARRAY_LEN(rq); i++)
        cr_assert_eq(decode_sched_admit(ds, &rq[i]), TD_OK, "%s", td_last_error());
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    decode_sched_stats_t st;
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.running, 3);
    cr_assert_eq(st.waiting, 1);
    cr_assert_eq(st.kv_out_held, 1);
    cr_assert_gt(st.context_tokens, 0, "the local prefill and the kv_out prompt are still computing");

    cr_assert_eq(decode_sched_cancel_all(ds), 3);
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.running, 1, "the computing kv_out prompt stays");
    cr_assert_eq(st.waiting, 0);
    cr_assert_eq(st.kv_out_held, 1, "the held kv_out prompt stays");
    /* what is left holds only the two kv_out prompts' blocks (50 tokens each: 4 blocks) */
    cr_assert_leq(st.used_blocks, 8, "%d blocks used after cancel_all", st.used_blocks);
    cr_assert_eq(decode_sched_cancel_all(ds), 0);
    int cancelled[6] = {0};
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    for (int k = 0; k < r.n_events; k++) {
        cr_assert_lt(r.events[k].id, 6);
        if (r.events[k].finish == DECODE_FINISH_CANCELLED) {
            cr_assert_eq(r.events[k].token, -1);
            cancelled[r.events[k].id]++;
        } else {
            cr_assert_eq(r.events[k].id, 3, "request %llu has an event after cancel_all",
                         (unsigned long long)r.events[k].id);
        }
    }
    cr_assert(cancelled[1] == 1 && cancelled[2] == 1 && cancelled[5] == 1 && !cancelled[3] && !cancelled[4],
              "cancelled events: 1:%d 2:%d 3:%d 4:%d 5:%d", cancelled[1], cancelled[2], cancelled[3], cancelled[4],
              cancelled[5]);
    cr_assert_eq(decode_sched_cancel(ds, 3), TD_OK);
    cr_assert_eq(decode_sched_release(ds, 4), TD_OK);
    assert_no_leak(&fx, ds);
    decode_sched_destroy(ds);
    td_test_engine_close(&fx);
}

Test(decode_sched, shared_pool_blocks_return_tcp, .timeout = 120)
{
    shared_leases_return_every_block("tcp");
}

Test(decode_sched, shared_pool_blocks_return_shm, .timeout = 120)
{
    shared_leases_return_every_block("sm,tcp");
}

/* The decode node's two threads on one block manager: a "compute" thread runs the
 * scheduler (sequences growing, finishing, preempted in a small pool) while this thread,
 * as the loop does, leases and cancels blocks through td_xfer. The block manager must end
 * consistent with every block back (td_kv serializes its operations; without that the
 * free list races). */
typedef struct churn {
    decode_sched_t *ds;
    td_kv_cache_t *kv;
    int32_t prompts[8][24];
    volatile bool stop;
    int finished;
} churn_t;

static void *churn_compute(void *arg)
{
    churn_t *c = arg;
    for (int round = 0; round < 6; round++) {
        for (int i = 0; i < 8; i++) {
            decode_request_t rq = greedy_request((uint64_t)(round * 8 + i), c->prompts[i], 24, 40);
            if (decode_sched_admit(c->ds, &rq) != TD_OK)
                return (void *)1;
        }
        while (decode_sched_busy(c->ds)) {
            decode_step_result_t r;
            if (decode_sched_step(c->ds, 0, &r) != TD_OK)
                return (void *)2;
            for (int e = 0; e < r.n_events; e++)
                c->finished += r.events[e].finish != DECODE_FINISH_NONE;
            /* between steps, what the engine does to the block manager, many times over
               (a step alone is mostly arithmetic: races would be rare) */
            for (int k = 0; k < 200; k++) {
                td_kv_seq_t q;
                td_kv_seq_init(&q);
                td_kv_cow_t cow;
                if (td_kv_seq_reserve(c->kv, &q, 1 + k % 40, &cow) == TD_OK)
                    td_kv_seq_commit(c->kv, &q, c->prompts[k % 8], TD_MIN(24, 1 + k % 40));
                td_kv_seq_free(c->kv, &q);
            }
        }
    }
    c->stop = true;
    return NULL;
}

Test(decode_sched, shared_pool_leases_and_engine_on_two_threads, .timeout = 240)
{
    td_test_skip_without_stories();
    shared_fx_t *f = calloc(1, sizeof *f);
    shared_open(f, "tcp");
    churn_t c = {0};
    decode_sched_config_t cfg = decode_sched_config_default();
    cr_assert_eq(decode_sched_create(f->fx.eng, NULL, &cfg, &c.ds), TD_OK);
    c.kv = f->kv;
    unsigned s = 9;
    for (int i = 0; i < 8; i++)
        random_prompt(&s, c.prompts[i], 24);
    /* The sender's connection all the way up first (a transfer adopted and returned): one
       nobody progressed, still being set up at teardown, crashed UCX 1.13's async thread in
       ucp_cm_server_conn_request_cb (SIGSEGV inside shared_close: the CI's "CRASH!" of this
       test, about 1 run in 75 here; not the block manager) */
    uint64_t lease0;
    td_xfer_token_t tok0;
    int32_t b0[2];
    cr_assert_eq(td_xfer_lease_create(f->rx, 1, 2, 5000, b0, &lease0, &tok0), TD_OK); /* lease 1: shared_push sends request = lease */
    shared_push(f, lease0, &tok0, b0, 2, c.prompts[0], 24);
    shared_run_until(f, &f->ready, 1, 5);
    cr_assert_eq(f->ready, 1, "the warm-up transfer landed");
    td_kv_unref_blocks_for(f->kv, TD_KV_HOLDER_LANDED, f->last.blocks, f->last.n_blocks);
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, churn_compute, &c), 0);
    int32_t blocks[8];
    uint64_t leases = 0, refused = 0;
    while (!c.stop) {
        uint64_t lease;
        td_xfer_token_t tok;
        td_status_t st = td_xfer_lease_create(f->rx, leases, 1 + (int32_t)(leases % 8), 5000, blocks, &lease, &tok);
        if (st == TD_OK)
            cr_assert_eq(td_xfer_lease_cancel(f->rx, lease), TD_OK);
        else
            refused++; /* the engine holds the pool right now: fine, try again */
        leases++;
    }
    void *rc;
    pthread_join(th, &rc);
    cr_assert_null(rc, "compute thread failed at %p", rc);
    cr_assert_eq(c.finished, 48);
    cr_assert_gt(leases - refused, 100, "only %llu leases went through", (unsigned long long)(leases - refused));
    cr_assert_eq(td_kv_cache_check(f->kv), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_kv_available(f->kv), f->initial, "every block back");
    decode_sched_destroy(c.ds);
    shared_close(f);
    free(f);
}

/* The decode node's whole ownership chain on its two threads, with the races the paused
 * peers of the reported double free make (h37f): this thread plays the loop (leases, a
 * sender pushing KV into them, cancels, the expiry tick), a compute thread the engine
 * (adoptions from a bounded command queue, steps, cancels). Leases live 1-60 ms or 5 s, so
 * they expire before the push, mid-push, during adoption, and after the hand-over while the
 * landed blocks wait in the queue (the compute thread takes commands only every few ms);
 * cancels come at random points, before and after the hand-over; some landed requests are
 * cancelled on the compute thread before and after adoption. td_kv's holders make any
 * release by the wrong owner abort at that call; at the end every block is back, the block
 * manager checks, and td_xfer's counts add up. */
enum { XR_Q = 64, XR_PROMPTS = 4, XR_ROUNDS = 160 };

typedef struct xr_cmd {
    uint64_t id;
    int32_t n_blocks, first, prompt;
    int32_t blocks[8];
    bool cancel; /* a Release for id, not an admission */
} xr_cmd_t;

typedef struct xrace {
    shared_fx_t *f;
    decode_sched_t *ds;
    int32_t prompts[XR_PROMPTS][40];
    int32_t firsts[XR_PROMPTS];
    pthread_mutex_t mu;
    xr_cmd_t q[XR_Q];
    int n_q;
    bool stop;
    int landed, adopted, refused, finished, cancelled_sched;
} xrace_t;

/* kv-ready on the loop: the landed blocks (LANDED) go to the compute thread, or back when the
 * queue is full (the decode node's full command ring) */
static void xr_on_ready(void *arg, const td_xfer_ready_t *r)
{
    xrace_t *x = arg;
    pthread_mutex_lock(&x->mu);
    bool room = x->n_q < XR_Q && r->n_blocks <= 8;
    if (room) {
        xr_cmd_t *c = &x->q[x->n_q++];
        *c = (xr_cmd_t){.id = r->request_id, .n_blocks = r->n_blocks, .first = (int32_t)r->first_token,
                        .prompt = (int32_t)(r->request_id % XR_PROMPTS)};
        memcpy(c->blocks, r->blocks, (size_t)r->n_blocks * sizeof(int32_t));
        x->landed++;
    }
    pthread_mutex_unlock(&x->mu);
    if (!room)
        td_kv_unref_blocks_for(x->f->kv, TD_KV_HOLDER_LANDED, r->blocks, r->n_blocks);
}

static void *xr_compute(void *arg)
{
    xrace_t *x = arg;
    xr_cmd_t cmds[XR_Q];
    for (;;) {
        pthread_mutex_lock(&x->mu);
        int n = x->n_q;
        memcpy(cmds, x->q, (size_t)n * sizeof *cmds);
        x->n_q = 0;
        bool stop = x->stop;
        pthread_mutex_unlock(&x->mu);
        for (int i = 0; i < n; i++) {
            xr_cmd_t *c = &cmds[i];
            if (c->cancel) {
                x->cancelled_sched += decode_sched_cancel(x->ds, c->id) == TD_OK;
                continue;
            }
            decode_request_t rq = greedy_request(c->id, x->prompts[c->prompt], 40, 6);
            rq.kv_blocks = c->blocks;
            rq.n_kv_blocks = c->n_blocks;
            rq.first_token = c->first;
            if (decode_sched_admit(x->ds, &rq) == TD_OK) {
                x->adopted++;
            } else { /* the decode node's compute_admit: the references go back */
                x->refused++;
                td_kv_unref_blocks_for(x->f->kv, TD_KV_HOLDER_LANDED, c->blocks, c->n_blocks);
            }
            if (c->id % 7 == 0) /* a Release right behind its admission */
                x->cancelled_sched += decode_sched_cancel(x->ds, c->id) == TD_OK;
        }
        if (decode_sched_busy(x->ds)) {
            decode_step_result_t r;
            if (decode_sched_step(x->ds, 0, &r) != TD_OK)
                return (void *)1;
            for (int e = 0; e < r.n_events; e++)
                x->finished += r.events[e].finish != DECODE_FINISH_NONE;
        } else if (stop && n == 0) {
            return NULL;
        }
        usleep(2000); /* landed blocks wait here past their leases' deadlines */
    }
}

/* Runs the shared loop (sender and receiver) for about `ms` milliseconds. */
static void xr_spin(shared_fx_t *f, double ms)
{
    double end = td_now_s() + ms * 1e-3;
    do
        uv_run(&f->loop, UV_RUN_NOWAIT);
    while (td_now_s() < end);
}

static void xr_transfers_race(const char *tls)
{
    td_test_skip_without_stories();
    shared_fx_t *f = calloc(1, sizeof *f);
    shared_open(f, tls);
    xrace_t *x = calloc(1, sizeof *x);
    x->f = f;
    pthread_mutex_init(&x->mu, NULL);
    decode_sched_config_t cfg = decode_sched_config_default();
    cr_assert_eq(decode_sched_create(f->fx.eng, NULL, &cfg, &x->ds), TD_OK);
    /* every prompt's KV computed once on the "prefill" engine, before the threads start (one
       backend, used by one thread at a time); the sender reads that pool from then on */
    td_kv_seq_t pre[XR_PROMPTS];
    unsigned seed = 5;
    float *logits = malloc((size_t)f->fx.vocab * sizeof(float));
    for (int k = 0; k < XR_PROMPTS; k++) {
        random_prompt(&seed, x->prompts[k], 40);
        td_kv_seq_init(&pre[k]);
        td_engine_item_t it = {.seq = &pre[k], .tokens = x->prompts[k], .n_tokens = 40, .n_logits = 1};
        cr_assert_eq(td_engine_step(f->pre, &it, 1, logits), TD_OK);
        x->firsts[k] = td_test_argmax(logits, f->fx.vocab);
    }
    free(logits);
    f->ready_hook = xr_on_ready;
    f->hook_arg = x;
    xr_spin(f, 50); /* the sender's hello */
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, xr_compute, x), 0);
    const td_kv_layout_t *L = td_engine_kv_layout(f->pre);
    int32_t pool_blocks;
    uint8_t *pool = td_engine_kv_pool(f->pre, &pool_blocks);
    unsigned r = 17;
    int sent = 0, exhausted = 0;
    for (uint64_t id = 1; id <= XR_ROUNDS; id++) {
        r = r * 1103515245u + 12345u;
        unsigned pick = (r >> 16) % 8;
        uint32_t ttl = pick < 5 ? 1 + (r >> 8) % 60 : 5000; /* most expire around the push */
        int32_t blocks[3];
        uint64_t lease;
        td_xfer_token_t tok;
        td_status_t st = td_xfer_lease_create(f->rx, id, 3, ttl, blocks, &lease, &tok);
        if (st == TD_ERR_EXHAUSTED) { /* the engine holds the pool: let it run */
            exhausted++;
            xr_spin(f, 5);
            continue;
        }
        cr_assert_eq(st, TD_OK, "%s", td_last_error());
        int k = (int)(id % XR_PROMPTS);
        td_xfer_send_params_t sp = {.request_id = id, .lease_id = lease, .token = tok, .dst_blocks = blocks,
                                    .n_dst_blocks = 3, .n_tokens = 40, .checksum = (id & 1) != 0,
                                    .mem = TD_XFER_MEM_HOST, .done = shared_on_done, .arg = f};
        if (ttl < 5000) /* a prefill that takes a while: the lease may die before the first layer */
            usleep(1000 * ((r >> 20) % (2 * ttl)));
        td_xfer_send_t *snd;
        cr_assert_eq(td_xfer_send_begin(f->tx, f->peer, &sp, &snd), TD_OK, "%s", td_last_error());
        bool failed = false;
        for (uint32_t l = 0; l < L->n_layers; l++) {
            /* a lease dead mid-push fails the request (STALE at the bind): the layers left are
               refused with that status and finish delivers the verdict, as in a prefill node */
            if ((failed = td_xfer_send_layer(snd, l, pool + td_kv_block_offset(L, (uint32_t)pool_blocks, l, 0),
                                             pre[k].blocks) != TD_OK))
                break;
            if (ttl < 5000) { /* layer by layer, as a prefill node computes them: dies mid-push too */
                uv_run(&f->loop, UV_RUN_NOWAIT);
                usleep(1000 * ((r >> (l % 16)) % 4));
            }
        }
        if (!failed)
            td_xfer_send_finish(snd, x->firsts[k]);
        else
            td_xfer_send_abort(snd, TD_OK); /* its verdict comes as the done callback */
        sent++;
        switch ((r >> 4) % 4) {
        case 0: /* the Release before its KV lands */
            td_xfer_lease_cancel(f->rx, lease);
            break;
        case 1: /* mid-transfer, or after the hand-over (STALE then) */
            xr_spin(f, (r >> 3) % 4);
            td_xfer_lease_cancel(f->rx, lease);
            break;
        case 2: /* after the hand-over: a Release that the compute thread takes */
            xr_spin(f, 3);
            td_xfer_lease_cancel(f->rx, lease);
            pthread_mutex_lock(&x->mu);
            if (x->n_q < XR_Q)
                x->q[x->n_q++] = (xr_cmd_t){.id = id, .cancel = true};
            pthread_mutex_unlock(&x->mu);
            break;
        default:
            break;
        }
        xr_spin(f, (r >> 12) % 3);
    }
    int want_done = sent;
    double end = td_now_s() + 20;
    while (f->done < want_done && td_now_s() < end)
        uv_run(&f->loop, UV_RUN_ONCE);
    cr_assert_eq(f->done, want_done, "every transfer has its verdict (%d of %d)", f->done, want_done);
    td_xfer_stats_t xs;
    end = td_now_s() + 10; /* the last leases expire (5 s ones among them) */
    do {
        xr_spin(f, 10);
        td_xfer_get_stats(f->rx, &xs);
    } while (xs.leases_live > 0 && td_now_s() < end);
    cr_assert_eq(xs.leases_live, 0);
    pthread_mutex_lock(&x->mu);
    x->stop = true;
    pthread_mutex_unlock(&x->mu);
    void *rc;
    pthread_join(th, &rc);
    cr_assert_null(rc, "compute thread failed");
    cr_assert_eq(xs.leases_created, xs.leases_adopted + xs.leases_expired + xs.leases_cancelled + xs.leases_sender_lost,
                 "every lease ended once: created %llu, adopted %llu expired %llu cancelled %llu lost %llu",
                 (unsigned long long)xs.leases_created, (unsigned long long)xs.leases_adopted,
                 (unsigned long long)xs.leases_expired, (unsigned long long)xs.leases_cancelled,
                 (unsigned long long)xs.leases_sender_lost);
    cr_assert_eq((uint64_t)f->ready, xs.leases_adopted);
    cr_assert_eq(x->adopted + x->refused + (f->ready - x->landed), f->ready, "every landed transfer adopted or refused");
    cr_assert_gt(xs.leases_adopted, 5, "too few transfers landed to show anything (%llu)",
                 (unsigned long long)xs.leases_adopted);
    cr_assert_gt(xs.leases_expired, 5, "too few leases expired to show anything (%llu)",
                 (unsigned long long)xs.leases_expired);
    cr_log_info("transfers race (%s): %d sent, %d refused for room; leases adopted %llu expired %llu cancelled %llu; "
                "sequences adopted %d finished %d cancelled %d", tls, sent, exhausted,
                (unsigned long long)xs.leases_adopted, (unsigned long long)xs.leases_expired,
                (unsigned long long)xs.leases_cancelled, x->adopted, x->finished, x->cancelled_sched);
    for (int k = 0; k < XR_PROMPTS; k++)
        td_engine_seq_end(f->pre, &pre[k]);
    cr_assert_eq(td_kv_cache_check(f->kv), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_kv_available(f->kv), f->initial, "every block back");
    decode_sched_destroy(x->ds);
    pthread_mutex_destroy(&x->mu);
    free(x);
    shared_close(f);
    free(f);
}

Test(decode_sched, shared_pool_transfers_race_expiry_cancel_and_adoption_tcp, .timeout = 240)
{
    xr_transfers_race("tcp");
}

Test(decode_sched, shared_pool_transfers_race_expiry_cancel_and_adoption_shm, .timeout = 240)
{
    xr_transfers_race("sm,tcp");
}

/* ---- the unified role: chunked prefill inside decode steps ------------------------------ */

/* The step times the tests below report to the scheduler: 3 ms a step, 0.5 ms a prompt token. */
/* prompt_chunks_share_steps without an objective: fitted is not used */
#define CHUNK_ANY 0

static double law_s(int32_t prefill_tokens)
{
    return 0.003 + 0.0005 * prefill_tokens;
}

/* A running decode and a long prompt arriving: every step until the prompt is in carries
 * the decode's token (no stall), feeds at most max_batch_tokens, and spends the rest of the
 * budget on the prompt in chunks of at most prefill_chunk; with a TPOT objective on either
 * request (tpot0, tpot1; 0: none), the chunks the tightest one allows by the step-cost fit of
 * the steps' times (law_s): TD_DECODE_PROBE_CHUNK until the fit has seen enough steps with prompt
 * tokens, then `fitted` (conditional disaggregation). Both outputs equal their runs alone. */
static void prompt_chunks_share_steps(double tpot0, double tpot1, int fitted)
{
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, false);
    enum { NP = 200, BUDGET = 32, CHUNK = 24 };
    static int32_t p0[8], p1[NP], want0[MAXT], want1[MAXT];
    unsigned s = 21;
    random_prompt(&s, p0, 8);
    random_prompt(&s, p1, NP);
    bool eos0, eos1;
    int n0 = alone(&fx, p0, 8, 60, want0, &eos0), n1 = alone(&fx, p1, NP, 10, want1, &eos1);
    cr_assert_geq(n0, 40, "prompt 0 ends too soon for the test (%d tokens): change the seed", n0);
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.max_batch_tokens = BUDGET;
    cfg.prefill_chunk = CHUNK;
    decode_sched_t *ds;
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_OK, "%s", td_last_error());
    static outcome_t oc[MAXN];
    memset(oc, 0, sizeof oc);
    decode_request_t r0 = greedy_request(0, p0, 8, 60), r1 = greedy_request(1, p1, NP, 10);
    r0.tpot_objective_s = tpot0;
    r1.tpot_objective_s = tpot1;
    bool bound = tpot0 > 0 || tpot1 > 0;
    cr_assert_eq(decode_sched_admit(ds, &r0), TD_OK);
    decode_step_result_t r;
    int prefill_samples = 0; /* steps with prompt tokens the fit has seen */
    for (int i = 0; i < 3; i++) { /* request 0 prefilled and decoding */
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        decode_sched_note_step_time(ds, law_s(r.n_prefill_tokens));
        prefill_samples += r.n_prefill_tokens > 0;
        collect(&r, oc);
    }
    cr_assert(!decode_sched_step_cost(ds).valid, "a fit from %d step with prompt tokens", prefill_samples);
    decode_sched_stats_t st;
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.context_tokens, 0, "a generating sequence has no context left to feed");
    cr_assert_eq(decode_sched_admit(ds, &r1), TD_OK);
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.context_tokens, NP - 1, "the waiting prompt, all but its last token (fed as any next token)");
    int prefill_steps = 0, prompt_fed = 0;
    while (oc[1].n == 0 && oc[1].finish_events == 0) {
        int before = oc[0].n;
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        decode_sched_note_step_time(ds, law_s(r.n_prefill_tokens));
        int chunk = !bound ? CHUNK : prefill_samples < TD_STEPCOST_MIN_PREFILL ? TD_DECODE_PROBE_CHUNK : fitted;
        prefill_samples += r.n_prefill_tokens > 0;
        collect(&r, oc);
        decode_sched_stats(ds, &st);
        cr_assert_eq(st.context_tokens, TD_MAX(NP - 1 - prompt_fed - r.n_prefill_tokens, 0),
                     "what the router is told is queued here (step %d)", prefill_steps);
        cr_assert_eq(oc[0].n, before + 1, "the decode stalled behind the prompt (step %d)", prefill_steps);
        cr_assert_leq(r.n_tokens, BUDGET);
        cr_assert_eq(r.n_prefill_tokens, r.n_tokens - 1, "one decode token, the rest prompt");
        cr_assert_eq(r.n_prefill_tokens, TD_MIN(chunk, NP - prompt_fed), "step %d: chunks of %d", prefill_steps,
                     chunk);
        prompt_fed += r.n_prefill_tokens;
        prefill_steps++;
    }
    cr_assert_eq(prompt_fed, NP, "the prompt's tokens were fed once each (no prefix cache)");
    td_stepcost_fit_t f = decode_sched_step_cost(ds);
    cr_assert(f.valid && fabs(f.per_prefill_s - 0.0005) < 1e-9, "the fit found the law's 0.5 ms a prompt token");
    run_to_end(ds, oc);
    cr_assert_eq(oc[0].n, n0);
    cr_assert_eq(oc[1].n, n1);
    for (int t = 0; t < n0; t++)
        cr_assert_eq(oc[0].tokens[t], want0[t], "request 0 token %d", t);
    for (int t = 0; t < n1; t++)
        cr_assert_eq(oc[1].tokens[t], want1[t], "request 1 token %d", t);
    sched_end(&fx, ds);
    td_test_engine_close(&fx);
}

Test(decode_sched, unified_prompt_chunks_share_steps_with_decodes, .timeout = 120)
{
    td_test_skip_without_stories();
    prompt_chunks_share_steps(0, 0, CHUNK_ANY);
}

/* A TPOT objective bounds a step's prompt chunks by the step-cost fit: 13.1 ms leaves 20 tokens
 * beside the 3 ms step (law_s), whether the objective is the prompt's own or the running
 * stream's; the tighter of two wins; one past the node's prefill_chunk is capped by it. */
Test(decode_sched, a_tpot_objective_bounds_the_prompt_chunks_by_the_fit, .timeout = 120)
{
    td_test_skip_without_stories();
    prompt_chunks_share_steps(0, 0.0131, 20);
    prompt_chunks_share_steps(0.0131, 0, 20);
    prompt_chunks_share_steps(0.0131, 0.0121, 18);
    prompt_chunks_share_steps(0, 1.0, 24);
}

/* stories260K on one thread, prompts p0 (n0 tokens) and p1 (n1) drawn from seed, and a
 * scheduler of the defaults (skips without the model) */
static decode_sched_t *open_two_prompts(td_test_engine_t *fx, unsigned seed, int32_t *p0, int n0, int32_t *p1, int n1)
{
    td_test_skip_without_stories();
    td_test_engine_open_cpu(fx, 1, 256, false);
    random_prompt(&seed, p0, n0);
    random_prompt(&seed, p1, n1);
    return sched_default(fx->eng);
}

/* An objective the decodes alone pass (2 ms against a 3 ms step) still moves a prompt on: one
 * token a step once the fit says so (TD_DECODE_PROBE_CHUNK before), beside the running stream. */
Test(decode_sched, an_objective_the_decodes_pass_still_moves_the_prompt_a_token_a_step, .timeout = 120)
{
    td_test_engine_t fx;
    static int32_t p0[8], p1[100];
    decode_sched_t *ds = open_two_prompts(&fx, 21, p0, 8, p1, 100);
    decode_request_t r0 = greedy_request(0, p0, 8, 60), r1 = greedy_request(1, p1, 100, 4);
    r1.tpot_objective_s = 0.002;
    static outcome_t oc[MAXN];
    memset(oc, 0, sizeof oc);
    cr_assert_eq(decode_sched_admit(ds, &r0), TD_OK);
    decode_step_result_t r;
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK); /* r0's prompt: one step with prompt tokens */
    decode_sched_note_step_time(ds, law_s(r.n_prefill_tokens));
    collect(&r, oc);
    cr_assert_eq(decode_sched_admit(ds, &r1), TD_OK);
    for (int i = 0; i < 10; i++) {
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        decode_sched_note_step_time(ds, law_s(r.n_prefill_tokens));
        collect(&r, oc);
        int want = 1 + i < TD_STEPCOST_MIN_PREFILL ? TD_DECODE_PROBE_CHUNK : 1;
        cr_assert_eq(r.n_prefill_tokens, want, "step %d: %d prompt tokens, want %d", i, r.n_prefill_tokens, want);
        cr_assert_eq(r.n_tokens, want + 1, "and the stream's token");
    }
    run_to_end(ds, oc);
    sched_end(&fx, ds);
    td_test_engine_close(&fx);
}

/* A node whose every step carries prompt tokens from its start (two prompts admitted at once
 * under an objective: no decode-only step) still fits its step cost: its first steps are all
 * the probe, which leaves the fit's intercept and prompt column collinear, so once
 * TD_STEPCOST_MIN_PREFILL of them gave no fit every other probe is half (td_stepcost_probe)
 * and the next step is sized by the fit (20 tokens within 13.1 ms, law_s). */
Test(decode_sched, a_node_that_meets_a_queue_before_any_decode_only_step_still_fits_its_step_cost, .timeout = 120)
{
    td_test_engine_t fx;
    static int32_t p0[100], p1[100];
    decode_sched_t *ds = open_two_prompts(&fx, 5, p0, 100, p1, 100);
    decode_request_t r0 = greedy_request(0, p0, 100, 4), r1 = greedy_request(1, p1, 100, 4);
    r0.tpot_objective_s = r1.tpot_objective_s = 0.0131;
    static outcome_t oc[MAXN];
    memset(oc, 0, sizeof oc);
    cr_assert_eq(decode_sched_admit(ds, &r0), TD_OK);
    cr_assert_eq(decode_sched_admit(ds, &r1), TD_OK);
    const int want[] = {TD_DECODE_PROBE_CHUNK, TD_DECODE_PROBE_CHUNK, TD_DECODE_PROBE_CHUNK,
                        TD_DECODE_PROBE_CHUNK, TD_DECODE_PROBE_CHUNK / 2, 20, 20};
    _Static_assert(TD_STEPCOST_MIN_PREFILL == 4, "the probes above are TD_STEPCOST_MIN_PREFILL long");
    decode_step_result_t r;
    for (int i = 0; i < (int)TD_ARRAY_LEN(want); i++) {
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        decode_sched_note_step_time(ds, law_s(r.n_prefill_tokens));
        collect(&r, oc);
        cr_assert_eq(r.n_prefill_tokens, want[i], "step %d: %d prompt tokens, want %d", i, r.n_prefill_tokens,
                     want[i]);
        cr_assert_eq(r.n_tokens, r.n_prefill_tokens, "no sequence generates yet");
    }
    td_stepcost_fit_t f = decode_sched_step_cost(ds);
    cr_assert(f.valid && fabs(f.per_prefill_s - 0.0005) < 1e-9, "the fit found the law's 0.5 ms a prompt token");
    run_to_end(ds, oc);
    cr_assert_eq(oc[0].n, 4);
    cr_assert_eq(oc[1].n, 4);
    sched_end(&fx, ds);
    td_test_engine_close(&fx);
}

/* ignore_eos: a request that ends at EOS alone runs on to max_tokens, the tokens before
 * the EOS unchanged; stop ids still stop it. */
Test(decode_sched, unified_ignore_eos_runs_to_max_tokens, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, true);
    static int32_t p[4], want[MAXT];
    int n = 0, max = 400;
    bool eos = false;
    unsigned s = 1;
    for (int tries = 0; tries < 50 && !eos; tries++) { /* a short prompt the model ends */
        random_prompt(&s, p, 4);
        n = alone(&fx, p, 4, max, want, &eos);
    }
    cr_assert(eos, "no prompt ended at EOS within %d tokens", max);
    decode_sched_t *ds = sched_default(fx.eng);
    static outcome_t oc[MAXN];
    memset(oc, 0, sizeof oc);
    decode_request_t rq = greedy_request(0, p, 4, max);
    rq.ignore_eos = true;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    run_to_end(ds, oc);
    cr_assert_eq(oc[0].finish, DECODE_FINISH_LENGTH, "finish %s", decode_finish_name(oc[0].finish));
    cr_assert_eq(oc[0].n, max, "%d tokens with ignore_eos, max_tokens %d (EOS after %d)", oc[0].n, max, n);
    for (int t = 0; t < n; t++)
        cr_assert_eq(oc[0].tokens[t], want[t], "token %d before the EOS changed", t);
    bool eos_inside = false;
    for (int t = n; t < max; t++)
        eos_inside |= is_eos(&fx, oc[0].tokens[t]);
    cr_assert(eos_inside, "the EOS id itself is output (it was sampled at token %d)", n);
    /* a stop id still stops an ignore_eos request */
    int32_t stop_id = want[n / 2];
    bool earlier = false;
    for (int t = 0; t < n / 2; t++)
        earlier |= want[t] == stop_id;
    memset(oc, 0, sizeof oc);
    rq.id = 1;
    rq.stop_ids = &stop_id;
    rq.n_stop_ids = 1;
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    run_to_end(ds, oc);
    cr_assert_eq(oc[1].finish, DECODE_FINISH_STOP);
    if (!earlier)
        cr_assert_eq(oc[1].n, n / 2);
    sched_end(&fx, ds);
    td_test_engine_close(&fx);
}

/* A cancel while the prompt is half prefilled (chunks of it in the pool, the rest to
 * come) releases its blocks before decode_sched_cancel returns; the next step reports it. */
Test(decode_sched, unified_cancel_mid_prefill_returns_every_block, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, false);
    static int32_t p[300];
    unsigned s = 5;
    random_prompt(&s, p, 300);
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.max_batch_tokens = 64;
    cfg.prefill_chunk = 64;
    decode_sched_t *ds;
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_OK, "%s", td_last_error());
    decode_request_t rq = greedy_request(3, p, 300, 50);
    cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK);
    decode_step_result_t r;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        cr_assert_eq(r.n_prefill_tokens, 64);
        cr_assert_eq(r.n_events, 0, "no token before the prompt is in");
    }
    decode_sched_stats_t st;
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.used_blocks, 128 / 16, "two chunks' blocks held: %d", st.used_blocks);
    cr_assert_eq(decode_sched_cancel(ds, 3), TD_OK);
    decode_sched_stats(ds, &st);
    cr_assert_eq(st.used_blocks, 0, "%d blocks held after the cancel", st.used_blocks);
    cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    cr_assert_eq(r.n_events, 1);
    cr_assert_eq(r.events[0].finish, DECODE_FINISH_CANCELLED);
    cr_assert(!decode_sched_busy(ds));
    sched_end(&fx, ds);
    td_test_engine_close(&fx);
}

/* ---- speculative decoding ----------------------------------------------------------------- */

/* Blocks held in an engine's pool. */
static int32_t used_blocks(td_engine_t *eng)
{
    td_kv_stats_t ks;
    td_kv_get_stats(td_engine_kv(eng), &ks);
    return ks.used;
}

/* N requests (greedy, seeded with logprobs, seeded with penalties and a stop id, in turn) with
 * prompts that repeat themselves, admitted one every `every` steps (all at once when every >
 * 10000), run to the end under cfg; the outcomes and the scheduler's stats. With cfg->draft,
 * deng is the draft model's engine: once every request is done, its pool holds no block. */
static void run_spec_mix(td_test_engine_t *fx, const decode_sched_config_t *cfg, td_engine_t *deng, int n, int every,
                         outcome_t *oc, decode_sched_stats_t *st)
{
    static int32_t prompts[MAXN][96];
    int n_prompt[MAXN];
    unsigned s = 21;
    for (int i = 0; i < n; i++) {
        int unit = 6 + (int)(rng_next(&s) % 12), reps = 2 + i % 3;
        random_prompt(&s, prompts[i], unit);
        for (int r = 1; r < reps; r++)
            memcpy(prompts[i] + r * unit, prompts[i] + 1, (size_t)(unit - 1) * sizeof(int32_t));
        n_prompt[i] = unit + (reps - 1) * (unit - 1);
    }
    memset(oc, 0, (size_t)n * sizeof *oc);
    decode_sched_t *ds;
    cr_assert_eq(decode_sched_create(fx->eng, NULL, cfg, &ds), TD_OK, "%s", td_last_error());
    int32_t stop_id = 300;
    int admitted = 0;
    for (int step = 0; step < 20000 && (admitted < n || decode_sched_busy(ds)); step++) {
        while (admitted < n && (step % every == 0 || every > 10000)) {
            int i = admitted++;
            decode_request_t rq = greedy_request((uint64_t)i, prompts[i], n_prompt[i], 40 + 13 * i);
            if (i % 3 >= 1) {
                rq.sampling.temperature = 0.3f + 0.1f * (float)(i % 4);
                rq.sampling.top_p = 0.9f;
                rq.sampling.seed = 100 + (uint64_t)i;
                rq.logprobs = true;
                rq.top_logprobs = 3;
            }
            if (i % 3 == 2) {
                rq.sampling.repetition_penalty = 1.1f;
                rq.sampling.frequency_penalty = 0.3f;
                rq.stop_ids = &stop_id;
                rq.n_stop_ids = 1;
            }
            cr_assert_eq(decode_sched_admit(ds, &rq), TD_OK, "%s", td_last_error());
            if (every <= 10000)
                break;
        }
        decode_step_result_t r;
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
        cr_assert_leq(r.n_tokens, cfg->max_batch_tokens);
        /* every > 10000: all prompts in the first step, pure decode steps after it */
        cr_assert(every <= 10000 || step == 0 || r.n_prefill_tokens == 0, "step %d carries a prompt chunk", step);
        collect(&r, oc);
    }
    cr_assert(!decode_sched_busy(ds), "requests left after 20000 steps");
    decode_sched_stats(ds, st);
    if (deng) {
        cr_assert_eq(used_blocks(deng), 0, "%d draft blocks held after every request ended", used_blocks(deng));
        cr_assert_eq(td_kv_cache_check(td_engine_kv(deng)), TD_OK, "%s", td_last_error());
    }
    sched_end(fx, ds);
}

/* A pool for the speculation tests: the engine's blocks, the scheduler's limits, requests
 * admitted one every `every` steps (all at once past 10000), the draft model's blocks. */
typedef struct spec_pool {
    int n_blocks;
    bool prefix_cache;
    int max_batch, max_batch_tokens, prefill_chunk, every, draft_blocks;
} spec_pool_t;

enum { SPEC_N = 9 };

/* Pool p: the mix (run_spec_mix) without speculation, then with spec (draft: the drafter over
 * deng, for a draft model). Every request's tokens and finish equal; where every prompt is in
 * before the first decode step (a decode node's case: pure decode steps) its logprob floats
 * too, bit for bit; elsewhere (step timing changes which kernel computes a row,
 * docs/kernels.md "Batch invariance") only the greedy requests are compared. Drafts were
 * accepted, and with `fewer` the steps were fewer. The stats of the run with speculation. */
static void spec_equals_off(td_test_engine_t *fx, const spec_pool_t *pl, size_t p, const td_spec_config_t *spec,
                            td_spec_draft_t *draft, td_engine_t *deng, bool fewer, decode_sched_stats_t *st_on)
{
    static outcome_t off[SPEC_N], on[SPEC_N];
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.max_batch = pl->max_batch;
    cfg.max_batch_tokens = pl->max_batch_tokens;
    cfg.prefill_chunk = pl->prefill_chunk;
    decode_sched_stats_t st_off;
    run_spec_mix(fx, &cfg, NULL, SPEC_N, pl->every, off, &st_off);
    cfg.spec = *spec;
    cfg.draft = draft;
    run_spec_mix(fx, &cfg, deng, SPEC_N, pl->every, on, st_on);
    bool exact = pl->every > 10000;
    for (int i = 0; i < SPEC_N; i++) {
        cr_assert_eq(on[i].finish_events, 1);
        if (!exact && i % 3 != 0)
            continue; /* sampled at temperature > 0: a last-bit difference may flip a draw */
        cr_assert_eq(on[i].finish, off[i].finish, "pool %zu request %d: finish %s, without speculation %s", p, i,
                     decode_finish_name(on[i].finish), decode_finish_name(off[i].finish));
        cr_assert_eq(on[i].n, off[i].n, "pool %zu request %d: %d tokens, without speculation %d", p, i, on[i].n,
                     off[i].n);
        cr_assert(!memcmp(on[i].tokens, off[i].tokens, (size_t)on[i].n * sizeof(int32_t)),
                  "pool %zu request %d: other tokens with speculation", p, i);
        cr_assert(!exact || !memcmp(on[i].lps, off[i].lps, (size_t)on[i].n * sizeof(float)),
                  "pool %zu request %d: other logprobs with speculation", p, i);
    }
    cr_assert_gt(st_on->spec.accepted, 0, "pool %zu: no draft accepted (%llu drafted): the test shows nothing", p,
                 (unsigned long long)st_on->spec.drafted);
    cr_assert(fewer ? st_on->steps < st_off.steps : st_on->steps <= st_off.steps,
              "pool %zu: %llu steps with speculation, %llu without", p, (unsigned long long)st_on->steps,
              (unsigned long long)st_off.steps);
    if (exact)
        cr_assert_eq(st_on->tokens_generated, st_off.tokens_generated);
    if (pl->n_blocks < 64)
        cr_assert_gt(st_on->preemptions, 0, "the tiny pool never preempted");
    cr_assert_eq(st_off.spec.drafted, 0);
}

/* Speculation changes the number of steps, nothing else: every request's tokens, logprob
 * floats and finish reason equal those without it (greedy, seeded, penalties, stop ids,
 * max tokens), drafts were accepted, and no block leaks (spec_equals_off). Pool 0 is a decode
 * node's case: every prompt is in before the first decode step, so every later step is a pure
 * decode step and the floats are compared bit for bit. Pool 1 is tiny: requests arrive one
 * every 4 steps and are preempted and recomputed, and a step carrying a prompt chunk runs the
 * prefill kernel for every row in it (docs/kernels.md "Batch invariance": a one-row item
 * beside a chunk is not bit-equal to a pure decode step), so which floats a token gets
 * depends on step timing, which speculation changes; there the greedy requests' tokens and
 * finishes are compared (as preemption_under_a_tiny_pool_keeps_tokens_and_blocks does). */
Test(decode_sched, speculation_changes_steps_not_tokens, .timeout = 300)
{
    td_test_skip_without_stories();
    const spec_pool_t pools[] = {{1024, true, SPEC_N, 512, 96, 100000, 0}, {12, false, 5, 48, 16, 4, 0}};
    td_spec_config_t spec = td_spec_config_default();
    spec.mode = TD_SPEC_PROMPT_LOOKUP;
    spec.k_max = 4;
    for (size_t p = 0; p < TD_ARRAY_LEN(pools); p++) {
        td_test_engine_t fx;
        td_test_engine_open_cpu(&fx, 1, pools[p].n_blocks, pools[p].prefix_cache);
        decode_sched_stats_t st;
        spec_equals_off(&fx, &pools[p], p, &spec, NULL, NULL, true, &st);
        td_test_engine_close(&fx);
    }
}

Test(decode_sched, speculation_config_is_checked, .timeout = 60)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 64, false);
    decode_sched_config_t cfg = decode_sched_config_default();
    decode_sched_t *ds = NULL;
    cfg.spec.mode = TD_SPEC_PROMPT_LOOKUP;
    cfg.spec.k_max = TD_SPEC_MAX_DRAFT + 1;
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_ERR_INVALID);
    cfg.spec = td_spec_config_default();
    cfg.spec.mode = TD_SPEC_DRAFT_MODEL; /* without a drafter */
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_ERR_INVALID);
    cr_assert_null(ds);
    td_test_engine_close(&fx);
}

/* stories260K drafting for itself: an engine of its own on fx's model and backend, n_blocks
 * KV blocks, and the drafter over it. */
static void draft_open(td_test_engine_t *fx, int n_blocks, td_engine_t **deng_p, td_spec_draft_t **draft_p)
{
    td_engine_config_t dc = td_engine_config_default();
    dc.n_blocks = n_blocks;
    dc.prefix_cache = false;
    dc.max_seqs = 1;
    dc.max_logit_rows = 1;
    cr_assert_eq(td_engine_create(fx->model, fx->be, &dc, deng_p), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_spec_draft_create(*deng_p, fx->vocab, draft_p), TD_OK, "%s", td_last_error());
}

/* With a draft model too, speculation changes the number of steps, nothing else (the pools of
 * speculation_changes_steps_not_tokens), and also with a draft pool too small for most
 * contexts (6 blocks: those sequences skip drafting and back off, nobody fails; the longest
 * request never drafts and sets the step count). Every draft block is back once the requests
 * are done, preempted ones included (run_spec_mix). */
Test(decode_sched, draft_model_changes_steps_not_tokens, .timeout = 300)
{
    td_test_skip_without_stories();
    const spec_pool_t pools[] = {{1024, true, SPEC_N, 512, 96, 100000, 1024}, {1024, true, SPEC_N, 512, 96, 100000, 6},
                                 {12, false, 5, 48, 16, 4, 1024}};
    td_spec_config_t spec = td_spec_config_default();
    spec.mode = TD_SPEC_DRAFT_MODEL;
    spec.k_max = 4;
    for (size_t p = 0; p < TD_ARRAY_LEN(pools); p++) {
        td_test_engine_t fx;
        td_test_engine_open_cpu(&fx, 1, pools[p].n_blocks, pools[p].prefix_cache);
        td_engine_t *deng;
        td_spec_draft_t *draft;
        draft_open(&fx, pools[p].draft_blocks, &deng, &draft);
        decode_sched_stats_t st;
        spec_equals_off(&fx, &pools[p], p, &spec, draft, deng, pools[p].draft_blocks >= 64, &st);
        td_spec_draft_destroy(draft);
        td_engine_destroy(deng);
        td_test_engine_close(&fx);
    }
}

/* Cancel and deadline give a sequence's draft blocks back at once, as they do its own. */
Test(decode_sched, draft_model_blocks_go_with_cancel_and_deadline, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, false);
    td_engine_t *deng;
    td_spec_draft_t *draft;
    draft_open(&fx, 256, &deng, &draft);
    decode_sched_config_t cfg = decode_sched_config_default();
    cfg.spec.mode = TD_SPEC_DRAFT_MODEL;
    cfg.spec.k_max = 4;
    cfg.draft = draft;
    decode_sched_t *ds;
    cr_assert_eq(decode_sched_create(fx.eng, NULL, &cfg, &ds), TD_OK, "%s", td_last_error());
    unsigned s = 5;
    int32_t p0[40], p1[40];
    random_prompt(&s, p0, 40);
    random_prompt(&s, p1, 40);
    decode_request_t r0 = greedy_request(0, p0, 40, 200), r1 = greedy_request(1, p1, 40, 200);
    r1.deadline_ns = 1000;
    cr_assert_eq(decode_sched_admit(ds, &r0), TD_OK, "%s", td_last_error());
    cr_assert_eq(decode_sched_admit(ds, &r1), TD_OK, "%s", td_last_error());
    decode_step_result_t r;
    for (int i = 0; i < 4; i++) /* the prompts, then decode steps that draft */
        cr_assert_eq(decode_sched_step(ds, 0, &r), TD_OK);
    decode_sched_stats_t st;
    decode_sched_stats(ds, &st);
    cr_assert_gt(st.spec.drafted, 0, "nothing drafted: the test shows nothing");
    int32_t held = used_blocks(deng);
    cr_assert_geq(held, 2 * 3, "%d draft blocks for two contexts of 40+ tokens", held);
    cr_assert_eq(decode_sched_cancel(ds, 0), TD_OK);
    cr_assert_lt(used_blocks(deng), held, "the cancel left its draft blocks (%d held)", used_blocks(deng));
    cr_assert_eq(decode_sched_step(ds, 2000, &r), TD_OK); /* request 1's deadline */
    cr_assert_eq(used_blocks(deng), 0, "%d draft blocks held after cancel and deadline", used_blocks(deng));
    cr_assert(!decode_sched_busy(ds));
    sched_end(&fx, ds);
    td_spec_draft_destroy(draft);
    td_engine_destroy(deng);
    td_test_engine_close(&fx);
}
