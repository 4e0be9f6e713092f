/*
 * bench_engine: `tandem bench engine`, the engine against ceilings measured in the same
 * run on the same device, and (--vs-llamacpp) against llama.cpp's llama-bench on the same
 * GGUF file, shape and thread count, run by this command right after:
 *   - batch-1 decode: tokens/s x bytes streamed per token / measured bandwidth (CPU: the
 *     threads reading a buffer as large as the weights, each its own contiguous part, so
 *     that the probe sees what decode sees, caches included; CUDA: a device-to-device copy,
 *     bytes read + written). A peer that reads the same weights faster than the probe
 *     (llama.cpp) raises the ceiling: the probe is then said not to be the bound.
 *   - prefill: model FLOP/s at a 512-token prompt / a GEMM of the prefill's FFN shape
 *     (CPU: OpenBLAS sgemm; CUDA: the backend's cuBLAS matmul in the weights' dtype)
 *   - batched decode: aggregate tokens/s at batch 1, 8, 32, 64
 *   - with --spec: batch-1 greedy decode with speculative decoding against without it, runs
 *     alternated (A/B), on a prompt that repeats itself (--spec-prompt-ids, else a random
 *     unit of 24 ids four times): tokens/s both ways, the speed-up, the acceptance
 * The model is --model PATH, or a synthetic one of a preset shape (default llama-3.2-1b,
 * f32; --layers N keeps the shape of a layer and N of them) written once to a cache folder.
 * A mixture of experts streams only its active weights per decoded token (the experts the
 * router picks): the bandwidth bound of batch-1 decode is taken over those bytes.
 */
#include <cblas.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/wait.h>

#include "td_backend.h"
#include "td_bench.h"
#include "td_child.h"
#include "td_cli.h"
#include "td_engine.h"
#include "td_gguf.h"
#include "td_model.h"
#include "td_spec.h"
#include "td_stats.h"
#include "td_threadpool.h"
#include "td_util.h"

void openblas_set_num_threads(int num_threads);

typedef struct bench_opts {
    const char *model;
    const char *preset;
    int layers;              /* --layers: the preset with this many layers; 0: as it is */
    td_dtype_t dtype;
    int quant;               /* --quant: a block td_dtype_t, or -1 */
    int kv_dtype;            /* --kv-dtype: f32, f16, bf16 or Q8_0; -1: f32 (cpu), --dtype (cuda) */
    bool vs_llamacpp;
    const char *llama_bench; /* path of llama-bench (--llama-bench or $LLAMA_BENCH) */
    td_device_spec_t device;
    int threads;
    int prompt_tokens;
    int gen_tokens;
    bool json;
    td_spec_config_t spec;   /* --spec, --draft-tokens */
    const char *draft_model; /* --draft-model */
    const char *spec_prompt; /* --spec-prompt-ids */
    int spec_reps;           /* --spec-reps: A/B pairs */
} bench_opts_t;

/* ---- ceilings ----------------------------------------------------------------------- */

typedef struct read_job {
    const uint64_t *buf;
    size_t n_per_task;
    uint64_t *sums;
} read_job_t;

/* Integer adds are associative, so the compiler vectorises this loop to full-width loads:
 * it runs at the memory's read bandwidth, as a GEMV streaming its weights does. */
static void read_task(void *arg, int task, int thread)
{
    read_job_t *j = arg;
    const uint64_t *p = j->buf + (size_t)task * j->n_per_task;
    uint64_t s = 0;
    for (size_t i = 0; i < j->n_per_task; i++)
        s += p[i];
    j->sums[task] = s;
    (void)thread;
}

/* Read bandwidth, all threads, over a buffer of `bytes` (the weights a decode step streams,
 * at least 64 MiB), each thread reading one contiguous part as a GEMV over its rows does:
 * bytes/s, best of 5 passes. */
static double measure_read_bw(td_pool_t *pool, int threads, size_t bytes)
{
    bytes = TD_MAX(bytes, (size_t)64 << 20);
    const int tasks = threads;
    bytes = bytes / ((size_t)tasks * 4096) * ((size_t)tasks * 4096);
    uint64_t *buf = malloc(bytes);
    uint64_t *sums = calloc(tasks, sizeof(uint64_t));
    if (!buf || !sums) {
        free(buf);
        free(sums);
        return 0;
    }
    for (size_t i = 0; i < bytes / sizeof(uint64_t); i++)
        buf[i] = i;
    read_job_t j = {.buf = buf, .n_per_task = bytes / sizeof(uint64_t) / tasks, .sums = sums};
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        uint64_t t0 = td_now_ns();
        td_pool_run(pool, tasks, read_task, &j);
        double s = (double)(td_now_ns() - t0) * 1e-9;
        best = TD_MAX(best, (double)bytes / s);
    }
    volatile uint64_t sink = sums[0];
    (void)sink;
    free(buf);
    free(sums);
    return best;
}

/* OpenBLAS sgemm at the prefill shape (M tokens x K dim) . (K x N): FLOP/s. */
static double measure_sgemm(int threads, int m, int n, int k)
{
    float *a = malloc((size_t)m * k * sizeof(float)), *b = malloc((size_t)n * k * sizeof(float));
    float *c = malloc((size_t)m * n * sizeof(float));
    if (!a || !b || !c) {
        free(a), free(b), free(c);
        return 0;
    }
    for (size_t i = 0; i < (size_t)m * k; i++)
        a[i] = (float)((i * 7) % 13) * 0.01f;
    for (size_t i = 0; i < (size_t)n * k; i++)
        b[i] = (float)((i * 5) % 11) * 0.01f;
    openblas_set_num_threads(threads);
    double best = 0;
    for (int rep = 0; rep < 4; rep++) {
        uint64_t t0 = td_now_ns();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a, k, b, k, 0.0f, c, n);
        double s = (double)(td_now_ns() - t0) * 1e-9;
        best = TD_MAX(best, 2.0 * m * n * k / s);
    }
    openblas_set_num_threads(1);
    free(a), free(b), free(c);
    return best;
}

/* ---- engine runs -------------------------------------------------------------------- */

/* prompt length of the batched-decode runs: short, so batch 64 is not mostly prefill */
#define BATCH_PROMPT 8
/* decode steps a batched figure times (at most; --gen-tokens when fewer): a batch-64 step
   of a 1B model is a second on two cores, and 8 steps already average its noise */
