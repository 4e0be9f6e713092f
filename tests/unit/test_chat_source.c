/*
 * Tests of td_chat_source (module td_tok): a model's chat template is found where Hugging
 * Face keeps it (tokenizer_config.json's string or list form, chat_template.jinja), a model
 * without one is a clear TD_ERR_NOT_FOUND, a malformed one a clear TD_ERR_FORMAT; and a
 * rendered conversation gets exactly one BOS, with the real Llama 3, Mistral and Qwen3
 * tokenizers of ../shared/models: Llama 3's and Mistral's templates write it (no second
 * one), a template that does not gets the tokenizer's, Qwen has none.
 */
#include <criterion/criterion.h>
#include <criterion/redirect.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_chat_source.h"
#include "td_status.h"
#include "td_test_models.h"
#include "td_util.h"

static char tmp_dir[64];

static void make_tmp(void)
{
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/td_chat_source_XXXXXX");
    cr_assert_not_null(mkdtemp(tmp_dir));
}

static void rm_tmp(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", tmp_dir);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(chat_source, .init = make_tmp, .fini = rm_tmp);

/* writes tmp_dir/name */
static void put(const char *name, const char *text)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", tmp_dir, name);
    td_test_write_file(path, text, strlen(text));
}

static td_tokenizer_t *load_tok(const char *rel)
{
    char path[4096];
    td_test_model_file(rel, path, sizeof path);
    td_tokenizer_t *tok = NULL;
    cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK, "%s: %s", path, td_last_error());
    return tok;
}

/* The conversation [system?, user] rendered with t for tok and encoded as chat does. */
static int32_t *chat_ids(const td_chat_template_t *t, const td_tokenizer_t *tok, bool system, size_t *n_p,
                         char **text_p)
{
    td_chat_message_t m[2] = {{.role = "system", .content = "You are terse."}, {.role = "user", .content = "Hi there"}};
    char *text;
    size_t len;
    cr_assert_eq(td_chat_render_messages(t, tok, system ? m : m + 1, system ? 2 : 1, NULL, &text, &len), TD_OK, "%s",
                 td_last_error());
    int32_t *ids;
    cr_assert_eq(td_chat_encode(tok, text, len, td_tokenizer_add_bos(tok), &ids, n_p), TD_OK);
    *text_p = text;
    return ids;
}

static size_t count_id(const int32_t *ids, size_t n, int32_t id)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ids[i] == id;
    return k;
}

Test(chat_source, llama3_template_writes_the_only_bos)
{
    char dir[4096];
    td_test_model_file("tokenizers/llama3", dir, sizeof dir);
    td_tokenizer_t *tok = load_tok("tokenizers/llama3");
    td_chat_template_t *t = NULL;
    cr_assert_eq(td_chat_template_for_model(dir, NULL, &t), TD_OK, "%s", td_last_error());
    size_t n;
    char *text;
    int32_t *ids = chat_ids(t, tok, true, &n, &text);
    int32_t bos = td_tokenizer_bos_id(tok);
    cr_assert(td_tokenizer_add_bos(tok), "Llama 3's tokenizer adds BOS");
    cr_assert(!strncmp(text, "<|begin_of_text|>", 17), "rendered: %s", text);
    cr_assert_eq(ids[0], bos);
    cr_assert_eq(count_id(ids, n, bos), 1, "one BOS, not the template's and the tokenizer's");
    /* the header markers are special tokens, not their text's pieces */
    int32_t hdr = td_tokenizer_piece_to_id(tok, "<|start_header_id|>", 19);
    cr_assert_eq(ids[1], hdr);
    free(ids);
    free(text);
    td_chat_template_destroy(t);
    td_tokenizer_destroy(tok);
}

Test(chat_source, qwen_has_no_bos)
{
    /* Qwen3's own template uses tojson (tools), outside td_chat_template's subset: the
     * Qwen2 template of tests/fixtures/chat, with Qwen3's tokenizer (the same ChatML ids) */
    td_tokenizer_t *tok = load_tok("tokenizers/qwen3");
    char *src = td_test_fixture_read("chat/qwen2.jinja", 1u << 20, NULL);
    put("chat_template.jinja", src);
    free(src);
    td_chat_template_t *t = NULL;
    cr_assert_eq(td_chat_template_for_model(tmp_dir, NULL, &t), TD_OK, "%s", td_last_error());
    size_t n;
    char *text;
    int32_t *ids = chat_ids(t, tok, true, &n, &text);
    cr_assert_str_eq(text, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                           "<|im_start|>assistant\n");
    cr_assert_eq(td_tokenizer_bos_id(tok), -1);
    cr_assert_eq(ids[0], td_tokenizer_piece_to_id(tok, "<|im_start|>", 12));
    cr_assert_eq(count_id(ids, n, ids[0]), 3, "three <|im_start|>, each one id");
    free(ids);
    free(text);
    td_chat_template_destroy(t);
    td_tokenizer_destroy(tok);
}

