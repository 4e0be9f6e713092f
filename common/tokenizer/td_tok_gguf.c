/*
 * td_tok_gguf: a tokenizer from the tokenizer.ggml.* metadata of a GGUF file, encoding as
 * llama.cpp (src/llama-vocab.cpp) does on the same file.
 *
 *   tokenizer.ggml.model "gpt2": byte-level BPE. tokens are in GPT-2's ByteLevel alphabet
 *     (keys here are the raw bytes), merges "left right" rank by position, and the
 *     pre-tokenizer is a list of regexes chosen by tokenizer.ggml.pre; each regex splits the
 *     pieces of the one before (matches and the gaps between them are both pieces), as
 *     llama.cpp's unicode_regex_split does.
 *   tokenizer.ggml.model "llama": SentencePiece BPE by tokenizer.ggml.scores, byte
 *     fallback to <0xXX> pieces, a dummy prefix space (tokenizer.ggml.add_space_prefix,
 *     default true) at the start and after each special token.
 *
 * tokenizer.ggml.token_type says what each id is (1 normal, 2 unknown, 3 control, 4
 * user-defined, 5 unused, 6 byte). Control, unknown and user-defined tokens are cut out of
 * the text before the model runs (llama.cpp's parse_special, which llama-tokenize does by
 * default); with TD_TOK_NO_PARSE_SPECIAL only user-defined ones are, as llama.cpp. Control
 * and unknown tokens are special (decode skips them); a user-defined token decodes to its
 * text as written. Like llama.cpp, end-of-turn tokens known by name (<|im_end|>,
 * <|eot_id|>, ...) are control tokens and end a generation, whatever their type says.
 */
#include "td_tokenizer_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_gguf.h"
#include "td_log.h"
#include "td_util.h"

/* llama.cpp's token types (llama.h: enum llama_token_type). */
enum {
    TT_NORMAL = 1,
    TT_UNKNOWN = 2,
    TT_CONTROL = 3,
    TT_USER_DEFINED = 4,
    TT_UNUSED = 5,
    TT_BYTE = 6,
};

/* Pre-tokenizers by tokenizer.ggml.pre, with llama.cpp's regex lists (llm_tokenizer_bpe).
 * llama.cpp runs the GPT-2, Llama 3 and Qwen 2 regexes by hand-written matchers that
 * implement them; PCRE2 runs them here. The GPT-2 one is td_tok_gpt2_pattern: its final
 * "\s+" alternative only names the gaps the other alternatives leave, which are pieces
 * anyway. */
#define RE_LLAMA3                                                                                                   \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "          \
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define RE_QWEN2                                                                                                    \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "               \
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

typedef struct pre_def {
    const char *names;        /* the tokenizer.ggml.pre values, '|'-separated */
    const char *re[4];        /* regexes in order; NULL ends; "" stands for td_tok_gpt2_pattern */
    bool ignore_merges;       /* a pre-token that is a token is not split (llama3) */
    bool add_bos;             /* llama.cpp's default when the file has no add_bos_token */
} pre_def_t;

static const pre_def_t pre_defs[] = {
    {"default", {"[\\p{P}\\$\\+<=>\\^~\\|]+", "", "\\p{N}+", "[0-9][0-9][0-9]"}, false, false},
    {"llama3|llama-v3|llama-bpe", {RE_LLAMA3}, true, true},
    {"qwen2", {RE_QWEN2}, false, false},
    {"gpt-2", {""}, false, false},
    {"smollm", {"\\p{N}", ""}, false, false},
};

static bool name_in(const char *names, const char *s, size_t len)
{
    for (const char *p = names;;) {
        const char *e = strchr(p, '|');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == len && !memcmp(p, s, len))
            return true;
        if (!e)
            return false;
        p = e + 1;
    }
}

