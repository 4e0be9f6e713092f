/*
 * Tests of td_tok on GGUF files: the vocab-only files of tests/fixtures/tokenizer/gguf (real
 * vocabularies cut short, one per pre-tokenizer and model kind; make_gguf_fixtures.py) encode
 * every text exactly as llama.cpp's llama-tokenize did on them, with special tokens parsed
 * (its default) and not (--no-parse-special); the BOS flag is the one llama-tokenize follows;
 * byte-level decoding gives the text back; bad files are errors that say what is wrong. With
 * TANDEM_TEST_GGUF naming SmolLM2-135M-Instruct.Q4_1.gguf, the real model's vocabulary is
 * checked against llama-tokenize's ids on it too.
 */
#include <criterion/criterion.h>

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_test_models.h"
#include "td_tokenizer.h"
#include "td_util.h"

typedef struct row {
    char *text;
    size_t len;
    int32_t *ids[2]; /* [0] special tokens parsed, [1] not */
    size_t n[2];
} row_t;

typedef struct rows {
    row_t *v;
    size_t n;
} rows_t;

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c - 'a' + 10;
}

static void read_ids(const cJSON *arr, int32_t **ids_p, size_t *n_p)
{
    const cJSON *it;
    cr_assert(cJSON_IsArray(arr));
    *n_p = (size_t)cJSON_GetArraySize(arr);
    *ids_p = malloc((*n_p + 1) * sizeof **ids_p);
    size_t k = 0;
    cJSON_ArrayForEach(it, arr) (*ids_p)[k++] = (int32_t)it->valuedouble;
}

/* tests/fixtures/tokenizer/gguf/<name>.jsonl */
static rows_t load_rows(const char *name)
{
    char rel[256];
    snprintf(rel, sizeof rel, "tokenizer/gguf/%s.jsonl", name);
    char *data = td_test_fixture_read(rel, 16u << 20, NULL);
    rows_t r = {0};
    size_t cap = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        cr_assert_not_null(j, "tests/fixtures/%s: bad line", rel);
        const cJSON *hex = cJSON_GetObjectItem(j, "hex");
        cr_assert(cJSON_IsString(hex));
        if (r.n == cap) {
            cap = cap ? cap * 2 : 64;
            r.v = realloc(r.v, cap * sizeof *r.v);
        }
        row_t *w = &r.v[r.n++];
        w->len = strlen(hex->valuestring) / 2;
        w->text = malloc(w->len + 1);
        for (size_t i = 0; i < w->len; i++)
            w->text[i] = (char)(hexval(hex->valuestring[2 * i]) * 16 + hexval(hex->valuestring[2 * i + 1]));
        w->text[w->len] = 0;
        read_ids(cJSON_GetObjectItem(j, "ids"), &w->ids[0], &w->n[0]);
        read_ids(cJSON_GetObjectItem(j, "ids_plain"), &w->ids[1], &w->n[1]);
        cJSON_Delete(j);
    }
    free(data);
    cr_assert_gt(r.n, 10, "tests/fixtures/%s: too few rows", rel);
    return r;
}

static void free_rows(rows_t *r)
{
    for (size_t i = 0; i < r->n; i++) {
        free(r->v[i].text);
        free(r->v[i].ids[0]);
        free(r->v[i].ids[1]);
    }
    free(r->v);
}

static void fixture_path(const char *name, char *path, size_t cap)
{
    snprintf(path, cap, "%s/tests/fixtures/tokenizer/gguf/%s.gguf", TD_SOURCE_DIR, name);
}

static td_tokenizer_t *load(const char *path)
{
    td_tokenizer_t *tok = NULL;
    cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK, "load %s: %s", path, td_last_error());
    return tok;
}

static void print_ids(const char *what, const int32_t *ids, size_t n)
{
    fprintf(stderr, "  %s (%zu):", what, n);
    for (size_t i = 0; i < n && i < 48; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, n > 48 ? " ...\n" : "\n");
}

/* Every row encodes to llama-tokenize's ids in both modes; byte-level vocabularies decode
 * the plain encoding back to the text. */
