/*
 * td_tokenizer: the public face of module td_tok and the encode/decode pipelines.
 *
 * Encode follows Hugging Face's order: added tokens are cut out of the raw text first
 * (leftmost, longest); each stretch between them is normalized (NFC, Prepend, Replace),
 * pre-tokenized (regex Split, ByteLevel, Metaspace) and each pre-token run through the BPE
 * model (td_tok_bpe.c). tokenizer.bin takes the same road with sentencepiece's pipeline:
 * "▁" read as a space, a dummy prefix space, no pre-tokenizer. Byte-level vocabularies
 * are keyed by raw bytes (td_tok_load.c undoes the ByteLevel alphabet), so the ByteLevel
 * pre-tokenizer's byte-to-character mapping has nothing left to do here.
 *
 * Decode is the streaming detokenizer run over all ids, so the two cannot disagree.
 */
#include "td_tokenizer_int.h"

#include <stdlib.h>
#include <string.h>

#include "td_util.h"

/* ---- accessors ---- */

int32_t td_tokenizer_vocab_size(const td_tokenizer_t *tok)
{
    return tok->n_vocab;
}

int32_t td_tokenizer_bos_id(const td_tokenizer_t *tok)
{
    return tok->bos_id;
}

bool td_tokenizer_add_bos(const td_tokenizer_t *tok)
{
    return tok->add_bos && tok->bos_id >= 0;
}

bool td_tokenizer_add_eos(const td_tokenizer_t *tok)
{
    return tok->add_eos && tok->n_eos;
}

int32_t td_tokenizer_pad_id(const td_tokenizer_t *tok)
{
    return tok->pad_id;
}

size_t td_tokenizer_eos_ids(const td_tokenizer_t *tok, const int32_t **ids_p)
{
    *ids_p = tok->eos_ids;
    return tok->n_eos;
}

bool td_tokenizer_is_eos(const td_tokenizer_t *tok, int32_t id)
{
    for (size_t i = 0; i < tok->n_eos; i++)
        if (tok->eos_ids[i] == id)
            return true;
    return false;
}

bool td_tokenizer_is_special(const td_tokenizer_t *tok, int32_t id)
{
    return id >= 0 && id < tok->n_vocab && (tok->flags[id] & TD_TOK_F_SPECIAL);
}

const char *td_tokenizer_id_to_piece(const td_tokenizer_t *tok, int32_t id, size_t *len_p)
{
    if (id < 0 || id >= tok->n_vocab || (tok->flags[id] & TD_TOK_F_HOLE))
        return NULL;
    if (len_p)
        *len_p = tok->piece_len[id];
    return tok->arena + tok->piece_off[id];
}

const char *td_tokenizer_token_bytes(const td_tokenizer_t *tok, int32_t id, size_t *len_p)
{
    if (id < 0 || id >= tok->n_vocab || (tok->flags[id] & TD_TOK_F_HOLE))
        return NULL;
    *len_p = tok->surf_len[id];
    return tok->arena + tok->surf_off[id];
}

int32_t td_tokenizer_piece_to_id(const td_tokenizer_t *tok, const char *piece, size_t len)
{
    for (size_t i = 0; i < tok->n_added; i++)
        if (tok->added[i].len == len && !memcmp(tok->arena + tok->added[i].off, piece, len))
            return tok->added[i].id;
    if (!tok->byte_level) {
        int32_t id = td_tok_map_get(tok, piece, len);
        if (id >= 0)
            return id;
    }
    /* byte-level keys are not the pieces; lookups by piece are rare (BOS/EOS at load) */
    for (int32_t id = 0; id < tok->n_vocab; id++)
        if (tok->piece_len[id] == len && !(tok->flags[id] & TD_TOK_F_HOLE) &&
            !memcmp(tok->arena + tok->piece_off[id], piece, len))
            return id;
    return -1;
}

/* ---- encode ---- */

typedef struct sbuf {
    char *v;
    size_t n, cap;
} sbuf_t;

static td_status_t sbuf_reserve(sbuf_t *b, size_t extra)
{
    if (b->n + extra <= b->cap)
        return TD_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra)
        cap *= 2;
    char *v = realloc(b->v, cap);
    if (!v)
        return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory for %zu bytes of text", cap);
    b->v = v;
    b->cap = cap;
    return TD_OK;
}

