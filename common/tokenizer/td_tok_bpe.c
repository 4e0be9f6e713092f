/*
 * td_tok_bpe: the tokenizer's two td_hash maps (model key -> id, id pair -> merge) and the
 * BPE merge loop shared by SentencePiece (best score first) and Hugging Face BPE (lowest
 * merge rank first). The loop keeps the word as a linked list of symbols and the
 * candidate pairs in a binary heap; a popped candidate is stale when its two symbols no
 * longer have the lengths it was made from (the trick of sentencepiece's bpe_model.cc).
 * Ties go to the leftmost pair, as in both references. O(n log n) per word.
 */
#include "td_tokenizer_int.h"

#include <stdlib.h>
#include <string.h>

#include "td_list.h"
#include "td_util.h"

static uint64_t key_hash(const char *s, size_t len)
{
    return td_fnv1a64(TD_FNV1A64_INIT, s, len);
}

static bool key_is(const td_tokenizer_t *tok, int32_t id, const char *s, size_t len)
{
    return tok->key_len[id] == len && !memcmp(tok->arena + tok->key_off[id], s, len);
}

td_status_t td_tok_map_build(td_tokenizer_t *tok)
{
    if (td_hash_init(&tok->vocab, (size_t)tok->n_vocab))
        return td_errorf(TD_ERR_NOMEM, "%s: no memory for the vocabulary map", tok->path);
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        if (!tok->key_len[id])
            continue;
        const char *k = tok->arena + tok->key_off[id];
        if (td_tok_map_get(tok, k, tok->key_len[id]) >= 0)
            continue; /* two ids with one key: the first one wins, as in a JSON object */
        td_status_t st = td_hash_put(&tok->vocab, key_hash(k, tok->key_len[id]), (uint64_t)id);
        TD_ASSERT(st == TD_OK); /* sized for every id: it never grows */
    }
    return TD_OK;
}

int32_t td_tok_map_get(const td_tokenizer_t *tok, const char *s, size_t len)
{
    if (len == 0)
        return -1;
    const td_hash_t *t = &tok->vocab;
    for (const td_hash_slot_t *sl = td_hash_find(t, key_hash(s, len)); sl; sl = td_hash_find_next(t, sl))
        if (key_is(tok, (int32_t)sl->value, s, len))
            return (int32_t)sl->value;
    return -1;
}

/* An id pair as one 64-bit key: the key is its own hash, so a hit needs no other check. */
static uint64_t pair_key(int32_t l, int32_t r)
{
    return ((uint64_t)(uint32_t)(l + 1) << 32) | (uint32_t)(r + 1);
}

td_status_t td_tok_merges_init(td_tokenizer_t *tok, size_t n)
{
    if (td_hash_init(&tok->merges, n))
        return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory for %zu merges", n);
    return TD_OK;
}

void td_tok_merge_put(td_tokenizer_t *tok, int32_t l, int32_t r, int32_t rank, int32_t id)
{
    TD_ASSERT(rank >= 0 && id >= 0);
    uint64_t key = pair_key(l, r);
    if (td_hash_find(&tok->merges, key))
        return;
    td_status_t st = td_hash_put(&tok->merges, key, ((uint64_t)(uint32_t)rank << 32) | (uint32_t)id);
    TD_ASSERT(st == TD_OK); /* sized for every merge: it never grows */
}

bool td_tok_merge_get(const td_tokenizer_t *tok, int32_t l, int32_t r, int32_t *rank_p, int32_t *id_p)
{
    const td_hash_slot_t *sl = td_hash_find(&tok->merges, pair_key(l, r));
    if (!sl)
        return false;
    *rank_p = (int32_t)(sl->value >> 32);
    *id_p = (int32_t)(uint32_t)sl->value;
    return true;
}

td_status_t td_tok_ids_push(td_tok_ids_t *a, int32_t id)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        int32_t *v = realloc(a->v, cap * sizeof *v);
        if (!v)
            return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory for %zu ids", cap);
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = id;
    return TD_OK;
}

