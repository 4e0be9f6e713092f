/*
 * fuzz_grammar: the grammar compilers (docs/grammar.md). The first byte picks the input kind
 * (td_gram_kind_t: GBNF, regex, choice, json_object, JSON Schema); the rest is the source.
 * Whatever compiles is walked: from the start state, a token mask over a small vocabulary
 * (every byte, a few JSON-ish strings, an EOS) and a walk of up to 64 tokens picked by the
 * input's bytes, each mask checked against a fresh copy's accept_bytes for a few tokens, and
 * the state's serialization read back. A first byte of 0xF0 or more fuzzes the tool-call
 * parser instead (td_tools.h; format = the byte's low two bits, bit 2 one call at most, bit
 * 3 arguments streamed): the rest is a model's output, fed whole and then in pieces sized by
 * its own bytes, and both must give the same content and calls (streamed pieces joined).
 * Seeds: tests/fuzz/corpus/grammar.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_gram.h"
#include "td_tools.h"

static td_gram_vocab_t *vocab(void)
{
    static const char *const extra[] = {"{\"", "\": ", "\", \"", "true", "null", "\"}", "ab", "abc", "\xc3\xa9",
                                        "\xe2\x82", "</s>"};
    enum { N = 256 + sizeof extra / sizeof extra[0] };
    char one[256];
    const char *bytes[N];
    size_t lens[N];
    uint8_t kinds[N];
    for (int i = 0; i < N; i++) {
        if (i < 256) {
            one[i] = (char)i;
            bytes[i] = one + i;
            lens[i] = 1;
        } else {
            bytes[i] = extra[i - 256];
            lens[i] = strlen(extra[i - 256]);
        }
        kinds[i] = i == N - 1 ? TD_GRAM_TOK_EOS : TD_GRAM_TOK_TEXT;
    }
    td_gram_vocab_t *v = NULL;
    if (td_gram_vocab_create(N, bytes, lens, kinds, &v) != TD_OK)
        abort();
    return v;
}


/* The parser's events as one record: runs of content joined, each call as 0x01 name 0x02
 * arguments 0x03 (a piecewise feed may split content where a whole one does not). */
typedef struct rec {
    char *p;
    size_t n, cap;
    bool in_content;
    bool open;      /* the last call was begun streamed: pieces may follow */
    uint32_t calls; /* calls recorded */
} rec_t;

static void rec_put(rec_t *r, const char *s, size_t n)
{
    if (r->n + n > r->cap) {
        size_t cap = r->cap ? r->cap : 256;
        while (cap < r->n + n)
            cap *= 2;
        if (!(r->p = realloc(r->p, cap)))
            abort();
        r->cap = cap;
    }
    if (n)
        memcpy(r->p + r->n, s, n);
    r->n += n;
}

static td_status_t rec_event(void *ctx, const td_tools_event_t *ev)
{
    rec_t *r = ctx;
    if (ev->kind == TD_TOOLS_CONTENT) {
        if (!ev->len)
            return TD_OK;
        if (!r->in_content)
            rec_put(r, "\x04", 1);
        rec_put(r, ev->text, ev->len);
        r->in_content = true;
        return TD_OK;
    }
    if (ev->kind == TD_TOOLS_CALL_ARGS) { /* a streamed call's next piece: joined, as a client does */
        if (!r->open || ev->index + 1 != r->calls)
            abort(); /* pieces belong to the call last begun */
        rec_put(r, ev->arguments, ev->arguments_len);
        return TD_OK;
    }
    if (ev->index != r->calls++)
        abort(); /* calls are numbered in order */
    char idx[16];
    int k = snprintf(idx, sizeof idx, "\x01%u:", ev->index);
    rec_put(r, idx, (size_t)k);
    rec_put(r, ev->name, strlen(ev->name));
    rec_put(r, "\x02", 1);
    r->open = ev->kind == TD_TOOLS_CALL_BEGIN;
    if (!r->open) {
        rec_put(r, ev->arguments, ev->arguments_len);
        rec_put(r, "\x03", 1);
    }
    r->in_content = false;
    return TD_OK;
}

