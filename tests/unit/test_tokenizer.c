/*
 * Tests of module td_tok: every reference fixture of tests/fixtures/tokenizer (made by
 * make_fixtures.py with HF tokenizers / sentencepiece) encodes and decodes exactly as the
 * reference; the streaming detokenizer agrees with decode and never splits a UTF-8
 * character; malformed files are refused with an error. Real vocabularies come from
 * ../shared/models (TANDEM_TEST_MODELS) and their tests skip when it is absent.
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

/* ---- helpers ---- */

typedef struct row {
    char *text;
    size_t len;
    int32_t *ids;
    size_t n;
} row_t;

typedef struct rows {
    row_t *v;
    size_t n;
} rows_t;

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c - 'a' + 10;
}

/* Reads tests/fixtures/tokenizer/<name>.<kind>.jsonl */
static rows_t load_rows(const char *name, const char *kind)
{
    char rel[256];
    snprintf(rel, sizeof rel, "tokenizer/%s.%s.jsonl", name, kind);
    char *data = td_test_fixture_read(rel, 64u << 20, NULL);
    rows_t r = {0};
    size_t cap = 0;
    for (char *line = strtok(data, "\n"); line; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        cr_assert_not_null(j, "tests/fixtures/%s: bad line", rel);
        const cJSON *hex = cJSON_GetObjectItem(j, "hex"), *ids = cJSON_GetObjectItem(j, "ids"), *it;
        cr_assert(cJSON_IsString(hex) && cJSON_IsArray(ids));
        if (r.n == cap) {
            cap = cap ? cap * 2 : 64;
            r.v = realloc(r.v, cap * sizeof *r.v);
        }
        row_t *w = &r.v[r.n++];
        size_t hl = strlen(hex->valuestring);
        w->len = hl / 2;
        w->text = malloc(w->len + 1);
        for (size_t i = 0; i < w->len; i++)
            w->text[i] = (char)(hexval(hex->valuestring[2 * i]) * 16 + hexval(hex->valuestring[2 * i + 1]));
        w->text[w->len] = 0;
        w->n = (size_t)cJSON_GetArraySize(ids);
        w->ids = malloc((w->n + 1) * sizeof *w->ids);
        size_t k = 0;
        cJSON_ArrayForEach(it, ids) w->ids[k++] = (int32_t)it->valuedouble;
        cJSON_Delete(j);
    }
    free(data);
    return r;
}

static void free_rows(rows_t *r)
{
    for (size_t i = 0; i < r->n; i++) {
        free(r->v[i].text);
        free(r->v[i].ids);
    }
    free(r->v);
}

/* Loads a tokenizer under ../shared/models, or skips the test. */
static td_tokenizer_t *load_shared(const char *rel)
{
    char path[1024];
    td_test_model_file(rel, path, sizeof path);
    td_tokenizer_t *tok = NULL;
    cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK, "load %s: %s", path, td_last_error());
    return tok;
}

static td_tokenizer_t *load_fixture_tok(const char *rel)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/fixtures/tokenizer/%s", TD_SOURCE_DIR, rel);
    td_tokenizer_t *tok = NULL;
    cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK, "load %s: %s", path, td_last_error());
    return tok;
}

static void print_ids(const char *what, const int32_t *ids, size_t n)
{
    fprintf(stderr, "  %s (%zu):", what, n);
    for (size_t i = 0; i < n && i < 64; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, n > 64 ? " ...\n" : "\n");
}

static void check_encode(td_tokenizer_t *tok, const char *name)
{
    rows_t r = load_rows(name, "encode");
    size_t bad = 0;
    for (size_t i = 0; i < r.n; i++) {
        int32_t *ids;
        size_t n;
        cr_assert_eq(td_tokenizer_encode(tok, r.v[i].text, r.v[i].len, 0, &ids, &n), TD_OK, "%s: encode row %zu: %s",
                     name, i, td_last_error());
        if (n != r.v[i].n || memcmp(ids, r.v[i].ids, n * sizeof *ids)) {
            if (bad++ < 5) {
                fprintf(stderr, "%s row %zu: text \"%.80s\"\n", name, i, r.v[i].text);
                print_ids("want", r.v[i].ids, r.v[i].n);
                print_ids("got ", ids, n);
            }
        }
        free(ids);
    }
    cr_expect_eq(bad, 0, "%s: %zu of %zu encode fixtures differ from the reference", name, bad, r.n);
    free_rows(&r);
}

