/*
 * test_engine: the engine on the real stories260K checkpoint against a straightforward
 * reference forward pass written here (llama2.c's run.c in double precision: the file
 * read with fread, one token at a time, a contiguous KV cache, no paging, no tiles), and
 * the engine's invariances: the same greedy tokens alone or in a batch of 32, prefilled in
 * one chunk or in many, with or without the prefix cache.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_backend.h"
#include "td_engine.h"
#include "td_model.h"
#include "td_test_models.h"

/* ---- the reference: run.c in double ------------------------------------------------ */

typedef struct ref_model {
    int dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len, head_size, kv_dim;
    float *data;  /* the whole file after the header */
    float *emb, *rms_att, *wq, *wk, *wv, *wo, *rms_ffn, *w1, *w2, *w3, *rms_final, *wcls;
    double *k_cache, *v_cache; /* [layer][seq_len][kv_dim] */
    int window;                /* sliding window of the layers in window_layers (0: none) */
    unsigned window_layers;    /* bit l: layer l slides */
} ref_model_t;

static void ref_load(ref_model_t *r)
{
    *r = (ref_model_t){0}; /* no sliding window unless a test sets one */
    FILE *f = fopen(td_test_stories_path(), "rb");
    cr_assert(f);
    int hdr[7];
    cr_assert_eq(fread(hdr, sizeof(int), 7, f), 7);
    r->dim = hdr[0], r->hidden = hdr[1], r->n_layers = hdr[2], r->n_heads = hdr[3];
    r->n_kv_heads = hdr[4], r->vocab = abs(hdr[5]), r->seq_len = hdr[6];
    r->head_size = r->dim / r->n_heads;
    r->kv_dim = r->n_kv_heads * r->head_size;
    fseek(f, 0, SEEK_END);
    long size = ftell(f) - 7 * (long)sizeof(int);
    fseek(f, 7 * sizeof(int), SEEK_SET);
    r->data = malloc((size_t)size);
    cr_assert_eq(fread(r->data, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    float *p = r->data;
    int L = r->n_layers, d = r->dim, hd = r->head_size;
    r->emb = p, p += (size_t)r->vocab * d;
    r->rms_att = p, p += (size_t)L * d;
    r->wq = p, p += (size_t)L * d * (r->n_heads * hd);
    r->wk = p, p += (size_t)L * d * r->kv_dim;
    r->wv = p, p += (size_t)L * d * r->kv_dim;
    r->wo = p, p += (size_t)L * (r->n_heads * hd) * d;
    r->rms_ffn = p, p += (size_t)L * d;
    r->w1 = p, p += (size_t)L * d * r->hidden;
    r->w2 = p, p += (size_t)L * r->hidden * d;
    r->w3 = p, p += (size_t)L * d * r->hidden;
    r->rms_final = p, p += d;
    p += (size_t)r->seq_len * hd / 2 * 2; /* freq_cis_real, freq_cis_imag */
    r->wcls = hdr[5] > 0 ? r->emb : p;
    r->k_cache = calloc((size_t)L * r->seq_len * r->kv_dim, sizeof(double));
    r->v_cache = calloc((size_t)L * r->seq_len * r->kv_dim, sizeof(double));
}

static void ref_free(ref_model_t *r)
{
    free(r->data);
    free(r->k_cache);
    free(r->v_cache);
}

static void rmsnorm_d(double *o, const double *x, const float *w, int n)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    ss = 1.0 / sqrt(ss / n + 1e-5);
    for (int i = 0; i < n; i++)
        o[i] = w[i] * (ss * x[i]);
}

static void matmul_d(double *o, const double *x, const float *w, int n, int d)
{
    for (int i = 0; i < d; i++) {
        double v = 0;
        for (int j = 0; j < n; j++)
            v += (double)w[(size_t)i * n + j] * x[j];
        o[i] = v;
    }
}

/* logits of `token` at `pos` (all earlier positions already run) */
static void ref_forward(ref_model_t *r, int token, int pos, double *logits)
{
    int d = r->dim, hd = r->head_size, kvd = r->kv_dim, kv_mul = r->n_heads / r->n_kv_heads;
    double *x = calloc((size_t)d, sizeof(double)), *xb = calloc((size_t)d, sizeof(double));
    double *xb2 = calloc((size_t)d, sizeof(double)), *q = calloc((size_t)d, sizeof(double));
    double *hb = calloc((size_t)r->hidden, sizeof(double)), *hb2 = calloc((size_t)r->hidden, sizeof(double));
    double *att = calloc((size_t)r->seq_len, sizeof(double));
    for (int i = 0; i < d; i++)
        x[i] = r->emb[(size_t)token * d + i];
    for (int l = 0; l < r->n_layers; l++) {
        rmsnorm_d(xb, x, r->rms_att + (size_t)l * d, d);
        double *k = r->k_cache + ((size_t)l * r->seq_len + pos) * kvd;
        double *v = r->v_cache + ((size_t)l * r->seq_len + pos) * kvd;
        matmul_d(q, xb, r->wq + (size_t)l * d * d, d, d);
        matmul_d(k, xb, r->wk + (size_t)l * d * kvd, d, kvd);
        matmul_d(v, xb, r->wv + (size_t)l * d * kvd, d, kvd);
        for (int i = 0; i < d; i += 2) {
            int head_dim = i % hd;
            double freq = 1.0 / pow(10000.0, head_dim / (double)hd);
            double val = pos * freq, fcr = cos(val), fci = sin(val);
            for (int t = 0; t < (i < kvd ? 2 : 1); t++) {
                double *vec = t == 0 ? q : k;
                double v0 = vec[i], v1 = vec[i + 1];
                vec[i] = v0 * fcr - v1 * fci;
                vec[i + 1] = v0 * fci + v1 * fcr;
            }
        }
        /* a sliding layer attends to positions (pos - window, pos] */
        int t0 = r->window > 0 && (r->window_layers >> l) & 1 ? fmax(0, pos - r->window + 1) : 0;
        for (int h = 0; h < r->n_heads; h++) {
            double *qh = q + h * hd, mx = -INFINITY, sum = 0;
            for (int t = t0; t <= pos; t++) {
                double *kt = r->k_cache + ((size_t)l * r->seq_len + t) * kvd + (h / kv_mul) * hd;
                double s = 0;
                for (int i = 0; i < hd; i++)
                    s += qh[i] * kt[i];
                att[t] = s / sqrt((double)hd);
                mx = fmax(mx, att[t]);
            }
            for (int t = t0; t <= pos; t++)
                sum += att[t] = exp(att[t] - mx);
            double *o = xb + h * hd;
            memset(o, 0, (size_t)hd * sizeof(double));
            for (int t = t0; t <= pos; t++) {
                double *vt = r->v_cache + ((size_t)l * r->seq_len + t) * kvd + (h / kv_mul) * hd;
                for (int i = 0; i < hd; i++)
                    o[i] += att[t] / sum * vt[i];
            }
        }
        matmul_d(xb2, xb, r->wo + (size_t)l * d * d, d, d);
        for (int i = 0; i < d; i++)
            x[i] += xb2[i];
        rmsnorm_d(xb, x, r->rms_ffn + (size_t)l * d, d);
        matmul_d(hb, xb, r->w1 + (size_t)l * d * r->hidden, d, r->hidden);
        matmul_d(hb2, xb, r->w3 + (size_t)l * d * r->hidden, d, r->hidden);
        for (int i = 0; i < r->hidden; i++)
            hb[i] = hb[i] / (1.0 + exp(-hb[i])) * hb2[i];
        matmul_d(xb, hb, r->w2 + (size_t)l * d * r->hidden, r->hidden, d);
        for (int i = 0; i < d; i++)
            x[i] += xb[i];
    }
    rmsnorm_d(x, x, r->rms_final, d);
    matmul_d(logits, x, r->wcls, d, r->vocab);
    free(x), free(xb), free(xb2), free(q), free(hb), free(hb2), free(att);
}

static int argmax_d(const double *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

/* Greedy continuation of prompt up to `total` tokens with the reference; returns the
 * generated ids in out[0 .. total - n_prompt) and the smallest top-1/top-2 logit gap. */
static double ref_greedy(ref_model_t *r, const int *prompt, int n_prompt, int total, int *out)
{
    double *logits = malloc((size_t)r->vocab * sizeof(double));
    double min_gap = INFINITY;
    int tok = prompt[0];
    for (int pos = 0; pos < total - 1; pos++) {
        ref_forward(r, tok, pos, logits);
        if (pos + 1 < n_prompt) {
            tok = prompt[pos + 1];
            continue;
        }
        int best = argmax_d(logits, r->vocab);
        double second = -INFINITY;
        for (int i = 0; i < r->vocab; i++)
            if (i != best && logits[i] > second)
                second = logits[i];
        min_gap = fmin(min_gap, logits[best] - second);
        out[pos + 1 - n_prompt] = tok = best;
    }
    free(logits);
    return min_gap;
}

/* ---- the engine side --------------------------------------------------------------- */

/* Under ASan (gcc's __SANITIZE_ADDRESS__: the -O0 sanitizer build) the reference and the
 * engine run ~50x slower: these two tests take shorter sequences and fewer of them there
 * (140 s each otherwise), the release build checks the whole length. */
#ifdef __SANITIZE_ADDRESS__
#define ENGINE_TEST_LEN 160
#define ENGINE_TEST_SEQS 12
#else
#define ENGINE_TEST_LEN 512
#define ENGINE_TEST_SEQS 32
#endif

Test(engine, greedy_matches_reference_to_512_tokens, .timeout = 300)
{
    td_test_skip_without_stories();
    ref_model_t r;
    ref_load(&r);
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 2048, false);
    unsigned s = 42;
    const int lens[] = {1, 5, 17, 100};
    for (size_t p = 0; p < sizeof lens / sizeof lens[0]; p++) {
        int *prompt = td_test_random_prompt(&s, lens[p]);
        int total = r.seq_len < ENGINE_TEST_LEN ? r.seq_len : ENGINE_TEST_LEN;
        int *want = malloc((size_t)total * sizeof(int)), *got = malloc((size_t)total * sizeof(int));
        double gap = ref_greedy(&r, prompt, lens[p], total, want);
        td_test_engine_greedy(&fx, 1, &prompt, &lens[p], &total, 64, &got, NULL);
        for (int i = 0; i < total - lens[p]; i++)
            cr_assert_eq(got[i], want[i],
                         "prompt of %d tokens: generated token %d is %d, reference %d "
                         "(reference's smallest top-2 gap %g)", lens[p], i, got[i], want[i], gap);
        free(prompt), free(want), free(got);
    }
    td_test_engine_close(&fx);
    ref_free(&r);
}

/* the same 32 sequences alone, in one batch, in chunks of 1/7/64, with prefix cache */
Test(engine, batch_and_chunk_invariance, .timeout = 300)
{
    td_test_skip_without_stories();
    enum { N = ENGINE_TEST_SEQS };
    unsigned s = 7;
    int *prompts[N], n_prompt[N], total[N], *alone[N], *got[N];
    for (int i = 0; i < N; i++) {
        n_prompt[i] = 1 + (int)(td_test_rng_next(&s) % 120);
        prompts[i] = td_test_random_prompt(&s, n_prompt[i]);
        total[i] = n_prompt[i] + 24 + (int)(td_test_rng_next(&s) % 40);
        alone[i] = malloc(512 * sizeof(int));
        got[i] = malloc(512 * sizeof(int));
    }
    uint64_t *h_alone[N], *h_got[N];
    for (int i = 0; i < N; i++) {
        h_alone[i] = malloc(512 * sizeof(uint64_t));
        h_got[i] = malloc(512 * sizeof(uint64_t));
    }
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 2048, false);
    for (int i = 0; i < N; i++)
        td_test_engine_greedy(&fx, 1, &prompts[i], &n_prompt[i], &total[i], 4096, &alone[i], &h_alone[i]);
    td_test_engine_close(&fx);
    /* Batch invariance, bit for bit: with whole prompts (each sequence's prefill computes
     * the same rows either way) every logits row of a sequence run in a batch of 32 equals
     * the one it gets alone, with 1 thread or 2; decode steps batch 1..32 sequences
     * (docs/kernels.md "Batch invariance"). */
    for (int threads = 1; threads <= 2; threads++) {
        td_test_engine_open_cpu(&fx, threads, 2048, false);
        td_test_engine_greedy(&fx, N, prompts, n_prompt, total, 4096, got, h_got);
        for (int i = 0; i < N; i++)
            for (int t = 0; t < total[i] - n_prompt[i]; t++)
                cr_assert_eq(h_got[i][t], h_alone[i][t],
                             "%d threads: sequence %d token %d: its logits in a batch of %d differ from alone", threads,
                             i, t, N);
        td_test_engine_close(&fx);
    }
    /* Split invariance, bit for bit: a prompt prefilled in pieces of 8 (the engine runs a
     * one-row step with the decode kernel, so pieces of two rows at least) gives the same
     * logits as prefilled whole. */
    td_test_engine_open_cpu(&fx, 1, 2048, false);
    int n_split = 0;
    for (int i = 0; i < N; i++) {
        if (n_prompt[i] <= 8 || n_prompt[i] % 8 == 1)
            continue;
        n_split++;
        td_test_engine_greedy(&fx, 1, &prompts[i], &n_prompt[i], &total[i], 8, &got[i], &h_got[i]);
        for (int t = 0; t < total[i] - n_prompt[i]; t++)
            cr_assert_eq(h_got[i][t], h_alone[i][t],
                         "sequence %d (%d prompt tokens) token %d: prefilled in pieces of 8, its logits differ from "
                         "prefilled whole", i, n_prompt[i], t);
    }
    cr_assert_gt(n_split, N / 4, "too few prompts to split: %d", n_split);
    td_test_engine_close(&fx);
    for (int i = 0; i < N; i++)
        free(h_alone[i]), free(h_got[i]);
    td_test_engine_open_cpu(&fx, 1, 2048, false);
    const int chunks[] = {4096, 1, 7, 64};
    for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
        td_test_engine_greedy(&fx, N, prompts, n_prompt, total, chunks[c], got, NULL);
        for (int i = 0; i < N; i++)
            for (int t = 0; t < total[i] - n_prompt[i]; t++)
                cr_assert_eq(got[i][t], alone[i][t],
                             "chunk %d: sequence %d token %d: batched %d, alone %d", chunks[c], i,
                             t, got[i][t], alone[i][t]);
    }
    td_test_engine_close(&fx);

    /* prefix cache on: shared prompt prefixes are reused and results do not change */
    td_test_engine_open_cpu(&fx, 1, 2048, true);
    for (int round = 0; round < 2; round++) {
        td_test_engine_greedy(&fx, N, prompts, n_prompt, total, 64, got, NULL);
        for (int i = 0; i < N; i++)
            for (int t = 0; t < total[i] - n_prompt[i]; t++)
                cr_assert_eq(got[i][t], alone[i][t], "prefix cache round %d: sequence %d token %d",
                             round, i, t);
    }
    td_kv_stats_t st;
    td_kv_get_stats(td_engine_kv(fx.eng), &st);
    cr_assert_gt(st.prefix_hits, 0, "second round found no cached prefix block");
    td_test_engine_close(&fx);
    for (int i = 0; i < N; i++)
        free(prompts[i]), free(alone[i]), free(got[i]);
}

