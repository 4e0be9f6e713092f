/*
 * td_chat_template_render: the renderer of td_chat_template (the overview is in
 * td_chat_template.c). It walks the compiled tree with the conversation bound to
 * `messages`, evaluating expressions into values that live in the render's own arena
 * (capped by max_memory), and appends the text to one output buffer; steps, output bytes
 * and memory are each bounded by td_chat_render_t.
 */
#include "td_chat_template_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- renderer ---- */

typedef struct binding {
    const char *name;
    size_t n;
    val_t v;
} binding_t;

typedef struct render {
    errctx_t e;
    const td_chat_render_t *r;
    td_arena_t a;
    char *out;
    size_t out_n, out_cap;
    uint64_t steps;
    binding_t *vars; /* innermost last */
    size_t n_vars, cap_vars;
} render_t;

static td_status_t nomem(render_t *R, size_t pos)
{
    if (R->a.over_limit)
        return td_chat_fail(&R->e, TD_ERR_EXHAUSTED, pos,
                            "rendering needs more than %zu bytes of memory", R->r->max_memory);
    return td_chat_fail(&R->e, TD_ERR_NOMEM, pos, "out of memory");
}

static void *ralloc(render_t *R, size_t n)
{
    return td_arena_alloc(&R->a, n);
}

static td_status_t step(render_t *R, size_t pos)
{
    if (++R->steps > R->r->max_steps)
        return td_chat_fail(&R->e, TD_ERR_EXHAUSTED, pos,
                            "rendering takes more than %" PRIu64 " steps", R->r->max_steps);
    return TD_OK;
}

static td_status_t emit(render_t *R, size_t pos, const char *s, size_t n)
{
    if (n > R->r->max_output - R->out_n)
        return td_chat_fail(&R->e, TD_ERR_EXHAUSTED, pos, "output exceeds %zu bytes",
                            R->r->max_output);
    if (R->out_n + n + 1 > R->out_cap) {
        size_t cap = R->out_cap ? R->out_cap : 1024;
        while (cap < R->out_n + n + 1)
            cap *= 2;
        char *o = realloc(R->out, cap);
        if (!o)
            return td_chat_fail(&R->e, TD_ERR_NOMEM, pos, "out of memory");
        R->out = o;
        R->out_cap = cap;
    }
    memcpy(R->out + R->out_n, s, n);
    R->out_n += n;
    return TD_OK;
}

static val_t str_val(const char *s, size_t n)
{
    return (val_t){.t = V_STR, .u.s = {s, n}};
}

static bool truthy(val_t v)
{
    switch (v.t) {
    case V_UNDEF:
    case V_NONE:
        return false;
    case V_BOOL:
        return v.u.b;
    case V_INT:
        return v.u.i != 0;
    case V_STR:
        return v.u.s.n != 0;
    case V_LIST:
        return v.u.l->n != 0;
    case V_DICT:
        return v.u.d->n != 0;
    case V_LOOP:
    case V_NS:
        return true;
    case V_FLOAT:
        return v.u.f != 0;
    }
    return false;
}

static const char *type_name(val_t v)
{
    static const char *const names[] = {"undefined", "none", "boolean", "integer", "string",
                                        "list",      "mapping", "loop", "float",   "namespace"};
    return names[v.t];
}

/* Python's repr of a float (the shortest digits that read back the same; positional
 * notation for exponents in [-4, 16), else d.ddde+XX), as str() and json.dumps write it,
 * into buf (at least 32 bytes); returns its length. */
static size_t float_repr(double f, char *buf, size_t cap)
{
    if (f != f)
        return (size_t)snprintf(buf, cap, "NaN");
    if (f == HUGE_VAL || f == -HUGE_VAL)
        return (size_t)snprintf(buf, cap, "%sInfinity", f < 0 ? "-" : "");
    char e[40];
    int prec = 0;
    for (prec = 0; prec < 17; prec++) { /* %.Ne: N+1 significant digits */
        snprintf(e, sizeof e, "%.*e", prec, f);
        if (strtod(e, NULL) == f)
            break;
    }
    /* e: [-]d[.ddd]e[+-]XX -> sign, digits, exponent */
    const char *q = e;
    bool neg = *q == '-';
    if (neg)
        q++;
    char dig[24];
    size_t nd = 0;
    for (; *q && *q != 'e'; q++)
        if (*q != '.')
            dig[nd++] = *q;
    int exp10 = atoi(q + 1);
    while (nd > 1 && dig[nd - 1] == '0')
        nd--;
    size_t k = 0;
    if (neg)
        buf[k++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            buf[k++] = '0', buf[k++] = '.';
            for (int i = -1; i > exp10; i--)
                buf[k++] = '0';
            for (size_t i = 0; i < nd; i++)
                buf[k++] = dig[i];
        } else {
            for (int i = 0; i <= exp10; i++)
                buf[k++] = (size_t)i < nd ? dig[i] : '0';
            buf[k++] = '.';
            if ((size_t)exp10 + 1 < nd)
                for (size_t i = (size_t)exp10 + 1; i < nd; i++)
                    buf[k++] = dig[i];
            else
                buf[k++] = '0';
        }
        buf[k] = '\0';
        return k;
    }
    buf[k++] = dig[0];
    if (nd > 1) {
        buf[k++] = '.';
        for (size_t i = 1; i < nd; i++)
            buf[k++] = dig[i];
    }
    k += (size_t)snprintf(buf + k, cap - k, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    return k;
}

/* The text {{ v }} prints; *s_p points into the arena or a literal. */
static td_status_t to_text(render_t *R, size_t pos, val_t v, const char **s_p, size_t *n_p)
{
    char buf[32];
    switch (v.t) {
    case V_UNDEF:
        *s_p = "", *n_p = 0;
        return TD_OK;
    case V_NONE:
        *s_p = "None", *n_p = 4;
        return TD_OK;
    case V_BOOL:
        *s_p = v.u.b ? "True" : "False", *n_p = v.u.b ? 4 : 5;
        return TD_OK;
    case V_STR:
        *s_p = v.u.s.p, *n_p = v.u.s.n;
        return TD_OK;
    case V_FLOAT: {
        int n = (int)float_repr(v.u.f, buf, sizeof buf);
        char *d = ralloc(R, (size_t)n + 1);
        if (!d)
            return nomem(R, pos);
        memcpy(d, buf, (size_t)n + 1);
        *s_p = d, *n_p = (size_t)n;
        return TD_OK;
    }
    case V_INT: {
        int n = snprintf(buf, sizeof buf, "%" PRId64, v.u.i);
        char *d = ralloc(R, (size_t)n + 1);
        if (!d)
            return nomem(R, pos);
        memcpy(d, buf, (size_t)n + 1);
        *s_p = d, *n_p = (size_t)n;
        return TD_OK;
    }
    default:
        return td_chat_fail(&R->e, TD_ERR_UNSUPPORTED, pos, "printing a %s is not supported",
                            type_name(v));
    }
}

static bool dict_get(const dict_t *d, const char *k, size_t n, val_t *v_p);

static bool is_num(val_t v)
{
    return v.t == V_INT || v.t == V_BOOL || v.t == V_FLOAT;
}

static double num_f(val_t v)
{
    return v.t == V_FLOAT ? v.u.f : v.t == V_INT ? (double)v.u.i : (double)v.u.b;
}

/* Python's ==: numbers by value, lists item by item, mappings key by key in any order.
 * Values from JSON are at most JSON_MAX_DEPTH deep and template values cannot nest
 * themselves, so the recursion is bounded. */
static bool equal(val_t a, val_t b)
{
    if ((a.t == V_INT || a.t == V_BOOL) && (b.t == V_INT || b.t == V_BOOL)) {
        int64_t x = a.t == V_INT ? a.u.i : a.u.b, y = b.t == V_INT ? b.u.i : b.u.b;
        return x == y;
    }
    if (is_num(a) && is_num(b))
        return num_f(a) == num_f(b);
    if (a.t == V_DICT && b.t == V_DICT) {
        if (a.u.d->n != b.u.d->n)
            return false;
        for (size_t i = 0; i < a.u.d->n; i++) {
            val_t w;
            if (!dict_get(b.u.d, a.u.d->keys[i], strlen(a.u.d->keys[i]), &w) ||
                !equal(a.u.d->v[i], w))
                return false;
        }
        return true;
    }
    if (a.t != b.t)
        return false;
    switch (a.t) {
    case V_UNDEF:
    case V_NONE:
        return true;
    case V_STR:
        return a.u.s.n == b.u.s.n && !memcmp(a.u.s.p, b.u.s.p, a.u.s.n);
    case V_LIST:
        if (a.u.l->n != b.u.l->n)
            return false;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!equal(a.u.l->v[i], b.u.l->v[i]))
                return false;
        return true;
    default:
        return a.u.ns == b.u.ns && a.u.loop == b.u.loop;
    }
}