Test(chat_source, mistral_without_template_then_chat_template_jinja)
{
    char dir[4096];
    td_test_model_file("tokenizers/mistral", dir, sizeof dir);
    td_tokenizer_t *tok = load_tok("tokenizers/mistral");
    td_chat_template_t *t = NULL;
    /* the shipped tokenizer_config.json has no chat_template */
    cr_assert_eq(td_chat_template_for_model(dir, NULL, &t), TD_ERR_NOT_FOUND);
    cr_assert_null(t);
    cr_assert(strstr(td_last_error(), "has no chat template"), "%s", td_last_error());
    cr_assert(strstr(td_last_error(), dir), "the message names the model: %s", td_last_error());
    /* a model path without one, its tokenizer with one: the tokenizer's */
    char *src = td_test_fixture_read("chat/mistral.jinja", 1u << 20, NULL);
    put("chat_template.jinja", src);
    free(src);
    cr_assert_eq(td_chat_template_for_model(dir, tmp_dir, &t), TD_OK, "%s", td_last_error());
    size_t n;
    char *text;
    int32_t *ids = chat_ids(t, tok, false, &n, &text);
    cr_assert(!strncmp(text, "<s>[INST] Hi there [/INST]", 26), "rendered: %s", text);
    cr_assert_eq(ids[0], td_tokenizer_bos_id(tok));
    cr_assert_eq(count_id(ids, n, td_tokenizer_bos_id(tok)), 1);
    free(ids);
    free(text);
    td_chat_template_destroy(t);
    td_tokenizer_destroy(tok);
}

/* a model without a template is the caller's error to report (generate --chat does), not
 * logged by the lookup: a server that finds none starts and serves prompts, and its normal
 * start has no line saying "error" */
Test(chat_source, no_template_is_not_logged, .init = cr_redirect_stderr)
{
    char dir[4096];
    td_test_model_file("tokenizers/mistral", dir, sizeof dir);
    td_chat_template_t *t = NULL;
    cr_assert_eq(td_chat_template_for_model(dir, NULL, &t), TD_ERR_NOT_FOUND);
    fflush(stderr);
    cr_assert_stderr_eq_str("", "the lookup logged its NOT_FOUND");
}

Test(chat_source, a_template_without_bos_gets_the_tokenizers)
{
    td_tokenizer_t *tok = load_tok("tokenizers/mistral");
    put("tokenizer_config.json", "{\"chat_template\": \"{% for m in messages %}[{{ m.role }}] {{ m.content }}\\n"
                                 "{% endfor %}\"}");
    td_chat_template_t *t = NULL;
    cr_assert_eq(td_chat_template_for_model(tmp_dir, NULL, &t), TD_OK, "%s", td_last_error());
    size_t n;
    char *text;
    int32_t *ids = chat_ids(t, tok, true, &n, &text);
    cr_assert_str_eq(text, "[system] You are terse.\n[user] Hi there\n");
    cr_assert_eq(ids[0], td_tokenizer_bos_id(tok));
    cr_assert_eq(count_id(ids, n, td_tokenizer_bos_id(tok)), 1);
    free(ids);
    /* without add_bos (a GGUF saying add_bos_token false): none */
    cr_assert_eq(td_chat_encode(tok, text, strlen(text), false, &ids, &n), TD_OK);
    cr_assert_neq(ids[0], td_tokenizer_bos_id(tok));
    free(ids);
    free(text);
    td_chat_template_destroy(t);
    td_tokenizer_destroy(tok);
}

Test(chat_source, list_form_and_malformed_configs)
{
    td_chat_template_t *t = NULL;
    put("tokenizer_config.json", "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"},"
                                 " {\"name\": \"default\", \"template\": \"D{{ messages | length }}\"}]}");
    cr_assert_eq(td_chat_template_for_model(tmp_dir, NULL, &t), TD_OK, "%s", td_last_error());
    td_chat_render_t r = td_chat_render_default();
    char *out;
    cr_assert_eq(td_chat_template_render(t, &r, &out, NULL, NULL, 0), TD_OK);
    cr_assert_str_eq(out, "D0", "the \"default\" entry");
    free(out);
    td_chat_template_destroy(t);
    t = NULL;

    static const struct {
        const char *config, *says;
        td_status_t st;
    } bad[] = {
        {"{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"T\"}]}", "without a \"default\" entry",
         TD_ERR_FORMAT},
        {"{\"chat_template\": 7}", "neither a string nor a list", TD_ERR_FORMAT},
        {"{\"chat_template\": [{\"name\": \"default\"}]}", "has no template string", TD_ERR_FORMAT},
        {"[1, 2]", "not a JSON object", TD_ERR_FORMAT},
        {"{\"chat_template\": \"{% if %}\"}", "chat template", TD_ERR_FORMAT},
        {"{\"chat_template\": \"{% macro m() %}{% endmacro %}\"}", "chat template", TD_ERR_UNSUPPORTED},
        {"{\"bos_token\": \"<s>\"}", "has no chat template", TD_ERR_NOT_FOUND},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(bad); i++) {
        put("tokenizer_config.json", bad[i].config);
        td_status_t st = td_chat_template_for_model(tmp_dir, NULL, &t);
        cr_expect_eq(st, bad[i].st, "%s: %s (%s)", bad[i].config, td_strerror(st), td_last_error());
        cr_expect_null(t);
        cr_expect(strstr(td_last_error(), bad[i].says), "%s: '%s' does not say '%s'", bad[i].config, td_last_error(),
                  bad[i].says);
    }
}