/* End-of-generation tokens llama.cpp recognises by their text (and makes control tokens,
 * so they are matched in the text), with its two exceptions: "<|end|>" is a user-defined
 * token, not an end, beside "<|return|>" + "<|call|>" (or "<|calls|>" + "<|flush|>"), and
 * "</s>" stays normal beside "<|tool_response>" or "<|plamo:eos|>". */
static const char *const eog_names[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81"
    "sentence\xef\xbd\x9c>", "[e~["};
/* Tokens llama.cpp always treats as user-defined (gpt-oss's, rendered when decoding). */
static const char *const user_names[] = {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"};
/* Tokens whose presence decides the exceptions above. */
static const char *const marker_names[] = {"<|return|>", "<|call|>", "<|calls|>", "<|flush|>", "<|tool_response>",
                                           "<|plamo:eos|>"};

static bool name_is(const char *name, td_gguf_str_t t)
{
    return strlen(name) == t.len && !memcmp(name, t.data, t.len);
}

static bool in_names(const char *const *names, size_t n, td_gguf_str_t t)
{
    for (size_t i = 0; i < n; i++)
        if (name_is(names[i], t))
            return true;
    return false;
}

static void add_eog(td_tokenizer_t *tok, int32_t id)
{
    if (id < 0 || tok->n_eos == TD_TOK_MAX_EOS || td_tokenizer_is_eos(tok, id))
        return;
    tok->eos_ids[tok->n_eos++] = id;
}

/* An optional uint key holding a token id: *id_p keeps its default when the key is absent;
 * an id outside the vocabulary is ignored with a warning, as llama.cpp does. */
static td_status_t special_id(td_tokenizer_t *tok, const td_gguf_t *g, const char *key, int32_t *id_p)
{
    if (*id_p >= tok->n_vocab)
        *id_p = -1;
    if (!td_gguf_find(g, key))
        return TD_OK;
    uint64_t v;
    td_status_t st = td_gguf_get_uint(g, key, &v);
    if (st)
        return st;
    if (v >= (uint64_t)tok->n_vocab)
        td_warn("tokenizer %s: %s = %llu is not an id of the %d-token vocabulary: ignored", tok->path, key,
                (unsigned long long)v, tok->n_vocab);
    else
        *id_p = (int32_t)v;
    return TD_OK;
}

static td_status_t opt_bool(const td_gguf_t *g, const char *key, bool *v)
{
    return td_gguf_find(g, key) ? td_gguf_get_bool(g, key, v) : TD_OK;
}

static td_status_t set_pre(td_tokenizer_t *tok, const td_gguf_t *g)
{
    td_status_t st;
    td_gguf_str_t name = {"default", 7};
    if (td_gguf_find(g, "tokenizer.ggml.pre")) {
        if ((st = td_gguf_get_str(g, "tokenizer.ggml.pre", &name)))
            return st;
        if (name.len == 0)
            name = (td_gguf_str_t){"default", 7}; /* llama.cpp: empty means default, with a warning */
    } else {
        td_warn("tokenizer %s: no tokenizer.ggml.pre: using the \"default\" pre-tokenizer, as llama.cpp does "
                "(encoding may differ from the model's own tokenizer)", tok->path);
    }
    const pre_def_t *d = NULL;
    for (size_t i = 0; i < TD_ARRAY_LEN(pre_defs) && !d; i++)
        if (name_in(pre_defs[i].names, name.data, name.len))
            d = &pre_defs[i];
    if (!d)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: tokenizer.ggml.pre \"%.*s\" is not supported (supported: default, "
                         "llama3, llama-v3, llama-bpe, qwen2, gpt-2, smollm)", tok->path, (int)TD_MIN(name.len, 64),
                         name.data);
    for (size_t i = 0; i < TD_ARRAY_LEN(d->re) && d->re[i]; i++) {
        td_tok_pre_t *p;
        if ((st = td_tok_add_pre(tok, &p)))
            return st;
        p->kind = TD_TOK_PRE_SPLIT;
        if ((st = td_tok_compile_re(tok, *d->re[i] ? d->re[i] : td_tok_gpt2_pattern, false, &p->re)))
            return st;
    }
    tok->ignore_merges = d->ignore_merges;
    tok->add_bos = d->add_bos;
    return TD_OK;
}

