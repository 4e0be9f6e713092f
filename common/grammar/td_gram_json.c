/*
 * td_gram_json: what is not GBNF, translated to GBNF text (docs/grammar.md lists the
 * subsets): a regular expression, a choice list, any JSON object, a JSON Schema.
 *
 * JSON Schema is walked once, depth first; each subschema becomes a rule (s1, s2, ...),
 * each $ref target one rule however often it is referred to (so recursive schemas become
 * recursive rules). A keyword outside the supported subset is refused with its JSON path,
 * never ignored; annotations (title, description, examples, ...) are skipped. Objects
 * list their properties in the schema's order, required ones always, optional ones
 * possibly not, and no other keys unless additionalProperties says so (as llama.cpp and
 * xgrammar read an absent additionalProperties in structured output). Whitespace between
 * JSON tokens is at most TD_GRAM_JSON_WS bytes and numbers at most 16 digits, so a
 * generation cannot run forever on padding.
 */
#include "td_gram_int.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- regular expressions --------------------------------------------------------------- */

typedef struct rx {
    const char *src, *p, *end;
    td_gram_str_t *out;
    int depth;
    bool json_string; /* inside a JSON string: '.' and negated classes leave out " \ and controls */
    td_status_t st;
} rx_t;

static bool rx_fail(rx_t *r, td_status_t st, const char *what)
{
    if (r->st == TD_OK)
        r->st = td_errorf_quiet(st, "regex at offset %td: %s", r->p - r->src, what);
    return false;
}

static void rx_cp(rx_t *r, uint32_t cp)
{
    if (cp < 0x10000)
        td_gram_str_printf(r->out, "\\u%04X", cp);
    else
        td_gram_str_printf(r->out, "\\U%08X", cp);
}

/* One UTF-8 character of the pattern as a code point. */
static bool rx_utf8(rx_t *r, uint32_t *cp)
{
    unsigned char c = (unsigned char)*r->p;
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || r->p + n > r->end)
        return rx_fail(r, TD_ERR_FORMAT, "invalid UTF-8");
    uint32_t v = n == 1 ? c : c & (0x7f >> n);
    for (int i = 1; i < n; i++) {
        if (((unsigned char)r->p[i] & 0xc0) != 0x80)
            return rx_fail(r, TD_ERR_FORMAT, "invalid UTF-8");
        v = (v << 6) | ((unsigned char)r->p[i] & 0x3f);
    }
    r->p += n;
    *cp = v;
    return true;
}

