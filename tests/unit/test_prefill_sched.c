/*
 * test_prefill_sched: the prefill batcher on stories260K. Chunked packing never exceeds
 * the token budget and completes prompts in arrival order; every first token equals the
 * engine's greedy first token for the prompt alone; the returned sequence holds the whole
 * prompt; queued-token accounting; the prefix cache is used on a repeated prompt; a
 * tiny pool restarts prompts instead of failing them, and nothing leaks. The engine's
 * per-layer hook runs once per layer in order, after that layer's K/V is in the pool, and
 * never for a step that could not reserve; the scheduler's layer hook reports exactly the
 * step's finishing prompts with their final block tables, and a done prompt's blocks keep
 * their bytes while later prompts run until it is released; a prompt whose step fails
 * after its first layer was handed out (injected backend fault) keeps its blocks until
 * released, one failing before any layer frees them at once. Log-probabilities: the first
 * token's and, asked for the prompt, every prompt position's equal td_sampler_logprobs of the
 * engine's rows for the prompt alone, in chunks bounded by the step's logit rows, without
 * the prefix cache (a repeated prompt is computed again).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "prefill_sched.h"
#include "td_backend.h"
#include "td_engine.h"
#include "td_kv.h"
#include "td_model.h"
#include "td_test_models.h"

/* The engine's greedy first token for the prompt alone, in one step. */
static int first_alone(td_test_engine_t *fx, const int32_t *p, int n)
{
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    float *logits = malloc((size_t)fx->vocab * sizeof(float));
    td_engine_item_t it = {.seq = &seq, .tokens = p, .n_tokens = n, .n_logits = 1};
    cr_assert_eq(td_engine_step(fx->eng, &it, 1, logits), TD_OK, "%s", td_last_error());
    int t = td_test_argmax(logits, fx->vocab);
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

static void make_prompts(td_test_engine_t *fx, unsigned seed)
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

static void assert_no_leak(td_test_engine_t *fx)
{
    td_kv_stats_t ks;
    td_kv_get_stats(td_engine_kv(fx->eng), &ks);
    cr_assert_eq(ks.used, 0, "%d blocks still referenced", ks.used);
    cr_assert_eq(td_kv_cache_check(td_engine_kv(fx->eng)), TD_OK, "%s", td_last_error());
}

/* The start the prompt-batch tests share: a fixture of n_blocks KV blocks, the N prompts of
 * `seed` with their reference first tokens, and a scheduler with the default config but a
 * step budget of max_batch_tokens (that config in *cfg_p). */
static prefill_sched_t *start(td_test_engine_t *fx, int n_blocks, unsigned seed, int32_t max_batch_tokens,
                              prefill_sched_config_t *cfg_p)
{
    td_test_engine_open_cpu(fx, 1, n_blocks, true);
    make_prompts(fx, seed);
    *cfg_p = prefill_sched_config_default();
    cfg_p->max_batch_tokens = max_batch_tokens;
    prefill_sched_t *ps;
    cr_assert_eq(prefill_sched_create(fx->eng, cfg_p, &ps), TD_OK, "%s", td_last_error());
    return ps;
}

Test(prefill_sched, chunked_packing_respects_budget_and_first_tokens_match, .timeout = 300)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    prefill_sched_config_t cfg;
    prefill_sched_t *ps = start(&fx, 1024, 17, 64, &cfg);
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
    td_test_engine_close(&fx);
}

/* One prompt under salts (its tenants', docs/security.md "Tenants"): a salt's repeat is
 * served from the cache, another salt's is computed whole, and the first token is the same. */
static int32_t run_salted(prefill_sched_t *ps, uint64_t id, const int32_t *p, int n, uint64_t salt, int32_t *first_p)
{
    prefill_request_t rq = {.id = id, .prompt = p, .n_prompt = n, .sampling = td_sampling_default(),
                            .cache_salt = salt};
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK, "%s", td_last_error());
    for (int steps = 0; steps < 100; steps++) {
        prefill_step_result_t r;
        cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
        if (r.n_outputs) {
            cr_assert(r.n_outputs == 1 && r.outputs[0].status == TD_OK);
            int32_t cached = r.outputs[0].n_cached;
            *first_p = r.outputs[0].first_token;
            cr_assert_eq(prefill_sched_release(ps, id), TD_OK);
            return cached;
        }
    }
    cr_assert_fail("prompt %llu never finished", (unsigned long long)id);
    return -1;
}

