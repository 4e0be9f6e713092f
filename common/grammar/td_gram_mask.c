/*
 * td_gram_mask: vocabularies, token masks and the grammar cache (contract in td_gram.h).
 *
 * The vocabulary's text tokens are sorted by their bytes, with lcp[i] the length of the
 * prefix token i shares with token i-1: walking them in order while keeping the matcher's
 * stack set after each byte of the current token (lvl[d] after d bytes) walks the token
 * trie without building it. A token reuses lvl[0..lcp] of the one before, and when a byte
 * kills every stack the whole subtree under that prefix (the following tokens with
 * lcp >= depth) is decided at once.
 *
 * Per stack suffix (the top TD_GRAM_SUFFIX entries of a stack: the byte-set position and
 * the rules it returns into) the first mask that meets it walks the vocabulary once from
 * the suffix alone: a token whose bytes are consumed without emptying it, or that ends
 * exactly where it empties, is accepted whatever lies below; one that dies before it
 * empties is rejected whatever lies below; one that needs to read past the suffix is
 * uncertain. At run time each stack of the state contributes its suffix's accepted bitset
 * (an OR of words) and a walk of only the uncertain tokens from the full stack. A suffix
 * rather than the top position alone (xgrammar keys its cache by position) because one
 * character class in a string (char ::= [^"\\] | ...) ends after one character: keyed by
 * the position, every longer token would be uncertain; with the string's rule and its
 * caller in the key only tokens that run past the string's closing quote are.
 */
#include "td_gram_int.h"

#include <stdlib.h>
#include <string.h>

#include "td_hash.h"
#include "td_util.h"

struct td_gram_vocab {
    int32_t n;
    char *bytes;        /* every token's bytes, back to back */
    size_t *off;        /* [n] */
    uint32_t *len;      /* [n] */
    uint8_t *kind;      /* [n] td_gram_tok_t */
    int32_t *sorted;    /* [n_sorted] text tokens with bytes, in byte order */
    uint32_t *lcp;      /* [n_sorted] prefix shared with the one before (0 for the first) */
    char *sbytes;       /* the sorted tokens' bytes back to back in sorted order, so that a
                           walk reads memory in order */
    size_t *soff;       /* [n_sorted] where sorted token i's bytes start in sbytes */
    uint32_t *slen;     /* [n_sorted] */
    int32_t *jump;      /* [n_sorted] the first j > i with lcp[j] < lcp[i] (n_sorted if none): the
                           tokens between share token i's first lcp[i] bytes, so a walk that
                           finds a prefix dead skips them in one step */
    int32_t n_sorted;
    int32_t *eos;       /* [n_eos] */
    int32_t n_eos;
    uint32_t max_len;
};

static int cmp_tok(const void *a, const void *b, void *ctx)
{
    const td_gram_vocab_t *v = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = v->len[x], ly = v->len[y], l = lx < ly ? lx : ly;
    int c = memcmp(v->bytes + v->off[x], v->bytes + v->off[y], l);
    if (c)
        return c;
    if (lx != ly)
        return lx < ly ? -1 : 1;
    return (x > y) - (x < y);
}

static uint32_t lcp_of(const td_gram_vocab_t *v, int32_t x, int32_t y)
{
    const uint8_t *a = (const uint8_t *)v->bytes + v->off[x], *b = (const uint8_t *)v->bytes + v->off[y];
    uint32_t l = v->len[x] < v->len[y] ? v->len[x] : v->len[y], i = 0;
    while (i < l && a[i] == b[i])
        i++;
    return i;
}

