/*
 * cmd_perplexity: `tandem perplexity`, a model's perplexity on a text file, computed exactly
 * as llama.cpp's llama-perplexity computes it, so the figures compare directly:
 *
 *   - the whole file is tokenized once (BOS first when the tokenizer adds one; special
 *     tokens' text taken as text);
 *   - it is cut into chunks of n_ctx tokens (as many as fit, or --chunks), each evaluated in
 *     a fresh context (a new sequence: no KV shared between chunks), in batches of n_batch
 *     tokens, the chunk's first token replaced by BOS when the tokenizer adds one;
 *   - only the second half of each chunk is scored, so every scored token has at least
 *     n_ctx/2 tokens of context: positions first = n_ctx/2 .. n_ctx-2 predict the tokens
 *     first+1 .. n_ctx-1, n_ctx - first - 1 tokens a chunk;
 *   - each token's negative log-likelihood is -(logit[tok] - max - log(sum_v exp(logit[v] -
 *     max))), the sum in double over expf of the float differences;
 *   - PPL = exp(mean nll), printed after each chunk as [k]PPL, and at the end with its error
 *     PPL * sqrt((mean nll^2 - mean nll^2) / (count - 1)):
 *     "Final estimate: PPL = X +/- Y".
 *
 * Progress: the running estimates go to stdout as they come (the machine-readable line); stderr
 * gets one line per chunk when it is not a terminal (a log: chunk k of n, its estimate, the time
 * left), or that line rewritten in place when it is a terminal and stdout is not (on a
 * terminal stdout's [k]x, already shows it).
 *
 * llama.cpp evaluates several chunks in one batch when n_batch is a multiple of n_ctx; the
 * result is the same chunk by chunk, which is what this does (--batch is at most --ctx).
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_gen.h"
#include "td_cli.h"
#include "td_log.h"
#include "td_progress.h"
#include "td_util.h"

/* the largest text file read whole (wikitext-2's test set is 1.3 MB) */
#define PPL_MAX_FILE ((size_t)1 << 30)

typedef struct ppl_opts {
    const char *file;
    int64_t ctx, batch, chunks; /* batch 0: ctx; chunks -1: all */
} ppl_opts_t;

/* Chunk k (1-based) of n is done: the progress line on stderr, as the file's header says. */
static void ppl_progress(td_progress_t *p, int64_t k, int64_t n, double ppl)
{
    if (p->tty && isatty(STDOUT_FILENO))
        return; /* stdout's [k]x, on the same terminal is the progress */
    double per = td_progress_elapsed(p) / (double)k;
    td_progress_update(p, k == n, "chunk %" PRId64 "/%" PRId64 ", [%" PRId64 "]%.4lf, %.2f s/chunk, ETA %.0f s", k, n,
                       k, ppl, per, per * (double)(n - k));
}

