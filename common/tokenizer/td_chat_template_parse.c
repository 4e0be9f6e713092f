/*
 * td_chat_template_parse: the parser of td_chat_template (the overview is in
 * td_chat_template.c). Recursive descent over the lexer's tokens builds a tree of statements
 * and expressions with jinja2's operator precedence; a construct outside the supported
 * subset (td_chat_template.h) is refused here with its line and column.
 */
#include "td_chat_template_impl.h"

#include <stdio.h>
#include <string.h>

typedef struct parser {
    errctx_t *e;
    td_arena_t *a;
    tok_t *t;
    size_t i;
    int depth;
} parser_t;

static node_t *new_node(parser_t *p, node_kind_t kind, size_t pos)
{
    node_t *n = td_arena_alloc(p->a, sizeof *n);
    if (n) {
        memset(n, 0, sizeof *n);
        n->kind = kind;
        n->pos = pos;
    }
    return n;
}

static const tok_t *cur(const parser_t *p)
{
    return &p->t[p->i];
}

static bool is_op(const tok_t *t, const char *op)
{
    return t->kind == T_OP && t->n == strlen(op) && !memcmp(t->s, op, t->n);
}

static bool is_name(const tok_t *t, const char *name)
{
    return t->kind == T_NAME && t->n == strlen(name) && !memcmp(t->s, name, t->n);
}

static const char *describe(const tok_t *t, char *buf, size_t cap)
{
    switch (t->kind) {
    case T_TEXT:
        return "template text";
    case T_VAR_BEGIN:
        return "'{{'";
    case T_VAR_END:
        return "'}}'";
    case T_BLOCK_BEGIN:
        return "'{%'";
    case T_BLOCK_END:
        return "'%}'";
    case T_STRING:
        return "a string";
    case T_INT:
        return "an integer";
    case T_EOF:
        return "the end of the template";
    case T_NAME:
    case T_OP:
        snprintf(buf, cap, "'%.*s'", (int)(t->n > 40 ? 40 : t->n), t->s);
        return buf;
    }
    return "?";
}

static td_status_t expected(parser_t *p, const char *what)
{
    char buf[64];
    return td_chat_fail(p->e, TD_ERR_FORMAT, cur(p)->pos, "expected %s, found %s", what,
                        describe(cur(p), buf, sizeof buf));
}

static td_status_t expect_op(parser_t *p, const char *op)
{
    if (!is_op(cur(p), op)) {
        char what[16];
        snprintf(what, sizeof what, "'%s'", op);
        return expected(p, what);
    }
    p->i++;
    return TD_OK;
}

static td_status_t enter(parser_t *p)
{
    if (++p->depth > MAX_DEPTH)
        return td_chat_fail(p->e, TD_ERR_RANGE, cur(p)->pos, "nesting deeper than %d", MAX_DEPTH);
    return TD_OK;
}

#define NEW(var, kind, pos)                                                                        \
    do {                                                                                           \
        (var) = new_node(p, (kind), (pos));                                                        \
        if (!(var))                                                                                \
            return TD_ERR_NOMEM;                                                                   \
    } while (0)

static td_status_t parse_expr(parser_t *p, node_t **out);

/* Arguments up to `close`; with `kwargs`, `name=expr` arguments too (n->kw names them). */
static td_status_t parse_args(parser_t *p, const char *close, node_t *n, bool kwargs)
{
    node_t *items[64];
    const char *kw[64];
    size_t k = 0;
    bool any_kw = false;
    while (!is_op(cur(p), close)) {
        if (k == 64)
            return td_chat_fail(p->e, TD_ERR_RANGE, cur(p)->pos, "more than 64 items");
        kw[k] = NULL;
        if (cur(p)->kind == T_NAME && is_op(&p->t[p->i + 1], "=")) {
            if (!kwargs)
                return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                                    "keyword arguments are not supported here");
            char *name = td_arena_alloc(p->a, cur(p)->n + 1);
            if (!name)
                return TD_ERR_NOMEM;
            memcpy(name, cur(p)->s, cur(p)->n);
            name[cur(p)->n] = '\0';
            kw[k] = name;
            any_kw = true;
            p->i += 2;
        } else if (any_kw) {
            return td_chat_fail(p->e, TD_ERR_FORMAT, cur(p)->pos,
                                "a positional argument after a keyword argument");
        }
        TRY(parse_expr(p, &items[k++]));
        if (!is_op(cur(p), ","))
            break;
        p->i++;
    }
    TRY(expect_op(p, close));
    n->nargs = k;
    n->args = td_arena_alloc(p->a, (k ? k : 1) * sizeof *n->args);
    n->kw = td_arena_alloc(p->a, (k ? k : 1) * sizeof *n->kw);
    if (!n->args || !n->kw)
        return TD_ERR_NOMEM;
    memcpy(n->args, items, k * sizeof *items);
    memcpy(n->kw, kw, k * sizeof *kw);
    return TD_OK;
}