td_status_t td_gram_vocab_create(int32_t n, const char *const *bytes, const size_t *lens, const uint8_t *kinds,
                                 td_gram_vocab_t **vocab_p)
{
    if (n <= 0)
        return td_errorf_quiet(TD_ERR_INVALID, "grammar vocabulary: %d tokens", n);
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        if (kinds[i] > TD_GRAM_TOK_EOS)
            return td_errorf_quiet(TD_ERR_INVALID, "grammar vocabulary: token %d has kind %u", i, kinds[i]);
        if (lens[i] > UINT32_MAX / 2)
            return td_errorf_quiet(TD_ERR_INVALID, "grammar vocabulary: token %d is %zu bytes", i, lens[i]);
        total += lens[i];
    }
    td_gram_vocab_t *v = calloc(1, sizeof *v);
    if (!v)
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar vocabulary: out of memory");
    v->n = n;
    v->bytes = malloc(total ? total : 1);
    v->off = malloc((size_t)n * sizeof *v->off);
    v->len = malloc((size_t)n * sizeof *v->len);
    v->kind = malloc((size_t)n);
    v->sorted = malloc((size_t)n * sizeof *v->sorted);
    v->lcp = malloc((size_t)n * sizeof *v->lcp);
    v->eos = malloc((size_t)n * sizeof *v->eos);
    if (!v->bytes || !v->off || !v->len || !v->kind || !v->sorted || !v->lcp || !v->eos) {
        td_gram_vocab_destroy(v);
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar vocabulary: out of memory for %d tokens", n);
    }
    size_t o = 0;
    for (int32_t i = 0; i < n; i++) {
        v->off[i] = o;
        v->len[i] = (uint32_t)lens[i];
        v->kind[i] = kinds[i];
        if (lens[i])
            memcpy(v->bytes + o, bytes[i], lens[i]);
        o += lens[i];
        if (kinds[i] == TD_GRAM_TOK_TEXT && lens[i] > 0)
            v->sorted[v->n_sorted++] = i;
        if (kinds[i] == TD_GRAM_TOK_EOS)
            v->eos[v->n_eos++] = i;
        if (lens[i] > v->max_len)
            v->max_len = (uint32_t)lens[i];
    }
    qsort_r(v->sorted, (size_t)v->n_sorted, sizeof *v->sorted, cmp_tok, v);
    v->sbytes = malloc(total ? total : 1);
    v->soff = malloc(((size_t)v->n_sorted + 1) * sizeof *v->soff);
    v->slen = malloc(((size_t)v->n_sorted + 1) * sizeof *v->slen);
    v->jump = malloc(((size_t)v->n_sorted + 1) * sizeof *v->jump);
    if (!v->sbytes || !v->soff || !v->slen || !v->jump) {
        td_gram_vocab_destroy(v);
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar vocabulary: out of memory for %d tokens", n);
    }
    o = 0;
    for (int32_t i = 0; i < v->n_sorted; i++) {
        int32_t t = v->sorted[i];
        v->lcp[i] = i ? lcp_of(v, v->sorted[i - 1], t) : 0;
        v->soff[i] = o;
        v->slen[i] = v->len[t];
        memcpy(v->sbytes + o, v->bytes + v->off[t], v->len[t]);
        o += v->len[t];
    }
    /* next smaller lcp: right to left, with a stack of the candidates */
    int32_t *stk = malloc(((size_t)v->n_sorted + 1) * sizeof *stk), n_stk = 0;
    if (!stk) {
        td_gram_vocab_destroy(v);
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar vocabulary: out of memory for %d tokens", n);
    }
    for (int32_t i = v->n_sorted - 1; i >= 0; i--) {
        while (n_stk > 0 && v->lcp[stk[n_stk - 1]] >= v->lcp[i])
            n_stk--;
        v->jump[i] = n_stk > 0 ? stk[n_stk - 1] : v->n_sorted;
        stk[n_stk++] = i;
    }
    free(stk);
    *vocab_p = v;
    return TD_OK;
}

void td_gram_vocab_destroy(td_gram_vocab_t *v)
{
    if (!v)
        return;
    free(v->bytes);
    free(v->off);
    free(v->len);
    free(v->kind);
    free(v->sorted);
    free(v->lcp);
    free(v->sbytes);
    free(v->soff);
    free(v->slen);
    free(v->jump);
    free(v->eos);
    free(v);
}

int32_t td_gram_vocab_size(const td_gram_vocab_t *v)
{
    return v->n;
}

