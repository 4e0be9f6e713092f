/*
 * td_tok_load: reading tokenizers from disk: td_tokenizer_load (which format a path holds),
 * llama2.c's tokenizer.bin, and the pieces every loader uses (the arena, the id tables,
 * byte pieces, the ByteLevel alphabet, regexes, the added tokens' index). Hugging Face's
 * tokenizer.json is td_tok_json.c, a GGUF file's vocabulary td_tok_gguf.c. Every rejection
 * names the file and what is wrong with it; nothing here trusts a length or an id from the
 * file before checking it.
 */
#include "td_tokenizer_int.h"

#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "td_gguf.h"
#include "td_log.h"
#include "td_util.h"

/* GPT-2's pre-tokenizer regex, used by ByteLevel with use_regex. */
const char td_tok_gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

td_status_t td_tok_arena_add(td_tokenizer_t *tok, const char *s, size_t len, uint32_t *off_p)
{
    size_t need = tok->arena_len + len + 1;
    if (need > UINT32_MAX)
        return td_errorf(TD_ERR_RANGE, "%s: vocabulary strings exceed 4 GiB", tok->path);
    if (need > tok->arena_cap) {
        size_t cap = tok->arena_cap ? tok->arena_cap : 1 << 16;
        while (cap < need)
            cap *= 2;
        char *a = realloc(tok->arena, cap);
        if (!a)
            return td_errorf(TD_ERR_NOMEM, "%s: no memory for the vocabulary", tok->path);
        tok->arena = a;
        tok->arena_cap = cap;
    }
    *off_p = (uint32_t)tok->arena_len;
    if (len)
        memcpy(tok->arena + tok->arena_len, s, len);
    tok->arena[tok->arena_len + len] = 0;
    tok->arena_len = need;
    return TD_OK;
}

td_status_t td_tok_alloc_ids(td_tokenizer_t *tok, int32_t n)
{
    size_t sz = (size_t)n;
    tok->n_vocab = n;
    tok->piece_off = calloc(sz, sizeof(uint32_t));
    tok->piece_len = calloc(sz, sizeof(uint32_t));
    tok->key_off = calloc(sz, sizeof(uint32_t));
    tok->key_len = calloc(sz, sizeof(uint32_t));
    tok->surf_off = calloc(sz, sizeof(uint32_t));
    tok->surf_len = calloc(sz, sizeof(uint32_t));
    tok->flags = malloc(sz ? sz : 1);
    if (!tok->piece_off || !tok->piece_len || !tok->key_off || !tok->key_len || !tok->surf_off ||
        !tok->surf_len || !tok->flags)
        return td_errorf(TD_ERR_NOMEM, "%s: no memory for %d ids", tok->path, n);
    memset(tok->flags, TD_TOK_F_HOLE, sz);
    return TD_OK;
}