/* Merges "left right" (ByteLevel alphabet), rank = position. */
static td_status_t load_merges(td_tokenizer_t *tok, const td_gguf_t *g, const int16_t u2b[0x144])
{
    td_status_t st;
    const td_gguf_kv_t *kv;
    if ((st = td_gguf_get_array(g, "tokenizer.ggml.merges", TD_GGUF_STRING, &kv)))
        return st;
    if (kv->arr_len > INT32_MAX)
        return td_errorf(TD_ERR_FORMAT, "%s: %zu merges are too many", tok->path, kv->arr_len);
    if ((st = td_tok_merges_init(tok, kv->arr_len)))
        return st;
    char *kbuf = NULL;
    size_t cap = 0;
    for (size_t i = 0; i < kv->arr_len; i++) {
        td_gguf_str_t m = td_gguf_arr_str(kv, i);
        const char *sp = m.len > 1 ? memchr(m.data + 1, ' ', m.len - 1) : NULL;
        if (!sp) {
            st = td_errorf(TD_ERR_FORMAT, "%s: tokenizer.ggml.merges[%zu] \"%.*s\" is not \"left right\"", tok->path,
                           i, (int)TD_MIN(m.len, 64), m.data);
            goto out;
        }
        size_t al = (size_t)(sp - m.data), bl = m.len - al - 1;
        if (m.len > cap) {
            char *k = realloc(kbuf, m.len);
            if (!k) {
                st = td_errorf(TD_ERR_NOMEM, "%s: no memory", tok->path);
                goto out;
            }
            kbuf = k;
            cap = m.len;
        }
        size_t kl = td_tok_bytelevel_to_bytes(u2b, m.data, al, kbuf);
        size_t kr = td_tok_bytelevel_to_bytes(u2b, sp + 1, bl, kbuf + kl);
        int32_t l = td_tok_map_get(tok, kbuf, kl), r = td_tok_map_get(tok, kbuf + kl, kr);
        int32_t res = td_tok_map_get(tok, kbuf, kl + kr);
        if (l < 0 || r < 0 || res < 0) {
            /* merges work on ids here; llama.cpp would merge the text anyway and look
             * the result up later, which only differs for a vocabulary like this one */
            st = td_errorf(TD_ERR_UNSUPPORTED, "%s: tokenizer.ggml.merges[%zu] \"%.*s\" names %s, which is not a token",
                           tok->path, i, (int)TD_MIN(m.len, 64), m.data,
                           l < 0 ? "its left part" : r < 0 ? "its right part" : "the merged piece");
            goto out;
        }
        td_tok_merge_put(tok, l, r, (int32_t)i, res);
    }
out:
    free(kbuf);
    return st;
}

/* The vocabulary's arrays in the file: tokens, and their types and scores when present. */
typedef struct gguf_vocab {
    const td_gguf_kv_t *tokens, *types, *scores; /* types, scores: NULL when absent */
    size_t n;                                     /* tokens */
    bool bpe, spm;                                /* tokenizer.ggml.model "gpt2", "llama" */
} gguf_vocab_t;

