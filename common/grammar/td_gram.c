/*
 * td_gram: the compiled form, the GBNF parser that builds it, the checks every grammar
 * passes, and the matcher state (contract in td_gram.h, the form in td_gram_int.h).
 *
 * GBNF as llama.cpp's grammar-parser reads it: `name ::= alternatives`, a rule ending at a
 * newline outside parentheses; `|`, `( )`, `"literal"`, `[class]` / `[^class]` with ranges,
 * `.` (any UTF-8 character), rule names, postfix `*` `+` `?` `{m}` `{m,}` `{m,n}`, escapes
 * \xHH \uHHHH \UHHHHHHHH \t \r \n \\ \" \[ \] (and any other ASCII punctuation as
 * itself), `#` comments. Classes are over code points and become byte sequences (the
 * UTF-8 range split of Rust's regex-syntax, rewritten here), so matching works on bytes.
 * Repetition is expanded into rules (X* as R ::= X R | "", X{2,4} as X X R2, R2 ::= X R1 |
 * "", R1 ::= X | ""), bounded by TD_GRAM_MAX_REPEAT, _RULES and _ELEMS.
 */
#include "td_gram_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_hash.h"
#include "td_util.h"

/* ---- growable string ---------------------------------------------------------------- */

void td_gram_str_free(td_gram_str_t *b)
{
    free(b->s);
    *b = (td_gram_str_t){0};
}

void td_gram_str_add(td_gram_str_t *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *ns = realloc(b->s, cap);
        if (!ns) {
            b->oom = true;
            return;
        }
        b->s = ns;
        b->cap = cap;
    }
    if (n)
        memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = '\0';
}

void td_gram_str_puts(td_gram_str_t *b, const char *s)
{
    td_gram_str_add(b, s, strlen(s));
}