static bool dict_get(const dict_t *d, const char *k, size_t n, val_t *v_p)
{
    for (size_t i = 0; i < d->n; i++)
        if (strlen(d->keys[i]) == n && !memcmp(d->keys[i], k, n)) {
            *v_p = d->v[i];
            return true;
        }
    return false;
}

/* x.name / x['name']: an absent key is undefined, as in jinja2. */
static td_status_t get_attr(render_t *R, size_t pos, val_t x, const char *k, size_t n, val_t *out)
{
    *out = (val_t){.t = V_UNDEF};
    if (x.t == V_UNDEF)
        return td_chat_fail(&R->e, TD_ERR_INVALID, pos, "undefined value has no attribute '%.*s'",
                            (int)n, k);
    if (x.t == V_DICT || x.t == V_NS) {
        dict_get(x.t == V_DICT ? x.u.d : x.u.ns, k, n, out);
    } else if (x.t == V_LOOP) {
        const loopv_t *l = x.u.loop;
        int64_t i0 = (int64_t)l->index0, len = (int64_t)l->length;
        struct {
            const char *name;
            val_t v;
        } f[] = {{"index0", {.t = V_INT, .u.i = i0}},
                 {"index", {.t = V_INT, .u.i = i0 + 1}},
                 {"revindex0", {.t = V_INT, .u.i = len - i0 - 1}},
                 {"revindex", {.t = V_INT, .u.i = len - i0}},
                 {"length", {.t = V_INT, .u.i = len}},
                 {"first", {.t = V_BOOL, .u.b = i0 == 0}},
                 {"last", {.t = V_BOOL, .u.b = i0 == len - 1}}};
        for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
            if (strlen(f[i].name) == n && !memcmp(f[i].name, k, n))
                *out = f[i].v;
    }
    return TD_OK;
}

static td_status_t eval(render_t *R, const node_t *n, val_t *out);

/* ---- JSON data (tools, tool calls) ---- */

#define JSON_MAX_DEPTH 64 /* nesting of the JSON handed to a template */

typedef struct jin {
    const char *p, *end;
} jin_t;

static void j_ws(jin_t *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}

static td_status_t j_bad(render_t *R, const char *what)
{
    return td_chat_fail(&R->e, TD_ERR_INVALID, 0, "%s is not valid JSON", what);
}

static int hexv(char c)
{
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

static bool j_hex4(jin_t *j, uint32_t *u)
{
    if (j->end - j->p < 4)
        return false;
    *u = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexv(j->p[i]);
        if (h < 0)
            return false;
        *u = *u << 4 | (uint32_t)h;
    }
    j->p += 4;
    return true;
}

/* A JSON string at j->p (the opening quote) decoded into the arena. */
static td_status_t j_str(render_t *R, jin_t *j, const char *what, const char **s_p, size_t *n_p)
{
    j->p++;
    const char *q = j->p;
    while (q < j->end && *q != '"')
        q += *q == '\\' ? 2 : 1;
    if (q >= j->end)
        return j_bad(R, what);
    char *d = ralloc(R, (size_t)(q - j->p) + 1); /* decoding never grows a string */
    if (!d)
        return nomem(R, 0);
    size_t k = 0;
    while (*j->p != '"') {
        unsigned char c = (unsigned char)*j->p++;
        if (c < 0x20)
            return j_bad(R, what);
        if (c != '\\') {
            d[k++] = (char)c;
            continue;
        }
        char e = *j->p++;
        const char *simple = strchr("\"\\/bfnrt", e);
        if (e && simple) {
            static const char out[] = "\"\\/\b\f\n\r\t";
            d[k++] = out[simple - "\"\\/bfnrt"];
            continue;
        }
        uint32_t u, lo;
        if (e != 'u' || !j_hex4(j, &u))
            return j_bad(R, what);
        if (u >= 0xD800 && u < 0xDC00 && j->end - j->p >= 6 && j->p[0] == '\\' &&
            j->p[1] == 'u') {
            jin_t t = {j->p + 2, j->end};
            if (j_hex4(&t, &lo) && lo >= 0xDC00 && lo < 0xE000) {
                u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00);
                j->p = t.p;
            }
        }
        if (u < 0x80) {
            d[k++] = (char)u;
        } else if (u < 0x800) {
            d[k++] = (char)(0xC0 | u >> 6);
            d[k++] = (char)(0x80 | (u & 0x3F));
        } else if (u < 0x10000) { /* a lone surrogate is kept as its 3 bytes, as Python keeps it */
            d[k++] = (char)(0xE0 | u >> 12);
            d[k++] = (char)(0x80 | ((u >> 6) & 0x3F));
            d[k++] = (char)(0x80 | (u & 0x3F));
        } else {
            d[k++] = (char)(0xF0 | u >> 18);
            d[k++] = (char)(0x80 | ((u >> 12) & 0x3F));
            d[k++] = (char)(0x80 | ((u >> 6) & 0x3F));
            d[k++] = (char)(0x80 | (u & 0x3F));
        }
    }
    j->p++;
    d[k] = '\0';
    *s_p = d;
    *n_p = k;
    return TD_OK;
}

/* Items collected for one list or object before they go into the arena. */
typedef struct jvec {
    val_t *v;
    const char **keys;
    size_t n, cap;
} jvec_t;

static td_status_t jvec_push(render_t *R, jvec_t *w, const char *key, val_t v)
{
    if (w->n == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 8;
        val_t *nv = realloc(w->v, cap * sizeof *nv);
        if (nv)
            w->v = nv;
        const char **nk = realloc(w->keys, cap * sizeof *nk);
        if (nk)
            w->keys = nk;
        if (!nv || !nk)
            return td_chat_fail(&R->e, TD_ERR_NOMEM, 0, "out of memory");
        w->cap = cap;
    }
    for (size_t i = 0; key && i < w->n; i++)
        if (!strcmp(w->keys[i], key)) { /* a repeated key: the last value, the first place */
            w->v[i] = v;
            return TD_OK;
        }
    w->keys[w->n] = key;
    w->v[w->n++] = v;
    return TD_OK;
}

static td_status_t j_value(render_t *R, jin_t *j, const char *what, int depth, val_t *out);

static td_status_t j_container(render_t *R, jin_t *j, const char *what, int depth, val_t *out)
{
    bool obj = *j->p == '{';
    char close = obj ? '}' : ']';
    if (depth >= JSON_MAX_DEPTH)
        return td_chat_fail(&R->e, TD_ERR_RANGE, 0, "%s nests deeper than %d", what,
                            JSON_MAX_DEPTH);
    j->p++;
    jvec_t w = {0};
    td_status_t st = TD_OK;
    j_ws(j);
    if (j->p < j->end && *j->p == close) {
        j->p++;
    } else {
        for (;;) {
            const char *key = NULL;
            size_t kn;
            val_t v;
            j_ws(j);
            if (obj) {
                if (j->p >= j->end || *j->p != '"' || (st = j_str(R, j, what, &key, &kn)))
                    break;
                j_ws(j);
                if (j->p >= j->end || *j->p++ != ':')
                    break;
            }
            if ((st = j_value(R, j, what, depth + 1, &v)) || (st = jvec_push(R, &w, key, v)))
                break;
            j_ws(j);
            if (j->p < j->end && *j->p == ',') {
                j->p++;
                continue;
            }
            if (j->p < j->end && *j->p == close) {
                j->p++;
                goto done;
            }
            break;
        }
        if (!st)
            st = j_bad(R, what);
        goto out;
    }
done:
    if (obj) {
        dict_t *d = ralloc(R, sizeof *d);
        val_t *v = ralloc(R, (w.n ? w.n : 1) * sizeof *v);
        const char **k = ralloc(R, (w.n ? w.n : 1) * sizeof *k);
        if (!d || !v || !k) {
            st = nomem(R, 0);
            goto out;
        }
        if (w.n) {
            memcpy(v, w.v, w.n * sizeof *v);
            memcpy(k, w.keys, w.n * sizeof *k);
        }
        *d = (dict_t){.n = w.n, .keys = k, .v = v};
        *out = (val_t){.t = V_DICT, .u.d = d};
    } else {
        list_t *l = ralloc(R, sizeof *l + w.n * sizeof l->v[0]);
        if (!l) {
            st = nomem(R, 0);
            goto out;
        }
        l->n = w.n;
        if (w.n)
            memcpy(l->v, w.v, w.n * sizeof *w.v);
        *out = (val_t){.t = V_LIST, .u.l = l};
    }
out:
    free(w.v);
    free(w.keys);
    return st;
}