/* Finds the vocabulary's arrays and checks that they agree with each other and the model. */
static td_status_t gguf_vocab_find(const td_tokenizer_t *tok, const td_gguf_t *g, gguf_vocab_t *v)
{
    td_status_t st;
    td_gguf_str_t model;
    if ((st = td_gguf_get_str(g, "tokenizer.ggml.model", &model)))
        return st;
    v->bpe = model.len == 4 && !memcmp(model.data, "gpt2", 4);
    v->spm = model.len == 5 && !memcmp(model.data, "llama", 5);
    if (!v->bpe && !v->spm)
        return td_errorf(TD_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model \"%.*s\" is not supported (supported: gpt2, "
                         "llama)", tok->path, (int)TD_MIN(model.len, 64), model.data);
    v->types = v->scores = NULL;
    if ((st = td_gguf_get_array(g, "tokenizer.ggml.tokens", TD_GGUF_STRING, &v->tokens)))
        return st;
    size_t n = v->n = v->tokens->arr_len;
    if (n == 0 || n > (1u << 24))
        return td_errorf(TD_ERR_FORMAT, "%s: tokenizer.ggml.tokens has %zu tokens (expected 1..%u)", tok->path, n,
                         1u << 24);
    if (td_gguf_find(g, "tokenizer.ggml.token_type") &&
        (st = td_gguf_get_array(g, "tokenizer.ggml.token_type", TD_GGUF_I32, &v->types)))
        return st;
    if (td_gguf_find(g, "tokenizer.ggml.scores") &&
        (st = td_gguf_get_array(g, "tokenizer.ggml.scores", TD_GGUF_F32, &v->scores)))
        return st;
    const td_gguf_kv_t *types = v->types, *scores = v->scores;
    if ((types && types->arr_len < n) || (scores && scores->arr_len < n))
        return td_errorf(TD_ERR_FORMAT, "%s: tokenizer.ggml.%s has %zu entries for %zu tokens", tok->path,
                         types && types->arr_len < n ? "token_type" : "scores",
                         types && types->arr_len < n ? types->arr_len : scores->arr_len, n);
    if (v->spm && !scores)
        return td_errorf(TD_ERR_FORMAT, "%s: a \"llama\" (SentencePiece) tokenizer needs tokenizer.ggml.scores",
                         tok->path);
    return TD_OK;
}

/* Token i, text t, of llama.cpp's type `type`: its piece, key and surface, its byte, and
 * whether the raw text is searched for it. kbuf: scratch of 3 x t.len + 1 bytes. */
static td_status_t gguf_add_token(td_tokenizer_t *tok, const gguf_vocab_t *v, size_t i, td_gguf_str_t t,
                                  int64_t type, const int16_t u2b[0x144], char *kbuf)
{
    td_status_t st;
    int32_t id = (int32_t)i;
    tok->flags[id] = 0;
    if ((st = td_tok_arena_add(tok, t.data, t.len, &tok->piece_off[id])))
        return st;
    tok->piece_len[id] = (uint32_t)t.len;
    /* the model key: raw bytes (byte-level) or the text as written ("▁" for spaces);
     * the surface decode gives: the bytes, or the text with "▁" read as a space */
    if (v->bpe) {
        size_t kl = td_tok_bytelevel_to_bytes(u2b, t.data, t.len, kbuf);
        if ((st = td_tok_arena_add(tok, kbuf, kl, &tok->key_off[id])))
            return st;
        tok->key_len[id] = tok->surf_len[id] = (uint32_t)kl;
        tok->surf_off[id] = tok->key_off[id];
    } else {
        size_t sl = 0;
        for (size_t k = 0; k < t.len;) {
            if (t.len - k >= 3 && !memcmp(t.data + k, "\xe2\x96\x81", 3)) {
                kbuf[sl++] = ' ';
                k += 3;
            } else {
                kbuf[sl++] = t.data[k++];
            }
        }
        tok->key_off[id] = tok->piece_off[id];
        tok->key_len[id] = (uint32_t)t.len;
        if ((st = td_tok_arena_add(tok, kbuf, sl, &tok->surf_off[id])))
            return st;
        tok->surf_len[id] = (uint32_t)sl;
        tok->scores[id] = (float)td_gguf_arr_float(v->scores, i);
    }

    int b = v->spm && type == TT_BYTE ? td_tok_byte_piece(t.data, t.len) : -1;
    if (b >= 0) {
        if ((st = td_tok_set_byte_piece(tok, id, b)))
            return st;
    } else if (v->bpe && tok->key_len[id] == 1 && type == TT_NORMAL) {
        uint8_t k = (uint8_t)tok->arena[tok->key_off[id]];
        if (tok->byte_id[k] < 0)
            tok->byte_id[k] = id;
    }
    if (type == TT_CONTROL || type == TT_UNKNOWN || type == TT_USER_DEFINED) {
        /* matched in the raw text, by its text as written */
        tok->flags[id] |= TD_TOK_F_ADDED;
        if (type != TT_USER_DEFINED)
            tok->flags[id] |= TD_TOK_F_SPECIAL;
        tok->added[tok->n_added++] = (td_tok_added_t){.id = id, .off = tok->piece_off[id], .len = (uint32_t)t.len};
        if (type == TT_USER_DEFINED) {
            tok->surf_off[id] = tok->piece_off[id];
            tok->surf_len[id] = (uint32_t)t.len;
        }
    }
    return TD_OK;
}

