/*
 * td_tools: tool-call formats, the grammar of a forced call, and the output parser
 * (td_tools.h).
 *
 * The parser keeps the text it has not given yet in one buffer and moves through three
 * states: START (llama3_json and mistral: the output's first characters decide whether it is
 * calls), CONTENT (text, watched for the format's opening marker, of which a partial match at
 * the end is held back) and CALL (text held until the call is complete JSON, then given as a
 * call). Completeness is found by a scanner that counts brackets outside strings; the call is
 * then read by cJSON, and its arguments are passed on as the model wrote them (the raw text of
 * the "arguments" member), so numbers keep their digits. Streaming arguments, a call whose
 * head (`{"name": N, "arguments": {`) is read moves to ARGS (its text given as it comes, the
 * same bracket count finding the arguments' end) and TAIL (the rest of the call object,
 * dropped); mistral's array is walked element by element (in_array).
 */
#include "td_tools.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_gram.h"
#include "td_gram_int.h"

const char *td_tools_format_name(td_tools_format_t fmt)
{
    switch (fmt) {
    case TD_TOOLS_HERMES:
        return "hermes";
    case TD_TOOLS_LLAMA3_JSON:
        return "llama3_json";
    case TD_TOOLS_MISTRAL:
        return "mistral";
    default:
        return "none";
    }
}

td_status_t td_tools_format_parse(const char *name, td_tools_format_t *fmt_p)
{
    for (int f = TD_TOOLS_NONE; f <= TD_TOOLS_MISTRAL; f++)
        if (name && !strcmp(name, td_tools_format_name((td_tools_format_t)f))) {
            *fmt_p = (td_tools_format_t)f;
            return TD_OK;
        }
    return td_errorf_quiet(TD_ERR_INVALID,
                           "tool-call format \"%s\" is not one of hermes, llama3_json, mistral, none",
                           name ? name : "");
}

static bool contains(const char *s, size_t n, const char *needle)
{
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (!memcmp(s + i, needle, k))
            return true;
    return false;
}

td_tools_format_t td_tools_detect(const char *src, size_t len)
{
    if (!src)
        return TD_TOOLS_NONE;
    if (contains(src, len, "<tool_call>"))
        return TD_TOOLS_HERMES;
    if (contains(src, len, "[TOOL_CALLS]"))
        return TD_TOOLS_MISTRAL;
    if (contains(src, len, "\"parameters\": ") && contains(src, len, "ipython"))
        return TD_TOOLS_LLAMA3_JSON;
    return TD_TOOLS_NONE;
}

/* ---- the grammar of a forced call ---- */

/* Copies GBNF text with every rule name prefixed (string literals, character classes and
 * comments copied as they are), so several grammars can share one text. */
static void put_renamed(td_gram_str_t *b, const char *g, const char *prefix)
{
    for (const char *p = g; *p;) {
        if (*p == '"' || *p == '[') {
            char close = *p == '"' ? '"' : ']';
            const char *q = p + 1;
            while (*q && *q != close)
                q += q[0] == '\\' && q[1] ? 2 : 1;
            if (*q)
                q++;
            td_gram_str_add(b, p, (size_t)(q - p));
            p = q;
        } else if (*p == '#') {
            const char *q = p;
            while (*q && *q != '\n')
                q++;
            p = q;
        } else if ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z')) {
            const char *q = p;
            while ((*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (*q >= '0' && *q <= '9') ||
                   *q == '-' || *q == '_')
                q++;
            td_gram_str_puts(b, prefix);
            td_gram_str_add(b, p, (size_t)(q - p));
            p = q;
        } else {
            td_gram_str_add(b, p++, 1);
        }
    }
}