td_gram_tok_t td_gram_vocab_kind(const td_gram_vocab_t *v, int32_t id)
{
    return id >= 0 && id < v->n ? (td_gram_tok_t)v->kind[id] : TD_GRAM_TOK_SPECIAL;
}

/* ---- the matcher ------------------------------------------------------------------------ */

/* The split of the vocabulary for one stack suffix (the top entries of a stack). */
typedef struct pos_cache {
    int32_t key[TD_GRAM_SUFFIX];  /* the suffix, bottom first */
    int32_t key_len;
    uint32_t *acc;  /* [words] accepted whatever lies below the suffix, or NULL: then */
    int32_t *acc_ids; /* [n_acc] those token ids, when fewer than a mask has words (a literal,
                         an enum: the common case is a handful of tokens, which a mask sets
                         one by one instead of OR-ing every word of a bitset) */
    int32_t n_acc;
    int32_t *unc;   /* [n_unc] uncertain: indices into sorted, ascending */
    int32_t n_unc;
    uint64_t or_fill; /* the fill (td_gram_matcher_t.fills) that last OR-ed acc into its mask */
} pos_cache_t;

struct td_gram_matcher {
    atomic_int refs;
    td_gram_t *g;
    const td_gram_vocab_t *v;
    size_t words;
    pthread_mutex_t mu;     /* guards everything below */
    pos_cache_t *pc;        /* [n_pc] the suffixes met so far */
    int32_t n_pc, pc_cap;
    td_hash_t pc_index;     /* fnv(suffix) -> index in pc */
    size_t pc_bytes;        /* what pc holds: bounded by TD_GRAM_CACHE_BYTES */
    int32_t *lvl;           /* [v->max_len + 1] the walk's stack sets, as interned ids */
    /* stack sets interned (equal contents, one id) and the transitions between them, so a
     * step met before is one table lookup: a lazy DFA over stack sets */
    td_gram_sset_t *isets;  /* [n_isets] */
    int32_t n_isets, isets_cap;
    td_hash_t iset_index;   /* content hash -> id */
    td_hash_t trans;        /* (id << 8 | byte) -> id of the set after the byte, for sets without a row */
    uint8_t *iflag;         /* [isets_cap] ISET_LIVE | ISET_ENDS of each set: what a walk reads per byte */
    int32_t *irow;          /* [isets_cap] the set's row of dense, or -1 */
    int32_t *dense;         /* [rows_cap][256] the set after each byte, -1 not met yet: the first
                               DENSE_ROWS sets' transitions are an index, not a hash lookup */
    int32_t n_rows, rows_cap;
    td_gram_sset_t scratch;
    bool *ended;            /* [v->max_len + 1] a stack emptied before this depth */
    td_gram_sset_t start;   /* a walk's starting set */
    int32_t *unc;           /* growable scratch of a suffix's uncertain tokens */
    int32_t n_unc, unc_cap;
    uint64_t fills;         /* td_gram_fill_mask calls so far */
};

td_status_t td_gram_matcher_create(td_gram_t *g, const td_gram_vocab_t *v, td_gram_matcher_t **m_p)
{
    td_gram_matcher_t *m = calloc(1, sizeof *m);
    if (!m)
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
    atomic_init(&m->refs, 1);
    m->g = td_gram_ref(g);
    m->v = v;
    m->words = td_gram_mask_words(v->n);
    pthread_mutex_init(&m->mu, NULL);
    m->lvl = calloc((size_t)v->max_len + 1, sizeof *m->lvl);
    m->ended = calloc((size_t)v->max_len + 1, sizeof *m->ended);
    if (!m->lvl || !m->ended || td_hash_init(&m->pc_index, 64) != TD_OK ||
        td_hash_init(&m->iset_index, 1024) != TD_OK || td_hash_init(&m->trans, 4096) != TD_OK) {
        td_gram_matcher_destroy(m);
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
    }
    *m_p = m;
    return TD_OK;
}