static void check_decode(td_tokenizer_t *tok, const char *name)
{
    rows_t r = load_rows(name, "decode");
    size_t bad = 0;
    for (size_t i = 0; i < r.n; i++) {
        char *text;
        size_t len;
        cr_assert_eq(td_tokenizer_decode(tok, r.v[i].ids, r.v[i].n, &text, &len), TD_OK, "%s: decode row %zu: %s",
                     name, i, td_last_error());
        cr_assert_eq(strlen(text), len < strlen(text) ? strlen(text) : strlen(text)); /* NUL-terminated */
        if (len != r.v[i].len || memcmp(text, r.v[i].text, len)) {
            if (bad++ < 5)
                fprintf(stderr, "%s decode row %zu:\n  want \"%.100s\"\n  got  \"%.100s\"\n", name, i, r.v[i].text, text);
        }
        free(text);
    }
    cr_expect_eq(bad, 0, "%s: %zu of %zu decode fixtures differ from the reference", name, bad, r.n);
    free_rows(&r);
}

/* True if s[0..n) is complete, valid UTF-8 (no character cut at either end). */
static bool valid_utf8(const char *s, size_t n)
{
    const uint8_t *u = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        size_t k = u[i] < 0x80 ? 1 : (u[i] & 0xE0) == 0xC0 ? 2 : (u[i] & 0xF0) == 0xE0 ? 3 : (u[i] & 0xF8) == 0xF0 ? 4 : 0;
        if (!k || i + k > n)
            return false;
        for (size_t j = 1; j < k; j++)
            if ((u[i + j] & 0xC0) != 0x80)
                return false;
        i += k;
    }
    return true;
}

/* Streams each encode fixture (with BOS where there is one) through td_detok_t. */
static void check_stream(td_tokenizer_t *tok, const char *name)
{
    rows_t r = load_rows(name, "encode");
    int32_t bos = td_tokenizer_bos_id(tok);
    for (size_t i = 0; i < r.n; i++) {
        size_t n = 0;
        int32_t *ids = malloc((r.v[i].n + 1) * sizeof *ids);
        if (bos >= 0)
            ids[n++] = bos;
        memcpy(ids + n, r.v[i].ids, r.v[i].n * sizeof *ids);
        n += r.v[i].n;
        char *want;
        size_t want_len;
        cr_assert_eq(td_tokenizer_decode(tok, ids, n, &want, &want_len), TD_OK);
        char *got = malloc(want_len + 16);
        size_t got_len = 0;
        td_detok_t d;
        td_detok_init(&d, tok);
        for (size_t k = 0; k <= n; k++) {
            const char *t;
            size_t tl;
            if (k < n)
                cr_assert_eq(td_detok_push(&d, ids[k], &t, &tl), TD_OK);
            else
                cr_assert_eq(td_detok_flush(&d, &t, &tl), TD_OK);
            cr_assert(valid_utf8(t, tl), "%s row %zu: token %zu emitted a partial UTF-8 character", name, i, k);
            cr_assert_leq(got_len + tl, want_len, "%s row %zu: stream longer than decode", name, i);
            memcpy(got + got_len, t, tl);
            got_len += tl;
        }
        td_detok_free(&d);
        cr_assert(got_len == want_len && !memcmp(got, want, want_len), "%s row %zu: stream != decode", name, i);
        free(got);
        free(want);
        free(ids);
    }
    free_rows(&r);
}

static void check_all(td_tokenizer_t *tok, const char *name)
{
    check_encode(tok, name);
    check_decode(tok, name);
    check_stream(tok, name);
}

/* The vocabulary's size, its BOS id (-1: none) and one of its EOS ids. */
static void expect_vocab(td_tokenizer_t *tok, int32_t vocab_size, int32_t bos_id, int32_t eos_id)
{
    cr_expect_eq(td_tokenizer_vocab_size(tok), vocab_size, "vocab size %d, want %d", td_tokenizer_vocab_size(tok),
                 vocab_size);
    cr_expect_eq(td_tokenizer_bos_id(tok), bos_id, "bos %d, want %d", td_tokenizer_bos_id(tok), bos_id);
    cr_expect(td_tokenizer_is_eos(tok, eos_id), "%d is not an eos id", eos_id);
}

/* ---- the real vocabularies ---- */

