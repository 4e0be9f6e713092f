/*
 * Tests of td_chat_template (module td_tok): every conversation of tests/fixtures/chat
 * (made by gen_fixtures.py with Python's jinja2) renders byte for byte as jinja2 rendered
 * it, or fails as jinja2 did; hostile templates (unterminated tags, deep nesting, huge
 * loops, exploding strings) are each a clear error, never a crash or a hang.
 */
#include <criterion/criterion.h>

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_chat_template.h"
#include "td_test_models.h"

static void check_fixture(const char *name)
{
    char path[256], err[512];
    size_t len;
    snprintf(path, sizeof path, "chat/%s.jinja", name);
    char *src = td_test_fixture_read(path, 1u << 20, &len);
    td_chat_template_t *t = NULL;
    td_status_t st = td_chat_template_create(src, len, &t, err, sizeof err);
    cr_assert_eq(st, TD_OK, "%s: %s", name, err);
    snprintf(path, sizeof path, "chat/%s.jsonl", name);
    char *rows = td_test_fixture_read(path, 16u << 20, &len);
    int n_rows = 0;
    for (char *line = strtok(rows, "\n"); line; line = strtok(NULL, "\n"), n_rows++) {
        cJSON *row = cJSON_Parse(line);
        cr_assert(row);
        cJSON *msgs = cJSON_GetObjectItem(row, "messages");
        td_chat_message_t m[32];
        char *calls[32] = {0};
        size_t n = 0;
        cJSON *it;
        cJSON_ArrayForEach(it, msgs)
        {
            cr_assert(n < 32);
            m[n] = (td_chat_message_t){
                .role = cJSON_GetObjectItem(it, "role")->valuestring,
                .content = cJSON_GetObjectItem(it, "content")->valuestring,
                .tool_call_id = cJSON_GetStringValue(cJSON_GetObjectItem(it, "tool_call_id")),
                .name = cJSON_GetStringValue(cJSON_GetObjectItem(it, "name"))};
            /* tool_calls as a client sends them: arguments are JSON text */
            cJSON *tc = cJSON_GetObjectItem(it, "tool_calls");
            if (tc)
                m[n].tool_calls = calls[n] = cJSON_PrintUnformatted(tc);
            n++;
        }
        td_chat_render_t r = td_chat_render_default();
        r.tools = cJSON_GetStringValue(cJSON_GetObjectItem(row, "tools_json"));
        r.messages = m;
        r.n_messages = n;
        r.bos_token = cJSON_GetStringValue(cJSON_GetObjectItem(row, "bos_token"));
        r.eos_token = cJSON_GetStringValue(cJSON_GetObjectItem(row, "eos_token"));
        r.add_generation_prompt = cJSON_IsTrue(cJSON_GetObjectItem(row, "add_generation_prompt"));
        char *out = NULL;
        size_t out_len = 0;
        err[0] = '\0';
        st = td_chat_template_render(t, &r, &out, &out_len, err, sizeof err);
        const char *want = cJSON_GetStringValue(cJSON_GetObjectItem(row, "output"));
        const char *want_err = cJSON_GetStringValue(cJSON_GetObjectItem(row, "error"));
        if (want) {
            cr_assert_eq(st, TD_OK, "%s row %d: %s", name, n_rows, err);
            cr_assert_eq(out_len, strlen(want), "%s row %d: length", name, n_rows);
            cr_assert_str_eq(out, want, "%s row %d", name, n_rows);
        } else {
            cr_assert_eq(st, TD_ERR_INVALID, "%s row %d: expected error %s", name, n_rows,
                         want_err);
            /* raise_exception's message is the template's; jinja2's own errors are worded
             * its way, so only their status is compared */
            if (strstr(err, "template raised"))
                cr_assert(strstr(err, want_err), "%s row %d: %s lacks %s", name, n_rows, err,
                          want_err);
        }
        free(out);
        for (size_t i = 0; i < n; i++)
            free(calls[i]);
        cJSON_Delete(row);
    }
    cr_assert_eq(n_rows, 20, "%s: %d rows", name, n_rows);
    free(rows);
    free(src);
    td_chat_template_destroy(t);
}

Test(chat_template, smollm2_matches_jinja2) { check_fixture("smollm2"); }
Test(chat_template, qwen2_matches_jinja2) { check_fixture("qwen2"); }
Test(chat_template, llama3_matches_jinja2) { check_fixture("llama3"); }
Test(chat_template, mistral_matches_jinja2) { check_fixture("mistral"); }
/* templates with tool calling: tools, assistant tool_calls, tool results */
Test(chat_template, qwen3_tools_match_jinja2) { check_fixture("qwen3"); }
Test(chat_template, llama31_tools_match_jinja2) { check_fixture("llama31"); }
Test(chat_template, mistral3_tools_match_jinja2) { check_fixture("mistral3"); }