void td_gram_matcher_destroy(td_gram_matcher_t *m)
{
    if (!m || atomic_fetch_sub(&m->refs, 1) != 1)
        return;
    for (int32_t i = 0; i < m->n_pc; i++) {
        free(m->pc[i].acc);
        free(m->pc[i].acc_ids);
        free(m->pc[i].unc);
    }
    free(m->pc);
    td_hash_free(&m->pc_index);
    free(m->lvl);
    for (int32_t i = 0; i < m->n_isets; i++)
        td_gram_sset_free(&m->isets[i]);
    free(m->isets);
    td_hash_free(&m->iset_index);
    td_hash_free(&m->trans);
    free(m->iflag);
    free(m->irow);
    free(m->dense);
    td_gram_sset_free(&m->scratch);
    free(m->ended);
    td_gram_sset_free(&m->start);
    free(m->unc);
    pthread_mutex_destroy(&m->mu);
    td_gram_unref(m->g);
    free(m);
}

td_gram_t *td_gram_matcher_grammar(const td_gram_matcher_t *m)
{
    return m->g;
}

static bool unc_push(td_gram_matcher_t *m, int32_t idx)
{
    if (m->n_unc == m->unc_cap) {
        int32_t cap = m->unc_cap ? m->unc_cap * 2 : 256;
        int32_t *n = realloc(m->unc, (size_t)cap * sizeof *n);
        if (!n)
            return false;
        m->unc = n;
        m->unc_cap = cap;
    }
    m->unc[m->n_unc++] = idx;
    return true;
}

#define INTERN_MAX_SETS 200000 /* past this many sets a walk starts the table afresh */

/* Forgets every interned set and transition. */
static void intern_reset(td_gram_matcher_t *m)
{
    for (int32_t i = 0; i < m->n_isets; i++)
        td_gram_sset_free(&m->isets[i]);
    m->n_isets = 0;
    m->n_rows = 0;
    td_hash_free(&m->iset_index);
    td_hash_free(&m->trans);
}

#define ISET_LIVE 1u /* the set holds a stack: the walk goes on */
#define ISET_ENDS 2u /* one of its stacks is empty: the grammar (or a suffix) may end here */
#define DENSE_ROWS 8192 /* sets whose transitions are a 256-entry row (8 MiB at most) */

/* The id of a set equal to s, interning a copy when new. */
static td_status_t intern(td_gram_matcher_t *m, const td_gram_sset_t *s, int32_t *id_p)
{
    uint64_t h = td_fnv1a64(TD_FNV1A64_INIT, s->buf, s->len * sizeof *s->buf) ^ (uint64_t)s->has_empty;
    if (!m->iset_index.slots && (td_hash_init(&m->iset_index, 1024) != TD_OK || td_hash_init(&m->trans, 4096) != TD_OK))
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
    for (td_hash_slot_t *x = td_hash_find(&m->iset_index, h); x; x = td_hash_find_next(&m->iset_index, x)) {
        const td_gram_sset_t *o = &m->isets[x->value];
        if (o->len == s->len && o->has_empty == s->has_empty &&
            (s->len == 0 || !memcmp(o->buf, s->buf, s->len * sizeof *s->buf))) { /* the empty set's buf is NULL */
            *id_p = (int32_t)x->value;
            return TD_OK;
        }
    }
    if (m->n_isets == m->isets_cap) {
        int32_t cap = m->isets_cap ? m->isets_cap * 2 : 256;
        td_gram_sset_t *n = realloc(m->isets, (size_t)cap * sizeof *n);
        if (n)
            m->isets = n;
        uint8_t *f = n ? realloc(m->iflag, (size_t)cap) : NULL;
        if (f)
            m->iflag = f;
        int32_t *r = f ? realloc(m->irow, (size_t)cap * sizeof *r) : NULL;
        if (!r)
            return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
        m->irow = r;
        m->isets_cap = cap;
    }
    int32_t row = -1;
    if (m->n_rows < DENSE_ROWS) {
        if (m->n_rows == m->rows_cap) {
            int32_t cap = m->rows_cap ? m->rows_cap * 2 : 64;
            int32_t *d = realloc(m->dense, (size_t)cap * 256 * sizeof *d);
            if (!d)
                return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
            m->dense = d;
            m->rows_cap = cap;
        }
        row = m->n_rows;
        memset(m->dense + (size_t)row * 256, 0xff, 256 * sizeof *m->dense);
    }
    td_gram_sset_t *c = &m->isets[m->n_isets];
    *c = (td_gram_sset_t){0};
    td_status_t st = td_gram_sset_copy(c, s);
    if (st == TD_OK && td_hash_put(&m->iset_index, h, (uint64_t)m->n_isets) != TD_OK)
        st = td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
    if (st != TD_OK) {
        td_gram_sset_free(c);
        return st;
    }
    m->iflag[m->n_isets] = (uint8_t)((s->n > 0 ? ISET_LIVE : 0) | (s->has_empty ? ISET_ENDS : 0));
    m->irow[m->n_isets] = row;
    m->n_rows += row >= 0;
    *id_p = m->n_isets++;
    return TD_OK;
}