Test(tokenizer, llama2_bin_matches_sentencepiece, .timeout = 60)
{
    td_tokenizer_t *tok = load_shared("llama2-tokenizer/tokenizer.bin");
    expect_vocab(tok, 32000, 1, 2);
    cr_expect(td_tokenizer_add_bos(tok) && !td_tokenizer_add_eos(tok), "llama2.c prompts start with BOS");
    size_t len;
    cr_expect_str_eq(td_tokenizer_id_to_piece(tok, 13, &len), "<0x0A>");
    cr_expect_null(td_tokenizer_id_to_piece(tok, 32000, &len));
    check_all(tok, "llama2");
    td_tokenizer_destroy(tok);
}

Test(tokenizer, mistral_json_matches_hf, .timeout = 60)
{
    td_tokenizer_t *tok = load_shared("tokenizers/mistral");
    expect_vocab(tok, 32000, 1, 2);
    cr_expect(td_tokenizer_add_bos(tok) && !td_tokenizer_add_eos(tok), "tokenizer_config.json: add_bos_token true");
    cr_expect_eq(td_tokenizer_piece_to_id(tok, "\xe2\x96\x81the", 6), 272);
    check_all(tok, "mistral");
    td_tokenizer_destroy(tok);
}

Test(tokenizer, llama3_json_matches_hf, .timeout = 60)
{
    td_tokenizer_t *tok = load_shared("tokenizers/llama3");
    expect_vocab(tok, 128256, 128000, 128001);
    cr_expect(td_tokenizer_is_eos(tok, 128009)); /* <|eot_id|> ends a chat turn */
    cr_expect(td_tokenizer_add_bos(tok), "no add_bos_token in the config: BOS, as transformers");
    cr_expect(td_tokenizer_is_special(tok, 128000));
    size_t len;
    cr_expect_str_eq(td_tokenizer_id_to_piece(tok, 128000, &len), "<|begin_of_text|>");
    check_all(tok, "llama3");
    td_tokenizer_destroy(tok);
}

Test(tokenizer, qwen3_json_matches_hf, .timeout = 60)
{
    td_tokenizer_t *tok = load_shared("tokenizers/qwen3/tokenizer.json");
    expect_vocab(tok, 151669, -1, 151645); /* eos: <|im_end|> */
    cr_expect_not(td_tokenizer_add_bos(tok), "Qwen has no BOS");
    check_all(tok, "qwen3");
    td_tokenizer_destroy(tok);
}

Test(tokenizer, minimal_bytelevel_json, .timeout = 30)
{
    td_tokenizer_t *tok = load_fixture_tok("bytelevel");
    expect_vocab(tok, 258, 256, 257);
    check_all(tok, "bytelevel");
    td_tokenizer_destroy(tok);
}

Test(tokenizer, add_bos_eos_flags, .timeout = 30)
{
    td_tokenizer_t *tok = load_fixture_tok("bytelevel/tokenizer.json");
    int32_t *ids;
    size_t n;
    cr_assert_eq(td_tokenizer_encode(tok, "hi", 2, TD_TOK_ADD_BOS | TD_TOK_ADD_EOS, &ids, &n), TD_OK);
    cr_assert_eq(n, 4);
    cr_expect_eq(ids[0], 256);
    cr_expect_eq(ids[1], 'h');
    cr_expect_eq(ids[2], 'i');
    cr_expect_eq(ids[3], 257);
    free(ids);
    cr_assert_eq(td_tokenizer_encode(tok, "", 0, 0, &ids, &n), TD_OK);
    cr_expect_eq(n, 0);
    cr_expect_not_null(ids);
    free(ids);
    td_tokenizer_destroy(tok);
}

/* ---- a small hand-made tokenizer.bin (needs no shared data) ---- */

typedef struct tmpdir {
    char path[256];
} tmpdir_t;

static void tmp_make(tmpdir_t *t)
{
    snprintf(t->path, sizeof t->path, "/tmp/td_tok_test_XXXXXX");
    cr_assert_not_null(mkdtemp(t->path));
}

static void tmp_remove(tmpdir_t *t)
{
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", t->path);
    cr_expect_eq(system(cmd), 0);
}

static void bin_add(char **buf, size_t *len, float score, const char *s)
{
    int32_t l = (int32_t)strlen(s);
    *buf = realloc(*buf, *len + 8 + (size_t)l);
    memcpy(*buf + *len, &score, 4);
    memcpy(*buf + *len + 4, &l, 4);
    memcpy(*buf + *len + 8, s, (size_t)l);
    *len += 8 + (size_t)l;
}

