/*
 * Tests of td_tools (module td_gram): the format is found in the real templates; each
 * format's output is parsed into the same content and calls whether it arrives whole or in
 * pieces of every size, and the same calls with their arguments streamed (the pieces joined);
 * text that only looks like a call stays text; and the grammar of a forced call accepts
 * exactly calls whose arguments follow the tool's schema.
 */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_gram.h"
#include "td_test_models.h"
#include "td_tools.h"

typedef struct collected {
    char content[4096];
    size_t n_content;
    char calls[8][512]; /* "name|arguments" */
    uint32_t n_calls;
} collected_t;

static td_status_t collect(void *ctx, const td_tools_event_t *ev)
{
    collected_t *c = ctx;
    if (ev->kind == TD_TOOLS_CONTENT) {
        cr_assert(c->n_content + ev->len < sizeof c->content);
        memcpy(c->content + c->n_content, ev->text, ev->len);
        c->n_content += ev->len;
        c->content[c->n_content] = '\0';
    } else if (ev->kind == TD_TOOLS_CALL_ARGS) { /* a streamed call's next piece */
        cr_assert(c->n_calls > 0 && ev->index == c->n_calls - 1, "the pieces of the call last begun");
        char *call = c->calls[ev->index];
        size_t at = strlen(call);
        cr_assert(at + ev->arguments_len < 512);
        memcpy(call + at, ev->arguments, ev->arguments_len);
        call[at + ev->arguments_len] = '\0';
    } else { /* a whole call, or a streamed one's name */
        cr_assert(c->n_calls < 8);
        cr_assert_eq(ev->index, c->n_calls, "calls are numbered in order");
        snprintf(c->calls[c->n_calls++], 512, "%s|%.*s", ev->name,
                 ev->kind == TD_TOOLS_CALL ? (int)ev->arguments_len : 0, ev->kind == TD_TOOLS_CALL ? ev->arguments : "");
    }
    return TD_OK;
}

/* Parses out whole, then in pieces of every size from 1 to 17 bytes, arguments streamed or
 * not: the same events (streamed: the same calls once the pieces are joined). */
static void parse_ways(td_tools_format_t fmt, uint32_t max_calls, bool stream, const char *out, collected_t *want)
{
    for (size_t piece = 0; piece <= 17; piece++) {
        collected_t c = {0};
        td_tools_parser_t *p;
        cr_assert_eq(td_tools_parser_create(fmt, max_calls, 0, &p), TD_OK);
        td_tools_parser_stream_args(p, stream);
        size_t n = strlen(out), step = piece ? piece : n;
        for (size_t i = 0; i < n; i += step)
            cr_assert_eq(td_tools_parser_feed(p, out + i, i + step > n ? n - i : step, collect, &c), TD_OK);
        cr_assert_eq(td_tools_parser_finish(p, collect, &c), TD_OK);
        cr_assert_eq(td_tools_parser_calls(p), c.n_calls);
        td_tools_parser_destroy(p);
        if (piece == 0) {
            *want = c;
            continue;
        }
        cr_assert_str_eq(c.content, want->content, "%s in pieces of %zu (stream %d): content", out, piece, stream);
        cr_assert_eq(c.n_calls, want->n_calls, "%s in pieces of %zu (stream %d): calls", out, piece, stream);
        for (uint32_t k = 0; k < c.n_calls; k++)
            cr_assert_str_eq(c.calls[k], want->calls[k], "stream %d", stream);
    }
}

/* parse_ways both ways, and streaming arguments changes nothing a client assembles */
static void parse_all_ways(td_tools_format_t fmt, uint32_t max_calls, const char *out, collected_t *want)
{
    collected_t s;
    parse_ways(fmt, max_calls, false, out, want);
    parse_ways(fmt, max_calls, true, out, &s);
    cr_assert_str_eq(s.content, want->content, "%s streamed: content", out);
    cr_assert_eq(s.n_calls, want->n_calls, "%s streamed: calls", out);
    for (uint32_t k = 0; k < s.n_calls; k++)
        cr_assert_str_eq(s.calls[k], want->calls[k], "%s streamed", out);
}