td_status_t td_tools_grammar(td_tools_format_t fmt, const td_tool_t *tools, size_t n, bool parallel,
                             char **gbnf_p, size_t *bad_p)
{
    if (!n || fmt == TD_TOOLS_NONE)
        return td_errorf_quiet(TD_ERR_INVALID, "a forced tool call needs tools and a tool-call format");
    td_gram_str_t b = {0};
    td_status_t st = TD_OK;
    switch (fmt) {
    case TD_TOOLS_HERMES:
        td_gram_str_puts(&b, parallel ? "root ::= tc ( \"\\n\" tc )*\n" : "root ::= tc\n");
        td_gram_str_puts(&b, "tc ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\n");
        break;
    case TD_TOOLS_MISTRAL: /* without the [TOOL_CALLS] marker: a control token in v0.3's vocabulary,
                            * which a grammar never emits; the parser reads a bare array too */
        td_gram_str_puts(&b, parallel ? "root ::= \"[\" call ( \", \" call )* \"]\"\n" : "root ::= \"[\" call \"]\"\n");
        break;
    default: /* llama3_json: one call is the whole output */
        td_gram_str_puts(&b, "root ::= call\n");
        break;
    }
    td_gram_str_puts(&b, "call ::= "); /* the alternatives, one per tool */
    for (size_t i = 0; i < n && !b.oom; i++)
        td_gram_str_printf(&b, "%sc%zu", i ? " | " : "", i);
    td_gram_str_puts(&b, "\n");
    for (size_t i = 0; i < n && !st && !b.oom; i++) {
        const char *params = tools[i].parameters;
        char *g = NULL;
        st = params ? td_gram_to_gbnf(TD_GRAM_JSON_SCHEMA, params, strlen(params), &g)
                    : td_gram_to_gbnf(TD_GRAM_JSON_OBJECT, "", 0, &g);
        if (st) {
            if (bad_p)
                *bad_p = i;
            break;
        }
        char prefix[32];
        snprintf(prefix, sizeof prefix, "t%zu-", i);
        td_gram_str_printf(&b, "c%zu ::= \"{\\x22name\\x22: \\x22\" ", i);
        td_gram_str_literal(&b, tools[i].name, strlen(tools[i].name));
        td_gram_str_puts(&b, fmt == TD_TOOLS_LLAMA3_JSON ? " \"\\x22, \\x22parameters\\x22: \" " : " \"\\x22, \\x22arguments\\x22: \" ");
        td_gram_str_printf(&b, "%sroot \"}\"\n", prefix);
        put_renamed(&b, g, prefix);
        td_gram_str_puts(&b, "\n");
        free(g);
    }
    if (!st && b.oom)
        st = td_errorf_quiet(TD_ERR_NOMEM, "tools: out of memory");
    char *out = NULL;
    if (!st && (st = td_gram_to_gbnf(TD_GRAM_GBNF, b.s, b.len, &out)) != TD_OK && bad_p)
        *bad_p = n; /* the whole: a bound of td_gram exceeded */
    td_gram_str_free(&b);
    if (st)
        return st;
    *gbnf_p = out;
    return TD_OK;
}

/* ---- scanning JSON ---- */

#define SPAN_INCOMPLETE ((size_t)0)
#define SPAN_BAD ((size_t)-1)

static size_t skip_ws(const char *s, size_t n, size_t i)
{
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    return i;
}

/* The end (exclusive) of the JSON value starting at s[i] (no leading space): brackets are
 * counted outside strings, so the value is only known to be balanced; SPAN_INCOMPLETE when
 * s ends first, SPAN_BAD when s[i] cannot start a value. */