void td_gram_str_printf(td_gram_str_t *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n < sizeof tmp) {
        td_gram_str_add(b, tmp, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    td_gram_str_add(b, big, (size_t)n);
    free(big);
}

void td_gram_str_literal(td_gram_str_t *b, const char *s, size_t n)
{
    td_gram_str_add(b, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\')
            td_gram_str_add(b, (const char *)&c, 1);
        else
            td_gram_str_printf(b, "\\x%02X", c);
    }
    td_gram_str_add(b, "\"", 1);
}

/* ---- the builder ---------------------------------------------------------------------- */

#define E_ALT 3u /* separates alternatives while building; END in the compiled form */

typedef struct brule {
    td_gram_elem_t *v;
    int32_t n, cap;
    char *name;      /* a named rule's name; NULL for groups and expansions */
    int32_t owner;   /* the named rule a group was written in (itself when named) */
    bool defined;
    bool star;       /* the R of X* (R ::= X R | ""): left-recursive when X can be empty */
    int32_t line_used; /* first line that refers to it (for "never defined") */
} brule_t;

typedef struct builder {
    brule_t *r;
    int32_t n, cap;
    int64_t n_elems;       /* across rules: the TD_GRAM_MAX_ELEMS bound */
    td_hash_t by_name;     /* fnv(name) -> rule index */
    uint64_t (*sets)[4];
    int32_t n_sets, sets_cap;
    td_hash_t set_ids;     /* fnv(set) -> set index */
} builder_t;

static void builder_free(builder_t *b)
{
    for (int32_t i = 0; i < b->n; i++) {
        free(b->r[i].v);
        free(b->r[i].name);
    }
    free(b->r);
    free(b->sets);
    td_hash_free(&b->by_name);
    td_hash_free(&b->set_ids);
}

/* A new rule; -1 when out of memory or past TD_GRAM_MAX_RULES (the caller says which). */
static int32_t rule_new(builder_t *b, const char *name, size_t name_len, int32_t owner)
{
    if (b->n >= TD_GRAM_MAX_RULES)
        return -1;
    if (b->n == b->cap) {
        int32_t cap = b->cap ? b->cap * 2 : 64;
        brule_t *nr = realloc(b->r, (size_t)cap * sizeof *nr);
        if (!nr)
            return -1;
        b->r = nr;
        b->cap = cap;
    }
    brule_t *r = &b->r[b->n];
    *r = (brule_t){.owner = owner < 0 ? b->n : owner, .line_used = -1};
    if (name) {
        r->name = strndup(name, name_len);
        if (!r->name || td_hash_put(&b->by_name, td_fnv1a64(TD_FNV1A64_INIT, name, name_len),
                                    (uint64_t)b->n) != TD_OK) {
            free(r->name);
            return -1;
        }
    }
    return b->n++;
}

static int32_t rule_find(const builder_t *b, const char *name, size_t len)
{
    uint64_t h = td_fnv1a64(TD_FNV1A64_INIT, name, len);
    for (td_hash_slot_t *s = td_hash_find(&b->by_name, h); s; s = td_hash_find_next(&b->by_name, s)) {
        const char *n = b->r[s->value].name;
        if (strlen(n) == len && !memcmp(n, name, len))
            return (int32_t)s->value;
    }
    return -1;
}

/* Appends an element to rule ri; false when out of memory or past TD_GRAM_MAX_ELEMS. */
static bool rule_push(builder_t *b, int32_t ri, uint32_t kind, int32_t arg)
{
    if (b->n_elems >= TD_GRAM_MAX_ELEMS)
        return false;
    brule_t *r = &b->r[ri];
    if (r->n == r->cap) {
        int32_t cap = r->cap ? r->cap * 2 : 8;
        td_gram_elem_t *nv = realloc(r->v, (size_t)cap * sizeof *nv);
        if (!nv)
            return false;
        r->v = nv;
        r->cap = cap;
    }
    r->v[r->n++] = (td_gram_elem_t){.kind = kind, .arg = (uint32_t)arg};
    b->n_elems++;
    return true;
}

/* The index of byte set s (an equal one is shared); -1 when out of memory. */
static int32_t set_id(builder_t *b, const uint64_t s[4])
{
    uint64_t h = td_fnv1a64(TD_FNV1A64_INIT, s, 32);
    for (td_hash_slot_t *x = td_hash_find(&b->set_ids, h); x; x = td_hash_find_next(&b->set_ids, x))
        if (!memcmp(b->sets[x->value], s, 32))
            return (int32_t)x->value;
    if (b->n_sets == b->sets_cap) {
        int32_t cap = b->sets_cap ? b->sets_cap * 2 : 64;
        uint64_t(*ns)[4] = realloc(b->sets, (size_t)cap * sizeof *ns);
        if (!ns)
            return -1;
        b->sets = ns;
        b->sets_cap = cap;
    }
    memcpy(b->sets[b->n_sets], s, 32);
    if (td_hash_put(&b->set_ids, h, (uint64_t)b->n_sets) != TD_OK)
        return -1;
    return b->n_sets++;
}

/* ---- the GBNF parser ------------------------------------------------------------------ */

typedef struct gparse {
    builder_t *b;
    const char *src, *p, *end;
    int32_t line;
    int32_t depth;      /* parentheses open */
    int32_t cur_named;  /* the named rule being defined */
    td_status_t st;     /* the first error (its message set) */
} gparse_t;

static bool fail(gparse_t *g, td_status_t st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool fail(gparse_t *g, td_status_t st, const char *fmt, ...)
{
    if (g->st != TD_OK)
        return false;
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    g->st = td_errorf_quiet(st, "grammar line %d: %s", g->line, msg);
    return false;
}

static bool too_big(gparse_t *g)
{
    if (g->b->n >= TD_GRAM_MAX_RULES)
        return fail(g, TD_ERR_RANGE, "more than %d rules after expanding repetitions: simplify the grammar",
                    TD_GRAM_MAX_RULES);
    if (g->b->n_elems >= TD_GRAM_MAX_ELEMS)
        return fail(g, TD_ERR_RANGE, "more than %d elements after expanding repetitions: simplify the grammar",
                    TD_GRAM_MAX_ELEMS);
    return fail(g, TD_ERR_NOMEM, "out of memory");
}

static bool push(gparse_t *g, int32_t ri, uint32_t kind, int32_t arg)
{
    return rule_push(g->b, ri, kind, arg) || too_big(g);
}

static int32_t new_rule(gparse_t *g)
{
    int32_t r = rule_new(g->b, NULL, 0, g->cur_named);
    if (r < 0)
        too_big(g);
    else
        g->b->r[r].defined = true;
    return r;
}

/* Skips blanks and comments; newlines too when newline_ok. */
static void skip_space(gparse_t *g, bool newline_ok)
{
    while (g->p < g->end) {
        char c = *g->p;
        if (c == '#') {
            while (g->p < g->end && *g->p != '\n' && *g->p != '\r')
                g->p++;
        } else if (c == ' ' || c == '\t') {
            g->p++;
        } else if (newline_ok && (c == '\n' || c == '\r')) {
            if (c == '\n')
                g->line++;
            g->p++;
        } else {
            break;
        }
    }
}

static bool is_name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

/* Reads one character of a literal or class (an escape or one UTF-8 character) into *cp;
 * *raw_byte set when it is a \xHH escape (a byte, not a code point). */
static bool parse_char(gparse_t *g, uint32_t *cp, bool *raw_byte)
{
    *raw_byte = false;
    if (g->p >= g->end)
        return fail(g, TD_ERR_FORMAT, "unexpected end of input inside a literal or class");
    unsigned char c = (unsigned char)*g->p;
    if (c == '\\') {
        g->p++;
        if (g->p >= g->end)
            return fail(g, TD_ERR_FORMAT, "a backslash at the end of the input");
        char e = *g->p++;
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (digits) {
            uint32_t v = 0;
            for (int i = 0; i < digits; i++) {
                int h = g->p < g->end ? td_hex_digit(*g->p) : -1;
                if (h < 0)
                    return fail(g, TD_ERR_FORMAT, "\\%c needs %d hex digits", e, digits);
                v = v * 16 + (uint32_t)h;
                g->p++;
            }
            if (v > 0x10FFFF)
                return fail(g, TD_ERR_FORMAT, "\\%c%X is past U+10FFFF", e, v);
            *cp = v;
            *raw_byte = e == 'x';
            return true;
        }
        switch (e) {
        case 't': *cp = '\t'; return true;
        case 'r': *cp = '\r'; return true;
        case 'n': *cp = '\n'; return true;
        case 'f': *cp = '\f'; return true;
        case 'v': *cp = '\v'; return true;
        case '0': *cp = 0; return true;
        default:
            if (e > 0x20 && e < 0x7f && !is_name_char(e)) {
                *cp = (uint32_t)e;
                return true;
            }
            return fail(g, TD_ERR_FORMAT, "unknown escape \\%c", e);
        }
    }
    /* one UTF-8 character, taken as its code point */
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || g->p + n > g->end)
        return fail(g, TD_ERR_FORMAT, "invalid UTF-8 byte 0x%02X", c);
    uint32_t v = n == 1 ? c : c & (0x7f >> n);
    for (int i = 1; i < n; i++) {
        unsigned char cc = (unsigned char)g->p[i];
        if ((cc & 0xc0) != 0x80)
            return fail(g, TD_ERR_FORMAT, "invalid UTF-8 sequence");
        v = (v << 6) | (cc & 0x3f);
    }
    g->p += n;
    *cp = v;
    return true;
}

static int utf8_encode(uint32_t cp, uint8_t out[4])
{
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

static bool push_byte(gparse_t *g, int32_t ri, uint8_t byte)
{
    uint64_t s[4] = {0};
    s[byte >> 6] |= 1ull << (byte & 63);
    int32_t id = set_id(g->b, s);
    if (id < 0)
        return fail(g, TD_ERR_NOMEM, "out of memory");
    return push(g, ri, TD_GRAM_E_BYTES, id);
}

/* A class being read: code point ranges, plus raw bytes (\xHH above 0x7F). */
typedef struct cclass {
    uint32_t lo[512], hi[512];
    int n;
    uint64_t raw[4];
} cclass_t;

/* ---- UTF-8 ranges: a code point range as alternatives of byte-range sequences -------- */

typedef struct seqs {
    gparse_t *g;
    int32_t rule;        /* the alternatives go here */
    uint64_t one[4];     /* one-byte sequences, gathered into one set */
    bool any_alt;        /* an alternative was written to rule */
} seqs_t;

static bool seq_emit(seqs_t *q, const uint8_t *a, const uint8_t *b, int n)
{
    if (n == 1) {
        for (int c = a[0]; c <= b[0]; c++)
            q->one[c >> 6] |= 1ull << (c & 63);
        return true;
    }
    gparse_t *g = q->g;
    if (q->any_alt && !push(g, q->rule, E_ALT, 0))
        return false;
    q->any_alt = true;
    for (int i = 0; i < n; i++) {
        uint64_t s[4] = {0};
        for (int c = a[i]; c <= b[i]; c++)
            s[c >> 6] |= 1ull << (c & 63);
        int32_t id = set_id(g->b, s);
        if (id < 0)
            return fail(g, TD_ERR_NOMEM, "out of memory");
        if (!push(g, q->rule, TD_GRAM_E_BYTES, id))
            return false;
    }
    return true;
}

/* lo..hi all of one encoded length n */
static bool utf8_split(seqs_t *q, uint32_t lo, uint32_t hi, int n)
{
    for (int i = 1; i < n; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0)
                return utf8_split(q, lo, lo | m, n) && utf8_split(q, (lo | m) + 1, hi, n);
            if ((hi & m) != m)
                return utf8_split(q, lo, (hi & ~m) - 1, n) && utf8_split(q, hi & ~m, hi, n);
        }
    }
    uint8_t a[4], b[4];
    utf8_encode(lo, a);
    utf8_encode(hi, b);
    return seq_emit(q, a, b, n);
}