/* ---- the merge loop ---- */

typedef struct sym {
    int32_t id;      /* -1: not (yet) a piece of the vocabulary */
    uint32_t start;  /* bytes of the word */
    uint32_t len;    /* 0: merged away */
    td_list_t link;  /* in the word, while not merged away */
} sym_t;

/* The symbol after / before a in the word, or NULL. */
static sym_t *sym_next(const td_list_t *word, const sym_t *a)
{
    td_list_t *n = td_list_next(word, &a->link);
    return n ? TD_CONTAINER_OF(n, sym_t, link) : NULL;
}

static sym_t *sym_prev(const td_list_t *word, const sym_t *a)
{
    td_list_t *n = td_list_prev(word, &a->link);
    return n ? TD_CONTAINER_OF(n, sym_t, link) : NULL;
}

typedef struct cand {
    double key;      /* smaller merges first: rank, or -score */
    int32_t left;    /* symbol index; ties go to the leftmost */
    uint32_t size;   /* len(left) + len(right) when made */
    int32_t id;      /* the merged piece */
} cand_t;

typedef struct heap {
    cand_t *v;
    size_t n, cap;
} heap_t;

static bool cand_before(const cand_t *a, const cand_t *b)
{
    return a->key < b->key || (a->key == b->key && a->left < b->left);
}

static td_status_t heap_push(heap_t *h, cand_t c)
{
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        cand_t *v = realloc(h->v, cap * sizeof *v);
        if (!v)
            return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory for the merge queue");
        h->v = v;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_before(&c, &h->v[p]))
            break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = c;
    return TD_OK;
}

static cand_t heap_pop(heap_t *h)
{
    cand_t top = h->v[0];
    cand_t last = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && cand_before(&h->v[c + 1], &h->v[c]))
            c++;
        if (!cand_before(&h->v[c], &last))
            break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (h->n)
        h->v[i] = last;
    return top;
}

/* Queues the merge of symbol a (of the word, or NULL) with its right neighbour, if the
 * model has one. */
static td_status_t try_pair(const td_tokenizer_t *tok, const char *s, const td_list_t *word, const sym_t *sy,
                            const sym_t *a, heap_t *h)
{
    const sym_t *b = a ? sym_next(word, a) : NULL;
    if (!b)
        return TD_OK;
    cand_t c = {.left = (int32_t)(a - sy), .size = a->len + b->len};
    if (tok->algo == TD_TOK_ALGO_SCORES) {
        int32_t id = td_tok_map_get(tok, s + a->start, a->len + b->len);
        if (id < 0 || (tok->flags[id] & TD_TOK_F_NOMERGE))
            return TD_OK;
        c.key = -(double)tok->scores[id];
        c.id = id;
    } else {
        if (a->id < 0 || b->id < 0)
            return TD_OK;
        int32_t rank;
        if (!td_tok_merge_get(tok, a->id, b->id, &rank, &c.id))
            return TD_OK;
        c.key = rank;
    }
    return heap_push(h, c);
}

static td_status_t emit_bytes(const td_tokenizer_t *tok, const char *s, size_t len, td_tok_ids_t *out)
{
    td_status_t st;
    for (size_t i = 0; i < len; i++) {
        int32_t id = tok->byte_id[(uint8_t)s[i]];
        if (id < 0)
            return td_errorf(TD_ERR_FORMAT, "%s: byte 0x%02X has no token", tok->path, (uint8_t)s[i]);
        if ((st = td_tok_ids_push(out, id)))
            return st;
    }
    return TD_OK;
}

static bool has_all_bytes(const td_tokenizer_t *tok, const char *s, size_t len)
{
    for (size_t i = 0; i < len; i++)
        if (tok->byte_id[(uint8_t)s[i]] < 0)
            return false;
    return true;
}

