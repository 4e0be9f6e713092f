/*
 * td_constrain: what a model's generation needs to run under a grammar (td_gram.h): the
 * grammar vocabulary of a model, built from its tokenizer. One place for the rule of which
 * token is text, which is never allowed and which ends a generation, so every path that
 * constrains (tandem generate today; the nodes later) agrees on the masks.
 */
#ifndef TD_CONSTRAIN_H
#define TD_CONSTRAIN_H

#include <stdint.h>

#include "td_gram.h"
#include "td_status.h"
#include "td_tokenizer.h"

/*
 * The grammar vocabulary of a model of n_vocab ids with tokenizer tok: token i's bytes are
 * td_tokenizer_token_bytes (a byte-fallback piece is its one byte); the tokenizer's EOS ids
 * and eos[0..n_eos) (the model's) are EOS (allowed only where the grammar may end); other
 * special tokens, ids past the tokenizer's vocabulary (a padded embedding) and tokens with
 * no bytes are never allowed. Errors: TD_ERR_INVALID (n_vocab <= 0), TD_ERR_NOMEM.
 */
td_status_t td_constrain_vocab(const td_tokenizer_t *tok, int32_t n_vocab, const int32_t *eos, int32_t n_eos,
                               td_gram_vocab_t **vocab_p);

#endif /* TD_CONSTRAIN_H */