/* The id of the set after byte b from set `from`. */
static td_status_t istep(td_gram_matcher_t *m, int32_t from, uint8_t b, int32_t *to_p)
{
    int32_t row = m->irow[from];
    uint64_t key = ((uint64_t)from << 8) | b;
    if (row >= 0) {
        int32_t to = m->dense[(size_t)row * 256 + b];
        if (to >= 0) {
            *to_p = to;
            return TD_OK;
        }
    } else {
        td_hash_slot_t *x = td_hash_find(&m->trans, key);
        if (x) {
            *to_p = (int32_t)x->value;
            return TD_OK;
        }
    }
    td_status_t st = td_gram_sset_step(m->g, &m->isets[from], b, &m->scratch);
    if (st == TD_OK)
        st = intern(m, &m->scratch, to_p);
    if (st == TD_OK && row >= 0)
        m->dense[(size_t)row * 256 + b] = *to_p; /* after intern: it may have moved dense */
    else if (st == TD_OK && td_hash_put(&m->trans, key, (uint64_t)*to_p) != TD_OK)
        st = td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
    return st;
}

/*
 * Walks the sorted tokens list[0..n) (indices into v->sorted; NULL: all of them) from the
 * stack set m->start. Accepted tokens set their bit in acc. local: the start is a stack
 * suffix alone, and tokens that need to read past it (a stack emptied with bytes left) go
 * to m->unc instead of being rejected.
 */
static td_status_t walk(td_gram_matcher_t *m, const int32_t *list, int32_t n, bool local, uint32_t *acc)
{
    const td_gram_vocab_t *v = m->v;
    if (m->n_isets > INTERN_MAX_SETS)
        intern_reset(m);
    td_status_t st = intern(m, &m->start, &m->lvl[0]);
    if (st != TD_OK)
        return st;
    m->ended[0] = false;
    uint32_t valid = 0;
    for (int32_t i = 0; i < n;) {
        int32_t idx = list ? list[i] : i;
        int32_t t = v->sorted[idx];
        const uint8_t *b = (const uint8_t *)v->sbytes + v->soff[idx];
        uint32_t len = v->slen[idx];
        uint32_t l = i == 0 ? 0 : list ? lcp_of(v, v->sorted[list[i - 1]], t) : v->lcp[idx];
        uint32_t d = l < valid ? l : valid;
        while (d < len) {
            if ((st = istep(m, m->lvl[d], b[d], &m->lvl[d + 1])) != TD_OK)
                return st;
            m->ended[d + 1] = m->ended[d] || (m->iflag[m->lvl[d]] & ISET_ENDS);
            d++;
            if (!(m->iflag[m->lvl[d]] & ISET_LIVE))
                break;
        }
        valid = d;
        if (m->iflag[m->lvl[d]] & ISET_LIVE) { /* d == len: every byte consumed */
            acc[t >> 5] |= 1u << (t & 31);
            i++;
            continue;
        }
        /* dead after d bytes: so is every following token sharing those d bytes */
        bool uncertain = local && m->ended[d];
        if (!uncertain && !list) { /* rejected, all of them: skip the subtree by jumps */
            int32_t j = i + 1;
            while (j < n && v->lcp[j] >= d)
                j = v->jump[j];
            i = j;
            continue;
        }
        for (;;) {
            if (uncertain && !unc_push(m, idx))
                return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
            i++;
            if (i >= n)
                break;
            int32_t nidx = list ? list[i] : i;
            uint32_t nl = list ? lcp_of(v, v->sorted[idx], v->sorted[nidx]) : v->lcp[nidx];
            if (nl < d)
                break;
            idx = nidx;
        }
    }
    return TD_OK;
}