static td_status_t j_value(render_t *R, jin_t *j, const char *what, int depth, val_t *out)
{
    TRY(step(R, 0));
    j_ws(j);
    if (j->p >= j->end)
        return j_bad(R, what);
    char c = *j->p;
    if (c == '{' || c == '[')
        return j_container(R, j, what, depth, out);
    if (c == '"') {
        const char *s;
        size_t n;
        TRY(j_str(R, j, what, &s, &n));
        *out = str_val(s, n);
        return TD_OK;
    }
    static const struct {
        const char *lit;
        val_t v;
    } LITS[] = {{"true", {.t = V_BOOL, .u.b = true}},
                {"false", {.t = V_BOOL, .u.b = false}},
                {"null", {.t = V_NONE}}};
    for (size_t i = 0; i < sizeof LITS / sizeof LITS[0]; i++) {
        size_t n = strlen(LITS[i].lit);
        if ((size_t)(j->end - j->p) >= n && !memcmp(j->p, LITS[i].lit, n)) {
            j->p += n;
            *out = LITS[i].v;
            return TD_OK;
        }
    }
    /* a number: an integer when it has neither fraction nor exponent and fits 64 bits (a
     * larger one becomes a float), as Python's json reads int and float apart */
    const char *q = j->p;
    if (q < j->end && *q == '-')
        q++;
    if (q >= j->end || *q < '0' || *q > '9')
        return j_bad(R, what);
    bool is_float = false;
    while (q < j->end && ((*q >= '0' && *q <= '9') || *q == '.' || *q == 'e' || *q == 'E' ||
                          ((*q == '+' || *q == '-') && (q[-1] == 'e' || q[-1] == 'E')))) {
        is_float |= *q == '.' || *q == 'e' || *q == 'E';
        q++;
    }
    char num[64];
    size_t n = (size_t)(q - j->p);
    if (n >= sizeof num)
        return td_chat_fail(&R->e, TD_ERR_RANGE, 0, "%s has a number longer than %zu characters",
                            what, sizeof num - 1);
    memcpy(num, j->p, n);
    num[n] = '\0';
    j->p = q;
    char *endp;
    if (!is_float) {
        errno = 0;
        long long i = strtoll(num, &endp, 10);
        if (!errno && *endp == '\0') {
            *out = (val_t){.t = V_INT, .u.i = i};
            return TD_OK;
        }
    }
    double f = strtod(num, &endp);
    if (*endp != '\0')
        return j_bad(R, what);
    *out = (val_t){.t = V_FLOAT, .u.f = f};
    return TD_OK;
}

/* text (NUL-terminated JSON) as a value; `what` names it in errors. */
static td_status_t json_parse(render_t *R, const char *text, const char *what, val_t *out)
{
    jin_t j = {text, text + strlen(text)};
    TRY(j_value(R, &j, what, 0, out));
    j_ws(&j);
    return j.p == j.end ? TD_OK : j_bad(R, what);
}

/* ---- tojson ---- */

/* Text growing up to `limit` bytes (malloc'ed). */
typedef struct jout {
    char *p;
    size_t n, cap, limit;
    bool over, oom;
} jout_t;

static void jo_put(jout_t *o, const char *s, size_t n)
{
    if (o->over || o->oom)
        return;
    if (n > o->limit - o->n) {
        o->over = true;
        return;
    }
    if (o->n + n + 1 > o->cap) {
        size_t cap = o->cap ? o->cap : 256;
        while (cap < o->n + n + 1)
            cap *= 2;
        char *p = realloc(o->p, cap);
        if (!p) {
            o->oom = true;
            return;
        }
        o->p = p;
        o->cap = cap;
    }
    memcpy(o->p + o->n, s, n);
    o->n += n;
}

static void jo_str(jout_t *o, const char *s, size_t n)
{
    jo_put(o, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char u[8];
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(u, sizeof u, "\\u%04x", c);
                esc = u;
            }
        }
        if (!esc)
            continue;
        jo_put(o, s + run, i - run);
        jo_put(o, esc, strlen(esc));
        run = i + 1;
    }
    jo_put(o, s + run, n - run);
    jo_put(o, "\"", 1);
}

static void jo_newline(jout_t *o, int64_t indent, int level)
{
    jo_put(o, "\n", 1);
    for (int64_t i = 0; i < indent * level && !o->over; i++)
        jo_put(o, " ", 1);
}

/* Python's json.dumps(v, ensure_ascii=False, indent=indent) (indent < 0: none), as the
 * tojson filter Hugging Face's chat environment installs writes it. */
static td_status_t jo_value(render_t *R, size_t pos, jout_t *o, val_t v, int64_t indent, int level)
{
    TRY(step(R, pos));
    if (level > JSON_MAX_DEPTH)
        return td_chat_fail(&R->e, TD_ERR_RANGE, pos, "tojson: nesting deeper than %d",
                            JSON_MAX_DEPTH);
    char buf[40];
    switch (v.t) {
    case V_NONE:
        jo_put(o, "null", 4);
        return TD_OK;
    case V_BOOL:
        jo_put(o, v.u.b ? "true" : "false", v.u.b ? 4 : 5);
        return TD_OK;
    case V_INT:
        jo_put(o, buf, (size_t)snprintf(buf, sizeof buf, "%" PRId64, v.u.i));
        return TD_OK;
    case V_FLOAT:
        jo_put(o, buf, float_repr(v.u.f, buf, sizeof buf));
        return TD_OK;
    case V_STR:
        jo_str(o, v.u.s.p, v.u.s.n);
        return TD_OK;
    case V_LIST:
    case V_DICT: {
        bool obj = v.t == V_DICT;
        size_t n = obj ? v.u.d->n : v.u.l->n;
        if (!n) {
            jo_put(o, obj ? "{}" : "[]", 2);
            return TD_OK;
        }
        jo_put(o, obj ? "{" : "[", 1);
        for (size_t i = 0; i < n; i++) {
            if (i)
                jo_put(o, indent >= 0 ? "," : ", ", indent >= 0 ? 1 : 2);
            if (indent >= 0)
                jo_newline(o, indent, level + 1);
            if (obj) {
                jo_str(o, v.u.d->keys[i], strlen(v.u.d->keys[i]));
                jo_put(o, ": ", 2);
            }
            TRY(jo_value(R, pos, o, obj ? v.u.d->v[i] : v.u.l->v[i], indent, level + 1));
        }
        if (indent >= 0)
            jo_newline(o, indent, level);
        jo_put(o, obj ? "}" : "]", 1);
        return TD_OK;
    }
    default:
        return td_chat_fail(&R->e, TD_ERR_INVALID, pos, "tojson: a %s is not JSON serializable",
                            type_name(v));
    }
}

static td_status_t tojson(render_t *R, const node_t *n, val_t x, val_t *out)
{
    int64_t indent = -1;
    for (size_t i = 0; i < n->nargs; i++) {
        val_t a;
        TRY(eval(R, n->args[i], &a));
        if (strcmp(n->kw[i], "indent"))
            return td_chat_fail(&R->e, TD_ERR_UNSUPPORTED, n->pos,
                                "tojson: argument '%s' is not supported", n->kw[i]);
        if (a.t == V_NONE)
            continue;
        if (a.t != V_INT || a.u.i < 0 || a.u.i > 64)
            return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos,
                                "tojson: indent must be an integer in [0, 64]");
        indent = a.u.i;
    }
    jout_t o = {.limit = R->r->max_output};
    td_status_t st = jo_value(R, n->pos, &o, x, indent, 0);
    if (!st && o.over)
        st = td_chat_fail(&R->e, TD_ERR_EXHAUSTED, n->pos, "tojson: output exceeds %zu bytes",
                          R->r->max_output);
    if (!st && o.oom)
        st = td_chat_fail(&R->e, TD_ERR_NOMEM, n->pos, "out of memory");
    if (!st) {
        char *d = ralloc(R, o.n + 1);
        if (!d) {
            st = nomem(R, n->pos);
        } else {
            if (o.n)
                memcpy(d, o.p, o.n);
            d[o.n] = '\0';
            *out = str_val(d, o.n);
        }
    }
    free(o.p);
    return st;
}