#define BATCH_STEPS 8
/* a prefill figure of more than this many seconds is taken twice, not three times */
#define PREFILL_LONG_S 4.0

static int32_t *random_tokens(int n, int vocab, uint64_t seed)
{
    int32_t *t = malloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n && t; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = (int32_t)((seed >> 33) % (uint64_t)vocab);
    }
    return t;
}

/* Prefills `batch` sequences of `prompt` tokens then decodes `gen` steps; returns the
 * seconds of the prefill and of the decode steps. */
static td_status_t run_batch(td_engine_t *eng, int batch, int prompt, int gen, double *prefill_s,
                             double *decode_s)
{
    const td_model_config_t *c = td_engine_model_config(eng);
    td_status_t st = TD_OK;
    td_kv_seq_t *seqs = calloc((size_t)batch, sizeof *seqs);
    td_engine_item_t *items = calloc((size_t)batch, sizeof *items);
    int32_t *next = calloc((size_t)batch, sizeof(int32_t));
    size_t logit_bytes = ((size_t)batch * c->vocab_size * sizeof(float) + 4095) & ~(size_t)4095;
    float *logits = aligned_alloc(4096, logit_bytes); /* whole pages: it may be page-locked */
    int32_t *toks = random_tokens(batch * prompt, c->vocab_size, 1234);
    td_backend_t *be = td_engine_backend(eng);
    bool pinned = false;
    if (!seqs || !items || !next || !logits || !toks) {
        st = td_errorf(TD_ERR_NOMEM, "bench: out of memory");
        goto out;
    }
    /* every step copies batch x vocab f32 logits to the host (33 MB at batch 64 of a 128k
       vocabulary): from a GPU into pageable memory that is several ms a step, next to a
       llama-3-8b step of about 6 ms; page-locked, as a serving node's buffer would be, far
       less (if it cannot be, the backend says why and the bench goes on unpinned) */
    pinned = !be->host_memory && be->ops->host_pin(be, logits, logit_bytes) == TD_OK;
    for (int i = 0; i < batch; i++)
        td_kv_seq_init(&seqs[i]);
    /* prefill: as many sequences a step as the token budget holds (a sequence longer than
       what is left of it goes on in the next step), as a serving node batches prompts; one
       step per sequence made the batch-64 runs 64 weight passes */
    uint64_t t0 = td_now_ns();
    int max_tokens = td_engine_config(eng)->max_batch_tokens;
    for (int i = 0, done = 0; i < batch && st == TD_OK;) { /* done: tokens of sequence i prefilled */
        int n_items = 0, budget = max_tokens;
        for (int q = i; q < batch && budget > 0; q++) {
            int from = q == i ? done : 0, n = TD_MIN(budget, prompt - from);
            items[n_items++] = (td_engine_item_t){.seq = &seqs[q], .tokens = toks + (size_t)q * prompt + from,
                                                  .n_tokens = n, .n_logits = from + n == prompt};
            budget -= n;
            if (from + n < prompt) { /* q goes on in the next step, from there */
                i = q;
                done = from + n;
                break;
            }
            i = q + 1;
            done = 0;
        }
        st = td_engine_step(eng, items, n_items, logits);
    }
    for (int i = 0; i < batch; i++)
        next[i] = (int32_t)(i % c->vocab_size);
    *prefill_s = (double)(td_now_ns() - t0) * 1e-9;
    t0 = td_now_ns();
    for (int s = 0; s < gen && st == TD_OK; s++) {
        for (int i = 0; i < batch; i++)
            items[i] = (td_engine_item_t){.seq = &seqs[i], .tokens = &next[i], .n_tokens = 1,
                                          .n_logits = 1};
        st = td_engine_step(eng, items, batch, logits);
        for (int i = 0; i < batch; i++)
            next[i] = (next[i] + 7) % c->vocab_size; /* any token: timing does not depend on it */
    }
    *decode_s = (double)(td_now_ns() - t0) * 1e-9;
    for (int i = 0; i < batch; i++)
        td_engine_seq_end(eng, &seqs[i]);
out:
    if (pinned)
        be->ops->host_unpin(be, logits);
    free(seqs), free(items), free(next), free(logits), free(toks);
    return st;
}

/* ---- speculative decoding ------------------------------------------------------------- */

typedef struct spec_result {
    double off_tps, on_tps;   /* median of the reps */
    td_spec_stats_t stats;    /* of the last run with speculation */
    int n_gen;
} spec_result_t;

/* One greedy batch-1 generation of up to `gen` tokens after prompt[0..n) (EOS ignored: the
 * figure is per token), with speculation per sc (mode off: one token a step); the decode
 * seconds (after the first token) and, with speculation, its counters. Its tokens go to
 * out[0..gen) (the caller compares both ways: a bench that changed the output is wrong). */