/* Checks a call's argument count: [lo, hi] positional ones, keyword ones only when `kwargs`. */
static td_status_t check_nargs(parser_t *p, const node_t *n, size_t lo, size_t hi, size_t pos)
{
    size_t k = 0;
    while (k < n->nargs && !n->kw[k])
        k++;
    if (k < lo || k > hi)
        return td_chat_fail(p->e, TD_ERR_FORMAT, pos, "'%.*s' takes %zu to %zu arguments, not %zu",
                            (int)n->sn, n->s, lo, hi, k);
    return TD_OK;
}

static td_status_t parse_primary(parser_t *p, node_t **out)
{
    const tok_t *t = cur(p);
    node_t *n;
    if (t->kind == T_STRING) {
        NEW(n, E_LIT, t->pos);
        n->v = (val_t){.t = V_STR, .u.s = {t->s, t->n}};
        p->i++;
        /* adjacent string literals concatenate, as in Python */
        while (cur(p)->kind == T_STRING) {
            const tok_t *u = cur(p);
            char *d = td_arena_alloc(p->a, n->v.u.s.n + u->n + 1);
            if (!d)
                return TD_ERR_NOMEM;
            memcpy(d, n->v.u.s.p, n->v.u.s.n);
            memcpy(d + n->v.u.s.n, u->s, u->n + 1);
            n->v.u.s.p = d;
            n->v.u.s.n += u->n;
            p->i++;
        }
    } else if (t->kind == T_INT) {
        NEW(n, E_LIT, t->pos);
        n->v = (val_t){.t = V_INT, .u.i = t->i};
        p->i++;
    } else if (t->kind == T_NAME) {
        p->i++;
        if (is_name(t, "true") || is_name(t, "True") || is_name(t, "false") ||
            is_name(t, "False")) {
            NEW(n, E_LIT, t->pos);
            n->v = (val_t){.t = V_BOOL, .u.b = t->s[0] == 't' || t->s[0] == 'T'};
        } else if (is_name(t, "none") || is_name(t, "None")) {
            NEW(n, E_LIT, t->pos);
            n->v = (val_t){.t = V_NONE};
        } else if (is_op(cur(p), "(")) {
            bool ns = is_name(t, "namespace");
            if (!is_name(t, "raise_exception") && !is_name(t, "range") && !ns)
                return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, t->pos,
                                    "function '%.*s' is not supported", (int)t->n, t->s);
            NEW(n, E_CALL, t->pos);
            n->s = t->s;
            n->sn = t->n;
            p->i++;
            TRY(parse_args(p, ")", n, ns));
            TRY(check_nargs(p, n, ns ? 0 : 1, ns ? 0 : 1, t->pos));
        } else {
            NEW(n, E_NAME, t->pos);
            n->s = t->s;
            n->sn = t->n;
        }
    } else if (is_op(t, "(")) {
        p->i++;
        TRY(parse_expr(p, &n));
        if (is_op(cur(p), ","))
            return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos, "tuples are not supported");
        TRY(expect_op(p, ")"));
    } else if (is_op(t, "[")) {
        NEW(n, E_LIST, t->pos);
        p->i++;
        TRY(parse_args(p, "]", n, false));
    } else if (is_op(t, "{")) {
        return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, t->pos, "dict literals are not supported");
    } else {
        return expected(p, "an expression");
    }
    *out = n;
    return TD_OK;
}