/* A prompt computed again after its blocks were cached gives the same logits bits: the
 * cached prefix never leaves a one-row piece (which would run the decode kernel), so a
 * 17-token prompt is computed whole again and a 33-token one from token 16 on. */
Test(engine, cached_prefix_leaves_two_rows_and_the_same_logits, .timeout = 60)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_test_engine_open_cpu(&fx, 1, 256, true);
    int32_t p[33];
    for (int i = 0; i < 33; i++)
        p[i] = i ? 20 + 7 * i : 1;
    float *a = malloc((size_t)fx.vocab * sizeof(float)), *b = malloc((size_t)fx.vocab * sizeof(float));
    const int32_t lens[] = {17, 33, 18, 32};
    const int32_t want_cached[] = {0, 16, 16, 16};
    for (int k = 0; k < 4; k++) {
        for (int round = 0; round < 2; round++) {
            td_kv_seq_t seq;
            td_kv_seq_init(&seq);
            int32_t cached = -1;
            cr_assert_eq(td_engine_seq_start(fx.eng, &seq, p, lens[k], &cached), TD_OK);
            if (round)
                cr_assert_eq(cached, want_cached[k], "prompt of %d: %d cached, want %d", lens[k], cached,
                             want_cached[k]);
            td_engine_item_t it = {.seq = &seq, .tokens = p + cached, .n_tokens = lens[k] - cached, .n_logits = 1};
            cr_assert_eq(td_engine_step(fx.eng, &it, 1, round ? b : a), TD_OK);
            td_engine_seq_end(fx.eng, &seq);
        }
        cr_assert(!memcmp(a, b, (size_t)fx.vocab * sizeof(float)), "prompt of %d: other logits after a cached prefix",
                  lens[k]);
    }
    free(a), free(b);
    td_test_engine_close(&fx);
}