Test(prefill_sched, a_salt_hits_only_its_own_prefixes, .timeout = 300)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    prefill_sched_config_t cfg;
    prefill_sched_t *ps = start(&fx, 1024, 5, 64, &cfg);
    int32_t p[150], first[4];
    p[0] = 1;
    for (int j = 1; j < 150; j++)
        p[j] = 3 + (j * 37) % 500;
    cr_assert_eq(run_salted(ps, 1, p, 150, 0xa, &first[0]), 0);
    cr_assert_eq(run_salted(ps, 2, p, 150, 0xb, &first[1]), 0, "another salt hit the first one's blocks");
    cr_assert_eq(run_salted(ps, 3, p, 150, 0, &first[2]), 0, "no salt hit a salted prompt's blocks");
    cr_assert_eq(run_salted(ps, 4, p, 150, 0xa, &first[3]), 144, "the salt's own repeat: 9 whole blocks cached");
    int want_first = first_alone(&fx, p, 150); /* last: its unsalted blocks would be salt 0's hits */
    for (int i = 0; i < 4; i++)
        cr_assert_eq(first[i], want_first, "run %d: first token %d, the engine alone %d", i, first[i], want_first);
    assert_no_leak(&fx);
    prefill_sched_destroy(ps);
    td_test_engine_close(&fx);
}

Test(prefill_sched, tiny_pool_restarts_and_bounds_refuse, .timeout = 300)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    prefill_sched_config_t cfg;
    /* 16 blocks, 256 tokens: prompts must take turns */
    prefill_sched_t *ps = start(&fx, 16, 29, 128, &cfg);
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
    /* a prompt of the model's length: refused at the node's edge (test_node_admit.c) */
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
    td_test_engine_close(&fx);
}

/* ---- layer hooks --------------------------------------------------------------------- */

typedef struct layer_rec {
    td_engine_t *eng;
    const td_engine_item_t *items;
    int32_t n_items;
    int32_t calls;
    int32_t next_layer;         /* the layer expected next */
    uint8_t *snap;              /* [n_layers][max_blocks] bytes of each layer at its hook */
    int32_t max_blocks;
} layer_rec_t;

static size_t block_bytes(td_engine_t *eng)
{
    return td_kv_block_bytes(td_engine_kv_layout(eng));
}

static const uint8_t *pool_block(td_engine_t *eng, uint32_t layer, int32_t block)
{
    int32_t nb;
    const uint8_t *pool = td_engine_kv_pool(eng, &nb);
    return pool + td_kv_block_offset(td_engine_kv_layout(eng), (uint32_t)nb, layer, (uint32_t)block);
}

/* Engine hook: records the order, snapshots layer `layer` of item 0's blocks. */
static void rec_layer(void *arg, uint32_t layer)
{
    layer_rec_t *r = arg;
    cr_assert_eq((int32_t)layer, r->next_layer, "hook for layer %u, expected %d", layer, r->next_layer);
    r->next_layer++;
    r->calls++;
    const td_kv_seq_t *seq = r->items[0].seq;
    int32_t nb = (int32_t)((seq->n_tokens + r->items[0].n_tokens + 15) / 16);
    cr_assert_leq(nb, seq->n_blocks, "block table does not cover the step's tokens at the hook");
    size_t bb = block_bytes(r->eng);
    for (int32_t b = 0; b < nb; b++)
        memcpy(r->snap + ((size_t)layer * r->max_blocks + b) * bb, pool_block(r->eng, layer, seq->blocks[b]), bb);
}

