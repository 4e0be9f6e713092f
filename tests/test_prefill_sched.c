/*
 * test_prefill_sched: the prefill batcher on stories260K. Chunked packing never exceeds
 * the token budget and completes prompts in arrival order; every first token equals the
 * engine's greedy first token for the prompt alone; the returned sequence holds the whole
 * prompt; queued-token accounting; the prefix cache is used on a repeated prompt; a
 * tiny pool restarts prompts instead of failing them, and nothing leaks.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_sched.h"
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

static void fx_open(fixture_t *fx, int n_blocks)
{
    cr_assert_eq(td_model_load(stories_path(), &fx->model), TD_OK, "%s", td_last_error());
    td_cpu_config_t cc = {.n_threads = 1};
    cr_assert_eq(td_backend_cpu_create(&cc, &fx->be), TD_OK);
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = n_blocks;
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

/* The engine's greedy first token for the prompt alone, in one step. */
static int first_alone(fixture_t *fx, const int32_t *p, int n)
{
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    float *logits = malloc((size_t)fx->vocab * sizeof(float));
    td_engine_item_t it = {.seq = &seq, .tokens = p, .n_tokens = n, .n_logits = 1};
    cr_assert_eq(td_engine_step(fx->eng, &it, 1, logits), TD_OK, "%s", td_last_error());
    int t = argmax(logits, fx->vocab);
    td_engine_seq_end(fx->eng, &seq);
    free(logits);
    return t;
}

static unsigned rng_next(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return (*s >> 8) & 0xffffff;
}

enum { N = 12, MAXP = 200 };

static int32_t prompts[N][MAXP];
static int n_prompt[N], want[N];

static void make_prompts(fixture_t *fx, unsigned seed)
{
    unsigned s = seed;
    for (int i = 0; i < N; i++) {
        n_prompt[i] = 1 + (int)(rng_next(&s) % MAXP);
        prompts[i][0] = 1;
        for (int j = 1; j < n_prompt[i]; j++)
            prompts[i][j] = 3 + (int32_t)(rng_next(&s) % 509);
        want[i] = first_alone(fx, prompts[i], n_prompt[i]);
    }
}

static void submit_all(prefill_sched_t *ps)
{
    for (int i = 0; i < N; i++) {
        prefill_request_t rq = {.id = (uint64_t)i, .prompt = prompts[i], .n_prompt = n_prompt[i],
                                .sampling = td_sampling_default()};
        cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK, "%s", td_last_error());
    }
}

static void assert_no_leak(fixture_t *fx)
{
    td_kv_stats_t ks;
    td_kv_get_stats(td_engine_kv(fx->eng), &ks);
    cr_assert_eq(ks.used, 0, "%d blocks still referenced", ks.used);
    cr_assert_eq(td_kv_cache_check(td_engine_kv(fx->eng)), TD_OK, "%s", td_last_error());
}

Test(prefill_sched, chunked_packing_respects_budget_and_first_tokens_match, .timeout = 300)
{
    skip_without_model();
    fixture_t fx;
    fx_open(&fx, 1024);
    make_prompts(&fx, 17);
    prefill_sched_config_t cfg = prefill_sched_config_default();
    cfg.max_batch_tokens = 64;
    prefill_sched_t *ps;
    cr_assert_eq(prefill_sched_create(fx.eng, &cfg, &ps), TD_OK);
    submit_all(ps);
    int64_t total = 0;
    for (int i = 0; i < N; i++)
        total += n_prompt[i];
    cr_assert_eq(prefill_sched_queued_tokens(ps), total);
    cr_assert_eq(prefill_sched_queued(ps), N);
    int done = 0, steps = 0;
    int64_t computed = 0, cached = 0, last_queued = total;
    while (done < N) {
        cr_assert_lt(steps++, 1000);
        prefill_step_result_t r;
        cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
        cr_assert_leq(r.n_tokens, 64, "step of %d tokens, budget 64", r.n_tokens);
        cr_assert_gt(r.n_tokens, 0, "a step with work queued did nothing");
        computed += r.n_tokens;
        for (int j = 0; j < r.n_outputs; j++) {
            const prefill_output_t *o = &r.outputs[j];
            cr_assert_eq(o->status, TD_OK);
            cr_assert_eq(o->id, (uint64_t)done, "prompt %llu finished before %d (FIFO)",
                         (unsigned long long)o->id, done);
            cr_assert_eq(o->first_token, want[o->id], "prompt %llu: first token %d, engine %d",
                         (unsigned long long)o->id, o->first_token, want[o->id]);
            cr_assert_eq(o->seq->n_tokens, n_prompt[o->id]);
            cr_assert_geq(o->seq->n_blocks * 16, n_prompt[o->id]);
            cached += o->n_cached;
            cr_assert_eq(prefill_sched_release(ps, o->id), TD_OK);
            done++;
        }
        /* queued = prompt tokens neither computed nor found in the prefix cache */
        int64_t q = prefill_sched_queued_tokens(ps);
        cr_assert_leq(q, total - computed, "queued tokens %lld, at most %lld", (long long)q,
                      (long long)(total - computed));
        cr_assert_leq(q, last_queued, "queued tokens grew");
        last_queued = q;
    }
    cr_assert_eq(computed + cached, total, "%lld computed + %lld cached != %lld",
                 (long long)computed, (long long)cached, (long long)total);
    cr_assert_eq(prefill_sched_queued_tokens(ps), 0);

    /* the same prompts again: the prefix cache serves their full blocks */
    submit_all(ps);
    int64_t first_cached = cached;
    cached = 0;
    computed = 0;
    for (done = 0; done < N;) {
        prefill_step_result_t r;
        cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
        computed += r.n_tokens;
        for (int j = 0; j < r.n_outputs; j++) {
            cr_assert_eq(r.outputs[j].first_token, want[r.outputs[j].id]);
            cached += r.outputs[j].n_cached;
            cr_assert_eq(prefill_sched_release(ps, r.outputs[j].id), TD_OK);
            done++;
        }
    }
    cr_assert_gt(cached, 0, "the second round found no cached block");
    cr_assert_geq(cached, first_cached);
    cr_assert_eq(computed + cached, total);
    cr_assert_eq(prefill_sched_release(ps, 0), TD_ERR_NOT_FOUND);
    assert_no_leak(&fx);
    prefill_sched_destroy(ps);
    fx_close(&fx);
}