td_status_t td_tok_bpe_word(const td_tokenizer_t *tok, const char *s, size_t len, td_tok_ids_t *out)
{
    if (len == 0)
        return TD_OK;
    if (len > UINT32_MAX / 2)
        return td_errorf(TD_ERR_RANGE, "%s: a pre-token of %zu bytes is too long", tok->path, len);
    if (tok->algo == TD_TOK_ALGO_RANKS && tok->ignore_merges) {
        int32_t id = td_tok_map_get(tok, s, len);
        if (id >= 0)
            return td_tok_ids_push(out, id);
    }

    td_status_t st = TD_OK;
    heap_t h = {0};
    sym_t *sy = malloc(len * sizeof *sy);
    if (!sy)
        return td_errorf(TD_ERR_NOMEM, "%s: no memory to encode %zu bytes", tok->path, len);

    /* initial symbols: bytes (byte-level) or UTF-8 characters */
    int32_t n = 0;
    for (size_t i = 0; i < len;) {
        size_t cl = 1;
        uint32_t cp;
        if (!tok->byte_level) {
            cl = td_tok_utf8_decode(s + i, len - i, &cp);
            if (!cl)
                cl = 1;
        }
        int32_t id = td_tok_map_get(tok, s + i, cl);
        if (id >= 0 && tok->algo == TD_TOK_ALGO_SCORES && (tok->flags[id] & TD_TOK_F_NOMERGE))
            id = -1;
        if (id < 0 && tok->algo == TD_TOK_ALGO_RANKS) {
            if (tok->byte_fallback && has_all_bytes(tok, s + i, cl)) {
                for (size_t k = 0; k < cl; k++, n++)
                    sy[n] = (sym_t){.id = tok->byte_id[(uint8_t)s[i + k]], .start = (uint32_t)(i + k), .len = 1};
                i += cl;
                continue;
            }
            if (tok->unk_id < 0) {
                st = td_errorf(TD_ERR_FORMAT, "%s: character at byte %zu of a pre-token has no token and "
                               "the model has no unk_token", tok->path, i);
                goto out;
            }
            if (tok->fuse_unk && n > 0 && sy[n - 1].id == tok->unk_id) {
                sy[n - 1].len += (uint32_t)cl;
                i += cl;
                continue;
            }
            id = tok->unk_id;
        }
        sy[n++] = (sym_t){.id = id, .start = (uint32_t)i, .len = (uint32_t)cl};
        i += cl;
    }
    td_list_t word;
    td_list_init(&word);
    for (int32_t i = 0; i < n; i++)
        td_list_push_back(&word, &sy[i].link);

    for (int32_t i = 0; i + 1 < n; i++)
        if ((st = try_pair(tok, s, &word, sy, &sy[i], &h)))
            goto out;
    while (h.n) {
        cand_t c = heap_pop(&h);
        sym_t *a = &sy[c.left];
        sym_t *b = a->len ? sym_next(&word, a) : NULL;
        if (!b || a->len + b->len != c.size)
            continue; /* stale */
        a->len += b->len;
        a->id = c.id;
        td_list_remove(&b->link);
        b->len = 0;
        if ((st = try_pair(tok, s, &word, sy, sym_prev(&word, a), &h)) ||
            (st = try_pair(tok, s, &word, sy, a, &h)))
            goto out;
    }

    TD_LIST_FOREACH(node, &word) {
        const sym_t *y = TD_CONTAINER_OF(node, sym_t, link);
        int32_t id = y->id;
        if (id >= 0) {
            st = td_tok_ids_push(out, id);
        } else if (tok->byte_fallback || tok->unk_id < 0) {
            st = emit_bytes(tok, s + y->start, y->len, out); /* sentencepiece byte fallback */
        } else if (!(tok->fuse_unk && out->n && out->v[out->n - 1] == tok->unk_id)) {
            st = td_tok_ids_push(out, tok->unk_id);
        }
        if (st)
            goto out;
    }
out:
    free(h.v);
    free(sy);
    return st;
}