Test(engine_layer_hook, once_per_layer_in_order_after_the_layer_is_written, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 16, true); /* 256 tokens */
    int n_layers = fx.model->config.n_layers;
    int32_t p[40];
    for (int i = 0; i < 40; i++)
        p[i] = 3 + (i * 37) % 400;
    td_kv_seq_t a, b;
    td_kv_seq_init(&a);
    td_kv_seq_init(&b);
    td_engine_item_t items[2] = {{.seq = &a, .tokens = p, .n_tokens = 40, .n_logits = 1},
                                 {.seq = &b, .tokens = p + 5, .n_tokens = 20, .n_logits = 1}};
    layer_rec_t r = {.eng = fx.eng, .items = items, .n_items = 2, .max_blocks = 4};
    size_t bb = block_bytes(fx.eng);
    r.snap = calloc((size_t)n_layers * r.max_blocks, bb);
    float *logits = malloc(2 * (size_t)fx.vocab * sizeof(float));
    td_engine_set_layer_hook(fx.eng, rec_layer, &r);
    cr_assert_eq(td_engine_step(fx.eng, items, 2, logits), TD_OK, "%s", td_last_error());
    cr_assert_eq(r.calls, n_layers, "%d hook calls for %d layers", r.calls, n_layers);
    /* every layer's bytes at its hook are its final bytes: the hook came after the write */
    for (int l = 0; l < n_layers; l++)
        for (int32_t k = 0; k < 3; k++)
            cr_assert(!memcmp(r.snap + ((size_t)l * r.max_blocks + k) * bb, pool_block(fx.eng, (uint32_t)l, a.blocks[k]),
                              bb), "layer %d block %d changed after its hook", l, k);
    /* a second step (decode of one token each) calls the hook again, from layer 0 */
    r.next_layer = 0;
    r.calls = 0;
    items[0].tokens = p + 39;
    items[0].n_tokens = 1;
    items[1].tokens = p + 24;
    items[1].n_tokens = 1;
    cr_assert_eq(td_engine_step(fx.eng, items, 2, logits), TD_OK, "%s", td_last_error());
    cr_assert_eq(r.calls, n_layers);
    /* a step that cannot reserve its blocks calls nothing */
    td_kv_seq_t big;
    td_kv_seq_init(&big);
    static int32_t many[300];
    for (int i = 0; i < 300; i++)
        many[i] = 3 + i % 500;
    td_engine_item_t bi = {.seq = &big, .tokens = many, .n_tokens = 300, .n_logits = 0};
    r.next_layer = 0;
    r.calls = 0;
    r.items = &bi;
    cr_assert_eq(td_engine_step(fx.eng, &bi, 1, NULL), TD_ERR_EXHAUSTED);
    cr_assert_eq(r.calls, 0, "the hook ran for a step that reserved nothing");
    /* removed: no calls */
    td_engine_set_layer_hook(fx.eng, NULL, NULL);
    r.items = items;
    items[0].tokens = p + 1;
    items[1].tokens = p + 2;
    cr_assert_eq(td_engine_step(fx.eng, items, 2, logits), TD_OK, "%s", td_last_error());
    cr_assert_eq(r.calls, 0);
    td_engine_seq_end(fx.eng, &big);
    td_engine_seq_end(fx.eng, &a);
    td_engine_seq_end(fx.eng, &b);
    assert_no_leak(&fx);
    free(logits);
    free(r.snap);
    td_test_engine_close(&fx);
}

enum { MAX_FIN = 16, MAX_FIN_BLOCKS = 16 };

typedef struct sched_rec {
    int n_layers;
    int32_t calls;          /* this step */
    int32_t next_layer;
    int32_t n_fin;
    uint64_t ids[MAX_FIN];
    int32_t n_blocks[MAX_FIN];
    int32_t blocks[MAX_FIN][MAX_FIN_BLOCKS];
} sched_rec_t;

static void rec_sched_layer(void *arg, uint32_t layer, const prefill_finishing_t *fin, int32_t n_fin)
{
    sched_rec_t *r = arg;
    cr_assert_eq((int32_t)layer, r->next_layer, "layer %u out of order (expected %d)", layer, r->next_layer);
    cr_assert_gt(n_fin, 0, "layer hook for a step that finishes nothing");
    cr_assert_leq(n_fin, MAX_FIN);
    r->next_layer++;
    r->calls++;
    if (layer == 0) {
        r->n_fin = n_fin;
        for (int32_t i = 0; i < n_fin; i++) {
            r->ids[i] = fin[i].id;
            r->n_blocks[i] = fin[i].n_blocks;
            cr_assert_eq(fin[i].n_prompt, n_prompt[fin[i].id]);
            cr_assert_eq(fin[i].n_blocks, (n_prompt[fin[i].id] + 15) / 16);
            cr_assert_leq(fin[i].n_blocks, MAX_FIN_BLOCKS);
            memcpy(r->blocks[i], fin[i].blocks, (size_t)fin[i].n_blocks * sizeof(int32_t));
        }
    } else {
        cr_assert_eq(n_fin, r->n_fin, "finishing list changed within a step");
        for (int32_t i = 0; i < n_fin; i++) {
            cr_assert_eq(fin[i].id, r->ids[i]);
            cr_assert(!memcmp(fin[i].blocks, r->blocks[i], (size_t)fin[i].n_blocks * sizeof(int32_t)));
        }
    }
}

