/*
 * td_tok_load: reading tokenizers from disk: llama2.c's tokenizer.bin and Hugging Face's
 * tokenizer.json (+ tokenizer_config.json / generation_config.json for BOS/EOS). Every
 * rejection names the file and what is wrong with it; nothing here trusts a length or an
 * id from the file before checking it. Supported pieces of tokenizer.json are listed in
 * docs/tokenizers.md; anything else is refused with TD_ERR_UNSUPPORTED rather than
 * silently encoding differently from the reference.
 */
#include "td_tokenizer_int.h"

#include <cjson/cJSON.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "td_gguf.h"
#include "td_log.h"
#include "td_util.h"

#define TD_TOK_MAX_FILE (1024u * 1024u * 1024u)
#define TD_TOK_MAX_IDS (1 << 24)

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

/* ---- tokenizer.json (Hugging Face) ---- */

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

static const char *json_str(const cJSON *o, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static bool json_bool(const cJSON *o, const char *name, bool dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
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

static td_status_t parse_normalizer(td_tokenizer_t *tok, const cJSON *n)
{
    td_status_t st;
    if (!n || cJSON_IsNull(n))
        return TD_OK;
    const char *type = json_str(n, "type");
    if (!type)
        return td_errorf(TD_ERR_FORMAT, "%s: normalizer without a \"type\"", tok->path);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "normalizers"), *it;
        if (!cJSON_IsArray(list))
            return td_errorf(TD_ERR_FORMAT, "%s: Sequence normalizer without a \"normalizers\" array", tok->path);
        cJSON_ArrayForEach(it, list)
        if ((st = parse_normalizer(tok, it)))
            return st;
        return TD_OK;
    }
    if (!strcmp(type, "NFC"))
        return td_tok_add_norm(tok, TD_TOK_NORM_NFC, NULL, NULL);
    if (!strcmp(type, "Prepend")) {
        const char *p = json_str(n, "prepend");
        if (!p)
            return td_errorf(TD_ERR_FORMAT, "%s: Prepend normalizer without a \"prepend\" string", tok->path);
        return td_tok_add_norm(tok, TD_TOK_NORM_PREPEND, p, NULL);
    }
    if (!strcmp(type, "Replace")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
        const char *from = json_str(pat, "String"), *to = json_str(n, "content");
        if (!from || !to)
            return td_errorf(TD_ERR_UNSUPPORTED, "%s: Replace normalizer: only {\"pattern\": {\"String\": ...}, "
                             "\"content\": ...} is supported", tok->path);
        if (!*from)
            return td_errorf(TD_ERR_FORMAT, "%s: Replace normalizer with an empty pattern", tok->path);
        return td_tok_add_norm(tok, TD_TOK_NORM_REPLACE, from, to);
    }
    return td_errorf(TD_ERR_UNSUPPORTED, "%s: normalizer type \"%s\" is not supported (supported: Sequence, NFC, "
                     "Prepend, Replace)", tok->path, type);
}

td_status_t td_tok_add_pre(td_tokenizer_t *tok, td_tok_pre_t **p_p)
{
    if (tok->n_pre == TD_TOK_MAX_STEPS)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: more than %d pre-tokenizer steps", tok->path, TD_TOK_MAX_STEPS);
    *p_p = &tok->pre[tok->n_pre++];
    return TD_OK;
}