/* The split for the top min(len, TD_GRAM_SUFFIX) entries of stk[0..len), computed on first
 * use. NULL in *pc_p (and TD_OK) when the cache is full: the caller walks every token. */
static td_status_t position(td_gram_matcher_t *m, const int32_t *stk, int32_t len, pos_cache_t **pc_p)
{
    int32_t kl = len < TD_GRAM_SUFFIX ? len : TD_GRAM_SUFFIX;
    const int32_t *key = stk + len - kl;
    uint64_t h = td_fnv1a64(TD_FNV1A64_INIT, key, (size_t)kl * sizeof *key);
    for (td_hash_slot_t *x = td_hash_find(&m->pc_index, h); x; x = td_hash_find_next(&m->pc_index, x)) {
        pos_cache_t *pc = &m->pc[x->value];
        if (pc->key_len == kl && !memcmp(pc->key, key, (size_t)kl * sizeof *key)) {
            *pc_p = pc;
            return TD_OK;
        }
    }
    *pc_p = NULL;
    if (m->pc_bytes + m->words * sizeof(uint32_t) > TD_GRAM_CACHE_BYTES)
        return TD_OK;
    if (m->n_pc == m->pc_cap) {
        int32_t cap = m->pc_cap ? m->pc_cap * 2 : 64;
        pos_cache_t *n = realloc(m->pc, (size_t)cap * sizeof *n);
        if (!n)
            return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
        m->pc = n;
        m->pc_cap = cap;
    }
    pos_cache_t *pc = &m->pc[m->n_pc];
    *pc = (pos_cache_t){.key_len = kl};
    memcpy(pc->key, key, (size_t)kl * sizeof *key);
    td_status_t st;
    pc->acc = calloc(m->words, sizeof *pc->acc);
    if (!pc->acc)
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
    m->n_unc = 0;
    td_gram_sset_clear(&m->start);
    if ((st = td_gram_sset_add(&m->start, key, kl)) != TD_OK ||
        (st = walk(m, NULL, m->v->n_sorted, true, pc->acc)) != TD_OK) {
        free(pc->acc);
        return st;
    }
    if (m->n_unc > 0) {
        pc->unc = malloc((size_t)m->n_unc * sizeof *pc->unc);
        if (!pc->unc) {
            free(pc->acc);
            return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
        }
        memcpy(pc->unc, m->unc, (size_t)m->n_unc * sizeof *pc->unc);
        pc->n_unc = m->n_unc;
    }
    int32_t n_acc = 0;
    for (size_t w = 0; w < m->words; w++)
        n_acc += __builtin_popcount(pc->acc[w]);
    if ((size_t)n_acc < m->words / 4 && (pc->acc_ids = malloc(((size_t)n_acc + 1) * sizeof *pc->acc_ids))) {
        for (size_t w = 0; w < m->words; w++)
            for (uint32_t b = pc->acc[w]; b; b &= b - 1)
                pc->acc_ids[pc->n_acc++] = (int32_t)(w * 32 + (size_t)__builtin_ctz(b));
        free(pc->acc);
        pc->acc = NULL;
    } /* else (a failed malloc too) the bitset stays */
    if (td_hash_put(&m->pc_index, h, (uint64_t)m->n_pc) != TD_OK) {
        free(pc->acc);
        free(pc->acc_ids);
        free(pc->unc);
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar matcher: out of memory");
    }
    m->n_pc++;
    m->pc_bytes += (pc->acc ? m->words * sizeof(uint32_t) : (size_t)pc->n_acc * sizeof(int32_t)) +
                   (size_t)pc->n_unc * sizeof(int32_t) + sizeof *pc;
    *pc_p = pc;
    return TD_OK;
}

