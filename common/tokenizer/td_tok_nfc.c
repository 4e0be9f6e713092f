/*
 * td_tok_nfc: Unicode Normalization Form C for the NFC normalizer of tokenizer.json
 * (Qwen): full canonical decomposition, canonical ordering of combining marks, then
 * canonical composition (Unicode Standard Annex #15), with Hangul done algorithmically.
 * The tables come from td_tok_nfc_data.c (generated). Also the module's UTF-8 helpers.
 */
#include "td_tokenizer_int.h"

#include <stdlib.h>
#include <string.h>

#include "td_util.h"

size_t td_tok_utf8_decode(const char *s, size_t len, uint32_t *cp_p)
{
    const uint8_t *u = (const uint8_t *)s;
    if (len == 0)
        return 0;
    if (u[0] < 0x80) {
        *cp_p = u[0];
        return 1;
    }
    size_t n;
    uint32_t cp, min;
    if ((u[0] & 0xE0) == 0xC0) {
        n = 2, cp = u[0] & 0x1F, min = 0x80;
    } else if ((u[0] & 0xF0) == 0xE0) {
        n = 3, cp = u[0] & 0x0F, min = 0x800;
    } else if ((u[0] & 0xF8) == 0xF0) {
        n = 4, cp = u[0] & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (len < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((u[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (u[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    *cp_p = cp;
    return n;
}

size_t td_tok_utf8_encode(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

enum { SBASE = 0xAC00, LBASE = 0x1100, VBASE = 0x1161, TBASE = 0x11A7, LCOUNT = 19, VCOUNT = 21,
       TCOUNT = 28, NCOUNT = VCOUNT * TCOUNT, SCOUNT = LCOUNT * NCOUNT };

static uint8_t ccc_of(uint32_t cp)
{
    if (cp < 0x300)
        return 0;
    size_t lo = 0, hi = td_tok_nfc_n_ccc;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < td_tok_nfc_ccc[mid].lo)
            hi = mid;
        else if (cp > td_tok_nfc_ccc[mid].hi)
            lo = mid + 1;
        else
            return td_tok_nfc_ccc[mid].ccc;
    }
    return 0;
}

static const td_tok_decomp_t *decomp_of(uint32_t cp)
{
    if (cp < 0xC0)
        return NULL;
    size_t lo = 0, hi = td_tok_nfc_n_decomp;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < td_tok_nfc_decomp[mid].cp)
            hi = mid;
        else if (cp > td_tok_nfc_decomp[mid].cp)
            lo = mid + 1;
        else
            return &td_tok_nfc_decomp[mid];
    }
    return NULL;
}

/* The primary composite of a + b, or 0. */
static uint32_t compose(uint32_t a, uint32_t b)
{
    if (a >= LBASE && a < LBASE + LCOUNT && b >= VBASE && b < VBASE + VCOUNT)
        return SBASE + ((a - LBASE) * VCOUNT + (b - VBASE)) * TCOUNT;
    if (a >= SBASE && a < SBASE + SCOUNT && (a - SBASE) % TCOUNT == 0 && b > TBASE && b < TBASE + TCOUNT)
        return a + (b - TBASE);
    size_t lo = 0, hi = td_tok_nfc_n_comp;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const td_tok_comp_t *c = &td_tok_nfc_comp[mid];
        if (a < c->a || (a == c->a && b < c->b))
            hi = mid;
        else if (a > c->a || b > c->b)
            lo = mid + 1;
        else
            return c->cp;
    }
    return 0;
}

/* Appends the full canonical decomposition of cp to buf (which has room: at most 4 per cp
 * in Unicode's data, we check). Returns the new count. */
static size_t decompose(uint32_t cp, uint32_t *buf, size_t n, size_t cap)
{
    if (cp >= SBASE && cp < SBASE + SCOUNT) {
        uint32_t si = cp - SBASE;
        buf[n++] = LBASE + si / NCOUNT;
        buf[n++] = VBASE + (si % NCOUNT) / TCOUNT;
        if (si % TCOUNT)
            buf[n++] = TBASE + si % TCOUNT;
        return n;
    }
    const td_tok_decomp_t *d = decomp_of(cp);
    if (!d || n + 4 > cap) {
        buf[n++] = cp;
        return n;
    }
    n = decompose(d->a, buf, n, cap);
    if (d->b)
        n = decompose(d->b, buf, n, cap);
    return n;
}

td_status_t td_tok_nfc(const char *s, size_t len, char **out_p, size_t *out_len_p)
{
    bool ascii = true;
    for (size_t i = 0; i < len && ascii; i++)
        ascii = (uint8_t)s[i] < 0x80;
    size_t n_cp = 0;
    if (!ascii) {
        for (size_t i = 0; i < len;) {
            uint32_t cp;
            size_t cl = td_tok_utf8_decode(s + i, len - i, &cp);
            if (!cl) {
                ascii = true; /* not valid UTF-8: leave it as it is */
                break;
            }
            i += cl;
            n_cp++;
        }
    }
    if (ascii) {
        char *o = malloc(len + 1);
        if (!o)
            return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory to normalize %zu bytes", len);
        memcpy(o, s, len);
        o[len] = 0;
        *out_p = o;
        *out_len_p = len;
        return TD_OK;
    }

    /* a decomposition is at most 4 code points for any one (Unicode 15; decompose checks) */
    size_t cap = n_cp * 4 + 4;
    uint32_t *cps = malloc(cap * sizeof *cps);
    char *o = malloc(cap * 4 + 1);
    if (!cps || !o) {
        free(cps);
        free(o);
        return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory to normalize %zu bytes", len);
    }
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        i += td_tok_utf8_decode(s + i, len - i, &cp);
        n = decompose(cp, cps, n, cap);
    }
    /* canonical ordering: stable insertion sort of each run of non-starters by class */
    for (size_t i = 1; i < n; i++) {
        uint8_t c = ccc_of(cps[i]);
        if (!c)
            continue;
        size_t j = i;
        uint32_t v = cps[i];
        while (j > 0) {
            uint8_t pc = ccc_of(cps[j - 1]);
            if (pc <= c)
                break;
            cps[j] = cps[j - 1];
            j--;
        }
        cps[j] = v;
    }
    /* canonical composition */
    size_t w = 0;
    ssize_t starter = -1;
    int last_ccc = -1;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = cps[i];
        uint8_t c = ccc_of(cp);
        if (starter >= 0) {
            bool blocked = last_ccc != -1 && (last_ccc == 0 || last_ccc >= c);
            /* last_ccc == -1: cp directly follows the starter */
            uint32_t comp = blocked ? 0 : compose(cps[starter], cp);
            if (comp) {
                cps[starter] = comp;
                continue;
            }
        }
        if (c == 0) {
            starter = (ssize_t)w;
            last_ccc = -1;
        } else {
            last_ccc = c;
        }
        cps[w++] = cp;
    }
    size_t ol = 0;
    for (size_t i = 0; i < w; i++)
        ol += td_tok_utf8_encode(cps[i], o + ol);
    o[ol] = 0;
    free(cps);
    *out_p = o;
    *out_len_p = ol;
    return TD_OK;
}
