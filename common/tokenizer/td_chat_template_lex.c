/*
 * td_chat_template_lex: the lexer of td_chat_template (the overview is in td_chat_template.c).
 * It turns the source into tokens (text runs, tag delimiters, expression tokens), applying
 * jinja2's whitespace rules (trim_blocks, lstrip_blocks, '-' and '+' markers) to the text
 * runs.
 */
#include "td_chat_template_impl.h"

#include <stdlib.h>
#include <string.h>

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

static const char *const OPS[] = {"==", "!=", "<=", ">=", "//", "<", ">", "+", "-", "*", "/", "%",
                                  "~",  "|",  ".",  ",",  ":",  "(", ")", "[", "]", "{", "}", "="};

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
            return td_chat_fail(lx->e, TD_ERR_FORMAT, open, "unterminated tag: expected '%s'",
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
                return td_chat_fail(lx->e, TD_ERR_FORMAT, t.pos, "unterminated string literal");
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
                        return td_chat_fail(lx->e, TD_ERR_RANGE, t.pos,
                                            "integer literal too large");
                    v = v * 10 + (s[p] - '0');
                }
                p++;
            }
            if (p < lx->len && (s[p] == '.' || s[p] == 'e' || s[p] == 'E') && p + 1 < lx->len &&
                is_digit(s[p + 1]))
                return td_chat_fail(lx->e, TD_ERR_UNSUPPORTED, t.pos,
                                    "float literals are not supported");
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
                return td_chat_fail(lx->e, TD_ERR_FORMAT, p, "unexpected character '%c'", s[p]);
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

td_status_t td_chat_lex(lexer_t *lx)
{
    const char *s = lx->src;
    size_t pos = 0;
    bool strip_ws = false, trim_nl = false; /* what the previous tag asks of the next text */
    for (;;) {
        size_t t = pos;
        while (t + 1 < lx->len &&
               !(s[t] == '{' && (s[t + 1] == '{' || s[t + 1] == '%' || s[t + 1] == '#')))
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
                return td_chat_fail(lx->e, TD_ERR_FORMAT, t, "unterminated comment: expected '#}'");
            strip_ws = k > pos && s[k - 1] == '-';
            trim_nl = !strip_ws && !(k > pos && s[k - 1] == '+');
            pos = k + 2;
            continue;
        }
        bool is_var = kind == '{', strip_after = false, keep_newline = false;
        td_status_t st =
            push_tok(lx, (tok_t){.kind = is_var ? T_VAR_BEGIN : T_BLOCK_BEGIN, .pos = t});
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
