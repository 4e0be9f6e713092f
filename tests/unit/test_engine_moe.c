/*
 * The engine's mixture of experts: the router's top-k and weights on hand-made logits (both
 * normalisations, ties, k = n_experts), and the invariance rule on synthetic Mixtral and
 * Qwen3-MoE models: a sequence's logits are bit-identical alone or in a batch of 16 (whose
 * other rows join its experts' groups), on 1 or 2 threads, its greedy tokens the same with
 * the prompts prefilled in pieces, for f32 and for q8_0 weights (the int8 path and the weights packed per expert). The
 * models' numbers against a float64 reference are tests/unit/test_moe_ref.sh's.
 */
#include <criterion/criterion.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_backend.h"
#include "td_engine.h"
#include "td_model.h"
#include "td_test_models.h"
#include "td_util.h"

Test(engine_moe, route_picks_the_top_k_and_normalises)
{
    const float logits[6] = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f, 0.0f};
    int32_t ids[6];
    float w[6];
    /* top 3: 1 and 3 tie at 2.0 (the lower id first), then 4 */
    td_engine_moe_route(logits, 6, 3, true, ids, w);
    cr_assert(ids[0] == 1 && ids[1] == 3 && ids[2] == 4, "ids %d %d %d", ids[0], ids[1], ids[2]);
    double z = 2 * exp(2.0) + exp(1.0);
    cr_assert_float_eq(w[0], exp(2.0) / z, 1e-7);
    cr_assert_float_eq(w[1], exp(2.0) / z, 1e-7);
    cr_assert_float_eq(w[2], exp(1.0) / z, 1e-7);
    /* without renormalisation: shares of the softmax over all six */
    td_engine_moe_route(logits, 6, 3, false, ids, w);
    double all = 0;
    for (int e = 0; e < 6; e++)
        all += exp((double)logits[e]);
    cr_assert_float_eq(w[0], exp(2.0) / all, 1e-7);
    cr_assert_float_eq(w[2], exp(1.0) / all, 1e-7);
    /* every expert: a full descending order, weights summing to 1 */
    td_engine_moe_route(logits, 6, 6, true, ids, w);
    const int32_t want[6] = {1, 3, 4, 0, 5, 2};
    double sum = 0;
    for (int r = 0; r < 6; r++) {
        cr_assert_eq(ids[r], want[r], "rank %d: expert %d, want %d", r, ids[r], want[r]);
        sum += w[r];
    }
    cr_assert_float_eq(sum, 1.0, 1e-6);
    /* k = 1 of equal logits: expert 0 */
    const float flat[4] = {0.25f, 0.25f, 0.25f, 0.25f};
    td_engine_moe_route(flat, 4, 1, true, ids, w);
    cr_assert(ids[0] == 0 && w[0] == 1.0f);
}

static char tmp_root[256];

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void tmp_setup(void)
{
    snprintf(tmp_root, sizeof tmp_root, "/tmp/td_test_moe_XXXXXX");
    cr_assert_not_null(mkdtemp(tmp_root));
}