static size_t json_end(const char *s, size_t n, size_t i)
{
    if (i >= n)
        return SPAN_INCOMPLETE;
    char c = s[i];
    if (c == '"') {
        for (size_t k = i + 1; k < n; k++) {
            if (s[k] == '\\')
                k++;
            else if (s[k] == '"')
                return k + 1;
        }
        return SPAN_INCOMPLETE;
    }
    if (c == '{' || c == '[') {
        size_t depth = 0;
        bool in_str = false;
        for (size_t k = i; k < n; k++) {
            char d = s[k];
            if (in_str) {
                if (d == '\\')
                    k++;
                else if (d == '"')
                    in_str = false;
            } else if (d == '"') {
                in_str = true;
            } else if (d == '{' || d == '[') {
                depth++;
            } else if (d == '}' || d == ']') {
                if (--depth == 0)
                    return k + 1;
            }
        }
        return SPAN_INCOMPLETE;
    }
    if (c == '-' || (c >= '0' && c <= '9') || c == 't' || c == 'f' || c == 'n') {
        size_t k = i;
        while (k < n && ((s[k] >= '0' && s[k] <= '9') || (s[k] >= 'a' && s[k] <= 'z') || s[k] == '-' ||
                         s[k] == '+' || s[k] == '.' || s[k] == 'E'))
            k++;
        return k < n ? k : SPAN_INCOMPLETE;
    }
    return SPAN_BAD;
}

/* The raw text of member `key` of the complete JSON object obj[0..n): *at, *len. */
static bool member_raw(const char *obj, size_t n, const char *key, size_t *at, size_t *len)
{
    size_t i = skip_ws(obj, n, 0), klen = strlen(key);
    if (i >= n || obj[i] != '{')
        return false;
    i++;
    for (;;) {
        i = skip_ws(obj, n, i);
        if (i >= n || obj[i] != '"')
            return false;
        size_t kend = json_end(obj, n, i);
        if (kend == SPAN_INCOMPLETE || kend == SPAN_BAD)
            return false;
        bool match = kend - i - 2 == klen && !memcmp(obj + i + 1, key, klen);
        i = skip_ws(obj, n, kend);
        if (i >= n || obj[i] != ':')
            return false;
        i = skip_ws(obj, n, i + 1);
        size_t vend = json_end(obj, n, i);
        if (vend == SPAN_INCOMPLETE || vend == SPAN_BAD)
            return false;
        if (match) {
            *at = i;
            *len = vend - i;
            return true;
        }
        i = skip_ws(obj, n, vend);
        if (i >= n || obj[i] != ',')
            return false;
        i++;
    }
}

/* ---- the parser ---- */

typedef enum { P_START, P_CONTENT, P_CALL, P_TEXT_ONLY } pstate_t;
typedef enum { CS_NONE, CS_ARGS, CS_TAIL } cstate_t; /* a streamed call: its arguments, the rest */

/* A bracket count over JSON text fed in pieces (json_end's, resumable) */
typedef struct {
    size_t depth;
    bool in_str, esc;
} jscan_t;

struct td_tools_parser {
    td_tools_format_t fmt;
    pstate_t st;
    uint32_t max_calls, n_calls;
    size_t max_bytes;
    bool after_call; /* whitespace between calls (and after the last) is not content */
    char *buf;       /* text not given yet [n] */
    size_t n, cap;
    char *name;      /* the current call's name (the event points at it) */
    char *args;      /* its arguments when decoded from a JSON string */
    /* streaming arguments (td_tools_parser_stream_args) */
    bool stream;
    cstate_t cs;
    jscan_t scan;    /* ARGS: over the arguments object; TAIL: over the call object's rest */
    bool in_array;   /* mistral: between the elements of the calls array */
    bool eat_close;  /* hermes: a streamed call's </tool_call> may follow */
};

td_status_t td_tools_parser_create(td_tools_format_t fmt, uint32_t max_calls, size_t max_bytes,
                                   td_tools_parser_t **p_p)
{
    td_tools_parser_t *p = calloc(1, sizeof *p);
    if (!p)
        return td_errorf_quiet(TD_ERR_NOMEM, "tools: out of memory");
    p->fmt = fmt;
    p->st = fmt == TD_TOOLS_NONE ? P_TEXT_ONLY : fmt == TD_TOOLS_HERMES ? P_CONTENT : P_START;
    p->max_calls = max_calls;
    p->max_bytes = max_bytes ? max_bytes : (size_t)1 << 20;
    *p_p = p;
    return TD_OK;
}

