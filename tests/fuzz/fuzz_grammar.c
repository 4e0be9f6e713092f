/*
 * fuzz_grammar: the grammar compilers (docs/grammar.md). The first byte picks the input kind
 * (td_gram_kind_t: GBNF, regex, choice, json_object, JSON Schema); the rest is the source.
 * Whatever compiles is walked: from the start state, a token mask over a small vocabulary
 * (every byte, a few JSON-ish strings, an EOS) and a walk of up to 64 tokens picked by the
 * input's bytes, each mask checked against a fresh copy's accept_bytes for a few tokens, and
 * the state's serialization read back. Seeds: tests/fuzz/corpus/grammar.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "td_gram.h"

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

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
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
