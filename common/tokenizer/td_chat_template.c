/*
 * td_chat_template: a Jinja2-subset interpreter for chat templates (td_chat_template.h).
 *
 * Three stages, as in jinja2 itself: the lexer turns the source into tokens (text runs,
 * tag delimiters, expression tokens) applying jinja2's whitespace rules (trim_blocks,
 * lstrip_blocks, '-' and '+' markers) to the text runs; a recursive-descent parser builds
 * a tree of statements and expressions with jinja2's operator precedence; the renderer
 * walks the tree. Everything compiled lives in one arena owned by the template; a render
 * allocates its values in its own arena (capped by max_memory) and frees it at the end,
 * so no value has an owner to track.
 */
#include "td_chat_template.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_arena.h"

#define MAX_DEPTH 64 /* nested statements + nested expressions */

/* ---- errors ---- */

typedef struct errctx {
    const char *src;
    size_t len;
    char *err;
    size_t err_cap;
} errctx_t;

static td_status_t fail(const errctx_t *e, td_status_t st, size_t pos, const char *fmt, ...)
{
    if (!e->err || !e->err_cap)
        return st;
    unsigned line = 1, col = 1;
    for (size_t i = 0; i < pos && i < e->len; i++) {
        if (e->src[i] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    int n = snprintf(e->err, e->err_cap, "chat template line %u, column %u: ", line, col);
    if (n >= 0 && (size_t)n < e->err_cap) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->err + n, e->err_cap - (size_t)n, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* ---- lexer ---- */

typedef enum tok_kind {
    T_TEXT,
    T_VAR_BEGIN,   /* {{ */
    T_VAR_END,     /* }} */
    T_BLOCK_BEGIN, /* {% */
    T_BLOCK_END,   /* %} */
    T_NAME,
    T_STRING, /* text: the decoded literal */
    T_INT,
    T_OP, /* text: one of the operators below */
    T_EOF,
} tok_kind_t;

typedef struct tok {
    tok_kind_t kind;
    size_t pos; /* offset in the source, for messages */
    const char *s;
    size_t n;
    int64_t i;
} tok_t;

typedef struct lexer {
    errctx_t *e;
    td_arena_t *a;
    const char *src;
    size_t len;
    tok_t *v;
    size_t n, cap;
} lexer_t;

static bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static bool is_name_start(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

static td_status_t push_tok(lexer_t *lx, tok_t t)
{
    if (lx->n == lx->cap) {
        size_t cap = lx->cap ? lx->cap * 2 : 256;
        tok_t *v = realloc(lx->v, cap * sizeof *v);
        if (!v)
            return TD_ERR_NOMEM;
        lx->v = v;
        lx->cap = cap;
    }
    lx->v[lx->n++] = t;
    return TD_OK;
}

/* Copies s[0..n) into the arena with \r\n and \r turned into \n, as jinja2 normalizes
 * newlines in template data and string literals. */
static const char *copy_normalized(td_arena_t *a, const char *s, size_t n, size_t *n_p)
{
    char *d = td_arena_alloc(a, n + 1);
    if (!d)
        return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\r') {
            d[k++] = '\n';
            if (i + 1 < n && s[i + 1] == '\n')
                i++;
        } else {
            d[k++] = s[i];
        }
    }
    d[k] = '\0';
    *n_p = k;
    return d;
}

static const char *const OPS[] = {"==", "!=", "<=", ">=", "//", "<", ">", "+", "-", "*", "/",
                                  "%",  "~",  "|",  ".",  ",",  ":", "(", ")", "[", "]", "{",
                                  "}",  "="};

/* Lexes the expression tokens of one tag starting at *pos up to its closing delimiter
 * ("}}" or "%}", with an optional '-' or '+' before it). */
static td_status_t lex_tag(lexer_t *lx, size_t *pos, bool is_var, bool *strip_after,
                           bool *keep_newline)
{
    const char *s = lx->src;
    size_t p = *pos, open = p - 2;
    const char close = is_var ? '}' : '%';
    for (;;) {
        while (p < lx->len && is_space(s[p]))
            p++;
        if (p >= lx->len)
            return fail(lx->e, TD_ERR_FORMAT, open, "unterminated tag: expected '%s'",
                        is_var ? "}}" : "%}");
        if ((s[p] == '-' || s[p] == '+') && p + 2 < lx->len && s[p + 1] == close &&
            s[p + 2] == '}') {
            *strip_after = s[p] == '-';
            *keep_newline = s[p] == '+';
            p += 3;
            break;
        }
        if (s[p] == close && p + 1 < lx->len && s[p + 1] == '}') {
            p += 2;
            break;
        }
        tok_t t = {.pos = p};
        if (s[p] == '\'' || s[p] == '"') {
            char q = s[p];
            size_t start = ++p;
            char *d = td_arena_alloc(lx->a, lx->len - start + 1);
            if (!d)
                return TD_ERR_NOMEM;
            size_t k = 0;
            while (p < lx->len && s[p] != q) {
                if (s[p] == '\\' && p + 1 < lx->len) {
                    char c = s[++p];
                    d[k++] = c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c;
                    p++;
                } else if (s[p] == '\r') {
                    d[k++] = '\n';
                    p += (p + 1 < lx->len && s[p + 1] == '\n') ? 2 : 1;
                } else {
                    d[k++] = s[p++];
                }
            }
            if (p >= lx->len)
                return fail(lx->e, TD_ERR_FORMAT, t.pos, "unterminated string literal");
            p++;
            d[k] = '\0';
            t.kind = T_STRING;
            t.s = d;
            t.n = k;
        } else if (is_digit(s[p])) {
            int64_t v = 0;
            while (p < lx->len && (is_digit(s[p]) || s[p] == '_')) {
                if (s[p] != '_') {
                    if (v > (INT64_MAX - 9) / 10)
                        return fail(lx->e, TD_ERR_RANGE, t.pos, "integer literal too large");
                    v = v * 10 + (s[p] - '0');
                }
                p++;
            }
            if (p < lx->len && (s[p] == '.' || s[p] == 'e' || s[p] == 'E') && p + 1 < lx->len &&
                is_digit(s[p + 1]))
                return fail(lx->e, TD_ERR_UNSUPPORTED, t.pos, "float literals are not supported");
            t.kind = T_INT;
            t.i = v;
        } else if (is_name_start(s[p])) {
            size_t start = p;
            while (p < lx->len && (is_name_start(s[p]) || is_digit(s[p])))
                p++;
            t.kind = T_NAME;
            t.s = s + start;
            t.n = p - start;
        } else {
            size_t i;
            for (i = 0; i < sizeof OPS / sizeof OPS[0]; i++) {
                size_t n = strlen(OPS[i]);
                if (p + n <= lx->len && !memcmp(s + p, OPS[i], n))
                    break;
            }
            if (i == sizeof OPS / sizeof OPS[0])
                return fail(lx->e, TD_ERR_FORMAT, p, "unexpected character '%c'", s[p]);
            t.kind = T_OP;
            t.s = OPS[i];
            t.n = strlen(OPS[i]);
            p += t.n;
        }
        td_status_t st = push_tok(lx, t);
        if (st)
            return st;
    }
    *pos = p;
    return push_tok(lx, (tok_t){.kind = is_var ? T_VAR_END : T_BLOCK_END, .pos = p - 2});
}

static td_status_t lex(lexer_t *lx)
{
    const char *s = lx->src;
    size_t pos = 0;
    bool strip_ws = false, trim_nl = false; /* what the previous tag asks of the next text */
    for (;;) {
        size_t t = pos;
        while (t + 1 < lx->len && !(s[t] == '{' && (s[t + 1] == '{' || s[t + 1] == '%' ||
                                                    s[t + 1] == '#')))
            t++;
        if (t + 1 >= lx->len)
            t = lx->len;
        size_t a = pos, b = t;
        if (strip_ws)
            while (a < b && is_space(s[a]))
                a++;
        else if (trim_nl && a < b && s[a] == '\n')
            a++;
        else if (trim_nl && a + 1 < b && s[a] == '\r' && s[a + 1] == '\n')
            a += 2;
        if (t < lx->len) {
            char kind = s[t + 1], mark = t + 2 < lx->len ? s[t + 2] : '\0';
            if (mark == '-') {
                while (b > a && is_space(s[b - 1]))
                    b--;
            } else if (mark != '+' && kind != '{') {
                /* lstrip_blocks: spaces and tabs between a line start and a block tag */
                size_t k = b;
                while (k > a && (s[k - 1] == ' ' || s[k - 1] == '\t'))
                    k--;
                if ((k > a && s[k - 1] == '\n') || (k == a && (a == 0 || s[a - 1] == '\n')))
                    b = k;
            }
        }
        if (b > a) {
            tok_t tx = {.kind = T_TEXT, .pos = a};
            tx.s = copy_normalized(lx->a, s + a, b - a, &tx.n);
            if (!tx.s)
                return TD_ERR_NOMEM;
            td_status_t st = push_tok(lx, tx);
            if (st)
                return st;
        }
        if (t >= lx->len)
            break;
        char kind = s[t + 1];
        pos = t + 2;
        if (pos < lx->len && (s[pos] == '-' || s[pos] == '+'))
            pos++;
        strip_ws = trim_nl = false;
        if (kind == '#') {
            size_t k = pos;
            while (k + 1 < lx->len && !(s[k] == '#' && s[k + 1] == '}'))
                k++;
            if (k + 1 >= lx->len)
                return fail(lx->e, TD_ERR_FORMAT, t, "unterminated comment: expected '#}'");
            strip_ws = k > pos && s[k - 1] == '-';
            trim_nl = !strip_ws && !(k > pos && s[k - 1] == '+');
            pos = k + 2;
            continue;
        }
        bool is_var = kind == '{', strip_after = false, keep_newline = false;
        td_status_t st = push_tok(lx, (tok_t){.kind = is_var ? T_VAR_BEGIN : T_BLOCK_BEGIN,
                                              .pos = t});
        if (st)
            return st;
        st = lex_tag(lx, &pos, is_var, &strip_after, &keep_newline);
        if (st)
            return st;
        strip_ws = strip_after;
        trim_nl = !is_var && !strip_after && !keep_newline;
    }
    return push_tok(lx, (tok_t){.kind = T_EOF, .pos = lx->len});
}

/* ---- tree ---- */

typedef enum node_kind {
    /* statements */
    N_TEXT,   /* s */
    N_OUTPUT, /* a */
    N_IF,     /* a: condition, body, orelse */
    N_FOR,    /* s: variable, a: iterable, body, orelse */
    N_SET,    /* s: variable, a: value */
    /* expressions */
    E_LIT,    /* v */
    E_NAME,   /* s */
    E_ATTR,   /* a.s */
    E_INDEX,  /* a[b] */
    E_SLICE,  /* a[b:c], b and c may be NULL */
    E_CALL,   /* s(args) */
    E_FILTER, /* a | s(args) */
    E_TEST,   /* a is [not] s */
    E_NOT,    /* not a */
    E_NEG,    /* -a */
    E_BINOP,  /* a op b: op in s */
    E_AND,
    E_OR,
    E_COND, /* a if b else c */
    E_LIST, /* [args] */
} node_kind_t;

typedef enum vtype { V_UNDEF, V_NONE, V_BOOL, V_INT, V_STR, V_LIST, V_DICT, V_LOOP } vtype_t;

typedef struct val val_t;
typedef struct list list_t;
typedef struct dict dict_t;
typedef struct loopv loopv_t;

struct val {
    vtype_t t;
    union {
        bool b;
        int64_t i;
        struct {
            const char *p;
            size_t n;
        } s;
        const list_t *l;
        const dict_t *d;
        const loopv_t *loop;
    } u;
};

struct list {
    size_t n;
    val_t v[];
};

struct dict {
    size_t n;
    const char **keys;
    val_t *v;
};

struct loopv {
    size_t index0, length;
};

typedef struct node node_t;
struct node {
    node_kind_t kind;
    size_t pos;
    const char *s;
    size_t sn;
    bool negate; /* E_TEST: "is not" */
    node_t *a, *b, *c;
    node_t *body, *orelse; /* statement lists */
    node_t *next;          /* next statement in a list */
    node_t **args;
    size_t nargs;
    val_t v;
};

struct td_chat_template {
    td_arena_t arena;
    char *src; /* a copy, for error positions at render time */
    size_t len;
    node_t *body;
};

/* ---- parser ---- */

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
    return fail(p->e, TD_ERR_FORMAT, cur(p)->pos, "expected %s, found %s", what,
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
        return fail(p->e, TD_ERR_RANGE, cur(p)->pos, "nesting deeper than %d", MAX_DEPTH);
    return TD_OK;
}

#define TRY(x)                                                                                   \
    do {                                                                                         \
        td_status_t st_ = (x);                                                                   \
        if (st_)                                                                                 \
            return st_;                                                                          \
    } while (0)
#define NEW(var, kind, pos)                                                                      \
    do {                                                                                         \
        (var) = new_node(p, (kind), (pos));                                                      \
        if (!(var))                                                                              \
            return TD_ERR_NOMEM;                                                                 \
    } while (0)

static td_status_t parse_expr(parser_t *p, node_t **out);

static td_status_t parse_args(parser_t *p, const char *close, node_t *n)
{
    node_t *items[64];
    size_t k = 0;
    while (!is_op(cur(p), close)) {
        if (k == 64)
            return fail(p->e, TD_ERR_RANGE, cur(p)->pos, "more than 64 items");
        if (cur(p)->kind == T_NAME && is_op(&p->t[p->i + 1], "="))
            return fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                        "keyword arguments are not supported");
        TRY(parse_expr(p, &items[k++]));
        if (!is_op(cur(p), ","))
            break;
        p->i++;
    }
    TRY(expect_op(p, close));
    n->nargs = k;
    n->args = td_arena_alloc(p->a, (k ? k : 1) * sizeof *n->args);
    if (!n->args)
        return TD_ERR_NOMEM;
    memcpy(n->args, items, k * sizeof *items);
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
            if (!is_name(t, "raise_exception") && !is_name(t, "range"))
                return fail(p->e, TD_ERR_UNSUPPORTED, t->pos, "function '%.*s' is not supported",
                            (int)t->n, t->s);
            NEW(n, E_CALL, t->pos);
            n->s = t->s;
            n->sn = t->n;
            p->i++;
            TRY(parse_args(p, ")", n));
            if (n->nargs != 1)
                return fail(p->e, TD_ERR_FORMAT, t->pos, "%.*s takes one argument", (int)t->n,
                            t->s);
        } else {
            NEW(n, E_NAME, t->pos);
            n->s = t->s;
            n->sn = t->n;
        }
    } else if (is_op(t, "(")) {
        p->i++;
        TRY(parse_expr(p, &n));
        if (is_op(cur(p), ","))
            return fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos, "tuples are not supported");
        TRY(expect_op(p, ")"));
    } else if (is_op(t, "[")) {
        NEW(n, E_LIST, t->pos);
        p->i++;
        TRY(parse_args(p, "]", n));
    } else if (is_op(t, "{")) {
        return fail(p->e, TD_ERR_UNSUPPORTED, t->pos, "dict literals are not supported");
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
            if (is_op(&p->t[p->i + 1], "("))
                return fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                            "method '%.*s' is not supported", (int)cur(p)->n, cur(p)->s);
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
                if (!is_op(cur(p), "]"))
                    TRY(parse_expr(p, &n->c));
                if (is_op(cur(p), ":"))
                    return fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                                "slice steps are not supported");
            }
            TRY(expect_op(p, "]"));
        } else if (is_op(t, "(")) {
            return fail(p->e, TD_ERR_UNSUPPORTED, t->pos, "calling this value is not supported");
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
            static const char *const FILTERS[] = {"trim",  "length", "count", "upper", "lower",
                                                  "default", "d",    "string"};
            bool known = false;
            for (size_t k = 0; k < sizeof FILTERS / sizeof FILTERS[0]; k++)
                known |= is_name(f, FILTERS[k]);
            if (!known)
                return fail(p->e, TD_ERR_UNSUPPORTED, f->pos, "filter '%.*s' is not supported",
                            (int)f->n, f->s);
            NEW(n, E_FILTER, f->pos);
            n->a = *io;
            n->s = f->s;
            n->sn = f->n;
            p->i++;
            if (is_op(cur(p), "(")) {
                p->i++;
                TRY(parse_args(p, ")", n));
            }
            if (n->nargs > ((n->s[0] == 'd') ? 1u : 0u))
                return fail(p->e, TD_ERR_FORMAT, f->pos, "too many arguments to '%.*s'",
                            (int)f->n, f->s);
        } else if (is_name(t, "is")) {
            p->i++;
            NEW(n, E_TEST, t->pos);
            n->a = *io;
            if (is_name(cur(p), "not")) {
                n->negate = true;
                p->i++;
            }
            const tok_t *f = cur(p);
            static const char *const TESTS[] = {"defined", "undefined", "none",     "string",
                                                "number",  "integer",   "mapping",  "sequence",
                                                "iterable", "boolean",  "true",     "false",
                                                "even",    "odd"};
            bool known = false;
            for (size_t k = 0; k < sizeof TESTS / sizeof TESTS[0]; k++)
                known |= is_name(f, TESTS[k]);
            /* jinja2 spells the none test "none"; "None" parses as the literal */
            if (f->kind != T_NAME)
                return expected(p, "a test name after 'is'");
            if (!known)
                return fail(p->e, TD_ERR_UNSUPPORTED, f->pos, "test '%.*s' is not supported",
                            (int)f->n, f->s);
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
static td_status_t parse_binary(parser_t *p, node_t **out, td_status_t (*next)(parser_t *, node_t **),
                                const char *const *ops)
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
static td_status_t parse_body(parser_t *p, node_t **out, const char *const *ends, const char *opener);

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
        if (is_op(cur(p), ","))
            return fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                        "unpacking several loop variables is not supported");
        if (!is_name(cur(p), "in"))
            return expected(p, "'in'");
        p->i++;
        TRY(parse_logic(p, &n->a, true)); /* jinja2: no conditional expression here */
        if (is_name(cur(p), "if") || is_name(cur(p), "recursive"))
            return fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                        "loop filters and recursive loops are not supported");
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
        if (!is_op(cur(p), "="))
            return is_op(cur(p), ".") || is_op(cur(p), ",") || cur(p)->kind == T_BLOCK_END
                       ? fail(p->e, TD_ERR_UNSUPPORTED, cur(p)->pos,
                              "only '{%% set name = expression %%}' is supported")
                       : expected(p, "'='");
        p->i++;
        TRY(parse_expr(p, &n->a));
        TRY(expect_block_end(p));
    } else {
        return fail(p->e, TD_ERR_UNSUPPORTED, pos, "statement '%.*s' is not supported",
                    (int)kw->n, kw->s);
    }
    *out = n;
    return TD_OK;
}