/* A template that fails to compile: the status, and the message names what was wrong. */
static void refuse(const char *src, td_status_t want, const char *needle)
{
    char err[512] = "";
    td_chat_template_t *t = (td_chat_template_t *)0x1;
    td_status_t st = td_chat_template_create(src, strlen(src), &t, err, sizeof err);
    cr_assert_eq(st, want, "%s: status %d (%s)", src, st, err);
    cr_assert_eq(t, (td_chat_template_t *)0x1, "output written on failure");
    cr_assert(strstr(err, needle), "%s: '%s' lacks '%s'", src, err, needle);
    cr_assert(strstr(err, "line "), "%s: '%s' has no position", src, err);
}

Test(chat_template, malformed_templates_are_refused)
{
    refuse("{{ x ", TD_ERR_FORMAT, "expected '}}'");
    refuse("abc\n  {% if x %}yes", TD_ERR_FORMAT, "line 2");
    refuse("{% if x %}yes", TD_ERR_FORMAT, "endif");
    refuse("{% for m in messages %}", TD_ERR_FORMAT, "endfor");
    refuse("{# never closed", TD_ERR_FORMAT, "comment");
    refuse("{{ 'open string }}", TD_ERR_FORMAT, "string");
    refuse("{% endif %}", TD_ERR_FORMAT, "unexpected");
    refuse("{{ x | frobnicate }}", TD_ERR_UNSUPPORTED, "frobnicate");
    refuse("{% macro m() %}{% endmacro %}", TD_ERR_UNSUPPORTED, "macro");
    refuse("{{ 1 + }}", TD_ERR_FORMAT, "expected an expression");
    refuse("{{ x @ y }}", TD_ERR_FORMAT, "unexpected character");
    refuse("{{ 99999999999999999999 }}", TD_ERR_RANGE, "too large");
}

Test(chat_template, deep_nesting_is_refused)
{
    size_t depth = 100000;
    char *src = malloc(depth * 2 + 16);
    size_t k = 0;
    k += (size_t)sprintf(src + k, "{{ ");
    for (size_t i = 0; i < depth; i++)
        src[k++] = '(';
    src[k++] = '1';
    for (size_t i = 0; i < depth; i++)
        src[k++] = ')';
    k += (size_t)sprintf(src + k, " }}");
    src[k] = '\0';
    refuse(src, TD_ERR_RANGE, "nesting");
    k = 0;
    for (size_t i = 0; i < 1000; i++)
        k += (size_t)sprintf(src + k, "{%% if x %%}");
    src[k] = '\0';
    refuse(src, TD_ERR_RANGE, "nesting");
    free(src);
}

/* A template that compiles and whose render fails with want. */
static void render_fails(const char *src, td_status_t want, const char *needle)
{
    char err[512] = "";
    td_chat_template_t *t = NULL;
    cr_assert_eq(td_chat_template_create(src, strlen(src), &t, err, sizeof err), TD_OK, "%s", err);
    td_chat_render_t r = td_chat_render_default();
    td_chat_message_t m = {.role = "user", .content = "hi"};
    r.messages = &m;
    r.n_messages = 1;
    char *out = (char *)0x1;
    td_status_t st = td_chat_template_render(t, &r, &out, NULL, err, sizeof err);
    cr_assert_eq(st, want, "%s: status %d (%s)", src, st, err);
    cr_assert_eq(out, (char *)0x1);
    cr_assert(strstr(err, needle), "%s: '%s' lacks '%s'", src, err, needle);
    td_chat_template_destroy(t);
}

Test(chat_template, hostile_renders_are_bounded)
{
    render_fails("{% for i in range(100000000) %}x{% endfor %}", TD_ERR_EXHAUSTED, "step");
    render_fails("{% for i in range(900000) %}{% for j in range(900000) %}{% endfor %}{% endfor %}",
                 TD_ERR_EXHAUSTED, "steps");
    render_fails("{% for i in range(100000) %}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}",
                 TD_ERR_EXHAUSTED, "output exceeds");
    render_fails("{% set a = range(900000) %}{{ (a + a + a + a) | length }}", TD_ERR_EXHAUSTED,
                 "memory");
    render_fails("{{ raise_exception('no system role') }}", TD_ERR_INVALID, "no system role");
    render_fails("{{ nothing.role }}", TD_ERR_INVALID, "undefined");
    render_fails("{{ 'a' + 1 }}", TD_ERR_INVALID, "cannot apply '+'");
    render_fails("{{ 1 // 0 }}", TD_ERR_INVALID, "division by zero");
}

Test(chat_template, destroy_null_is_a_no_op)
{
    td_chat_template_destroy(NULL);
}