static td_status_t parse_pre(td_tokenizer_t *tok, const cJSON *n)
{
    td_status_t st;
    td_tok_pre_t *p = NULL;
    if (!n || cJSON_IsNull(n))
        return TD_OK;
    const char *type = json_str(n, "type");
    if (!type)
        return td_errorf(TD_ERR_FORMAT, "%s: pre_tokenizer without a \"type\"", tok->path);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "pretokenizers"), *it;
        if (!cJSON_IsArray(list))
            return td_errorf(TD_ERR_FORMAT, "%s: Sequence pre_tokenizer without a \"pretokenizers\" array", tok->path);
        cJSON_ArrayForEach(it, list)
        if ((st = parse_pre(tok, it)))
            return st;
        return TD_OK;
    }
    if (!strcmp(type, "Split")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
        const char *re = json_str(pat, "Regex"), *lit = json_str(pat, "String");
        const char *behavior = json_str(n, "behavior");
        if (!re && !lit)
            return td_errorf(TD_ERR_FORMAT, "%s: Split pre_tokenizer without a Regex or String pattern", tok->path);
        if (!behavior || strcmp(behavior, "Isolated") || json_bool(n, "invert", false))
            return td_errorf(TD_ERR_UNSUPPORTED, "%s: Split pre_tokenizer: only behavior \"Isolated\" without invert "
                             "is supported (got \"%s\")", tok->path, behavior ? behavior : "(none)");
        if ((st = td_tok_add_pre(tok, &p)))
            return st;
        p->kind = TD_TOK_PRE_SPLIT;
        return td_tok_compile_re(tok, re ? re : lit, !re, &p->re);
    }
    if (!strcmp(type, "ByteLevel")) {
        if ((st = td_tok_add_pre(tok, &p)))
            return st;
        p->kind = TD_TOK_PRE_BYTELEVEL;
        p->add_prefix_space = json_bool(n, "add_prefix_space", true);
        tok->byte_level = true;
        if (json_bool(n, "use_regex", true))
            return td_tok_compile_re(tok, td_tok_gpt2_pattern, false, &p->re);
        return TD_OK;
    }
    if (!strcmp(type, "Metaspace")) {
        if ((st = td_tok_add_pre(tok, &p)))
            return st;
        p->kind = TD_TOK_PRE_METASPACE;
        const char *r = json_str(n, "replacement");
        if (!r)
            r = "\xe2\x96\x81";
        if (!(p->repl = strdup(r)))
            return td_errorf(TD_ERR_NOMEM, "%s: no memory", tok->path);
        p->repl_len = strlen(r);
        const char *scheme = json_str(n, "prepend_scheme");
        if (scheme)
            p->prepend = !strcmp(scheme, "always") ? 2 : !strcmp(scheme, "first") ? 1 : 0;
        else
            p->prepend = json_bool(n, "add_prefix_space", true) ? 2 : 0;
        p->split = json_bool(n, "split", true);
        return TD_OK;
    }
    return td_errorf(TD_ERR_UNSUPPORTED, "%s: pre_tokenizer type \"%s\" is not supported (supported: Sequence, "
                     "Split, ByteLevel, Metaspace)", tok->path, type);
}

/* What the decoder does, gathered from its steps. */
typedef struct dec_cfg {
    bool byte_level, byte_fallback, strip;
    const char *repl_from, *repl_to;
} dec_cfg_t;