void td_tools_parser_stream_args(td_tools_parser_t *p, bool on)
{
    p->stream = on;
}

void td_tools_parser_destroy(td_tools_parser_t *p)
{
    if (!p)
        return;
    free(p->buf);
    free(p->name);
    free(p->args);
    free(p);
}

uint32_t td_tools_parser_calls(const td_tools_parser_t *p)
{
    return p->n_calls;
}

static void consume(td_tools_parser_t *p, size_t k)
{
    if (k == 0)
        return; /* also keeps a parser that has buffered nothing (buf NULL) out of memmove */
    memmove(p->buf, p->buf + k, p->n - k);
    p->n -= k;
}

static bool all_space(const char *s, size_t n)
{
    return skip_ws(s, n, 0) == n;
}

/* Gives buf[0..k) as content (whitespace alone after a call is dropped) and consumes it. */
static td_status_t give_content(td_tools_parser_t *p, size_t k, td_tools_event_cb cb, void *ctx)
{
    td_status_t st = TD_OK;
    if (k && !(p->after_call && all_space(p->buf, k))) {
        td_tools_event_t ev = {.kind = TD_TOOLS_CONTENT, .text = p->buf, .len = k};
        st = cb(ctx, &ev);
        p->after_call = false;
    }
    consume(p, k);
    return st;
}

/* The call object obj[0..n) given as a call: TD_ERR_FORMAT (not a call: the caller gives
 * the text as content) or the callback's status. */
static td_status_t give_call(td_tools_parser_t *p, const char *obj, size_t n, td_tools_event_cb cb, void *ctx)
{
    cJSON *o = cJSON_ParseWithLength(obj, n);
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name");
    if (!cJSON_IsObject(o) || !cJSON_IsString(name)) {
        cJSON_Delete(o);
        return TD_ERR_FORMAT;
    }
    free(p->name);
    free(p->args);
    p->args = NULL;
    p->name = strdup(name->valuestring);
    size_t at = 0, len = 0;
    const char *args = "{}";
    size_t args_len = 2;
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, "arguments");
    bool found = member_raw(obj, n, "arguments", &at, &len) || member_raw(obj, n, "parameters", &at, &len);
    if (!a)
        a = cJSON_GetObjectItemCaseSensitive(o, "parameters");
    if (found && cJSON_IsString(a)) { /* arguments written as a JSON string: its text */
        p->args = strdup(a->valuestring);
        args = p->args;
        args_len = p->args ? strlen(p->args) : 0;
    } else if (found) {
        args = obj + at;
        args_len = len;
    }
    cJSON_Delete(o);
    if (!p->name || (found && cJSON_IsString(a) && !p->args))
        return td_errorf_quiet(TD_ERR_NOMEM, "tools: out of memory");
    if (p->max_calls && p->n_calls >= p->max_calls) {
        p->after_call = true;
        return TD_OK; /* past the bound (parallel_tool_calls false): dropped */
    }
    td_tools_event_t ev = {.kind = TD_TOOLS_CALL, .index = p->n_calls, .name = p->name,
                           .arguments = args, .arguments_len = args_len};
    p->n_calls++;
    p->after_call = true;
    return cb(ctx, &ev);
}

/* ---- streamed calls ---- */

typedef enum { HEAD_NO, HEAD_MORE, HEAD_YES } head_t;

/* Whether s[*i..n) begins with word: HEAD_MORE while s ends inside it; *i moves past it. */
static head_t head_word(const char *s, size_t n, size_t *i, const char *word)
{
    size_t k = strlen(word), have = n - *i < k ? n - *i : k;
    if (memcmp(s + *i, word, have))
        return HEAD_NO;
    if (have < k)
        return HEAD_MORE;
    *i += k;
    return HEAD_YES;
}