static int parse_opts(int argc, char **argv, cli_gen_opts_t *o, ppl_opts_t *p)
{
    td_dtype_t dtype = TD_F32;
    const td_opt_t opts[] = {
        {.name = "model", .type = TD_OPT_STR, .ptr = &o->model, .arg = "PATH",
         .help = "GGUF file, llama2.c checkpoint (.bin) or Hugging Face model directory"},
        {.name = "tokenizer", .type = TD_OPT_STR, .ptr = &o->tokenizer, .arg = "PATH",
         .help = "tokenizer.bin / tokenizer.json / directory (default: the model's)"},
        {.name = "file", .type = TD_OPT_STR, .ptr = &p->file, .arg = "TEXT",
         .help = "the text to score (at least 2 x --ctx tokens)"},
        {.name = "ctx", .type = TD_OPT_I64, .ptr = &p->ctx, .min = 4, .max = 1 << 20, .arg = "N",
         .help = "tokens per chunk, each a fresh context (default 512, llama-perplexity's)"},
        {.name = "batch", .type = TD_OPT_I64, .ptr = &p->batch, .min = 1, .max = 1 << 20, .arg = "N",
         .help = "tokens per forward step (default and at most: --ctx)"},
        {.name = "chunks", .type = TD_OPT_I64, .ptr = &p->chunks, .min = 1, .max = INT32_MAX, .arg = "K",
         .help = "score the first K chunks only (default: every whole chunk)"},
        {.name = "threads", .type = TD_OPT_I64, .ptr = &o->threads, .min = 1, .max = 4096, .arg = "N",
         .help = "compute threads (default: all cores)"},
        {.name = "device", .type = TD_OPT_FN, .ptr = &o->device, .parse = cli_opt_device, .arg = "D",
         .help = "cpu (default), cuda (GPU 0) or cuda:N"},
        {.name = "dtype", .type = TD_OPT_FN, .ptr = &dtype, .parse = cli_opt_dtype, .arg = "T",
         .help = "f32|f16|bf16: weights and KV cache in T (as generate --dtype)"},
        {.name = "quant", .type = TD_OPT_FN, .ptr = &o->quant, .parse = cli_opt_quant, .arg = "Q",
         .help = "q8_0|q4_0: quantize the float weight matrices to Q at load"},
        {.name = "kv-dtype", .type = TD_OPT_FN, .ptr = &o->kv_dtype, .parse = cli_opt_kv_dtype, .arg = "T",
         .help = "f32|f16|bf16|q8_0: the KV cache in T (default: as --dtype; q8_0: blocks of 32\n"
                 "with an f16 scale, half of f16's memory, llama.cpp's -ctk/-ctv q8_0)"},
        {.name = "log-level", .type = TD_OPT_FN, .parse = cli_gen_parse_log_level, .arg = "L",
         .help = "error|warn|info|debug"},
    };
    enum { N_OPTS = TD_ARRAY_LEN(opts), OPT_BATCH = 4, OPT_DTYPE = 8 };
    int given[N_OPTS] = {0};
    td_opts_t spec = {.prog = "perplexity", .opts = opts, .n_opts = N_OPTS};
    td_opts_result_t r = {.given = given};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help) {
        printf("usage: tandem perplexity --model PATH --file TEXT [--ctx N] [--batch N] [--chunks K]\n"
               "                         [--tokenizer PATH] [--threads N] [--device D] [--dtype T]\n"
               "                         [--quant q8_0|q4_0] [--kv-dtype T]\n\n");
        td_opts_usage(stdout, opts, N_OPTS, false);
        printf("\n"
               "llama-perplexity's method and output (docs/chat.md): chunks of --ctx tokens, each a\n"
               "fresh context starting with BOS where the model adds one, the second half of each\n"
               "scored. Prints the running estimate after each chunk, [1]x,[2]y,..., then\n"
               "\"Final estimate: PPL = X +/- Y\" on stdout; timings and per-chunk progress on stderr.\n"
               "Exit status: 0 done, 1 failed (a file too short for two chunks says how many tokens\n"
               "it has), 2 usage error.\n");
        return 0;
    }
    TD_ASSERT(!strcmp(opts[OPT_BATCH].name, "batch") && !strcmp(opts[OPT_DTYPE].name, "dtype"));
    if (given[OPT_DTYPE])
        o->dtype = (int)dtype;
    if (!o->model || !p->file) {
        fprintf(stderr, "tandem perplexity: give --model PATH and --file TEXT\n");
        return 2;
    }
    if (p->ctx % 2) {
        fprintf(stderr, "tandem perplexity: --ctx %" PRId64 " is odd; the second half of each chunk is scored: "
                        "give an even N\n", p->ctx);
        return 2;
    }
    /* llama-perplexity's n_batch = min(n_batch, n_ctx) */
    if (!given[OPT_BATCH] || p->batch > p->ctx)
        p->batch = p->ctx;
    return -1;
}