static td_status_t parse_postfix(parser_t *p, node_t **io)
{
    for (;;) {
        const tok_t *t = cur(p);
        node_t *n;
        if (is_op(t, ".")) {
            p->i++;
            if (cur(p)->kind != T_NAME)
                return expected(p, "an attribute name after '.'");
            if (is_op(&p->t[p->i + 1], "(")) {
                /* a method: [min, max] positional arguments */
                static const struct {
                    const char *name;
                    size_t lo, hi;
                } METHODS[] = {{"startswith", 1, 1}, {"endswith", 1, 1}, {"split", 0, 1},
                               {"strip", 0, 1},      {"lstrip", 0, 1},   {"rstrip", 0, 1},
                               {"upper", 0, 0},      {"lower", 0, 0},    {"items", 0, 0},
                               {"keys", 0, 0},       {"values", 0, 0},   {"get", 1, 2}};
                const tok_t *m = cur(p);
                size_t k = 0;
                while (k < sizeof METHODS / sizeof METHODS[0] && !is_name(m, METHODS[k].name))
                    k++;
                if (k == sizeof METHODS / sizeof METHODS[0])
                    return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, m->pos,
                                        "method '%.*s' is not supported", (int)m->n, m->s);
                NEW(n, E_METHOD, m->pos);
                n->a = *io;
                n->s = m->s;
                n->sn = m->n;
                p->i += 2;
                TRY(parse_args(p, ")", n, false));
                TRY(check_nargs(p, n, METHODS[k].lo, METHODS[k].hi, m->pos));
                *io = n;
                continue;
            }
            NEW(n, E_ATTR, t->pos);
            n->a = *io;
            n->s = cur(p)->s;
            n->sn = cur(p)->n;
            p->i++;
        } else if (is_op(t, "[")) {
            p->i++;
            NEW(n, E_INDEX, t->pos);
            n->a = *io;
            if (!is_op(cur(p), ":"))
                TRY(parse_expr(p, &n->b));
            if (is_op(cur(p), ":")) {
                n->kind = E_SLICE;
                p->i++;
                if (!is_op(cur(p), "]") && !is_op(cur(p), ":"))
                    TRY(parse_expr(p, &n->c));
                if (is_op(cur(p), ":")) {
                    p->i++;
                    if (!is_op(cur(p), "]"))
                        TRY(parse_expr(p, &n->d));
                }
            }
            TRY(expect_op(p, "]"));
        } else if (is_op(t, "(")) {
            return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, t->pos,
                                "calling this value is not supported");
        } else {
            return TD_OK;
        }
        *io = n;
    }
}

static td_status_t parse_unary(parser_t *p, node_t **out, bool with_filter);

static td_status_t parse_filters(parser_t *p, node_t **io)
{
    for (;;) {
        const tok_t *t = cur(p);
        node_t *n;
        if (is_op(t, "|")) {
            p->i++;
            if (cur(p)->kind != T_NAME)
                return expected(p, "a filter name after '|'");
            const tok_t *f = cur(p);
            /* [lo, hi] positional arguments; tojson alone takes keyword ones (indent) */
            static const struct {
                const char *name;
                size_t lo, hi;
            } FILTERS[] = {{"trim", 0, 0},       {"length", 0, 0},    {"count", 0, 0},
                           {"upper", 0, 0},      {"lower", 0, 0},     {"default", 0, 1},
                           {"d", 0, 1},          {"string", 0, 0},    {"tojson", 0, 0},
                           {"items", 0, 0},      {"list", 0, 0},      {"join", 0, 1},
                           {"first", 0, 0},      {"last", 0, 0},      {"selectattr", 1, 3},
                           {"rejectattr", 1, 3}, {"select", 1, 2},    {"reject", 1, 2}};
            size_t k = 0;
            while (k < sizeof FILTERS / sizeof FILTERS[0] && !is_name(f, FILTERS[k].name))
                k++;
            if (k == sizeof FILTERS / sizeof FILTERS[0])
                return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, f->pos,
                                    "filter '%.*s' is not supported", (int)f->n, f->s);
            NEW(n, E_FILTER, f->pos);
            n->a = *io;
            n->s = f->s;
            n->sn = f->n;
            p->i++;
            n->kw = NULL;
            if (is_op(cur(p), "(")) {
                p->i++;
                TRY(parse_args(p, ")", n, is_name(f, "tojson")));
            }
            TRY(check_nargs(p, n, FILTERS[k].lo, FILTERS[k].hi, f->pos));
        } else if (is_name(t, "is")) {
            p->i++;
            NEW(n, E_TEST, t->pos);
            n->a = *io;
            if (is_name(cur(p), "not")) {
                n->negate = true;
                p->i++;
            }
            const tok_t *f = cur(p);
            static const char *const TESTS[] = {
                "defined",  "undefined", "none",    "string", "number", "integer", "mapping",
                "sequence", "iterable",  "boolean", "true",   "false",  "even",    "odd"};
            bool known = false;
            for (size_t k = 0; k < sizeof TESTS / sizeof TESTS[0]; k++)
                known |= is_name(f, TESTS[k]);
            /* jinja2 spells the none test "none"; "None" parses as the literal */
            if (f->kind != T_NAME)
                return expected(p, "a test name after 'is'");
            if (!known)
                return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, f->pos,
                                    "test '%.*s' is not supported", (int)f->n, f->s);
            n->s = f->s;
            n->sn = f->n;
            p->i++;
        } else {
            return TD_OK;
        }
        *io = n;
    }
}