static td_status_t parse_decoder(td_tokenizer_t *tok, const cJSON *n, dec_cfg_t *d)
{
    td_status_t st;
    if (!n || cJSON_IsNull(n))
        return TD_OK;
    const char *type = json_str(n, "type");
    if (!type)
        return td_errorf(TD_ERR_FORMAT, "%s: decoder without a \"type\"", tok->path);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "decoders"), *it;
        if (!cJSON_IsArray(list))
            return td_errorf(TD_ERR_FORMAT, "%s: Sequence decoder without a \"decoders\" array", tok->path);
        cJSON_ArrayForEach(it, list)
        if ((st = parse_decoder(tok, it, d)))
            return st;
        return TD_OK;
    }
    if (!strcmp(type, "ByteLevel")) {
        d->byte_level = true;
    } else if (!strcmp(type, "ByteFallback")) {
        d->byte_fallback = true;
    } else if (!strcmp(type, "Fuse")) {
    } else if (!strcmp(type, "Replace")) {
        d->repl_from = json_str(cJSON_GetObjectItemCaseSensitive(n, "pattern"), "String");
        d->repl_to = json_str(n, "content");
        if (!d->repl_from || !d->repl_to || !*d->repl_from || strlen(d->repl_to) > strlen(d->repl_from))
            return td_errorf(TD_ERR_UNSUPPORTED, "%s: Replace decoder: only a String pattern replaced by "
                             "something no longer is supported", tok->path);
    } else if (!strcmp(type, "Strip")) {
        const char *c = json_str(n, "content");
        const cJSON *start = cJSON_GetObjectItemCaseSensitive(n, "start");
        const cJSON *stop = cJSON_GetObjectItemCaseSensitive(n, "stop");
        if (!c || strcmp(c, " ") || !cJSON_IsNumber(start) || start->valuedouble > 1 ||
            (cJSON_IsNumber(stop) && stop->valuedouble != 0))
            return td_errorf(TD_ERR_UNSUPPORTED, "%s: Strip decoder: only content \" \", start <= 1, stop 0 is "
                             "supported", tok->path);
        d->strip = start->valuedouble == 1;
    } else if (!strcmp(type, "Metaspace")) {
        const char *r = json_str(n, "replacement");
        d->repl_from = r ? r : "\xe2\x96\x81";
        d->repl_to = " ";
        const char *scheme = json_str(n, "prepend_scheme");
        d->strip = scheme ? strcmp(scheme, "never") != 0 : json_bool(n, "add_prefix_space", true);
    } else {
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: decoder type \"%s\" is not supported (supported: Sequence, "
                         "ByteLevel, ByteFallback, Fuse, Replace, Strip, Metaspace)", tok->path, type);
    }
    return TD_OK;
}

/* "<s>" or {"content": "<s>", ...} in tokenizer_config.json */
static const char *config_token(const cJSON *cfg, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, name);
    if (cJSON_IsString(v))
        return v->valuestring;
    if (cJSON_IsObject(v))
        return json_str(v, "content");
    return NULL;
}

static int32_t lookup_token(const td_tokenizer_t *tok, const char *s)
{
    if (!s)
        return -1;
    return td_tokenizer_piece_to_id(tok, s, strlen(s));
}

static void add_eos(td_tokenizer_t *tok, int32_t id)
{
    if (id < 0 || id >= tok->n_vocab || tok->n_eos == TD_TOK_MAX_EOS)
        return;
    for (size_t i = 0; i < tok->n_eos; i++)
        if (tok->eos_ids[i] == id)
            return;
    tok->eos_ids[tok->n_eos++] = id;
}

static td_status_t parse_json_file(const char *path, bool required, cJSON **root_p)
{
    char *data;
    size_t len;
    *root_p = NULL;
    if (!required && !td_is_file(path))
        return TD_OK;
    td_status_t st = td_file_read_all(path, TD_TOK_MAX_FILE, &data, &len);
    if (st)
        return st;
    /* a UTF-8 byte-order mark (Windows editors write one) carries no content: skipped */
    size_t bom = td_utf8_bom_len(data, len);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(data + bom, len - bom, &end, false);
    if (!root) {
        size_t off = end && end >= data ? (size_t)(end - data) : 0;
        size_t line = 1;
        for (size_t i = 0; i < off && i < len; i++)
            line += data[i] == '\n';
        free(data);
        return td_errorf(TD_ERR_FORMAT, "%s: invalid JSON near byte %zu (line %zu)", path, off, line);
    }
    free(data);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return td_errorf(TD_ERR_FORMAT, "%s: top level is not a JSON object", path);
    }
    *root_p = root;
    return TD_OK;
}

/* Reads tokenizer_config.json and generation_config.json beside the tokenizer (if there)
 * for BOS/EOS, then falls back to well-known special tokens. */
