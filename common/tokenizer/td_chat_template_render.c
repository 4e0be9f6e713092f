/*
 * td_chat_template_render: the renderer of td_chat_template (the overview is in
 * td_chat_template.c). It walks the compiled tree with the conversation bound to
 * `messages`, evaluating expressions into values that live in the render's own arena
 * (capped by max_memory), and appends the text to one output buffer; steps, output bytes
 * and memory are each bounded by td_chat_render_t.
 */
#include "td_chat_template_impl.h"

#include <inttypes.h>
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
        return true;
    }
    return false;
}

static const char *type_name(val_t v)
{
    static const char *const names[] = {"undefined", "none", "boolean", "integer",
                                        "string",    "list", "mapping", "loop"};
    return names[v.t];
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

static bool equal(val_t a, val_t b)
{
    if ((a.t == V_INT || a.t == V_BOOL) && (b.t == V_INT || b.t == V_BOOL)) {
        int64_t x = a.t == V_INT ? a.u.i : a.u.b, y = b.t == V_INT ? b.u.i : b.u.b;
        return x == y;
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
        return a.u.d == b.u.d && a.u.loop == b.u.loop;
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
    if (x.t == V_DICT) {
        dict_get(x.u.d, k, n, out);
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
    /* upper / lower: ASCII letters only; other characters are copied */
    char *d = ralloc(R, x.u.s.n + 1);
    if (!d)
        return nomem(R, n->pos);
    bool up = IS("upper");
    for (size_t i = 0; i < x.u.s.n; i++) {
        char c = x.u.s.p[i];
        d[i] = up && c >= 'a' && c <= 'z'    ? (char)(c - 32)
               : !up && c >= 'A' && c <= 'Z' ? (char)(c + 32)
                                             : c;
    }
    d[x.u.s.n] = '\0';
    *out = str_val(d, x.u.s.n);
    return TD_OK;
#undef IS
}

static bool test(const node_t *n, val_t x)
{
    const char *f = n->s;
    size_t fn = n->sn;
#define IS(name) (fn == sizeof(name) - 1 && !memcmp(f, name, fn))
    if (IS("defined"))
        return x.t != V_UNDEF;
    if (IS("undefined"))
        return x.t == V_UNDEF;
    if (IS("none"))
        return x.t == V_NONE;
    if (IS("string"))
        return x.t == V_STR;
    if (IS("number") || IS("integer"))
        return x.t == V_INT || (IS("number") && x.t == V_BOOL);
    if (IS("mapping"))
        return x.t == V_DICT;
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
    return false;
#undef IS
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

static td_status_t eval_slice(render_t *R, const node_t *n, val_t *out)
{
    val_t a, b;
    TRY(eval(R, n->a, &a));
    int64_t len = a.t == V_LIST ? (int64_t)a.u.l->n : a.t == V_STR ? (int64_t)a.u.s.n : -1;
    if (len < 0)
        return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "cannot slice a %s", type_name(a));
    int64_t lo = 0, hi = len;
    if (n->b) {
        TRY(eval(R, n->b, &b));
        if (b.t != V_INT)
            return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "slice bounds must be integers");
        lo = clamp_index(b.u.i, len);
    }
    if (n->c) {
        TRY(eval(R, n->c, &b));
        if (b.t != V_INT)
            return td_chat_fail(&R->e, TD_ERR_INVALID, n->pos, "slice bounds must be integers");
        hi = clamp_index(b.u.i, len);
    }
    if (hi < lo)
        hi = lo;
    if (a.t == V_STR) {
        *out = str_val(a.u.s.p + lo, (size_t)(hi - lo));
        return TD_OK;
    }
    list_t *l = ralloc(R, sizeof *l + (size_t)(hi - lo) * sizeof l->v[0]);
    if (!l)
        return nomem(R, n->pos);
    l->n = (size_t)(hi - lo);
    memcpy(l->v, a.u.l->v + lo, l->n * sizeof l->v[0]);
    *out = (val_t){.t = V_LIST, .u.l = l};
    return TD_OK;
}

/* The two functions the parser admits: range(n) and raise_exception(msg). */
static td_status_t eval_call(render_t *R, const node_t *n, val_t *out)
{
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
    if (len == 0)
        return exec_body(R, n->orelse, scope);
    loopv_t *loop = ralloc(R, sizeof *loop);
    if (!loop)
        return nomem(R, n->pos);
    loop->length = len;
    size_t mark = R->n_vars;
    for (size_t i = 0; i < len; i++) {
        TRY(step(R, n->pos));
        R->n_vars = mark; /* each iteration starts from a fresh loop scope */
        loop->index0 = i;
        val_t x = xs.t == V_LIST ? xs.u.l->v[i] : str_val(xs.u.d->keys[i], strlen(xs.u.d->keys[i]));
        TRY(bind(R, n->pos, "loop", 4, (val_t){.t = V_LOOP, .u.loop = loop}));
        TRY(bind(R, n->pos, n->s, n->sn, x));
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
            TRY(assign(R, scope, n->pos, n->s, n->sn, v));
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

static td_status_t bind_globals(render_t *R)
{
    const td_chat_render_t *r = R->r;
    static const char *const keys[] = {"role", "content"};
    list_t *msgs = ralloc(R, sizeof *msgs + r->n_messages * sizeof msgs->v[0]);
    if (!msgs)
        return nomem(R, 0);
    msgs->n = r->n_messages;
    for (size_t i = 0; i < r->n_messages; i++) {
        dict_t *d = ralloc(R, sizeof *d);
        val_t *v = ralloc(R, 2 * sizeof *v);
        if (!d || !v)
            return nomem(R, 0);
        const char *role = r->messages[i].role ? r->messages[i].role : "";
        const char *content = r->messages[i].content ? r->messages[i].content : "";
        v[0] = str_val(role, strlen(role));
        v[1] = str_val(content, strlen(content));
        *d = (dict_t){.n = 2, .keys = (const char **)keys, .v = v};
        msgs->v[i] = (val_t){.t = V_DICT, .u.d = d};
    }
    TRY(bind(R, 0, "messages", 8, (val_t){.t = V_LIST, .u.l = msgs}));
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