Test(engine, exhausted_pool_is_an_error_the_caller_can_act_on, .timeout = 60)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 4; /* 64 tokens */
    ec.prefix_cache = false;
    td_test_engine_open(&fx, 1, &ec);
    td_engine_t *eng = fx.eng;
    int toks[100];
    for (int i = 0; i < 100; i++)
        toks[i] = 1 + i;
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    td_engine_item_t it = {.seq = &seq, .tokens = toks, .n_tokens = 100, .n_logits = 1};
    float *logits = malloc(512 * sizeof(float));
    cr_assert_eq(td_engine_step(eng, &it, 1, logits), TD_ERR_EXHAUSTED);
    cr_assert_eq(seq.n_tokens, 0, "a failed step advanced the sequence");
    it.n_tokens = 60;
    cr_assert_eq(td_engine_step(eng, &it, 1, logits), TD_OK, "%s", td_last_error());
    cr_assert_eq(seq.n_tokens, 60);
    /* bad input: a token outside the vocabulary changes nothing */
    int bad = 512;
    td_engine_item_t it2 = {.seq = &seq, .tokens = &bad, .n_tokens = 1, .n_logits = 1};
    cr_assert_eq(td_engine_step(eng, &it2, 1, logits), TD_ERR_RANGE);
    cr_assert_eq(seq.n_tokens, 60);
    td_engine_seq_end(eng, &seq);
    td_kv_stats_t st;
    td_kv_get_stats(td_engine_kv(eng), &st);
    cr_assert_eq(st.free, 4, "blocks leaked: %d free of 4", st.free);
    free(logits);
    td_test_engine_close(&fx);
}