static int rx_hex(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* Class shorthands as GBNF class bodies. */
static const char *rx_shorthand(char c)
{
    switch (c) {
    case 'd': return "0-9";
    case 'w': return "a-zA-Z0-9_";
    case 's': return " \\t\\n\\r\\f\\v";
    }
    return NULL;
}

/* After a backslash: a character escape into *cp (true), or false with *cls set to a
 * shorthand (d w s D W S) or an error. */
static bool rx_escape(rx_t *r, uint32_t *cp, char *cls)
{
    *cls = 0;
    if (r->p >= r->end)
        return rx_fail(r, TD_ERR_FORMAT, "a backslash at the end");
    char e = *r->p++;
    switch (e) {
    case 'n': *cp = '\n'; return true;
    case 't': *cp = '\t'; return true;
    case 'r': *cp = '\r'; return true;
    case 'f': *cp = '\f'; return true;
    case 'v': *cp = '\v'; return true;
    case '0': *cp = 0; return true;
    case 'd': case 'w': case 's': case 'D': case 'W': case 'S': *cls = e; return false;
    case 'b': case 'B': case 'A': case 'Z': case 'z': case 'G':
        r->p--;
        return rx_fail(r, TD_ERR_UNSUPPORTED, "anchors and word boundaries (\\b \\B \\A \\Z \\z \\G) are not supported");
    case 'p': case 'P':
        r->p--;
        return rx_fail(r, TD_ERR_UNSUPPORTED, "Unicode property classes (\\p, \\P) are not supported");
    case 'x': case 'u': {
        int digits = e == 'x' ? 2 : 4;
        uint32_t v = 0;
        for (int i = 0; i < digits; i++) {
            int h = r->p < r->end ? rx_hex(*r->p) : -1;
            if (h < 0)
                return rx_fail(r, TD_ERR_FORMAT, "\\x needs 2 hex digits, \\u 4");
            v = v * 16 + (uint32_t)h;
            r->p++;
        }
        *cp = v;
        return true;
    }
    default:
        if (e >= '1' && e <= '9') {
            r->p--;
            return rx_fail(r, TD_ERR_UNSUPPORTED, "backreferences are not supported");
        }
        if ((unsigned char)e < 0x80 && !((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z'))) {
            *cp = (uint32_t)(unsigned char)e;
            return true;
        }
        r->p--;
        return rx_fail(r, TD_ERR_UNSUPPORTED, "unknown escape");
    }
}

static const char *json_excl = "\"\\\\\\x00-\\x1F"; /* " \ and control characters, as GBNF class text */

static bool rx_class(rx_t *r)
{
    r->p++; /* [ */
    bool neg = r->p < r->end && *r->p == '^';
    if (neg)
        r->p++;
    td_gram_str_puts(r->out, neg ? "[^" : "[");
    if (neg && r->json_string)
        td_gram_str_puts(r->out, json_excl);
    bool first = true;
    while (r->p < r->end && (*r->p != ']' || first)) {
        first = false;
        uint32_t lo;
        char cls = 0;
        if (*r->p == '[' && r->p + 1 < r->end && r->p[1] == ':')
            return rx_fail(r, TD_ERR_UNSUPPORTED, "POSIX classes ([:alpha:]) are not supported");
        if (*r->p == '\\') {
            r->p++;
            if (!rx_escape(r, &lo, &cls)) {
                if (r->st != TD_OK)
                    return false;
                const char *sh = rx_shorthand(cls);
                if (!sh)
                    return rx_fail(r, TD_ERR_UNSUPPORTED, "negated shorthands (\\D \\W \\S) inside a class are not supported");
                td_gram_str_puts(r->out, sh);
                continue;
            }
        } else if (!rx_utf8(r, &lo)) {
            return false;
        }
        rx_cp(r, lo);
        if (r->p + 1 < r->end && *r->p == '-' && r->p[1] != ']') {
            r->p++;
            uint32_t hi;
            if (*r->p == '\\') {
                r->p++;
                if (!rx_escape(r, &hi, &cls))
                    return r->st == TD_OK ? rx_fail(r, TD_ERR_FORMAT, "a class range ends in a shorthand") : false;
            } else if (!rx_utf8(r, &hi)) {
                return false;
            }
            if (hi < lo)
                return rx_fail(r, TD_ERR_FORMAT, "a class range runs backwards");
            td_gram_str_puts(r->out, "-");
            rx_cp(r, hi);
        }
    }
    if (r->p >= r->end)
        return rx_fail(r, TD_ERR_FORMAT, "a [ is not closed with ]");
    r->p++;
    td_gram_str_puts(r->out, "]");
    return true;
}

static bool rx_alt(rx_t *r);

/* {m}, {m,}, {m,n} at r->p: true and the bounds when it is one (else r->p unchanged). */
static bool rx_braces(rx_t *r, long *lo, long *hi)
{
    const char *q = r->p + 1;
    long a = 0, b;
    const char *s = q;
    while (q < r->end && *q >= '0' && *q <= '9' && a <= 100000)
        a = a * 10 + (*q++ - '0');
    if (q == s)
        return false;
    b = a;
    if (q < r->end && *q == ',') {
        q++;
        b = -1;
        if (q < r->end && *q >= '0' && *q <= '9') {
            b = 0;
            while (q < r->end && *q >= '0' && *q <= '9' && b <= 100000)
                b = b * 10 + (*q++ - '0');
        }
    }
    if (q >= r->end || *q != '}')
        return false;
    r->p = q + 1;
    *lo = a;
    *hi = b;
    return true;
}

static bool rx_seq(rx_t *r)
{
    bool any = false;
    while (r->p < r->end && *r->p != '|' && *r->p != ')') {
        char c = *r->p;
        if (c == '^' && r->p == r->src) {
            r->p++;
            continue;
        }
        if (c == '$' && r->p + 1 == r->end) {
            r->p++;
            continue;
        }
        if (c == '^' || c == '$')
            return rx_fail(r, TD_ERR_UNSUPPORTED, "anchors (^ $) are supported only at the start and the end");
        if (c == '*' || c == '+' || c == '?')
            return rx_fail(r, TD_ERR_FORMAT, "a quantifier with nothing before it");
        if (any)
            td_gram_str_puts(r->out, " ");
        any = true;
        if (c == '(') {
            r->p++;
            if (r->p < r->end && *r->p == '?') {
                if (r->p + 1 < r->end && r->p[1] == ':') {
                    r->p += 2;
                } else if (r->end - r->p > 2 && (r->p[1] == 'P' || r->p[1] == '<') && r->p[1 + (r->p[1] == 'P')] == '<' &&
                           r->p[2 + (r->p[1] == 'P')] != '=' && r->p[2 + (r->p[1] == 'P')] != '!') {
                    r->p = memchr(r->p, '>', (size_t)(r->end - r->p));
                    if (!r->p)
                        return rx_fail(r, TD_ERR_FORMAT, "a named group's name is not closed with >");
                    r->p++;
                } else {
                    return rx_fail(r, TD_ERR_UNSUPPORTED, "lookaround and inline flags ((?=, (?!, (?<=, (?i) ...) are not supported");
                }
            }
            if (++r->depth > TD_GRAM_MAX_NESTING)
                return rx_fail(r, TD_ERR_RANGE, "groups nested too deep");
            td_gram_str_puts(r->out, "(");
            if (!rx_alt(r))
                return false;
            if (r->p >= r->end || *r->p != ')')
                return rx_fail(r, TD_ERR_FORMAT, "a ( is not closed with )");
            r->p++;
            r->depth--;
            td_gram_str_puts(r->out, ")");
        } else if (c == '[') {
            if (!rx_class(r))
                return false;
        } else if (c == '.') {
            r->p++;
            td_gram_str_puts(r->out, r->json_string ? "[^\\x0A\"\\\\\\x00-\\x1F]" : "[^\\x0A]");
        } else {
            uint32_t cp;
            char cls = 0;
            if (c == '\\') {
                r->p++;
                if (!rx_escape(r, &cp, &cls)) {
                    if (r->st != TD_OK)
                        return false;
                    const char *sh = rx_shorthand((char)(cls | 0x20));
                    bool neg = cls >= 'A' && cls <= 'Z';
                    td_gram_str_printf(r->out, "[%s%s%s]", neg ? "^" : "", neg && r->json_string ? json_excl : "", sh);
                    goto quant;
                }
            } else if (!rx_utf8(r, &cp)) {
                return false;
            }
            td_gram_str_puts(r->out, "[");
            rx_cp(r, cp);
            td_gram_str_puts(r->out, "]");
        }
    quant:
        if (r->p < r->end) {
            char q = *r->p;
            long lo, hi;
            if (q == '*' || q == '+' || q == '?') {
                r->p++;
                td_gram_str_add(r->out, &q, 1);
            } else if (q == '{' && rx_braces(r, &lo, &hi)) {
                if (lo > TD_GRAM_MAX_REPEAT || hi > TD_GRAM_MAX_REPEAT)
                    return rx_fail(r, TD_ERR_RANGE, "a repetition count above 1000");
                if (hi >= 0 && hi < lo)
                    return rx_fail(r, TD_ERR_FORMAT, "{m,n} with n below m");
                if (hi < 0)
                    td_gram_str_printf(r->out, "{%ld,}", lo);
                else
                    td_gram_str_printf(r->out, "{%ld,%ld}", lo, hi);
            } else {
                continue;
            }
            if (r->p < r->end && *r->p == '?')
                r->p++; /* lazy: the same language */
            else if (r->p < r->end && *r->p == '+')
                return rx_fail(r, TD_ERR_UNSUPPORTED, "possessive quantifiers are not supported");
            if (r->p < r->end && (*r->p == '*' || *r->p == '+' || *r->p == '?' || *r->p == '{'))
                if (*r->p != '{' || rx_braces(&(rx_t){.src = r->src, .p = r->p, .end = r->end}, &lo, &hi))
                    return rx_fail(r, TD_ERR_FORMAT, "two quantifiers in a row");
        }
    }
    if (!any)
        td_gram_str_puts(r->out, "\"\"");
    return true;
}

static bool rx_alt(rx_t *r)
{
    if (!rx_seq(r))
        return false;
    while (r->p < r->end && *r->p == '|') {
        r->p++;
        td_gram_str_puts(r->out, " | ");
        if (!rx_seq(r))
            return false;
    }
    return true;
}

static td_status_t regex_body(const char *re, size_t len, bool json_string, td_gram_str_t *out)
{
    rx_t r = {.src = re, .p = re, .end = re + len, .out = out, .json_string = json_string};
    td_gram_str_puts(out, "(");
    if (rx_alt(&r) && r.p < r.end)
        rx_fail(&r, TD_ERR_FORMAT, "a ) without its (");
    td_gram_str_puts(out, ")");
    return r.st;
}

td_status_t td_gram_regex_to_gbnf(const char *re, size_t len, td_gram_str_t *out)
{
    td_gram_str_puts(out, "root ::= ");
    td_status_t st = regex_body(re, len, false, out);
    td_gram_str_puts(out, "\n");
    return st;
}

td_status_t td_gram_regex_rules(const char *re, size_t len, const char *name, td_gram_str_t *out)
{
    td_gram_str_printf(out, "%s ::= ", name);
    td_status_t st = regex_body(re, len, true, out);
    td_gram_str_puts(out, "\n");
    return st;
}

/* ---- choice ---------------------------------------------------------------------------- */

td_status_t td_gram_choice_to_gbnf(const char *src, size_t len, td_gram_str_t *out)
{
    cJSON *a = cJSON_ParseWithLength(src, len);
    td_status_t st = TD_OK;
    if (!a || !cJSON_IsArray(a)) {
        st = td_errorf_quiet(TD_ERR_FORMAT, "choice: expected a JSON array of strings");
        goto out;
    }
    int n = cJSON_GetArraySize(a);
    if (n < 1 || n > TD_GRAM_MAX_CHOICES) {
        st = td_errorf_quiet(n < 1 ? TD_ERR_FORMAT : TD_ERR_RANGE, "choice: %d strings; give 1 to %d", n,
                             TD_GRAM_MAX_CHOICES);
        goto out;
    }
    td_gram_str_puts(out, "root ::= ");
    int i = 0;
    for (cJSON *c = a->child; c; c = c->next, i++) {
        if (!cJSON_IsString(c)) {
            st = td_errorf_quiet(TD_ERR_FORMAT, "choice: item %d is not a string", i);
            goto out;
        }
        if (i)
            td_gram_str_puts(out, " | ");
        td_gram_str_literal(out, c->valuestring, strlen(c->valuestring));
    }
    td_gram_str_puts(out, "\n");
out:
    cJSON_Delete(a);
    return st;
}

/* ---- JSON ------------------------------------------------------------------------------- */

/* The shared JSON rules; the schema translator appends them once (after its own). */
static void json_common(td_gram_str_t *o)
{
    td_gram_str_printf(o,
        "ws ::= [ \\t\\n]{0,%d}\n"
        "value ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"
        "object ::= \"{\" ws ( member ( \",\" ws member )* )? \"}\"\n"
        "member ::= string ws \":\" ws value ws\n"
        "array ::= \"[\" ws ( value ws ( \",\" ws value ws )* )? \"]\"\n"
        "string ::= \"\\\"\" char* \"\\\"\"\n"
        "char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4} )\n"
        "number ::= integer ( \".\" [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?\n"
        "integer ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,15} )\n"
        "boolean ::= \"true\" | \"false\"\n"
        "null ::= \"null\"\n"
        "date ::= [0-9]{4} \"-\" ( \"0\" [1-9] | \"1\" [0-2] ) \"-\" ( \"0\" [1-9] | [12] [0-9] | \"3\" [01] )\n"
        "time ::= ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,9} )? "
        "( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )\n",
        TD_GRAM_JSON_WS);
}

td_status_t td_gram_json_object_gbnf(td_gram_str_t *out)
{
    td_gram_str_puts(out, "root ::= object\n");
    json_common(out);
    return TD_OK;
}

/* ---- JSON Schema -------------------------------------------------------------------------- */

typedef struct sch {
    cJSON *root;
    td_gram_str_t *out;
    int next;          /* rule counter */
    int depth;
    td_status_t st;
    struct { char *ref; int rule; } refs[256];
    int n_refs;
} sch_t;

static int sch_fail(sch_t *s, td_status_t st, const char *path, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int sch_fail(sch_t *s, td_status_t st, const char *path, const char *fmt, ...)
{
    if (s->st == TD_OK) {
        char msg[384];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        s->st = td_errorf_quiet(st, "json schema %s: %s", path, msg);
    }
    return -1;
}

static void jpath(char *buf, size_t cap, const char *path, const char *key)
{
    snprintf(buf, cap, "%s.%s", path, key);
}

static const char *const annotations[] = {"title", "description", "default", "examples", "$schema", "$id",
                                          "$comment", "deprecated", "readOnly", "writeOnly", "$defs",
                                          "definitions", NULL};
static const char *const keywords[] = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable",
                                       "properties", "required", "additionalProperties",
                                       "items", "minItems", "maxItems",
                                       "pattern", "format", "minLength", "maxLength",
                                       "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL};

static bool in_list(const char *const *l, const char *k)
{
    for (; *l; l++)
        if (!strcmp(*l, k))
            return true;
    return false;
}

static int sch_node(sch_t *s, const cJSON *n, const char *path);

/* JSON text of a string as a GBNF literal: the quotes and escapes of JSON, then GBNF's. */
static void json_string_literal(td_gram_str_t *o, const char *str)
{
    td_gram_str_t j = {0};
    td_gram_str_add(&j, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)str; *p; p++) {
        if (*p == '"' || *p == '\\') {
            char e[2] = {'\\', (char)*p};
            td_gram_str_add(&j, e, 2);
        } else if (*p < 0x20) {
            td_gram_str_printf(&j, "\\u%04x", *p);
        } else {
            td_gram_str_add(&j, (const char *)p, 1);
        }
    }
    td_gram_str_add(&j, "\"", 1);
    if (j.oom)
        o->oom = true;
    else
        td_gram_str_literal(o, j.s, j.len);
    td_gram_str_free(&j);
}

static int new_rule(sch_t *s)
{
    return ++s->next;
}

/* A literal JSON value (enum / const) */
static bool literal_value(sch_t *s, td_gram_str_t *e, const cJSON *v, const char *path)
{
    char *txt = cJSON_PrintUnformatted(v);
    if (!txt)
        return sch_fail(s, TD_ERR_NOMEM, path, "out of memory"), false;
    td_gram_str_literal(e, txt, strlen(txt));
    cJSON_free(txt);
    return true;
}

/* Digits of non-negative range [lo, hi] (equal lengths, as strings) */
static void digits_range(td_gram_str_t *o, const char *lo, const char *hi, size_t n)
{
    if (n == 0) {
        td_gram_str_puts(o, "\"\"");
        return;
    }
    if (lo[0] == hi[0]) {
        td_gram_str_printf(o, "\"%c\" ", lo[0]);
        digits_range(o, lo + 1, hi + 1, n - 1);
        return;
    }
    char nines[24], zeros[24];
    memset(nines, '9', n - 1);
    memset(zeros, '0', n - 1);
    td_gram_str_printf(o, "( \"%c\" (", lo[0]);
    digits_range(o, lo + 1, nines, n - 1);
    td_gram_str_puts(o, ")");
    if (lo[0] + 1 <= hi[0] - 1)
        td_gram_str_printf(o, " | [%c-%c] [0-9]{%zu}", lo[0] + 1, hi[0] - 1, n - 1);
    td_gram_str_printf(o, " | \"%c\" (", hi[0]);
    digits_range(o, zeros, hi + 1, n - 1);
    td_gram_str_puts(o, ") )");
}

/* Decimal integers in [lo, hi] (lo >= 0; hi < 0: unbounded), no leading zeros, as one group */
static void uint_range(td_gram_str_t *o, long long lo, long long hi)
{
    char a[24], b[24];
    int la = snprintf(a, sizeof a, "%lld", lo);
    int lb = hi >= 0 ? snprintf(b, sizeof b, "%lld", hi) : 16;
    td_gram_str_puts(o, "(");
    bool first = true;
    for (int len = la; len <= lb; len++) {
        char l[24], h[24];
        if (len == la)
            memcpy(l, a, (size_t)len + 1);
        else
            l[0] = '1', memset(l + 1, '0', (size_t)len - 1), l[len] = 0;
        if (hi >= 0 && len == lb) {
            memcpy(h, b, (size_t)len + 1);
        } else if (hi < 0 && len > la) {
            td_gram_str_printf(o, "%s[1-9] [0-9]{%d,%d}", first ? "" : " | ", len - 1, 15);
            break;
        } else {
            memset(h, '9', (size_t)len);
            h[len] = 0;
        }
        td_gram_str_puts(o, first ? "" : " | ");
        first = false;
        td_gram_str_puts(o, "(");
        digits_range(o, l, h, (size_t)len);
        td_gram_str_puts(o, ")");
    }
    td_gram_str_puts(o, ")");
}

#include <limits.h>
#define INT_BOUND 1000000000000000LL /* 1e15: bounds beyond are refused */

static bool get_bound(sch_t *s, const cJSON *n, const char *key, const char *path, bool integer, double *v, bool *has)
{
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(n, key);
    *has = false;
    if (!b)
        return true;
    char p[512];
    jpath(p, sizeof p, path, key);
    if (!cJSON_IsNumber(b))
        return sch_fail(s, TD_ERR_FORMAT, p, "must be a number"), false;
    if (integer && (fabs(b->valuedouble) > (double)INT_BOUND))
        return sch_fail(s, TD_ERR_UNSUPPORTED, p, "%g: integer bounds beyond 1e15 are not supported", b->valuedouble), false;
    *v = b->valuedouble;
    *has = true;
    return true;
}

static bool integer_body(sch_t *s, td_gram_str_t *e, const cJSON *n, const char *path)
{
    double mn, mx, xmn, xmx;
    bool hmn, hmx, hxmn, hxmx;
    if (!get_bound(s, n, "minimum", path, true, &mn, &hmn) || !get_bound(s, n, "maximum", path, true, &mx, &hmx) ||
        !get_bound(s, n, "exclusiveMinimum", path, true, &xmn, &hxmn) ||
        !get_bound(s, n, "exclusiveMaximum", path, true, &xmx, &hxmx))
        return false;
    if (!hmn && !hmx && !hxmn && !hxmx) {
        td_gram_str_puts(e, "integer");
        return true;
    }
    bool has_lo = hmn || hxmn, has_hi = hmx || hxmx;
    long long lo = LLONG_MIN, hi = LLONG_MAX;
    if (hmn)
        lo = (long long)ceil(mn);
    if (hxmn && (long long)floor(xmn) + 1 > lo)
        lo = (long long)floor(xmn) + 1;
    if (hmx)
        hi = (long long)floor(mx);
    if (hxmx && (long long)ceil(xmx) - 1 < hi)
        hi = (long long)ceil(xmx) - 1;
    if (has_lo && has_hi && lo > hi)
        return sch_fail(s, TD_ERR_INVALID, path, "no integer lies between the bounds"), false;
    td_gram_str_puts(e, "(");
    bool any = false;
    if (!has_hi || hi >= 0) { /* the non-negative part */
        uint_range(e, has_lo && lo > 0 ? lo : 0, has_hi ? hi : -1);
        any = true;
    }
    if (!has_lo || lo < 0) { /* the negative part: "-" then [max(1, -hi), -lo] */
        long long nlo = has_hi && hi < 0 ? -hi : 1;
        td_gram_str_puts(e, any ? " | \"-\" " : "\"-\" ");
        uint_range(e, nlo, has_lo ? -lo : -1);
    }
    td_gram_str_puts(e, ")");
    return true;
}

static bool number_body(sch_t *s, td_gram_str_t *e, const cJSON *n, const char *path)
{
    double mn, mx, xmn, xmx;
    bool hmn, hmx, hxmn, hxmx;
    if (!get_bound(s, n, "minimum", path, false, &mn, &hmn) || !get_bound(s, n, "maximum", path, false, &mx, &hmx) ||
        !get_bound(s, n, "exclusiveMinimum", path, false, &xmn, &hxmn) ||
        !get_bound(s, n, "exclusiveMaximum", path, false, &xmx, &hxmx))
        return false;
    if (hmx || hxmx || hxmn || (hmn && mn != 0)) {
        char p[512];
        jpath(p, sizeof p, path, hmx ? "maximum" : hxmx ? "exclusiveMaximum" : hxmn ? "exclusiveMinimum" : "minimum");
        return sch_fail(s, TD_ERR_UNSUPPORTED, p, "bounds on a number are supported only as \"minimum\": 0; "
                        "use \"type\": \"integer\" for other bounds"), false;
    }
    if (hmn) /* minimum 0: no sign */
        td_gram_str_puts(e, "( ( \"0\" | [1-9] [0-9]{0,15} ) ( \".\" [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )? )");
    else
        td_gram_str_puts(e, "number");
    return true;
}

static bool string_body(sch_t *s, td_gram_str_t *e, const cJSON *n, const char *path)
{
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(n, "format");
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
    const cJSON *mnl = cJSON_GetObjectItemCaseSensitive(n, "minLength");
    const cJSON *mxl = cJSON_GetObjectItemCaseSensitive(n, "maxLength");
    char p[512];
    int kinds = !!fmt + !!pat + !!(mnl || mxl);
    if (kinds > 1)
        return sch_fail(s, TD_ERR_UNSUPPORTED, path, "a string with more than one of format, pattern and "
                        "minLength/maxLength is not supported"), false;
    if (fmt) {
        jpath(p, sizeof p, path, "format");
        if (!cJSON_IsString(fmt))
            return sch_fail(s, TD_ERR_FORMAT, p, "must be a string"), false;
        static const struct { const char *name, *rule; } fmts[] = {
            {"date", "\"\\\"\" date \"\\\"\""},
            {"time", "\"\\\"\" time \"\\\"\""},
            {"date-time", "\"\\\"\" date \"T\" time \"\\\"\""},
            {"uuid", "\"\\\"\" [0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{12} \"\\\"\""},
            {"email", "\"\\\"\" [a-zA-Z0-9._%+-]{1,64} \"@\" [a-zA-Z0-9-]{1,63} ( \".\" [a-zA-Z0-9-]{1,63} ){1,8} \"\\\"\""},
        };
        for (size_t i = 0; i < sizeof fmts / sizeof fmts[0]; i++) {
            if (!strcmp(fmt->valuestring, fmts[i].name)) {
                td_gram_str_printf(e, "( %s )", fmts[i].rule);
                return true;
            }
        }
        return sch_fail(s, TD_ERR_UNSUPPORTED, p, "format \"%s\" is not supported (supported: date, time, "
                        "date-time, uuid, email)", fmt->valuestring), false;
    }
    if (pat) {
        jpath(p, sizeof p, path, "pattern");
        if (!cJSON_IsString(pat))
            return sch_fail(s, TD_ERR_FORMAT, p, "must be a string"), false;
        int r = new_rule(s);
        char name[32];
        snprintf(name, sizeof name, "s%d", r);
        td_status_t st = td_gram_regex_rules(pat->valuestring, strlen(pat->valuestring), name, s->out);
        if (st != TD_OK)
            return sch_fail(s, st, p, "%s", td_last_error()), false;
        td_gram_str_printf(e, "( \"\\\"\" %s \"\\\"\" )", name);
        return true;
    }
    if (mnl || mxl) {
        long lo = 0, hi = -1;
        if (mnl) {
            jpath(p, sizeof p, path, "minLength");
            if (!cJSON_IsNumber(mnl) || mnl->valuedouble < 0 || mnl->valuedouble > TD_GRAM_MAX_REPEAT)
                return sch_fail(s, TD_ERR_RANGE, p, "must be an integer in [0, %d]", TD_GRAM_MAX_REPEAT), false;
            lo = (long)mnl->valuedouble;
        }
        if (mxl) {
            jpath(p, sizeof p, path, "maxLength");
            if (!cJSON_IsNumber(mxl) || mxl->valuedouble < lo || mxl->valuedouble > TD_GRAM_MAX_REPEAT)
                return sch_fail(s, TD_ERR_RANGE, p, "must be an integer in [minLength, %d]", TD_GRAM_MAX_REPEAT), false;
            hi = (long)mxl->valuedouble;
        }
        if (hi < 0)
            td_gram_str_printf(e, "( \"\\\"\" char{%ld,} \"\\\"\" )", lo);
        else
            td_gram_str_printf(e, "( \"\\\"\" char{%ld,%ld} \"\\\"\" )", lo, hi);
        return true;
    }
    td_gram_str_puts(e, "string");
    return true;
}

static bool object_body(sch_t *s, td_gram_str_t *e, const cJSON *n, const char *path)
{
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(n, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(n, "required");
    const cJSON *addl = cJSON_GetObjectItemCaseSensitive(n, "additionalProperties");
    char p[512];
    if (props && !cJSON_IsObject(props))
        return jpath(p, sizeof p, path, "properties"), sch_fail(s, TD_ERR_FORMAT, p, "must be an object"), false;
    if (req && !cJSON_IsArray(req))
        return jpath(p, sizeof p, path, "required"), sch_fail(s, TD_ERR_FORMAT, p, "must be an array"), false;
    if (!props && !addl) { /* any object */
        td_gram_str_puts(e, "object");
        return true;
    }
    /* the value rule of extra keys: -1 none, 0 any value, else a rule */
    int extra = -1;
    if (addl) {
        jpath(p, sizeof p, path, "additionalProperties");
        if (cJSON_IsBool(addl))
            extra = cJSON_IsTrue(addl) ? 0 : -1;
        else if (cJSON_IsObject(addl)) {
            if ((extra = sch_node(s, addl, p)) < 0)
                return false;
        } else
            return sch_fail(s, TD_ERR_FORMAT, p, "must be a boolean or a schema"), false;
    }
    int np = props ? cJSON_GetArraySize(props) : 0;
    if (req) {
        for (const cJSON *r = req->child; r; r = r->next) {
            if (!cJSON_IsString(r))
                return jpath(p, sizeof p, path, "required"), sch_fail(s, TD_ERR_FORMAT, p, "must list strings"), false;
            if (!props || !cJSON_GetObjectItemCaseSensitive(props, r->valuestring)) {
                if (extra < 0) {
                    jpath(p, sizeof p, path, "required");
                    return sch_fail(s, TD_ERR_INVALID, p, "\"%s\" is required but not among the properties "
                                    "and no additional properties are allowed", r->valuestring), false;
                }
                jpath(p, sizeof p, path, "required");
                return sch_fail(s, TD_ERR_UNSUPPORTED, p, "\"%s\" is required but not among the properties: "
                                "list it under properties", r->valuestring), false;
            }
        }
    }
    /* each property: its key-value rule */
    int *kv = malloc(sizeof(int) * (size_t)(np + 1));
    bool *required = calloc((size_t)np + 1, sizeof *required);
    if (!kv || !required) {
        free(kv);
        free(required);
        return sch_fail(s, TD_ERR_NOMEM, path, "out of memory"), false;
    }
    int i = 0;
    for (const cJSON *pr = props ? props->child : NULL; pr; pr = pr->next, i++) {
        char pp[512];
        snprintf(pp, sizeof pp, "%s.properties.%s", path, pr->string);
        int v = sch_node(s, pr, pp);
        if (v < 0) {
            free(kv);
            free(required);
            return false;
        }
        kv[i] = new_rule(s);
        td_gram_str_printf(s->out, "s%d ::= ", kv[i]);
        json_string_literal(s->out, pr->string);
        td_gram_str_printf(s->out, " ws \":\" ws s%d ws\n", v);
        for (const cJSON *r = req ? req->child : NULL; r; r = r->next)
            if (cJSON_IsString(r) && !strcmp(r->valuestring, pr->string))
                required[i] = true;
    }
    int xkv = -1;
    if (extra >= 0) {
        xkv = new_rule(s);
        if (extra > 0)
            td_gram_str_printf(s->out, "s%d ::= string ws \":\" ws s%d ws\n", xkv, extra);
        else
            td_gram_str_printf(s->out, "s%d ::= member\n", xkv);
    }
    /* tail_i: the properties from i on, after one was written (each behind a comma);
     * head_i: the same before any was written */
    int base = s->next;
    s->next += 2 * (np + 1);
    for (int k = np; k >= 0; k--) {
        int tail = base + 1 + 2 * k, head = base + 2 + 2 * k;
        if (k == np) {
            if (xkv >= 0) {
                td_gram_str_printf(s->out, "s%d ::= ( \",\" ws s%d )*\n", tail, xkv);
                td_gram_str_printf(s->out, "s%d ::= ( s%d ( \",\" ws s%d )* )?\n", head, xkv, xkv);
            } else {
                td_gram_str_printf(s->out, "s%d ::= \"\"\n", tail);
                td_gram_str_printf(s->out, "s%d ::= \"\"\n", head);
            }
            continue;
        }
        int nt = base + 1 + 2 * (k + 1), nh = base + 2 + 2 * (k + 1);
        if (required[k]) {
            td_gram_str_printf(s->out, "s%d ::= \",\" ws s%d s%d\n", tail, kv[k], nt);
            td_gram_str_printf(s->out, "s%d ::= s%d s%d\n", head, kv[k], nt);
        } else {
            td_gram_str_printf(s->out, "s%d ::= ( \",\" ws s%d )? s%d\n", tail, kv[k], nt);
            td_gram_str_printf(s->out, "s%d ::= s%d s%d | s%d\n", head, kv[k], nt, nh);
        }
    }
    td_gram_str_printf(e, "( \"{\" ws s%d \"}\" )", base + 2);
    free(kv);
    free(required);
    return true;
}

static bool array_body(sch_t *s, td_gram_str_t *e, const cJSON *n, const char *path)
{
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(n, "items");
    const cJSON *mni = cJSON_GetObjectItemCaseSensitive(n, "minItems");
    const cJSON *mxi = cJSON_GetObjectItemCaseSensitive(n, "maxItems");
    char p[512];
    int it = 0;
    if (items) {
        jpath(p, sizeof p, path, "items");
        if (!cJSON_IsObject(items))
            return sch_fail(s, TD_ERR_UNSUPPORTED, p, "items must be one schema (tuple forms and prefixItems are not supported)"), false;
        if ((it = sch_node(s, items, p)) < 0)
            return false;
    }
    long lo = 0, hi = -1;
    if (mni) {
        jpath(p, sizeof p, path, "minItems");
        if (!cJSON_IsNumber(mni) || mni->valuedouble < 0 || mni->valuedouble > TD_GRAM_MAX_REPEAT)
            return sch_fail(s, TD_ERR_RANGE, p, "must be an integer in [0, %d]", TD_GRAM_MAX_REPEAT), false;
        lo = (long)mni->valuedouble;
    }
    if (mxi) {
        jpath(p, sizeof p, path, "maxItems");
        if (!cJSON_IsNumber(mxi) || mxi->valuedouble < lo || mxi->valuedouble > TD_GRAM_MAX_REPEAT)
            return sch_fail(s, TD_ERR_RANGE, p, "must be an integer in [minItems, %d]", TD_GRAM_MAX_REPEAT), false;
        hi = (long)mxi->valuedouble;
    }
    char item[32];
    if (it > 0)
        snprintf(item, sizeof item, "s%d", it);
    else
        snprintf(item, sizeof item, "value");
    if (hi == 0) {
        td_gram_str_puts(e, "( \"[\" ws \"]\" )");
        return true;
    }
    td_gram_str_printf(e, "( \"[\" ws %s%s ws ( \",\" ws %s ws )", lo == 0 ? "( " : "", item, item);
    long rlo = lo > 0 ? lo - 1 : 0, rhi = hi < 0 ? -1 : hi - 1;
    if (rhi < 0)
        td_gram_str_printf(e, "{%ld,}", rlo);
    else
        td_gram_str_printf(e, "{%ld,%ld}", rlo, rhi);
    td_gram_str_printf(e, "%s \"]\" )", lo == 0 ? " )?" : "");
    return true;
}

/* The body of node n for one type name */
static bool type_body(sch_t *s, td_gram_str_t *e, const cJSON *n, const char *type, const char *path)
{
    if (!strcmp(type, "string"))
        return string_body(s, e, n, path);
    if (!strcmp(type, "integer"))
        return integer_body(s, e, n, path);
    if (!strcmp(type, "number"))
        return number_body(s, e, n, path);
    if (!strcmp(type, "boolean")) {
        td_gram_str_puts(e, "boolean");
        return true;
    }
    if (!strcmp(type, "null")) {
        td_gram_str_puts(e, "null");
        return true;
    }
    if (!strcmp(type, "object"))
        return object_body(s, e, n, path);
    if (!strcmp(type, "array"))
        return array_body(s, e, n, path);
    char p[512];
    jpath(p, sizeof p, path, "type");
    return sch_fail(s, TD_ERR_FORMAT, p, "unknown type \"%s\"", type), false;
}

static int ref_rule(sch_t *s, const char *ref, const char *path)
{
    for (int i = 0; i < s->n_refs; i++)
        if (s->refs[i].rule >= 0 && !strcmp(s->refs[i].ref, ref))
            return s->refs[i].rule;
    const cJSON *target = NULL;
    if (!strcmp(ref, "#")) {
        target = s->root;
    } else if (!strncmp(ref, "#/$defs/", 8) || !strncmp(ref, "#/definitions/", 14)) {
        const char *name = ref + (ref[2] == '$' ? 8 : 14);
        const cJSON *defs = cJSON_GetObjectItemCaseSensitive(s->root, ref[2] == '$' ? "$defs" : "definitions");
        target = defs ? cJSON_GetObjectItemCaseSensitive(defs, name) : NULL;
        if (!target)
            return sch_fail(s, TD_ERR_INVALID, path, "$ref \"%s\": no such definition", ref);
    } else {
        return sch_fail(s, TD_ERR_UNSUPPORTED, path, "$ref \"%s\": only \"#\", \"#/$defs/NAME\" and "
                        "\"#/definitions/NAME\" are supported", ref);
    }
    if (s->n_refs == (int)(sizeof s->refs / sizeof s->refs[0]))
        return sch_fail(s, TD_ERR_RANGE, path, "more than %d patterns and $refs", s->n_refs);
    int r = new_rule(s);
    char *copy = strdup(ref);
    if (!copy)
        return sch_fail(s, TD_ERR_NOMEM, path, "out of memory");
    s->refs[s->n_refs].ref = copy;
    s->refs[s->n_refs].rule = r;
    s->n_refs++;
    /* the target's rule, written once; recursion refers to r before it is complete */
    int body = sch_node(s, target, ref);
    if (body < 0)
        return -1;
    td_gram_str_printf(s->out, "s%d ::= s%d\n", r, body);
    return r;
}

/* Writes the rules of schema node n; returns its rule number (or -1 with s->st set). */
static int sch_node(sch_t *s, const cJSON *n, const char *path)
{
    if (++s->depth > TD_GRAM_MAX_NESTING)
        return sch_fail(s, TD_ERR_RANGE, path, "schemas nested more than %d deep", TD_GRAM_MAX_NESTING);
    int result = -1;
    char p[512];
    if (cJSON_IsBool(n)) {
        if (cJSON_IsFalse(n)) {
            sch_fail(s, TD_ERR_UNSUPPORTED, path, "the schema false (nothing matches) is not supported here");
            goto out;
        }
        result = new_rule(s);
        td_gram_str_printf(s->out, "s%d ::= value\n", result);
        goto out;
    }
    if (!cJSON_IsObject(n)) {
        sch_fail(s, TD_ERR_FORMAT, path, "a schema must be an object or a boolean");
        goto out;
    }
    for (const cJSON *k = n->child; k; k = k->next) {
        if (in_list(annotations, k->string) || in_list(keywords, k->string))
            continue;
        jpath(p, sizeof p, path, k->string);
        sch_fail(s, TD_ERR_UNSUPPORTED, p, "keyword \"%s\" is not supported (docs/grammar.md lists what is)", k->string);
        goto out;
    }
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(n, "type");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(n, "enum");
    const cJSON *cn = cJSON_GetObjectItemCaseSensitive(n, "const");
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(n, "anyOf");
    const cJSON *one = cJSON_GetObjectItemCaseSensitive(n, "oneOf");
    const cJSON *all = cJSON_GetObjectItemCaseSensitive(n, "allOf");
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(n, "$ref");
    const cJSON *nullable = cJSON_GetObjectItemCaseSensitive(n, "nullable");
    bool or_null = cJSON_IsTrue(nullable);
    if (all) {
        jpath(p, sizeof p, path, "allOf");
        if (!cJSON_IsArray(all) || cJSON_GetArraySize(all) != 1 || cJSON_GetArraySize(n) != 1) {
            sch_fail(s, TD_ERR_UNSUPPORTED, p, "keyword \"allOf\" is supported only with one schema and nothing beside it");
            goto out;
        }
        result = sch_node(s, all->child, p);
        goto out;
    }
    if (ref) {
        jpath(p, sizeof p, path, "$ref");
        if (!cJSON_IsString(ref)) {
            sch_fail(s, TD_ERR_FORMAT, p, "must be a string");
            goto out;
        }
        result = ref_rule(s, ref->valuestring, p);
        goto out;
    }
    /* the node's own rule: its alternatives gathered in body while nested nodes write
     * their complete rules to the output */
    td_gram_str_t body = {0};
    bool ok = true;
    if (en || cn) {
        jpath(p, sizeof p, path, en ? "enum" : "const");
        if (en && (!cJSON_IsArray(en) || cJSON_GetArraySize(en) < 1)) {
            ok = false;
            sch_fail(s, TD_ERR_FORMAT, p, "must be a non-empty array");
        }
        int i = 0;
        for (const cJSON *v = en ? en->child : cn; ok && v; v = en ? v->next : NULL, i++) {
            if (i)
                td_gram_str_puts(&body, " | ");
            ok = literal_value(s, &body, v, p);
        }
    } else if (any || one) {
        const cJSON *list = any ? any : one;
        jpath(p, sizeof p, path, any ? "anyOf" : "oneOf");
        if (!cJSON_IsArray(list) || cJSON_GetArraySize(list) < 1) {
            ok = false;
            sch_fail(s, TD_ERR_FORMAT, p, "must be a non-empty array of schemas");
        }
        int i = 0;
        for (const cJSON *v = ok ? list->child : NULL; v; v = v->next, i++) {
            char pi[560];
            snprintf(pi, sizeof pi, "%s[%d]", p, i);
            int r = sch_node(s, v, pi);
            if (r < 0) {
                ok = false;
                break;
            }
            td_gram_str_printf(&body, "%ss%d", i ? " | " : "", r);
        }
    } else if (type) {
        int i = 0;
        const cJSON *t = cJSON_IsArray(type) ? type->child : type;
        jpath(p, sizeof p, path, "type");
        if (cJSON_IsArray(type) && !t) {
            ok = false;
            sch_fail(s, TD_ERR_FORMAT, p, "an empty type list");
        }
        for (; ok && t; t = cJSON_IsArray(type) ? t->next : NULL, i++) {
            if (!cJSON_IsString(t)) {
                ok = false;
                sch_fail(s, TD_ERR_FORMAT, p, "must be a string or an array of strings");
                break;
            }
            if (i)
                td_gram_str_puts(&body, " | ");
            ok = type_body(s, &body, n, t->valuestring, path);
        }
    } else if (cJSON_GetObjectItemCaseSensitive(n, "properties") ||
               cJSON_GetObjectItemCaseSensitive(n, "additionalProperties")) {
        ok = type_body(s, &body, n, "object", path);
    } else if (cJSON_GetObjectItemCaseSensitive(n, "items")) {
        ok = type_body(s, &body, n, "array", path);
    } else {
        td_gram_str_puts(&body, "value");
    }
    if (ok && s->st == TD_OK) {
        result = new_rule(s);
        td_gram_str_printf(s->out, "s%d ::= %s%s\n", result, body.s ? body.s : "\"\"", or_null ? " | null" : "");
    }
    td_gram_str_free(&body);
out:
    s->depth--;
    return s->st == TD_OK ? result : -1;
}

td_status_t td_gram_schema_to_gbnf(const char *src, size_t len, td_gram_str_t *out)
{
    cJSON *root = cJSON_ParseWithLength(src, len);
    if (!root)
        return td_errorf_quiet(TD_ERR_FORMAT, "json schema: not valid JSON (near byte %td)",
                               cJSON_GetErrorPtr() ? cJSON_GetErrorPtr() - src : (ptrdiff_t)0);
    sch_t s = {.root = root};
    td_gram_str_t rules = {0};
    s.out = &rules;
    int r = sch_node(&s, root, "$");
    if (r >= 0) {
        td_gram_str_printf(out, "root ::= s%d\n", r);
        td_gram_str_add(out, rules.s ? rules.s : "", rules.len);
        json_common(out);
        if (rules.oom)
            out->oom = true;
    }
    for (int i = 0; i < s.n_refs; i++)
        free(s.refs[i].ref);
    td_gram_str_free(&rules);
    cJSON_Delete(root);
    return s.st;
}