static td_status_t lookup(render_t *R, const node_t *n, val_t *out)
{
    for (size_t i = R->n_vars; i-- > 0;)
        if (R->vars[i].n == n->sn && !memcmp(R->vars[i].name, n->s, n->sn)) {
            *out = R->vars[i].v;
            return TD_OK;
        }
    *out = (val_t){.t = V_UNDEF};
    return TD_OK;
}

static td_status_t bind(render_t *R, size_t pos, const char *name, size_t n, val_t v)
{
    if (R->n_vars == R->cap_vars) {
        size_t cap = R->cap_vars ? R->cap_vars * 2 : 16;
        binding_t *b = ralloc(R, cap * sizeof *b);
        if (!b)
            return nomem(R, pos);
        if (R->n_vars)
            memcpy(b, R->vars, R->n_vars * sizeof *b);
        R->vars = b;
        R->cap_vars = cap;
    }
    R->vars[R->n_vars++] = (binding_t){name, n, v};
    return TD_OK;
}

/* {% set %} assigns in the innermost scope that starts at `scope`. */
static td_status_t assign(render_t *R, size_t scope, size_t pos, const char *name, size_t n,
                          val_t v)
{
    for (size_t i = R->n_vars; i-- > scope;)
        if (R->vars[i].n == n && !memcmp(R->vars[i].name, name, n)) {
            R->vars[i].v = v;
            return TD_OK;
        }
    return bind(R, pos, name, n, v);
}

static td_status_t concat(render_t *R, size_t pos, const char *a, size_t an, const char *b,
                          size_t bn, val_t *out)
{
    char *d = ralloc(R, an + bn + 1);
    if (!d)
        return nomem(R, pos);
    memcpy(d, a, an);
    memcpy(d + an, b, bn);
    d[an + bn] = '\0';
    *out = str_val(d, an + bn);
    return TD_OK;
}

static td_status_t binop(render_t *R, const node_t *n, val_t a, val_t b, val_t *out)
{
    const char *op = n->s;
    if (!strcmp(op, "==") || !strcmp(op, "!=")) {
        *out = (val_t){.t = V_BOOL, .u.b = equal(a, b) == (op[0] == '=')};
        return TD_OK;
    }
    if (!strcmp(op, "in") || !strcmp(op, "not in")) {
        bool found = false;
        if (b.t == V_STR && a.t == V_STR) {
            found = a.u.s.n == 0;
            for (size_t i = 0; !found && i + a.u.s.n <= b.u.s.n; i++)
                found = !memcmp(b.u.s.p + i, a.u.s.p, a.u.s.n);
        } else if (b.t == V_LIST) {
            for (size_t i = 0; !found && i < b.u.l->n; i++)
                found = equal(a, b.u.l->v[i]);
        } else if (b.t == V_DICT && a.t == V_STR) {
            val_t ignored;
            found = dict_get(b.u.d, a.u.s.p, a.u.s.n, &ignored);
        } else if (b.t == V_LOOP && a.t == V_STR) {
            val_t v;
            TRY(get_attr(R, n->pos, b, a.u.s.p, a.u.s.n, &v));
            found = v.t != V_UNDEF;
        } else {
            return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos,
                                "'in' needs a string, list or mapping "
                                "on its right, not a %s",
                                type_name(b));
        }
        *out = (val_t){.t = V_BOOL, .u.b = found == (op[0] == 'i')};
        return TD_OK;
    }
    if (!strcmp(op, "~")) {
        const char *as, *bs;
        size_t an, bn;
        TRY(to_text(R, n->pos, a, &as, &an));
        TRY(to_text(R, n->pos, b, &bs, &bn));
        return concat(R, n->pos, as, an, bs, bn, out);
    }
    if (!strcmp(op, "+") && a.t == V_STR && b.t == V_STR)
        return concat(R, n->pos, a.u.s.p, a.u.s.n, b.u.s.p, b.u.s.n, out);
    if (!strcmp(op, "+") && a.t == V_LIST && b.t == V_LIST) {
        size_t k = a.u.l->n + b.u.l->n;
        list_t *l = ralloc(R, sizeof *l + k * sizeof l->v[0]);
        if (!l)
            return nomem(R, n->pos);
        l->n = k;
        memcpy(l->v, a.u.l->v, a.u.l->n * sizeof l->v[0]);
        memcpy(l->v + a.u.l->n, b.u.l->v, b.u.l->n * sizeof l->v[0]);
        *out = (val_t){.t = V_LIST, .u.l = l};
        return TD_OK;
    }
    bool ints = (a.t == V_INT || a.t == V_BOOL) && (b.t == V_INT || b.t == V_BOOL);
    if (!ints)
        return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "cannot apply '%s' to a %s and a %s", op,
                            type_name(a), type_name(b));
    int64_t x = a.t == V_INT ? a.u.i : a.u.b, y = b.t == V_INT ? b.u.i : b.u.b, r = 0;
    bool cmp = true, res = false;
    if (!strcmp(op, "<"))
        res = x < y;
    else if (!strcmp(op, "<="))
        res = x <= y;
    else if (!strcmp(op, ">"))
        res = x > y;
    else if (!strcmp(op, ">="))
        res = x >= y;
    else
        cmp = false;
    if (cmp) {
        *out = (val_t){.t = V_BOOL, .u.b = res};
        return TD_OK;
    }
    if (!strcmp(op, "/"))
        return td_chat_fail(&R->e, TD_ERR_UNSUPPORTED, n->pos,
                            "'/' (a float result) is not supported");
    if ((!strcmp(op, "//") || !strcmp(op, "%")) && y == 0)
        return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "division by zero");
    bool ovf = false;
    if (!strcmp(op, "+"))
        ovf = __builtin_add_overflow(x, y, &r);
    else if (!strcmp(op, "-"))
        ovf = __builtin_sub_overflow(x, y, &r);
    else if (!strcmp(op, "*"))
        ovf = __builtin_mul_overflow(x, y, &r);
    else if (x == INT64_MIN && y == -1)
        ovf = true;
    else if (!strcmp(op, "//"))
        r = x / y - ((x % y != 0) && ((x < 0) != (y < 0))); /* Python floors */
    else {
        r = x % y;
        if (r != 0 && ((r < 0) != (y < 0)))
            r += y;
    }
    if (ovf)
        return td_chat_fail(&R->e, TD_ERR_RANGE, n->pos, "integer overflow in '%s'", op);
    *out = (val_t){.t = V_INT, .u.i = r};
    return TD_OK;
}

static td_status_t case_map(render_t *R, size_t pos, val_t x, bool up, val_t *out);
static td_status_t filter_select(render_t *R, const node_t *n, val_t x, bool attr, bool keep,
                                 val_t *out);
static td_status_t dict_items(render_t *R, size_t pos, const dict_t *d, val_t *out);
static list_t *new_list(render_t *R, size_t n);