static bool utf8_range(seqs_t *q, uint32_t lo, uint32_t hi)
{
    static const uint32_t top[4] = {0x7F, 0x7FF, 0xFFFF, 0x10FFFF};
    if (lo <= 0xDFFF && hi >= 0xD800) { /* surrogates are not characters */
        bool ok = true;
        if (lo < 0xD800)
            ok = utf8_range(q, lo, 0xD7FF);
        if (ok && hi > 0xDFFF)
            ok = utf8_range(q, 0xE000, hi);
        return ok;
    }
    for (int n = 1; n <= 4 && lo <= hi; n++) {
        if (lo > top[n - 1])
            continue;
        uint32_t h = hi < top[n - 1] ? hi : top[n - 1];
        if (!utf8_split(q, lo, h, n))
            return false;
        lo = h + 1;
    }
    return true;
}

static int cmp_range(const void *a, const void *b)
{
    const uint32_t *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}

/* Writes class c (negated or not) into rule ri: one BYTES element when it is all single
 * bytes, else a reference to a new rule of its byte sequences. */
static bool emit_class(gparse_t *g, int32_t ri, cclass_t *c, bool negate)
{
    /* normalize: sort and merge the ranges, then complement if negated */
    uint32_t (*r)[2] = malloc(sizeof(uint32_t[2]) * (size_t)(c->n + 1));
    if (!r)
        return fail(g, TD_ERR_NOMEM, "out of memory");
    for (int i = 0; i < c->n; i++) {
        r[i][0] = c->lo[i];
        r[i][1] = c->hi[i];
    }
    qsort(r, (size_t)c->n, sizeof *r, cmp_range);
    int m = 0;
    for (int i = 0; i < c->n; i++) {
        if (m > 0 && r[i][0] <= r[m - 1][1] + 1) {
            if (r[i][1] > r[m - 1][1])
                r[m - 1][1] = r[i][1];
        } else {
            r[m][0] = r[i][0];
            r[m][1] = r[i][1];
            m++;
        }
    }
    uint64_t raw[4];
    memcpy(raw, c->raw, sizeof raw);
    if (negate) {
        uint32_t (*nr)[2] = malloc(sizeof(uint32_t[2]) * (size_t)(m + 1));
        if (!nr) {
            free(r);
            return fail(g, TD_ERR_NOMEM, "out of memory");
        }
        int k = 0;
        uint32_t next = 0;
        for (int i = 0; i < m; i++) {
            if (r[i][0] > next)
                nr[k][0] = next, nr[k][1] = r[i][0] - 1, k++;
            next = r[i][1] + 1;
        }
        if (next <= 0x10FFFF)
            nr[k][0] = next, nr[k][1] = 0x10FFFF, k++;
        free(r);
        r = nr;
        m = k;
        /* a negated class is characters: raw bytes above 0x7F are taken out of none */
        memset(raw, 0, sizeof raw);
    }
    int32_t alt_rule = new_rule(g);
    if (alt_rule < 0) {
        free(r);
        return false;
    }
    seqs_t q = {.g = g, .rule = alt_rule};
    memcpy(q.one, raw, sizeof raw);
    bool ok = true;
    for (int i = 0; i < m && ok; i++)
        ok = utf8_range(&q, r[i][0], r[i][1]);
    free(r);
    if (!ok)
        return false;
    int32_t id = set_id(g->b, q.one);
    if (id < 0)
        return fail(g, TD_ERR_NOMEM, "out of memory");
    if (!q.any_alt) { /* all one byte: no rule needed (the empty one stays unused) */
        g->b->r[alt_rule].defined = true;
        return push(g, ri, TD_GRAM_E_BYTES, id);
    }
    bool any_one = q.one[0] | q.one[1] | q.one[2] | q.one[3];
    if (any_one && !(push(g, alt_rule, E_ALT, 0) && push(g, alt_rule, TD_GRAM_E_BYTES, id)))
        return false;
    return push(g, ri, TD_GRAM_E_RULE, alt_rule);
}

static bool parse_class(gparse_t *g, int32_t ri)
{
    g->p++; /* [ */
    bool negate = g->p < g->end && *g->p == '^';
    if (negate)
        g->p++;
    cclass_t *c = calloc(1, sizeof *c);
    if (!c)
        return fail(g, TD_ERR_NOMEM, "out of memory");
    bool ok = true;
    while (ok && g->p < g->end && *g->p != ']') {
        uint32_t lo, hi;
        bool raw_lo, raw_hi = false;
        if (!(ok = parse_char(g, &lo, &raw_lo)))
            break;
        hi = lo;
        if (g->p + 1 < g->end && *g->p == '-' && g->p[1] != ']') {
            g->p++;
            if (!(ok = parse_char(g, &hi, &raw_hi)))
                break;
            if (hi < lo) {
                ok = fail(g, TD_ERR_FORMAT, "class range U+%04X-U+%04X runs backwards", lo, hi);
                break;
            }
        }
        if ((raw_lo || raw_hi) && hi > 0x7F) { /* \xHH ranges above ASCII are bytes */
            if (hi > 0xFF) {
                ok = fail(g, TD_ERR_FORMAT, "a range from a \\x byte must end at a byte");
                break;
            }
            for (uint32_t x = lo; x <= hi; x++)
                c->raw[x >> 6] |= 1ull << (x & 63);
            continue;
        }
        if (c->n == (int)(sizeof c->lo / sizeof c->lo[0])) {
            ok = fail(g, TD_ERR_RANGE, "a character class with more than %d ranges", c->n);
            break;
        }
        c->lo[c->n] = lo;
        c->hi[c->n] = hi;
        c->n++;
    }
    if (ok && g->p >= g->end)
        ok = fail(g, TD_ERR_FORMAT, "a character class is not closed with ]");
    if (ok) {
        g->p++;
        ok = emit_class(g, ri, c, negate);
    }
    free(c);
    return ok;
}

static bool parse_alternates(gparse_t *g, int32_t ri, bool nested);

static bool parse_int(gparse_t *g, int *v)
{
    const char *s = g->p;
    long x = 0;
    while (g->p < g->end && *g->p >= '0' && *g->p <= '9') {
        x = x * 10 + (*g->p - '0');
        if (x > TD_GRAM_MAX_REPEAT)
            return fail(g, TD_ERR_RANGE, "a repetition count above %d: use * or +, or a smaller bound",
                        TD_GRAM_MAX_REPEAT);
        g->p++;
    }
    if (g->p == s)
        return fail(g, TD_ERR_FORMAT, "expected a number in {m,n}");
    *v = (int)x;
    return true;
}