static td_status_t load_specials(td_tokenizer_t *tok, const char *dir)
{
    td_status_t st;
    char p[4096];
    cJSON *cfg = NULL, *gen = NULL;
    const char *bos = NULL, *eos = NULL;
    bool have_cfg = false;
    if ((st = td_path_join(p, sizeof p, dir, "tokenizer_config.json")) == TD_OK &&
        (st = parse_json_file(p, false, &cfg)))
        return st;
    if (cfg) {
        have_cfg = true;
        bos = config_token(cfg, "bos_token");
        eos = config_token(cfg, "eos_token");
    }
    tok->bos_id = lookup_token(tok, bos);
    add_eos(tok, lookup_token(tok, eos));
    if (!have_cfg) {
        static const char *const bos_names[] = {"<s>", "<|begin_of_text|>", "<bos>"};
        for (size_t i = 0; i < TD_ARRAY_LEN(bos_names) && tok->bos_id < 0; i++)
            tok->bos_id = lookup_token(tok, bos_names[i]);
    }
    /* transformers' default when the config does not say: BOS where there is one */
    tok->add_bos = tok->bos_id >= 0 && json_bool(cfg, "add_bos_token", true);
    tok->add_eos = tok->n_eos && json_bool(cfg, "add_eos_token", false);
    if (td_path_join(p, sizeof p, dir, "generation_config.json") == TD_OK) {
        if ((st = parse_json_file(p, false, &gen))) {
            cJSON_Delete(cfg);
            return st;
        }
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(gen, "eos_token_id"), *it;
        if (cJSON_IsNumber(e))
            add_eos(tok, (int32_t)e->valuedouble);
        else if (cJSON_IsArray(e))
            cJSON_ArrayForEach(it, e) if (cJSON_IsNumber(it)) add_eos(tok, (int32_t)it->valuedouble);
    }
    /* end-of-turn markers of chat models end a generation too */
    static const char *const eos_names[] = {"</s>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>",
                                            "<|im_end|>", "<|endoftext|>", "<eos>", "<end_of_turn>"};
    for (size_t i = 0; i < TD_ARRAY_LEN(eos_names); i++) {
        int32_t id = lookup_token(tok, eos_names[i]);
        if (id >= 0 && (tok->flags[id] & TD_TOK_F_SPECIAL))
            add_eos(tok, id);
    }
    cJSON_Delete(gen);
    cJSON_Delete(cfg);
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

/* Whether id's vocabulary entry is s, as written or as the bytes a ByteLevel string
 * stands for. */
static bool same_token(const td_tokenizer_t *tok, int32_t id, const char *s, size_t len)
{
    return (tok->piece_len[id] == len && !memcmp(tok->arena + tok->piece_off[id], s, len)) ||
           (tok->key_len[id] == len && !memcmp(tok->arena + tok->key_off[id], s, len));
}

/* A tokenizer.json's ids are 0..n-1, each one token, each token one id. A gap would only
 * show mid-generation ("token id 274 is not in the vocabulary") and a token under two ids
 * encodes as one of them arbitrarily, so both are refused here. Needs the vocabulary map
 * and the sorted added tokens. */
static td_status_t check_ids(const td_tokenizer_t *tok)
{
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        if (tok->flags[id] & TD_TOK_F_HOLE)
            return td_errorf(TD_ERR_FORMAT, "%s: no token has id %d: the ids of model.vocab and added_tokens must "
                             "be 0..%d with no gap", tok->path, id, tok->n_vocab - 1);
        if (!tok->key_len[id])
            continue;
        int32_t first = td_tok_map_get(tok, tok->arena + tok->key_off[id], tok->key_len[id]);
        if (first != id)
            return td_errorf(TD_ERR_FORMAT, "%s: token \"%.*s\" has two ids in model.vocab, %d and %d", tok->path,
                             (int)TD_MIN(tok->piece_len[id], 64), tok->arena + tok->piece_off[id], first, id);
    }
    for (size_t i = 0; i < tok->n_added; i++) {
        const td_tok_added_t *a = &tok->added[i];
        const char *s = tok->arena + a->off;
        int32_t v = td_tok_map_get(tok, s, a->len);
        if (v >= 0 && v != a->id)
            return td_errorf(TD_ERR_FORMAT, "%s: added token \"%.*s\" has id %d, but model.vocab gives it id %d",
                             tok->path, (int)TD_MIN(a->len, 64), s, a->id, v);
        /* sorted by first byte, then length: equal contents are neighbours */
        for (size_t j = i + 1; j < tok->n_added && tok->added[j].len == a->len &&
                               tok->arena[tok->added[j].off] == s[0]; j++)
            if (!memcmp(tok->arena + tok->added[j].off, s, a->len))
                return td_errorf(TD_ERR_FORMAT, "%s: added token \"%.*s\" has two ids, %d and %d", tok->path,
                                 (int)TD_MIN(a->len, 64), s, a->id, tok->added[j].id);
    }
    return TD_OK;
}