static td_status_t filter(render_t *R, const node_t *n, val_t x, val_t *out)
{
    const char *f = n->s;
    size_t fn = n->sn;
#define IS(name) (fn == sizeof(name) - 1 && !memcmp(f, name, fn))
    if (IS("default") || IS("d")) {
        *out = x;
        if (x.t == V_UNDEF) {
            *out = (val_t){.t = V_STR, .u.s = {"", 0}};
            if (n->nargs)
                TRY(eval(R, n->args[0], out));
        }
        return TD_OK;
    }
    if (IS("string")) {
        const char *s;
        size_t sn;
        TRY(to_text(R, n->pos, x, &s, &sn));
        *out = str_val(s, sn);
        return TD_OK;
    }
    if (IS("length") || IS("count")) {
        int64_t len;
        if (x.t == V_STR) {
            len = 0; /* characters, not bytes: count UTF-8 lead bytes */
            for (size_t i = 0; i < x.u.s.n; i++)
                len += ((unsigned char)x.u.s.p[i] & 0xC0) != 0x80;
        } else if (x.t == V_LIST) {
            len = (int64_t)x.u.l->n;
        } else if (x.t == V_DICT) {
            len = (int64_t)x.u.d->n;
        } else if (x.t == V_UNDEF) {
            len = 0;
        } else {
            return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "a %s has no length", type_name(x));
        }
        *out = (val_t){.t = V_INT, .u.i = len};
        return TD_OK;
    }
    if (IS("tojson"))
        return tojson(R, n, x, out);
    if (IS("selectattr") || IS("rejectattr") || IS("select") || IS("reject"))
        return filter_select(R, n, x, f[fn - 4] == 'a', f[0] == 's', out);
    if (IS("items")) {
        if (x.t == V_UNDEF) {
            list_t *l = new_list(R, 0);
            if (!l)
                return nomem(R, n->pos);
            *out = (val_t){.t = V_LIST, .u.l = l};
            return TD_OK;
        }
        if (x.t != V_DICT && x.t != V_NS)
            return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "items: a %s is not a mapping",
                                type_name(x));
        return dict_items(R, n->pos, x.t == V_DICT ? x.u.d : x.u.ns, out);
    }
    if (IS("list") && (x.t == V_LIST || x.t == V_DICT)) {
        size_t k = x.t == V_LIST ? x.u.l->n : x.u.d->n;
        list_t *l = new_list(R, k);
        if (!l)
            return nomem(R, n->pos);
        for (size_t i = 0; i < k; i++)
            l->v[i] = x.t == V_LIST ? x.u.l->v[i]
                                    : str_val(x.u.d->keys[i], strlen(x.u.d->keys[i]));
        *out = (val_t){.t = V_LIST, .u.l = l};
        return TD_OK;
    }
    if ((IS("first") || IS("last")) && x.t == V_LIST) {
        *out = (val_t){.t = V_UNDEF};
        if (x.u.l->n)
            *out = x.u.l->v[IS("first") ? 0 : x.u.l->n - 1];
        return TD_OK;
    }
    if (IS("join") && x.t == V_LIST) {
        const char *sep = "";
        size_t sepn = 0;
        if (n->nargs) {
            val_t a;
            TRY(eval(R, n->args[0], &a));
            TRY(to_text(R, n->pos, a, &sep, &sepn));
        }
        val_t acc = str_val("", 0);
        for (size_t i = 0; i < x.u.l->n; i++) {
            const char *t;
            size_t tn;
            TRY(step(R, n->pos));
            TRY(to_text(R, n->pos, x.u.l->v[i], &t, &tn));
            if (i)
                TRY(concat(R, n->pos, acc.u.s.p, acc.u.s.n, sep, sepn, &acc));
            TRY(concat(R, n->pos, acc.u.s.p, acc.u.s.n, t, tn, &acc));
        }
        *out = acc;
        return TD_OK;
    }
    if (x.t == V_UNDEF)
        x = str_val("", 0);
    if (x.t != V_STR)
        return td_chat_fail(&R->e, TD_ERR_UNSUPPORTED, n->pos,
                            "filter '%.*s' of a %s is not supported", (int)fn, f, type_name(x));
    if (IS("trim")) {
        size_t a = 0, b = x.u.s.n;
        while (a < b && is_space(x.u.s.p[a]))
            a++;
        while (b > a && is_space(x.u.s.p[b - 1]))
            b--;
        *out = str_val(x.u.s.p + a, b - a);
        return TD_OK;
    }
    if (!IS("upper") && !IS("lower"))
        return td_chat_fail(&R->e, TD_ERR_UNSUPPORTED, n->pos,
                            "filter '%.*s' of a string is not supported", (int)fn, f);
    return case_map(R, n->pos, x, IS("upper"), out);
#undef IS
}

/* upper / lower: ASCII letters only; other characters are copied */
static td_status_t case_map(render_t *R, size_t pos, val_t x, bool up, val_t *out)
{
    char *d = ralloc(R, x.u.s.n + 1);
    if (!d)
        return nomem(R, pos);
    for (size_t i = 0; i < x.u.s.n; i++) {
        char c = x.u.s.p[i];
        d[i] = up && c >= 'a' && c <= 'z'    ? (char)(c - 32)
               : !up && c >= 'A' && c <= 'Z' ? (char)(c + 32)
                                             : c;
    }
    d[x.u.s.n] = '\0';
    *out = str_val(d, x.u.s.n);
    return TD_OK;
}

/* jinja2's test `f` of x (arg: its argument, for equalto); *known false for a name that is
 * not a test. */
static bool test_named(const char *f, size_t fn, val_t x, const val_t *arg, bool *known)
{
#define IS(name) (fn == sizeof(name) - 1 && !memcmp(f, name, fn))
    *known = true;
    if (IS("defined"))
        return x.t != V_UNDEF;
    if (IS("undefined"))
        return x.t == V_UNDEF;
    if (IS("none"))
        return x.t == V_NONE;
    if (IS("string"))
        return x.t == V_STR;
    if (IS("number"))
        return x.t == V_INT || x.t == V_BOOL || x.t == V_FLOAT;
    if (IS("integer"))
        return x.t == V_INT;
    if (IS("float"))
        return x.t == V_FLOAT;
    if (IS("mapping"))
        return x.t == V_DICT || x.t == V_NS;
    if (IS("sequence") || IS("iterable"))
        return x.t == V_STR || x.t == V_LIST || x.t == V_DICT;
    if (IS("boolean"))
        return x.t == V_BOOL;
    if (IS("true"))
        return x.t == V_BOOL && x.u.b;
    if (IS("false"))
        return x.t == V_BOOL && !x.u.b;
    if (IS("even") || IS("odd"))
        return x.t == V_INT && (x.u.i % 2 == 0) == IS("even");
    if ((IS("equalto") || IS("eq") || IS("==")) && arg)
        return equal(x, *arg);
    if ((IS("ne") || IS("!=")) && arg)
        return !equal(x, *arg);
    *known = false;
    return false;
#undef IS
}

static bool test(const node_t *n, val_t x)
{
    bool known;
    return test_named(n->s, n->sn, x, NULL, &known);
}

static list_t *new_list(render_t *R, size_t n)
{
    list_t *l = ralloc(R, sizeof *l + n * sizeof l->v[0]);
    if (l)
        l->n = n;
    return l;
}

/* A mapping's (key, value) pairs as two-item lists: items(). */
static td_status_t dict_items(render_t *R, size_t pos, const dict_t *d, val_t *out)
{
    list_t *l = new_list(R, d->n);
    if (!l)
        return nomem(R, pos);
    for (size_t i = 0; i < d->n; i++) {
        list_t *pair = new_list(R, 2);
        if (!pair)
            return nomem(R, pos);
        pair->v[0] = str_val(d->keys[i], strlen(d->keys[i]));
        pair->v[1] = d->v[i];
        l->v[i] = (val_t){.t = V_LIST, .u.l = pair};
    }
    *out = (val_t){.t = V_LIST, .u.l = l};
    return TD_OK;
}

/* select / reject / selectattr / rejectattr over a list: args are (attr,) test name and its
 * argument; no test: truthiness. */
static td_status_t filter_select(render_t *R, const node_t *n, val_t x, bool attr, bool keep,
                                 val_t *out)
{
    if (x.t == V_UNDEF || x.t == V_NONE) {
        x = (val_t){.t = V_LIST, .u.l = new_list(R, 0)};
        if (!x.u.l)
            return nomem(R, n->pos);
    }
    if (x.t != V_LIST)
        return td_chat_fail(&R->e, TD_ERR_UNSUPPORTED, n->pos,
                            "filter '%.*s' of a %s is not supported", (int)n->sn, n->s,
                            type_name(x));
    val_t a[3];
    for (size_t i = 0; i < n->nargs; i++)
        TRY(eval(R, n->args[i], &a[i]));
    size_t t0 = attr ? 1 : 0;
    if ((attr && a[0].t != V_STR) || (n->nargs > t0 && a[t0].t != V_STR))
        return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos,
                            "'%.*s' needs an attribute name and a test name as strings",
                            (int)n->sn, n->s);
    list_t *l = new_list(R, x.u.l->n);
    if (!l)
        return nomem(R, n->pos);
    size_t k = 0;
    for (size_t i = 0; i < x.u.l->n; i++) {
        TRY(step(R, n->pos));
        val_t v = x.u.l->v[i];
        if (attr)
            TRY(get_attr(R, n->pos, v, a[0].u.s.p, a[0].u.s.n, &v));
        bool pass;
        if (n->nargs > t0) {
            bool known;
            pass = test_named(a[t0].u.s.p, a[t0].u.s.n, v, n->nargs > t0 + 1 ? &a[t0 + 1] : NULL,
                              &known);
            if (!known)
                return td_chat_fail(&R->e, TD_ERR_UNSUPPORTED, n->pos,
                                    "test '%.*s' is not supported", (int)a[t0].u.s.n,
                                    a[t0].u.s.p);
        } else {
            pass = truthy(v);
        }
        if (pass == keep)
            l->v[k++] = x.u.l->v[i];
    }
    l->n = k;
    *out = (val_t){.t = V_LIST, .u.l = l};
    return TD_OK;
}