static td_status_t parse_unary(parser_t *p, node_t **out, bool with_filter)
{
    TRY(enter(p));
    const tok_t *t = cur(p);
    if (is_op(t, "-") || is_op(t, "+")) {
        p->i++;
        node_t *a;
        TRY(parse_unary(p, &a, false));
        node_t *n = a;
        if (t->s[0] == '-') {
            NEW(n, E_NEG, t->pos);
            n->a = a;
        }
        *out = n;
    } else {
        TRY(parse_primary(p, out));
        TRY(parse_postfix(p, out));
    }
    if (with_filter)
        TRY(parse_filters(p, out));
    p->depth--;
    return TD_OK;
}

/* One level of left-associative binary operators over `next`. */
static td_status_t parse_binary(parser_t *p, node_t **out,
                                td_status_t (*next)(parser_t *, node_t **), const char *const *ops)
{
    TRY(next(p, out));
    for (;;) {
        const char *op = NULL;
        for (const char *const *o = ops; *o; o++)
            if (is_op(cur(p), *o))
                op = *o;
        if (!op)
            return TD_OK;
        node_t *n;
        NEW(n, E_BINOP, cur(p)->pos);
        p->i++;
        n->s = op;
        n->a = *out;
        TRY(next(p, &n->b));
        *out = n;
    }
}

static td_status_t parse_unary_f(parser_t *p, node_t **out)
{
    return parse_unary(p, out, true);
}

static td_status_t parse_math2(parser_t *p, node_t **out)
{
    static const char *const ops[] = {"*", "//", "/", "%", NULL};
    return parse_binary(p, out, parse_unary_f, ops);
}

static td_status_t parse_concat(parser_t *p, node_t **out)
{
    static const char *const ops[] = {"~", NULL};
    return parse_binary(p, out, parse_math2, ops);
}

static td_status_t parse_math1(parser_t *p, node_t **out)
{
    static const char *const ops[] = {"+", "-", NULL};
    return parse_binary(p, out, parse_concat, ops);
}

static td_status_t parse_compare(parser_t *p, node_t **out)
{
    static const char *const ops[] = {"==", "!=", "<=", ">=", "<", ">", NULL};
    TRY(parse_math1(p, out));
    for (;;) {
        const tok_t *t = cur(p);
        const char *op = NULL;
        for (const char *const *o = ops; *o; o++)
            if (is_op(t, *o))
                op = *o;
        size_t skip = 1;
        if (!op && is_name(t, "in"))
            op = "in";
        else if (!op && is_name(t, "not") && is_name(&p->t[p->i + 1], "in"))
            op = "not in", skip = 2;
        if (!op)
            return TD_OK;
        node_t *n;
        NEW(n, E_BINOP, t->pos);
        p->i += skip;
        n->s = op;
        n->a = *out;
        TRY(parse_math1(p, &n->b));
        *out = n;
    }
}

