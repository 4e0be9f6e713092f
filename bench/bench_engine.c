/*
 * bench_engine: `tandem bench engine`, the engine against ceilings measured in the same
 * run on the same device:
 *   - batch-1 decode: tokens/s x bytes streamed per token / measured bandwidth (CPU: all
 *     cores reading 1 GiB; CUDA: a device-to-device copy, bytes read + written)
 *   - prefill: model FLOP/s at a 512-token prompt / a GEMM of the prefill's FFN shape
 *     (CPU: OpenBLAS sgemm; CUDA: the backend's cuBLAS matmul in the weights' dtype)
 *   - batched decode: aggregate tokens/s at batch 1, 8, 32, 64
 * The model is --model PATH, or a synthetic one of a preset shape (default llama-3.2-1b,
 * f32) written once to a cache folder.
 */
#include <cblas.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_backend.h"
#include "td_bench.h"
#include "td_engine.h"
#include "td_model.h"
#include "td_threadpool.h"
#include "td_util.h"

void openblas_set_num_threads(int num_threads);

typedef struct bench_opts {
    const char *model;
    const char *preset;
    td_dtype_t dtype;
    td_device_spec_t device;
    int threads;
    int prompt_tokens;
    int gen_tokens;
    bool json;
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

/* Read bandwidth over a buffer far larger than the caches, all threads: bytes/s. */
static double measure_read_bw(td_pool_t *pool)
{
    const size_t bytes = (size_t)1 << 30;
    const int tasks = 256;
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
#define BATCH_PROMPT 16

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
    /* prefill sequence by sequence within the token budget */
    uint64_t t0 = td_now_ns();
    int max_tokens = td_engine_config(eng)->max_batch_tokens;
    for (int i = 0; i < batch && st == TD_OK; i++) {
        for (int off = 0; off < prompt && st == TD_OK; off += max_tokens) {
            int n = TD_MIN(max_tokens, prompt - off);
            td_engine_item_t it = {.seq = &seqs[i], .tokens = toks + (size_t)i * prompt + off,
                                   .n_tokens = n, .n_logits = off + n == prompt};
            st = td_engine_step(eng, &it, 1, logits);
        }
        next[i] = (int32_t)(i % c->vocab_size);
    }
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

/* FLOPs of a forward pass over T new tokens after `prefix` cached ones (matmuls and
 * causal attention), per the model's shape, with logits for the last row only: that is
 * what run_batch asks of a prompt (the LM head over all T rows, never computed, inflated a
 * 512-token prefill's count by 27% on llama-3.2-1b, 7% on llama-3-8b). */
static double forward_flops(const td_model_config_t *c, double T, double prefix)
{
    double qd = (double)c->n_heads * c->head_dim, kvd = (double)c->n_kv_heads * c->head_dim;
    double per_layer = 2 * T * c->dim * (qd + 2 * kvd) + 2 * T * qd * c->dim +
                       2 * T * c->dim * c->hidden_dim * 3.0;
    double attn = 2.0 * 2.0 * qd * (T * prefix + T * (T + 1) / 2);
    return c->n_layers * (per_layer + attn) + 2.0 * c->dim * c->vocab_size;
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
    snprintf(dir, cap, "%s/bench-%s-%s", base, o->preset, td_dtype_name(o->dtype));
    /* td_model_synth writes config.json last: with it the model is whole */
    char cfg[4096 + 16];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    if (td_is_file(cfg))
        return TD_OK;
    td_synth_params_t sp = {.seed = 1, .dtype = o->dtype};
    td_status_t st = td_model_preset(o->preset, &sp.config);
    if (st != TD_OK)
        return td_errorf(st, "bench: unknown preset '%s'", o->preset);
    fprintf(stderr, "bench: writing a synthetic %s model to %s (once)\n", o->preset, dir);
    return td_model_synth(&sp, dir, NULL);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tandem bench engine [--model PATH | --preset NAME] [--dtype f32|bf16|f16]\n"
            "                           [--device cpu|cuda[:N]] [--threads N] [--prompt-tokens N]\n"
            "                           [--gen-tokens N] [--json]\n"
            "  --preset   synthetic model shape (default llama-3.2-1b), written once under\n"
            "             $TANDEM_CACHE or ~/.cache/tandem\n"
            "  --dtype    dtype of the synthetic weights (default f32); on cuda also of the\n"
            "             activations and the KV cache\n"
            "  --device   where the engine runs (default cpu)\n"
            "  --threads  compute threads (default: all cores)\n");
}

int bench_engine(int argc, char **argv)
{
    bench_opts_t o = {.preset = "llama-3.2-1b", .dtype = TD_F32, .threads = 0,
                      .prompt_tokens = 512, .gen_tokens = 16};
    static const struct option longopts[] = {
        {"model", required_argument, 0, 'm'},    {"preset", required_argument, 0, 'p'},
        {"dtype", required_argument, 0, 'd'},    {"threads", required_argument, 0, 't'},
        {"prompt-tokens", required_argument, 0, 'P'}, {"gen-tokens", required_argument, 0, 'g'},
        {"json", no_argument, 0, 'j'},           {"help", no_argument, 0, 'h'},
        {"device", required_argument, 0, 'D'},
        {0, 0, 0, 0},
    };
    int64_t v;
    optind = 1;
    for (int ch; (ch = getopt_long(argc, argv, "", longopts, NULL)) != -1;) {
        switch (ch) {
        case 'm': o.model = optarg; break;
        case 'p': o.preset = optarg; break;
        case 'd':
            if (td_dtype_parse_flag(optarg, &o.dtype) != TD_OK)
                return 2;
            break;
        case 't':
            if (td_parse_i64(optarg, 1, 1024, "--threads", &v) != TD_OK)
                return 2;
            o.threads = (int)v;
            break;
        case 'P':
            if (td_parse_i64(optarg, 1, 1 << 16, "--prompt-tokens", &v) != TD_OK)
                return 2;
            o.prompt_tokens = (int)v;
            break;
        case 'g':
            if (td_parse_i64(optarg, 1, 1 << 16, "--gen-tokens", &v) != TD_OK)
                return 2;
            o.gen_tokens = (int)v;
            break;
        case 'D':
            if (td_device_parse(optarg, &o.device) != TD_OK)
                return 2;
            break;
        case 'j': o.json = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (o.threads <= 0)
        o.threads = td_cpu_count();

    char dir[4096];
    td_model_t *model = NULL;
    td_backend_t *be = NULL;
    td_engine_t *eng = NULL;
    td_pool_t *pool = NULL;
    int rc = 1;
    if (td_backend_open(&o.device, o.threads, o.dtype, &be) != TD_OK ||
        ensure_model(&o, dir, sizeof dir) != TD_OK || td_model_load(dir, &model) != TD_OK)
        goto out;
    const td_model_config_t *c = &model->config;
    /* ceilings: bandwidth and GEMM FLOP/s on the device the engine runs on */
    double bw = 0, sgemm = 0;
    if (o.device.cuda) {
        if (bench_copy_bandwidth(be, (size_t)1 << 30, 10, &bw) != TD_OK ||
            bench_matmul_flops(be, o.prompt_tokens, c->hidden_dim, c->dim, o.dtype, 10, &sgemm) != TD_OK)
            goto out;
    } else {
        if (td_pool_create(o.threads, &pool) != TD_OK)
            goto out;
        bw = measure_read_bw(pool);
        td_pool_destroy(pool);
        pool = NULL;
        sgemm = measure_sgemm(o.threads, o.prompt_tokens, c->hidden_dim, c->dim);
    }
    const char *bw_name = o.device.cuda ? "device copy bandwidth" : "read bandwidth";
    const char *gemm_name = o.device.cuda ? "cuBLAS gemm" : "OpenBLAS sgemm";

    const int batches[] = {1, 8, 32, 64};
    td_engine_config_t ec = td_engine_config_default();
    if (o.device.cuda)
        ec.kv_dtype = o.dtype;
    ec.n_blocks = 64 * TD_DIV_CEIL(64 + o.gen_tokens + 1, ec.block_size) +
                  TD_DIV_CEIL(o.prompt_tokens + o.gen_tokens + 1, ec.block_size) + 8;
    ec.max_batch_tokens = TD_MAX(o.prompt_tokens, 64);
    ec.prefix_cache = false;
    if (td_engine_create(model, be, &ec, &eng) != TD_OK)
        goto out;

    /* prefill at the prompt length, best of 3 */
    double pre_s = 1e30, dec_s = 0, p = 0, d = 0;
    for (int rep = 0; rep < 3; rep++) {
        if (run_batch(eng, 1, o.prompt_tokens, 1, &p, &d) != TD_OK)
            goto out;
        pre_s = TD_MIN(pre_s, p);
    }
    double prefill_tps = o.prompt_tokens / pre_s;
    double prefill_flops = forward_flops(c, o.prompt_tokens, 0) / pre_s;

    /* batch-1 decode after a 64-token prompt */
    if (run_batch(eng, 1, 64, o.gen_tokens, &p, &dec_s) != TD_OK)
        goto out;
    double decode_tps = o.gen_tokens / dec_s;
    size_t kv_tok = 2 * (size_t)c->n_layers * c->n_kv_heads * c->head_dim * td_dtype_size(ec.kv_dtype);
    double bytes_per_token = (double)td_engine_weight_bytes(eng) + kv_tok * (64 + o.gen_tokens / 2.0);
    double decode_ratio = decode_tps * bytes_per_token / bw;

    double batch_tps[4];
    for (int b = 0; b < 4; b++) {
        if (run_batch(eng, batches[b], BATCH_PROMPT, o.gen_tokens, &p, &d) != TD_OK)
            goto out;
        batch_tps[b] = batches[b] * o.gen_tokens / d;
    }

    if (o.json) {
        printf("{\"model\": \"%s\", \"device\": \"%s\", \"threads\": %d, \"weight_bytes\": %zu, "
               "\"read_bw_gbytes_per_s\": %.3f, \"sgemm_gflops\": %.2f, "
               "\"decode_b1_tokens_per_s\": %.3f, \"decode_b1_bytes_per_token\": %.0f, "
               "\"decode_b1_bw_ratio\": %.3f, \"prefill_tokens\": %d, "
               "\"prefill_tokens_per_s\": %.2f, \"prefill_gflops\": %.2f, "
               "\"prefill_sgemm_ratio\": %.3f, \"batched_decode_tokens_per_s\": "
               "{\"1\": %.2f, \"8\": %.2f, \"32\": %.2f, \"64\": %.2f}}\n",
               dir, be->ops->name, o.threads, td_engine_weight_bytes(eng), bw * 1e-9, sgemm * 1e-9, decode_tps,
               bytes_per_token, decode_ratio, o.prompt_tokens, prefill_tps, prefill_flops * 1e-9,
               prefill_flops / sgemm, batch_tps[0], batch_tps[1], batch_tps[2], batch_tps[3]);
    } else {
        printf("model          %s (%s, %.2f GB of weights streamed per step, %s)\n", dir,
               c->arch_name, (double)td_engine_weight_bytes(eng) * 1e-9, be->ops->name);
        printf("ceilings       %s %.2f GB/s, %s %.1f GFLOP/s (%dx%dx%d)\n", bw_name, bw * 1e-9,
               gemm_name, sgemm * 1e-9, o.prompt_tokens, c->hidden_dim, c->dim);
        printf("decode b=1     %.2f tokens/s x %.1f MB/token = %.2f GB/s = %.2f of %s\n", decode_tps,
               bytes_per_token * 1e-6, decode_tps * bytes_per_token * 1e-9, decode_ratio, bw_name);
        printf("prefill %4d   %.1f tokens/s = %.1f GFLOP/s = %.2f of %s\n", o.prompt_tokens,
               prefill_tps, prefill_flops * 1e-9, prefill_flops / sgemm, gemm_name);
        printf("batched decode");
        for (int b = 0; b < 4; b++)
            printf("  b=%d %.1f tok/s", batches[b], batch_tps[b]);
        printf("\n");
    }
    rc = 0;
out:
    if (rc && !td_last_error()[0])
        fprintf(stderr, "tandem bench engine: failed\n"); /* decided errors were logged where decided */
    td_engine_destroy(eng);
    td_backend_destroy(be);
    td_pool_destroy(pool);
    td_model_destroy(model);
    return rc;
}