/* <unk> <s> </s> <0x00>..<0xFF> then " ", "a", "b", "ab", " a", " ab" (ids 259..264) */
static char *small_bin(size_t *len_p)
{
    char *buf = malloc(4);
    int32_t max_len = 8;
    memcpy(buf, &max_len, 4);
    size_t len = 4;
    bin_add(&buf, &len, 0, "<unk>");
    bin_add(&buf, &len, 0, "\n<s>\n");
    bin_add(&buf, &len, 0, "\n</s>\n");
    for (int b = 0; b < 256; b++) {
        char p[8];
        snprintf(p, sizeof p, "<0x%02X>", b);
        bin_add(&buf, &len, 0, p);
    }
    bin_add(&buf, &len, -1, " ");
    bin_add(&buf, &len, -2, "a");
    bin_add(&buf, &len, -3, "b");
    bin_add(&buf, &len, -4, "ab");
    bin_add(&buf, &len, -5, " a");
    bin_add(&buf, &len, -6, " ab");
    *len_p = len;
    return buf;
}

Test(tokenizer, small_bin_encode_decode, .timeout = 30)
{
    tmpdir_t t;
    tmp_make(&t);
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer.bin", t.path);
    size_t len;
    char *bin = small_bin(&len);
    td_test_write_file(path, bin, len);
    td_tokenizer_t *tok = NULL;
    cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK, "%s", td_last_error());
    int32_t *ids;
    size_t n;
    /* dummy prefix: " ab"; best score first: "a"+"b" (-4) before " "+"a" (-5), then " "+"ab" */
    cr_assert_eq(td_tokenizer_encode(tok, "ab", 2, TD_TOK_ADD_BOS, &ids, &n), TD_OK);
    cr_assert_eq(n, 2);
    cr_expect_eq(ids[0], 1);
    cr_expect_eq(ids[1], 264);
    free(ids);
    /* "é" is not in the vocabulary: byte fallback 0xC3 0xA9 */
    cr_assert_eq(td_tokenizer_encode(tok, "\xc3\xa9", 2, 0, &ids, &n), TD_OK);
    cr_assert_eq(n, 3);
    cr_expect_eq(ids[0], 259);
    cr_expect_eq(ids[1], 3 + 0xC3);
    cr_expect_eq(ids[2], 3 + 0xA9);
    char *text;
    cr_assert_eq(td_tokenizer_decode(tok, ids, n, &text, NULL), TD_OK);
    cr_expect_str_eq(text, "\xc3\xa9");
    free(text);
    /* the streaming detokenizer holds 0xC3 until 0xA9 arrives */
    td_detok_t d;
    td_detok_init(&d, tok);
    const char *o;
    size_t ol;
    cr_assert_eq(td_detok_push(&d, ids[0], &o, &ol), TD_OK);
    cr_expect_eq(ol, 0); /* the dummy-prefix space is dropped at the start */
    cr_assert_eq(td_detok_push(&d, ids[1], &o, &ol), TD_OK);
    cr_expect_eq(ol, 0);
    cr_assert_eq(td_detok_push(&d, ids[2], &o, &ol), TD_OK);
    cr_expect_eq(ol, 2);
    cr_expect_eq(td_detok_push(&d, 100000, &o, &ol), TD_ERR_RANGE);
    /* a lone lead byte at the end of a stream comes out as U+FFFD */
    cr_assert_eq(td_detok_push(&d, 3 + 0xE6, &o, &ol), TD_OK);
    cr_expect_eq(ol, 0);
    cr_assert_eq(td_detok_flush(&d, &o, &ol), TD_OK);
    cr_expect_str_eq(o, "\xef\xbf\xbd");
    td_detok_free(&d);
    free(ids);
    td_tokenizer_destroy(tok);

    /* truncations at every length are refused, never a crash */
    for (size_t cut = 0; cut < len; cut += cut < 64 ? 1 : 97) {
        td_test_write_file(path, bin, cut);
        tok = NULL;
        td_status_t st = td_tokenizer_load(path, &tok);
        if (cut == 4 + 13 + 13) /* ends right after a whole record but < 3 tokens */
            cr_expect_neq(st, TD_OK);
        if (st == TD_OK)
            td_tokenizer_destroy(tok); /* a cut at a record boundary is a smaller valid file */
        else
            cr_expect(strstr(td_last_error(), path) != NULL, "error does not name the file: %s", td_last_error());
    }
    td_test_write_file(path, bin, len - 1);
    cr_expect_eq(td_tokenizer_load(path, &tok), TD_ERR_FORMAT);
    cr_expect(strstr(td_last_error(), "truncated") != NULL, "%s", td_last_error());
    free(bin);
    tmp_remove(&t);
}