/* ---- weight dtypes and the CUDA backend ----------------------------------------------- */

/* Rounds every weight of the reference to `dtype` values (the model file is f32). */
static void ref_round_weights(ref_model_t *r, td_dtype_t dtype)
{
    size_t n = (size_t)(r->rms_final + r->dim - r->data);
    uint16_t *tmp = malloc(n * sizeof(uint16_t));
    td_dtype_convert(tmp, dtype, r->data, TD_F32, n);
    td_dtype_convert(r->data, TD_F32, tmp, dtype, n);
    free(tmp);
}

/* weights converted to bf16 at load give what the double reference gives on bf16-rounded
   weights, in half the bytes; an unknown weight dtype is refused */
Test(engine, weights_converted_at_load, .timeout = 300)
{
    td_test_skip_without_stories();
    ref_model_t r;
    ref_load(&r);
    ref_round_weights(&r, TD_BF16);
    td_test_engine_t fx, f32;
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 2048;
    ec.weight_dtype = TD_BF16;
    td_test_engine_open(&fx, 2, &ec);
    ec.weight_dtype = TD_ENGINE_WEIGHTS_AS_STORED;
    td_test_engine_open(&f32, 1, &ec);
    cr_assert_eq(td_engine_weight_bytes(fx.eng) * 2, td_engine_weight_bytes(f32.eng),
                 "bf16 weights take %zu bytes, f32 %zu", td_engine_weight_bytes(fx.eng),
                 td_engine_weight_bytes(f32.eng));
    td_test_engine_close(&f32);
    unsigned s = 3;
    const int lens[] = {1, 17, 100};
    for (size_t p = 0; p < sizeof lens / sizeof lens[0]; p++) {
        int *prompt = td_test_random_prompt(&s, lens[p]);
        int total = lens[p] + 200;
        int *want = malloc(200 * sizeof(int)), *got = malloc(200 * sizeof(int));
        double gap = ref_greedy(&r, prompt, lens[p], total, want);
        td_test_engine_greedy(&fx, 1, &prompt, &lens[p], &total, 64, &got, NULL);
        for (int i = 0; i < 200; i++)
            cr_assert_eq(got[i], want[i],
                         "bf16 weights, prompt of %d tokens: token %d is %d, reference %d (smallest gap %g)",
                         lens[p], i, got[i], want[i], gap);
        free(prompt), free(want), free(got);
    }
    td_engine_t *bad = NULL;
    ec.weight_dtype = 7;
    cr_assert_eq(td_engine_create(fx.model, fx.be, &ec, &bad), TD_ERR_INVALID);
    cr_assert_null(bad);
    td_test_engine_close(&fx);
    ref_free(&r);
}

/* ---- sliding window ------------------------------------------------------------------ */

/* stories260K with a sliding window of `window` tokens on the layers of `layers` (bit l:
   layer l slides), the reference given the same, and an engine of 16-token blocks. */
static void swa_open(td_test_engine_t *fx, ref_model_t *r, int threads, int window, unsigned layers,
                     bool prefix_cache)
{
    td_test_model_open(fx, threads);
    td_model_config_t *c = &fx->model->config;
    td_model_config_set_window(c, window);
    c->swa_layers[0] &= layers;
    if (r) {
        r->window = window;
        r->window_layers = layers;
    }
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 2048;
    ec.prefix_cache = prefix_cache;
    cr_assert_eq(td_engine_create(fx->model, fx->be, &ec, &fx->eng), TD_OK, "%s", td_last_error());
}

#ifdef __SANITIZE_ADDRESS__
#define SWA_TEST_LEN 110
#else
#define SWA_TEST_LEN 220
#endif

/* Greedy tokens far past the window equal the double reference with the same mask, for a
   window on every layer (blocks behind it go back to the pool, counted exactly) and on some
   layers only (nothing can go back: the full layers read everything). */
