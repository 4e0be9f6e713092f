/*
 * test_engine_cuda: the engine on the CUDA backend against the same engine on the CPU
 * backend, on the real stories260K checkpoint (test_engine checks the CPU engine against a
 * reference forward pass). Its own executable so that a machine without a CUDA device (or
 * a build without CUDA) lists it as skipped: every test here skips there, and the
 * executable then exits 77 (tests/support/td_test_main.c).
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "td_backend.h"
#include "td_engine.h"
#include "td_model.h"
#include "td_test_models.h"

/* stories260K on the CUDA backend (activations in act) and on the CPU, weights and KV cache
   in dtype on both; skips without the model or a CUDA device, fails on any other error */
static void cuda_pair_open(td_test_engine_t *g, td_test_engine_t *c, td_dtype_t act, td_dtype_t dtype)
{
    td_test_skip_without_stories();
    td_backend_t *gpu, *cpu;
    td_status_t st = td_backend_cuda_create(&(td_cuda_config_t){.device = 0, .act_dtype = act}, &gpu);
    if (st == TD_ERR_UNSUPPORTED)
        cr_skip_test("skipped: no CUDA device (%s)", td_last_error());
    cr_assert_eq(st, TD_OK, "cuda backend on a machine with a device: %s", td_last_error());
    cr_assert_eq(td_backend_cpu_create(&(td_cpu_config_t){.n_threads = 2}, &cpu), TD_OK);
    td_test_engine_open_on(g, gpu, dtype, 256);
    td_test_engine_open_on(c, cpu, dtype, 256);
}

/*
 * The CUDA backend end to end against the CPU backend: four prompts (1..100 tokens) in one
 * ragged batch, prefilled in chunks of 64 (a cached prefix for the 100-token prompt), then
 * n_match greedy decode steps, both engines in lockstep on the CPU's tokens (teacher
 * forcing, so one near-tie does not derail the rest of a sequence). Every logits row is
 * compared: normalised MSE under max_nmse (and, over all rows, mean_nmse), and the GPU's
 * argmax equal to the CPU's wherever the CPU's top-2 gap is at least tie_gap.
 *
 * Why not equal greedy tokens in bf16: on the GPU the activations are bf16 too (the CPU's
 * are f32), and stories260K (dim 64) amplifies their rounding. A CPU emulation of this very
 * run with every bf16 rounding the engine does (weights, KV, each op's output) and exact
 * kernels gives a worst row's logits nmse of 0.003-0.047 per prompt (mean 0.0015-0.003,
 * max |diff| up to 2.7 logits), flips the argmax 1-3 times in 32 tokens per prompt and
 * diverges greedily by token 8-24 of every prompt; a broken rope, attention window or GQA
 * head map gives mean nmse 0.9-2.6. In f32 the two differ only in summation order, but 10
 * of the 800 rows have a CPU top-2 gap under 1e-3 (the smallest near 5e-5).
 */