int td_tok_byte_piece(const char *s, size_t len)
{
    if (len != 6 || memcmp(s, "<0x", 3) || s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

td_status_t td_tok_set_byte_piece(td_tokenizer_t *tok, int32_t id, int b)
{
    if (tok->byte_id[b] < 0)
        tok->byte_id[b] = id;
    char c = (char)b;
    td_status_t st = td_tok_arena_add(tok, &c, 1, &tok->surf_off[id]);
    if (st == TD_OK)
        tok->surf_len[id] = 1;
    return st;
}

td_status_t td_tok_add_norm(td_tokenizer_t *tok, td_tok_norm_kind_t kind, const char *a, const char *b)
{
    if (tok->n_norm == TD_TOK_MAX_STEPS)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: more than %d normalizer steps", tok->path, TD_TOK_MAX_STEPS);
    td_tok_norm_t *n = &tok->norm[tok->n_norm];
    n->kind = kind;
    if (a && !(n->a = strdup(a)))
        return td_errorf(TD_ERR_NOMEM, "%s: no memory", tok->path);
    if (b && !(n->b = strdup(b)))
        return td_errorf(TD_ERR_NOMEM, "%s: no memory", tok->path);
    n->a_len = a ? strlen(a) : 0;
    n->b_len = b ? strlen(b) : 0;
    tok->n_norm++;
    return TD_OK;
}

/* ---- tokenizer.bin (llama2.c) ---- */

static td_status_t load_bin(td_tokenizer_t *tok, const char *data, size_t size)
{
    td_status_t st;
    if (size < 4)
        return td_errorf(TD_ERR_FORMAT, "%s: truncated tokenizer.bin (%zu bytes, no header)", tok->path, size);
    int32_t max_len;
    memcpy(&max_len, data, 4);
    if (max_len <= 0 || max_len > 65536) {
        size_t i = td_utf8_bom_len(data, size);
        while (i < size && (data[i] == ' ' || data[i] == '\n' || data[i] == '\r' || data[i] == '\t'))
            i++;
        bool json = i < size && data[i] == '{';
        return td_errorf(TD_ERR_FORMAT, "%s: max_token_length %d is not plausible: not a llama2.c tokenizer.bin%s",
                         tok->path, max_len, json ? " (it starts like JSON: a tokenizer.json must be named *.json)"
                                                  : "");
    }
    /* first pass: count and validate */
    int32_t n = 0;
    for (size_t o = 4; o < size; n++) {
        if (size - o < 8)
            return td_errorf(TD_ERR_FORMAT, "%s: truncated at token %d (offset %zu): record header needs 8 bytes, "
                             "%zu left", tok->path, n, o, size - o);
        int32_t len;
        memcpy(&len, data + o + 4, 4);
        if (len < 0 || len > max_len)
            return td_errorf(TD_ERR_FORMAT, "%s: token %d (offset %zu) has length %d, outside [0, %d]",
                             tok->path, n, o, len, max_len);
        if (size - o - 8 < (size_t)len)
            return td_errorf(TD_ERR_FORMAT, "%s: truncated in token %d (offset %zu): %d bytes announced, %zu left",
                             tok->path, n, o, len, size - o - 8);
        o += 8 + (size_t)len;
        if (n >= TD_TOK_MAX_IDS)
            return td_errorf(TD_ERR_FORMAT, "%s: more than %d tokens", tok->path, TD_TOK_MAX_IDS);
    }
    if (n < 3)
        return td_errorf(TD_ERR_FORMAT, "%s: %d tokens; a llama2.c tokenizer has at least <unk>, <s>, </s>", tok->path, n);
    if ((st = td_tok_alloc_ids(tok, n)))
        return st;
    if (!(tok->scores = malloc((size_t)n * sizeof *tok->scores)))
        return td_errorf(TD_ERR_NOMEM, "%s: no memory for %d scores", tok->path, n);

    size_t o = 4;
    for (int32_t id = 0; id < n; id++) {
        int32_t len;
        memcpy(&tok->scores[id], data + o, 4);
        memcpy(&len, data + o + 4, 4);
        const char *p = data + o + 8;
        o += 8 + (size_t)len;
        uint32_t off;
        if ((st = td_tok_arena_add(tok, p, (size_t)len, &off)))
            return st;
        tok->piece_off[id] = tok->key_off[id] = tok->surf_off[id] = off;
        tok->piece_len[id] = tok->key_len[id] = tok->surf_len[id] = (uint32_t)len;
        tok->flags[id] = 0;
        int b = td_tok_byte_piece(p, (size_t)len);
        if (b >= 0 && id < 259) {
            tok->flags[id] |= TD_TOK_F_NOMERGE;
            if ((st = td_tok_set_byte_piece(tok, id, b)))
                return st;
        }
    }
    /* llama2.c's convention (sentencepiece's defaults): 0 <unk>, 1 <s>, 2 </s>, control */
    tok->flags[0] |= TD_TOK_F_NOMERGE;
    tok->flags[1] |= TD_TOK_F_NOMERGE | TD_TOK_F_SPECIAL;
    tok->flags[2] |= TD_TOK_F_NOMERGE | TD_TOK_F_SPECIAL;
    static const char unk_surface[] = " \xe2\x81\x87 "; /* sentencepiece's " ⁇ " */
    if ((st = td_tok_arena_add(tok, unk_surface, sizeof unk_surface - 1, &tok->surf_off[0])))
        return st;
    tok->surf_len[0] = sizeof unk_surface - 1;

    tok->algo = TD_TOK_ALGO_SCORES;
    tok->spm_dummy_prefix = true;
    tok->strip_leading_space = true;
    tok->byte_fallback = tok->byte_id[0] >= 0;
    tok->unk_id = 0;
    tok->bos_id = 1;
    tok->add_bos = true; /* llama2.c's run.c starts every prompt with BOS */
    tok->eos_ids[0] = 2;
    tok->n_eos = 1;
    /* llama2.c stores "▁" as ' '; sentencepiece also treats a literal "▁" in the text as a space */
    if ((st = td_tok_add_norm(tok, TD_TOK_NORM_REPLACE, "\xe2\x96\x81", " ")))
        return st;
    return td_tok_map_build(tok);
}

/* ---- shared by the loaders ---- */

void td_tok_bytelevel_tables(uint32_t b2u[256], int16_t u2b[0x144])
{
    int n = 0;
    for (int i = 0; i < 0x144; i++)
        u2b[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        b2u[b] = printable ? (uint32_t)b : (uint32_t)(256 + n++);
        u2b[b2u[b]] = (int16_t)b;
    }
}

size_t td_tok_bytelevel_to_bytes(const int16_t u2b[0x144], const char *s, size_t len, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t cl = td_tok_utf8_decode(s + i, len - i, &cp);
        if (cl && cp < 0x144 && u2b[cp] >= 0) {
            out[o++] = (char)u2b[cp];
        } else {
            if (!cl)
                cl = 1;
            memcpy(out + o, s + i, cl);
            o += cl;
        }
        i += cl;
    }
    return o;
}

td_status_t td_tok_compile_re(td_tokenizer_t *tok, const char *pattern, bool literal, pcre2_code **re_p)
{
    int err;
    PCRE2_SIZE erroff;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : 0);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, opts, &err, &erroff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: pre-tokenizer regex does not compile at offset %zu: %s",
                         tok->path, (size_t)erroff, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* falls back to the interpreter if JIT is unavailable */
    *re_p = re;
    return TD_OK;
}