static td_status_t parse_not(parser_t *p, node_t **out)
{
    if (is_name(cur(p), "not")) {
        TRY(enter(p));
        node_t *n;
        NEW(n, E_NOT, cur(p)->pos);
        p->i++;
        TRY(parse_not(p, &n->a));
        p->depth--;
        *out = n;
        return TD_OK;
    }
    return parse_compare(p, out);
}

static td_status_t parse_logic(parser_t *p, node_t **out, bool is_or)
{
    TRY(is_or ? parse_logic(p, out, false) : parse_not(p, out));
    while (is_name(cur(p), is_or ? "or" : "and")) {
        node_t *n;
        NEW(n, is_or ? E_OR : E_AND, cur(p)->pos);
        p->i++;
        n->a = *out;
        TRY(is_or ? parse_logic(p, &n->b, false) : parse_not(p, &n->b));
        *out = n;
    }
    return TD_OK;
}

static td_status_t parse_expr(parser_t *p, node_t **out)
{
    TRY(enter(p));
    TRY(parse_logic(p, out, true));
    while (is_name(cur(p), "if")) {
        node_t *n;
        NEW(n, E_COND, cur(p)->pos);
        p->i++;
        n->a = *out;
        TRY(parse_logic(p, &n->b, true));
        if (is_name(cur(p), "else")) {
            p->i++;
            TRY(parse_logic(p, &n->c, true));
        }
        *out = n;
    }
    p->depth--;
    return TD_OK;
}

/* Parses statements until a block tag whose keyword is one of `ends` (left unconsumed:
 * p->i at its name) or, when ends is NULL, the end of the template. */
static td_status_t parse_body(parser_t *p, node_t **out, const char *const *ends,
                              const char *opener);

static td_status_t expect_block_end(parser_t *p)
{
    if (cur(p)->kind != T_BLOCK_END)
        return expected(p, "'%}'");
    p->i++;
    return TD_OK;
}

static td_status_t parse_if(parser_t *p, node_t **out, size_t pos)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    node_t *n;
    NEW(n, N_IF, pos);
    TRY(parse_expr(p, &n->a));
    TRY(expect_block_end(p));
    TRY(parse_body(p, &n->body, ends, "if"));
    *out = n;
    if (is_name(cur(p), "elif")) {
        size_t epos = cur(p)->pos;
        p->i++;
        TRY(enter(p));
        TRY(parse_if(p, &n->orelse, epos));
        p->depth--;
        return TD_OK;
    }
    if (is_name(cur(p), "else")) {
        static const char *const end[] = {"endif", NULL};
        p->i++;
        TRY(expect_block_end(p));
        TRY(parse_body(p, &n->orelse, end, "if"));
    }
    p->i++; /* endif */
    return expect_block_end(p);
}