/* dst[0..words) |= src[0..words), 32 bytes a step: a Qwen3-sized mask is 4,748 words, and
 * the scalar loop GCC made of the plain one (mask and m may alias, so it re-read the count
 * each word) was most of a warm fill with several stacks */
static void or_words(uint32_t *restrict dst, const uint32_t *restrict src, size_t words)
{
    typedef uint32_t v8u32 __attribute__((vector_size(32)));
    size_t w = 0;
    for (; w + 8 <= words; w += 8) {
        v8u32 a, b;
        memcpy(&a, dst + w, sizeof a);
        memcpy(&b, src + w, sizeof b);
        a |= b;
        memcpy(dst + w, &a, sizeof a);
    }
    for (; w < words; w++)
        dst[w] |= src[w];
}

td_status_t td_gram_fill_mask(td_gram_matcher_t *m, const td_gram_state_t *s, uint32_t *mask)
{
    if (s->g != m->g)
        return td_errorf_quiet(TD_ERR_INVALID, "grammar mask: the state belongs to another grammar");
    td_status_t st = TD_OK;
    memset(mask, 0, m->words * sizeof *mask);
    pthread_mutex_lock(&m->mu);
    const uint64_t fill = ++m->fills;
    for (int32_t k = 0; k < s->set.n && st == TD_OK; k++) {
        int32_t len;
        const int32_t *stk = td_gram_sset_stack(&s->set, k, &len);
        if (len == 0)
            continue;
        pos_cache_t *pc = NULL;
        if ((st = position(m, stk, len, &pc)) != TD_OK)
            break;
        if ((st = td_gram_sset_one(&s->set, k, &m->start)) != TD_OK)
            break;
        if (!pc) { /* the cache is full: every token from the full stack */
            st = walk(m, NULL, m->v->n_sorted, false, mask);
            continue;
        }
        if (pc->acc) { /* stacks that share a suffix share its accepted set: OR-ed once */
            if (pc->or_fill != fill)
                or_words(mask, pc->acc, m->words);
            pc->or_fill = fill;
        } else
            for (int32_t i = 0; i < pc->n_acc; i++)
                mask[pc->acc_ids[i] >> 5] |= 1u << (pc->acc_ids[i] & 31);
        if (pc->n_unc > 0)
            st = walk(m, pc->unc, pc->n_unc, false, mask);
    }
    pthread_mutex_unlock(&m->mu);
    if (st == TD_OK && s->set.has_empty)
        for (int32_t i = 0; i < m->v->n_eos; i++)
            mask[m->v->eos[i] >> 5] |= 1u << (m->v->eos[i] & 31);
    return st;
}

td_status_t td_gram_accept_token(td_gram_matcher_t *m, td_gram_state_t *s, int32_t id)
{
    const td_gram_vocab_t *v = m->v;
    if (id < 0 || id >= v->n || s->g != m->g)
        return TD_ERR_INVALID;
    switch (v->kind[id]) {
    case TD_GRAM_TOK_EOS: return td_gram_can_end(s) ? TD_OK : TD_ERR_INVALID;
    case TD_GRAM_TOK_SPECIAL: return TD_ERR_INVALID;
    default:
        if (v->len[id] == 0)
            return TD_ERR_INVALID;
        return td_gram_accept_bytes(s, v->bytes + v->off[id], v->len[id]);
    }
}

/* ---- cache ------------------------------------------------------------------------------ */

typedef struct cache_entry {
    uint64_t hash;
    td_gram_kind_t kind;
    char *src;
    size_t len;
    td_gram_matcher_t *m;
    uint64_t used;
} cache_entry_t;