/* Python's index rules: negative from the end, clamped for slices. */
static int64_t clamp_index(int64_t i, int64_t len)
{
    if (i < 0)
        i += len;
    return i < 0 ? 0 : i > len ? len : i;
}

/* x[i]: a string key is an attribute; an integer out of range is undefined. */
static td_status_t eval_index(render_t *R, const node_t *n, val_t *out)
{
    val_t a, b;
    TRY(eval(R, n->a, &a));
    TRY(eval(R, n->b, &b));
    if (b.t == V_STR)
        return get_attr(R, n->pos, a, b.u.s.p, b.u.s.n, out);
    if (a.t == V_UNDEF)
        return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "cannot index an undefined value");
    *out = (val_t){.t = V_UNDEF};
    if (b.t == V_INT && (a.t == V_LIST || a.t == V_STR)) {
        int64_t len = a.t == V_LIST ? (int64_t)a.u.l->n : (int64_t)a.u.s.n;
        int64_t i = b.u.i < 0 ? b.u.i + len : b.u.i;
        if (i >= 0 && i < len)
            *out = a.t == V_LIST ? a.u.l->v[i] : str_val(a.u.s.p + i, 1);
    }
    return TD_OK;
}

/* a[b:c:d] with Python's rules (slice.indices); strings are sliced by bytes. */
static td_status_t eval_slice(render_t *R, const node_t *n, val_t *out)
{
    val_t a, b;
    TRY(eval(R, n->a, &a));
    int64_t len = a.t == V_LIST ? (int64_t)a.u.l->n : a.t == V_STR ? (int64_t)a.u.s.n : -1;
    if (len < 0)
        return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "cannot slice a %s", type_name(a));
    int64_t bound[3] = {0, 0, 1};
    bool given[3] = {false, false, false};
    const node_t *parts[3] = {n->b, n->c, n->d};
    for (int i = 0; i < 3; i++) {
        if (!parts[i])
            continue;
        TRY(eval(R, parts[i], &b));
        if (b.t == V_NONE)
            continue;
        if (b.t != V_INT)
            return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "slice bounds must be integers");
        bound[i] = b.u.i;
        given[i] = true;
    }
    int64_t stp = bound[2], lo, hi;
    if (stp == 0 || stp == INT64_MIN)
        return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "slice step cannot be zero");
    if (stp > 0) {
        lo = given[0] ? clamp_index(bound[0], len) : 0;
        hi = given[1] ? clamp_index(bound[1], len) : len;
    } else { /* counting down: bounds clamp to [-1, len - 1] */
        lo = given[0] ? (bound[0] < 0 ? bound[0] + len : bound[0]) : len - 1;
        hi = given[1] ? (bound[1] < 0 ? bound[1] + len : bound[1]) : -1;
        lo = lo < -1 ? -1 : lo > len - 1 ? len - 1 : lo;
        hi = hi < -1 ? -1 : hi > len - 1 ? len - 1 : hi;
    }
    int64_t count = stp > 0 ? (hi > lo ? (hi - lo + stp - 1) / stp : 0)
                            : (lo > hi ? (lo - hi - stp - 1) / -stp : 0);
    if (a.t == V_STR && stp == 1) {
        *out = str_val(a.u.s.p + lo, (size_t)count);
        return TD_OK;
    }
    if (a.t == V_STR) {
        char *d = ralloc(R, (size_t)count + 1);
        if (!d)
            return nomem(R, n->pos);
        for (int64_t i = 0; i < count; i++)
            d[i] = a.u.s.p[lo + i * stp];
        d[count] = '\0';
        *out = str_val(d, (size_t)count);
        return TD_OK;
    }
    list_t *l = new_list(R, (size_t)count);
    if (!l)
        return nomem(R, n->pos);
    for (int64_t i = 0; i < count; i++)
        l->v[i] = a.u.l->v[lo + i * stp];
    *out = (val_t){.t = V_LIST, .u.l = l};
    return TD_OK;
}

/* namespace(name=value, ...): a mapping whose attributes {% set ns.x = ... %} changes. */
static td_status_t make_namespace(render_t *R, const node_t *n, val_t *out)
{
    size_t cap = n->nargs < 8 ? 8 : n->nargs;
    dict_t *d = ralloc(R, sizeof *d);
    const char **keys = ralloc(R, cap * sizeof *keys);
    val_t *v = ralloc(R, cap * sizeof *v);
    if (!d || !keys || !v)
        return nomem(R, n->pos);
    *d = (dict_t){.keys = keys, .v = v, .cap = cap};
    for (size_t i = 0; i < n->nargs; i++) {
        TRY(eval(R, n->args[i], &v[i]));
        keys[i] = n->kw[i];
        d->n++;
    }
    *out = (val_t){.t = V_NS, .u.ns = d};
    return TD_OK;
}

static td_status_t ns_set(render_t *R, size_t pos, dict_t *d, const char *k, size_t kn, val_t v)
{
    for (size_t i = 0; i < d->n; i++)
        if (strlen(d->keys[i]) == kn && !memcmp(d->keys[i], k, kn)) {
            d->v[i] = v;
            return TD_OK;
        }
    if (d->n == d->cap) {
        size_t cap = d->cap * 2;
        const char **keys = ralloc(R, cap * sizeof *keys);
        val_t *vs = ralloc(R, cap * sizeof *vs);
        if (!keys || !vs)
            return nomem(R, pos);
        memcpy(keys, d->keys, d->n * sizeof *keys);
        memcpy(vs, d->v, d->n * sizeof *vs);
        d->keys = keys, d->v = vs, d->cap = cap;
    }
    char *key = ralloc(R, kn + 1);
    if (!key)
        return nomem(R, pos);
    memcpy(key, k, kn);
    key[kn] = '\0';
    d->keys[d->n] = key;
    d->v[d->n++] = v;
    return TD_OK;
}

static bool in_set(char c, const char *set, size_t n)
{
    return set ? memchr(set, c, n) != NULL : is_space(c);
}

/* s.split(sep): by sep, or (no sep) by runs of whitespace with none at the ends. */
static td_status_t str_split(render_t *R, size_t pos, val_t x, const val_t *sep, val_t *out)
{
    const char *p = x.u.s.p;
    size_t n = x.u.s.n, parts = 0;
    if (sep && sep->u.s.n == 0)
        return td_chat_fail(&R->e, TD_ERR_INVALID, pos, "split: empty separator");
    for (int pass = 0; pass < 2; pass++) { /* count, then fill */
        list_t *l = pass ? new_list(R, parts) : NULL;
        if (pass && !l)
            return nomem(R, pos);
        size_t k = 0, i = 0, start = 0;
        if (sep) {
            for (i = 0; i + sep->u.s.n <= n; i++) {
                if (memcmp(p + i, sep->u.s.p, sep->u.s.n))
                    continue;
                if (pass)
                    l->v[k] = str_val(p + start, i - start);
                k++;
                i += sep->u.s.n - 1;
                start = i + 1;
            }
            if (pass)
                l->v[k] = str_val(p + start, n - start);
            k++;
        } else {
            while (i < n) {
                while (i < n && is_space(p[i]))
                    i++;
                if (i == n)
                    break;
                start = i;
                while (i < n && !is_space(p[i]))
                    i++;
                if (pass)
                    l->v[k] = str_val(p + start, i - start);
                k++;
            }
        }
        TRY(step(R, pos));
        parts = k;
        if (pass)
            *out = (val_t){.t = V_LIST, .u.l = l};
    }
    return TD_OK;
}