/* The parts of tokenizer.json that load_json reads, each checked for its shape. */
typedef struct json_model {
    const cJSON *model;  /* "model": its type, options and unk_token */
    const cJSON *vocab;  /* model.vocab: piece -> id */
    const cJSON *merges; /* model.merges, or NULL */
    const cJSON *added;  /* added_tokens, or NULL */
} json_model_t;

/* Finds the model's parts in root and refuses what is not a BPE model we can load. */
static td_status_t json_model_check(const td_tokenizer_t *tok, const cJSON *root, json_model_t *m)
{
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model))
        return td_errorf(TD_ERR_FORMAT, "%s: no \"model\" object", tok->path);
    const char *mtype = json_str(model, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (mtype ? strcmp(mtype, "BPE") != 0 : !merges)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: model type \"%s\" is not supported (only BPE)", tok->path,
                         mtype ? mtype : "(none)");
    if (!cJSON_IsObject(vocab))
        return td_errorf(TD_ERR_FORMAT, "%s: model.vocab is not an object of piece: id", tok->path);
    if (merges && !cJSON_IsArray(merges) && !cJSON_IsNull(merges))
        return td_errorf(TD_ERR_FORMAT, "%s: model.merges is not an array", tok->path);
    const char *cont = json_str(model, "continuing_subword_prefix"), *eow = json_str(model, "end_of_word_suffix");
    if ((cont && *cont) || (eow && *eow))
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: BPE continuing_subword_prefix / end_of_word_suffix are not "
                         "supported", tok->path);
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (cJSON_IsNumber(dropout) && dropout->valuedouble > 0)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: BPE dropout is not supported", tok->path);
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (added && !cJSON_IsArray(added) && !cJSON_IsNull(added))
        return td_errorf(TD_ERR_FORMAT, "%s: added_tokens is not an array", tok->path);
    *m = (json_model_t){.model = model, .vocab = vocab, .merges = merges, .added = added};
    return TD_OK;
}

/* Sizes the id tables for the largest id of the vocabulary and the added tokens; *kcap_p:
 * a key buffer that holds any vocabulary piece's key. */
static td_status_t json_alloc_ids(td_tokenizer_t *tok, const json_model_t *m, size_t *kcap_p)
{
    int32_t n = 0;
    const cJSON *it;
    size_t max_piece = 1;
    cJSON_ArrayForEach(it, m->vocab) {
        if (!cJSON_IsNumber(it) || it->valuedouble < 0 || it->valuedouble >= TD_TOK_MAX_IDS ||
            it->valuedouble != (double)(int32_t)it->valuedouble)
            return td_errorf(TD_ERR_FORMAT, "%s: model.vocab[\"%s\"] is not an id in [0, %d)", tok->path,
                             it->string, TD_TOK_MAX_IDS);
        n = TD_MAX(n, (int32_t)it->valuedouble + 1);
        max_piece = TD_MAX(max_piece, strlen(it->string) * 2 + 8);
    }
    cJSON_ArrayForEach(it, m->added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(it, "id");
        const char *content = json_str(it, "content");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= TD_TOK_MAX_IDS || !content || !*content)
            return td_errorf(TD_ERR_FORMAT, "%s: an added_tokens entry lacks a valid \"id\" or non-empty \"content\"",
                             tok->path);
        n = TD_MAX(n, (int32_t)id->valuedouble + 1);
    }
    if (n == 0)
        return td_errorf(TD_ERR_FORMAT, "%s: empty vocabulary", tok->path);
    *kcap_p = max_piece;
    return td_tok_alloc_ids(tok, n);
}