/* Whether s[i..n) opens a call whose arguments can stream: `{"name": STRING, "arguments": {`
 * (or "parameters"), blanks between tokens; *name_at and *name_end the name's string token,
 * *args_at the arguments' `{`. HEAD_MORE while s may still become one. */
static head_t call_head(const char *s, size_t n, size_t i, size_t *name_at, size_t *name_end, size_t *args_at)
{
    static const char *const seps[] = {"{", "\"name\"", ":", NULL, ",", NULL, ":", "{"};
    for (size_t t = 0; t < sizeof seps / sizeof seps[0]; t++) {
        i = skip_ws(s, n, i);
        if (i >= n)
            return HEAD_MORE;
        head_t r;
        if (t == 3) { /* the name */
            if (s[i] != '"')
                return HEAD_NO;
            size_t e = json_end(s, n, i);
            if (e == SPAN_INCOMPLETE)
                return HEAD_MORE;
            *name_at = i;
            *name_end = i = e;
            continue;
        }
        if (t == 5) { /* the arguments' key */
            size_t j = i;
            r = head_word(s, n, &j, "\"arguments\"");
            if (r == HEAD_NO) {
                j = i;
                r = head_word(s, n, &j, "\"parameters\"");
            }
            if (r != HEAD_YES)
                return r;
            i = j;
            continue;
        }
        if (t == 7)
            *args_at = i;
        if ((r = head_word(s, n, &i, seps[t])) != HEAD_YES)
            return r;
    }
    return HEAD_YES;
}

/* Scans s[0..n) on from sc's state: the index after the byte that closes the value sc is
 * in (its depth back to 0), or SPAN_INCOMPLETE. */
static size_t jscan(jscan_t *sc, const char *s, size_t n)
{
    for (size_t k = 0; k < n; k++) {
        char d = s[k];
        if (sc->in_str) {
            if (sc->esc)
                sc->esc = false;
            else if (d == '\\')
                sc->esc = true;
            else if (d == '"')
                sc->in_str = false;
        } else if (d == '"') {
            sc->in_str = true;
        } else if (d == '{' || d == '[') {
            sc->depth++;
        } else if ((d == '}' || d == ']') && sc->depth > 0 && --sc->depth == 0) {
            return k + 1;
        }
    }
    return SPAN_INCOMPLETE;
}

/* If buf[i..) opens a call that can stream (and the call bound leaves room), gives its
 * CALL_BEGIN, consumes the head and moves to ARGS: *begun. */
static td_status_t stream_begin(td_tools_parser_t *p, size_t i, bool *begun, td_tools_event_cb cb, void *ctx)
{
    size_t name_at = 0, name_end = 0, args_at = 0;
    *begun = false;
    if (!p->stream || (p->max_calls && p->n_calls >= p->max_calls) ||
        call_head(p->buf, p->n, i, &name_at, &name_end, &args_at) != HEAD_YES)
        return TD_OK;
    cJSON *nm = cJSON_ParseWithLength(p->buf + name_at, name_end - name_at);
    if (!cJSON_IsString(nm)) { /* a bad escape: the call is read whole (and is no call) */
        cJSON_Delete(nm);
        return TD_OK;
    }
    free(p->name);
    p->name = strdup(nm->valuestring);
    cJSON_Delete(nm);
    if (!p->name)
        return td_errorf_quiet(TD_ERR_NOMEM, "tools: out of memory");
    consume(p, args_at);
    p->cs = CS_ARGS;
    p->scan = (jscan_t){0};
    *begun = true;
    td_tools_event_t ev = {.kind = TD_TOOLS_CALL_BEGIN, .index = p->n_calls, .name = p->name};
    p->n_calls++;
    p->after_call = true;
    return cb(ctx, &ev);
}

/* ARGS and TAIL: the arguments given as they come, then the rest of the call object read
 * and dropped (at the end of the output, what is held of either). */