/* x.name(args): the string and mapping methods the parser admits. */
static td_status_t eval_method(render_t *R, const node_t *n, val_t *out)
{
    val_t x, a[2] = {{.t = V_UNDEF}, {.t = V_UNDEF}};
    TRY(eval(R, n->a, &x));
    for (size_t i = 0; i < n->nargs; i++)
        TRY(eval(R, n->args[i], &a[i]));
    const char *f = n->s;
    size_t fn = n->sn;
#define IS(name) (fn == sizeof(name) - 1 && !memcmp(f, name, fn))
    if (x.t == V_DICT || x.t == V_NS) {
        const dict_t *d = x.t == V_DICT ? x.u.d : x.u.ns;
        if (IS("items"))
            return dict_items(R, n->pos, d, out);
        if (IS("keys") || IS("values")) {
            list_t *l = new_list(R, d->n);
            if (!l)
                return nomem(R, n->pos);
            for (size_t i = 0; i < d->n; i++)
                l->v[i] = IS("keys") ? str_val(d->keys[i], strlen(d->keys[i])) : d->v[i];
            *out = (val_t){.t = V_LIST, .u.l = l};
            return TD_OK;
        }
        if (IS("get")) {
            *out = n->nargs > 1 ? a[1] : (val_t){.t = V_NONE};
            if (a[0].t == V_STR)
                dict_get(d, a[0].u.s.p, a[0].u.s.n, out);
            return TD_OK;
        }
    }
    if (x.t == V_STR) {
        const char *p = x.u.s.p;
        size_t len = x.u.s.n;
        if (IS("startswith") || IS("endswith")) {
            if (a[0].t != V_STR)
                return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "%.*s needs a string",
                                    (int)fn, f);
            size_t k = a[0].u.s.n;
            bool r = k <= len && !memcmp(IS("startswith") ? p : p + len - k, a[0].u.s.p, k);
            *out = (val_t){.t = V_BOOL, .u.b = r};
            return TD_OK;
        }
        if (IS("split")) {
            bool has = n->nargs && a[0].t != V_NONE;
            if (has && a[0].t != V_STR)
                return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "split needs a string");
            return str_split(R, n->pos, x, has ? &a[0] : NULL, out);
        }
        if (IS("strip") || IS("lstrip") || IS("rstrip")) {
            bool has = n->nargs && a[0].t != V_NONE;
            if (has && a[0].t != V_STR)
                return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "%.*s needs a string",
                                    (int)fn, f);
            const char *set = has ? a[0].u.s.p : NULL;
            size_t sn = has ? a[0].u.s.n : 0, lo = 0, hi = len;
            if (!IS("rstrip"))
                while (lo < hi && in_set(p[lo], set, sn))
                    lo++;
            if (!IS("lstrip"))
                while (hi > lo && in_set(p[hi - 1], set, sn))
                    hi--;
            *out = str_val(p + lo, hi - lo);
            return TD_OK;
        }
        if (IS("upper") || IS("lower"))
            return case_map(R, n->pos, x, IS("upper"), out);
    }
    return td_chat_fail(&R->e, x.t == V_UNDEF ? TD_ERR_INVALID : TD_ERR_UNSUPPORTED, n->pos,
                        "a %s has no method '%.*s'", type_name(x), (int)fn, f);
#undef IS
}

/* The functions the parser admits: range(n), raise_exception(msg), namespace(...). */
static td_status_t eval_call(render_t *R, const node_t *n, val_t *out)
{
    if (n->s[0] == 'n') /* namespace(...) */
        return make_namespace(R, n, out);
    val_t a;
    TRY(eval(R, n->args[0], &a));
    if (n->s[0] == 'r' && n->sn == 5) { /* range(n) */
        if (a.t != V_INT)
            return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "range needs an integer");
        int64_t k = a.u.i < 0 ? 0 : a.u.i;
        if ((uint64_t)k > R->r->max_steps)
            return td_chat_fail(&R->e, TD_ERR_EXHAUSTED, n->pos,
                                "range(%" PRId64 ") exceeds the step limit", k);
        list_t *l = ralloc(R, sizeof *l + (size_t)k * sizeof l->v[0]);
        if (!l)
            return nomem(R, n->pos);
        l->n = (size_t)k;
        for (int64_t i = 0; i < k; i++)
            l->v[i] = (val_t){.t = V_INT, .u.i = i};
        *out = (val_t){.t = V_LIST, .u.l = l};
        return TD_OK;
    }
    const char *s;
    size_t sn;
    TRY(to_text(R, n->pos, a, &s, &sn));
    return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "template raised: %.*s",
                        (int)(sn > 400 ? 400 : sn), s);
}

static td_status_t eval(render_t *R, const node_t *n, val_t *out)
{
    TRY(step(R, n->pos));
    val_t a, b;
    switch (n->kind) {
    case E_LIT:
        *out = n->v;
        return TD_OK;
    case E_NAME:
        return lookup(R, n, out);
    case E_ATTR:
        TRY(eval(R, n->a, &a));
        return get_attr(R, n->pos, a, n->s, n->sn, out);
    case E_INDEX:
        return eval_index(R, n, out);
    case E_SLICE:
        return eval_slice(R, n, out);
    case E_CALL:
        return eval_call(R, n, out);
    case E_METHOD:
        return eval_method(R, n, out);
    case E_FILTER:
        TRY(eval(R, n->a, &a));
        return filter(R, n, a, out);
    case E_TEST:
        TRY(eval(R, n->a, &a));
        *out = (val_t){.t = V_BOOL, .u.b = test(n, a) != n->negate};
        return TD_OK;
    case E_NOT:
        TRY(eval(R, n->a, &a));
        *out = (val_t){.t = V_BOOL, .u.b = !truthy(a)};
        return TD_OK;
    case E_NEG:
        TRY(eval(R, n->a, &a));
        if (a.t != V_INT || a.u.i == INT64_MIN)
            return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "cannot negate a %s", type_name(a));
        *out = (val_t){.t = V_INT, .u.i = -a.u.i};
        return TD_OK;
    case E_BINOP:
        TRY(eval(R, n->a, &a));
        TRY(eval(R, n->b, &b));
        return binop(R, n, a, b, out);
    case E_AND: /* Python semantics: the deciding operand, not a boolean */
    case E_OR:
        TRY(eval(R, n->a, &a));
        if (truthy(a) == (n->kind == E_OR)) {
            *out = a;
            return TD_OK;
        }
        return eval(R, n->b, out);
    case E_COND:
        TRY(eval(R, n->b, &b));
        if (truthy(b))
            return eval(R, n->a, out);
        if (n->c)
            return eval(R, n->c, out);
        *out = (val_t){.t = V_UNDEF};
        return TD_OK;
    case E_LIST: {
        list_t *l = ralloc(R, sizeof *l + n->nargs * sizeof l->v[0]);
        if (!l)
            return nomem(R, n->pos);
        l->n = n->nargs;
        for (size_t i = 0; i < n->nargs; i++)
            TRY(eval(R, n->args[i], &l->v[i]));
        *out = (val_t){.t = V_LIST, .u.l = l};
        return TD_OK;
    }
    default:
        return td_chat_fail(&R->e, TD_ERR_INTERNAL, n->pos, "not an expression");
    }
}

static td_status_t exec_body(render_t *R, const node_t *n, size_t scope);

/* Binds a loop's variable(s) to x: two names unpack a two-item list (items()' pairs). */
static td_status_t bind_loop_vars(render_t *R, const node_t *n, val_t x)
{
    if (!n->s2)
        return bind(R, n->pos, n->s, n->sn, x);
    if (x.t != V_LIST || x.u.l->n != 2)
        return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos,
                            "cannot unpack a %s into two loop variables", type_name(x));
    TRY(bind(R, n->pos, n->s, n->sn, x.u.l->v[0]));
    return bind(R, n->pos, n->s2, n->s2n, x.u.l->v[1]);
}

/* The i-th item a loop over xs (a list, or a mapping's keys) sees. */
static val_t item_at(val_t xs, size_t i)
{
    return xs.t == V_LIST ? xs.u.l->v[i] : str_val(xs.u.d->keys[i], strlen(xs.u.d->keys[i]));
}

