/*
 * td_tok_json: a tokenizer from Hugging Face's tokenizer.json (+ tokenizer_config.json /
 * generation_config.json for BOS/EOS): a BPE model, its normalizer, pre-tokenizer and
 * decoder, added tokens and merges. Supported pieces of tokenizer.json are listed in
 * docs/tokenizers.md; anything else is refused with TD_ERR_UNSUPPORTED rather than
 * silently encoding differently from the reference. Every rejection names the file and
 * what is wrong with it.
 */
#include "td_tokenizer_int.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "td_log.h"
#include "td_util.h"

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

td_status_t td_tok_load_json(td_tokenizer_t *tok, const char *json_path, const char *dir)
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