/* ---- malformed inputs ---- */

static td_status_t load_text(const tmpdir_t *t, const char *name, const char *content)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", t->path, name);
    td_test_write_file(path, content, strlen(content));
    td_tokenizer_t *tok = (td_tokenizer_t *)(uintptr_t)1;
    td_status_t st = td_tokenizer_load(path, &tok);
    if (st == TD_OK)
        td_tokenizer_destroy(tok);
    else
        cr_expect_eq(tok, (td_tokenizer_t *)(uintptr_t)1, "output written on failure");
    return st;
}

Test(tokenizer, malformed_files_are_errors, .timeout = 30)
{
    tmpdir_t t;
    tmp_make(&t);
    td_tokenizer_t *tok = NULL;
    char path[512];

    snprintf(path, sizeof path, "%s/missing.json", t.path);
    cr_expect_eq(td_tokenizer_load(path, &tok), TD_ERR_IO);
    cr_expect(strstr(td_last_error(), "missing.json") != NULL, "%s", td_last_error());
    cr_expect_eq(td_tokenizer_load(t.path, &tok), TD_ERR_NOT_FOUND); /* empty directory */

    cr_expect_eq(load_text(&t, "empty.bin", ""), TD_ERR_FORMAT);
    cr_expect_eq(load_text(&t, "bad.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0,"), TD_ERR_FORMAT);
    cr_expect(strstr(td_last_error(), "invalid JSON") != NULL, "%s", td_last_error());
    cr_expect_eq(load_text(&t, "nomodel.json", "{\"version\": \"1.0\"}"), TD_ERR_FORMAT);
    cr_expect(strstr(td_last_error(), "model") != NULL, "%s", td_last_error());
    cr_expect_eq(load_text(&t, "unigram.json", "{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\", 0.0]]}}"),
                 TD_ERR_UNSUPPORTED);
    cr_expect(strstr(td_last_error(), "Unigram") != NULL, "%s", td_last_error());
    cr_expect_eq(load_text(&t, "vocabarr.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": [], \"merges\": []}}"),
                 TD_ERR_FORMAT);
    cr_expect_eq(load_text(&t, "badid.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -3}, \"merges\": []}}"),
                 TD_ERR_FORMAT);
    cr_expect_eq(load_text(&t, "dupid.json",
                           "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 0}, \"merges\": []}}"),
                 TD_ERR_FORMAT);
    cr_expect_eq(load_text(&t, "badmerge.json",
                           "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [7]}}"),
                 TD_ERR_FORMAT);
    cr_expect_eq(load_text(&t, "badnorm.json",
                           "{\"normalizer\": {\"type\": \"Lowercase\"}, "
                           "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}"),
                 TD_ERR_UNSUPPORTED);
    cr_expect_eq(load_text(&t, "badre.json",
                           "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, "
                           "\"behavior\": \"Isolated\", \"invert\": false}, "
                           "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}"),
                 TD_ERR_UNSUPPORTED);
    cr_expect_eq(load_text(&t, "badadded.json",
                           "{\"added_tokens\": [{\"id\": \"x\"}], "
                           "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}"),
                 TD_ERR_FORMAT);
    cr_expect_eq(load_text(&t, "fallback.json",
                           "{\"model\": {\"type\": \"BPE\", \"byte_fallback\": true, \"vocab\": {\"a\": 0}, \"merges\": []}}"),
                 TD_ERR_FORMAT);
    /* a minimal valid one loads, and a character it cannot represent is an encode error */
    cr_expect_eq(load_text(&t, "ok.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, "
                                          "\"merges\": [\"a b\"]}}"),
                 TD_OK);
    snprintf(path, sizeof path, "%s/ok.json", t.path);
    cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK);
    int32_t *ids;
    size_t n;
    cr_assert_eq(td_tokenizer_encode(tok, "abab", 4, 0, &ids, &n), TD_OK);
    cr_expect_eq(n, 2);
    cr_expect_eq(ids[0], 2);
    free(ids);
    cr_expect_eq(td_tokenizer_encode(tok, "abc", 3, 0, &ids, &n), TD_ERR_FORMAT);
    td_tokenizer_destroy(tok);
    td_tokenizer_destroy(NULL);
    tmp_remove(&t);
}