static td_status_t spec_run(td_engine_t *eng, td_spec_draft_t *draft, const td_spec_config_t *sc,
                            const int32_t *prompt, int n, int gen, int32_t *out, double *secs_p,
                            td_spec_stats_t *stats)
{
    const td_model_config_t *c = td_engine_model_config(eng);
    size_t vocab = (size_t)c->vocab_size;
    float *logits = malloc((size_t)(TD_SPEC_MAX_DRAFT + 1) * vocab * sizeof(float));
    int32_t *ctx = malloc((size_t)(n + gen + 1) * sizeof *ctx);
    td_kv_seq_t seq, dseq;
    td_kv_seq_init(&seq);
    td_kv_seq_init(&dseq);
    td_spec_adapt_t adapt;
    td_spec_adapt_init(&adapt, sc);
    memset(stats, 0, sizeof *stats);
    td_status_t st = TD_OK;
    if (!logits || !ctx) {
        st = td_errorf(TD_ERR_NOMEM, "bench: out of memory");
        goto out;
    }
    memcpy(ctx, prompt, (size_t)n * sizeof *ctx);
    int n_ctx = n, n_gen = 0;
    td_engine_item_t it = {.seq = &seq, .tokens = prompt, .n_tokens = n, .n_logits = 1};
    if ((st = td_engine_step(eng, &it, 1, logits)) != TD_OK)
        goto out;
    ctx[n_ctx++] = out[n_gen++] = td_spec_argmax(logits, c->vocab_size);
    uint64_t t0 = td_now_ns();
    while (n_gen < gen) {
        int32_t d[TD_SPEC_MAX_DRAFT], m = 0, next = ctx[n_ctx - 1];
        int k = sc->mode == TD_SPEC_OFF ? 0 : TD_MIN(td_spec_adapt_want(&adapt, sc), gen - n_gen - 1);
        if (k > 0 && sc->mode == TD_SPEC_PROMPT_LOOKUP)
            m = td_spec_lookup(ctx, n_ctx, sc->ngram_min, sc->ngram_max, k, d);
        else if (k > 0 && (st = td_spec_draft_run(draft, &dseq, ctx, n_ctx, k, d, &m)) != TD_OK)
            goto out;
        int32_t feed[TD_SPEC_MAX_DRAFT + 1] = {next};
        memcpy(feed + 1, d, (size_t)m * sizeof *d);
        int n_before = seq.n_tokens;
        it = (td_engine_item_t){.seq = &seq, .tokens = feed, .n_tokens = m + 1, .n_logits = m + 1, .verify = m > 0};
        if ((st = td_engine_step(eng, &it, 1, logits)) != TD_OK)
            goto out;
        int taken = 0, acc = 0;
        for (int i = 0; i <= m && n_gen < gen; i++) {
            int32_t t = td_spec_argmax(logits + (size_t)i * vocab, c->vocab_size);
            ctx[n_ctx++] = out[n_gen++] = t;
            taken++;
            if (i == m || t != d[i])
                break;
            acc++;
        }
        if (m > 0) {
            td_engine_seq_rollback(eng, &seq, n_before + taken);
            td_spec_adapt_update(&adapt, sc, m, acc);
            stats->verify_steps++;
            stats->drafted += (uint64_t)m;
            stats->accepted += (uint64_t)acc;
            stats->tokens += (uint64_t)taken;
        } else {
            stats->plain_steps++;
        }
    }
    *secs_p = (double)(td_now_ns() - t0) * 1e-9;
out:
    td_engine_seq_end(eng, &seq);
    if (draft)
        td_spec_draft_seq_end(draft, &dseq);
    free(logits);
    free(ctx);
    return st;
}

/* The --spec figure: reps A/B pairs (off, then on), medians of each. */
static td_status_t spec_bench(const bench_opts_t *o, td_engine_t *eng, td_spec_draft_t *draft, spec_result_t *r)
{
    const td_model_config_t *c = td_engine_model_config(eng);
    int32_t *prompt = NULL;
    size_t n = 0;
    td_status_t st = TD_OK;
    if (o->spec_prompt) {
        for (const char *p = o->spec_prompt; *p;) {
            char *end;
            long v = strtol(p, &end, 10);
            if (end == p)
                break;
            int32_t *np = realloc(prompt, (n + 1) * sizeof *np);
            if (!np) {
                free(prompt);
                return td_errorf(TD_ERR_NOMEM, "bench: out of memory");
            }
            prompt = np;
            prompt[n++] = (int32_t)v;
            p = end;
        }
        for (size_t i = 0; i < n; i++)
            if (prompt[i] < 0 || prompt[i] >= c->vocab_size) {
                int32_t bad = prompt[i];
                free(prompt);
                return td_errorf(TD_ERR_INVALID, "--spec-prompt-ids: id %d is outside the vocabulary [0, %d)", bad,
                                 c->vocab_size);
            }
    } else { /* a unit of 24 random ids, four times */
        int32_t *unit = random_tokens(24, c->vocab_size, 99);
        prompt = malloc(96 * sizeof *prompt);
        if (!unit || !prompt) {
            free(unit), free(prompt);
            return td_errorf(TD_ERR_NOMEM, "bench: out of memory");
        }
        for (int i = 0; i < 96; i++)
            prompt[i] = unit[i % 24];
        n = 96;
        free(unit);
    }
    if (n == 0)
        return td_errorf(TD_ERR_INVALID, "--spec-prompt-ids: no ids");
    int reps = o->spec_reps, gen = o->gen_tokens;
    double *off = calloc((size_t)reps, sizeof *off), *on = calloc((size_t)reps, sizeof *on);
    int32_t *a = malloc((size_t)gen * sizeof *a), *b = malloc((size_t)gen * sizeof *b);
    td_spec_config_t none = o->spec;
    none.mode = TD_SPEC_OFF;
    if (!off || !on || !a || !b) {
        st = td_errorf(TD_ERR_NOMEM, "bench: out of memory");
        goto out;
    }
    td_spec_stats_t dummy;
    for (int i = 0; i < reps && st == TD_OK; i++) {
        double s_off = 0, s_on = 0;
        if ((st = spec_run(eng, NULL, &none, prompt, (int)n, gen, a, &s_off, &dummy)) != TD_OK ||
            (st = spec_run(eng, draft, &o->spec, prompt, (int)n, gen, b, &s_on, &r->stats)) != TD_OK)
            break;
        if (memcmp(a, b, (size_t)gen * sizeof *a)) {
            st = td_errorf(TD_ERR_INTERNAL, "bench: speculative decoding changed the greedy output (a bug)");
            break;
        }
        off[i] = (gen - 1) / s_off;
        on[i] = (gen - 1) / s_on;
    }
    if (st == TD_OK) {
        td_stats_sort(off, (size_t)reps);
        td_stats_sort(on, (size_t)reps);
        r->off_tps = off[reps / 2];
        r->on_tps = on[reps / 2];
        r->n_gen = gen;
    }
out:
    free(off), free(on), free(a), free(b), free(prompt);
    return st;
}

/* FLOPs of a forward pass over T new tokens after `prefix` cached ones (matmuls and
 * causal attention), per the model's shape, with logits for the last row only: that is
 * what run_batch asks of a prompt (the LM head over all T rows, never computed, inflated a
 * 512-token prefill's count by 27% on llama-3.2-1b, 7% on llama-3-8b). */