Test(tools, hermes_calls_and_content)
{
    collected_t c;
    parse_all_ways(TD_TOOLS_HERMES, 0,
                   "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
                   "\"days\": 3.50}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n",
                   &c);
    cr_assert_str_eq(c.content, "Let me check.\n");
    cr_assert_eq(c.n_calls, 2);
    cr_assert_str_eq(c.calls[0], "get_weather|{\"city\": \"Paris\", \"days\": 3.50}", "arguments as written");
    cr_assert_str_eq(c.calls[1], "f|{}");
    /* parallel_tool_calls false: the first call only */
    parse_all_ways(TD_TOOLS_HERMES, 1,
                   "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", "
                   "\"arguments\": {}}</tool_call>",
                   &c);
    cr_assert_eq(c.n_calls, 1);
    cr_assert_str_eq(c.calls[0], "a|{}");
    cr_assert_str_eq(c.content, "");
    /* not calls: text as written, also a tag never closed and a "<tool" at the end */
    parse_all_ways(TD_TOOLS_HERMES, 0, "a < b and <tool_call>not json</tool_call> c <tool", &c);
    cr_assert_eq(c.n_calls, 0);
    cr_assert_str_eq(c.content, "a < b and <tool_call>not json</tool_call> c <tool");
    parse_ways(TD_TOOLS_HERMES, 0, false, "x <tool_call>{\"name\": \"a\", \"arguments\": {\"q\": 1", &c);
    cr_assert_eq(c.n_calls, 0);
    cr_assert_str_eq(c.content, "x <tool_call>{\"name\": \"a\", \"arguments\": {\"q\": 1");
    /* streamed, a call is a call from its head on: cut short, its arguments are what came */
    parse_ways(TD_TOOLS_HERMES, 0, true, "x <tool_call>{\"name\": \"a\", \"arguments\": {\"q\": 1", &c);
    cr_assert_eq(c.n_calls, 1);
    cr_assert_str_eq(c.calls[0], "a|{\"q\": 1");
    cr_assert_str_eq(c.content, "x ");
    /* arguments given as a JSON string: its text */
    parse_all_ways(TD_TOOLS_HERMES, 0, "<tool_call>{\"name\": \"a\", \"arguments\": \"{\\\"q\\\": 1}\"}</tool_call>", &c);
    cr_assert_str_eq(c.calls[0], "a|{\"q\": 1}");
}

Test(tools, llama3_json_calls_and_content)
{
    collected_t c;
    parse_all_ways(TD_TOOLS_LLAMA3_JSON, 0,
                   "  {\"name\": \"get_weather\", \"parameters\": {\"city\": \"a}b\\\"{\"}}", &c);
    cr_assert_eq(c.n_calls, 1);
    cr_assert_str_eq(c.calls[0], "get_weather|{\"city\": \"a}b\\\"{\"}", "braces inside strings");
    cr_assert_str_eq(c.content, "");
    parse_all_ways(TD_TOOLS_LLAMA3_JSON, 0, "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": [1, 2]}}", &c);
    cr_assert_eq(c.n_calls, 2);
    cr_assert_str_eq(c.calls[1], "b|{\"x\": [1, 2]}");
    parse_all_ways(TD_TOOLS_LLAMA3_JSON, 0, "The answer is {\"name\": \"a\"}", &c);
    cr_assert_eq(c.n_calls, 0);
    cr_assert_str_eq(c.content, "The answer is {\"name\": \"a\"}");
    parse_all_ways(TD_TOOLS_LLAMA3_JSON, 0, "{\"not\": \"a call\"}", &c);
    cr_assert_eq(c.n_calls, 0);
    cr_assert_str_eq(c.content, "{\"not\": \"a call\"}");
}

Test(tools, mistral_calls_and_content)
{
    collected_t c;
    parse_all_ways(TD_TOOLS_MISTRAL, 0,
                   "[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {\"k\": \"v\"}}, {\"name\": \"b\", \"arguments\": {}}]",
                   &c);
    cr_assert_eq(c.n_calls, 2);
    cr_assert_str_eq(c.calls[0], "a|{\"k\": \"v\"}");
    cr_assert_str_eq(c.calls[1], "b|{}");
    cr_assert_str_eq(c.content, "");
    /* v0.3's [TOOL_CALLS] is a control token that decoding drops: a bare array is calls too */
    parse_all_ways(TD_TOOLS_MISTRAL, 0, " [{\"name\": \"a\", \"arguments\": {}}]", &c);
    cr_assert_eq(c.n_calls, 1);
    parse_all_ways(TD_TOOLS_MISTRAL, 0, "Sure. [TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {}}]", &c);
    cr_assert_eq(c.n_calls, 1);
    cr_assert_str_eq(c.content, "Sure. ");
    parse_all_ways(TD_TOOLS_MISTRAL, 0, "[1, 2] is a list [", &c);
    cr_assert_eq(c.n_calls, 0);
    cr_assert_str_eq(c.content, "[1, 2] is a list [");
}

Test(tools, plain_text_without_a_format)
{
    collected_t c;
    parse_all_ways(TD_TOOLS_NONE, 0, "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>", &c);
    cr_assert_eq(c.n_calls, 0);
    cr_assert_str_eq(c.content, "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>");
}