/* The vocabulary's pieces: each id's piece, its key (bytes, for a byte-level vocabulary)
 * and its surface (what the decoder makes of it); the byte pieces. kbuf: scratch of the
 * size json_alloc_ids gave. */
static td_status_t json_load_vocab(td_tokenizer_t *tok, const cJSON *vocab, const dec_cfg_t *dec,
                                   const int16_t u2b[0x144], char *kbuf)
{
    td_status_t st;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab) {
        int32_t id = (int32_t)it->valuedouble;
        const char *s = it->string;
        size_t len = strlen(s);
        if (!(tok->flags[id] & TD_TOK_F_HOLE))
            return td_errorf(TD_ERR_FORMAT, "%s: id %d appears twice in model.vocab", tok->path, id);
        tok->flags[id] = 0;
        if ((st = td_tok_arena_add(tok, s, len, &tok->piece_off[id])))
            return st;
        tok->piece_len[id] = (uint32_t)len;
        tok->key_off[id] = tok->surf_off[id] = tok->piece_off[id];
        tok->key_len[id] = tok->surf_len[id] = (uint32_t)len;
        if (tok->byte_level) {
            size_t kl = td_tok_bytelevel_to_bytes(u2b, s, len, kbuf);
            if ((st = td_tok_arena_add(tok, kbuf, kl, &tok->key_off[id])))
                return st;
            tok->key_len[id] = tok->surf_len[id] = (uint32_t)kl;
            tok->surf_off[id] = tok->key_off[id];
            if (kl == 1 && tok->byte_id[(uint8_t)kbuf[0]] < 0)
                tok->byte_id[(uint8_t)kbuf[0]] = id;
            continue;
        }
        int b = td_tok_byte_piece(s, len);
        if (b >= 0) {
            if (dec->byte_fallback && (st = td_tok_set_byte_piece(tok, id, b)))
                return st;
            if (tok->byte_id[b] < 0)
                tok->byte_id[b] = id;
            continue;
        }
        if (dec->repl_from) {
            /* surface: the decoder's Replace ("▁" -> " ") */
            size_t fl = strlen(dec->repl_from), tl = strlen(dec->repl_to), o = 0;
            char *buf = kbuf;
            for (size_t i = 0; i < len;) {
                if (len - i >= fl && !memcmp(s + i, dec->repl_from, fl)) {
                    memcpy(buf + o, dec->repl_to, tl);
                    o += tl;
                    i += fl;
                } else {
                    buf[o++] = s[i++];
                }
            }
            if ((st = td_tok_arena_add(tok, buf, o, &tok->surf_off[id])))
                return st;
            tok->surf_len[id] = (uint32_t)o;
        }
    }
    return TD_OK;
}

/* Added tokens: matched in the text; their surface is their content. */
static td_status_t json_load_added(td_tokenizer_t *tok, const cJSON *added)
{
    td_status_t st;
    const cJSON *it;
    size_t n_added = (size_t)cJSON_GetArraySize(added);
    if (n_added && !(tok->added = calloc(n_added, sizeof *tok->added)))
        return td_errorf(TD_ERR_NOMEM, "%s: no memory for added tokens", tok->path);
    cJSON_ArrayForEach(it, added) {
        int32_t id = (int32_t)cJSON_GetObjectItemCaseSensitive(it, "id")->valuedouble;
        const char *content = json_str(it, "content");
        size_t len = strlen(content);
        uint32_t off;
        if (tok->flags[id] & TD_TOK_F_ADDED)
            return td_errorf(TD_ERR_FORMAT, "%s: added_tokens has id %d twice (\"%.64s\" and \"%.*s\")", tok->path,
                             id, content, (int)TD_MIN(tok->piece_len[id], 64), tok->arena + tok->piece_off[id]);
        if (!(tok->flags[id] & TD_TOK_F_HOLE) && !same_token(tok, id, content, len))
            return td_errorf(TD_ERR_FORMAT, "%s: added_tokens gives id %d to \"%.64s\", but model.vocab gives it to "
                             "\"%.*s\"", tok->path, id, content, (int)TD_MIN(tok->piece_len[id], 64),
                             tok->arena + tok->piece_off[id]);
        if ((st = td_tok_arena_add(tok, content, len, &off)))
            return st;
        if (tok->flags[id] & TD_TOK_F_HOLE) {
            tok->flags[id] = 0;
            tok->piece_off[id] = tok->surf_off[id] = off;
            tok->piece_len[id] = tok->surf_len[id] = (uint32_t)len;
        }
        tok->flags[id] |= TD_TOK_F_ADDED;
        if (json_bool(it, "special", false))
            tok->flags[id] |= TD_TOK_F_SPECIAL;
        tok->added[tok->n_added++] = (td_tok_added_t){
            .id = id, .off = off, .len = (uint32_t)len,
            .lstrip = json_bool(it, "lstrip", false), .rstrip = json_bool(it, "rstrip", false)};
    }
    td_tok_index_added(tok);
    return TD_OK;
}