static td_status_t parse_body(parser_t *p, node_t **out, const char *const *ends, const char *opener)
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
                return fail(p->e, TD_ERR_FORMAT, kw->pos, "unexpected %s%s%s",
                            describe(kw, buf, sizeof buf), opener ? " inside " : "",
                            opener ? opener : "");
            }
            p->i++;
            TRY(parse_stmt(p, &n));
        } else {
            char buf[64];
            return fail(p->e, TD_ERR_FORMAT, t->pos, "unexpected %s",
                        describe(t, buf, sizeof buf));
        }
        *tail = n;
        tail = &n->next;
    }
    *out = head;
    p->depth--;
    return TD_OK;
}

td_status_t td_chat_template_create(const char *src, size_t len, td_chat_template_t **tmpl_p,
                                    char *err, size_t err_cap)
{
    if (!src || !tmpl_p)
        return TD_ERR_INVALID;
    td_chat_template_t *t = calloc(1, sizeof *t);
    if (!t)
        return TD_ERR_NOMEM;
    td_arena_init(&t->arena, 0, 0);
    td_status_t st = TD_ERR_NOMEM;
    t->src = malloc(len + 1);
    if (!t->src)
        goto err_template;
    memcpy(t->src, src, len);
    t->src[len] = '\0';
    t->len = len;
    errctx_t e = {t->src, len, err, err_cap};
    lexer_t lx = {.e = &e, .a = &t->arena, .src = t->src, .len = len};
    st = lex(&lx);
    if (st)
        goto err_tokens;
    parser_t p = {.e = &e, .a = &t->arena, .t = lx.v};
    st = parse_body(&p, &t->body, NULL, NULL);
    if (st)
        goto err_tokens;
    free(lx.v);
    *tmpl_p = t;
    return TD_OK;

err_tokens:
    free(lx.v);
    if (st == TD_ERR_NOMEM)
        fail(&e, st, 0, "out of memory");
err_template:
    td_chat_template_destroy(t);
    return st;
}