td_status_t td_tok_add_pre(td_tokenizer_t *tok, td_tok_pre_t **p_p)
{
    if (tok->n_pre == TD_TOK_MAX_STEPS)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: more than %d pre-tokenizer steps", tok->path, TD_TOK_MAX_STEPS);
    *p_p = &tok->pre[tok->n_pre++];
    return TD_OK;
}

static int cmp_added(const void *a, const void *b, void *arg)
{
    const td_tokenizer_t *tok = arg;
    const td_tok_added_t *x = a, *y = b;
    uint8_t fx = (uint8_t)tok->arena[x->off], fy = (uint8_t)tok->arena[y->off];
    if (fx != fy)
        return fx < fy ? -1 : 1;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

void td_tok_index_added(td_tokenizer_t *tok)
{
    if (tok->n_added)
        qsort_r(tok->added, tok->n_added, sizeof *tok->added, cmp_added, tok);
    for (int b = 0, i = 0; b <= 256; b++) {
        while (i < (int)tok->n_added && (uint8_t)tok->arena[tok->added[i].off] < b)
            i++;
        tok->added_first[b] = (uint32_t)i;
    }
}

/* ---- entry ---- */

void td_tokenizer_destroy(td_tokenizer_t *tok)
{
    if (!tok)
        return;
    for (size_t i = 0; i < tok->n_norm; i++) {
        free(tok->norm[i].a);
        free(tok->norm[i].b);
    }
    for (size_t i = 0; i < tok->n_pre; i++) {
        pcre2_code_free(tok->pre[i].re);
        free(tok->pre[i].repl);
    }
    td_hash_free(&tok->vocab);
    td_hash_free(&tok->merges);
    free(tok->added);
    free(tok->scores);
    free(tok->flags);
    free(tok->surf_len);
    free(tok->surf_off);
    free(tok->key_len);
    free(tok->key_off);
    free(tok->piece_len);
    free(tok->piece_off);
    free(tok->arena);
    free(tok->path);
    free(tok);
}

td_status_t td_tokenizer_load(const char *path, td_tokenizer_t **tok_p)
{
    td_status_t st;
    char json_path[4096], dir[4096];
    char *data = NULL;
    size_t size = 0;
    if (!path || !*path)
        return td_errorf(TD_ERR_INVALID, "tokenizer: no path given");

    td_tokenizer_t *tok = calloc(1, sizeof *tok);
    if (!tok)
        return td_errorf(TD_ERR_NOMEM, "tokenizer: no memory");
    tok->bos_id = tok->unk_id = tok->pad_id = -1;
    for (int b = 0; b < 256; b++)
        tok->byte_id[b] = -1;

    bool is_json;
    if (td_is_dir(path)) {
        snprintf(dir, sizeof dir, "%s", path);
        if ((st = td_path_join(json_path, sizeof json_path, path, "tokenizer.json")))
            goto err;
        if (!td_is_file(json_path)) {
            /* a llama2.c model directory */
            if ((st = td_path_join(json_path, sizeof json_path, path, "tokenizer.bin")))
                goto err;
            if (!td_is_file(json_path)) {
                st = td_errorf(TD_ERR_NOT_FOUND, "%s: directory has neither tokenizer.json nor tokenizer.bin", path);
                goto err;
            }
        }
    } else if (td_gguf_is_gguf(path)) {
        if (!(tok->path = strdup(path))) {
            st = td_errorf(TD_ERR_NOMEM, "tokenizer: no memory");
            goto err;
        }
        if ((st = td_tok_load_gguf(tok)))
            goto err;
        goto done;
    } else {
        snprintf(json_path, sizeof json_path, "%s", path);
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s", path);
        snprintf(dir, sizeof dir, "%s", dirname(tmp));
    }
    if (!(tok->path = strdup(json_path))) {
        st = td_errorf(TD_ERR_NOMEM, "tokenizer: no memory");
        goto err;
    }
    if ((st = td_file_read_all(json_path, TD_TOK_MAX_FILE, &data, &size)))
        goto err;
    /* The format comes from the name (tokenizer.json, or anything *.json, is JSON; *.bin
     * is llama2.c's); only a file named neither is recognised by its first character. */
    size_t i = td_utf8_bom_len(data, size);
    while (i < size && (data[i] == ' ' || data[i] == '\n' || data[i] == '\r' || data[i] == '\t'))
        i++;
    const char *name = strrchr(json_path, '/') ? strrchr(json_path, '/') + 1 : json_path;
    size_t nl = strlen(name);
    bool named_json = nl >= 5 && !strcasecmp(name + nl - 5, ".json");
    bool named_bin = nl >= 4 && !strcasecmp(name + nl - 4, ".bin");
    is_json = named_json || (!named_bin && i < size && data[i] == '{');
    if (size == 0 || (i == size && !named_bin)) {
        const char *want = named_json  ? "a tokenizer.json object"
                           : named_bin ? "a llama2.c tokenizer.bin"
                                       : "a tokenizer.json or a llama2.c tokenizer.bin";
        st = td_errorf(TD_ERR_FORMAT, "%s: empty file (%zu bytes%s): expected %s", tok->path, size,
                       size ? ", all blank" : "", want);
        goto err;
    }
    if (is_json) {
        free(data);
        data = NULL;
        st = td_tok_load_json(tok, json_path, dir);
    } else {
        st = load_bin(tok, data, size);
    }
    if (st)
        goto err;
    free(data);
done:
    td_tok_bound_tokens(tok);
    td_debug("tokenizer %s: %d ids, bos %d, %zu eos", tok->path, tok->n_vocab, tok->bos_id, tok->n_eos);
    *tok_p = tok;
    return TD_OK;
err:
    free(data);
    td_tokenizer_destroy(tok);
    return st;
}