/* Merges: "a b" strings or ["a", "b"] pairs, rank = position. Each side and the merged
 * piece must be in the vocabulary. *kbuf_p (of *kcap_p bytes) grows for long pairs. */
static td_status_t json_load_merges(td_tokenizer_t *tok, const cJSON *merges, const int16_t u2b[0x144],
                                    char **kbuf_p, size_t *kcap_p)
{
    td_status_t st;
    const cJSON *it;
    tok->algo = TD_TOK_ALGO_RANKS;
    size_t n_merges = merges ? (size_t)cJSON_GetArraySize(merges) : 0;
    if ((st = td_tok_merges_init(tok, n_merges)))
        return st;
    int32_t rank = 0;
    cJSON_ArrayForEach(it, merges) {
        const char *a, *b;
        size_t al, bl;
        if (cJSON_IsString(it)) {
            a = it->valuestring;
            const char *sp = strchr(a + (*a ? 1 : 0), ' ');
            if (!sp)
                return td_errorf(TD_ERR_FORMAT, "%s: merge %d \"%s\" is not \"left right\"", tok->path, rank, a);
            al = (size_t)(sp - a);
            b = sp + 1;
            bl = strlen(b);
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(it->child) &&
                   cJSON_IsString(it->child->next)) {
            a = it->child->valuestring;
            b = it->child->next->valuestring;
            al = strlen(a);
            bl = strlen(b);
        } else {
            return td_errorf(TD_ERR_FORMAT, "%s: merge %d is neither \"left right\" nor [left, right]", tok->path,
                             rank);
        }
        /* keys of left, right and the merged piece */
        size_t need = (al + bl) * 2 + 8;
        if (need > *kcap_p) {
            char *k = realloc(*kbuf_p, need);
            if (!k)
                return td_errorf(TD_ERR_NOMEM, "%s: no memory", tok->path);
            *kbuf_p = k;
            *kcap_p = need;
        }
        char *kbuf = *kbuf_p;
        size_t kl, kr;
        if (tok->byte_level) {
            kl = td_tok_bytelevel_to_bytes(u2b, a, al, kbuf);
            kr = td_tok_bytelevel_to_bytes(u2b, b, bl, kbuf + kl);
        } else {
            memcpy(kbuf, a, al);
            memcpy(kbuf + al, b, bl);
            kl = al, kr = bl;
        }
        int32_t l = td_tok_map_get(tok, kbuf, kl), r = td_tok_map_get(tok, kbuf + kl, kr);
        int32_t m = td_tok_map_get(tok, kbuf, kl + kr);
        if (l < 0 || r < 0 || m < 0) {
            /* HF refuses such a file too (MergeTokenOutOfVocabulary); skipping the merge
             * would encode differently from the reference without a word */
            return td_errorf(TD_ERR_FORMAT, "%s: merge %d \"%.*s %.*s\" names %s, which is not in model.vocab",
                             tok->path, rank, (int)TD_MIN(al, 64), a, (int)TD_MIN(bl, 64), b,
                             l < 0 ? "its left token" : r < 0 ? "its right token" : "the merged token");
        }
        td_tok_merge_put(tok, l, r, rank, m);
        rank++;
    }
    return TD_OK;
}