/* Every token of the vocabulary, with the end-of-generation tokens known by name (see the
 * top of the file); then the index of added tokens and the key map. */
static td_status_t gguf_load_tokens(td_tokenizer_t *tok, const gguf_vocab_t *v, const int16_t u2b[0x144])
{
    td_status_t st;
    size_t n = v->n;
    if ((st = td_tok_alloc_ids(tok, (int32_t)n)))
        return st;
    tok->byte_level = v->bpe;
    tok->algo = v->bpe ? TD_TOK_ALGO_RANKS : TD_TOK_ALGO_SCORES;
    if (v->spm && !(tok->scores = malloc(n * sizeof *tok->scores)))
        return td_errorf(TD_ERR_NOMEM, "%s: no memory for %zu scores", tok->path, n);
    size_t max_len = sizeof "[EMPTY_16777216]"; /* room for an empty token's stand-in */
    for (size_t i = 0; i < n; i++)
        max_len = TD_MAX(max_len, td_gguf_arr_str(v->tokens, i).len);
    char *kbuf = malloc(max_len * 3 + 1);
    if (!kbuf || !(tok->added = calloc(n, sizeof *tok->added))) {
        st = td_errorf(TD_ERR_NOMEM, "%s: no memory for %zu tokens", tok->path, n);
        goto out;
    }
    bool has[TD_ARRAY_LEN(marker_names)] = {0};
    for (size_t i = 0; i < n; i++)
        for (size_t k = 0; k < TD_ARRAY_LEN(marker_names); k++)
            has[k] |= name_is(marker_names[k], td_gguf_arr_str(v->tokens, i));
    bool end_not_eog = (has[0] && has[1]) || (has[2] && has[3]);
    bool s_not_eog = has[4] || has[5];

    for (size_t i = 0; i < n; i++) {
        td_gguf_str_t t = td_gguf_arr_str(v->tokens, i);
        int64_t type = v->types ? td_gguf_arr_int(v->types, i) : TT_NORMAL;
        char empty[32];
        if (t.len == 0) { /* llama.cpp's stand-in, so the id stays and nothing matches it */
            t.len = (size_t)snprintf(empty, sizeof empty, "[EMPTY_%zu]", i);
            t.data = empty;
        }
        bool eog = in_names(eog_names, TD_ARRAY_LEN(eog_names), t) && !(s_not_eog && name_is("</s>", t));
        if (eog && end_not_eog && name_is("<|end|>", t)) {
            eog = false;
            type = TT_USER_DEFINED;
        }
        if (eog)
            type = TT_CONTROL;
        if (in_names(user_names, TD_ARRAY_LEN(user_names), t))
            type = TT_USER_DEFINED;
        if ((st = gguf_add_token(tok, v, i, t, type, u2b, kbuf)))
            goto out;
        if (eog)
            add_eog(tok, (int32_t)i);
    }
    td_tok_index_added(tok);
    st = td_tok_map_build(tok);
out:
    free(kbuf);
    return st;
}