/* Applies {lo, hi} (hi -1: unbounded) to the items of rule ri from index `from`. */
static bool repeat(gparse_t *g, int32_t ri, int32_t from, int lo, int hi)
{
    brule_t *r = &g->b->r[ri];
    if (from >= r->n)
        return fail(g, TD_ERR_FORMAT, "a repetition operator with nothing before it");
    td_gram_elem_t x;
    if (r->n - from == 1) {
        x = r->v[from];
    } else { /* several elements (a literal, a class's bytes): one group rule */
        int32_t grp = new_rule(g);
        if (grp < 0)
            return false;
        r = &g->b->r[ri];
        for (int32_t i = from; i < r->n; i++) {
            if (!push(g, grp, r->v[i].kind, (int32_t)r->v[i].arg))
                return false;
            r = &g->b->r[ri];
        }
        x = (td_gram_elem_t){.kind = TD_GRAM_E_RULE, .arg = (uint32_t)grp};
    }
    g->b->r[ri].n = from;
    for (int i = 0; i < lo; i++)
        if (!push(g, ri, x.kind, (int32_t)x.arg))
            return false;
    if (hi < 0) { /* R ::= X R | "" */
        int32_t rr = new_rule(g);
        if (rr < 0)
            return false;
        if (!(push(g, rr, x.kind, (int32_t)x.arg) && push(g, rr, TD_GRAM_E_RULE, rr) && push(g, rr, E_ALT, 0)))
            return false;
        g->b->r[rr].star = true;
        return push(g, ri, TD_GRAM_E_RULE, rr);
    }
    int32_t prev = -1; /* R_k ::= X R_{k-1} | "" */
    for (int k = 0; k < hi - lo; k++) {
        int32_t rk = new_rule(g);
        if (rk < 0)
            return false;
        if (!push(g, rk, x.kind, (int32_t)x.arg))
            return false;
        if (prev >= 0 && !push(g, rk, TD_GRAM_E_RULE, prev))
            return false;
        if (!push(g, rk, E_ALT, 0))
            return false;
        prev = rk;
    }
    return prev < 0 || push(g, ri, TD_GRAM_E_RULE, prev);
}

static bool parse_sequence(gparse_t *g, int32_t ri, bool nested)
{
    int32_t last = -1; /* where the last item starts in rule ri */
    while (g->p < g->end && g->st == TD_OK) {
        char c = *g->p;
        int32_t start = g->b->r[ri].n;
        if (c == '"') {
            g->p++;
            last = start;
            while (g->p < g->end && *g->p != '"') {
                uint32_t cp;
                bool raw;
                if (!parse_char(g, &cp, &raw))
                    return false;
                uint8_t buf[4];
                int n = raw ? (buf[0] = (uint8_t)cp, 1) : utf8_encode(cp, buf);
                for (int i = 0; i < n; i++)
                    if (!push_byte(g, ri, buf[i]))
                        return false;
            }
            if (g->p >= g->end)
                return fail(g, TD_ERR_FORMAT, "a string literal is not closed with \"");
            g->p++;
        } else if (c == '[') {
            last = start;
            if (!parse_class(g, ri))
                return false;
        } else if (c == '.') {
            g->p++;
            last = start;
            cclass_t *cc = calloc(1, sizeof *cc);
            if (!cc)
                return fail(g, TD_ERR_NOMEM, "out of memory");
            bool ok = emit_class(g, ri, cc, true);
            free(cc);
            if (!ok)
                return false;
        } else if (is_name_char(c)) {
            const char *s = g->p;
            while (g->p < g->end && is_name_char(*g->p))
                g->p++;
            int32_t ref = rule_find(g->b, s, (size_t)(g->p - s));
            if (ref < 0 && (ref = rule_new(g->b, s, (size_t)(g->p - s), -1)) < 0)
                return too_big(g);
            if (g->b->r[ref].line_used < 0)
                g->b->r[ref].line_used = g->line;
            last = start;
            if (!push(g, ri, TD_GRAM_E_RULE, ref))
                return false;
        } else if (c == '(') {
            if (++g->depth > TD_GRAM_MAX_NESTING)
                return fail(g, TD_ERR_RANGE, "parentheses nested more than %d deep", TD_GRAM_MAX_NESTING);
            g->p++;
            skip_space(g, true);
            int32_t grp = new_rule(g);
            if (grp < 0 || !parse_alternates(g, grp, true))
                return false;
            if (g->p >= g->end || *g->p != ')')
                return fail(g, TD_ERR_FORMAT, "a ( is not closed with )");
            g->p++;
            g->depth--;
            last = start;
            if (!push(g, ri, TD_GRAM_E_RULE, grp))
                return false;
        } else if (c == '*' || c == '+' || c == '?') {
            g->p++;
            if (last < 0)
                return fail(g, TD_ERR_FORMAT, "%c with nothing before it", c);
            if (!repeat(g, ri, last, c == '+' ? 1 : 0, c == '?' ? 1 : -1))
                return false;
            last = -1;
        } else if (c == '{') {
            g->p++;
            if (last < 0)
                return fail(g, TD_ERR_FORMAT, "{ with nothing before it");
            skip_space(g, false);
            int lo = 0, hi;
            if (!parse_int(g, &lo))
                return false;
            skip_space(g, false);
            hi = lo;
            if (g->p < g->end && *g->p == ',') {
                g->p++;
                skip_space(g, false);
                hi = -1;
                if (g->p < g->end && *g->p != '}' && !parse_int(g, &hi))
                    return false;
                skip_space(g, false);
            }
            if (g->p >= g->end || *g->p != '}')
                return fail(g, TD_ERR_FORMAT, "a { is not closed with }");
            g->p++;
            if (hi >= 0 && hi < lo)
                return fail(g, TD_ERR_FORMAT, "{%d,%d}: the maximum is below the minimum", lo, hi);
            if (!repeat(g, ri, last, lo, hi))
                return false;
            last = -1;
        } else {
            break;
        }
        skip_space(g, nested);
    }
    return g->st == TD_OK;
}

static bool parse_alternates(gparse_t *g, int32_t ri, bool nested)
{
    if (!parse_sequence(g, ri, nested))
        return false;
    while (g->p < g->end && *g->p == '|') {
        g->p++;
        if (!push(g, ri, E_ALT, 0))
            return false;
        skip_space(g, true);
        if (!parse_sequence(g, ri, nested))
            return false;
    }
    return true;
}

