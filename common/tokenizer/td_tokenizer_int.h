/*
 * td_tokenizer_int: the inside of td_tokenizer_t, shared by the files of module td_tok
 * (td_tokenizer.c: API, encode pipeline, decode; td_tok_load.c: the loaders' entry,
 * tokenizer.bin and what the loaders share; td_tok_json.c: tokenizer.json; td_tok_gguf.c:
 * a GGUF file's vocabulary; td_tok_bpe.c: hash maps and the merge loop; td_tok_nfc.c: Unicode NFC by libutf8proc).
 * Not for use outside the module.
 */
#ifndef TD_TOKENIZER_INT_H
#define TD_TOKENIZER_INT_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include "td_hash.h"
#include "td_tokenizer.h"

/* ---- per-id flags ---- */
enum {
    TD_TOK_F_HOLE = 1u << 0,    /* no token has this id (sparse tokenizer.json vocab) */
    TD_TOK_F_SPECIAL = 1u << 1, /* skipped by decode */
    TD_TOK_F_NOMERGE = 1u << 2, /* never the result of a SentencePiece merge (control, byte) */
    TD_TOK_F_ADDED = 1u << 3,   /* an added token of tokenizer.json */
};

/* An added token of tokenizer.json, matched in the raw text before anything else. */
typedef struct td_tok_added {
    int32_t id;
    uint32_t off, len; /* content in the arena */
    bool lstrip, rstrip;
} td_tok_added_t;

/* Normalizer steps (applied in order to each segment between added tokens). */
typedef enum td_tok_norm_kind { TD_TOK_NORM_NFC, TD_TOK_NORM_PREPEND, TD_TOK_NORM_REPLACE } td_tok_norm_kind_t;

typedef struct td_tok_norm {
    td_tok_norm_kind_t kind;
    char *a;   /* PREPEND: the prefix; REPLACE: the pattern */
    char *b;   /* REPLACE: the replacement */
    size_t a_len, b_len;
} td_tok_norm_t;

/* Pre-tokenizer steps (each splits the pieces of the previous one). */
typedef enum td_tok_pre_kind {
    TD_TOK_PRE_SPLIT,     /* regex, behavior Isolated */
    TD_TOK_PRE_BYTELEVEL, /* optional prefix space, optional GPT-2 regex split */
    TD_TOK_PRE_METASPACE, /* ' ' -> replacement, prepend scheme, optional split */
} td_tok_pre_kind_t;

typedef struct td_tok_pre {
    td_tok_pre_kind_t kind;
    pcre2_code *re;          /* SPLIT, BYTELEVEL with use_regex */
    bool add_prefix_space;   /* BYTELEVEL */
    char *repl;              /* METASPACE replacement ("▁") */
    size_t repl_len;
    int prepend;             /* METASPACE: 0 never, 1 first, 2 always */
    bool split;              /* METASPACE */
} td_tok_pre_t;

#define TD_TOK_MAX_STEPS 8

typedef enum td_tok_algo {
    TD_TOK_ALGO_SCORES, /* SentencePiece BPE: merge the pair whose piece has the best score */
    TD_TOK_ALGO_RANKS,  /* HF BPE: merge the pair of lowest merge rank */
} td_tok_algo_t;

struct td_tokenizer {
    char *path;                 /* for messages */
    td_tok_algo_t algo;
    bool byte_level;            /* model keys are raw bytes (ByteLevel alphabet undone) */
    int32_t n_vocab;            /* ids are [0, n_vocab) */

    /* strings per id, in `arena`: the piece as in the file (NUL-terminated), the model
     * key (what the merge loop matches), the decoded bytes */
    char *arena;
    size_t arena_len, arena_cap;
    uint32_t *piece_off, *piece_len;  /* [n_vocab] */
    uint32_t *key_off, *key_len;      /* [n_vocab]; key_len 0 = not in the model vocab */
    uint32_t *surf_off, *surf_len;    /* [n_vocab] */
    uint8_t *flags;                   /* [n_vocab] TD_TOK_F_* */
    float *scores;                    /* [n_vocab], ALGO_SCORES only */