Test(engine, sliding_window_matches_reference_beyond_the_window, .timeout = 300)
{
    td_test_skip_without_stories();
    static const struct {
        int window;
        unsigned layers;
    } cases[] = {{40, ~0u}, {24, 0x16u}};
    const int lens[] = {5, 60, 100};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        ref_model_t r;
        ref_load(&r);
        td_test_engine_t fx;
        swa_open(&fx, &r, 2, cases[k].window, cases[k].layers, false);
        bool all = cases[k].layers == ~0u;
        cr_assert_eq(td_model_kv_window(&fx.model->config), all ? cases[k].window : 0);
        unsigned s = 99;
        int64_t want_released = 0;
        for (size_t p = 0; p < sizeof lens / sizeof lens[0]; p++) {
            int *prompt = td_test_random_prompt(&s, lens[p]);
            int total = SWA_TEST_LEN;
            int *want = malloc((size_t)total * sizeof(int)), *got = malloc((size_t)total * sizeof(int));
            double gap = ref_greedy(&r, prompt, lens[p], total, want);
            td_test_engine_greedy(&fx, 1, &prompt, &lens[p], &total, 64, &got, NULL);
            for (int i = 0; i < total - lens[p]; i++)
                cr_assert_eq(got[i], want[i],
                             "window %d: prompt of %d tokens: generated token %d is %d, reference %d "
                             "(reference's smallest top-2 gap %g)", cases[k].window, lens[p], i, got[i], want[i],
                             gap);
            /* the last step left total - 1 tokens in the cache; every whole block below
               position total - 1 - window + 1 went back */
            if (all)
                want_released += (total - cases[k].window) / 16;
            free(prompt), free(want), free(got);
        }
        td_kv_stats_t st;
        td_kv_get_stats(td_engine_kv(fx.eng), &st);
        cr_assert_eq((int64_t)st.window_released, want_released, "window %d: %llu blocks released, want %lld",
                     cases[k].window, (unsigned long long)st.window_released, (long long)want_released);
        cr_assert(!all || want_released > 0);
        cr_assert_eq(st.used, 0, "blocks still held after every sequence ended");
        td_test_engine_close(&fx);
        ref_free(&r);
    }
}

/* With a window: the same logits bits alone or batched, prefilled whole or in pieces of 8
   whose windows cross block and piece boundaries, and with prompts taken from the prefix
   cache (blocks behind the window included); greedy tokens the same for chunks of 1 and 7. */
Test(engine, sliding_window_batch_chunk_and_prefix_invariance, .timeout = 300)
{
    td_test_skip_without_stories();
    enum { N = 10 };
    unsigned s = 5;
    int *prompts[N], n_prompt[N], total[N], *alone[N], *got[N];
    uint64_t *h_alone[N], *h_got[N];
    for (int i = 0; i < N; i++) {
        n_prompt[i] = 2 + (int)(td_test_rng_next(&s) % 110);
        prompts[i] = td_test_random_prompt(&s, n_prompt[i]);
        total[i] = n_prompt[i] + 20 + (int)(td_test_rng_next(&s) % 50);
        alone[i] = malloc(256 * sizeof(int)), got[i] = malloc(256 * sizeof(int));
        h_alone[i] = malloc(256 * sizeof(uint64_t)), h_got[i] = malloc(256 * sizeof(uint64_t));
    }
    td_test_engine_t fx;
    swa_open(&fx, NULL, 1, 21, ~0u, false);
    for (int i = 0; i < N; i++)
        td_test_engine_greedy(&fx, 1, &prompts[i], &n_prompt[i], &total[i], 4096, &alone[i], &h_alone[i]);
    td_test_engine_close(&fx);

    swa_open(&fx, NULL, 2, 21, ~0u, false);
    td_test_engine_greedy(&fx, N, prompts, n_prompt, total, 4096, got, h_got);
    for (int i = 0; i < N; i++)
        for (int t = 0; t < total[i] - n_prompt[i]; t++)
            cr_assert_eq(h_got[i][t], h_alone[i][t], "sequence %d token %d: batched logits differ from alone", i, t);
    int n_split = 0;
    for (int i = 0; i < N; i++) {
        if (n_prompt[i] <= 8 || n_prompt[i] % 8 == 1)
            continue;
        n_split++;
        td_test_engine_greedy(&fx, 1, &prompts[i], &n_prompt[i], &total[i], 8, &got[i], &h_got[i]);
        for (int t = 0; t < total[i] - n_prompt[i]; t++)
            cr_assert_eq(h_got[i][t], h_alone[i][t], "sequence %d (%d prompt tokens) token %d: prefilled in pieces "
                         "of 8, logits differ", i, n_prompt[i], t);
    }
    cr_assert_gt(n_split, N / 4);
    const int chunks[] = {1, 7};
    for (size_t c = 0; c < 2; c++) {
        td_test_engine_greedy(&fx, N, prompts, n_prompt, total, chunks[c], got, NULL);
        for (int i = 0; i < N; i++)
            for (int t = 0; t < total[i] - n_prompt[i]; t++)
                cr_assert_eq(got[i][t], alone[i][t], "chunk %d: sequence %d token %d", chunks[c], i, t);
    }
    td_test_engine_close(&fx);

    /* prefix cache: the second round attaches blocks the first released behind its window */
    swa_open(&fx, NULL, 1, 21, ~0u, true);
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < N; i++) {
            td_test_engine_greedy(&fx, 1, &prompts[i], &n_prompt[i], &total[i], 4096, &got[i], &h_got[i]);
            for (int t = 0; t < total[i] - n_prompt[i]; t++)
                cr_assert_eq(got[i][t], alone[i][t], "prefix cache round %d: sequence %d token %d", round, i, t);
        }
    td_kv_stats_t st;
    td_kv_get_stats(td_engine_kv(fx.eng), &st);
    cr_assert_gt(st.prefix_hits, 0, "second round found no cached prefix block");
    cr_assert_gt(st.window_released, 0);
    cr_assert_eq(st.used, 0);
    cr_assert_eq(td_kv_cache_check(td_engine_kv(fx.eng)), TD_OK, "%s", td_last_error());
    td_test_engine_close(&fx);
    for (int i = 0; i < N; i++)
        free(prompts[i]), free(alone[i]), free(got[i]), free(h_alone[i]), free(h_got[i]);
}

