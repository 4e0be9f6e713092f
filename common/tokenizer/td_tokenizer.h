/*
 * td_tokenizer: text <-> token ids for the models tandem serves (module td_tok).
 *
 * One opaque tokenizer loaded from either
 *   - llama2.c's tokenizer.bin (SentencePiece BPE: merges by best piece score, a dummy
 *     prefix space, byte fallback <0xXX> pieces; BOS 1, EOS 2), or
 *   - a Hugging Face tokenizer.json with a BPE model, in SentencePiece style (Mistral,
 *     Llama 2: "▁" for spaces, byte_fallback, Prepend/Replace normalizers or a Metaspace
 *     pre-tokenizer) or byte-level style (GPT-2, Llama 3, Qwen: ByteLevel alphabet, regex
 *     Split pre-tokenizers run with PCRE2, merges by rank, NFC normalizer), or
 *   - a directory holding tokenizer.json and optionally tokenizer_config.json (which names
 *     bos_token / eos_token), or
 *   - a GGUF file (a model, or llama.cpp's vocab-only kind): its tokenizer.ggml.* metadata,
 *     model "gpt2" (byte-level BPE with the pre-tokenizer tokenizer.ggml.pre names) or
 *     "llama" (SentencePiece BPE by scores).
 * Encoding matches the reference implementations token for token (sentencepiece for
 * tokenizer.bin, HF `tokenizers` for tokenizer.json; tests/fixtures/tokenizer holds the
 * checked cases; GGUF files encode as llama.cpp's llama-tokenize does on them). Added tokens of a tokenizer.json (e.g. "<|begin_of_text|>", "<s>") that
 * appear in the text are emitted as their ids, as HF does; tokenizer.bin, like
 * sentencepiece, treats such text as ordinary characters. In a GGUF vocabulary the control,
 * unknown and user-defined tokens (tokenizer.ggml.token_type 3, 2, 4) are matched so, as
 * llama.cpp does with parse_special; TD_TOK_NO_PARSE_SPECIAL leaves only user-defined ones.
 *
 * Decoding skips special tokens (HF skip_special_tokens=True, sentencepiece's control
 * pieces) and drops the dummy-prefix space at the start. td_detok_t decodes a stream of
 * ids and never emits a partial UTF-8 character: bytes of a character split across
 * tokens are held until the character is complete; invalid bytes become U+FFFD.
 *
 * Threads: a loaded tokenizer is immutable; any number of threads may encode and decode
 * with it at once. A td_detok_t belongs to one thread at a time.
 */
#ifndef TD_TOKENIZER_H
#define TD_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

typedef struct td_tokenizer td_tokenizer_t;

/* Upper bound on the EOS ids a tokenizer reports. */
#define TD_TOK_MAX_EOS 8

/* Flags of td_tokenizer_encode. */
enum {
    TD_TOK_ADD_BOS = 1u << 0, /* prepend the BOS id (where the tokenizer has one) */
    TD_TOK_ADD_EOS = 1u << 1, /* append the first EOS id (where it has one) */
    /* special tokens' text in the input is encoded as ordinary text (llama.cpp's
     * parse_special = false; llama-tokenize --no-parse-special): only added tokens that are
     * not special (GGUF user-defined, tokenizer.json "special": false) are still matched */
    TD_TOK_NO_PARSE_SPECIAL = 1u << 2,
};

/*
 * Loads a tokenizer from `path`: a tokenizer.bin (llama2.c format), a tokenizer.json, a
 * directory containing tokenizer.json (+ optional tokenizer_config.json), or a GGUF file
 * (recognised by its magic; only the tokenizer.ggml.* metadata is read). The kind of
 * file is decided by its content, not its name. On success *tok_p owns everything (the
 * files are not kept open). Errors, each with a td_errorf message naming the file and
 * the problem: TD_ERR_IO (missing/unreadable), TD_ERR_FORMAT (truncated file, bad JSON,
 * missing or wrongly typed fields), TD_ERR_UNSUPPORTED (a model type or normalizer /
 * pre-tokenizer / decoder this module does not implement), TD_ERR_NOMEM.
 */
td_status_t td_tokenizer_load(const char *path, td_tokenizer_t **tok_p);

/* Frees a tokenizer. NULL is a no-op. */
void td_tokenizer_destroy(td_tokenizer_t *tok);

/* Number of token ids (base vocabulary plus added tokens): valid ids are [0, n). */
int32_t td_tokenizer_vocab_size(const td_tokenizer_t *tok);

/* BOS id, or -1 when the tokenizer has none (e.g. Qwen). */
int32_t td_tokenizer_bos_id(const td_tokenizer_t *tok);

/* Whether the model's own prompts start with BOS / end with EOS: pass TD_TOK_ADD_BOS /
 * TD_TOK_ADD_EOS to td_tokenizer_encode when so. GGUF: tokenizer.ggml.add_bos_token /
 * add_eos_token (default as llama.cpp's: BOS for "llama" vocabularies and the llama3
 * pre-tokenizer); tokenizer.json: tokenizer_config.json's add_bos_token / add_eos_token
 * (default: BOS where there is one, no EOS); tokenizer.bin: BOS. */
bool td_tokenizer_add_bos(const td_tokenizer_t *tok);
bool td_tokenizer_add_eos(const td_tokenizer_t *tok);

/* Padding id (GGUF tokenizer.ggml.padding_token_id), or -1. */
int32_t td_tokenizer_pad_id(const td_tokenizer_t *tok);

/* The EOS ids (at most TD_TOK_MAX_EOS, possibly 0): *ids_p points into the tokenizer. For
 * GGUF: eos, eot, eom token ids and the end-of-turn tokens llama.cpp knows by name. */