    td_hash_t vocab;                  /* model key -> id, by td_fnv1a64 of the key */
    td_hash_t merges;                 /* ALGO_RANKS: id pair -> merge (td_tok_merge_*) */
    int32_t byte_id[256];             /* <0xXX> piece (or ByteLevel char) of each byte, -1 */

    td_tok_added_t *added;            /* sorted by first byte, then length descending */
    size_t n_added;
    uint32_t added_first[257];        /* added[added_first[b] .. added_first[b+1]) start with b */

    td_tok_norm_t norm[TD_TOK_MAX_STEPS];
    size_t n_norm;
    td_tok_pre_t pre[TD_TOK_MAX_STEPS];
    size_t n_pre;

    /* SentencePiece (tokenizer.bin): dummy prefix and the string spaces become */
    bool spm_dummy_prefix;

    /* model options */
    bool ignore_merges;
    bool byte_fallback;
    bool fuse_unk;
    int32_t unk_id;

    /* decoder: drop one leading space of the decoded text */
    bool strip_leading_space;

    /* the most bytes of text one id stands for; 0 = unbounded (td_tokenizer_min_tokens) */
    uint32_t max_token_bytes;

    int32_t bos_id;
    int32_t eos_ids[TD_TOK_MAX_EOS];
    size_t n_eos;
    int32_t pad_id;

    /* whether the model's own encoding starts with BOS / ends with EOS (GGUF
     * tokenizer.ggml.add_bos_token / add_eos_token, tokenizer_config.json add_bos_token) */
    bool add_bos, add_eos;
};

/* ---- td_tok_bpe.c ---- */

/* Builds tok->vocab over the ids with key_len > 0 (of two ids with one key the first
 * wins, as in a JSON object). Errors: TD_ERR_NOMEM. */
td_status_t td_tok_map_build(td_tokenizer_t *tok);

/* The id whose model key is s[0..len), or -1. */
int32_t td_tok_map_get(const td_tokenizer_t *tok, const char *s, size_t len);

/* Makes tok->merges with room for n merges. Errors: TD_ERR_NOMEM. */
td_status_t td_tok_merges_init(td_tokenizer_t *tok, size_t n);
/* Adds the merge of ids (l, r) into id at rank (>= 0) unless the pair has one already (the
 * first, lowest rank, wins); at most the n of td_tok_merges_init. */
void td_tok_merge_put(td_tokenizer_t *tok, int32_t l, int32_t r, int32_t rank, int32_t id);
/* The merge of ids (l, r): true with its rank and result id, or false. */
bool td_tok_merge_get(const td_tokenizer_t *tok, int32_t l, int32_t r, int32_t *rank_p, int32_t *id_p);

/* A growable id array. */
typedef struct td_tok_ids {
    int32_t *v;
    size_t n, cap;
} td_tok_ids_t;

td_status_t td_tok_ids_push(td_tok_ids_t *a, int32_t id);

/*
 * Runs the tokenizer's model on one pre-token `s[0..len)` (model keys: raw bytes for
 * byte-level tokenizers, "▁"-style text otherwise) and appends its ids to `out`.
 * Errors: TD_ERR_NOMEM; TD_ERR_FORMAT when a character has no token (no byte fallback,
 * no unk).
 */
td_status_t td_tok_bpe_word(const td_tokenizer_t *tok, const char *s, size_t len, td_tok_ids_t *out);

/* ---- td_tok_nfc.c ---- */

/*
 * NFC of valid UTF-8 s[0..len) into a malloc'd buffer (*out_p, *out_len_p). Text that is
 * not valid UTF-8 is copied unchanged. Errors: TD_ERR_NOMEM.
 */
td_status_t td_tok_nfc(const char *s, size_t len, char **out_p, size_t *out_len_p);

/* Length (1..4) of the valid UTF-8 character at s[0..len), or 0 where the bytes there are
 * not one (libutf8proc's decoder: overlong forms, surrogates and code points past
 * U+10FFFF are not); *cp_p gets the code point when valid. */
static inline size_t td_tok_utf8_decode(const char *s, size_t len, uint32_t *cp_p)
{
    utf8proc_int32_t cp;
    utf8proc_ssize_t n = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &cp);
    if (n <= 0)
        return 0;
    *cp_p = (uint32_t)cp;
    return (size_t)n;
}

