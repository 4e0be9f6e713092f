/*
 * bench grammar: what constrained decoding costs on the CPU, per token, over a real
 * vocabulary (docs/grammar.md "How fast"). For each grammar: the compile time (median of 5),
 * then seeded random walks (each next token drawn uniformly from the allowed ones, a walk
 * restarted when it ends) timing td_gram_fill_mask + td_gram_accept_token per token (not
 * the benchmark's own draw): the
 * first pass fills the per-position caches (cold), the second pass repeats the same walks
 * on the filled caches (warm: what a long-running server sees).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_backend.h"
#include "td_bench.h"
#include "td_constrain.h"
#include "td_engine.h"
#include "td_model.h"
#include "td_sampler.h"
#include "td_gram.h"
#include "td_opts.h"
#include "td_rng.h"
#include "td_tokenizer.h"
#include "td_util.h"

typedef struct gcase {
    const char *name;
    td_gram_kind_t kind;
    const char *src;
} gcase_t;

static const gcase_t builtin[] = {
    {"json_object", TD_GRAM_JSON_OBJECT, ""},
    {"schema-flat", TD_GRAM_JSON_SCHEMA,
     "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\","
     "\"minimum\":0,\"maximum\":150},\"email\":{\"type\":\"string\",\"format\":\"email\"},\"admin\":{\"type\":"
     "\"boolean\"}},\"required\":[\"name\",\"age\"]}"},
    {"schema-nested", TD_GRAM_JSON_SCHEMA,
     "{\"$defs\":{\"item\":{\"type\":\"object\",\"properties\":{\"sku\":{\"type\":\"string\",\"pattern\":"
     "\"^[A-Z]{3}-\\\\d{4}$\"},\"qty\":{\"type\":\"integer\",\"minimum\":1},\"price\":{\"type\":\"number\"},"
     "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"new\",\"sale\",\"gift\"]},\"maxItems\":3}},"
     "\"required\":[\"sku\",\"qty\",\"price\"]}},\"type\":\"object\",\"properties\":{\"order_id\":{\"type\":"
     "\"string\",\"format\":\"uuid\"},\"created\":{\"type\":\"string\",\"format\":\"date-time\"},\"customer\":"
     "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"vip\":{\"type\":[\"boolean\","
     "\"null\"]}},\"required\":[\"name\"]},\"items\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/item\"},"
     "\"minItems\":1,\"maxItems\":20},\"note\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}},"
     "\"required\":[\"order_id\",\"created\",\"items\"]}"},
};

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

typedef struct walk_stats {
    uint64_t *ns; /* [n] per token */
    int64_t n;
} walk_stats_t;

/* n_tokens tokens of seeded random walks; per-token times into w->ns. */
static td_status_t walks(td_gram_matcher_t *m, int32_t n_vocab, const td_gram_vocab_t *v, int64_t n_tokens,
                         uint64_t seed, walk_stats_t *w, const uint8_t *is_eos)
{
    td_gram_t *g = td_gram_matcher_grammar(m);
    uint32_t *mask = malloc(td_gram_mask_words(n_vocab) * sizeof *mask);
    int32_t *allowed = malloc((size_t)n_vocab * sizeof *allowed);
    td_gram_state_t *s = NULL;
    td_status_t st = TD_OK;
    if (!mask || !allowed || (st = td_gram_state_create(g, &s)) != TD_OK) {
        st = st ? st : TD_ERR_NOMEM;
        goto out;
    }
    (void)v;
    w->n = 0;
    uint64_t x = seed;
    while (w->n < n_tokens) {
        uint64_t t0 = td_now_ns();
        if ((st = td_gram_fill_mask(m, s, mask)) != TD_OK)
            goto out;
        uint64_t t_mask = td_now_ns() - t0; /* the draw below is the benchmark's, not timed */
        int32_t na = 0, eos = -1;
        for (int32_t i = 0; i < n_vocab; i++)
            if ((mask[i >> 5] >> (i & 31)) & 1) {
                if (is_eos[i])
                    eos = i;
                else
                    allowed[na++] = i;
            }
        int32_t t = na ? allowed[td_splitmix64(&x) % (uint64_t)na] : eos;
        if (t < 0 || (eos >= 0 && td_splitmix64(&x) % 8 == 0)) { /* ended: a new walk */
            td_gram_state_destroy(s);
            s = NULL;
            if ((st = td_gram_state_create(g, &s)) != TD_OK)
                goto out;
            continue;
        }
        uint64_t t1 = td_now_ns();
        if ((st = td_gram_accept_token(m, s, t)) != TD_OK)
            goto out;
        w->ns[w->n++] = t_mask + (td_now_ns() - t1);
    }
out:
    td_gram_state_destroy(s);
    free(mask);
    free(allowed);
    return st;
}