static uint8_t *snapshot_seq(td_test_engine_t *fx, const td_kv_seq_t *seq, int32_t nb)
{
    size_t bb = block_bytes(fx->eng);
    int L = fx->model->config.n_layers;
    uint8_t *buf = malloc((size_t)L * nb * bb);
    for (int l = 0; l < L; l++)
        for (int32_t b = 0; b < nb; b++)
            memcpy(buf + ((size_t)l * nb + b) * bb, pool_block(fx->eng, (uint32_t)l, seq->blocks[b]), bb);
    return buf;
}

Test(prefill_sched, layer_hook_reports_finishing_prompts_and_blocks_hold_until_release, .timeout = 300)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    prefill_sched_config_t cfg;
    /* 40 blocks, 640 tokens: later prompts would reuse released blocks */
    prefill_sched_t *ps = start(&fx, 40, 41, 96, &cfg);
    sched_rec_t rec = {.n_layers = fx.model->config.n_layers};
    prefill_sched_set_layer_hook(ps, rec_sched_layer, &rec);
    submit_all(ps);
    cr_assert(prefill_sched_pending(ps, 0));
    /* the first prompt done is held, its bytes compared after everything else ran */
    int64_t held_id = -1;
    int32_t held_nb = 0;
    uint8_t *held_bytes = NULL;
    const td_kv_seq_t *held_seq = NULL;
    int done = 0, restarted = 0;
    for (int steps = 0; done < N; steps++) {
        cr_assert_lt(steps, 2000);
        rec.calls = 0;
        rec.next_layer = 0;
        rec.n_fin = 0;
        prefill_step_result_t r;
        cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
        restarted += r.n_restarted;
        int32_t n_ok = 0;
        for (int j = 0; j < r.n_outputs; j++)
            n_ok += r.outputs[j].status == TD_OK;
        /* hook calls: all layers when the step finished prompts, none otherwise */
        cr_assert_eq(rec.calls, n_ok ? rec.n_layers : 0, "step %d: %d hook calls, %d prompts finished", steps,
                     rec.calls, n_ok);
        cr_assert_eq(rec.n_fin, n_ok);
        for (int j = 0; j < r.n_outputs; j++) {
            const prefill_output_t *o = &r.outputs[j];
            cr_assert_eq(o->status, TD_OK, "prompt %llu failed", (unsigned long long)o->id);
            cr_assert_not(o->held);
            cr_assert_not(prefill_sched_pending(ps, o->id));
            cr_assert_eq(o->first_token, want[o->id]);
            int32_t k = 0;
            while (k < rec.n_fin && rec.ids[k] != o->id)
                k++;
            cr_assert_lt(k, rec.n_fin, "prompt %llu finished without a layer report", (unsigned long long)o->id);
            cr_assert(!memcmp(rec.blocks[k], o->seq->blocks, (size_t)rec.n_blocks[k] * sizeof(int32_t)),
                      "reported block table differs from the output's");
            if (held_id < 0) {
                held_id = (int64_t)o->id;
                held_seq = o->seq;
                held_nb = rec.n_blocks[k];
                held_bytes = snapshot_seq(&fx, o->seq, held_nb);
            } else {
                cr_assert_eq(prefill_sched_release(ps, o->id), TD_OK);
            }
            done++;
        }
    }
    td_kv_stats_t ks;
    td_kv_get_stats(td_engine_kv(fx.eng), &ks);
    cr_assert_gt(ks.evictions + (uint64_t)restarted, 0, "released blocks were never reused: the hold proves nothing");
    uint8_t *now = snapshot_seq(&fx, held_seq, held_nb);
    size_t bytes = (size_t)fx.model->config.n_layers * held_nb * block_bytes(fx.eng);
    cr_assert(!memcmp(held_bytes, now, bytes), "a held prompt's KV changed before its release");
    cr_assert_geq(ks.used, held_nb, "held blocks not referenced");
    cr_assert_eq(prefill_sched_unreleased(ps), 1);
    cr_assert_eq(prefill_sched_release(ps, (uint64_t)held_id), TD_OK);
    cr_assert_eq(prefill_sched_release(ps, (uint64_t)held_id), TD_ERR_NOT_FOUND, "released twice");
    assert_no_leak(&fx);

    /* cancel: only a pending prompt is pending; cancelling it frees everything */
    prefill_request_t rq = {.id = 500, .prompt = prompts[0], .n_prompt = n_prompt[0], .sampling = td_sampling_default()};
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK);
    cr_assert(prefill_sched_pending(ps, 500));
    cr_assert_not(prefill_sched_pending(ps, 501));
    cr_assert_eq(prefill_sched_cancel(ps, 500), TD_OK);
    cr_assert_not(prefill_sched_pending(ps, 500));
    assert_no_leak(&fx);
    free(held_bytes);
    free(now);
    prefill_sched_destroy(ps);
    td_test_engine_close(&fx);
}