void td_chat_template_destroy(td_chat_template_t *t)
{
    if (!t)
        return;
    td_arena_free(&t->arena);
    free(t->src);
    free(t);
}

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
        return fail(&R->e, TD_ERR_EXHAUSTED, pos, "rendering needs more than %zu bytes of memory",
                    R->r->max_memory);
    return fail(&R->e, TD_ERR_NOMEM, pos, "out of memory");
}

static void *ralloc(render_t *R, size_t n)
{
    return td_arena_alloc(&R->a, n);
}

static td_status_t step(render_t *R, size_t pos)
{
    if (++R->steps > R->r->max_steps)
        return fail(&R->e, TD_ERR_EXHAUSTED, pos, "rendering takes more than %" PRIu64 " steps",
                    R->r->max_steps);
    return TD_OK;
}

static td_status_t emit(render_t *R, size_t pos, const char *s, size_t n)
{
    if (n > R->r->max_output - R->out_n)
        return fail(&R->e, TD_ERR_EXHAUSTED, pos, "output exceeds %zu bytes", R->r->max_output);
    if (R->out_n + n + 1 > R->out_cap) {
        size_t cap = R->out_cap ? R->out_cap : 1024;
        while (cap < R->out_n + n + 1)
            cap *= 2;
        char *o = realloc(R->out, cap);
        if (!o)
            return fail(&R->e, TD_ERR_NOMEM, pos, "out of memory");
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
        return fail(&R->e, TD_ERR_UNSUPPORTED, pos, "printing a %s is not supported",
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
        return fail(&R->e, TD_ERR_INVALID, pos, "undefined value has no attribute '%.*s'",
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
            return fail(&R->e, TD_ERR_INVALID, n->pos, "'in' needs a string, list or mapping "
                        "on its right, not a %s", type_name(b));
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
        return fail(&R->e, TD_ERR_INVALID, n->pos, "cannot apply '%s' to a %s and a %s", op,
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
        return fail(&R->e, TD_ERR_UNSUPPORTED, n->pos, "'/' (a float result) is not supported");
    if ((!strcmp(op, "//") || !strcmp(op, "%")) && y == 0)
        return fail(&R->e, TD_ERR_INVALID, n->pos, "division by zero");
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
        return fail(&R->e, TD_ERR_RANGE, n->pos, "integer overflow in '%s'", op);
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
            return fail(&R->e, TD_ERR_INVALID, n->pos, "a %s has no length", type_name(x));
        }
        *out = (val_t){.t = V_INT, .u.i = len};
        return TD_OK;
    }
    if (x.t == V_UNDEF)
        x = str_val("", 0);
    if (x.t != V_STR)
        return fail(&R->e, TD_ERR_UNSUPPORTED, n->pos, "filter '%.*s' of a %s is not supported",
                    (int)fn, f, type_name(x));
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
        d[i] = up && c >= 'a' && c <= 'z' ? (char)(c - 32)
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
        TRY(eval(R, n->a, &a));
        TRY(eval(R, n->b, &b));
        if (b.t == V_STR)
            return get_attr(R, n->pos, a, b.u.s.p, b.u.s.n, out);
        if (a.t == V_UNDEF)
            return fail(&R->e, TD_ERR_INVALID, n->pos, "cannot index an undefined value");
        *out = (val_t){.t = V_UNDEF};
        if (b.t == V_INT && (a.t == V_LIST || a.t == V_STR)) {
            int64_t len = a.t == V_LIST ? (int64_t)a.u.l->n : (int64_t)a.u.s.n;
            int64_t i = b.u.i < 0 ? b.u.i + len : b.u.i;
            if (i >= 0 && i < len)
                *out = a.t == V_LIST ? a.u.l->v[i] : str_val(a.u.s.p + i, 1);
        }
        return TD_OK;
    case E_SLICE: {
        TRY(eval(R, n->a, &a));
        int64_t len = a.t == V_LIST ? (int64_t)a.u.l->n : a.t == V_STR ? (int64_t)a.u.s.n : -1;
        if (len < 0)
            return fail(&R->e, TD_ERR_INVALID, n->pos, "cannot slice a %s", type_name(a));
        int64_t lo = 0, hi = len;
        if (n->b) {
            TRY(eval(R, n->b, &b));
            if (b.t != V_INT)
                return fail(&R->e, TD_ERR_INVALID, n->pos, "slice bounds must be integers");
            lo = clamp_index(b.u.i, len);
        }
        if (n->c) {
            TRY(eval(R, n->c, &b));
            if (b.t != V_INT)
                return fail(&R->e, TD_ERR_INVALID, n->pos, "slice bounds must be integers");
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
    case E_CALL:
        TRY(eval(R, n->args[0], &a));
        if (n->s[0] == 'r' && n->sn == 5) { /* range(n) */
            if (a.t != V_INT)
                return fail(&R->e, TD_ERR_INVALID, n->pos, "range needs an integer");
            int64_t k = a.u.i < 0 ? 0 : a.u.i;
            if ((uint64_t)k > R->r->max_steps)
                return fail(&R->e, TD_ERR_EXHAUSTED, n->pos,
                            "range(%" PRId64 ") exceeds the step limit", k);
            list_t *l = ralloc(R, sizeof *l + (size_t)k * sizeof l->v[0]);
            if (!l)
                return nomem(R, n->pos);
            l->n = (size_t)k;
            for (int64_t i = 0; i < k; i++)
                l->v[i] = (val_t){.t = V_INT, .u.i = i};
            *out = (val_t){.t = V_LIST, .u.l = l};
            return TD_OK;
        } else {
            const char *s;
            size_t sn;
            TRY(to_text(R, n->pos, a, &s, &sn));
            return fail(&R->e, TD_ERR_INVALID, n->pos, "template raised: %.*s",
                        (int)(sn > 400 ? 400 : sn), s);
        }
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
            return fail(&R->e, TD_ERR_INVALID, n->pos, "cannot negate a %s", type_name(a));
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
        return fail(&R->e, TD_ERR_INTERNAL, n->pos, "not an expression");
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
        return fail(&R->e, TD_ERR_UNSUPPORTED, n->pos, "iterating over a string is not supported");
    else
        return fail(&R->e, TD_ERR_INVALID, n->pos, "cannot iterate over a %s", type_name(xs));
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
            return fail(&R->e, TD_ERR_INTERNAL, n->pos, "not a statement");
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