static double forward_flops(const td_model_config_t *c, double T, double prefix)
{
    double qd = (double)c->n_heads * c->head_dim, kvd = (double)c->n_kv_heads * c->head_dim;
    /* a mixture: the router, and k experts per token */
    double ffn = c->n_experts > 0 ? (double)c->expert_hidden_dim * c->n_experts_used : (double)c->hidden_dim;
    double per_layer = 2 * T * c->dim * (qd + 2 * kvd) + 2 * T * qd * c->dim + 2 * T * c->dim * ffn * 3.0 +
                       2 * T * c->dim * (double)c->n_experts;
    double attn = 2.0 * 2.0 * qd * (T * prefix + T * (T + 1) / 2);
    return c->n_layers * (per_layer + attn) + 2.0 * c->dim * c->vocab_size;
}

/* ---- the peer: llama.cpp's llama-bench on the same file ----------------------------- */

typedef struct llama_result {
    double pp_tps;     /* prefill of prompt_tokens, tokens/s (avg of its repetitions) */
    double tg_tps;     /* decode of gen_tokens at batch 1, tokens/s */
    double model_size; /* bytes of weights, as llama-bench reports them */
} llama_result_t;

/* Runs `llama-bench -m FILE -p P -n G -t T -r 3 -o json` and reads its JSON from stdout. */
static td_status_t run_llama_bench(const bench_opts_t *o, const char *model, llama_result_t *r)
{
    char p[16], n[16], t[16];
    snprintf(p, sizeof p, "%d", o->prompt_tokens);
    snprintf(n, sizeof n, "%d", o->gen_tokens);
    snprintf(t, sizeof t, "%d", o->threads);
    char *argv[] = {(char *)o->llama_bench, "-m", (char *)model, "-p", p, "-n", n, "-t", t,
                    "-r", "3", "-o", "json", NULL};
    td_child_config_t cc = td_child_config_default();
    cc.file = o->llama_bench;
    cc.argv = argv;
    cc.out = TD_CHILD_OUT_PIPE;
    cc.die_with_parent = true;
    td_child_t child;
    td_status_t st = td_child_spawn(&cc, &child);
    if (st != TD_OK)
        return st;
    char *text = NULL, line[1024];
    size_t len = 0, cap = 0;
    uint64_t deadline = td_now_ns() + 900ull * 1000000000ull; /* a 1B model at 1 thread: minutes */
    while (st == TD_OK) {
        uint64_t now = td_now_ns();
        if (now >= deadline) {
            st = td_errorf(TD_ERR_TIMEOUT, "bench: %s did not finish within 900 s", o->llama_bench);
            break;
        }
        td_status_t rs = td_child_read_line(&child, (int)((deadline - now) / 1000000), line, sizeof line);
        if (rs == TD_ERR_CLOSED)
            break;
        if (rs == TD_ERR_CANCELLED || rs == TD_ERR_TIMEOUT)
            continue;
        size_t l = strlen(line);
        if (len + l + 2 > cap) {
            cap = (len + l + 2) * 2;
            char *nt = realloc(text, cap);
            if (!nt) {
                st = td_errorf(TD_ERR_NOMEM, "bench: out of memory reading llama-bench's output");
                break;
            }
            text = nt;
        }
        memcpy(text + len, line, l);
        len += l;
        text[len++] = '\n';
        text[len] = 0;
    }
    int status = 0;
    td_child_stop_all(&child, 1, SIGTERM, 5000, &status);
    td_child_close(&child);
    if (st == TD_OK && (!WIFEXITED(status) || WEXITSTATUS(status) != 0))
        st = td_errorf(TD_ERR_IO, "bench: %s exited with status %d (127: it cannot be run; pass --llama-bench PATH)",
                       o->llama_bench, WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    cJSON *j = st == TD_OK && text ? cJSON_Parse(text) : NULL;
    free(text);
    if (st != TD_OK)
        return st;
    *r = (llama_result_t){0};
    const cJSON *e;
    cJSON_ArrayForEach(e, j) {
        const cJSON *np = cJSON_GetObjectItem(e, "n_prompt"), *ng = cJSON_GetObjectItem(e, "n_gen");
        const cJSON *ts = cJSON_GetObjectItem(e, "avg_ts"), *sz = cJSON_GetObjectItem(e, "model_size");
        if (!cJSON_IsNumber(np) || !cJSON_IsNumber(ng) || !cJSON_IsNumber(ts))
            continue;
        if (np->valuedouble == o->prompt_tokens && ng->valuedouble == 0)
            r->pp_tps = ts->valuedouble;
        if (np->valuedouble == 0 && ng->valuedouble == o->gen_tokens)
            r->tg_tps = ts->valuedouble;
        if (cJSON_IsNumber(sz))
            r->model_size = sz->valuedouble;
    }
    cJSON_Delete(j);
    if (r->pp_tps <= 0 || r->tg_tps <= 0)
        return td_errorf(TD_ERR_FORMAT, "bench: %s printed no pp%d/tg%d results in its JSON", o->llama_bench,
                         o->prompt_tokens, o->gen_tokens);
    return TD_OK;
}

static td_status_t ensure_model(const bench_opts_t *o, char *dir, size_t cap)
{
    if (o->model) {
        snprintf(dir, cap, "%s", o->model);
        return TD_OK;
    }
    const char *base = getenv("TANDEM_CACHE");
    char home_cache[2048];
    if (!base) {
        const char *home = getenv("HOME");
        snprintf(home_cache, sizeof home_cache, "%s/.cache/tandem", home ? home : "/tmp");
        base = home_cache;
    }
    char layers[24] = "";
    if (o->layers > 0)
        snprintf(layers, sizeof layers, "-L%d", o->layers);
    snprintf(dir, cap, "%s/bench-%s%s-%s", base, o->preset, layers, td_dtype_name(o->dtype));
    /* td_model_synth writes config.json last: with it the model is whole */
    char cfg[4096 + 16];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    if (td_is_file(cfg))
        return TD_OK;
    td_synth_params_t sp = {.seed = 1, .dtype = o->dtype};
    td_status_t st = td_model_preset(o->preset, &sp.config);
    if (st != TD_OK)
        return td_errorf(st, "bench: unknown preset '%s'", o->preset);
    if (o->layers > 0)
        sp.config.n_layers = o->layers;
    fprintf(stderr, "bench: writing a synthetic %s model to %s (once)\n", o->preset, dir);
    return td_model_synth(&sp, dir, NULL);
}

/* `bench engine --spec`: the speculative decoding figure alone; returns the exit status. */
static int spec_main(const bench_opts_t *o, const td_model_t *model, td_backend_t *be, td_engine_t *eng,
                     const td_engine_config_t *ec, const char *dir)
{
    td_model_t *dmodel = NULL;
    td_engine_t *deng = NULL;
    td_spec_draft_t *draft = NULL;
    spec_result_t r = {0};
    int rc = 1;
    if (o->draft_model) {
        td_engine_config_t dc = *ec;
        dc.max_logit_rows = 1;
        if (td_model_load(o->draft_model, &dmodel) != TD_OK ||
            td_spec_draft_check(model, NULL, dmodel, o->draft_model) != TD_OK ||
            td_engine_create(dmodel, be, &dc, &deng) != TD_OK ||
            td_spec_draft_create(deng, model->config.vocab_size, &draft) != TD_OK)
            goto out;
    }
    if (spec_bench(o, eng, draft, &r) != TD_OK)
        goto out;
    const td_spec_stats_t *sp = &r.stats;
    double per_step = sp->verify_steps ? (double)sp->tokens / (double)sp->verify_steps : 0.0;
    if (o->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "model", dir);
        cJSON_AddStringToObject(j, "device", be->ops->name);
        if (td_backend_cpu_isa(be))
            cJSON_AddStringToObject(j, "cpu_isa", td_backend_cpu_isa(be));
        cJSON_AddNumberToObject(j, "threads", o->threads);
        cJSON_AddStringToObject(j, "spec", td_spec_mode_name(o->spec.mode));
        if (o->draft_model)
            cJSON_AddStringToObject(j, "draft_model", o->draft_model);
        cJSON_AddNumberToObject(j, "draft_tokens", o->spec.k_max);
        cJSON_AddNumberToObject(j, "gen_tokens", r.n_gen);
        cJSON_AddNumberToObject(j, "reps", o->spec_reps);
        bench_json_number(j, "decode_tokens_per_s_off", r.off_tps, 3);
        bench_json_number(j, "decode_tokens_per_s_on", r.on_tps, 3);
        bench_json_number(j, "speedup", r.on_tps / r.off_tps, 3);
        bench_json_number(j, "acceptance", td_spec_acceptance(sp), 3);
        bench_json_number(j, "tokens_per_verify_step", per_step, 3);
        cJSON_AddNumberToObject(j, "verify_steps", (double)sp->verify_steps);
        cJSON_AddNumberToObject(j, "plain_steps", (double)sp->plain_steps);
        if (bench_json_print(stdout, j) != 0)
            goto out;
    } else {
        printf("model          %s (%s, %s, %d threads)\n", dir, model->config.arch_name, be->ops->name, o->threads);
        printf("speculation    %s%s%s, up to %d draft tokens, %d tokens greedy, median of %d A/B pairs\n",
               td_spec_mode_name(o->spec.mode), o->draft_model ? " " : "", o->draft_model ? o->draft_model : "",
               o->spec.k_max, r.n_gen, o->spec_reps);
        printf("decode b=1     off %.2f tokens/s, on %.2f tokens/s: %.2fx\n", r.off_tps, r.on_tps, r.on_tps / r.off_tps);
        printf("drafts         %" PRIu64 " verify steps, %" PRIu64 " plain; %" PRIu64 " drafted, %" PRIu64
               " accepted (%.1f%%); %.2f tokens per verify step\n",
               sp->verify_steps, sp->plain_steps, sp->drafted, sp->accepted, 100.0 * td_spec_acceptance(sp), per_step);
    }
    rc = 0;
out:
    td_spec_draft_destroy(draft);
    td_engine_destroy(deng);
    td_model_destroy(dmodel);
    return rc;
}