/* The negative log-likelihood of tok under one row of logits, as llama.cpp computes it:
 * max in float, the sum of expf of the float differences in double. */
static double token_nll(const float *logits, int32_t n_vocab, int32_t tok)
{
    float max = logits[0];
    for (int32_t i = 1; i < n_vocab; i++)
        max = fmaxf(max, logits[i]);
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; i++)
        sum += expf(logits[i] - max);
    return -((double)(logits[tok] - max) - log(sum));
}

/* Evaluates one chunk tokens[0..n_ctx) in a fresh sequence and adds the nll of its scored
 * tokens to *nll, their squares to *nll2. logits holds (n_ctx - first) rows. */
static td_status_t eval_chunk(cli_gen_t *g, const int32_t *chunk, int32_t n_ctx, int32_t n_batch, int32_t first,
                              float *logits, double *nll, double *nll2)
{
    const td_model_config_t *c = &g->model->config;
    int32_t *batch = malloc((size_t)n_batch * sizeof *batch);
    if (!batch)
        return td_errorf(TD_ERR_NOMEM, "out of memory");
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    td_status_t st = TD_OK;
    for (int32_t pos = 0; pos < n_ctx && st == TD_OK; pos += n_batch) {
        int32_t n = TD_MIN(n_batch, n_ctx - pos);
        memcpy(batch, chunk + pos, (size_t)n * sizeof *batch);
        if (pos == 0 && g->add_bos)
            batch[0] = c->bos_id;
        /* logits of the positions >= first: a suffix of the batch */
        int32_t from = TD_MAX(pos, first);
        int32_t n_logits = TD_MAX(0, pos + n - from);
        td_engine_item_t it = {.seq = &seq, .tokens = batch, .n_tokens = n, .n_logits = n_logits};
        st = td_engine_step(g->eng, &it, 1,
                            n_logits ? logits + (size_t)(from - first) * (size_t)c->vocab_size : NULL);
    }
    td_engine_seq_end(g->eng, &seq);
    free(batch);
    if (st != TD_OK)
        return st;
    /* position first + i predicts token first + i + 1 */
    for (int32_t i = 0; i < n_ctx - first - 1; i++) {
        double v = token_nll(logits + (size_t)i * (size_t)c->vocab_size, c->vocab_size, chunk[first + i + 1]);
        *nll += v;
        *nll2 += v * v;
    }
    return TD_OK;
}