static td_status_t exec_for(render_t *R, const node_t *n, size_t scope)
{
    val_t xs;
    TRY(eval(R, n->a, &xs));
    size_t len;
    if (xs.t == V_LIST)
        len = xs.u.l->n;
    else if (xs.t == V_DICT)
        len = xs.u.d->n;
    else if (xs.t == V_UNDEF || xs.t == V_NONE)
        len = 0;
    else if (xs.t == V_STR)
        return td_chat_fail(&R->e, TD_ERR_UNSUPPORTED, n->pos,
                            "iterating over a string is not supported");
    else
        return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "cannot iterate over a %s",
                            type_name(xs));
    size_t mark = R->n_vars, kept = len;
    list_t *items = NULL; /* with a loop filter: the items it keeps */
    if (n->b) {
        if (!(items = new_list(R, len)))
            return nomem(R, n->pos);
        kept = 0;
        for (size_t i = 0; i < len; i++) { /* the filter sees the variables, not `loop` */
            val_t x = item_at(xs, i), keep;
            TRY(step(R, n->pos));
            TRY(bind_loop_vars(R, n, x));
            TRY(eval(R, n->b, &keep));
            R->n_vars = mark;
            if (truthy(keep))
                items->v[kept++] = x;
        }
    }
    if (kept == 0)
        return exec_body(R, n->orelse, scope);
    loopv_t *loop = ralloc(R, sizeof *loop);
    if (!loop)
        return nomem(R, n->pos);
    loop->length = kept;
    for (size_t i = 0; i < kept; i++) {
        TRY(step(R, n->pos));
        R->n_vars = mark; /* each iteration starts from a fresh loop scope */
        loop->index0 = i;
        TRY(bind(R, n->pos, "loop", 4, (val_t){.t = V_LOOP, .u.loop = loop}));
        TRY(bind_loop_vars(R, n, items ? items->v[i] : item_at(xs, i)));
        TRY(exec_body(R, n->body, mark));
    }
    R->n_vars = mark;
    return TD_OK;
}

static td_status_t exec_body(render_t *R, const node_t *n, size_t scope)
{
    for (; n; n = n->next) {
        TRY(step(R, n->pos));
        val_t v;
        switch (n->kind) {
        case N_TEXT:
            TRY(emit(R, n->pos, n->s, n->sn));
            break;
        case N_OUTPUT: {
            const char *s;
            size_t sn;
            TRY(eval(R, n->a, &v));
            TRY(to_text(R, n->a->pos, v, &s, &sn));
            TRY(emit(R, n->pos, s, sn));
            break;
        }
        case N_IF:
            TRY(eval(R, n->a, &v));
            TRY(exec_body(R, truthy(v) ? n->body : n->orelse, scope));
            break;
        case N_FOR:
            TRY(exec_for(R, n, scope));
            break;
        case N_SET:
            TRY(eval(R, n->a, &v));
            if (n->s2) { /* set ns.attr: the namespace is found wherever it was bound */
                val_t ns;
                node_t name = {.kind = E_NAME, .s = n->s, .sn = n->sn};
                TRY(lookup(R, &name, &ns));
                if (ns.t != V_NS)
                    return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos,
                                        "cannot set an attribute of a %s (only of a namespace)",
                                        type_name(ns));
                TRY(ns_set(R, n->pos, ns.u.ns, n->s2, n->s2n, v));
            } else {
                TRY(assign(R, scope, n->pos, n->s, n->sn, v));
            }
            break;
        default:
            return td_chat_fail(&R->e, TD_ERR_INTERNAL, n->pos, "not a statement");
        }
    }
    return TD_OK;
}

td_chat_render_t td_chat_render_default(void)
{
    return (td_chat_render_t){
        .max_output = (size_t)1 << 20,
        .max_steps = 1000000,
        .max_memory = (size_t)64 << 20,
    };
}

/* An assistant message's tool calls: each function.arguments that is a JSON object's text
 * becomes that object, as vLLM hands them to templates (Hugging Face's templates take
 * arguments as a mapping; OpenAI's clients send its JSON text). */
static td_status_t parse_arguments(render_t *R, val_t calls)
{
    if (calls.t != V_LIST)
        return TD_OK;
    for (size_t i = 0; i < calls.u.l->n; i++) {
        val_t fn;
        if (calls.u.l->v[i].t != V_DICT ||
            !dict_get(calls.u.l->v[i].u.d, "function", 8, &fn) || fn.t != V_DICT)
            continue;
        dict_t *d = (dict_t *)fn.u.d; /* built by this render, in its arena */
        for (size_t k = 0; k < d->n; k++) {
            if (strcmp(d->keys[k], "arguments") || d->v[k].t != V_STR)
                continue;
            val_t args;
            char err[8];
            errctx_t saved = R->e;
            R->e.err = err, R->e.err_cap = sizeof err; /* text that is not JSON stays text */
            td_status_t st = json_parse(R, d->v[k].u.s.p, "arguments", &args);
            R->e = saved;
            if (st == TD_ERR_NOMEM || st == TD_ERR_EXHAUSTED)
                return nomem(R, 0);
            if (st == TD_OK && args.t == V_DICT)
                d->v[k] = args;
        }
    }
    return TD_OK;
}

static td_status_t bind_globals(render_t *R)
{
    const td_chat_render_t *r = R->r;
    static const char *const KEYS[] = {"role", "content", "tool_calls", "tool_call_id", "name"};
    list_t *msgs = ralloc(R, sizeof *msgs + r->n_messages * sizeof msgs->v[0]);
    if (!msgs)
        return nomem(R, 0);
    msgs->n = r->n_messages;
    for (size_t i = 0; i < r->n_messages; i++) {
        const td_chat_message_t *m = &r->messages[i];
        dict_t *d = ralloc(R, sizeof *d);
        val_t *v = ralloc(R, 5 * sizeof *v);
        const char **keys = ralloc(R, 5 * sizeof *keys);
        if (!d || !v || !keys)
            return nomem(R, 0);
        const char *role = m->role ? m->role : "";
        const char *content = m->content ? m->content : "";
        size_t k = 0;
        keys[k] = KEYS[0], v[k++] = str_val(role, strlen(role));
        keys[k] = KEYS[1], v[k++] = str_val(content, strlen(content));
        if (m->tool_calls) {
            keys[k] = KEYS[2];
            TRY(json_parse(R, m->tool_calls, "a message's tool_calls", &v[k]));
            TRY(parse_arguments(R, v[k++]));
        }
        if (m->tool_call_id)
            keys[k] = KEYS[3], v[k++] = str_val(m->tool_call_id, strlen(m->tool_call_id));
        if (m->name)
            keys[k] = KEYS[4], v[k++] = str_val(m->name, strlen(m->name));
        *d = (dict_t){.n = k, .keys = keys, .v = v};
        msgs->v[i] = (val_t){.t = V_DICT, .u.d = d};
    }
    TRY(bind(R, 0, "messages", 8, (val_t){.t = V_LIST, .u.l = msgs}));
    if (r->tools) {
        val_t tools;
        TRY(json_parse(R, r->tools, "tools", &tools));
        TRY(bind(R, 0, "tools", 5, tools));
    }
    TRY(bind(R, 0, "add_generation_prompt", 21,
             (val_t){.t = V_BOOL, .u.b = r->add_generation_prompt}));
    if (r->bos_token)
        TRY(bind(R, 0, "bos_token", 9, str_val(r->bos_token, strlen(r->bos_token))));
    if (r->eos_token)
        TRY(bind(R, 0, "eos_token", 9, str_val(r->eos_token, strlen(r->eos_token))));
    return TD_OK;
}

td_status_t td_chat_template_render(const td_chat_template_t *t, const td_chat_render_t *r,
                                    char **out_p, size_t *len_p, char *err, size_t err_cap)
{
    if (!t || !r || !out_p || (r->n_messages && !r->messages))
        return TD_ERR_INVALID;
    render_t R = {.e = {t->src, t->len, err, err_cap}, .r = r};
    td_arena_init(&R.a, 0, r->max_memory);
    td_status_t st = bind_globals(&R);
    if (!st)
        st = exec_body(&R, t->body, R.n_vars);
    if (!st)
        st = emit(&R, t->len, "", 0); /* an empty render still gets a buffer */
    td_arena_free(&R.a);
    if (st) {
        free(R.out);
        return st;
    }
    R.out[R.out_n] = '\0';
    *out_p = R.out;
    if (len_p)
        *len_p = R.out_n;
    return TD_OK;
}