Test(prefill_sched, tiny_pool_restarts_and_bounds_refuse, .timeout = 300)
{
    skip_without_model();
    fixture_t fx;
    fx_open(&fx, 16); /* 256 tokens: prompts must take turns */
    make_prompts(&fx, 29);
    prefill_sched_config_t cfg = prefill_sched_config_default();
    cfg.max_batch_tokens = 128;
    prefill_sched_t *ps;
    cr_assert_eq(prefill_sched_create(fx.eng, &cfg, &ps), TD_OK);
    submit_all(ps);
    int done = 0, restarted = 0;
    for (int steps = 0; done < N; steps++) {
        cr_assert_lt(steps, 2000);
        prefill_step_result_t r;
        cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
        restarted += r.n_restarted;
        for (int j = 0; j < r.n_outputs; j++) {
            cr_assert_eq(r.outputs[j].status, TD_OK, "prompt %llu failed",
                         (unsigned long long)r.outputs[j].id);
            cr_assert_eq(r.outputs[j].first_token, want[r.outputs[j].id]);
            cr_assert_eq(prefill_sched_release(ps, r.outputs[j].id), TD_OK);
            done++;
        }
    }
    cr_assert_gt(restarted, 0, "the tiny pool never forced a restart");
    assert_no_leak(&fx);

    /* a prompt larger than the whole pool fails instead of waiting forever */
    static int32_t big[300];
    for (int i = 0; i < 300; i++)
        big[i] = 3 + i % 500;
    prefill_request_t rq = {.id = 100, .prompt = big, .n_prompt = 300, .sampling = td_sampling_default()};
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK);
    td_status_t got = TD_OK;
    for (int steps = 0; steps < 10 && got == TD_OK; steps++) {
        prefill_step_result_t r;
        cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
        if (r.n_outputs)
            got = r.outputs[0].status;
    }
    cr_assert_eq(got, TD_ERR_EXHAUSTED);
    /* deadlines, cancel, bounds */
    rq.id = 101;
    rq.n_prompt = 20;
    rq.deadline_ns = 5;
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK);
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_ERR_INVALID, "duplicate id");
    prefill_step_result_t r;
    cr_assert_eq(prefill_sched_step(ps, 5, &r), TD_OK);
    cr_assert_eq(r.n_outputs, 1);
    cr_assert_eq(r.outputs[0].status, TD_ERR_TIMEOUT);
    rq.id = 102;
    rq.deadline_ns = 0;
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK);
    cr_assert_eq(prefill_sched_cancel(ps, 102), TD_OK);
    cr_assert_eq(prefill_sched_queued_tokens(ps), 0);
    rq.n_prompt = fx.model->config.max_seq_len;
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_ERR_RANGE);
    assert_no_leak(&fx);
    prefill_sched_destroy(ps);

    cfg.max_queue = 2;
    cr_assert_eq(prefill_sched_create(fx.eng, &cfg, &ps), TD_OK);
    rq.n_prompt = 10;
    for (int i = 0; i < 2; i++) {
        rq.id = 200 + (uint64_t)i;
        cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK);
    }
    rq.id = 202;
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_ERR_EXHAUSTED, "queue bound");
    prefill_sched_destroy(ps); /* releases the queued prompts */
    assert_no_leak(&fx);
    fx_close(&fx);
}