/* load_text's status, and the error must contain needle (NULL: it must load). */
static void expect_load(const tmpdir_t *t, const char *name, const char *content, td_status_t want, const char *needle)
{
    td_clear_error();
    td_status_t st = load_text(t, name, content);
    cr_expect_eq(st, want, "%s: %s, expected %s (%s)", name, td_status_name(st), td_status_name(want),
                 td_last_error());
    if (needle)
        cr_expect(strstr(td_last_error(), needle) != NULL, "%s: \"%s\" lacks \"%s\"", name, td_last_error(), needle);
    if (want != TD_OK)
        cr_expect(strstr(td_last_error(), name) != NULL, "%s: error does not name the file: %s", name,
                  td_last_error());
}

/* The format comes from the file's name, never guessed from its bytes when the name says. */
Test(tokenizer, format_from_the_name, .timeout = 30)
{
    tmpdir_t t;
    tmp_make(&t);
    expect_load(&t, "tokenizer.json", "", TD_ERR_FORMAT,
                "tokenizer.json: empty file (0 bytes): expected a tokenizer.json object");
    expect_load(&t, "blank.json", " \n\t", TD_ERR_FORMAT, "empty file (3 bytes, all blank): expected a tokenizer.json");
    expect_load(&t, "tokenizer.bin", "", TD_ERR_FORMAT, "empty file (0 bytes): expected a llama2.c tokenizer.bin");
    expect_load(&t, "tok", "", TD_ERR_FORMAT, "empty file (0 bytes): expected a tokenizer.json or a llama2.c");
    /* a directory's tokenizer.json is JSON too */
    td_tokenizer_t *tok = NULL;
    cr_expect_eq(td_tokenizer_load(t.path, &tok), TD_ERR_FORMAT); /* the empty tokenizer.json written above */
    cr_expect(strstr(td_last_error(), "tokenizer.json: empty file") != NULL, "%s", td_last_error());
    /* bytes that are not JSON in a *.json file: a JSON error, not a llama2.c one */
    expect_load(&t, "binary.json", "\x08\x00\x00\x00junk", TD_ERR_FORMAT, "invalid JSON");
    /* JSON under a *.bin name: llama2.c's format, with a hint */
    expect_load(&t, "json.bin", "{\"model\": {}}", TD_ERR_FORMAT,
                "it starts like JSON: a tokenizer.json must be named *.json");

    /* a UTF-8 byte-order mark is skipped: the same tokenizer, the same ids */
    char src[512], path[512];
    snprintf(src, sizeof src, "%s/tests/fixtures/tokenizer/bytelevel/tokenizer.json", TD_SOURCE_DIR);
    size_t len;
    char *data = td_test_fixture_read("tokenizer/bytelevel/tokenizer.json", 64u << 20, &len);
    char *bom = malloc(len + 3);
    memcpy(bom, "\xef\xbb\xbf", 3);
    memcpy(bom + 3, data, len);
    snprintf(path, sizeof path, "%s/bom.json", t.path);
    td_test_write_file(path, bom, len + 3);
    td_tokenizer_t *a = NULL, *b = NULL;
    cr_assert_eq(td_tokenizer_load(src, &a), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_tokenizer_load(path, &b), TD_OK, "%s", td_last_error());
    int32_t *ia, *ib;
    size_t na, nb;
    cr_assert_eq(td_tokenizer_encode(a, "h\xc3\xa9llo", 6, 0, &ia, &na), TD_OK);
    cr_assert_eq(td_tokenizer_encode(b, "h\xc3\xa9llo", 6, 0, &ib, &nb), TD_OK);
    cr_expect(na == nb && !memcmp(ia, ib, na * sizeof *ia));
    free(ia);
    free(ib);
    td_tokenizer_destroy(a);
    td_tokenizer_destroy(b);
    free(bom);
    free(data);
    tmp_remove(&t);
}

#define BPE(vocab, merges, added) \
    "{\"added_tokens\": [" added "], \"model\": {\"type\": \"BPE\", \"vocab\": {" vocab "}, \"merges\": [" merges "]}}"

/* ids 0..n-1 with no gap, no id or token twice, merges and added tokens that agree with
 * the vocabulary: each refusal names the file, the id or token and what is wrong. */