Test(tools, formats_found_in_real_templates)
{
    static const struct {
        const char *file;
        td_tools_format_t want;
    } cases[] = {{"chat/qwen3.jinja", TD_TOOLS_HERMES},    {"chat/llama31.jinja", TD_TOOLS_LLAMA3_JSON},
                 {"chat/mistral3.jinja", TD_TOOLS_MISTRAL}, {"chat/llama3.jinja", TD_TOOLS_NONE},
                 {"chat/qwen2.jinja", TD_TOOLS_NONE},       {"chat/smollm2.jinja", TD_TOOLS_NONE}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len;
        char *src = td_test_fixture_read(cases[i].file, 1u << 20, &len);
        cr_assert_eq(td_tools_detect(src, len), cases[i].want, "%s", cases[i].file);
        free(src);
    }
    td_tools_format_t f;
    cr_assert_eq(td_tools_format_parse("llama3_json", &f), TD_OK);
    cr_assert_eq(f, TD_TOOLS_LLAMA3_JSON);
    cr_assert_eq(td_tools_format_parse("json", &f), TD_ERR_INVALID);
}

/* Whether the grammar accepts text whole. */
static bool accepts(const char *gbnf, const char *text)
{
    td_gram_t *g;
    cr_assert_eq(td_gram_compile(TD_GRAM_GBNF, gbnf, strlen(gbnf), &g), TD_OK, "%s", td_last_error());
    td_gram_state_t *s;
    cr_assert_eq(td_gram_state_create(g, &s), TD_OK);
    bool ok = td_gram_accept_bytes(s, text, strlen(text)) == TD_OK && td_gram_can_end(s);
    td_gram_state_destroy(s);
    td_gram_unref(g);
    return ok;
}