static void check_rows(td_tokenizer_t *tok, const char *name, bool check_decode)
{
    rows_t r = load_rows(name);
    size_t bad = 0;
    for (size_t i = 0; i < r.n; i++) {
        for (int mode = 0; mode < 2; mode++) {
            int32_t *ids;
            size_t n;
            unsigned flags = mode ? TD_TOK_NO_PARSE_SPECIAL : 0;
            cr_assert_eq(td_tokenizer_encode(tok, r.v[i].text, r.v[i].len, flags, &ids, &n), TD_OK,
                         "%s: encode row %zu: %s", name, i, td_last_error());
            if (n != r.v[i].n[mode] || memcmp(ids, r.v[i].ids[mode], n * sizeof *ids)) {
                if (bad++ < 6) {
                    fprintf(stderr, "%s row %zu%s: text \"%.80s\"\n", name, i, mode ? " (no parse special)" : "",
                            r.v[i].text);
                    print_ids("llama.cpp", r.v[i].ids[mode], r.v[i].n[mode]);
                    print_ids("td_tok   ", ids, n);
                }
            }
            free(ids);
        }
        if (check_decode) {
            char *text;
            size_t len;
            cr_assert_eq(td_tokenizer_decode(tok, r.v[i].ids[1], r.v[i].n[1], &text, &len), TD_OK);
            cr_expect(len == r.v[i].len && !memcmp(text, r.v[i].text, len), "%s row %zu: decode gives \"%s\", not \"%s\"",
                      name, i, text, r.v[i].text);
            free(text);
        }
    }
    cr_expect_eq(bad, 0, "%s: %zu of %zu encodings differ from llama.cpp's", name, bad, 2 * r.n);
    free_rows(&r);
}

/* The committed fixture <name>: rows, and the BOS flag llama-tokenize followed. */
static void check_fixture(const char *name, bool byte_level)
{
    char path[1024], rel[256];
    fixture_path(name, path, sizeof path);
    td_tokenizer_t *tok = load(path);
    check_rows(tok, name, byte_level);
    snprintf(rel, sizeof rel, "tokenizer/gguf/%s.meta.json", name);
    char *meta = td_test_fixture_read(rel, 4096, NULL);
    cJSON *j = cJSON_Parse(meta);
    cr_assert(cJSON_IsBool(cJSON_GetObjectItem(j, "add_bos")), "tests/fixtures/%s: no add_bos", rel);
    cr_expect_eq(td_tokenizer_add_bos(tok), cJSON_IsTrue(cJSON_GetObjectItem(j, "add_bos")),
                 "%s: add_bos differs from llama-tokenize's", name);
    cJSON_Delete(j);
    free(meta);
    td_tokenizer_destroy(tok);
}

Test(tok_gguf, smollm_matches_llama_cpp, .timeout = 60)
{
    check_fixture("smollm", true);
}

Test(tok_gguf, llama3_matches_llama_cpp, .timeout = 60)
{
    check_fixture("llama3", true);
}

Test(tok_gguf, qwen2_matches_llama_cpp, .timeout = 60)
{
    check_fixture("qwen2", true);
}

Test(tok_gguf, gpt2_matches_llama_cpp, .timeout = 60)
{
    check_fixture("gpt2", true);
}

Test(tok_gguf, default_pre_matches_llama_cpp, .timeout = 60)
{
    check_fixture("default", true);
}

Test(tok_gguf, sentencepiece_matches_llama_cpp, .timeout = 60)
{
    check_fixture("llama-spm", false);
}

Test(tok_gguf, special_ids_and_flags, .timeout = 30)
{
    char path[1024];
    fixture_path("smollm", path, sizeof path);
    td_tokenizer_t *tok = load(path);
    /* SmolLM2: bos <|im_start|> 1, eos <|im_end|> 2, pad 2; <|endoftext|> 0 ends a turn too */
    cr_expect_eq(td_tokenizer_bos_id(tok), 1);
    cr_expect_eq(td_tokenizer_pad_id(tok), 2);
    cr_expect_not(td_tokenizer_add_bos(tok));
    cr_expect_not(td_tokenizer_add_eos(tok));
    const int32_t *eos;
    size_t n_eos = td_tokenizer_eos_ids(tok, &eos);
    cr_assert_geq(n_eos, 2);
    cr_expect_eq(eos[0], 2, "the file's eos_token_id comes first (TD_TOK_ADD_EOS appends it)");
    cr_expect(td_tokenizer_is_eos(tok, 0));
    cr_expect(td_tokenizer_is_special(tok, 1) && !td_tokenizer_is_special(tok, 100));
    cr_expect_eq(td_tokenizer_piece_to_id(tok, "<|im_start|>", 12), 1);

    /* control tokens are skipped when decoding, the rest is byte-level text */
    int32_t *ids;
    size_t n;
    const char *chat = "<|im_start|>user\nHi<|im_end|>";
    cr_assert_eq(td_tokenizer_encode(tok, chat, strlen(chat), TD_TOK_ADD_BOS | TD_TOK_ADD_EOS, &ids, &n), TD_OK);
    cr_assert_geq(n, 4);
    cr_expect(ids[0] == 1 && ids[1] == 1 && ids[n - 2] == 2 && ids[n - 1] == 2, "BOS, <|im_start|> ... <|im_end|>, EOS");
    char *text;
    cr_assert_eq(td_tokenizer_decode(tok, ids, n, &text, NULL), TD_OK);
    cr_expect_str_eq(text, "user\nHi");
    free(text);
    free(ids);
    td_tokenizer_destroy(tok);

    fixture_path("llama-spm", path, sizeof path);
    tok = load(path);
    cr_expect_eq(td_tokenizer_bos_id(tok), 1);
    cr_expect(td_tokenizer_add_bos(tok), "a SentencePiece GGUF says add_bos_token = true");
    cr_expect(td_tokenizer_is_eos(tok, 2));
    td_tokenizer_destroy(tok);
}

