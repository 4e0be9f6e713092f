/*
 * td_chat_template_impl: the inside of a compiled chat template, shared by the files that
 * make up td_chat_template (td_chat_template.c: errors, compile and destroy;
 * td_chat_template_lex.c: source to tokens; td_chat_template_parse.c: tokens to a tree;
 * td_chat_template_render.c: values, evaluation and the rendering API). Not for use outside
 * the module.
 */
#ifndef TD_CHAT_TEMPLATE_IMPL_H
#define TD_CHAT_TEMPLATE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_arena.h"
#include "td_chat_template.h"

#define MAX_DEPTH 64 /* nested statements + nested expressions */

#define TRY(x)                                                                                     \
    do {                                                                                           \
        td_status_t st_ = (x);                                                                     \
        if (st_)                                                                                   \
            return st_;                                                                            \
    } while (0)

/* ---- errors ---- */

typedef struct errctx {
    const char *src;
    size_t len;
    char *err;
    size_t err_cap;
} errctx_t;

/* Writes "chat template line L, column C: " and the formatted message into e->err (when
 * there is one) with the line and column of src[pos], and returns st. */
td_status_t td_chat_fail(const errctx_t *e, td_status_t st, size_t pos, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static inline bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* ---- tokens ---- */

typedef enum tok_kind {
    T_TEXT,
    T_VAR_BEGIN,   /* {{ */
    T_VAR_END,     /* }} */
    T_BLOCK_BEGIN, /* {% */
    T_BLOCK_END,   /* %} */
    T_NAME,
    T_STRING, /* text: the decoded literal */
    T_INT,
    T_OP, /* text: one of the operators of the lexer's OPS */
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

/* Tokenizes lx->src[0..len) into lx->v[0..n) (realloc'ed; the caller frees lx->v, also on
 * failure), ending with T_EOF. Text runs and decoded string literals live in lx->a.
 * Errors: as td_chat_parse. */
td_status_t td_chat_lex(lexer_t *lx);

/* ---- tree ---- */

typedef enum node_kind {
    /* statements */
    N_TEXT,   /* s */
    N_OUTPUT, /* a */
    N_IF,     /* a: condition, body, orelse */
    N_FOR,    /* s (and s2 when unpacking two): variables, a: iterable, b: filter or NULL,
               * body, orelse */
    N_SET,    /* s: variable (s2: its attribute when setting a namespace's), a: value */
    /* expressions */
    E_LIT,    /* v */
    E_NAME,   /* s */
    E_ATTR,   /* a.s */
    E_INDEX,  /* a[b] */
    E_SLICE,  /* a[b:c:d], b, c and d may be NULL */
    E_CALL,   /* s(args): raise_exception, range, namespace (keyword arguments) */
    E_METHOD, /* a.s(args): a string's or a mapping's method */
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

/* V_FLOAT only comes from JSON data (tools, tool calls); V_NS is namespace(), the one
 * mutable value (its dict's values change with {% set ns.x = ... %}). */
typedef enum vtype {
    V_UNDEF,
    V_NONE,
    V_BOOL,
    V_INT,
    V_STR,
    V_LIST,
    V_DICT,
    V_LOOP,
    V_FLOAT,
    V_NS
} vtype_t;

typedef struct val val_t;
typedef struct list list_t;
typedef struct dict dict_t;
typedef struct loopv loopv_t;

struct val {
    vtype_t t;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *p;
            size_t n;
        } s;
        const list_t *l;
        const dict_t *d;
        const loopv_t *loop;
        dict_t *ns;
    } u;
};

struct list {
    size_t n;
    val_t v[];
};

struct dict {
    size_t n;
    const char **keys; /* NUL-terminated; insertion order, as Python's dicts */
    val_t *v;
    size_t cap;        /* V_NS: room in keys and v */
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
    const char *s2; /* N_FOR: the second variable; N_SET: the attribute */
    size_t s2n;
    bool negate; /* E_TEST: "is not" */
    node_t *a, *b, *c, *d;
    node_t *body, *orelse; /* statement lists */
    node_t *next;          /* next statement in a list */
    node_t **args;
    const char **kw; /* [nargs]: a keyword argument's name (NUL-terminated), NULL if positional */
    size_t nargs;
    val_t v;
};

struct td_chat_template {
    td_arena_t arena;
    char *src; /* a copy, for error positions at render time */
    size_t len;
    node_t *body;
};

/* Parses the tokens toks (ending with T_EOF) into a statement list *body_p allocated in a.
 * Errors: a syntax error is described through e; TD_ERR_NOMEM is returned without a message
 * (td_chat_template_create adds it). */
td_status_t td_chat_parse(errctx_t *e, td_arena_t *a, tok_t *toks, node_t **body_p);

#endif