/* ---- td_tok_load.c ---- */

#define TD_TOK_MAX_FILE (1024u * 1024u * 1024u) /* bytes of a tokenizer file read whole */
#define TD_TOK_MAX_IDS (1 << 24)                /* ids of a vocabulary */

/* GPT-2's pre-tokenizer regex (ByteLevel use_regex, llama.cpp's "gpt-2"). */
extern const char td_tok_gpt2_pattern[];

/* Compiles a pre-tokenizer regex (UTF, Unicode properties, JIT where available) into *re_p.
 * Errors: TD_ERR_UNSUPPORTED naming the offset when it does not compile. */
td_status_t td_tok_compile_re(td_tokenizer_t *tok, const char *pattern, bool literal, pcre2_code **re_p);

/* Appends a normalizer / pre-tokenizer step (at most TD_TOK_MAX_STEPS each). Errors:
 * TD_ERR_UNSUPPORTED (too many steps), TD_ERR_NOMEM. */
td_status_t td_tok_add_norm(td_tokenizer_t *tok, td_tok_norm_kind_t kind, const char *a, const char *b);
td_status_t td_tok_add_pre(td_tokenizer_t *tok, td_tok_pre_t **p_p);

/* The byte of a "<0xXX>" piece, or -1. */
int td_tok_byte_piece(const char *s, size_t len);

/* id is the piece of byte b (byte fallback): the byte's id unless an earlier one is, and id
 * decodes to the byte. Errors: td_tok_arena_add's. */
td_status_t td_tok_set_byte_piece(td_tokenizer_t *tok, int32_t id, int b);

/* ByteLevel alphabet: GPT-2's bytes_to_unicode and its inverse over U+0000..U+0143. */
void td_tok_bytelevel_tables(uint32_t b2u[256], int16_t u2b[0x144]);
/* Converts a ByteLevel-alphabet string to the bytes it stands for (characters outside the
 * alphabet are kept as their UTF-8). out has room for len bytes. */
size_t td_tok_bytelevel_to_bytes(const int16_t u2b[0x144], const char *s, size_t len, char *out);

/* Sets tok->max_token_bytes once the tokenizer is loaded (td_tokenizer.c). */
void td_tok_bound_tokens(td_tokenizer_t *tok);

/* Sorts tok->added (first byte, then longest first) and fills added_first. */
void td_tok_index_added(td_tokenizer_t *tok);

/* ---- td_tok_json.c ---- */

/*
 * Fills `tok` (fresh from td_tokenizer_load, tok->path set) from the tokenizer.json at
 * json_path, and its BOS/EOS from tokenizer_config.json / generation_config.json in dir.
 * Errors: TD_ERR_IO, TD_ERR_FORMAT (not JSON, or a part of the wrong shape, named),
 * TD_ERR_UNSUPPORTED (a model, normalizer, pre-tokenizer or decoder not implemented,
 * named), TD_ERR_NOMEM.
 */
td_status_t td_tok_load_json(td_tokenizer_t *tok, const char *json_path, const char *dir);

/* ---- td_tok_gguf.c ---- */

/*
 * Fills `tok` (fresh from td_tokenizer_load, tok->path set) from the tokenizer.ggml.*
 * metadata of the GGUF file at tok->path, as llama.cpp's llama-vocab.cpp reads it.
 * Errors: TD_ERR_IO / TD_ERR_FORMAT (td_gguf's, or missing/mistyped keys),
 * TD_ERR_UNSUPPORTED (a tokenizer model or pre-tokenizer name not implemented, named),
 * TD_ERR_NOMEM.
 */
td_status_t td_tok_load_gguf(td_tokenizer_t *tok);

/* Appends s[0..len) and a NUL to the arena; *off_p its offset. Errors: TD_ERR_NOMEM. */
td_status_t td_tok_arena_add(td_tokenizer_t *tok, const char *s, size_t len, uint32_t *off_p);

/* Allocates the per-id arrays for n ids, all holes. Errors: TD_ERR_NOMEM. */
td_status_t td_tok_alloc_ids(td_tokenizer_t *tok, int32_t n);

#endif /* TD_TOKENIZER_INT_H */