static td_status_t sbuf_add(sbuf_t *b, const char *s, size_t len)
{
    if (len == 0 && b->v)
        return TD_OK;
    td_status_t st = sbuf_reserve(b, len ? len : 1);
    if (st)
        return st;
    if (len)
        memcpy(b->v + b->n, s, len);
    b->n += len;
    return TD_OK;
}

typedef struct span {
    size_t off, len;
    bool first; /* starts at offset 0 of the whole text (Metaspace prepend_scheme "first") */
} span_t;

typedef struct spans {
    span_t *v;
    size_t n, cap;
} spans_t;

static td_status_t spans_add(spans_t *s, size_t off, size_t len, bool first)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        span_t *v = realloc(s->v, cap * sizeof *v);
        if (!v)
            return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory for pre-tokens");
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n++] = (span_t){off, len, first};
    return TD_OK;
}

/* Applies one normalizer step to cur (a heap string), replacing it. */
static td_status_t normalize_step(const td_tok_norm_t *nm, char **cur, size_t *len)
{
    td_status_t st = TD_OK;
    char *out = NULL;
    size_t ol = 0;
    switch (nm->kind) {
    case TD_TOK_NORM_NFC:
        if ((st = td_tok_nfc(*cur, *len, &out, &ol)))
            return st;
        break;
    case TD_TOK_NORM_PREPEND:
        if (*len == 0)
            return TD_OK;
        if (!(out = malloc(nm->a_len + *len + 1)))
            return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory to normalize %zu bytes", *len);
        memcpy(out, nm->a, nm->a_len);
        memcpy(out + nm->a_len, *cur, *len);
        ol = nm->a_len + *len;
        break;
    case TD_TOK_NORM_REPLACE: {
        size_t count = 0;
        for (size_t i = 0; i + nm->a_len <= *len;)
            if (!memcmp(*cur + i, nm->a, nm->a_len))
                count++, i += nm->a_len;
            else
                i++;
        if (!count)
            return TD_OK;
        if (!(out = malloc(*len + count * nm->b_len + 1)))
            return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory to normalize %zu bytes", *len);
        for (size_t i = 0; i < *len;) {
            if (i + nm->a_len <= *len && !memcmp(*cur + i, nm->a, nm->a_len)) {
                memcpy(out + ol, nm->b, nm->b_len);
                ol += nm->b_len;
                i += nm->a_len;
            } else {
                out[ol++] = (*cur)[i++];
            }
        }
        break;
    }
    }
    free(*cur);
    *cur = out;
    *len = ol;
    return st;
}

/* Isolated regex split of buf[sp.off .. +sp.len) into `out` (matches and the gaps between). */
static td_status_t split_regex(const td_tokenizer_t *tok, pcre2_code *re, pcre2_match_data *md, const char *buf,
                               span_t sp, spans_t *out)
{
    td_status_t st;
    const char *s = buf + sp.off;
    size_t len = sp.len, pos = 0, last = 0;
    bool first = sp.first;
    while (pos < len) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, len, pos, 0, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return td_errorf(TD_ERR_INTERNAL, "%s: pre-tokenizer regex failed: %s", tok->path, (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me <= ms) {
            pos = ms + 1;
            while (pos < len && ((uint8_t)s[pos] & 0xC0) == 0x80)
                pos++;
            continue;
        }
        if (ms > last) {
            if ((st = spans_add(out, sp.off + last, ms - last, first)))
                return st;
            first = false;
        }
        if ((st = spans_add(out, sp.off + ms, me - ms, first)))
            return st;
        first = false;
        last = pos = me;
    }
    if (last < len && (st = spans_add(out, sp.off + last, len - last, first)))
        return st;
    return TD_OK;
}

/* Copies buf[sp] to the end of the buffer with `prefix` in front (if given) and each
 * ' ' replaced by `repl` (if given); returns the new span. */
static td_status_t rewrite_span(sbuf_t *b, span_t sp, const char *prefix, size_t prefix_len, const char *repl,
                                size_t repl_len, span_t *out)
{
    size_t spaces = 0;
    for (size_t i = 0; repl && i < sp.len; i++)
        spaces += b->v[sp.off + i] == ' ';
    td_status_t st = sbuf_reserve(b, prefix_len + sp.len + spaces * repl_len);
    if (st)
        return st;
    size_t start = b->n;
    memcpy(b->v + b->n, prefix, prefix_len);
    b->n += prefix_len;
    for (size_t i = 0; i < sp.len; i++) {
        char c = b->v[sp.off + i];
        if (repl && c == ' ') {
            memcpy(b->v + b->n, repl, repl_len);
            b->n += repl_len;
        } else {
            b->v[b->n++] = c;
        }
    }
    *out = (span_t){start, b->n - start, sp.first};
    return TD_OK;
}