static bool parse_grammar(gparse_t *g)
{
    skip_space(g, true);
    while (g->p < g->end) {
        const char *s = g->p;
        while (g->p < g->end && is_name_char(*g->p))
            g->p++;
        if (g->p == s)
            return fail(g, TD_ERR_FORMAT, "expected a rule name, found '%c'", *g->p);
        size_t n = (size_t)(g->p - s);
        skip_space(g, false);
        if (g->end - g->p < 3 || memcmp(g->p, "::=", 3) != 0)
            return fail(g, TD_ERR_FORMAT, "expected ::= after rule name %.*s", (int)n, s);
        g->p += 3;
        skip_space(g, true);
        int32_t ri = rule_find(g->b, s, n);
        if (ri < 0 && (ri = rule_new(g->b, s, n, -1)) < 0)
            return too_big(g);
        if (g->b->r[ri].defined)
            return fail(g, TD_ERR_FORMAT, "rule %.*s is defined twice", (int)n, s);
        g->b->r[ri].defined = true;
        g->cur_named = ri;
        if (!parse_alternates(g, ri, false))
            return false;
        if (g->p < g->end && *g->p != '\n' && *g->p != '\r')
            return fail(g, TD_ERR_FORMAT, "unexpected '%c' in rule %.*s", *g->p, (int)n, s);
        skip_space(g, true);
    }
    return true;
}

/* ---- flattening and the checks -------------------------------------------------------- */

/* A rule's name for messages: its own, or "a group in X". */
static void rule_label(const builder_t *b, int32_t r, char *buf, size_t cap)
{
    if (b->r[r].name)
        snprintf(buf, cap, "%s", b->r[r].name);
    else
        snprintf(buf, cap, "a group in rule %s", b->r[b->r[r].owner].name ? b->r[b->r[r].owner].name : "?");
}

/* Left recursion: a rule reached again at the left edge (through rules that can match the
 * empty string) without a byte in between. */
typedef struct lr {
    const td_gram_t *g;
    const builder_t *b;
    const bool *nullable;
    uint8_t *color; /* 0 new, 1 on the path, 2 done */
    int32_t *path;
    int32_t n_path;
    int32_t hit;    /* the rule found twice, -1 */
} lr_t;

static void lr_visit(lr_t *x, int32_t r)
{
    if (x->hit >= 0)
        return;
    x->color[r] = 1;
    x->path[x->n_path++] = r;
    const td_gram_t *g = x->g;
    for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1] && x->hit < 0; a++) {
        for (int32_t p = g->alt_start[a]; g->elems[p].kind == TD_GRAM_E_RULE; p++) {
            int32_t s = (int32_t)g->elems[p].arg;
            if (x->color[s] == 1) {
                x->hit = s;
                return;
            }
            if (x->color[s] == 0)
                lr_visit(x, s);
            if (x->hit >= 0 || !x->nullable[s])
                break;
        }
    }
    if (x->hit < 0) {
        x->color[r] = 2;
        x->n_path--;
    }
}

static td_status_t check(td_gram_t *g, const builder_t *b)
{
    td_status_t st = TD_OK;
    int32_t nr = g->n_rules;
    bool *nullable = calloc((size_t)nr, sizeof *nullable);
    bool *prod = calloc((size_t)nr, sizeof *prod);
    uint8_t *color = calloc((size_t)nr, 1);
    int32_t *path = malloc((size_t)nr * sizeof *path);
    if (!nullable || !prod || !color || !path) {
        st = td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
        goto out;
    }
    /* nullable and productive (can end), to a fixpoint */
    for (bool changed = true; changed;) {
        changed = false;
        for (int32_t r = 0; r < nr; r++) {
            for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
                bool nul = true, pro = true;
                for (int32_t p = g->alt_start[a]; g->elems[p].kind != TD_GRAM_E_END; p++) {
                    td_gram_elem_t e = g->elems[p];
                    if (e.kind == TD_GRAM_E_BYTES) {
                        const uint64_t *s = g->sets[e.arg];
                        nul = false;
                        if (!(s[0] | s[1] | s[2] | s[3]))
                            pro = false;
                    } else {
                        nul = nul && nullable[e.arg];
                        pro = pro && prod[e.arg];
                    }
                }
                if (nul && !nullable[r])
                    nullable[r] = changed = true;
                if (pro && !prod[r])
                    prod[r] = changed = true;
            }
        }
    }
    char name[160];
    /* every rule reachable from the root can end (else a generation could be trapped) */
    {
        int32_t *work = path, n = 0;
        memset(color, 0, (size_t)nr);
        work[n++] = g->root;
        color[g->root] = 1;
        while (n > 0) {
            int32_t r = work[--n];
            if (!prod[r]) {
                rule_label(b, r, name, sizeof name);
                st = td_errorf_quiet(TD_ERR_INVALID, "grammar: rule %s can never end: every alternative "
                                     "needs itself again (or a rule that cannot end, or an empty "
                                     "character class); give it an alternative that ends", name);
                goto out;
            }
            for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++)
                for (int32_t p = g->alt_start[a]; g->elems[p].kind != TD_GRAM_E_END; p++)
                    if (g->elems[p].kind == TD_GRAM_E_RULE && !color[g->elems[p].arg]) {
                        color[g->elems[p].arg] = 1;
                        work[n++] = (int32_t)g->elems[p].arg;
                    }
        }
    }
    memset(color, 0, (size_t)nr);
    lr_t x = {.g = g, .b = b, .nullable = nullable, .color = color, .path = path, .hit = -1};
    for (int32_t r = 0; r < nr && x.hit < 0; r++)
        if (!color[r])
            lr_visit(&x, r);
    if (x.hit >= 0) {
        char cyc[512] = "";
        size_t used = 0;
        bool on = false;
        for (int32_t i = 0; i < x.n_path; i++) {
            on = on || x.path[i] == x.hit;
            if (!on || (b->r[x.path[i]].name == NULL))
                continue;
            used += (size_t)snprintf(cyc + used, used < sizeof cyc ? sizeof cyc - used : 0, "%s -> ",
                                     b->r[x.path[i]].name);
            if (used >= sizeof cyc)
                break;
        }
        rule_label(b, x.hit, name, sizeof name);
        if (b->r[x.hit].star) {
            st = td_errorf_quiet(TD_ERR_INVALID, "grammar: %s repeats (* or +) something that can match the "
                                 "empty string, such as (\"a\"?)*: make the repeated part non-empty", name);
            goto out;
        }
        st = td_errorf_quiet(TD_ERR_INVALID, "grammar: rule %s is left-recursive (%s%s): it can reach "
                             "itself before matching a byte; rewrite it with repetition, e.g. "
                             "list ::= item (\",\" item)*", name, cyc, name);
        goto out;
    }
out:
    free(nullable);
    free(prod);
    free(color);
    free(path);
    return st;
}