struct td_gram_cache {
    const td_gram_vocab_t *v;
    pthread_mutex_t mu;
    cache_entry_t *e;
    int32_t n, cap;
    uint64_t tick, hits, misses;
};

td_status_t td_gram_cache_create(const td_gram_vocab_t *v, int32_t cap, td_gram_cache_t **c_p)
{
    if (cap < 1)
        return td_errorf_quiet(TD_ERR_INVALID, "grammar cache: capacity %d, at least 1", cap);
    td_gram_cache_t *c = calloc(1, sizeof *c);
    if (!c || !(c->e = calloc((size_t)cap, sizeof *c->e))) {
        free(c);
        return td_errorf_quiet(TD_ERR_NOMEM, "grammar cache: out of memory");
    }
    c->v = v;
    c->cap = cap;
    pthread_mutex_init(&c->mu, NULL);
    *c_p = c;
    return TD_OK;
}

void td_gram_cache_destroy(td_gram_cache_t *c)
{
    if (!c)
        return;
    for (int32_t i = 0; i < c->n; i++) {
        free(c->e[i].src);
        td_gram_matcher_destroy(c->e[i].m);
    }
    free(c->e);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

td_status_t td_gram_cache_get(td_gram_cache_t *c, td_gram_kind_t kind, const char *src, size_t len,
                              td_gram_matcher_t **m_p)
{
    uint32_t k = (uint32_t)kind;
    if (kind == TD_GRAM_JSON_OBJECT)
        len = 0;
    uint64_t h = td_fnv1a64(td_fnv1a64(TD_FNV1A64_INIT, &k, sizeof k), src, len);
    td_status_t st = TD_OK;
    pthread_mutex_lock(&c->mu);
    c->tick++;
    for (int32_t i = 0; i < c->n; i++) {
        cache_entry_t *e = &c->e[i];
        if (e->hash == h && e->kind == kind && e->len == len && (len == 0 || !memcmp(e->src, src, len))) {
            e->used = c->tick;
            c->hits++;
            atomic_fetch_add(&e->m->refs, 1);
            *m_p = e->m;
            goto out;
        }
    }
    c->misses++;
    td_gram_t *g;
    if ((st = td_gram_compile(kind, src, len, &g)) != TD_OK)
        goto out;
    td_gram_matcher_t *m;
    st = td_gram_matcher_create(g, c->v, &m);
    td_gram_unref(g);
    if (st != TD_OK)
        goto out;
    char *copy = malloc(len ? len : 1);
    if (!copy) {
        td_gram_matcher_destroy(m);
        st = td_errorf_quiet(TD_ERR_NOMEM, "grammar cache: out of memory");
        goto out;
    }
    if (len)
        memcpy(copy, src, len);
    int32_t slot = c->n;
    if (c->n == c->cap) { /* evict the least recently used */
        slot = 0;
        for (int32_t i = 1; i < c->n; i++)
            if (c->e[i].used < c->e[slot].used)
                slot = i;
        free(c->e[slot].src);
        td_gram_matcher_destroy(c->e[slot].m);
    } else {
        c->n++;
    }
    c->e[slot] = (cache_entry_t){.hash = h, .kind = kind, .src = copy, .len = len, .m = m, .used = c->tick};
    atomic_fetch_add(&m->refs, 1);
    *m_p = m;
out:
    pthread_mutex_unlock(&c->mu);
    return st;
}

void td_gram_cache_release(td_gram_cache_t *c, td_gram_matcher_t *m)
{
    (void)c;
    td_gram_matcher_destroy(m);
}

void td_gram_cache_stats(const td_gram_cache_t *c, uint64_t *hits_p, uint64_t *misses_p)
{
    pthread_mutex_t *mu = (pthread_mutex_t *)&c->mu;
    pthread_mutex_lock(mu);
    *hits_p = c->hits;
    *misses_p = c->misses;
    pthread_mutex_unlock(mu);
}