/* A SentencePiece vocabulary's pipeline: llama.cpp's spaces, and byte fallback. */
static td_status_t gguf_spm_pipeline(td_tokenizer_t *tok, const td_gguf_t *g)
{
    td_status_t st;
    bool prefix = true;
    if ((st = opt_bool(g, "tokenizer.ggml.add_space_prefix", &prefix)))
        return st;
    /* llama.cpp: a space in front of the text and of each stretch after a special
     * token, then every space written "▁"; a "▁" in the text stays one */
    if ((st = td_tok_add_norm(tok, TD_TOK_NORM_REPLACE, " ", "\xe2\x96\x81")) ||
        (prefix && (st = td_tok_add_norm(tok, TD_TOK_NORM_PREPEND, "\xe2\x96\x81", NULL))))
        return st;
    tok->strip_leading_space = prefix;
    tok->byte_fallback = true;
    for (int b = 0; b < 256; b++)
        if (tok->byte_id[b] < 0)
            return td_errorf(TD_ERR_FORMAT, "%s: byte token <0x%02X> is missing (a SentencePiece vocabulary needs "
                             "all 256 for byte fallback)", tok->path, b);
    tok->add_bos = true;
    return TD_OK;
}

/* Special ids: llama.cpp's defaults per model (11 for "gpt2" is its own, kept so that a
 * file without the keys encodes the same), then the file's; the end-of-generation ids with
 * the EOS id first (TD_TOK_ADD_EOS appends eos_ids[0]). */
static td_status_t gguf_special_ids(td_tokenizer_t *tok, const td_gguf_t *g, bool spm)
{
    td_status_t st;
    int32_t eos = spm ? 2 : 11, eot = -1, eom = -1;
    tok->bos_id = spm ? 1 : 11;
    tok->unk_id = spm ? 0 : -1;
    if ((st = special_id(tok, g, "tokenizer.ggml.bos_token_id", &tok->bos_id)) ||
        (st = special_id(tok, g, "tokenizer.ggml.eos_token_id", &eos)) ||
        (st = special_id(tok, g, "tokenizer.ggml.eot_token_id", &eot)) ||
        (st = special_id(tok, g, "tokenizer.ggml.eom_token_id", &eom)) ||
        (st = special_id(tok, g, "tokenizer.ggml.unknown_token_id", &tok->unk_id)) ||
        (st = special_id(tok, g, "tokenizer.ggml.padding_token_id", &tok->pad_id)) ||
        (st = opt_bool(g, "tokenizer.ggml.add_bos_token", &tok->add_bos)) ||
        (st = opt_bool(g, "tokenizer.ggml.add_eos_token", &tok->add_eos)))
        return st;
    int32_t eog[TD_TOK_MAX_EOS];
    size_t n_eog = tok->n_eos;
    memcpy(eog, tok->eos_ids, sizeof eog);
    tok->n_eos = 0;
    add_eog(tok, eos);
    add_eog(tok, eot);
    add_eog(tok, eom);
    for (size_t i = 0; i < n_eog; i++)
        add_eog(tok, eog[i]);
    if (tok->add_bos && tok->bos_id < 0)
        return td_errorf(TD_ERR_FORMAT, "%s: tokenizer.ggml.add_bos_token is true but there is no BOS token "
                         "(tokenizer.ggml.bos_token_id)", tok->path);
    return TD_OK;
}

td_status_t td_tok_load_gguf(td_tokenizer_t *tok)
{
    td_status_t st;
    td_gguf_t *g = NULL;
    if ((st = td_gguf_open(tok->path, &g)))
        return st;
    gguf_vocab_t v;
    uint32_t b2u[256];
    int16_t u2b[0x144];
    td_tok_bytelevel_tables(b2u, u2b);
    st = gguf_vocab_find(tok, g, &v);
    if (!st)
        st = gguf_load_tokens(tok, &v, u2b);
    if (!st)
        st = v.bpe ? set_pre(tok, g) : gguf_spm_pipeline(tok, g);
    if (!st && v.bpe)
        st = load_merges(tok, g, u2b);
    if (!st)
        st = gguf_special_ids(tok, g, v.spm);
    td_gguf_close(g);
    return st;
}