/* One stretch of text between added tokens: normalize, pre-tokenize, BPE. */
static td_status_t encode_segment(const td_tokenizer_t *tok, const char *text, size_t len, bool at_start,
                                  td_tok_ids_t *ids)
{
    td_status_t st = TD_OK;
    sbuf_t b = {0};
    spans_t cur = {0}, next = {0};
    pcre2_match_data *md = NULL;
    if (len == 0)
        return TD_OK;

    char *norm = malloc(len + 1);
    if (!norm)
        return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory to encode %zu bytes", len);
    memcpy(norm, text, len);
    size_t nlen = len;
    for (size_t i = 0; i < tok->n_norm; i++)
        if ((st = normalize_step(&tok->norm[i], &norm, &nlen)))
            goto out;
    if (tok->spm_dummy_prefix && nlen && (st = sbuf_add(&b, " ", 1)))
        goto out;
    if ((st = sbuf_add(&b, norm, nlen)) || (st = spans_add(&cur, 0, b.n, at_start)))
        goto out;

    for (size_t k = 0; k < tok->n_pre; k++) {
        const td_tok_pre_t *p = &tok->pre[k];
        next.n = 0;
        if (p->re) {
            pcre2_match_data_free(md);
            if (!(md = pcre2_match_data_create_from_pattern(p->re, NULL))) {
                st = td_errorf(TD_ERR_NOMEM, "tokenizer: no memory for regex match data");
                goto out;
            }
        }
        for (size_t i = 0; i < cur.n; i++) {
            span_t sp = cur.v[i];
            if (p->kind == TD_TOK_PRE_BYTELEVEL && p->add_prefix_space && sp.len && b.v[sp.off] != ' ' &&
                (st = rewrite_span(&b, sp, " ", 1, NULL, 0, &sp)))
                goto out;
            if (p->kind == TD_TOK_PRE_METASPACE) {
                bool pre = p->prepend == 2 || (p->prepend == 1 && sp.first);
                if (pre && sp.len >= 1 && b.v[sp.off] == ' ')
                    pre = false; /* the space itself becomes the replacement */
                if (pre && sp.len >= p->repl_len && !memcmp(b.v + sp.off, p->repl, p->repl_len))
                    pre = false;
                if ((st = rewrite_span(&b, sp, pre ? p->repl : "", pre ? p->repl_len : 0, p->repl, p->repl_len, &sp)))
                    goto out;
                if (!p->split) {
                    if ((st = spans_add(&next, sp.off, sp.len, sp.first)))
                        goto out;
                    continue;
                }
                /* split before each replacement, which stays with the word after it */
                size_t s0 = 0;
                for (size_t j = 1; j + p->repl_len <= sp.len; j++) {
                    if (!memcmp(b.v + sp.off + j, p->repl, p->repl_len)) {
                        if ((st = spans_add(&next, sp.off + s0, j - s0, sp.first && s0 == 0)))
                            goto out;
                        s0 = j;
                    }
                }
                if (sp.len > s0 && (st = spans_add(&next, sp.off + s0, sp.len - s0, sp.first && s0 == 0)))
                    goto out;
                continue;
            }
            if (p->re) {
                if ((st = split_regex(tok, p->re, md, b.v, sp, &next)))
                    goto out;
            } else if ((st = spans_add(&next, sp.off, sp.len, sp.first))) {
                goto out;
            }
        }
        spans_t t = cur;
        cur = next;
        next = t;
    }
    for (size_t i = 0; i < cur.n; i++)
        if ((st = td_tok_bpe_word(tok, b.v + cur.v[i].off, cur.v[i].len, ids)))
            goto out;
out:
    pcre2_match_data_free(md);
    free(next.v);
    free(cur.v);
    free(b.v);
    free(norm);
    return st;
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

td_status_t td_tokenizer_encode(const td_tokenizer_t *tok, const char *text, size_t len, unsigned flags,
                                int32_t **ids_p, size_t *n_p)
{
    td_status_t st = TD_OK;
    td_tok_ids_t ids = {0};
    if (!text && len)
        return td_errorf(TD_ERR_INVALID, "tokenizer: NULL text of %zu bytes", len);
    if ((flags & TD_TOK_ADD_BOS) && tok->bos_id >= 0 && (st = td_tok_ids_push(&ids, tok->bos_id)))
        goto err;

    size_t seg = 0, i = 0;
    while (i < len && tok->n_added) {
        uint8_t c = (uint8_t)text[i];
        const td_tok_added_t *m = NULL;
        for (uint32_t k = tok->added_first[c]; k < tok->added_first[c + 1]; k++) {
            const td_tok_added_t *a = &tok->added[k];
            if ((flags & TD_TOK_NO_PARSE_SPECIAL) && (tok->flags[a->id] & TD_TOK_F_SPECIAL))
                continue;
            if (a->len <= len - i && !memcmp(text + i, tok->arena + a->off, a->len)) {
                m = a; /* sorted longest first */
                break;
            }
        }
        if (!m) {
            i++;
            continue;
        }
        size_t s = i, e = i + m->len;
        if (m->lstrip)
            while (s > seg && is_ws(text[s - 1]))
                s--;
        if (m->rstrip)
            while (e < len && is_ws(text[e]))
                e++;
        if ((st = encode_segment(tok, text + seg, s - seg, seg == 0, &ids)) || (st = td_tok_ids_push(&ids, m->id)))
            goto err;
        seg = i = e;
    }
    if ((st = encode_segment(tok, text + seg, len - seg, seg == 0, &ids)))
        goto err;
    if ((flags & TD_TOK_ADD_EOS) && tok->n_eos && (st = td_tok_ids_push(&ids, tok->eos_ids[0])))
        goto err;
    if (!ids.v && !(ids.v = malloc(sizeof *ids.v))) {
        st = td_errorf(TD_ERR_NOMEM, "tokenizer: no memory");
        goto err;
    }
    *ids_p = ids.v;
    *n_p = ids.n;
    return TD_OK;
err:
    free(ids.v);
    return st;
}

/* ---- a bound without encoding ---- */

void td_tok_bound_tokens(td_tokenizer_t *tok)
{
    tok->max_token_bytes = 0;
    for (size_t i = 0; i < tok->n_norm; i++)
        if (tok->norm[i].kind == TD_TOK_NORM_NFC ||
            (tok->norm[i].kind == TD_TOK_NORM_REPLACE && tok->norm[i].b_len < tok->norm[i].a_len))
            return;
    for (size_t i = 0; i < tok->n_added; i++)
        if (tok->added[i].lstrip || tok->added[i].rstrip)
            return;
    bool all_bytes = tok->byte_fallback; /* then no character is ever unknown */
    for (int b = 0; b < 256 && all_bytes; b++)
        all_bytes = tok->byte_id[b] >= 0;
    if (tok->fuse_unk && tok->unk_id >= 0 && !all_bytes)
        return; /* a run of unknown characters, any length, is one id */
    uint32_t most = 4; /* an unknown character: one id for up to 4 bytes */
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        if (tok->flags[id] & TD_TOK_F_HOLE)
            continue;
        most = TD_MAX(most, TD_MAX(tok->piece_len[id], TD_MAX(tok->key_len[id], tok->surf_len[id])));
    }
    for (size_t i = 0; i < tok->n_added; i++)
        most = TD_MAX(most, tok->added[i].len);
    tok->max_token_bytes = most;
}