/* ---- end to end: decode tokens/s with and without the grammar --------------------------- */

#define E2E_PROMPT 8 /* prompt tokens of each sequence: decode, not prefill, is measured */
static const int e2e_batches[] = {1, 32};

typedef struct e2e {
    td_engine_t *eng;
    const td_model_config_t *mc;
    const td_gram_vocab_t *v; /* the model's grammar vocabulary */
    int gen;       /* decode steps timed */
    float temperature;
} e2e_t;

/*
 * One run: `batch` sequences of an E2E_PROMPT-token prompt prefilled, then gen decode steps
 * timed, every token sampled (--temperature, a per-sequence seed) as the decode node
 * samples (decode_sched.c): with a matcher m, td_gram_fill_mask, td_sampler_sample_masked and
 * td_gram_accept_token per row, a sequence whose grammar has ended starting a new walk (the
 * model goes on: only the cost is measured); without, td_sampler_sample. Writes the decode
 * tokens/s and the mask share (fill + accept, µs per token).
 */
static td_status_t e2e_run(const e2e_t *e, int batch, td_gram_matcher_t *m, double *tps_p, double *mask_us_p)
{
    const int32_t nv = e->mc->vocab_size;
    td_status_t st = TD_OK;
    td_kv_seq_t *seqs = calloc((size_t)batch, sizeof *seqs);
    td_engine_item_t *items = calloc((size_t)batch, sizeof *items);
    td_sampler_t **samp = calloc((size_t)batch, sizeof *samp);
    td_gram_state_t **gst = calloc((size_t)batch, sizeof *gst);
    int32_t *next = calloc((size_t)batch, sizeof *next), *prompt = calloc((size_t)batch * E2E_PROMPT, sizeof *prompt);
    float *logits = malloc((size_t)batch * (size_t)nv * sizeof *logits);
    uint32_t *mask = malloc(td_gram_mask_words(nv) * sizeof *mask);
    if (!seqs || !items || !samp || !gst || !next || !prompt || !logits || !mask) {
        st = td_errorf(TD_ERR_NOMEM, "bench grammar: out of memory");
        goto out;
    }
    uint64_t x = 777;
    for (int i = 0; i < batch; i++) {
        td_kv_seq_init(&seqs[i]);
        for (int k = 0; k < E2E_PROMPT; k++)
            prompt[i * E2E_PROMPT + k] = (int32_t)(td_splitmix64(&x) % 256); /* byte pieces: any model has them */
        td_sampling_t sp = td_sampling_default();
        sp.temperature = e->temperature;
        sp.seed = 1000 + (uint64_t)i;
        if ((st = td_sampler_create(&sp, &samp[i])) != TD_OK)
            goto out;
        if (m && (st = td_gram_state_create(td_gram_matcher_grammar(m), &gst[i])) != TD_OK)
            goto out;
        items[i] = (td_engine_item_t){.seq = &seqs[i], .tokens = prompt + i * E2E_PROMPT, .n_tokens = E2E_PROMPT,
                                      .n_logits = 1};
    }
    if ((st = td_engine_step(e->eng, items, batch, logits)) != TD_OK)
        goto out;
    uint64_t t0 = 0, mask_ns = 0;
    for (int step = 0; step <= e->gen && st == TD_OK; step++) {
        if (step == 1) /* step 0 samples the prefill's rows: the timed part starts with decode */
            t0 = td_now_ns(), mask_ns = 0;
        if (step > 0) {
            for (int i = 0; i < batch; i++)
                items[i] = (td_engine_item_t){.seq = &seqs[i], .tokens = &next[i], .n_tokens = 1, .n_logits = 1};
            if ((st = td_engine_step(e->eng, items, batch, logits)) != TD_OK)
                break;
        }
        for (int i = 0; i < batch && st == TD_OK; i++) {
            const float *lg = logits + (size_t)i * (size_t)nv;
            if (!m) {
                st = td_sampler_sample(samp[i], lg, nv, &next[i]);
                continue;
            }
            uint64_t a = td_now_ns();
            if (td_gram_is_done(gst[i])) { /* the walk ended: a new one */
                td_gram_state_destroy(gst[i]);
                gst[i] = NULL;
                if ((st = td_gram_state_create(td_gram_matcher_grammar(m), &gst[i])) != TD_OK)
                    break;
            }
            if ((st = td_gram_fill_mask(m, gst[i], mask)) != TD_OK)
                break;
            uint64_t b = td_now_ns();
            if ((st = td_sampler_sample_masked(samp[i], lg, nv, mask, &next[i])) != TD_OK)
                break;
            uint64_t c = td_now_ns();
            if (td_gram_vocab_kind(e->v, next[i]) == TD_GRAM_TOK_EOS) { /* the walk ends: a new one */
                td_gram_state_destroy(gst[i]);
                gst[i] = NULL;
                st = td_gram_state_create(td_gram_matcher_grammar(m), &gst[i]);
            } else if (td_gram_accept_token(m, gst[i], next[i]) != TD_OK) {
                st = td_errorf(TD_ERR_INTERNAL, "bench grammar: token %d was in the mask but the grammar refused it",
                               next[i]);
            }
            mask_ns += (b - a) + (td_now_ns() - c);
        }
    }
    if (st == TD_OK) {
        double s = (double)(td_now_ns() - t0) * 1e-9;
        *tps_p = (double)batch * e->gen / s;
        *mask_us_p = (double)mask_ns * 1e-3 / ((double)batch * e->gen);
    }
out:
    for (int i = 0; i < batch && seqs; i++) {
        td_engine_seq_end(e->eng, &seqs[i]);
        if (samp)
            td_sampler_destroy(samp[i]);
        if (gst)
            td_gram_state_destroy(gst[i]);
    }
    free(seqs), free(items), free(samp), free(gst), free(next), free(prompt), free(logits), free(mask);
    return st;
}

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The end-to-end figures of one grammar: at each batch, reps rounds of (unconstrained; a
 * fresh matcher, as for a schema a node has not seen; the same matcher again, as for a
 * repeated schema; unconstrained again, the two averaged), so that the shared machine's
 * drift moves all three alike;
 * the medians go into j and, unless json, on stdout. */