/* Fault injection: the CPU backend's ops with attn_prefill failing on its fail_at-th call. */
static const td_backend_ops_t *real_ops;
static td_backend_ops_t faulty_ops;
static int attn_calls, attn_fail_at;

static td_status_t faulty_attn_prefill(td_backend_t *be, const td_attn_params_t *p)
{
    if (++attn_calls == attn_fail_at)
        return td_errorf(TD_ERR_INTERNAL, "test: injected attention failure");
    return real_ops->attn_prefill(be, p);
}

static void count_layers(void *arg, uint32_t layer, const prefill_finishing_t *fin, int32_t n_fin)
{
    (*(int *)arg)++;
}

Test(prefill_sched, a_prompt_failing_after_its_layers_were_handed_out_keeps_its_blocks, .timeout = 120)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 64, true);
    cr_assert_geq(fx.model->config.n_layers, 2);
    real_ops = fx.be->ops;
    faulty_ops = *real_ops;
    faulty_ops.attn_prefill = faulty_attn_prefill;
    fx.be->ops = &faulty_ops;
    prefill_sched_t *ps;
    prefill_sched_config_t cfg = prefill_sched_config_default();
    cr_assert_eq(prefill_sched_create(fx.eng, &cfg, &ps), TD_OK);
    int hook_calls = 0;
    prefill_sched_set_layer_hook(ps, count_layers, &hook_calls);
    int32_t p[40];
    for (int i = 0; i < 40; i++)
        p[i] = 3 + (i * 53) % 450;
    td_kv_stats_t ks;
    prefill_step_result_t r;

    /* fails in layer 1: layer 0 was handed out, so the blocks stay until release */
    attn_calls = 0;
    attn_fail_at = 2;
    prefill_request_t rq = {.id = 1, .prompt = p, .n_prompt = 40, .sampling = td_sampling_default()};
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK);
    cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
    cr_assert_eq(hook_calls, 1, "the hook ran %d times before the failing layer 1", hook_calls);
    cr_assert_eq(r.n_outputs, 1);
    cr_assert_eq(r.outputs[0].status, TD_ERR_INTERNAL);
    cr_assert(r.outputs[0].held, "a pushed prompt's failure must hold its blocks");
    cr_assert_not(prefill_sched_pending(ps, 1));
    cr_assert_eq(prefill_sched_unreleased(ps), 1);
    td_kv_get_stats(td_engine_kv(fx.eng), &ks);
    cr_assert_eq(ks.used, 3, "%d blocks referenced, the prompt's 3 expected", ks.used);
    cr_assert_eq(prefill_sched_release(ps, 1), TD_OK);
    assert_no_leak(&fx);

    /* fails in layer 0: nothing was handed out, the blocks go back at once */
    hook_calls = 0;
    attn_calls = 0;
    attn_fail_at = 1;
    rq.id = 2;
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK);
    cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
    cr_assert_eq(hook_calls, 0);
    cr_assert_eq(r.n_outputs, 1);
    cr_assert_eq(r.outputs[0].status, TD_ERR_INTERNAL);
    cr_assert_not(r.outputs[0].held);
    cr_assert_eq(prefill_sched_unreleased(ps), 0);
    assert_no_leak(&fx);

    /* healthy again: the same prompt completes with the engine's greedy token */
    attn_fail_at = 0;
    rq.id = 3;
    cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK);
    cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
    cr_assert_eq(r.n_outputs, 1);
    cr_assert_eq(r.outputs[0].status, TD_OK);
    cr_assert_eq(r.outputs[0].first_token, first_alone(&fx, p, 40));
    cr_assert_eq(prefill_sched_release(ps, 3), TD_OK);
    prefill_sched_destroy(ps);
    assert_no_leak(&fx);
    fx.be->ops = real_ops;
    td_test_engine_close(&fx);
}

/* Every row of the prompt alone, in one step: row i follows prompt[0..i]. */
static float *rows_alone(td_test_engine_t *fx, const int32_t *p, int n)
{
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    float *logits = malloc((size_t)n * (size_t)fx->vocab * sizeof(float));
    cr_assert_not_null(logits);
    td_engine_item_t it = {.seq = &seq, .tokens = p, .n_tokens = n, .n_logits = n};
    cr_assert_eq(td_engine_step(fx->eng, &it, 1, logits), TD_OK, "%s", td_last_error());
    td_engine_seq_end(fx->eng, &seq);
    return logits;
}

