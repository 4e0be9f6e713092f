/*
 * td_constrain: a model's grammar vocabulary (contract in td_constrain.h).
 */
#include "td_constrain.h"

#include <stdio.h>
#include <stdlib.h>

td_status_t td_constrain_vocab(const td_tokenizer_t *tok, int32_t n_vocab, const int32_t *eos, int32_t n_eos,
                               td_gram_vocab_t **vocab_p)
{
    if (n_vocab <= 0)
        return td_errorf(TD_ERR_INVALID, "grammar vocabulary: %d tokens", n_vocab);
    const char **bytes = malloc((size_t)n_vocab * sizeof *bytes);
    size_t *lens = malloc((size_t)n_vocab * sizeof *lens);
    uint8_t *kinds = malloc((size_t)n_vocab);
    td_status_t st;
    if (!bytes || !lens || !kinds) {
        st = td_errorf(TD_ERR_NOMEM, "grammar vocabulary: out of memory for %d tokens", n_vocab);
        goto out;
    }
    const int32_t n_tok = td_tokenizer_vocab_size(tok);
    for (int32_t i = 0; i < n_vocab; i++) {
        size_t len = 0;
        const char *b = i < n_tok ? td_tokenizer_token_bytes(tok, i, &len) : NULL;
        bytes[i] = b ? b : "";
        lens[i] = b ? len : 0;
        kinds[i] = !b                               ? TD_GRAM_TOK_SPECIAL
                   : td_tokenizer_is_eos(tok, i)     ? TD_GRAM_TOK_EOS
                   : td_tokenizer_is_special(tok, i) ? TD_GRAM_TOK_SPECIAL
                                                     : TD_GRAM_TOK_TEXT;
    }
    for (int32_t k = 0; k < n_eos; k++)
        if (eos[k] >= 0 && eos[k] < n_vocab)
            kinds[eos[k]] = TD_GRAM_TOK_EOS;
    if ((st = td_gram_vocab_create(n_vocab, bytes, lens, kinds, vocab_p)) != TD_OK) {
        char why[256]; /* td_gram is quiet: this is where the error is decided, and logged */
        snprintf(why, sizeof why, "%s", td_last_error());
        td_errorf(st, "%s", why);
    }
out:
    free(bytes);
    free(lens);
    free(kinds);
    return st;
}