static void cuda_matches_cpu(td_dtype_t dtype, int n_match, double max_nmse, double mean_nmse,
                             double tie_gap)
{
    td_test_engine_t g, c;
    cuda_pair_open(&g, &c, dtype, dtype);
    enum { N = 4 };
    const int chunk = 64;
    unsigned s = 11;
    int lens[N] = {1, 5, 17, 100}, *prompts[N], done[N], gen[N], next[N], owner[N];
    td_kv_seq_t sc[N], sg[N];
    td_engine_item_t ic[N], ig[N];
    int vocab = c.vocab;
    float *lc = malloc((size_t)N * vocab * sizeof(float)), *lg = malloc((size_t)N * vocab * sizeof(float));
    cr_assert(lc && lg);
    for (int i = 0; i < N; i++) {
        prompts[i] = td_test_random_prompt(&s, lens[i]);
        td_kv_seq_init(&sc[i]);
        td_kv_seq_init(&sg[i]);
        int cc = 0, cg = 0;
        cr_assert_eq(td_engine_seq_start(c.eng, &sc[i], prompts[i], lens[i], &cc), TD_OK);
        cr_assert_eq(td_engine_seq_start(g.eng, &sg[i], prompts[i], lens[i], &cg), TD_OK);
        cr_assert_eq(cc, cg);
        done[i] = cc;
        gen[i] = 0;
    }
    int rows = 0, ties = 0;
    double sum_nmse = 0, worst = 0;
    for (;;) {
        int k = 0;
        for (int i = 0; i < N; i++) {
            if (gen[i] >= n_match)
                continue;
            if (done[i] < lens[i]) {
                int len = lens[i] - done[i] < chunk ? lens[i] - done[i] : chunk;
                ic[k] = (td_engine_item_t){.seq = &sc[i], .tokens = prompts[i] + done[i], .n_tokens = len,
                                           .n_logits = done[i] + len == lens[i]};
            } else {
                ic[k] = (td_engine_item_t){.seq = &sc[i], .tokens = &next[i], .n_tokens = 1, .n_logits = 1};
            }
            ig[k] = ic[k];
            ig[k].seq = &sg[i];
            owner[k++] = i;
        }
        if (k == 0)
            break;
        cr_assert_eq(td_engine_step(c.eng, ic, k, lc), TD_OK, "cpu step: %s", td_last_error());
        cr_assert_eq(td_engine_step(g.eng, ig, k, lg), TD_OK, "cuda step: %s", td_last_error());
        int row = 0;
        for (int j = 0; j < k; j++) {
            int i = owner[j];
            if (done[i] < lens[i])
                done[i] += ic[j].n_tokens;
            if (!ic[j].n_logits)
                continue;
            const float *want = lc + (size_t)row * vocab, *got = lg + (size_t)row * vocab;
            row++;
            double err = 0, ref = 0;
            for (int v = 0; v < vocab; v++) {
                cr_assert(isfinite(got[v]), "%s, prompt of %d tokens, token %d: CUDA logit %d is %g",
                          td_dtype_name(dtype), lens[i], gen[i], v, got[v]);
                double d = (double)got[v] - want[v];
                err += d * d;
                ref += (double)want[v] * want[v];
            }
            double nmse = err / ref;
            cr_assert(nmse <= max_nmse, "%s, prompt of %d tokens, token %d: CUDA logits nmse %.3g > %.3g",
                      td_dtype_name(dtype), lens[i], gen[i], nmse, max_nmse);
            int best = td_test_argmax(want, vocab), gbest = td_test_argmax(got, vocab);
            float second = -INFINITY;
            for (int v = 0; v < vocab; v++)
                if (v != best && want[v] > second)
                    second = want[v];
            if (want[best] - second < tie_gap)
                ties++;
            else
                cr_assert_eq(gbest, best, "%s, prompt of %d tokens: CUDA token %d is %d, CPU %d (CPU top-2 gap %g)",
                             td_dtype_name(dtype), lens[i], gen[i], gbest, best, want[best] - second);
            sum_nmse += nmse;
            worst = nmse > worst ? nmse : worst;
            rows++;
            next[i] = best;
            gen[i]++;
        }
    }
    cr_assert_eq(rows, N * n_match);
    cr_assert(sum_nmse / rows <= mean_nmse, "%s: mean CUDA logits nmse %.3g > %.3g over %d rows",
              td_dtype_name(dtype), sum_nmse / rows, mean_nmse, rows);
    cr_log_info("%s: %d logits rows, nmse mean %.3g worst %.3g; %d with a CPU top-2 gap under %g (argmax "
                "not compared)", td_dtype_name(dtype), rows, sum_nmse / rows, worst, ties, tie_gap);
    for (int i = 0; i < N; i++) {
        td_engine_seq_end(c.eng, &sc[i]);
        td_engine_seq_end(g.eng, &sg[i]);
        free(prompts[i]);
    }
    free(lc), free(lg);
    td_test_engine_close(&g);
    td_test_engine_close(&c);
}

/* f32: tokens equal to the CPU's but for near-ties (gap < 1e-3), logits to summation order */
Test(engine, cuda_logits_match_cpu_f32, .timeout = 300)
{
    cuda_matches_cpu(TD_F32, 200, 1e-6, 1e-7, 1e-3);
}

/* bf16 activations: every row within 5x, the mean within 7x of what exact bf16 kernels give;
   argmax only where the gap exceeds twice the largest rounding swing seen (2.7) */
Test(engine, cuda_logits_match_cpu_bf16_activations, .timeout = 300)
{
    cuda_matches_cpu(TD_BF16, 32, 0.25, 0.02, 6.0);
}

/*
 * The acceptance check of the CUDA backend (issue 3), free-running: the same four prompts in
 * one ragged batch, chunked prefill, then greedy decode on each engine alone; the first
 * n_match generated tokens of every sequence must be equal. Weights and KV cache in
 * `dtype`, activations f32 on both (the CPU's always are; bf16 activations are compared by
 * logits above, since their rounding alone flips a greedy token of this tiny model).
 */
static void cuda_greedy_matches_cpu(td_dtype_t dtype, int n_match)
{
    td_test_engine_t g, c;
    cuda_pair_open(&g, &c, TD_F32, dtype);
    enum { N = 4 };
    unsigned s = 11;
    int lens[N] = {1, 5, 17, 100}, total[N], *prompts[N], *want[N], *got[N];
    for (int i = 0; i < N; i++) {
        prompts[i] = td_test_random_prompt(&s, lens[i]);
        total[i] = lens[i] + n_match;
        want[i] = malloc((size_t)n_match * sizeof(int));
        got[i] = malloc((size_t)n_match * sizeof(int));
    }
    td_test_engine_greedy(&c, N, prompts, lens, total, 64, want, NULL);
    td_test_engine_greedy(&g, N, prompts, lens, total, 64, got, NULL);
    for (int i = 0; i < N; i++) {
        for (int t = 0; t < n_match; t++)
            cr_assert_eq(got[i][t], want[i][t], "%s weights and KV, prompt of %d tokens: CUDA token %d is %d, CPU %d",
                         td_dtype_name(dtype), lens[i], t, got[i][t], want[i][t]);
        free(prompts[i]), free(want[i]), free(got[i]);
    }
    td_test_engine_close(&g);
    td_test_engine_close(&c);
}

Test(engine, cuda_greedy_equals_cpu_f32_200_tokens, .timeout = 300)
{
    cuda_greedy_matches_cpu(TD_F32, 200);
}

Test(engine, cuda_greedy_equals_cpu_bf16_32_tokens, .timeout = 300)
{
    cuda_greedy_matches_cpu(TD_BF16, 32);
}
