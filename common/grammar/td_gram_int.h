/*
 * td_gram_int: the inside of module td_gram, shared by its files (td_gram.c: the form, the
 * GBNF parser, the checks, the matcher state; td_gram_json.c: JSON Schema, json_object,
 * choice and regex to GBNF text; td_gram_mask.c: vocabularies, token masks, the cache).
 * Not for use outside the module.
 */
#ifndef TD_GRAM_INT_H
#define TD_GRAM_INT_H

#include <pthread.h>
#include <stdatomic.h>

#include "td_gram.h"

/* ---- a growable string (the text translators write GBNF into it) -------------------- */

typedef struct td_gram_str {
    char *s;
    size_t len, cap;
    bool oom; /* an append failed: the text is incomplete */
} td_gram_str_t;

void td_gram_str_free(td_gram_str_t *b);
void td_gram_str_add(td_gram_str_t *b, const char *s, size_t n);
void td_gram_str_puts(td_gram_str_t *b, const char *s);
void td_gram_str_printf(td_gram_str_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Appends s[0..n) as a GBNF string literal, quotes included (every byte outside printable
 * ASCII, and " \ , escaped as \xNN). */
void td_gram_str_literal(td_gram_str_t *b, const char *s, size_t n);

/* ---- translators to GBNF (td_gram_json.c) -------------------------------------------- */

/* Each writes a GBNF grammar for its input into out (rule root first). Errors as
 * td_gram_compile's, the message set (td_errorf_quiet). */
td_status_t td_gram_regex_to_gbnf(const char *re, size_t len, td_gram_str_t *out);
td_status_t td_gram_choice_to_gbnf(const char *src, size_t len, td_gram_str_t *out);
td_status_t td_gram_json_object_gbnf(td_gram_str_t *out);
td_status_t td_gram_schema_to_gbnf(const char *src, size_t len, td_gram_str_t *out);
/* The rules for a regex as rule `name` (other rules it needs are named name-N), appended
 * to out; used by the schema translator for "pattern". */
td_status_t td_gram_regex_rules(const char *re, size_t len, const char *name, td_gram_str_t *out);

/* ---- the compiled form --------------------------------------------------------------- */

typedef enum td_gram_elem_kind {
    TD_GRAM_E_END = 0, /* end of an alternative: return to the rule below on the stack */
    TD_GRAM_E_BYTES,   /* one byte of the set sets[arg] */
    TD_GRAM_E_RULE,    /* the rule arg */
} td_gram_elem_kind_t;

typedef struct td_gram_elem {
    uint32_t kind : 2;
    uint32_t arg : 30;
} td_gram_elem_t;

struct td_gram {
    atomic_int refs;
    td_gram_kind_t kind;
    uint64_t hash;
    char *source;              /* GBNF text, NUL-terminated */

    td_gram_elem_t *elems;     /* [n_elems] every alternative of every rule, each ending in END */
    int32_t n_elems;
    uint64_t (*sets)[4];       /* [n_sets] 256-bit byte sets */
    int32_t n_sets;
    int32_t *alt_start;        /* [n_alts] position of each alternative's first element */
    int32_t *rule_alt;         /* [n_rules + 1] alternatives of rule r: alt_start[rule_alt[r] .. rule_alt[r+1]) */
    int32_t n_rules;
    int32_t root;              /* the start rule */
};

static inline bool td_gram_set_has(const td_gram_t *g, int32_t set, uint8_t b)
{
    return (g->sets[set][b >> 6] >> (b & 63)) & 1;
}

/* A matcher caches the vocabulary's split per stack suffix of this many entries, in at
 * most this many bytes (then masks of new suffixes are walked whole, uncached). */
#define TD_GRAM_SUFFIX 6
#define TD_GRAM_CACHE_BYTES ((size_t)512 << 20)

/* ---- stack sets: the matcher state's inside ------------------------------------------- */

/* A set of distinct stacks: stack k is buf[off[k]] = its length L, then L positions,
 * bottom first. */
typedef struct td_gram_sset {
    int32_t *buf;
    size_t len, cap;
    int32_t *off;      /* [n] */
    uint64_t *hash;    /* [n] FNV-1a of each stack, to find duplicates */
    int32_t n, n_cap;
    bool has_empty;    /* one stack is empty: the grammar may end */
    bool oom;
} td_gram_sset_t;

void td_gram_sset_free(td_gram_sset_t *s);
void td_gram_sset_clear(td_gram_sset_t *s);
/* dst = src (dst's memory reused). Errors: TD_ERR_NOMEM. */
td_status_t td_gram_sset_copy(td_gram_sset_t *dst, const td_gram_sset_t *src);
/* The start: every alternative of the root, expanded. */
td_status_t td_gram_sset_start(const td_gram_t *g, td_gram_sset_t *out);
/* out = the stacks of in after byte b (out cleared first; in and out distinct). Errors:
 * TD_ERR_NOMEM. */
td_status_t td_gram_sset_step(const td_gram_t *g, const td_gram_sset_t *in, uint8_t b, td_gram_sset_t *out);
/* Adds the stack stk[0..n) to s (nothing when an equal one is there). Errors: TD_ERR_NOMEM. */
td_status_t td_gram_sset_add(td_gram_sset_t *s, const int32_t *stk, int32_t n);
/* out = {stack k of in}. */
td_status_t td_gram_sset_one(const td_gram_sset_t *in, int32_t k, td_gram_sset_t *out);
/* out = {[pos]}: the one-entry stack of a byte-set position (a matcher's precompute). */
td_status_t td_gram_sset_single(int32_t pos, td_gram_sset_t *out);

static inline const int32_t *td_gram_sset_stack(const td_gram_sset_t *s, int32_t k, int32_t *len_p)
{
    *len_p = s->buf[s->off[k]];
    return s->buf + s->off[k] + 1;
}

struct td_gram_state {
    td_gram_t *g;
    td_gram_sset_t set;
    td_gram_sset_t tmp; /* scratch for accept_bytes */
};

#endif /* TD_GRAM_INT_H */