static void tools_parse(td_tools_format_t fmt, uint32_t max_calls, bool stream, const char *out, size_t len,
                        const uint8_t *cuts, size_t n_cuts, rec_t *r)
{
    td_tools_parser_t *p = NULL;
    if (td_tools_parser_create(fmt, max_calls, (size_t)1 << 20, &p) != TD_OK)
        abort();
    td_tools_parser_stream_args(p, stream);
    for (size_t i = 0, k = 0; i < len; k++) {
        size_t piece = n_cuts ? (size_t)cuts[k % n_cuts] % 17 + 1 : len;
        piece = piece < len - i ? piece : len - i;
        if (td_tools_parser_feed(p, out + i, piece, rec_event, r) != TD_OK)
            abort();
        i += piece;
    }
    if (td_tools_parser_finish(p, rec_event, r) != TD_OK)
        abort();
    td_tools_parser_destroy(p);
}

static void fuzz_tools(const uint8_t *data, size_t size)
{
    td_tools_format_t fmt = (td_tools_format_t)(data[0] & 3);
    uint32_t max_calls = data[0] & 4 ? 1 : 0;
    bool stream = data[0] & 8; /* arguments streamed */
    const char *out = (const char *)data + 1;
    size_t len = size - 1;
    rec_t whole = {0}, pieces = {0};
    tools_parse(fmt, max_calls, stream, out, len, NULL, 0, &whole);
    tools_parse(fmt, max_calls, stream, out, len, data + 1, len, &pieces);
    if (whole.n != pieces.n || (whole.n && memcmp(whole.p, pieces.p, whole.n)))
        abort(); /* fed in pieces, the same content and calls as fed whole */
    free(whole.p);
    free(pieces.p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    if (data[0] >= 0xF0) {
        fuzz_tools(data, size);
        return 0;
    }
    static td_gram_vocab_t *v;
    if (!v)
        v = vocab();
    td_gram_kind_t kind = (td_gram_kind_t)(data[0] % 5);
    td_gram_t *g = NULL;
    if (td_gram_compile(kind, (const char *)data + 1, size - 1, &g) != TD_OK)
        return 0;
    td_gram_matcher_t *m = NULL;
    td_gram_state_t *s = NULL;
    int32_t n = td_gram_vocab_size(v);
    uint32_t mask[(256 + 11 + 31) / 32];
    if (td_gram_matcher_create(g, v, &m) != TD_OK || td_gram_state_create(g, &s) != TD_OK)
        abort();
    for (size_t step = 0; step < 64; step++) {
        if (td_gram_fill_mask(m, s, mask) != TD_OK)
            abort();
        int32_t pick = -1, n_allowed = 0;
        for (int32_t t = 0; t < n; t++)
            if ((mask[t >> 5] >> (t & 31)) & 1)
                n_allowed++;
        if (n_allowed == 0)
            break;
        int32_t want = (int32_t)(data[step % size] % (uint32_t)n_allowed);
        for (int32_t t = 0, k = 0; t < n; t++)
            if ((mask[t >> 5] >> (t & 31)) & 1 && k++ == want)
                pick = t;
        /* the mask agrees with accept on the picked token and a forbidden neighbour */
        for (int32_t t = pick; t <= pick + 1 && t < n - 1; t++) {
            td_gram_state_t *c;
            if (td_gram_state_copy(s, &c) != TD_OK)
                abort();
            td_status_t st = td_gram_accept_token(m, c, t);
            if ((st == TD_OK) != (((mask[t >> 5] >> (t & 31)) & 1) != 0))
                abort();
            td_gram_state_destroy(c);
        }
        if (td_gram_accept_token(m, s, pick) != TD_OK)
            abort();
        if (pick == n - 1)
            break;
        uint8_t *buf;
        size_t len;
        td_gram_state_t *r;
        if (td_gram_state_serialize(s, &buf, &len) != TD_OK || td_gram_state_deserialize(g, buf, len, &r) != TD_OK)
            abort();
        free(buf);
        td_gram_state_destroy(r);
    }
    td_gram_state_destroy(s);
    td_gram_matcher_destroy(m);
    td_gram_unref(g);
    return 0;
}