/* A prompt longer than the window computed again from the prefix cache gives the same
   logits bits, and a step that would read a block given back is refused, not computed. */
Test(engine, sliding_window_prefix_hit_and_released_blocks, .timeout = 60)
{
    td_test_skip_without_stories();
    td_test_engine_t fx;
    swa_open(&fx, NULL, 1, 30, ~0u, true);
    int32_t p[100];
    for (int i = 0; i < 100; i++)
        p[i] = i ? 3 + (7 * i) % 500 : 1;
    float *lg[3];
    for (int k = 0; k < 3; k++)
        lg[k] = malloc((size_t)fx.vocab * sizeof(float));
    for (int round = 0; round < 2; round++) {
        td_kv_seq_t seq;
        td_kv_seq_init(&seq);
        int32_t cached = -1;
        cr_assert_eq(td_engine_seq_start(fx.eng, &seq, p, 100, &cached), TD_OK);
        cr_assert_eq(cached, round ? 96 : 0);
        td_engine_item_t it = {.seq = &seq, .tokens = p + cached, .n_tokens = 100 - cached, .n_logits = 1};
        cr_assert_eq(td_engine_step(fx.eng, &it, 1, lg[round]), TD_OK);
        /* 100 tokens, window 30: the next query (position 100) reads from 71 on: blocks 0..3 go */
        cr_assert_eq(td_engine_seq_release_window(fx.eng, &seq), 4);
        cr_assert_eq(td_engine_seq_release_window(fx.eng, &seq), 0);
        int32_t t = 5;
        td_engine_item_t one = {.seq = &seq, .tokens = &t, .n_tokens = 1, .n_logits = 1};
        cr_assert_eq(td_engine_step(fx.eng, &one, 1, lg[2]), TD_OK);
        if (round == 0) {
            /* give back block 4 (positions 64..79) by hand: the query at 101 reads from 72 on,
               so the next step must refuse, not read a block that is not there */
            cr_assert_eq(td_kv_seq_release_before(td_engine_kv(fx.eng), &seq, 80), 1);
            cr_assert_eq(td_engine_step(fx.eng, &one, 1, lg[2]), TD_ERR_INVALID);
        }
        td_engine_seq_end(fx.eng, &seq);
    }
    cr_assert(!memcmp(lg[0], lg[1], (size_t)fx.vocab * sizeof(float)),
              "a prompt beyond the window: other logits after a cached prefix");
    for (int k = 0; k < 3; k++)
        free(lg[k]);
    td_kv_stats_t st;
    td_kv_get_stats(td_engine_kv(fx.eng), &st);
    cr_assert_eq(st.used, 0);
    td_test_engine_close(&fx);
}

/* ---- speculative verification ------------------------------------------------------- */

/* Prefills prompt[0..n) into an empty seq (no logits kept). */
static void prefill_seq(td_engine_t *eng, td_kv_seq_t *seq, const int32_t *prompt, int32_t n)
{
    td_kv_seq_init(seq);
    td_engine_item_t it = {.seq = seq, .tokens = prompt, .n_tokens = n, .n_logits = 0};
    cr_assert_eq(td_engine_step(eng, &it, 1, NULL), TD_OK, "%s", td_last_error());
}

/*
 * The verify step's promise, bit for bit: a verify item of K rows gives, row by row, the logits
 * of K one-row decode steps fed the same tokens, whatever shares its step (alone; beside one-row
 * items and another verify item); after a rollback to any kept prefix the next one-row step
 * gives the same logits again; no block leaks, and the cache's bookkeeping stays consistent.
 * The rows cross a block boundary (prompt of 13, K = 7, blocks of 16) so that a rollback frees
 * a block the verify step reserved.
 */