int cmd_perplexity(int argc, char **argv)
{
    cli_gen_opts_t o = cli_gen_opts_default();
    ppl_opts_t p = {.ctx = 512, .chunks = -1};
    int rc = parse_opts(argc, argv, &o, &p);
    if (rc >= 0)
        return rc;
    rc = 1;
    cli_gen_t g = {0};
    char *text = NULL;
    size_t text_len = 0, n_tokens = 0;
    int32_t *tokens = NULL;
    float *logits = NULL;
    td_status_t st;

    if ((st = cli_gen_open(&g, &o, true)) != TD_OK || (st = td_file_read_all(p.file, PPL_MAX_FILE, &text, &text_len)))
        goto out;
    const td_model_config_t *c = &g.model->config;
    if (g.add_bos && c->bos_id < 0) {
        td_errorf(TD_ERR_INVALID, "%s: the tokenizer adds BOS but the model has no BOS id", o.model);
        goto out;
    }
    if (p.ctx > c->max_seq_len) {
        td_errorf(TD_ERR_RANGE, "--ctx %" PRId64 " is more than the model's length %d: give --ctx %d or less", p.ctx,
                  c->max_seq_len, c->max_seq_len);
        goto out;
    }
    uint64_t t0 = td_now_ns();
    /* llama-perplexity's common_tokenize(ctx, text, add_special = true, parse_special = false):
     * text that looks like a special token is text */
    unsigned flags = TD_TOK_NO_PARSE_SPECIAL | (g.add_bos ? TD_TOK_ADD_BOS : 0);
    if ((st = td_tokenizer_encode(g.tok, text, text_len, flags, &tokens, &n_tokens)))
        goto out;
    double t_tok = (double)(td_now_ns() - t0) * 1e-9;
    if (n_tokens < 2 * (size_t)p.ctx) {
        td_errorf(TD_ERR_RANGE, "%s tokenizes to %zu tokens; a context of %" PRId64 " needs at least %" PRId64
                  " (two chunks): give a longer file or a smaller --ctx", p.file, n_tokens, p.ctx, 2 * p.ctx);
        goto out;
    }
    for (size_t i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size) {
            td_errorf(TD_ERR_RANGE, "%s: token %d is outside the model's vocabulary [0, %d): the tokenizer does "
                      "not belong to the model", p.file, tokens[i], c->vocab_size);
            goto out;
        }
    int32_t n_ctx = (int32_t)p.ctx, n_batch = (int32_t)p.batch, first = n_ctx / 2;
    int64_t n_chunk = (int64_t)(n_tokens / (size_t)n_ctx);
    if (p.chunks > 0)
        n_chunk = TD_MIN(n_chunk, p.chunks);

    td_engine_config_t ec = td_engine_config_default();
    ec.max_batch_tokens = n_batch;
    ec.max_seqs = 1;
    ec.max_logit_rows = n_batch;
    ec.prefix_cache = false;
    if ((st = cli_gen_start_engine(&g, &o, &ec, n_ctx)) != TD_OK)
        goto out;
    logits = malloc((size_t)(n_ctx - first) * (size_t)c->vocab_size * sizeof *logits);
    if (!logits) {
        td_errorf(TD_ERR_NOMEM, "out of memory: %d rows of %d logits", n_ctx - first, c->vocab_size);
        goto out;
    }
    fprintf(stderr,
            "perplexity: %zu tokens (tokenized in %.2f s), %" PRId64 " chunks of %d tokens, batch %d, "
            "scoring the last %d of each\n",
            n_tokens, t_tok, n_chunk, n_ctx, n_batch, n_ctx - first - 1);
    double nll = 0.0, nll2 = 0.0;
    int64_t count = 0;
    td_progress_t prog;
    td_progress_init(&prog, "perplexity", 0, 0); /* a log: a line per chunk */
    t0 = td_now_ns();
    for (int64_t k = 0; k < n_chunk; k++) {
        if ((st = eval_chunk(&g, tokens + k * n_ctx, n_ctx, n_batch, first, logits, &nll, &nll2)) != TD_OK)
            goto out;
        count += n_ctx - first - 1;
        printf("[%" PRId64 "]%.4lf,", k + 1, exp(nll / (double)count));
        fflush(stdout);
        ppl_progress(&prog, k + 1, n_chunk, exp(nll / (double)count));
    }
    printf("\n");
    double secs = (double)(td_now_ns() - t0) * 1e-9;
    nll2 /= (double)count;
    nll /= (double)count;
    double ppl = exp(nll);
    nll2 -= nll * nll;
    if (nll2 > 0) {
        nll2 = sqrt(nll2 / (double)(count - 1));
        printf("Final estimate: PPL = %.4lf +/- %.5lf\n", ppl, nll2 * ppl);
    } else {
        /* every scored token equally likely: no spread to estimate (llama.cpp says the same) */
        printf("Final estimate: PPL = %.4lf\n", ppl);
        td_warn("perplexity: no spread in the log-likelihoods: the error cannot be estimated");
    }
    fprintf(stderr, "perplexity: %" PRId64 " chunks in %.2f s, %.1f tokens/s\n", n_chunk, secs,
            (double)(n_chunk * n_ctx) / secs);
    rc = 0;
out:
    if (rc && !td_last_error()[0])
        fprintf(stderr, "tandem perplexity: failed\n");
    free(logits);
    free(tokens);
    free(text);
    cli_gen_close(&g);
    return rc;
}