Test(tokenizer, vocabulary_complete_and_consistent, .timeout = 30)
{
    tmpdir_t t;
    tmp_make(&t);
    expect_load(&t, "ok.json", BPE("\"a\": 0, \"b\": 1, \"ab\": 2", "\"a b\"", "{\"id\": 3, \"content\": \"<s>\"}"),
                TD_OK, NULL);
    expect_load(&t, "gap.json", BPE("\"a\": 0, \"b\": 2", "", ""), TD_ERR_FORMAT,
                "gap.json: no token has id 1: the ids of model.vocab and added_tokens must be 0..2 with no gap");
    expect_load(&t, "gap_added.json", BPE("\"a\": 0", "", "{\"id\": 2, \"content\": \"<s>\"}"), TD_ERR_FORMAT,
                "no token has id 1");
    expect_load(&t, "dupid.json", BPE("\"a\": 0, \"b\": 0", "", ""), TD_ERR_FORMAT,
                "id 0 appears twice in model.vocab");
    expect_load(&t, "duptok.json", BPE("\"a\": 0, \"a\": 1", "", ""), TD_ERR_FORMAT,
                "duptok.json: token \"a\" has two ids in model.vocab, 0 and 1");
    expect_load(&t, "mergeleft.json", BPE("\"a\": 0, \"b\": 1, \"ab\": 2", "\"a b\", \"c b\"", ""), TD_ERR_FORMAT,
                "mergeleft.json: merge 1 \"c b\" names its left token, which is not in model.vocab");
    expect_load(&t, "mergeright.json", BPE("\"a\": 0, \"b\": 1, \"ab\": 2", "[\"a\", \"x\"]", ""), TD_ERR_FORMAT,
                "merge 0 \"a x\" names its right token");
    expect_load(&t, "mergeresult.json", BPE("\"a\": 0, \"b\": 1, \"ab\": 2", "\"a b\", \"b a\"", ""), TD_ERR_FORMAT,
                "merge 1 \"b a\" names the merged token");
    expect_load(&t, "addedother.json", BPE("\"a\": 0, \"b\": 1", "", "{\"id\": 0, \"content\": \"x\"}"),
                TD_ERR_FORMAT, "addedother.json: added_tokens gives id 0 to \"x\", but model.vocab gives it to \"a\"");
    expect_load(&t, "addedsame.json", BPE("\"a\": 0, \"b\": 1", "", "{\"id\": 0, \"content\": \"a\"}"), TD_OK, NULL);
    expect_load(&t, "addedtwice.json",
                BPE("\"a\": 0", "", "{\"id\": 1, \"content\": \"<s>\"}, {\"id\": 1, \"content\": \"</s>\"}"),
                TD_ERR_FORMAT, "added_tokens has id 1 twice");
    expect_load(&t, "addedmoved.json", BPE("\"a\": 0", "", "{\"id\": 1, \"content\": \"a\"}"), TD_ERR_FORMAT,
                "added token \"a\" has id 1, but model.vocab gives it id 0");
    expect_load(&t, "addeddup.json",
                BPE("\"a\": 0", "", "{\"id\": 1, \"content\": \"<s>\"}, {\"id\": 2, \"content\": \"<s>\"}"),
                TD_ERR_FORMAT, "added token \"<s>\" has two ids, 1 and 2");
    tmp_remove(&t);
}

/* ---- a bound on the ids of a text, without encoding it ---- */

/* Every row of the encode fixtures, and a long run of the tokenizer's longest token, make
 * at least td_tokenizer_min_tokens ids; a bound is given (max_token_bytes > 0). */