static td_status_t flatten(const builder_t *b, td_gram_t *g)
{
    int64_t n_alts = 0, n_elems = 0;
    for (int32_t r = 0; r < b->n; r++) {
        n_alts++;
        n_elems += b->r[r].n + 1;
        for (int32_t i = 0; i < b->r[r].n; i++)
            if (b->r[r].v[i].kind == E_ALT)
                n_alts++;
    }
    g->elems = malloc((size_t)n_elems * sizeof *g->elems);
    g->alt_start = malloc((size_t)n_alts * sizeof *g->alt_start);
    g->rule_alt = malloc((size_t)(b->n + 1) * sizeof *g->rule_alt);
    g->sets = malloc((size_t)(b->n_sets ? b->n_sets : 1) * sizeof *g->sets);
    if (!g->elems || !g->alt_start || !g->rule_alt || !g->sets)
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory for %lld elements", (long long)n_elems);
    if (b->n_sets)
        memcpy(g->sets, b->sets, (size_t)b->n_sets * sizeof *g->sets);
    g->n_sets = b->n_sets;
    int32_t e = 0, a = 0;
    for (int32_t r = 0; r < b->n; r++) {
        g->rule_alt[r] = a;
        g->alt_start[a++] = e;
        for (int32_t i = 0; i < b->r[r].n; i++) {
            td_gram_elem_t x = b->r[r].v[i];
            if (x.kind == E_ALT) {
                g->elems[e++] = (td_gram_elem_t){.kind = TD_GRAM_E_END};
                g->alt_start[a++] = e;
            } else {
                g->elems[e++] = x;
            }
        }
        g->elems[e++] = (td_gram_elem_t){.kind = TD_GRAM_E_END};
    }
    g->rule_alt[b->n] = a;
    g->n_elems = e;
    g->n_rules = b->n;
    return TD_OK;
}

static td_status_t compile_gbnf(td_gram_t *g, const char *src, size_t len)
{
    builder_t b = {0};
    td_status_t st;
    if (td_hash_init(&b.by_name, 64) != TD_OK || td_hash_init(&b.set_ids, 64) != TD_OK) {
        st = td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
        goto out;
    }
    gparse_t p = {.b = &b, .src = src, .p = src, .end = src + len, .line = 1, .cur_named = -1};
    parse_grammar(&p);
    if ((st = p.st) != TD_OK)
        goto out;
    int32_t root = rule_find(&b, "root", 4);
    if (root < 0 || !b.r[root].defined) {
        st = td_errorf_quiet(TD_ERR_INVALID, "grammar: no rule named root: the start rule is root ::= ...");
        goto out;
    }
    for (int32_t r = 0; r < b.n; r++) {
        if (!b.r[r].defined) {
            st = td_errorf_quiet(TD_ERR_INVALID, "grammar line %d: rule %s is used but never defined",
                                 b.r[r].line_used, b.r[r].name);
            goto out;
        }
    }
    g->root = root;
    if ((st = flatten(&b, g)) != TD_OK)
        goto out;
    st = check(g, &b);
out:
    builder_free(&b);
    return st;
}

/* ---- compile ---------------------------------------------------------------------------- */

const char *td_gram_kind_name(td_gram_kind_t kind)
{
    switch (kind) {
    case TD_GRAM_GBNF: return "gbnf";
    case TD_GRAM_REGEX: return "regex";
    case TD_GRAM_CHOICE: return "choice";
    case TD_GRAM_JSON_OBJECT: return "json_object";
    case TD_GRAM_JSON_SCHEMA: return "json_schema";
    }
    return "?";
}

td_status_t td_gram_compile(td_gram_kind_t kind, const char *src, size_t len, td_gram_t **gram_p)
{
    if (kind == TD_GRAM_JSON_OBJECT) {
        src = "";
        len = 0;
    }
    if (!src && len > 0)
        return td_errorf_quiet(TD_ERR_INVALID, "grammar: no source text");
    if (len > TD_GRAM_MAX_SOURCE)
        return td_errorf_quiet(TD_ERR_RANGE, "%s: %zu bytes, at most %u accepted", td_gram_kind_name(kind),
                               len, TD_GRAM_MAX_SOURCE);
    td_gram_t *g = calloc(1, sizeof *g);
    if (!g)
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
    atomic_init(&g->refs, 1);
    g->kind = kind;
    uint32_t k = (uint32_t)kind;
    g->hash = td_fnv1a64(td_fnv1a64(TD_FNV1A64_INIT, &k, sizeof k), src, len);
    td_gram_str_t text = {0};
    td_status_t st;
    switch (kind) {
    case TD_GRAM_GBNF: td_gram_str_add(&text, src, len); st = TD_OK; break;
    case TD_GRAM_REGEX: st = td_gram_regex_to_gbnf(src, len, &text); break;
    case TD_GRAM_CHOICE: st = td_gram_choice_to_gbnf(src, len, &text); break;
    case TD_GRAM_JSON_OBJECT: st = td_gram_json_object_gbnf(&text); break;
    case TD_GRAM_JSON_SCHEMA: st = td_gram_schema_to_gbnf(src, len, &text); break;
    default: st = td_errorf_quiet(TD_ERR_INVALID, "grammar: unknown kind %d", (int)kind); break;
    }
    if (st == TD_OK && text.oom)
        st = td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
    if (st == TD_OK && text.len > (size_t)TD_GRAM_MAX_SOURCE * 4)
        st = td_errorf_quiet(TD_ERR_RANGE, "%s: its grammar would be %zu bytes of GBNF, at most %u accepted: "
                             "simplify it", td_gram_kind_name(kind), text.len, TD_GRAM_MAX_SOURCE * 4);
    if (st != TD_OK) {
        td_gram_str_free(&text);
        free(g);
        return st;
    }
    if (!text.s)
        td_gram_str_add(&text, "", 0);
    g->source = text.s;
    if ((st = compile_gbnf(g, text.s ? text.s : "", text.len)) != TD_OK) {
        td_gram_unref(g);
        return st;
    }
    *gram_p = g;
    return TD_OK;
}

td_gram_t *td_gram_ref(td_gram_t *g)
{
    atomic_fetch_add(&g->refs, 1);
    return g;
}

void td_gram_unref(td_gram_t *g)
{
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1)
        return;
    free(g->source);
    free(g->elems);
    free(g->sets);
    free(g->alt_start);
    free(g->rule_alt);
    free(g);
}

const char *td_gram_source(const td_gram_t *g)
{
    return g->source ? g->source : "";
}

td_status_t td_gram_to_gbnf(td_gram_kind_t kind, const char *src, size_t len, char **gbnf_p)
{
    td_gram_t *g = NULL;
    td_status_t st = td_gram_compile(kind, src, len, &g);
    if (st != TD_OK)
        return st;
    char *gbnf = strdup(td_gram_source(g));
    td_gram_unref(g);
    if (!gbnf)
        return td_errorf(TD_ERR_NOMEM, "grammar: out of memory");
    *gbnf_p = gbnf;
    return TD_OK;
}