static void tmp_teardown(void)
{
    if (tmp_root[0])
        nftw(tmp_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* A synthetic `preset` model (GGUF with `dtype` matrices) under tmp_root, opened on a CPU
 * backend of `threads` threads with an engine. */
static void open_moe(td_test_engine_t *fx, const char *preset, td_dtype_t dtype, int threads)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s-%s.gguf", tmp_root, preset, td_dtype_name(dtype));
    if (!td_is_file(path)) {
        td_synth_params_t p;
        memset(&p, 0, sizeof p);
        cr_assert_eq(td_model_preset(preset, &p.config), TD_OK);
        p.dtype = dtype;
        p.seed = 3;
        cr_assert_eq(td_model_synth_gguf(&p, path), TD_OK, "%s", td_last_error());
    }
    *fx = (td_test_engine_t){0};
    cr_assert_eq(td_model_load(path, &fx->model), TD_OK, "%s", td_last_error());
    cr_assert_gt(fx->model->config.n_experts, 0);
    fx->vocab = fx->model->config.vocab_size;
    td_cpu_config_t cc = {.n_threads = threads};
    cr_assert_eq(td_backend_cpu_create(&cc, &fx->be), TD_OK, "%s", td_last_error());
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 1024;
    ec.prefix_cache = false;
    cr_assert_eq(td_engine_create(fx->model, fx->be, &ec, &fx->eng), TD_OK, "%s", td_last_error());
}

static void check_invariance(const char *preset, td_dtype_t dtype)
{
    enum { N = 16 };
    unsigned s = 5;
    int *prompts[N], n_prompt[N], total[N], *alone[N], *got[N];
    uint64_t *h_alone[N], *h_got[N];
    for (int i = 0; i < N; i++) {
        n_prompt[i] = 2 + (int)(td_test_rng_next(&s) % 40);
        prompts[i] = td_test_random_prompt(&s, n_prompt[i]);
        total[i] = n_prompt[i] + 8 + (int)(td_test_rng_next(&s) % 8);
        alone[i] = malloc(128 * sizeof(int));
        got[i] = malloc(128 * sizeof(int));
        h_alone[i] = malloc(128 * sizeof(uint64_t));
        h_got[i] = malloc(128 * sizeof(uint64_t));
    }
    td_test_engine_t fx;
    open_moe(&fx, preset, dtype, 1);
    for (int i = 0; i < N; i++)
        td_test_engine_greedy(&fx, 1, &prompts[i], &n_prompt[i], &total[i], 4096, &alone[i], &h_alone[i]);
    td_test_engine_close(&fx);
    for (int threads = 1; threads <= 2; threads++) {
        open_moe(&fx, preset, dtype, threads);
        /* whole prompts batched together: every step's rows are all prefill or all decode,
           as alone, and each row lands in groups of other sequences' rows */
        td_test_engine_greedy(&fx, N, prompts, n_prompt, total, 4096, got, h_got);
        for (int i = 0; i < N; i++)
            for (int t = 0; t < total[i] - n_prompt[i]; t++)
                cr_assert_eq(h_got[i][t], h_alone[i][t],
                             "%s %s, %d threads: sequence %d token %d: its logits in a batch of %d differ from "
                             "alone", preset, td_dtype_name(dtype), threads, i, t, N);
        /* prompts in pieces of 3 beside other sequences' decode rows (which then take the
           prefill attention kernel, so only the tokens are compared, as test_engine does) */
        td_test_engine_greedy(&fx, N, prompts, n_prompt, total, 3, got, NULL);
        for (int i = 0; i < N; i++)
            for (int t = 0; t < total[i] - n_prompt[i]; t++)
                cr_assert_eq(got[i][t], alone[i][t], "%s %s, %d threads, pieces of 3: sequence %d token %d: %d, "
                             "alone %d", preset, td_dtype_name(dtype), threads, i, t, got[i][t], alone[i][t]);
        td_test_engine_close(&fx);
    }
    for (int i = 0; i < N; i++)
        free(prompts[i]), free(alone[i]), free(got[i]), free(h_alone[i]), free(h_got[i]);
}

Test(engine_moe, mixtral_batch_and_chunk_invariance, .init = tmp_setup, .fini = tmp_teardown, .timeout = 300)
{
    check_invariance("tiny-mixtral", TD_F32);
    check_invariance("tiny-mixtral", TD_Q8_0);
}

Test(engine_moe, qwen3moe_batch_and_chunk_invariance, .init = tmp_setup, .fini = tmp_teardown, .timeout = 300)
{
    check_invariance("tiny-qwen3moe", TD_F32);
    check_invariance("tiny-qwen3moe", TD_Q4_0);
}

/* The bytes a token reads: all weights but the experts the router leaves out. */
Test(engine_moe, active_weight_bytes, .init = tmp_setup, .fini = tmp_teardown, .timeout = 60)
{
    td_test_engine_t fx;
    open_moe(&fx, "tiny-mixtral", TD_F32, 1);
    const td_model_config_t *c = &fx.model->config;
    size_t all = td_engine_weight_bytes(fx.eng), active = td_engine_active_weight_bytes(fx.eng);
    size_t expert = 3 * (size_t)c->dim * (size_t)c->expert_hidden_dim * sizeof(float);
    cr_assert_eq(all - active, (size_t)(c->n_experts - c->n_experts_used) * (size_t)c->n_layers * expert,
                 "all %zu, active %zu", all, active);
    cr_assert_eq(td_model_param_count(c) - td_model_active_param_count(c),
                 (uint64_t)(c->n_experts - c->n_experts_used) * (uint64_t)c->n_layers * expert / sizeof(float));
    td_test_engine_close(&fx);
}
