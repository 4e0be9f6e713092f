/*
 * bench grammar: what constrained decoding costs on the CPU, per token, over a real
 * vocabulary (docs/grammar.md "How fast"). For each grammar: the compile time (median of 5),
 * then seeded random walks (each next token drawn uniformly from the allowed ones, a walk
 * restarted when it ends) timing td_gram_fill_mask + td_gram_accept_token per token (not
 * the benchmark's own draw): the
 * first pass fills the per-position caches (cold), the second pass repeats the same walks
 * on the filled caches (warm: what a long-running server sees).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_bench.h"
#include "td_constrain.h"
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

int bench_grammar(int argc, char **argv)
{
    bool json = false;
    const char *tok_path = NULL, *schema = NULL;
    int64_t tokens = 2000;
    const td_opt_t opts[] = {
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &json, .help = "one JSON document on stdout (docs/bench.md)"},
        {.name = "tokenizer", .type = TD_OPT_STR, .ptr = &tok_path, .arg = "PATH",
         .help = "the vocabulary: a GGUF model, tokenizer.json or directory (required)"},
        {.name = "json-schema", .type = TD_OPT_STR, .ptr = &schema, .arg = "FILE",
         .help = "a schema of your own instead of the built-in three"},
        {.name = "tokens", .type = TD_OPT_I64, .ptr = &tokens, .min = 10, .max = 10000000, .arg = "N",
         .help = "tokens walked per grammar and pass (default 2000)"},
    };
    td_opts_t spec = {.prog = "bench grammar", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r_opts = {0};
    if (td_opts_parse(&spec, argc, argv, &r_opts) != TD_OK)
        return 2;
    if (r_opts.help || !tok_path) {
        printf("usage: tandem bench grammar --tokenizer PATH [--json-schema FILE] [--tokens N] [--json]\n"
               "  per-token mask time of constrained decoding over PATH's vocabulary: compile time,\n"
               "  then random walks with cold and warm per-position caches (docs/grammar.md).\n\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), false);
        return r_opts.help ? 0 : 2;
    }
    td_tokenizer_t *tok = NULL;
    td_gram_vocab_t *v = NULL;
    char *own = NULL;
    uint8_t *is_eos = NULL;
    walk_stats_t w = {0};
    int rc = 1;
    cJSON *out = cJSON_CreateObject(), *arr = cJSON_AddArrayToObject(out, "grammars");
    cJSON_AddStringToObject(out, "bench", "grammar");
    if (td_tokenizer_load(tok_path, &tok) != TD_OK)
        goto done;
    int32_t n = td_tokenizer_vocab_size(tok);
    if (td_constrain_vocab(tok, n, NULL, 0, &v) != TD_OK)
        goto done;
    is_eos = calloc((size_t)n, 1);
    w.ns = malloc((size_t)tokens * sizeof *w.ns);
    if (!is_eos || !w.ns)
        goto done;
    for (int32_t i = 0; i < n; i++)
        is_eos[i] = td_tokenizer_is_eos(tok, i);
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
        if (!json)
            printf("%-14s %10.3f %12.1f %12.1f %12.1f %12.1f\n", cases[c].name, (double)ct[2] * 1e-6, cold, warm, p50,
                   p99);
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
    return rc;
}
