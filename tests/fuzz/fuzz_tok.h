/* fuzz_tok.h: what the tokenizer harnesses do with a tokenizer that loaded. */
#ifndef FUZZ_TOK_H
#define FUZZ_TOK_H

#include "fuzz_util.h"
#include "td_tokenizer.h"

/* Encodes a fixed text (ASCII, a ChatML special, CJK, digits, an invalid byte) and the
 * input's first bytes, decodes the ids back, and decodes ids taken from the input (out
 * of range ones included) in one piece and through the streaming detokenizer. */
static inline void fuzz_tokenizer_use(const td_tokenizer_t *tok, const uint8_t *data, size_t size)
{
    static const char text[] = "Hello, world! <|im_start|>user\n\xe4\xbd\xa0\xe5\xa5\xbd 123 \xff";
    const char *texts[2] = {text, (const char *)data};
    size_t lens[2] = {sizeof text - 1, size < 256 ? size : 256};
    for (int t = 0; t < 2; t++) {
        int32_t *ids = NULL;
        size_t n = 0;
        if (td_tokenizer_encode(tok, texts[t], lens[t], TD_TOK_ADD_BOS, &ids, &n) == TD_OK) {
            char *out = NULL;
            if (td_tokenizer_decode(tok, ids, n, &out, NULL) == TD_OK)
                free(out);
        }
        free(ids);
    }
    int32_t ids[16];
    size_t n = 0;
    for (size_t i = 0; i + 4 <= size && n < 16; i += 4 + i) {
        uint32_t v;
        memcpy(&v, data + i, 4);
        ids[n++] = (int32_t)(v % (uint32_t)(td_tokenizer_vocab_size(tok) + 2)) - 1;
    }
    char *out = NULL;
    if (td_tokenizer_decode(tok, ids, n, &out, NULL) == TD_OK)
        free(out);
    td_detok_t d;
    td_detok_init(&d, tok);
    for (size_t i = 0; i < n; i++) {
        const char *piece;
        size_t len;
        (void)td_detok_push(&d, ids[i], &piece, &len);
    }
    const char *rest;
    size_t len;
    (void)td_detok_flush(&d, &rest, &len);
    td_detok_free(&d);
}

#endif /* FUZZ_TOK_H */