/* Reads the command line into o; false when the command ends here, with *rc_p its exit
 * status (--help: 0; a bad option: 2). */
static bool configure(bench_opts_t *o, int argc, char **argv, int *rc_p)
{
    *o = (bench_opts_t){.preset = "llama-3.2-1b", .dtype = TD_F32, .quant = -1, .kv_dtype = -1, .threads = 0,
                        .prompt_tokens = 512, .gen_tokens = 16, .llama_bench = getenv("LLAMA_BENCH")};
    o->spec = td_spec_config_default();
    int64_t threads = 0, prompt_tokens = o->prompt_tokens, gen_tokens = o->gen_tokens, draft_tokens = o->spec.k_max,
            spec_reps = 5, layers = 0;
    const td_opt_t opts[] = {
        {.name = "model", .type = TD_OPT_STR, .ptr = &o->model, .arg = "PATH", .help = "a model to load instead of a preset"},
        {.name = "preset", .type = TD_OPT_STR, .ptr = &o->preset, .arg = "NAME",
         .help = "synthetic model shape (default llama-3.2-1b), written once under\n"
                 "$TANDEM_CACHE or ~/.cache/tandem"},
        {.name = "layers", .type = TD_OPT_I64, .ptr = &layers, .min = 1, .max = 1024, .arg = "N",
         .help = "the preset's layer shape, N layers (a real shape that fits in memory;\n"
                 "per-layer figures scale)"},
        {.name = "dtype", .type = TD_OPT_FN, .ptr = &o->dtype, .parse = cli_opt_dtype, .arg = "T",
         .help = "f32|bf16|f16: dtype of the synthetic weights (default f32); on cuda also of the\n"
                 "activations and the KV cache"},
        {.name = "quant", .type = TD_OPT_FN, .ptr = &o->quant, .parse = cli_opt_quant, .arg = "Q",
         .help = "q8_0|q4_0: quantize the weight matrices at load (CPU)"},
        {.name = "kv-dtype", .type = TD_OPT_FN, .ptr = &o->kv_dtype, .parse = cli_opt_kv_dtype, .arg = "T",
         .help = "f32|f16|bf16|q8_0: the KV cache (default: cpu f32, cuda --dtype)"},
        {.name = "device", .type = TD_OPT_FN, .ptr = &o->device, .parse = cli_opt_device, .arg = "D",
         .help = "where the engine runs: cpu (default), cuda or cuda:N"},
        {.name = "threads", .type = TD_OPT_I64, .ptr = &threads, .min = 1, .max = 1024, .arg = "N",
         .help = "compute threads (default: all cores)"},
        {.name = "prompt-tokens", .type = TD_OPT_I64, .ptr = &prompt_tokens, .min = 1, .max = 1 << 16, .arg = "N",
         .help = "prompt length of the prefill figure (default 512)"},
        {.name = "gen-tokens", .type = TD_OPT_I64, .ptr = &gen_tokens, .min = 1, .max = 1 << 16, .arg = "N",
         .help = "tokens generated per decode figure (default 16)"},
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &o->json, .help = "one JSON document on stdout (docs/bench.md)"},
        {.name = "vs-llamacpp", .type = TD_OPT_BOOL, .ptr = &o->vs_llamacpp,
         .help = "then run llama.cpp's llama-bench on the same GGUF file (--model FILE.gguf),\n"
                 "prompt and generation lengths and threads, and print the ratios (CPU)"},
        {.name = "llama-bench", .type = TD_OPT_STR, .ptr = &o->llama_bench, .arg = "PATH",
         .help = "the llama-bench program of --vs-llamacpp (default: $LLAMA_BENCH)"},
        {.name = "spec", .type = TD_OPT_FN, .ptr = &o->spec.mode, .parse = cli_opt_spec, .arg = "MODE",
         .help = "prompt-lookup|draft-model: only the speculative decoding figure: batch-1\n"
                 "greedy decode of --gen-tokens with and without it, A/B alternated"},
        {.name = "draft-model", .type = TD_OPT_STR, .ptr = &o->draft_model, .arg = "PATH",
         .help = "the draft model of --spec draft-model (sharing the vocabulary)"},
        {.name = "draft-tokens", .type = TD_OPT_I64, .ptr = &draft_tokens, .min = 1, .max = TD_SPEC_MAX_DRAFT,
         .arg = "K", .help = "most draft tokens per verify step (default 8)"},
        {.name = "spec-prompt-ids", .type = TD_OPT_STR, .ptr = &o->spec_prompt, .arg = "IDS",
         .help = "the --spec workload's prompt (default: 24 random ids, four times)"},
        {.name = "spec-reps", .type = TD_OPT_I64, .ptr = &spec_reps, .min = 1, .max = 100, .arg = "N",
         .help = "A/B pairs of the --spec figure; medians reported (default 5)"},
    };
    td_opts_t spec = {.prog = "bench engine", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r = {0};
    *rc_p = 2;
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return false;
    if (r.help) {
        printf("usage: tandem bench engine [--model PATH | --preset NAME [--layers N]] [--dtype f32|bf16|f16]\n"
               "                           [--quant q8_0|q4_0] [--kv-dtype T] [--device cpu|cuda[:N]] [--threads N]\n"
               "                           [--prompt-tokens N] [--gen-tokens N] [--json]\n"
               "                           [--vs-llamacpp [--llama-bench PATH]]\n"
               "                           [--spec prompt-lookup|draft-model [--draft-model PATH] [--draft-tokens K]\n"
               "                            [--spec-prompt-ids IDS] [--spec-reps N]]\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        *rc_p = 0;
        return false;
    }
    o->threads = (int)threads;
    o->layers = (int)layers;
    if (o->layers && o->model) {
        fprintf(stderr, "tandem bench engine: --layers shapes a --preset model, not --model\n");
        return false;
    }
    o->prompt_tokens = (int)prompt_tokens;
    o->gen_tokens = (int)gen_tokens;
    o->spec.k_max = (int32_t)draft_tokens;
    o->spec_reps = (int)spec_reps;
    if (td_spec_resolve_mode(&o->spec.mode, o->draft_model != NULL) != TD_OK) {
        fprintf(stderr, "tandem bench engine: %s\n", td_last_error());
        return false;
    }
    if (o->spec.mode != TD_SPEC_OFF && o->gen_tokens < 2) {
        fprintf(stderr, "tandem bench engine: --spec needs --gen-tokens of 2 or more\n");
        return false;
    }
    if (o->threads <= 0)
        o->threads = td_cpu_count();
    if (o->vs_llamacpp && (o->device.cuda || !o->model || !td_gguf_is_gguf(o->model) || !o->llama_bench)) {
        fprintf(stderr, "tandem bench engine: --vs-llamacpp compares on the CPU on one GGUF file: it needs "
                        "--model FILE.gguf and --llama-bench PATH (or $LLAMA_BENCH)%s\n",
                o->device.cuda ? ", and no --device cuda" : "");
        return false;
    }
    return true;
}

/* The engine the figures run on: KV room for 64 sequences of 64 + gen tokens and one of the
 * prompt + gen (--spec: one sequence of up to 4096 tokens and a verify step's rows), no
 * prefix cache (every run computes its prompt). */
static td_engine_config_t engine_config(const bench_opts_t *o)
{
    td_engine_config_t ec = td_engine_config_default();
    td_engine_config_set_dtype(&ec, -1, o->quant, o->kv_dtype >= 0 ? o->kv_dtype : o->device.cuda ? (int)o->dtype : -1);
    ec.n_blocks = 64 * TD_DIV_CEIL(64 + o->gen_tokens + 1, ec.block_size) +
                  TD_DIV_CEIL(o->prompt_tokens + o->gen_tokens + 1, ec.block_size) + 8;
    ec.max_batch_tokens = TD_MAX(o->prompt_tokens, 64);
    ec.prefix_cache = false;
    if (o->spec.mode != TD_SPEC_OFF) {
        ec.max_logit_rows = TD_SPEC_MAX_DRAFT + 1;
        ec.max_batch_tokens = TD_MAX(ec.max_batch_tokens, 512);
        ec.n_blocks = TD_DIV_CEIL(4096 + o->gen_tokens + TD_SPEC_MAX_DRAFT + 1, ec.block_size) + 8;
    }
    return ec;
}

/* The batch sizes of the batched decode figure. */
static const int batches[] = {1, 8, 32, 64};

/* The figures of `bench engine` without --spec, and the ceilings they are measured against. */
typedef struct engine_figures {
    double bw, sgemm;                    /* ceilings: read (cuda: copy) bandwidth in B/s, GEMM FLOP/s */
    int32_t ffn_dim;                     /* the ceiling GEMM's width: an FFN matrix's (a mixture: an expert's) */
    double prefill_tps, prefill_flops;   /* at the prompt length */
    double decode_tps;                   /* batch 1, after a 64-token prompt */
    double active;                       /* weight bytes a token reads (a mixture: its k experts') */
    double bytes_per_token;              /* active + the KV read */
    double batch_tps[TD_ARRAY_LEN(batches)];
    llama_result_t lr;                   /* --vs-llamacpp */
    double peer_bw;                      /* llama.cpp's read rate in B/s; 0 without it */
    bool probe_bound;                    /* the ceiling is the probe's, not llama.cpp's (faster) */
    double decode_ratio;                 /* decode's read rate over the ceiling */
} engine_figures_t;

/* Ceilings: bandwidth and GEMM FLOP/s on the device the engine runs on (the GEMM of an
 * FFN matrix: a mixture's expert width). */
static td_status_t measure_ceilings(const bench_opts_t *o, td_backend_t *be, td_engine_t *eng, engine_figures_t *f)
{
    const td_model_config_t *c = td_engine_model_config(eng);
    f->ffn_dim = c->n_experts > 0 ? c->expert_hidden_dim : c->hidden_dim;
    if (o->device.cuda) {
        td_status_t st = bench_copy_bandwidth(be, (size_t)1 << 30, 10, &f->bw);
        if (st == TD_OK)
            st = bench_matmul_flops(be, o->prompt_tokens, f->ffn_dim, c->dim, o->dtype, 10, &f->sgemm);
        return st;
    }
    td_pool_t *pool = NULL;
    td_status_t st = td_pool_create(o->threads, &pool);
    if (st != TD_OK)
        return st;
    f->bw = measure_read_bw(pool, o->threads, td_engine_weight_bytes(eng));
    td_pool_destroy(pool);
    f->sgemm = measure_sgemm(o->threads, o->prompt_tokens, f->ffn_dim, c->dim);
    return TD_OK;
}

/* The engine's figures: prefill, batch-1 and batched decode, then llama.cpp's when asked. */
static td_status_t measure(const bench_opts_t *o, td_engine_t *eng, const td_engine_config_t *ec, const char *dir,
                           engine_figures_t *f)
{
    const td_model_config_t *c = td_engine_model_config(eng);
    td_status_t st;
    /* prefill at the prompt length, best of 3 (of 2 when one takes long: the figure stays
       under a minute for a 1B model on two cores) */
    double pre_s = 1e30, dec_s = 0, p = 0, d = 0;
    for (int rep = 0; rep < (pre_s > PREFILL_LONG_S ? 2 : 3); rep++) {
        if ((st = run_batch(eng, 1, o->prompt_tokens, 1, &p, &d)) != TD_OK)
            return st;
        pre_s = TD_MIN(pre_s, p);
    }
    f->prefill_tps = o->prompt_tokens / pre_s;
    f->prefill_flops = forward_flops(c, o->prompt_tokens, 0) / pre_s;

    /* batch-1 decode after a 64-token prompt */
    if ((st = run_batch(eng, 1, 64, o->gen_tokens, &p, &dec_s)) != TD_OK)
        return st;
    f->decode_tps = o->gen_tokens / dec_s;
    size_t kv_tok = (size_t)td_model_kv_bytes_per_token(c, ec->kv_dtype);
    /* a mixture reads the router's k experts of each layer per token, not all of them */
    f->active = (double)td_engine_active_weight_bytes(eng);
    f->bytes_per_token = f->active + kv_tok * (64 + o->gen_tokens / 2.0);

    for (size_t b = 0; b < TD_ARRAY_LEN(batches); b++) {
        int steps = TD_MIN(o->gen_tokens, BATCH_STEPS);
        if ((st = run_batch(eng, batches[b], BATCH_PROMPT, steps, &p, &d)) != TD_OK)
            return st;
        f->batch_tps[b] = batches[b] * steps / d;
    }

    /* the peer, after our runs (never beside them: they share the cores) */
    if (o->vs_llamacpp) {
        if ((st = run_llama_bench(o, dir, &f->lr)) != TD_OK)
            return st;
        f->peer_bw = f->lr.tg_tps * f->lr.model_size;
    }
    /* the ceiling is what the fastest reader achieved: the probe, or the peer when faster */
    f->probe_bound = f->peer_bw <= f->bw;
    double ceiling = f->probe_bound ? f->bw : f->peer_bw;
    f->decode_ratio = f->decode_tps * f->bytes_per_token / ceiling;
    return TD_OK;
}

/* The figures as one JSON document on stdout (docs/bench.md); bench_json_print's status. */
static int print_json(const bench_opts_t *o, td_backend_t *be, td_engine_t *eng, const td_engine_config_t *ec,
                      const char *dir, const engine_figures_t *f)
{
    const td_model_config_t *c = td_engine_model_config(eng);
    cJSON *j = cJSON_CreateObject(), *batched = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "model", dir);
    cJSON_AddStringToObject(j, "device", be->ops->name);
    if (td_backend_cpu_isa(be))
        cJSON_AddStringToObject(j, "cpu_isa", td_backend_cpu_isa(be));
    cJSON_AddStringToObject(j, "kv_dtype", td_dtype_name(ec->kv_dtype));
    if (td_backend_cpu_isa(be)) /* what the quantized matmul's activations are (--device cpu[:exact|:q8]) */
        cJSON_AddStringToObject(j, "cpu_activations", o->device.exact ? "f32" : o->device.q8 ? "one-byte" : "two-byte");
    cJSON_AddNumberToObject(j, "threads", o->threads);
    cJSON_AddNumberToObject(j, "weight_bytes", (double)td_engine_weight_bytes(eng));
    cJSON_AddNumberToObject(j, "active_weight_bytes", f->active);
    cJSON_AddNumberToObject(j, "experts", c->n_experts);
    cJSON_AddNumberToObject(j, "experts_per_token", c->n_experts_used);
    bench_json_number(j, "read_bw_gbytes_per_s", f->bw * 1e-9, 3);
    bench_json_number(j, "sgemm_gflops", f->sgemm * 1e-9, 2);
    bench_json_number(j, "decode_b1_tokens_per_s", f->decode_tps, 3);
    bench_json_number(j, "decode_b1_bytes_per_token", f->bytes_per_token, 0);
    bench_json_number(j, "decode_b1_bw_ratio", f->decode_ratio, 3);
    cJSON_AddNumberToObject(j, "prefill_tokens", o->prompt_tokens);
    bench_json_number(j, "prefill_tokens_per_s", f->prefill_tps, 2);
    bench_json_number(j, "prefill_gflops", f->prefill_flops * 1e-9, 2);
    bench_json_number(j, "prefill_sgemm_ratio", f->prefill_flops / f->sgemm, 3);
    for (size_t b = 0; b < TD_ARRAY_LEN(batches); b++) {
        char key[16];
        snprintf(key, sizeof key, "%d", batches[b]);
        bench_json_number(batched, key, f->batch_tps[b], 2);
    }
    if (!cJSON_AddItemToObject(j, "batched_decode_tokens_per_s", batched))
        cJSON_Delete(batched);
    if (o->vs_llamacpp) {
        bench_json_number(j, "llamacpp_decode_b1_tokens_per_s", f->lr.tg_tps, 3);
        bench_json_number(j, "llamacpp_prefill_tokens_per_s", f->lr.pp_tps, 2);
        bench_json_number(j, "llamacpp_read_gbytes_per_s", f->peer_bw * 1e-9, 3);
        bench_json_number(j, "decode_vs_llamacpp", f->decode_tps / f->lr.tg_tps, 3);
        bench_json_number(j, "prefill_vs_llamacpp", f->prefill_tps / f->lr.pp_tps, 3);
        cJSON_AddBoolToObject(j, "read_bw_probe_is_bound", f->probe_bound);
    }
    return bench_json_print(stdout, j);
}