uint32_t td_tokenizer_max_token_bytes(const td_tokenizer_t *tok)
{
    return tok->max_token_bytes;
}

size_t td_tokenizer_min_tokens(const td_tokenizer_t *tok, size_t len)
{
    return tok->max_token_bytes ? TD_DIV_CEIL(len, (size_t)tok->max_token_bytes) : 0;
}

/* ---- decode ---- */

void td_detok_init(td_detok_t *d, const td_tokenizer_t *tok)
{
    *d = (td_detok_t){.tok = tok, .at_start = true};
}

void td_detok_free(td_detok_t *d)
{
    free(d->out);
    d->out = NULL;
    d->out_cap = 0;
}

static td_status_t out_reserve(td_detok_t *d, size_t need)
{
    if (need <= d->out_cap)
        return TD_OK;
    size_t cap = d->out_cap ? d->out_cap : 64;
    while (cap < need)
        cap *= 2;
    char *o = realloc(d->out, cap);
    if (!o)
        return td_errorf(TD_ERR_NOMEM, "detokenizer: no memory for %zu bytes", cap);
    d->out = o;
    d->out_cap = cap;
    return TD_OK;
}

static const char replacement[3] = {'\xEF', '\xBF', '\xBD'}; /* U+FFFD */

/* Feeds bytes through the UTF-8 assembler: complete characters go to d->out at *o,
 * an invalid sequence (maximal subpart, as WHATWG and Rust's from_utf8_lossy) becomes
 * one U+FFFD. Room for 3 bytes per input byte + 4 is reserved by the caller. */