static td_status_t stream_call(td_tools_parser_t *p, bool final, bool *progress, td_tools_event_cb cb, void *ctx)
{
    size_t end = jscan(&p->scan, p->buf, p->n), k = end == SPAN_INCOMPLETE ? p->n : end;
    td_status_t st = TD_OK;
    if (p->cs == CS_ARGS && k) {
        td_tools_event_t ev = {.kind = TD_TOOLS_CALL_ARGS, .index = p->n_calls - 1, .name = p->name,
                               .arguments = p->buf, .arguments_len = k};
        st = cb(ctx, &ev);
    }
    consume(p, k);
    if (end == SPAN_INCOMPLETE) {
        if (final) { /* the output ended inside the call */
            p->cs = CS_NONE;
            p->in_array = false;
            p->st = P_CONTENT;
        }
        return st;
    }
    if (p->cs == CS_ARGS) {
        p->cs = CS_TAIL;
        p->scan = (jscan_t){.depth = 1}; /* inside the call object */
    } else {
        p->cs = CS_NONE;
        if (p->fmt == TD_TOOLS_HERMES) {
            p->st = P_CONTENT;
            p->eat_close = true;
        }
    }
    *progress = true;
    return st;
}

/* mistral's calls array at buf[i, end), each element a call, the array checked whole first */
static td_status_t give_array(td_tools_parser_t *p, size_t i, size_t end, td_tools_event_cb cb, void *ctx)
{
    cJSON *arr = cJSON_ParseWithLength(p->buf + i, end - i);
    bool ok = cJSON_IsArray(arr) && cJSON_GetArraySize(arr) > 0;
    cJSON_Delete(arr);
    td_status_t st = TD_ERR_FORMAT;
    for (size_t k = skip_ws(p->buf, end, i + 1); ok && k < end - 1;) {
        size_t e = json_end(p->buf, end, k);
        if (e == SPAN_INCOMPLETE || e == SPAN_BAD)
            break;
        if ((st = give_call(p, p->buf + k, e - k, cb, ctx)) != TD_OK)
            break;
        k = skip_ws(p->buf, end, e);
        if (k < end && p->buf[k] == ',')
            k = skip_ws(p->buf, end, k + 1);
    }
    return st;
}

/* The JSON value at buf[i] given whole once complete (or the output ends, or it outgrows
 * max_bytes): a llama3_json call, one element of mistral's array (in_array: an element that
 * could not stream), or mistral's whole array. What is not calls makes the rest text. */
static td_status_t give_whole(td_tools_parser_t *p, size_t i, bool final, bool *progress, td_tools_event_cb cb,
                              void *ctx)
{
    size_t end = json_end(p->buf, p->n, i);
    if (end == SPAN_INCOMPLETE && !final && p->n <= p->max_bytes)
        return TD_OK;
    td_status_t st = TD_ERR_FORMAT;
    if (end != SPAN_INCOMPLETE && end != SPAN_BAD) {
        if (p->fmt == TD_TOOLS_LLAMA3_JSON || p->in_array)
            st = give_call(p, p->buf + i, end - i, cb, ctx);
        else if (p->buf[i] == '[')
            st = give_array(p, i, end, cb, ctx);
    }
    if (st == TD_ERR_FORMAT) { /* not calls: the rest is text */
        p->in_array = false;
        p->after_call = false;
        p->st = P_TEXT_ONLY;
        *progress = true;
        return TD_OK;
    }
    consume(p, end);
    if (p->fmt == TD_TOOLS_MISTRAL) /* in the array, st is read again only after its ']' */
        p->st = P_CONTENT;
    *progress = p->n > 0;
    return st;
}

/* mistral, streaming, between elements of the calls array: the next element (streamed, or
 * held and given whole), or the array's end. */