/* A copy of fixture `name` in a temporary file with the first `from` after `key` replaced by
 * `to` (same length): a file that differs in one value. */
static void patched_copy(const char *name, const char *key, const char *from, const char *to, char *out, size_t cap)
{
    char rel[256];
    size_t len;
    snprintf(rel, sizeof rel, "tokenizer/gguf/%s.gguf", name);
    char *data = td_test_fixture_read(rel, 16u << 20, &len);
    cr_assert_eq(strlen(from), strlen(to));
    char *k = memmem(data, len, key, strlen(key));
    cr_assert_not_null(k, "%s has no key %s", rel, key);
    char *v = memmem(k, len - (size_t)(k - data), from, strlen(from));
    cr_assert_not_null(v);
    memcpy(v, to, strlen(to));
    snprintf(out, cap, "/tmp/td_tok_gguf_%d_%s.gguf", (int)getpid(), to);
    td_test_write_file(out, data, len);
    free(data);
}

static void expect_refused(const char *path, td_status_t want, const char *needle)
{
    td_tokenizer_t *tok = NULL;
    td_status_t st = td_tokenizer_load(path, &tok);
    cr_expect_eq(st, want, "%s: status %d (%s), want %d", path, st, td_last_error(), want);
    cr_expect_null(tok);
    cr_expect(strstr(td_last_error(), needle), "message \"%s\" does not name \"%s\"", td_last_error(), needle);
    unlink(path);
}

Test(tok_gguf, unsupported_and_broken_files_are_errors, .timeout = 30)
{
    char path[512];
    patched_copy("smollm", "tokenizer.ggml.pre", "smollm", "smolxx", path, sizeof path);
    expect_refused(path, TD_ERR_UNSUPPORTED, "\"smolxx\"");
    patched_copy("smollm", "tokenizer.ggml.model", "gpt2", "bert", path, sizeof path);
    expect_refused(path, TD_ERR_UNSUPPORTED, "\"bert\"");
    patched_copy("smollm", "tokenizer.ggml.tokens", "tokenizer.ggml.tokens", "tokenizer.ggml.tokenz", path,
                 sizeof path);
    expect_refused(path, TD_ERR_NOT_FOUND, "tokenizer.ggml.tokens");

    /* cut short: td_gguf says where */
    size_t len;
    char *data = td_test_fixture_read("tokenizer/gguf/smollm.gguf", 16u << 20, &len);
    snprintf(path, sizeof path, "/tmp/td_tok_gguf_%d_cut.gguf", (int)getpid());
    td_test_write_file(path, data, len / 3);
    free(data);
    td_tokenizer_t *tok = NULL;
    cr_expect_eq(td_tokenizer_load(path, &tok), TD_ERR_FORMAT, "%s", td_last_error());
    cr_expect_null(tok);
    unlink(path);
}

Test(tok_gguf, real_smollm2_matches_llama_cpp, .timeout = 120)
{
    const char *path = getenv("TANDEM_TEST_GGUF");
    if (!path || access(path, R_OK) != 0)
        cr_skip_test("TANDEM_TEST_GGUF does not name a file (set it to SmolLM2-135M-Instruct.Q4_1.gguf, "
                     "scripts/fetch-model prints its path)");
    td_tokenizer_t *tok = load(path);
    cr_expect_eq(td_tokenizer_vocab_size(tok), 49152);
    cr_expect_not(td_tokenizer_add_bos(tok), "SmolLM2's file says add_bos_token = false");
    check_rows(tok, "smollm2-real", true);
    td_tokenizer_destroy(tok);
}
