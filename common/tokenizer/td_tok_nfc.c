/*
 * td_tok_nfc: Unicode Normalization Form C for the NFC normalizer of tokenizer.json
 * (Qwen), by libutf8proc (canonical decomposition, canonical ordering, canonical
 * composition: Unicode Standard Annex #15). ASCII, the common case, is NFC already and is
 * copied without a call.
 */
#include "td_tokenizer_int.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "td_util.h"

/* A malloc'd, NUL-terminated copy of s[0..len). */
static td_status_t copy_text(const char *s, size_t len, char **out_p, size_t *out_len_p)
{
    char *o = malloc(len + 1);
    if (!o)
        return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory to normalize %zu bytes", len);
    memcpy(o, s, len);
    o[len] = 0;
    *out_p = o;
    *out_len_p = len;
    return TD_OK;
}

td_status_t td_tok_nfc(const char *s, size_t len, char **out_p, size_t *out_len_p)
{
    bool ascii = true;
    for (size_t i = 0; i < len && ascii; i++)
        ascii = (uint8_t)s[i] < 0x80;
    if (ascii)
        return copy_text(s, len, out_p, out_len_p);
    /* len given, so a NUL in the text is a character like any other */
    utf8proc_uint8_t *o = NULL;
    utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &o,
                                      UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (n == UTF8PROC_ERROR_INVALIDUTF8)
        return copy_text(s, len, out_p, out_len_p); /* not UTF-8: left as it is */
    if (n < 0)
        return td_errorf(n == UTF8PROC_ERROR_NOMEM ? TD_ERR_NOMEM : TD_ERR_RANGE,
                         "tokenizer: cannot normalize %zu bytes: %s", len, utf8proc_errmsg(n));
    *out_p = (char *)o;
    *out_len_p = (size_t)n;
    return TD_OK;
}