size_t td_tokenizer_eos_ids(const td_tokenizer_t *tok, const int32_t **ids_p);

/* True if `id` is one of the EOS ids. */
bool td_tokenizer_is_eos(const td_tokenizer_t *tok, int32_t id);

/* Looks up an id by its exact piece (as in the file: "▁the", "Ġthe", "<s>") or added
 * token content; -1 when absent. */
int32_t td_tokenizer_piece_to_id(const td_tokenizer_t *tok, const char *piece, size_t len);

/*
 * The piece of `id` as written in the file ("▁the", "<0x0A>", "Ġthe"; added tokens by
 * their content), NUL-terminated, owned by the tokenizer; *len_p (if not NULL) its byte
 * length. NULL for an id out of range (or a hole in a sparse vocabulary).
 */
const char *td_tokenizer_id_to_piece(const td_tokenizer_t *tok, int32_t id, size_t *len_p);

/*
 * The bytes token `id` stands for in decoded text, before decode's clean-ups: a byte-level
 * piece's raw bytes, a SentencePiece piece with "▁" as a space, a byte-fallback piece's
 * one byte (possibly part of a UTF-8 character), a special token's text. Not
 * NUL-terminated; owned by the tokenizer. NULL for an id out of range (or a hole). What a
 * grammar matches a token against (docs/grammar.md).
 */
const char *td_tokenizer_token_bytes(const td_tokenizer_t *tok, int32_t id, size_t *len_p);

/* True for special tokens (control pieces, added tokens marked special): decoding skips them. */
bool td_tokenizer_is_special(const td_tokenizer_t *tok, int32_t id);

/*
 * Encodes `len` bytes of `text` (need not be NUL-terminated, may contain NULs; invalid
 * UTF-8 is encoded byte by byte where the vocabulary allows). flags: TD_TOK_ADD_BOS /
 * TD_TOK_ADD_EOS. On success *ids_p is a malloc'd array of *n_p ids (caller frees; a
 * non-NULL pointer even when *n_p is 0). Errors: TD_ERR_NOMEM; TD_ERR_FORMAT when a piece
 * has no representation (no byte fallback and no unk token).
 */
td_status_t td_tokenizer_encode(const td_tokenizer_t *tok, const char *text, size_t len,
                                unsigned flags, int32_t **ids_p, size_t *n_p);

/*
 * A lower bound on the ids td_tokenizer_encode makes of `len` bytes of text (BOS and EOS not
 * counted), without encoding it: len / td_tokenizer_max_token_bytes, rounded up. Sound
 * because every step of the encoder keeps or grows the text (a prefix, a space made "▁")
 * and each id stands for at most that many bytes of it (a piece, an added token, a byte, an
 * unknown character). 0 (no bound) when the tokenizer has a step that can shrink text: an
 * NFC normalizer (a letter and a combining mark become one character), a replacement
 * shorter than what it replaces, an added token that takes the blanks around it (lstrip /
 * rstrip), unknown characters fused into one id. Thread-safe (reads only).
 */
size_t td_tokenizer_min_tokens(const td_tokenizer_t *tok, size_t len);

/* The most bytes of text one id stands for (the longest piece, model key or added token;
 * at least 4, a character's bytes); 0 when no sound bound exists (see above). */
uint32_t td_tokenizer_max_token_bytes(const td_tokenizer_t *tok);

/*
 * Decodes `n` ids to UTF-8 text: special tokens skipped, the dummy-prefix space dropped
 * at the start, invalid UTF-8 replaced by U+FFFD. *text_p is malloc'd and NUL-terminated
 * (caller frees), *len_p (if not NULL) its length. Errors: TD_ERR_RANGE for an id outside
 * [0, vocab size), TD_ERR_NOMEM.
 */
td_status_t td_tokenizer_decode(const td_tokenizer_t *tok, const int32_t *ids, size_t n,
                                char **text_p, size_t *len_p);

/*
 * Streaming detokenizer: push ids as they are generated, get the text that is complete.
 * Concatenating every push's output and the flush's equals td_tokenizer_decode of all
 * the ids, and no output ends inside a UTF-8 character. Caller-allocated; the tokenizer
 * must outlive it.
 */
typedef struct td_detok {
    const td_tokenizer_t *tok;
    uint8_t pending[4];  /* bytes of an incomplete UTF-8 character */
    size_t n_pending;
    bool at_start;       /* nothing emitted yet: the dummy-prefix space is still to drop */
    char *out;           /* output of the last push/flush, owned here */
    size_t out_cap;
} td_detok_t;

/* Prepares `d` for a new stream of `tok`. Never fails (allocation happens on push). */
void td_detok_init(td_detok_t *d, const td_tokenizer_t *tok);

/*
 * Adds one id. *text_p / *len_p receive the newly complete text (possibly empty, never
 * NULL: NUL-terminated), valid until the next push/flush/free of `d`. Errors: TD_ERR_RANGE (bad id; the stream is
 * unchanged), TD_ERR_NOMEM.
 */
td_status_t td_detok_push(td_detok_t *d, int32_t id, const char **text_p, size_t *len_p);

/* Ends the stream: held bytes of an unfinished character come out as U+FFFD. `d` is
 * ready for a new stream afterwards. Errors: TD_ERR_NOMEM. */
td_status_t td_detok_flush(td_detok_t *d, const char **text_p, size_t *len_p);

/* Releases the output buffer. Safe on a zeroed or already freed struct. */
void td_detok_free(td_detok_t *d);

#endif /* TD_TOKENIZER_H */