uint64_t td_gram_hash(const td_gram_t *g)
{
    return g->hash;
}

size_t td_gram_n_elems(const td_gram_t *g)
{
    return (size_t)g->n_elems;
}

size_t td_gram_n_rules(const td_gram_t *g)
{
    return (size_t)g->n_rules;
}

/* ---- stack sets ------------------------------------------------------------------------- */

void td_gram_sset_free(td_gram_sset_t *s)
{
    free(s->buf);
    free(s->off);
    free(s->hash);
    *s = (td_gram_sset_t){0};
}

void td_gram_sset_clear(td_gram_sset_t *s)
{
    s->len = 0;
    s->n = 0;
    s->has_empty = false;
    s->oom = false;
}

/* Adds stk[0..n) unless an equal stack is there. */
static void sset_add(td_gram_sset_t *s, const int32_t *stk, int32_t n)
{
    if (s->oom)
        return;
    if (n == 0)
        s->has_empty = true;
    uint64_t h = td_fnv1a64(TD_FNV1A64_INIT, stk, (size_t)n * sizeof *stk);
    for (int32_t k = 0; k < s->n; k++) {
        if (s->hash[k] != h)
            continue;
        const int32_t *o = s->buf + s->off[k];
        if (o[0] == n && !memcmp(o + 1, stk, (size_t)n * sizeof *stk))
            return;
    }
    if (s->n >= TD_GRAM_MAX_STACKS)
        return; /* documented: ambiguity past the bound is dropped */
    if (s->n == s->n_cap) {
        int32_t cap = s->n_cap ? s->n_cap * 2 : 8;
        int32_t *no = realloc(s->off, (size_t)cap * sizeof *no);
        if (!no) {
            s->oom = true;
            return;
        }
        s->off = no;
        uint64_t *nh = realloc(s->hash, (size_t)cap * sizeof *nh);
        if (!nh) {
            s->oom = true;
            return;
        }
        s->hash = nh;
        s->n_cap = cap;
    }
    if (s->len + (size_t)n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        while (cap < s->len + (size_t)n + 1)
            cap *= 2;
        int32_t *nb = realloc(s->buf, cap * sizeof *nb);
        if (!nb) {
            s->oom = true;
            return;
        }
        s->buf = nb;
        s->cap = cap;
    }
    s->off[s->n] = (int32_t)s->len;
    s->hash[s->n] = h;
    s->n++;
    s->buf[s->len++] = n;
    memcpy(s->buf + s->len, stk, (size_t)n * sizeof *stk);
    s->len += (size_t)n;
}

#define EXPAND_MAX_DEPTH 4096 /* rule expansions in one go; only a chain of more rules than
                                 this without a byte between them reaches it */

/* Adds to out every stack stk[0..n) leads to before its next byte: the top expanded until
 * it is a byte set, rules that end popped. stk has room for TD_GRAM_MAX_STACK + 1. */
static void expand(const td_gram_t *g, td_gram_sset_t *out, int32_t *stk, int32_t n, int depth)
{
    if (depth > EXPAND_MAX_DEPTH || out->oom)
        return;
    while (n > 0 && g->elems[stk[n - 1]].kind == TD_GRAM_E_END)
        n--; /* the alternative ended: return to the rule below */
    if (n == 0) {
        sset_add(out, stk, 0);
        return;
    }
    int32_t pos = stk[n - 1];
    td_gram_elem_t e = g->elems[pos];
    if (e.kind == TD_GRAM_E_BYTES) {
        sset_add(out, stk, n);
        return;
    }
    /* a rule: its alternatives replace the reference, the element after it stays below
     * (unless that ends the alternative: a tail call keeps right recursion flat) */
    int32_t base = n - 1;
    if (g->elems[pos + 1].kind != TD_GRAM_E_END)
        stk[base++] = pos + 1;
    if (base >= TD_GRAM_MAX_STACK) {
        stk[n - 1] = pos;
        return; /* documented: nesting past the bound is dropped */
    }
    int32_t r = (int32_t)e.arg;
    for (int32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
        stk[base] = g->alt_start[a];
        expand(g, out, stk, base + 1, depth + 1); /* restores stk[0..base) */
    }
    stk[n - 1] = pos;
}

/* Scratch stack for expand: one per thread would be a global; each call site passes its own. */
typedef struct { int32_t v[TD_GRAM_MAX_STACK + 2]; } stkbuf_t;

td_status_t td_gram_sset_start(const td_gram_t *g, td_gram_sset_t *out)
{
    td_gram_sset_clear(out);
    stkbuf_t *t = malloc(sizeof *t);
    if (!t)
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
    for (int32_t a = g->rule_alt[g->root]; a < g->rule_alt[g->root + 1]; a++) {
        t->v[0] = g->alt_start[a];
        expand(g, out, t->v, 1, 0);
    }
    free(t);
    return out->oom ? td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory") : TD_OK;
}

td_status_t td_gram_sset_step(const td_gram_t *g, const td_gram_sset_t *in, uint8_t b, td_gram_sset_t *out)
{
    td_gram_sset_clear(out);
    stkbuf_t t; /* 4 KiB on the stack */
    for (int32_t k = 0; k < in->n; k++) {
        int32_t n;
        const int32_t *s = td_gram_sset_stack(in, k, &n);
        if (n == 0)
            continue;
        td_gram_elem_t e = g->elems[s[n - 1]];
        if (!td_gram_set_has(g, (int32_t)e.arg, b))
            continue;
        memcpy(t.v, s, (size_t)n * sizeof *s);
        t.v[n - 1] = s[n - 1] + 1;
        expand(g, out, t.v, n, 0);
    }
    return out->oom ? td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory") : TD_OK;
}

td_status_t td_gram_sset_copy(td_gram_sset_t *dst, const td_gram_sset_t *src)
{
    td_gram_sset_clear(dst);
    for (int32_t k = 0; k < src->n; k++) {
        int32_t n;
        const int32_t *s = td_gram_sset_stack(src, k, &n);
        sset_add(dst, s, n);
    }
    return dst->oom ? td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory") : TD_OK;
}

td_status_t td_gram_sset_one(const td_gram_sset_t *in, int32_t k, td_gram_sset_t *out)
{
    td_gram_sset_clear(out);
    int32_t n;
    const int32_t *s = td_gram_sset_stack(in, k, &n);
    sset_add(out, s, n);
    return out->oom ? td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory") : TD_OK;
}

td_status_t td_gram_sset_add(td_gram_sset_t *s, const int32_t *stk, int32_t n)
{
    sset_add(s, stk, n);
    return s->oom ? td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory") : TD_OK;
}