/* The figures as text, one line each. */
static void print_text(const bench_opts_t *o, td_backend_t *be, td_engine_t *eng, const td_engine_config_t *ec,
                       const char *dir, const engine_figures_t *f)
{
    const td_model_config_t *c = td_engine_model_config(eng);
    const char *bw_name = o->device.cuda ? "device copy bandwidth" : "read bandwidth";
    const char *gemm_name = o->device.cuda ? "cuBLAS gemm" : "OpenBLAS sgemm";
    printf("model          %s (%s, %.2f GB of weights streamed per step, %s%s%s%s, KV %s)\n", dir,
           c->arch_name, (double)td_engine_weight_bytes(eng) * 1e-9, be->ops->name,
           td_backend_cpu_isa(be) ? " kernels " : "", td_backend_cpu_isa(be) ? td_backend_cpu_isa(be) : "",
           !td_backend_cpu_isa(be) ? "" : o->device.exact ? ", f32 activations"
                                        : o->device.q8   ? ", one-byte activations" : "",
           td_dtype_name(ec->kv_dtype));
    if (c->n_experts > 0)
        printf("experts        %d of %d per token: %.3f GB of active weights per token (of %.3f GB)\n",
               c->n_experts_used, c->n_experts, f->active * 1e-9, (double)td_engine_weight_bytes(eng) * 1e-9);
    printf("ceilings       %s %.2f GB/s, %s %.1f GFLOP/s (%dx%dx%d)\n", bw_name, f->bw * 1e-9,
           gemm_name, f->sgemm * 1e-9, o->prompt_tokens, f->ffn_dim, c->dim);
    printf("decode b=1     %.2f tokens/s x %.1f MB/token = %.2f GB/s = %.2f of %s\n", f->decode_tps,
           f->bytes_per_token * 1e-6, f->decode_tps * f->bytes_per_token * 1e-9, f->decode_ratio,
           f->probe_bound ? bw_name : "llama.cpp's read rate");
    printf("prefill %4d   %.1f tokens/s = %.1f GFLOP/s = %.2f of %s\n", o->prompt_tokens,
           f->prefill_tps, f->prefill_flops * 1e-9, f->prefill_flops / f->sgemm, gemm_name);
    printf("batched decode");
    for (size_t b = 0; b < TD_ARRAY_LEN(batches); b++)
        printf("  b=%d %.1f tok/s", batches[b], f->batch_tps[b]);
    printf("\n");
    if (o->vs_llamacpp) {
        printf("llama.cpp      %s, %d threads: decode tg%d %.2f tokens/s (reads %.2f GB/s), prefill pp%d "
               "%.1f tokens/s\n",
               o->llama_bench, o->threads, o->gen_tokens, f->lr.tg_tps, f->peer_bw * 1e-9, o->prompt_tokens, f->lr.pp_tps);
        printf("vs llama.cpp   decode %.2fx, prefill %.2fx%s\n", f->decode_tps / f->lr.tg_tps, f->prefill_tps / f->lr.pp_tps,
               f->probe_bound ? "" : " (llama.cpp read the weights faster than the read probe: the probe is not "
                                  "the bound, the ceiling above is llama.cpp's rate)");
    }
}