Test(tools, forced_call_grammar_follows_the_schemas)
{
    td_tool_t tools[] = {
        {"get_weather", "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": "
                        "{\"type\": \"integer\", \"minimum\": 1, \"maximum\": 14}}, \"required\": [\"city\"]}"},
        {"ping", NULL},
    };
    char *g = NULL;
    size_t bad = 99;
    cr_assert_eq(td_tools_grammar(TD_TOOLS_HERMES, tools, 2, true, &g, &bad), TD_OK, "%s", td_last_error());
    cr_assert(accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>"));
    cr_assert(accepts(g, "<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"any\": [1]}}\n</tool_call>\n<tool_call>\n"
                         "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"x\"}}\n</tool_call>"));
    cr_assert(!accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 3}}\n</tool_call>"),
              "city is required");
    cr_assert(!accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"P\", \"days\": 15}}\n</tool_call>"),
              "days <= 14");
    cr_assert(!accepts(g, "<tool_call>\n{\"name\": \"other\", \"arguments\": {}}\n</tool_call>"));
    cr_assert(!accepts(g, "Hello"));
    free(g);
    /* one call only; the named tool alone */
    cr_assert_eq(td_tools_grammar(TD_TOOLS_HERMES, tools, 1, false, &g, &bad), TD_OK);
    cr_assert(!accepts(g, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a\"}}\n</tool_call>\n"
                          "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a\"}}\n</tool_call>"));
    free(g);
    cr_assert_eq(td_tools_grammar(TD_TOOLS_LLAMA3_JSON, tools, 2, true, &g, &bad), TD_OK);
    cr_assert(accepts(g, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"));
    free(g);
    cr_assert_eq(td_tools_grammar(TD_TOOLS_MISTRAL, tools, 2, true, &g, &bad), TD_OK);
    cr_assert(accepts(g, "[{\"name\": \"ping\", \"arguments\": {}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"a\"}}]"));
    free(g);
    /* an unsupported keyword: refused, naming the tool and the keyword */
    td_tool_t badt[] = {{"a", NULL}, {"b", "{\"type\": \"object\", \"properties\": {\"x\": {\"type\": \"number\", \"multipleOf\": 2}}}"}};
    g = NULL;
    cr_assert_eq(td_tools_grammar(TD_TOOLS_HERMES, badt, 2, true, &g, &bad), TD_ERR_UNSUPPORTED);
    cr_assert_eq(bad, 1);
    cr_assert_null(g);
    cr_assert(strstr(td_last_error(), "multipleOf"), "%s", td_last_error());
}

typedef struct streamed {
    size_t fed;             /* bytes fed so far */
    size_t begin_at[4];     /* bytes fed when call k began */
    uint32_t n_calls, n_args_events, n_whole;
    char args[4][256];
} streamed_t;

static td_status_t on_streamed(void *ctx, const td_tools_event_t *ev)
{
    streamed_t *s = ctx;
    if (ev->kind == TD_TOOLS_CALL_BEGIN) {
        cr_assert(s->n_calls < 4);
        s->begin_at[s->n_calls++] = s->fed;
    } else if (ev->kind == TD_TOOLS_CALL_ARGS) {
        s->n_args_events++;
        strncat(s->args[ev->index], ev->arguments, ev->arguments_len);
    } else if (ev->kind == TD_TOOLS_CALL) {
        s->n_whole++;
    }
    return TD_OK;
}

/* Fed a byte at a time, a streamed call begins as soon as its head is read and its arguments
 * come a byte at a time, in each format; a call past parallel_tool_calls' bound, or with its
 * arguments first, comes whole or not at all. */
Test(tools, streamed_arguments_come_as_they_are_written)
{
    static const struct {
        td_tools_format_t fmt;
        const char *out, *head; /* head: the output up to the arguments' '{' */
        const char *args0;
        uint32_t calls;
    } cases[] = {
        {TD_TOOLS_HERMES, "Hi <tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"P\\\"}\"}}\n</tool_call> ok",
         "Hi <tool_call>\n{\"name\": \"w\", \"arguments\": ", "{\"city\": \"P\\\"}\"}", 1},
        {TD_TOOLS_LLAMA3_JSON, "{\"name\": \"w\", \"parameters\": {\"a\": [1, {\"b\": 2}]}}; {\"name\": \"v\", \"parameters\": {}}",
         "{\"name\": \"w\", \"parameters\": ", "{\"a\": [1, {\"b\": 2}]}", 2},
        {TD_TOOLS_MISTRAL, "[TOOL_CALLS] [{\"name\": \"w\", \"arguments\": {\"k\": 1}}, {\"name\": \"v\", \"arguments\": {}}]",
         "[TOOL_CALLS] [{\"name\": \"w\", \"arguments\": ", "{\"k\": 1}", 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        streamed_t s = {0};
        td_tools_parser_t *p;
        cr_assert_eq(td_tools_parser_create(cases[i].fmt, 0, 0, &p), TD_OK);
        td_tools_parser_stream_args(p, true);
        for (const char *c = cases[i].out; *c; c++) {
            s.fed++;
            cr_assert_eq(td_tools_parser_feed(p, c, 1, on_streamed, &s), TD_OK);
        }
        cr_assert_eq(td_tools_parser_finish(p, on_streamed, &s), TD_OK);
        td_tools_parser_destroy(p);
        cr_assert_eq(s.n_calls, cases[i].calls, "case %zu: calls streamed", i);
        cr_assert_eq(s.n_whole, 0);
        cr_assert_eq(s.begin_at[0], strlen(cases[i].head) + 1, "case %zu: the call begins with its arguments' '{'", i);
        cr_assert_str_eq(s.args[0], cases[i].args0);
        cr_assert_geq(s.n_args_events, strlen(cases[i].args0), "case %zu: a piece a byte", i);
    }
    /* past parallel_tool_calls false's one call: the second is dropped, never begun */
    streamed_t s = {0};
    td_tools_parser_t *p;
    const char *two = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", "
                      "\"arguments\": {\"x\": 1}}</tool_call>";
    cr_assert_eq(td_tools_parser_create(TD_TOOLS_HERMES, 1, 0, &p), TD_OK);
    td_tools_parser_stream_args(p, true);
    cr_assert_eq(td_tools_parser_feed(p, two, strlen(two), on_streamed, &s), TD_OK);
    cr_assert_eq(td_tools_parser_finish(p, on_streamed, &s), TD_OK);
    cr_assert_eq(td_tools_parser_calls(p), 1);
    td_tools_parser_destroy(p);
    cr_assert_eq(s.n_calls + s.n_whole, 1);
    /* arguments before the name: held and given whole */
    s = (streamed_t){0};
    const char *late = "<tool_call>{\"arguments\": {\"x\": 1}, \"name\": \"b\"}</tool_call>";
    cr_assert_eq(td_tools_parser_create(TD_TOOLS_HERMES, 0, 0, &p), TD_OK);
    td_tools_parser_stream_args(p, true);
    cr_assert_eq(td_tools_parser_feed(p, late, strlen(late), on_streamed, &s), TD_OK);
    cr_assert_eq(td_tools_parser_finish(p, on_streamed, &s), TD_OK);
    td_tools_parser_destroy(p);
    cr_assert_eq(s.n_calls, 0);
    cr_assert_eq(s.n_whole, 1);
}