static td_status_t parse_stmt(parser_t *p, node_t **out)
{
    const tok_t *kw = cur(p);
    size_t pos = kw->pos;
    if (kw->kind != T_NAME)
        return expected(p, "a statement keyword");
    p->i++;
    if (is_name(kw, "if"))
        return parse_if(p, out, pos);
    node_t *n;
    if (is_name(kw, "for")) {
        NEW(n, N_FOR, pos);
        if (cur(p)->kind != T_NAME)
            return expected(p, "a loop variable name");
        n->s = cur(p)->s;
        n->sn = cur(p)->n;
        p->i++;
        if (is_op(cur(p), ",")) { /* for key, value in pairs */
            p->i++;
            if (cur(p)->kind != T_NAME)
                return expected(p, "a second loop variable name");
            n->s2 = cur(p)->s;
            n->s2n = cur(p)->n;
            p->i++;
            if (is_op(cur(p), ","))
                return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                                    "unpacking more than two loop variables is not supported");
        }
        if (!is_name(cur(p), "in"))
            return expected(p, "'in'");
        p->i++;
        TRY(parse_logic(p, &n->a, true)); /* jinja2: no conditional expression here */
        if (is_name(cur(p), "if")) { /* a loop filter: loop.* counts the kept items */
            p->i++;
            TRY(parse_logic(p, &n->b, true));
        }
        if (is_name(cur(p), "recursive"))
            return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                                "recursive loops are not supported");
        TRY(expect_block_end(p));
        static const char *const ends[] = {"else", "endfor", NULL};
        TRY(parse_body(p, &n->body, ends, "for"));
        if (is_name(cur(p), "else")) {
            static const char *const end[] = {"endfor", NULL};
            p->i++;
            TRY(expect_block_end(p));
            TRY(parse_body(p, &n->orelse, end, "for"));
        }
        p->i++; /* endfor */
        TRY(expect_block_end(p));
    } else if (is_name(kw, "set")) {
        NEW(n, N_SET, pos);
        if (cur(p)->kind != T_NAME)
            return expected(p, "a variable name after 'set'");
        n->s = cur(p)->s;
        n->sn = cur(p)->n;
        p->i++;
        if (is_op(cur(p), ".") && p->t[p->i + 1].kind == T_NAME) { /* set ns.attr = ... */
            n->s2 = p->t[p->i + 1].s;
            n->s2n = p->t[p->i + 1].n;
            p->i += 2;
        }
        if (!is_op(cur(p), "="))
            return is_op(cur(p), ".") || is_op(cur(p), ",") || cur(p)->kind == T_BLOCK_END
                       ? td_chat_fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                                      "only '{%% set name = expression %%}' and "
                                      "'{%% set namespace.attribute = expression %%}' are "
                                      "supported")
                       : expected(p, "'='");
        p->i++;
        TRY(parse_expr(p, &n->a));
        TRY(expect_block_end(p));
    } else {
        return td_chat_fail(p->e, TD_ERR_UNSUPPORTED, pos, "statement '%.*s' is not supported",
                            (int)kw->n, kw->s);
    }
    *out = n;
    return TD_OK;
}

static td_status_t parse_body(parser_t *p, node_t **out, const char *const *ends,
                              const char *opener)
{
    TRY(enter(p));
    node_t *head = NULL, **tail = &head;
    for (;;) {
        const tok_t *t = cur(p);
        node_t *n = NULL;
        if (t->kind == T_EOF) {
            if (ends) {
                char buf[64];
                snprintf(buf, sizeof buf, "'{%% end%s %%}' to close '%s'", opener, opener);
                return expected(p, buf);
            }
            break;
        }
        if (t->kind == T_TEXT) {
            NEW(n, N_TEXT, t->pos);
            n->s = t->s;
            n->sn = t->n;
            p->i++;
        } else if (t->kind == T_VAR_BEGIN) {
            NEW(n, N_OUTPUT, t->pos);
            p->i++;
            TRY(parse_expr(p, &n->a));
            if (cur(p)->kind != T_VAR_END)
                return expected(p, "'}}'");
            p->i++;
        } else if (t->kind == T_BLOCK_BEGIN) {
            const tok_t *kw = &p->t[p->i + 1];
            bool is_end = false;
            for (const char *const *e = ends; e && *e; e++)
                is_end |= is_name(kw, *e);
            if (is_end) {
                p->i++;
                break;
            }
            if (is_name(kw, "elif") || is_name(kw, "else") || is_name(kw, "endif") ||
                is_name(kw, "endfor")) {
                p->i++;
                char buf[64];
                return td_chat_fail(p->e, TD_ERR_FORMAT, kw->pos, "unexpected %s%s%s",
                                    describe(kw, buf, sizeof buf), opener ? " inside " : "",
                                    opener ? opener : "");
            }
            p->i++;
            TRY(parse_stmt(p, &n));
        } else {
            char buf[64];
            return td_chat_fail(p->e, TD_ERR_FORMAT, t->pos, "unexpected %s",
                                describe(t, buf, sizeof buf));
        }
        *tail = n;
        tail = &n->next;
    }
    *out = head;
    p->depth--;
    return TD_OK;
}

td_status_t td_chat_parse(errctx_t *e, td_arena_t *a, tok_t *toks, node_t **body_p)
{
    parser_t p = {.e = e, .a = a, .t = toks};
    return parse_body(&p, body_p, NULL, NULL);
}