td_status_t td_gram_sset_single(int32_t pos, td_gram_sset_t *out)
{
    td_gram_sset_clear(out);
    sset_add(out, &pos, 1);
    return out->oom ? td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory") : TD_OK;
}

/* ---- matcher state ---------------------------------------------------------------------- */

td_status_t td_gram_state_create(td_gram_t *g, td_gram_state_t **state_p)
{
    td_gram_state_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
    s->g = td_gram_ref(g);
    td_status_t st = td_gram_sset_start(g, &s->set);
    if (st != TD_OK) {
        td_gram_state_destroy(s);
        return st;
    }
    *state_p = s;
    return TD_OK;
}

td_status_t td_gram_state_copy(const td_gram_state_t *src, td_gram_state_t **copy_p)
{
    td_gram_state_t *s = calloc(1, sizeof *s);
    if (!s)
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
    s->g = td_gram_ref(src->g);
    td_status_t st = td_gram_sset_copy(&s->set, &src->set);
    if (st != TD_OK) {
        td_gram_state_destroy(s);
        return st;
    }
    *copy_p = s;
    return TD_OK;
}

void td_gram_state_destroy(td_gram_state_t *s)
{
    if (!s)
        return;
    td_gram_sset_free(&s->set);
    td_gram_sset_free(&s->tmp);
    td_gram_unref(s->g);
    free(s);
}

td_gram_t *td_gram_state_grammar(const td_gram_state_t *s)
{
    return s->g;
}

td_status_t td_gram_accept_bytes(td_gram_state_t *s, const void *bytes, size_t len)
{
    if (len == 0)
        return TD_OK;
    const uint8_t *p = bytes;
    td_gram_sset_t cur = {0}, next = {0};
    td_status_t st = td_gram_sset_copy(&cur, &s->set);
    for (size_t i = 0; i < len && st == TD_OK; i++) {
        if ((st = td_gram_sset_step(s->g, &cur, p[i], &next)) != TD_OK)
            break;
        td_gram_sset_t t = cur;
        cur = next;
        next = t;
        if (cur.n == 0)
            st = TD_ERR_INVALID; /* quiet: a rejected byte is routine */
    }
    if (st == TD_OK) {
        td_gram_sset_t t = s->set;
        s->set = cur;
        cur = t;
    }
    td_gram_sset_free(&cur);
    td_gram_sset_free(&next);
    return st;
}

bool td_gram_can_end(const td_gram_state_t *s)
{
    return s->set.has_empty;
}

bool td_gram_is_done(const td_gram_state_t *s)
{
    return s->set.has_empty && s->set.n == 1;
}

/* ---- serialization: "TDGS", version 1, hash, n, then per stack its length and positions,
 * all little-endian 32-bit (the hash 64-bit) */

#define STATE_MAGIC 0x53474454u /* "TDGS" */

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

td_status_t td_gram_state_serialize(const td_gram_state_t *s, uint8_t **buf_p, size_t *len_p)
{
    size_t n = 4 + 4 + 8 + 4 + (size_t)s->set.len * 4;
    uint8_t *buf = malloc(n), *p = buf;
    if (!buf)
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
    put32(p, STATE_MAGIC);
    put32(p + 4, 1);
    put32(p + 8, (uint32_t)s->g->hash);
    put32(p + 12, (uint32_t)(s->g->hash >> 32));
    put32(p + 16, (uint32_t)s->set.n);
    p += 20;
    for (int32_t k = 0; k < s->set.n; k++) {
        int32_t len;
        const int32_t *stk = td_gram_sset_stack(&s->set, k, &len);
        put32(p, (uint32_t)len);
        p += 4;
        for (int32_t i = 0; i < len; i++, p += 4)
            put32(p, (uint32_t)stk[i]);
    }
    *buf_p = buf;
    *len_p = (size_t)(p - buf);
    return TD_OK;
}

td_status_t td_gram_state_deserialize(td_gram_t *g, const uint8_t *buf, size_t len, td_gram_state_t **state_p)
{
    if (len < 20 || get32(buf) != STATE_MAGIC || get32(buf + 4) != 1)
        return td_errorf_quiet(TD_ERR_FORMAT, "grammar state: %zu bytes without the TDGS version 1 header", len);
    uint64_t h = (uint64_t)get32(buf + 8) | (uint64_t)get32(buf + 12) << 32;
    if (h != g->hash)
        return td_errorf_quiet(TD_ERR_MISMATCH, "grammar state: made for grammar %016llx, not this one (%016llx)",
                               (unsigned long long)h, (unsigned long long)g->hash);
    uint32_t n = get32(buf + 16);
    if (n > TD_GRAM_MAX_STACKS)
        return td_errorf_quiet(TD_ERR_FORMAT, "grammar state: %u stacks, at most %d", n, TD_GRAM_MAX_STACKS);
    td_gram_state_t *s = calloc(1, sizeof *s);
    int32_t *stk = malloc((TD_GRAM_MAX_STACK + 1) * sizeof *stk);
    td_status_t st = TD_OK;
    if (!s || !stk) {
        free(s);
        free(stk);
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
    }
    s->g = td_gram_ref(g);
    const uint8_t *p = buf + 20, *end = buf + len;
    for (uint32_t k = 0; k < n && st == TD_OK; k++) {
        if (end - p < 4) {
            st = td_errorf_quiet(TD_ERR_FORMAT, "grammar state: truncated in stack %u", k);
            break;
        }
        uint32_t sl = get32(p);
        p += 4;
        if (sl > TD_GRAM_MAX_STACK || (size_t)(end - p) < (size_t)sl * 4) {
            st = td_errorf_quiet(TD_ERR_FORMAT, "grammar state: stack %u of %u entries is truncated or too deep", k, sl);
            break;
        }
        for (uint32_t i = 0; i < sl; i++, p += 4) {
            uint32_t pos = get32(p);
            bool ok = pos < (uint32_t)g->n_elems &&
                      (i + 1 < sl ? g->elems[pos].kind != TD_GRAM_E_END : g->elems[pos].kind == TD_GRAM_E_BYTES);
            if (!ok) {
                st = td_errorf_quiet(TD_ERR_FORMAT, "grammar state: stack %u entry %u (%u) is not a position "
                                     "of this grammar", k, i, pos);
                break;
            }
            stk[i] = (int32_t)pos;
        }
        if (st == TD_OK)
            sset_add(&s->set, stk, (int32_t)sl);
    }
    if (st == TD_OK && p != end)
        st = td_errorf_quiet(TD_ERR_FORMAT, "grammar state: %zu bytes after the last stack", (size_t)(end - p));
    if (st == TD_OK && s->set.oom)
        st = td_errorf_quiet(TD_ERR_NOMEM, "grammar: out of memory");
    free(stk);
    if (st != TD_OK) {
        td_gram_state_destroy(s);
        return st;
    }
    *state_p = s;
    return TD_OK;
}