static td_status_t e2e_case(const e2e_t *e, const gcase_t *gc, int reps, bool json, cJSON *j)
{
    td_gram_t *g = NULL;
    td_status_t st = td_gram_compile(gc->kind, gc->src, strlen(gc->src), &g);
    if (st != TD_OK)
        return st;
    cJSON *arr = cJSON_AddArrayToObject(j, "e2e");
    for (size_t b = 0; b < TD_ARRAY_LEN(e2e_batches) && st == TD_OK; b++) {
        int batch = e2e_batches[b];
        double tps[3][16], mus[3][16];
        for (int r = 0; r < reps && st == TD_OK; r++) {
            td_gram_matcher_t *m = NULL;
            double unused;
            double before = 0, after = 0;
            if ((st = e2e_run(e, batch, NULL, &before, &unused)) != TD_OK ||
                (st = td_gram_matcher_create(g, e->v, &m)) != TD_OK)
                break;
            mus[0][r] = 0;
            if ((st = e2e_run(e, batch, m, &tps[1][r], &mus[1][r])) == TD_OK &&
                (st = e2e_run(e, batch, m, &tps[2][r], &mus[2][r])) == TD_OK)
                st = e2e_run(e, batch, NULL, &after, &unused);
            tps[0][r] = (before + after) / 2; /* before and after: the drift of the round cancels */
            td_gram_matcher_destroy(m);
        }
        if (st != TD_OK)
            break;
        double med[3], mmed[3];
        for (int k = 0; k < 3; k++) {
            qsort(tps[k], (size_t)reps, sizeof(double), cmp_dbl);
            qsort(mus[k], (size_t)reps, sizeof(double), cmp_dbl);
            med[k] = tps[k][reps / 2];
            mmed[k] = mus[k][reps / 2];
        }
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "batch", batch);
        bench_json_number(x, "free_tps", med[0], 1);
        bench_json_number(x, "cold_tps", med[1], 1);
        bench_json_number(x, "warm_tps", med[2], 1);
        bench_json_number(x, "cold_ratio", med[1] / med[0], 3);
        bench_json_number(x, "warm_ratio", med[2] / med[0], 3);
        bench_json_number(x, "cold_mask_us_per_token", mmed[1], 1);
        bench_json_number(x, "warm_mask_us_per_token", mmed[2], 1);
        cJSON_AddItemToArray(arr, x);
        if (!json)
            printf("%-14s %5d %11.1f %11.1f %11.1f %7.3f %7.3f %12.1f %12.1f\n", gc->name, batch, med[0], med[1], med[2],
                   med[1] / med[0], med[2] / med[0], mmed[1], mmed[2]);
    }
    td_gram_unref(g);
    return st;
}