static void check_verify_rows(td_engine_t *eng, int vocab, const char *what)
{
    enum { NP = 13, K = 7 };
    int32_t prompt[NP], draft[K], other[3] = {7, 300, 42};
    unsigned s = 11;
    for (int i = 0; i < NP; i++)
        prompt[i] = i ? 3 + (int32_t)(td_test_rng_next(&s) % 500) : 1;
    for (int i = 0; i < K; i++)
        draft[i] = 3 + (int32_t)(td_test_rng_next(&s) % 500);
    size_t row = (size_t)vocab * sizeof(float);
    float *want = malloc(K * row), *got = malloc((K + 1 + 3) * row), *one = malloc(row);
    cr_assert(want && got && one);
    td_kv_cache_t *kv = td_engine_kv(eng);
    td_kv_stats_t st0;
    td_kv_get_stats(kv, &st0);

    /* K one-row steps */
    td_kv_seq_t a;
    prefill_seq(eng, &a, prompt, NP);
    for (int i = 0; i < K; i++) {
        td_engine_item_t it = {.seq = &a, .tokens = &draft[i], .n_tokens = 1, .n_logits = 1};
        cr_assert_eq(td_engine_step(eng, &it, 1, want + (size_t)i * vocab), TD_OK, "%s", td_last_error());
    }

    /* one verify item alone */
    td_kv_seq_t b;
    prefill_seq(eng, &b, prompt, NP);
    td_engine_item_t vb = {.seq = &b, .tokens = draft, .n_tokens = K, .n_logits = K, .verify = true};
    cr_assert_eq(td_engine_step(eng, &vb, 1, got), TD_OK, "%s", td_last_error());
    for (int i = 0; i < K; i++)
        cr_assert(!memcmp(got + (size_t)i * vocab, want + (size_t)i * vocab, row),
                  "%s: verify row %d alone differs from the one-row step", what, i);
    cr_assert_eq(b.n_tokens, NP + K);

    /* rollback to each kept length, then the next one-row step equals the sequential one */
    for (int keep = NP + K - 1; keep >= NP; keep -= 3) {
        td_engine_seq_rollback(eng, &b, keep);
        cr_assert_eq(b.n_tokens, keep);
        cr_assert_eq(b.n_blocks, (keep + 15) / 16, "%s: rollback to %d keeps %d blocks", what, keep, b.n_blocks);
        cr_assert_eq(td_kv_cache_check(kv), TD_OK, "%s", td_last_error());
        int j = keep - NP; /* the next token to feed is draft[j], whose logits are want[j] */
        td_engine_item_t it = {.seq = &b, .tokens = &draft[j], .n_tokens = 1, .n_logits = 1};
        cr_assert_eq(td_engine_step(eng, &it, 1, one), TD_OK, "%s", td_last_error());
        cr_assert(!memcmp(one, want + (size_t)j * vocab, row), "%s: after a rollback to %d, the step differs", what,
                  keep);
        td_engine_seq_rollback(eng, &b, keep);
    }
    td_engine_seq_end(eng, &b);

    /* in a mixed batch: a one-row item, the verify item, another verify item of 2 rows */
    td_kv_seq_t c, d;
    prefill_seq(eng, &b, prompt, NP);
    prefill_seq(eng, &c, prompt, 5);
    prefill_seq(eng, &d, prompt + 2, 9);
    td_engine_item_t items[3] = {
        {.seq = &c, .tokens = &other[0], .n_tokens = 1, .n_logits = 1},
        {.seq = &b, .tokens = draft, .n_tokens = K, .n_logits = K, .verify = true},
        {.seq = &d, .tokens = &other[1], .n_tokens = 2, .n_logits = 2, .verify = true},
    };
    cr_assert_eq(td_engine_step(eng, items, 3, got), TD_OK, "%s", td_last_error());
    for (int i = 0; i < K; i++)
        cr_assert(!memcmp(got + (size_t)(1 + i) * vocab, want + (size_t)i * vocab, row),
                  "%s: verify row %d in a batch of 3 differs from the one-row step", what, i);

    /* a verify item beside a prefill piece is refused, nothing advances */
    int32_t n_b = b.n_tokens, n_c = c.n_tokens;
    td_engine_item_t mixed[2] = {
        {.seq = &c, .tokens = other, .n_tokens = 3, .n_logits = 1},
        {.seq = &b, .tokens = draft, .n_tokens = 2, .n_logits = 2, .verify = true},
    };
    cr_assert_eq(td_engine_step(eng, mixed, 2, got), TD_ERR_INVALID);
    cr_assert_eq(b.n_tokens, n_b);
    cr_assert_eq(c.n_tokens, n_c);
    td_engine_item_t partial = {.seq = &b, .tokens = draft, .n_tokens = 2, .n_logits = 1, .verify = true};
    cr_assert_eq(td_engine_step(eng, &partial, 1, got), TD_ERR_INVALID);

    td_engine_seq_end(eng, &a);
    td_engine_seq_end(eng, &b);
    td_engine_seq_end(eng, &c);
    td_engine_seq_end(eng, &d);
    td_kv_stats_t st1;
    td_kv_get_stats(kv, &st1);
    cr_assert_eq(st1.used, 0, "%s: %d blocks still referenced after every sequence ended", what, st1.used);
    cr_assert_eq(st1.free + st1.cached, st0.free + st0.cached, "%s: blocks leaked", what);
    cr_assert_eq(td_kv_cache_check(kv), TD_OK, "%s", td_last_error());
    free(want), free(got), free(one);
}

/* A Q8_0 KV cache needs head_dim in whole blocks of 32: stories260K's 8 is refused by name,
 * and nothing is created. */
Test(engine, q8_0_kv_needs_whole_blocks)
{
    td_test_skip_without_stories();
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 16;
    ec.kv_dtype = TD_Q8_0;
    td_test_engine_t fx = {0};
    cr_assert_eq(td_model_load(td_test_stories_path(), &fx.model), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_backend_cpu_create(NULL, &fx.be), TD_OK);
    td_engine_t *eng = NULL;
    cr_assert_eq(td_engine_create(fx.model, fx.be, &ec, &eng), TD_ERR_UNSUPPORTED);
    cr_assert_null(eng);
    cr_assert(strstr(td_last_error(), "q8_0 KV cache needs head_dim a multiple of 32"), "%s", td_last_error());
    td_backend_destroy(fx.be);
    td_model_destroy(fx.model);
}