static void assert_logprob_near(const td_token_logprob_t *got, const td_token_logprob_t *want, const char *what, int pos)
{
    cr_assert_eq(got->token, want->token, "%s %d", what, pos);
    cr_assert(fabsf(got->logprob - want->logprob) < 1e-3f, "%s %d: logprob %g, alone %g", what, pos,
              (double)got->logprob, (double)want->logprob);
    cr_assert_eq(got->n_top, want->n_top, "%s %d", what, pos);
    for (int32_t k = 0; k < got->n_top; k++)
        cr_assert(fabsf(got->top[k].logprob - want->top[k].logprob) < 1e-3f, "%s %d top %d", what, pos, k);
}

Test(prefill_sched, logprobs_of_the_first_token_and_the_prompt_match_the_engine_alone, .timeout = 300)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    prefill_sched_config_t cfg;
    prefill_sched_t *ps = start(&fx, 1024, 5, 64, &cfg); /* 64-token steps: several chunks */
    prefill_sched_destroy(ps);
    cfg.max_batch = 8; /* 8 logit rows a step: prompt-logprob chunks of at most 8 tokens */
    cr_assert_eq(prefill_sched_create(fx.eng, &cfg, &ps), TD_OK, "%s", td_last_error());
    const td_logprobs_want_t wants[3] = {
        {.on = true, .top = 5, .prompt = true}, {.on = true, .top = 0, .prompt = false},
        {.on = true, .top = TD_LOGPROBS_MAX_TOP, .prompt = true}};
    /* prompt 0 twice: the second time its blocks are cached, and must not be used */
    const int which[4] = {0, 1, 2, 0};
    for (int round = 0; round < 2; round++) {
        for (int k = round * 2; k < round * 2 + 2; k++) {
            int i = which[k];
            prefill_request_t rq = {.id = (uint64_t)(100 + k), .prompt = prompts[i], .n_prompt = n_prompt[i],
                                    .sampling = td_sampling_default(), .logprobs = wants[k % 3]};
            cr_assert_eq(prefill_sched_submit(ps, &rq), TD_OK, "%s", td_last_error());
        }
        int done = 0;
        for (int steps = 0; done < 2; steps++) {
            cr_assert_lt(steps, 1000);
            prefill_step_result_t r;
            cr_assert_eq(prefill_sched_step(ps, 0, &r), TD_OK);
            for (int j = 0; j < r.n_outputs; j++) {
                const prefill_output_t *o = &r.outputs[j];
                int k = (int)o->id - 100, i = which[k];
                const td_logprobs_want_t *w = &wants[k % 3];
                cr_assert_eq(o->status, TD_OK);
                cr_assert_eq(o->first_token, want[i]);
                if (w->prompt)
                    cr_assert_eq(o->n_cached, 0, "prompt logprobs used %d cached tokens", o->n_cached);
                int n = n_prompt[i];
                cr_assert_eq(o->n_logprobs, w->prompt ? n + 1 : 1);
                float *rows = rows_alone(&fx, prompts[i], n);
                td_token_logprob_t ref;
                cr_assert_eq(td_sampler_logprobs(rows + (size_t)(n - 1) * fx.vocab, fx.vocab, want[i], w->top, &ref), TD_OK);
                assert_logprob_near(&o->logprobs[o->n_logprobs - 1], &ref, "first token of prompt", i);
                if (w->prompt) {
                    cr_assert_eq(o->logprobs[0].token, prompts[i][0]);
                    cr_assert(o->logprobs[0].logprob == 0.0f && o->logprobs[0].n_top == 0);
                    for (int pos = 1; pos < n; pos++) {
                        cr_assert_eq(td_sampler_logprobs(rows + (size_t)(pos - 1) * fx.vocab, fx.vocab, prompts[i][pos],
                                                         w->top, &ref), TD_OK);
                        assert_logprob_near(&o->logprobs[pos], &ref, "prompt position", pos);
                    }
                }
                free(rows);
                free(o->logprobs);
                cr_assert_eq(prefill_sched_release(ps, o->id), TD_OK);
                done++;
            }
        }
    }
    /* too long a prompt for its logprobs, or too many alternatives: refused by name at the
       node's edge (test_node_admit.c) */
    prefill_sched_destroy(ps);
    assert_no_leak(&fx);
    td_test_engine_close(&fx);
}