static td_status_t array_next(td_tools_parser_t *p, bool final, bool *progress, td_tools_event_cb cb, void *ctx)
{
    size_t i = skip_ws(p->buf, p->n, 0);
    if (i < p->n && p->buf[i] == ']') {
        consume(p, i + 1);
        p->in_array = false;
        p->st = P_CONTENT;
        *progress = true;
        return TD_OK;
    }
    if (i < p->n && p->buf[i] == ',')
        i = skip_ws(p->buf, p->n, i + 1);
    if (i >= p->n) {
        if (final)
            consume(p, p->n);
        return TD_OK;
    }
    bool begun;
    td_status_t st = stream_begin(p, i, &begun, cb, ctx);
    if (st != TD_OK || begun) {
        *progress = begun;
        return st;
    }
    return give_whole(p, i, final, progress, cb, ctx);
}

/* The length of the longest end of buf that is a proper beginning of marker. */
static size_t partial_marker(const char *s, size_t n, const char *marker)
{
    size_t m = strlen(marker);
    for (size_t k = m - 1 < n ? m - 1 : n; k > 0; k--)
        if (!memcmp(s + n - k, marker, k))
            return k;
    return 0;
}

static const char *open_marker(td_tools_format_t fmt)
{
    return fmt == TD_TOOLS_HERMES ? "<tool_call>" : fmt == TD_TOOLS_MISTRAL ? "[TOOL_CALLS]" : "<|python_tag|>";
}