/* --dump DIR: what a reference engine needs to match the same grammars over the same
 * vocabulary (bench/grammar_vs.sh runs xgrammar on it), DIR made if missing: DIR/vocab.tsv, one line a token id
 * with its kind (text, special, eos) and its bytes in hex (the bytes td_constrain_vocab
 * gives the grammar), and DIR/NAME.json, each grammar case's source. */
static td_status_t dump_cases(const char *dir, const td_tokenizer_t *tok, const td_gram_vocab_t *v,
                              const gcase_t *cases, int n_cases)
{
    static const char *kind[] = {"text", "special", "eos"};
    char path[4096];
    td_status_t st = td_mkdir_p(dir);
    if (st != TD_OK)
        return st;
    snprintf(path, sizeof path, "%s/vocab.tsv", dir);
    FILE *f = fopen(path, "w");
    if (!f)
        return td_errorf(TD_ERR_IO, "--dump: cannot write %s: %s", path, strerror(errno));
    const int32_t n = td_gram_vocab_size(v), n_tok = td_tokenizer_vocab_size(tok);
    for (int32_t i = 0; i < n; i++) {
        size_t len = 0;
        td_gram_tok_t k = td_gram_vocab_kind(v, i);
        const char *b = i < n_tok ? td_tokenizer_token_bytes(tok, i, &len) : NULL;
        fprintf(f, "%d\t%s\t", i, kind[k]);
        for (size_t j = 0; b && k == TD_GRAM_TOK_TEXT && j < len; j++)
            fprintf(f, "%02x", (uint8_t)b[j]);
        fputc('\n', f);
    }
    if (fclose(f) != 0)
        return td_errorf(TD_ERR_IO, "--dump: cannot write %s: %s", path, strerror(errno));
    for (int c = 0; c < n_cases; c++) {
        snprintf(path, sizeof path, "%s/%s.json", dir, cases[c].name);
        if (!(f = fopen(path, "w")))
            return td_errorf(TD_ERR_IO, "--dump: cannot write %s: %s", path, strerror(errno));
        fputs(cases[c].kind == TD_GRAM_JSON_OBJECT ? "{\"type\":\"object\"}" : cases[c].src, f);
        if (fclose(f) != 0)
            return td_errorf(TD_ERR_IO, "--dump: cannot write %s: %s", path, strerror(errno));
    }
    return TD_OK;
}