int bench_engine(int argc, char **argv)
{
    bench_opts_t o;
    int rc;
    if (!configure(&o, argc, argv, &rc))
        return rc;

    char dir[4096];
    td_model_t *model = NULL;
    td_backend_t *be = NULL;
    td_engine_t *eng = NULL;
    engine_figures_t f = {0};
    rc = 1;
    if (td_backend_open(&o.device, o.threads, o.dtype, &be) != TD_OK ||
        ensure_model(&o, dir, sizeof dir) != TD_OK || td_model_load(dir, &model) != TD_OK)
        goto out;
    td_engine_config_t ec = engine_config(&o);
    if (td_engine_create(model, be, &ec, &eng) != TD_OK)
        goto out;
    if (o.spec.mode != TD_SPEC_OFF) {
        rc = spec_main(&o, model, be, eng, &ec, dir);
        goto out;
    }
    if (measure_ceilings(&o, be, eng, &f) != TD_OK || measure(&o, eng, &ec, dir, &f) != TD_OK)
        goto out;
    if (o.json) {
        if (print_json(&o, be, eng, &ec, dir, &f) != 0)
            goto out;
    } else {
        print_text(&o, be, eng, &ec, dir, &f);
    }
    rc = 0;
out:
    if (rc && !td_last_error()[0])
        fprintf(stderr, "tandem bench engine: failed\n"); /* decided errors were logged where decided */
    td_engine_destroy(eng);
    td_backend_destroy(be);
    td_model_destroy(model);
    return rc;
}