/* The model's options (unk_token, byte_fallback, fuse_unk, ignore_merges) and the
 * decoder's strip; byte_fallback needs every byte's piece. */
static td_status_t json_model_options(td_tokenizer_t *tok, const cJSON *model, const dec_cfg_t *dec)
{
    const char *unk = json_str(model, "unk_token");
    tok->unk_id = unk ? td_tok_map_get(tok, unk, strlen(unk)) : -1;
    if (unk && tok->unk_id < 0 && !tok->byte_level)
        td_warn("tokenizer %s: unk_token \"%s\" is not in the vocabulary", tok->path, unk);
    tok->byte_fallback = json_bool(model, "byte_fallback", false);
    tok->fuse_unk = json_bool(model, "fuse_unk", false);
    tok->ignore_merges = json_bool(model, "ignore_merges", false);
    tok->strip_leading_space = dec->strip;
    if (tok->byte_fallback) {
        for (int b = 0; b < 256; b++)
            if (tok->byte_id[b] < 0)
                return td_errorf(TD_ERR_FORMAT, "%s: byte_fallback is set but piece <0x%02X> is missing", tok->path,
                                 b);
    }
    if (tok->byte_level) {
        for (int b = 0; b < 256; b++)
            if (tok->byte_id[b] < 0)
                td_debug("tokenizer %s: byte 0x%02X has no ByteLevel token", tok->path, b);
    }
    return TD_OK;
}

/* A tokenizer.json (Hugging Face tokenizers) and the special tokens of dir's configs. */
static td_status_t load_json(td_tokenizer_t *tok, const char *json_path, const char *dir)
{
    td_status_t st;
    cJSON *root = NULL;
    char *kbuf = NULL;
    if ((st = parse_json_file(json_path, true, &root)))
        return st;
    json_model_t m = {0};
    if ((st = json_model_check(tok, root, &m)))
        goto out;

    /* pipeline first: whether the vocabulary is byte-level decides its keys */
    if ((st = parse_normalizer(tok, cJSON_GetObjectItemCaseSensitive(root, "normalizer"))) ||
        (st = parse_pre(tok, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"))))
        goto out;
    dec_cfg_t dec = {0};
    if ((st = parse_decoder(tok, cJSON_GetObjectItemCaseSensitive(root, "decoder"), &dec)))
        goto out;
    if (dec.byte_level)
        tok->byte_level = true;

    /* ids: the largest of vocab and added tokens */
    size_t kcap = 0;
    if ((st = json_alloc_ids(tok, &m, &kcap)))
        goto out;
    uint32_t b2u[256];
    int16_t u2b[0x144];
    td_tok_bytelevel_tables(b2u, u2b);
    if (!(kbuf = malloc(kcap))) {
        st = td_errorf(TD_ERR_NOMEM, "%s: no memory", tok->path);
        goto out;
    }
    if ((st = json_load_vocab(tok, m.vocab, &dec, u2b, kbuf)) || (st = json_load_added(tok, m.added)) ||
        (st = td_tok_map_build(tok)) || (st = check_ids(tok)) ||
        (st = json_load_merges(tok, m.merges, u2b, &kbuf, &kcap)) || (st = json_model_options(tok, m.model, &dec)))
        goto out;
    st = load_specials(tok, dir);
out:
    free(kbuf);
    cJSON_Delete(root);
    return st;
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
        st = load_json(tok, json_path, dir);
    } else {
        st = load_bin(tok, data, size);
    }
    if (st)
        goto err;
    free(data);
done:
    td_debug("tokenizer %s: %d ids, bos %d, %zu eos", tok->path, tok->n_vocab, tok->bos_id, tok->n_eos);
    *tok_p = tok;
    return TD_OK;
err:
    free(data);
    td_tokenizer_destroy(tok);
    return st;
}