Test(engine, verify_rows_equal_one_row_steps, .timeout = 120)
{
    td_test_skip_without_stories();
    struct {
        const char *what;
        int weight_dtype, kv_dtype, quant, threads;
        bool prefix_cache;
    } cases[] = {
        {"f32", TD_ENGINE_WEIGHTS_AS_STORED, TD_F32, -1, 1, false},
        {"f32, 2 threads, prefix cache", TD_ENGINE_WEIGHTS_AS_STORED, TD_F32, -1, 2, true},
        {"f16 weights and KV", TD_F16, TD_F16, -1, 2, false},
        {"bf16 weights and KV", TD_BF16, TD_BF16, -1, 1, true},
        {"q8_0 weights", TD_ENGINE_WEIGHTS_AS_STORED, TD_F32, TD_Q8_0, 2, false},
        {"q4_0 weights", TD_ENGINE_WEIGHTS_AS_STORED, TD_F32, TD_Q4_0, 1, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        td_engine_config_t ec = td_engine_config_default();
        ec.n_blocks = 64;
        ec.prefix_cache = cases[i].prefix_cache;
        ec.weight_dtype = cases[i].weight_dtype;
        ec.kv_dtype = (td_dtype_t)cases[i].kv_dtype;
        ec.weight_quant = cases[i].quant;
        td_test_engine_t fx;
        td_test_engine_open(&fx, cases[i].threads, &ec);
        check_verify_rows(fx.eng, fx.vocab, cases[i].what);
        td_test_engine_close(&fx);
    }
}

/* The same on the real model when TANDEM_TEST_GGUF names it (SmolLM2-135M-Instruct.Q4_1.gguf:
 * Q4_1 matrices through the int8 dot-product kernels, grouped-query attention), with an f32
 * and a Q8_0 KV cache. */
Test(engine, verify_rows_equal_one_row_steps_gguf, .timeout = 300)
{
    const char *path = getenv("TANDEM_TEST_GGUF");
    if (!path || !*path)
        cr_skip_test("TANDEM_TEST_GGUF does not name a file (set it to SmolLM2-135M-Instruct.Q4_1.gguf)");
    td_model_t *model = NULL;
    td_backend_t *be = NULL;
    td_engine_t *eng = NULL;
    cr_assert_eq(td_model_load(path, &model), TD_OK, "%s", td_last_error());
    td_cpu_config_t cc = {.n_threads = 2};
    cr_assert_eq(td_backend_cpu_create(&cc, &be), TD_OK, "%s", td_last_error());
    for (int kv = 0; kv < 2; kv++) {
        td_engine_config_t ec = td_engine_config_default();
        ec.n_blocks = 64;
        ec.kv_dtype = kv ? TD_Q8_0 : TD_F32;
        cr_assert_eq(td_engine_create(model, be, &ec, &eng), TD_OK, "%s", td_last_error());
        check_verify_rows(eng, model->config.vocab_size, kv ? "gguf q4_1, q8_0 KV" : "gguf q4_1");
        td_engine_destroy(eng);
    }
    td_backend_destroy(be);
    td_model_destroy(model);
}

/* Split invariance on the real model (grouped-query attention with 3 query heads a KV head,
 * so a prefill tile's query rows are odd as often as even, and the attention kernel's row
 * blocks of every size meet every row: pieces of 7 tokens are 21 rows, 4 blocks of 4 and a
 * single row; of 5, 15 rows, the last block 3): prompts prefilled whole, in pieces of 7 and
 * of 5, give the same bits in every generated token's logits. (A row skewed in the kernel's
 * single-row path, 1 + 1e-7 of its scores, fails it.) */
static void split_invariance_gguf(bool one_byte)
{
    const char *path = getenv("TANDEM_TEST_GGUF");
    if (!path || !*path)
        cr_skip_test("TANDEM_TEST_GGUF does not name a file (set it to SmolLM2-135M-Instruct.Q4_1.gguf)");
    td_test_engine_t fx = {0};
    cr_assert_eq(td_model_load(path, &fx.model), TD_OK, "%s", td_last_error());
    td_cpu_config_t cc = {.n_threads = 1, .act_one_byte = one_byte};
    cr_assert_eq(td_backend_cpu_create(&cc, &fx.be), TD_OK, "%s", td_last_error());
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 64;
    ec.prefix_cache = false;
    cr_assert_eq(td_engine_create(fx.model, fx.be, &ec, &fx.eng), TD_OK, "%s", td_last_error());
    fx.vocab = fx.model->config.vocab_size;
    unsigned s = 11;
    /* none 1 past a multiple of 7 or 5: a one-row piece runs the decode kernel. Under ASan (-O0),
       where SmolLM2's three prefills of these take 50 s of CPU, the first two: the same kernels,
       whole tiles and odd last rows, pieces of 7 and of 5; the release build runs all three. */
#ifdef __SANITIZE_ADDRESS__
    const int lens[] = {37, 62};
#else
    const int lens[] = {37, 62, 100};
#endif
    for (size_t p = 0; p < sizeof lens / sizeof lens[0]; p++) {
        int n = lens[p], total = n + 4, *prompt = td_test_random_prompt(&s, n);
        int *whole = malloc(8 * sizeof(int)), *got = malloc(8 * sizeof(int));
        uint64_t *h_whole = malloc(8 * sizeof(uint64_t)), *h_got = malloc(8 * sizeof(uint64_t));
        td_test_engine_greedy(&fx, 1, &prompt, &n, &total, 4096, &whole, &h_whole);
        const int pieces[] = {7, 5};
        for (size_t k = 0; k < sizeof pieces / sizeof pieces[0]; k++) {
            td_test_engine_greedy(&fx, 1, &prompt, &n, &total, pieces[k], &got, &h_got);
            for (int t = 0; t < total - n; t++)
                cr_assert_eq(h_got[t], h_whole[t],
                             "%d-token prompt prefilled in pieces of %d: token %d's logits differ from prefilled whole", n,
                             pieces[k], t);
        }
        free(prompt), free(whole), free(got), free(h_whole), free(h_got);
    }
    td_test_engine_close(&fx);
}

Test(engine, split_invariance_gguf, .timeout = 300)
{
    split_invariance_gguf(false);
}

/* The same with cpu:q8's one-byte activation rows (a file with Q4_K, IQ4_XS or Q6_K matrices
 * runs their super-block rows, one scale a 256 values) */
Test(engine, split_invariance_gguf_q8, .timeout = 300)
{
    split_invariance_gguf(true);
}