/* One step of the parser over buf; *progress says whether it can take another. */
static td_status_t step(td_tools_parser_t *p, bool final, bool *progress, td_tools_event_cb cb, void *ctx)
{
    *progress = false;
    if (p->cs != CS_NONE)
        return stream_call(p, final, progress, cb, ctx);
    if (p->in_array)
        return array_next(p, final, progress, cb, ctx);
    const char *marker = open_marker(p->fmt);
    size_t mlen = strlen(marker);
    bool begun;
    td_status_t st;
    switch (p->st) {
    case P_TEXT_ONLY:
        return give_content(p, p->n, cb, ctx);
    case P_START: { /* llama3_json, mistral: is the output calls? */
        size_t i = skip_ws(p->buf, p->n, 0);
        if (i == p->n) {
            if (final)
                return give_content(p, p->n, cb, ctx);
            return TD_OK;
        }
        size_t rest = p->n - i;
        bool is_marker = rest >= mlen && !memcmp(p->buf + i, marker, mlen);
        bool maybe_marker = rest < mlen && !memcmp(p->buf + i, marker, rest);
        size_t j = skip_ws(p->buf, p->n, i + 1);
        bool json_start = p->fmt == TD_TOOLS_LLAMA3_JSON ? p->buf[i] == '{'
                                                         : p->buf[i] == '[' && j < p->n && p->buf[j] == '{';
        bool maybe_json = p->fmt == TD_TOOLS_MISTRAL && p->buf[i] == '[' && j == p->n;
        if (is_marker) {
            consume(p, i + mlen);
            p->st = P_CALL;
        } else if (json_start) {
            consume(p, i);
            p->st = P_CALL;
        } else if ((maybe_marker || maybe_json) && !final) {
            return TD_OK;
        } else {
            p->st = p->fmt == TD_TOOLS_MISTRAL ? P_CONTENT : P_TEXT_ONLY;
        }
        *progress = true;
        return TD_OK;
    }
    case P_CONTENT: {
        if (p->eat_close) { /* after a streamed hermes call: its </tool_call>, if it comes */
            static const char close[] = "</tool_call>";
            size_t i = skip_ws(p->buf, p->n, 0), cl = sizeof close - 1, have = p->n - i < cl ? p->n - i : cl;
            if (!memcmp(p->buf + i, close, have)) {
                if (have < cl && !final)
                    return TD_OK;
                if (have == cl)
                    consume(p, i + cl);
            }
            p->eat_close = false;
            *progress = true;
            return TD_OK;
        }
        for (size_t i = 0; i + mlen <= p->n; i++)
            if (!memcmp(p->buf + i, marker, mlen)) {
                st = give_content(p, i, cb, ctx);
                consume(p, mlen);
                p->st = P_CALL;
                *progress = true;
                return st;
            }
        size_t hold = final ? 0 : partial_marker(p->buf, p->n, marker);
        if (!final && p->after_call && all_space(p->buf, p->n - hold))
            return TD_OK; /* whitespace after a call (before what may open the next): content
                           * only if text follows, with that text, as when the output came whole */
        return give_content(p, p->n - hold, cb, ctx);
    }
    case P_CALL:
        break;
    }
    /* P_CALL: a call whose arguments stream, or text held until the call is complete */
    if (p->fmt == TD_TOOLS_HERMES) {
        if ((st = stream_begin(p, skip_ws(p->buf, p->n, 0), &begun, cb, ctx)) != TD_OK || begun) {
            *progress = begun;
            return st;
        }
        static const char close[] = "</tool_call>";
        size_t cl = sizeof close - 1, end = p->n;
        for (size_t i = 0; i + cl <= p->n; i++)
            if (!memcmp(p->buf + i, close, cl)) {
                end = i;
                break;
            }
        bool closed = end < p->n;
        if (!closed && !final && p->n <= p->max_bytes)
            return TD_OK;
        st = give_call(p, p->buf, end, cb, ctx);
        if (st == TD_ERR_FORMAT) { /* not a call: the text as it was written */
            td_tools_event_t ev = {.kind = TD_TOOLS_CONTENT, .text = marker, .len = mlen};
            p->after_call = false;
            if ((st = cb(ctx, &ev)) == TD_OK)
                st = give_content(p, closed ? end + cl : p->n, cb, ctx);
        } else {
            consume(p, closed ? end + cl : p->n);
        }
        p->st = P_CONTENT;
        *progress = p->n > 0;
        return st;
    }
    /* llama3_json: objects (separated by ';'); mistral: one array of them */
    size_t i = skip_ws(p->buf, p->n, 0);
    if (p->fmt == TD_TOOLS_LLAMA3_JSON && i < p->n && p->buf[i] == ';')
        i = skip_ws(p->buf, p->n, i + 1);
    if (i == p->n) { /* blanks (and a ';') are held: if text that is no call follows, they are
                      * its content, as when the output came whole */
        if (p->n > p->max_bytes)
            consume(p, i);
        return TD_OK;
    }
    size_t at = p->fmt == TD_TOOLS_MISTRAL && p->buf[i] == '[' ? skip_ws(p->buf, p->n, i + 1) : i;
    if ((st = stream_begin(p, at, &begun, cb, ctx)) != TD_OK || begun) {
        p->in_array = begun && p->fmt == TD_TOOLS_MISTRAL;
        *progress = begun;
        return st;
    }
    return give_whole(p, i, final, progress, cb, ctx);
}

static td_status_t run(td_tools_parser_t *p, bool final, td_tools_event_cb cb, void *ctx)
{
    bool progress = true;
    td_status_t st = TD_OK;
    for (int guard = 0; progress && !st && guard < 1000000; guard++)
        st = step(p, final, &progress, cb, ctx);
    return st;
}

td_status_t td_tools_parser_feed(td_tools_parser_t *p, const char *text, size_t len, td_tools_event_cb cb,
                                 void *ctx)
{
    if (p->n + len + 1 > p->cap) {
        size_t cap = p->cap ? p->cap : 256;
        while (cap < p->n + len + 1)
            cap *= 2;
        char *b = realloc(p->buf, cap);
        if (!b)
            return td_errorf_quiet(TD_ERR_NOMEM, "tools: out of memory");
        p->buf = b;
        p->cap = cap;
    }
    if (len)
        memcpy(p->buf + p->n, text, len);
    p->n += len;
    return run(p, false, cb, ctx);
}

td_status_t td_tools_parser_finish(td_tools_parser_t *p, td_tools_event_cb cb, void *ctx)
{
    td_status_t st = run(p, true, cb, ctx);
    if (!st && p->n) /* whitespace after the last call */
        consume(p, p->n);
    return st;
}