static void check_min_tokens_sound(td_tokenizer_t *tok, const char *name)
{
    uint32_t L = td_tokenizer_max_token_bytes(tok);
    cr_assert_gt(L, 0, "%s: no bound, but its steps cannot shrink text", name);
    rows_t r = load_rows(name, "encode");
    for (size_t i = 0; i < r.n; i++) {
        int32_t *ids;
        size_t n;
        cr_assert_eq(td_tokenizer_encode(tok, r.v[i].text, r.v[i].len, 0, &ids, &n), TD_OK);
        cr_assert_geq(n, td_tokenizer_min_tokens(tok, r.v[i].len), "%s row %zu: %zu bytes made %zu ids, under the "
                      "bound %zu (longest token %u bytes)", name, i, r.v[i].len, n,
                      td_tokenizer_min_tokens(tok, r.v[i].len), L);
        free(ids);
    }
    free_rows(&r);
    /* the worst text for the bound: the longest piece, over and over */
    int32_t longest = -1;
    size_t best = 0;
    for (int32_t id = 0; id < td_tokenizer_vocab_size(tok); id++) {
        size_t pl;
        const char *p = td_tokenizer_id_to_piece(tok, id, &pl);
        char *t;
        size_t tl;
        if (p && !td_tokenizer_is_special(tok, id) && td_tokenizer_decode(tok, &id, 1, &t, &tl) == TD_OK) {
            if (tl > best)
                best = tl, longest = id;
            free(t);
        }
    }
    cr_assert_geq(longest, 0);
    cr_assert_leq(best, L, "%s: id %d decodes to %zu bytes, more than the bound's %u", name, longest, best, L);
    char *one;
    size_t ol;
    cr_assert_eq(td_tokenizer_decode(tok, &longest, 1, &one, &ol), TD_OK);
    size_t reps = 200, len = reps * ol;
    char *text = malloc(len);
    for (size_t k = 0; k < reps; k++)
        memcpy(text + k * ol, one, ol);
    int32_t *ids;
    size_t n;
    cr_assert_eq(td_tokenizer_encode(tok, text, len, 0, &ids, &n), TD_OK);
    cr_assert_geq(n, td_tokenizer_min_tokens(tok, len), "%s: %zu x id %d (%zu bytes): %zu ids, bound %zu", name, reps,
                  longest, ol, n, td_tokenizer_min_tokens(tok, len));
    free(ids);
    free(text);
    free(one);
    cr_assert_eq(td_tokenizer_min_tokens(tok, 0), 0);
    cr_assert_eq(td_tokenizer_min_tokens(tok, (size_t)L * 1000 + 1), 1001);
}

Test(tokenizer, min_tokens_is_a_sound_bound, .timeout = 120)
{
    td_tokenizer_t *tok = load_fixture_tok("bytelevel");
    check_min_tokens_sound(tok, "bytelevel");
    td_tokenizer_destroy(tok);
    static const struct {
        const char *path, *name;
    } real[] = {{"tokenizers/llama3/tokenizer.json", "llama3"},
                {"tokenizers/mistral/tokenizer.json", "mistral"}};
    for (size_t i = 0; i < TD_ARRAY_LEN(real); i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", td_test_models_dir(), real[i].path);
        if (access(path, R_OK) != 0)
            continue; /* the shared models are absent: the fixture above still ran */
        tok = load_shared(real[i].path);
        check_min_tokens_sound(tok, real[i].name);
        td_tokenizer_destroy(tok);
    }
}

/* Qwen3 normalizes to NFC, which can shrink text ("e" + U+0301, 3 bytes, becomes "é", 2),
 * and llama2.c's tokenizer.bin reads a "▁" (3 bytes) as a space (1): no bound is claimed
 * for either, so nothing is refused before encoding. */
Test(tokenizer, min_tokens_no_bound_when_a_normalizer_can_shrink_text, .timeout = 60)
{
    td_tokenizer_t *tok = load_shared("llama2-tokenizer/tokenizer.bin");
    cr_assert_eq(td_tokenizer_max_token_bytes(tok), 0);
    cr_assert_eq(td_tokenizer_min_tokens(tok, 1u << 20), 0);
    td_tokenizer_destroy(tok);
    tok = load_shared("tokenizers/qwen3/tokenizer.json");
    cr_assert_eq(td_tokenizer_max_token_bytes(tok), 0);
    cr_assert_eq(td_tokenizer_min_tokens(tok, 1u << 20), 0);
    /* why: 1000 decomposed characters (3000 bytes) come back as 2000 bytes */
    char text[3000];
    for (int k = 0; k < 1000; k++)
        memcpy(text + 3 * k, "e\xcc\x81", 3);
    int32_t *ids;
    size_t n;
    cr_assert_eq(td_tokenizer_encode(tok, text, sizeof text, 0, &ids, &n), TD_OK);
    char *back;
    size_t bl;
    cr_assert_eq(td_tokenizer_decode(tok, ids, n, &back, &bl), TD_OK);
    cr_assert_lt(bl, sizeof text, "NFC shrank the text: %zu bytes back from %zu", bl, sizeof text);
    free(back);
    free(ids);
    td_tokenizer_destroy(tok);
}
