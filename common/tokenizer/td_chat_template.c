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
 *
 * This file holds the error messages and compiling; td_chat_template_lex.c is the lexer,
 * td_chat_template_parse.c the parser, td_chat_template_render.c the renderer, and
 * td_chat_template_impl.h the types they share.
 */
#include "td_chat_template.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_chat_template_impl.h"

/* ---- errors ---- */

td_status_t td_chat_fail(const errctx_t *e, td_status_t st, size_t pos, const char *fmt, ...)
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

/* ---- compiling ---- */

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
    st = td_chat_lex(&lx);
    if (st)
        goto err_tokens;
    st = td_chat_parse(&e, &t->arena, lx.v, &t->body);
    if (st)
        goto err_tokens;
    free(lx.v);
    *tmpl_p = t;
    return TD_OK;

err_tokens:
    free(lx.v);
    if (st == TD_ERR_NOMEM)
        td_chat_fail(&e, st, 0, "out of memory");
err_template:
    td_chat_template_destroy(t);
    return st;
}

const char *td_chat_template_source(const td_chat_template_t *t, size_t *len_p)
{
    if (len_p)
        *len_p = t->len;
    return t->src;
}

void td_chat_template_destroy(td_chat_template_t *t)
{
    if (!t)
        return;
    td_arena_free(&t->arena);
    free(t->src);
    free(t);
}