static void utf8_feed(td_detok_t *d, const uint8_t *s, size_t n, size_t *o)
{
    for (size_t i = 0; i < n; i++) {
        uint8_t x = s[i];
    again:
        if (!d->n_pending) {
            if (x < 0x80)
                d->out[(*o)++] = (char)x;
            else if (x >= 0xC2 && x <= 0xF4)
                d->pending[d->n_pending++] = x;
            else
                memcpy(d->out + *o, replacement, 3), *o += 3;
            continue;
        }
        uint8_t lead = d->pending[0], lo = 0x80, hi = 0xBF;
        size_t total = lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
        if (d->n_pending == 1) {
            if (lead == 0xE0)
                lo = 0xA0;
            else if (lead == 0xED)
                hi = 0x9F;
            else if (lead == 0xF0)
                lo = 0x90;
            else if (lead == 0xF4)
                hi = 0x8F;
        }
        if (x >= lo && x <= hi) {
            d->pending[d->n_pending++] = x;
            if (d->n_pending == total) {
                memcpy(d->out + *o, d->pending, total);
                *o += total;
                d->n_pending = 0;
            }
            continue;
        }
        memcpy(d->out + *o, replacement, 3);
        *o += 3;
        d->n_pending = 0;
        goto again;
    }
}

td_status_t td_detok_push(td_detok_t *d, int32_t id, const char **text_p, size_t *len_p)
{
    const td_tokenizer_t *tok = d->tok;
    if (id < 0 || id >= tok->n_vocab || (tok->flags[id] & TD_TOK_F_HOLE))
        return td_errorf(TD_ERR_RANGE, "detokenizer: token id %d is not in the vocabulary of %d ids", id, tok->n_vocab);
    const uint8_t *s = (const uint8_t *)tok->arena + tok->surf_off[id];
    size_t n = tok->surf_len[id];
    if (tok->flags[id] & TD_TOK_F_SPECIAL)
        n = 0;
    if (n && d->at_start) {
        d->at_start = false;
        if (tok->strip_leading_space && s[0] == ' ')
            s++, n--;
    }
    td_status_t st = out_reserve(d, 3 * n + 16);
    if (st)
        return st;
    size_t o = 0;
    utf8_feed(d, s, n, &o);
    d->out[o] = 0;
    *text_p = d->out;
    *len_p = o;
    return TD_OK;
}

td_status_t td_detok_flush(td_detok_t *d, const char **text_p, size_t *len_p)
{
    td_status_t st = out_reserve(d, 16);
    if (st)
        return st;
    size_t o = 0;
    if (d->n_pending) {
        memcpy(d->out, replacement, 3);
        o = 3;
    }
    d->out[o] = 0;
    d->n_pending = 0;
    d->at_start = true;
    *text_p = d->out;
    *len_p = o;
    return TD_OK;
}

td_status_t td_tokenizer_decode(const td_tokenizer_t *tok, const int32_t *ids, size_t n, char **text_p,
                                size_t *len_p)
{
    td_status_t st;
    td_detok_t d;
    sbuf_t b = {0};
    const char *t;
    size_t tl;
    td_detok_init(&d, tok);
    for (size_t i = 0; i < n; i++)
        if ((st = td_detok_push(&d, ids[i], &t, &tl)) || (st = sbuf_add(&b, t, tl)))
            goto err;
    if ((st = td_detok_flush(&d, &t, &tl)) || (st = sbuf_add(&b, t, tl)) || (st = sbuf_add(&b, "", 1)))
        goto err;
    td_detok_free(&d);
    *text_p = b.v;
    if (len_p)
        *len_p = b.n - 1;
    return TD_OK;
err:
    td_detok_free(&d);
    free(b.v);
    return st;
}