int bench_grammar(int argc, char **argv)
{
    bool json = false;
    const char *tok_path = NULL, *schema = NULL, *model_path = NULL, *dump = NULL;
    int64_t tokens = 2000, threads = 0, gen = 128, reps = 3;
    float temperature = 0;
    const td_opt_t opts[] = {
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &json, .help = "one JSON document on stdout (docs/bench.md)"},
        {.name = "tokenizer", .type = TD_OPT_STR, .ptr = &tok_path, .arg = "PATH",
         .help = "the vocabulary: a GGUF model, tokenizer.json or directory (required)"},
        {.name = "json-schema", .type = TD_OPT_STR, .ptr = &schema, .arg = "FILE",
         .help = "a schema of your own instead of the built-in three"},
        {.name = "tokens", .type = TD_OPT_I64, .ptr = &tokens, .min = 10, .max = 10000000, .arg = "N",
         .help = "tokens walked per grammar and pass (default 2000)"},
        {.name = "model", .type = TD_OPT_STR, .ptr = &model_path, .arg = "PATH",
         .help = "also decode end to end on this model (its tokenizer unless --tokenizer): tokens/s\n"
                 "with and without each grammar at batch 1 and 32 (CPU)"},
        {.name = "threads", .type = TD_OPT_I64, .ptr = &threads, .min = 1, .max = 1024, .arg = "N",
         .help = "with --model: compute threads (default: the CPU count)"},
        {.name = "gen-tokens", .type = TD_OPT_I64, .ptr = &gen, .min = 2, .max = 4096, .arg = "N",
         .help = "with --model: decode steps timed per run (default 128)"},
        {.name = "reps", .type = TD_OPT_I64, .ptr = &reps, .min = 1, .max = 15, .arg = "N",
         .help = "with --model: rounds of the three runs, medians reported (default 3)"},
        {.name = "temperature", .type = TD_OPT_F32, .ptr = &temperature, .fmin = 0, .fmax = 2, .arg = "T",
         .help = "with --model: sampling temperature (default 0, greedy: the sampler's cost is\n"
                 "the same with and without a mask, so the difference is the grammar's)"},
        {.name = "dump", .type = TD_OPT_STR, .ptr = &dump, .arg = "DIR",
         .help = "write DIR/vocab.tsv (each token's kind and bytes) and DIR/NAME.json (each\n"
                 "grammar's source) for a reference engine, then measure as usual"},
    };
    td_opts_t spec = {.prog = "bench grammar", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r_opts = {0};
    if (td_opts_parse(&spec, argc, argv, &r_opts) != TD_OK)
        return 2;
    if (!tok_path)
        tok_path = model_path;
    if (r_opts.help || !tok_path) {
        printf("usage: tandem bench grammar --tokenizer PATH [--json-schema FILE] [--tokens N] [--json]\n"
               "       tandem bench grammar --model PATH [--threads N] [--gen-tokens N] [--reps N] ...\n"
               "  per-token mask time of constrained decoding over PATH's vocabulary: compile time,\n"
               "  then random walks with cold and warm per-suffix caches; with --model, decode\n"
               "  tokens/s with and without each grammar at batch 1 and 32 (docs/grammar.md).\n\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return r_opts.help ? 0 : 2;
    }
    td_tokenizer_t *tok = NULL;
    td_gram_vocab_t *v = NULL;
    td_model_t *model = NULL;
    td_backend_t *be = NULL;
    td_engine_t *eng = NULL;
    cJSON *items[3] = {0};
    char *own = NULL;
    uint8_t *is_eos = NULL;
    walk_stats_t w = {0};
    int rc = 1;
    cJSON *out = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(out, "grammars");
    cJSON_AddStringToObject(out, "bench", "grammar");
    if (td_tokenizer_load(tok_path, &tok) != TD_OK)
        goto done;
    int32_t n = td_tokenizer_vocab_size(tok);
    if (model_path) { /* the model's vocabulary (a padded embedding) and EOS ids, as a node's */
        td_device_spec_t dev = {0};
        td_engine_config_t ec = td_engine_config_default();
        ec.prefix_cache = false;
        ec.max_batch_tokens = TD_MAX(ec.max_batch_tokens, 32 * E2E_PROMPT);
        if (td_model_load(model_path, &model) != TD_OK ||
            td_backend_open(&dev, threads > 0 ? (int32_t)threads : td_cpu_count(), TD_F32, &be) != TD_OK ||
            td_engine_create(model, be, &ec, &eng) != TD_OK)
            goto done;
        const td_model_config_t *mc = td_engine_model_config(eng);
        n = mc->vocab_size;
        if (td_constrain_vocab(tok, n, mc->eos_ids, mc->n_eos, &v) != TD_OK)
            goto done;
    } else if (td_constrain_vocab(tok, n, NULL, 0, &v) != TD_OK) {
        goto done;
    }
    is_eos = calloc((size_t)n, 1);
    w.ns = malloc((size_t)tokens * sizeof *w.ns);
    if (!is_eos || !w.ns)
        goto done;
    for (int32_t i = 0; i < n; i++)
        is_eos[i] = td_gram_vocab_kind(v, i) == TD_GRAM_TOK_EOS;
    gcase_t cases[3];
    int n_cases = 0;
    if (schema) {
        size_t len;
        if (td_file_read_all(schema, TD_GRAM_MAX_SOURCE, &own, &len) != TD_OK)
            goto done;
        cases[n_cases++] = (gcase_t){"schema", TD_GRAM_JSON_SCHEMA, own};
    } else {
        for (size_t i = 0; i < TD_ARRAY_LEN(builtin); i++)
            cases[n_cases++] = builtin[i];
    }
    if (dump && dump_cases(dump, tok, v, cases, n_cases) != TD_OK)
        goto done;
    cJSON_AddNumberToObject(out, "vocab", n);
    if (!json)
        printf("vocabulary: %d tokens (%s)\n%-14s %10s %12s %12s %12s %12s\n", n, tok_path, "grammar", "compile ms",
               "cold us/tok", "warm us/tok", "warm p50 us", "warm p99 us");
    for (int c = 0; c < n_cases; c++) {
        uint64_t ct[5];
        td_gram_t *g = NULL;
        for (int k = 0; k < 5; k++) {
            td_gram_unref(g);
            g = NULL;
            uint64_t t0 = td_now_ns();
            if (td_gram_compile(cases[c].kind, cases[c].src, strlen(cases[c].src), &g) != TD_OK) {
                fprintf(stderr, "tandem bench grammar: %s: %s\n", cases[c].name, td_last_error());
                goto done;
            }
            ct[k] = td_now_ns() - t0;
        }
        qsort(ct, 5, sizeof *ct, cmp_u64);
        td_gram_matcher_t *m = NULL;
        td_status_t st = td_gram_matcher_create(g, v, &m);
        td_gram_unref(g);
        if (st != TD_OK)
            goto done;
        double cold = 0, warm = 0;
        for (int pass = 0; pass < 2 && st == TD_OK; pass++) {
            if ((st = walks(m, n, v, tokens, 12345, &w, is_eos)) != TD_OK)
                break;
            double sum = 0;
            for (int64_t i = 0; i < w.n; i++)
                sum += (double)w.ns[i];
            *(pass ? &warm : &cold) = sum / (double)w.n * 1e-3;
        }
        td_gram_matcher_destroy(m);
        if (st != TD_OK) {
            fprintf(stderr, "tandem bench grammar: %s: %s\n", cases[c].name, td_last_error());
            goto done;
        }
        qsort(w.ns, (size_t)w.n, sizeof *w.ns, cmp_u64);
        double p50 = (double)w.ns[w.n / 2] * 1e-3, p99 = (double)w.ns[w.n * 99 / 100] * 1e-3;
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "name", cases[c].name);
        bench_json_number(j, "compile_ms", (double)ct[2] * 1e-6, 3);
        bench_json_number(j, "cold_us_per_token", cold, 1);
        bench_json_number(j, "warm_us_per_token", warm, 1);
        bench_json_number(j, "warm_p50_us", p50, 1);
        bench_json_number(j, "warm_p99_us", p99, 1);
        cJSON_AddItemToArray(arr, j);
        items[c] = j;
        if (!json)
            printf("%-14s %10.3f %12.1f %12.1f %12.1f %12.1f\n", cases[c].name, (double)ct[2] * 1e-6, cold, warm, p50,
                   p99);
    }
    if (eng) {
        e2e_t e = {.eng = eng, .mc = td_engine_model_config(eng), .v = v, .gen = (int)gen, .temperature = temperature};
        cJSON_AddStringToObject(out, "model", model_path);
        cJSON_AddNumberToObject(out, "threads", threads > 0 ? (int)threads : td_cpu_count());
        cJSON_AddNumberToObject(out, "gen_tokens", (int)gen);
        cJSON_AddNumberToObject(out, "temperature", (double)temperature);
        if (!json)
            printf("\nend to end: %s, %d threads, %d decode steps a run, temperature %g, median of %d rounds\n"
                   "%-14s %5s %11s %11s %11s %7s %7s %12s %12s\n",
                   model_path, threads > 0 ? (int)threads : td_cpu_count(), (int)gen, (double)temperature, (int)reps, "grammar", "batch",
                   "free tok/s", "cold tok/s", "warm tok/s", "cold x", "warm x", "cold mask us", "warm mask us");
        for (int c = 0; c < n_cases; c++)
            if (e2e_case(&e, &cases[c], (int)reps, json, items[c]) != TD_OK) {
                fprintf(stderr, "tandem bench grammar: %s: %s\n", cases[c].name, td_last_error());
                goto done;
            }
    }
    rc = 0;
done:
    if (rc)
        fprintf(stderr, "tandem bench grammar: %s\n", td_last_error());
    if (json && rc == 0)
        rc = bench_json_print(stdout, out);
    else
        cJSON_Delete(out);
    free(w.ns);
    free(is_eos);
    free(own);
    td_gram_vocab_destroy(v);
    td_tokenizer_destroy(tok);
    td_engine_destroy(eng);
    td_backend_destroy(be);
    td_model_destroy(model);
    return rc;
}
