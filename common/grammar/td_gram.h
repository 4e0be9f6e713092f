/*
 * td_gram: constrained decoding. Compiles a grammar (llama.cpp's GBNF, a regular
 * expression, a choice of strings, "any JSON object", a JSON Schema) into one form, tracks
 * where a generation stands in it, and gives the set of token ids that may come next.
 *
 * The form (docs/grammar.md): a context-free grammar over BYTES, flattened into one array
 * of elements. A rule is a list of alternatives; an alternative is a sequence of elements,
 * each a byte set (256 bits) or a reference to a rule, closed by an END element. Every
 * other input is translated to GBNF text first (td_gram_source() shows it), and only the
 * GBNF parser builds the form, so there is one parser and one set of checks: every rule
 * defined, none left-recursive, every rule able to end, and the size bounds below.
 *
 * The matcher state (td_gram_state_t) is a set of pushdown stacks of element positions, as
 * llama.cpp's grammar sampler keeps: the top of each stack is the byte set that may match
 * next, the entries below are where to return when a rule ends; an empty stack means the
 * grammar may end here. The state is a plain value: copied, serialized to bytes (to travel
 * with a request) and read back against the same compiled grammar.
 *
 * Token masks (td_gram_matcher_t) work over a vocabulary's token BYTES (td_gram_vocab_t):
 * the tokens sorted by their bytes form an implicit trie (shared prefixes are walked once,
 * a dead prefix skips its whole subtree), and for each stack suffix met (the top
 * TD_GRAM_SUFFIX entries: a byte-set position and the rules it returns into) the tokens
 * are split once, lazily, into those accepted whatever lies below the suffix, those
 * rejected whatever lies below, and the uncertain rest, which alone are checked against
 * the full stack at run time (the adaptive token mask cache of xgrammar, Dong et al. 2024,
 * keyed by a suffix rather than a position). The stack sets the walks meet are interned
 * and their byte transitions kept (a lazy DFA). Special tokens are never allowed, except
 * the end-of-sequence ones where the grammar may end.
 *
 * Threads: a compiled grammar and a vocabulary are immutable and shared. A matcher may be
 * shared too: its lazily filled caches are guarded by its own mutex. A state
 * belongs to one thread at a time.
 */
#ifndef TD_GRAM_H
#define TD_GRAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

/* Bounds against hostile input (each refusal names the bound). */
#define TD_GRAM_MAX_SOURCE (1u << 20)  /* bytes of a grammar, schema or regex */
#define TD_GRAM_MAX_RULES 20000        /* rules after expansion */
#define TD_GRAM_MAX_ELEMS 400000       /* elements after expansion */
#define TD_GRAM_MAX_REPEAT 1000        /* m and n of {m,n} */
#define TD_GRAM_MAX_NESTING 128        /* parentheses, schema or JSON depth */
#define TD_GRAM_MAX_CHOICES 4096       /* strings of a choice list */
#define TD_GRAM_MAX_STACK 1024         /* entries of one matcher stack (nesting of a generation) */
#define TD_GRAM_MAX_STACKS 1024        /* stacks of one state (ambiguity); more are dropped */
#define TD_GRAM_JSON_WS 20             /* whitespace bytes between two JSON tokens, at most */

typedef enum td_gram_kind {
    TD_GRAM_GBNF,        /* llama.cpp's GBNF, start rule "root" */
    TD_GRAM_REGEX,       /* a regular expression, matched whole */
    TD_GRAM_CHOICE,      /* a JSON array of strings: exactly one of them */
    TD_GRAM_JSON_OBJECT, /* any JSON object ({"type":"json_object"}); the source is ignored */
    TD_GRAM_JSON_SCHEMA, /* a JSON Schema (the subset in docs/grammar.md) */
} td_gram_kind_t;

/* "gbnf", "regex", "choice", "json_object", "json_schema"; "?" for other values. */
const char *td_gram_kind_name(td_gram_kind_t kind);

typedef struct td_gram td_gram_t;

/*
 * Compiles src[0..len) of the given kind. On success *gram_p holds one reference (release
 * with td_gram_unref). Errors, each with a message naming what is wrong and where (a GBNF
 * line, a regex offset, a schema's JSON path such as "$.properties.age: keyword
 * \"multipleOf\" is not supported"): TD_ERR_FORMAT (malformed input), TD_ERR_UNSUPPORTED (a
 * feature outside the supported subset, named), TD_ERR_RANGE (a bound above exceeded),
 * TD_ERR_INVALID (a grammar that cannot match: undefined or left-recursive rule, a rule that
 * can never end), TD_ERR_NOMEM. Pure; any thread.
 */
td_status_t td_gram_compile(td_gram_kind_t kind, const char *src, size_t len, td_gram_t **gram_p);

/* Another reference to g. */
td_gram_t *td_gram_ref(td_gram_t *g);
/* Drops a reference; the last frees. NULL is a no-op. */
void td_gram_unref(td_gram_t *g);

/* The GBNF text the grammar was built from (for a GBNF input, the input). Owned by g. */
const char *td_gram_source(const td_gram_t *g);

/* Compiles src as kind and writes its GBNF text (td_gram_source) to *gbnf_p, a string the
 * caller frees: what a router sends nodes, which compile GBNF only. Errors: td_gram_compile's
 * (TD_ERR_NOMEM also when the copy fails). *gbnf_p written on success only. */
td_status_t td_gram_to_gbnf(td_gram_kind_t kind, const char *src, size_t len, char **gbnf_p);
/* FNV-1a of the kind and the input: the cache key, and the check that a serialized state
 * is read against the grammar it came from. */
uint64_t td_gram_hash(const td_gram_t *g);
/* Elements and rules of the compiled form (for the docs' figures and tests). */
size_t td_gram_n_elems(const td_gram_t *g);
size_t td_gram_n_rules(const td_gram_t *g);

/* ---- matcher state ------------------------------------------------------------------ */

typedef struct td_gram_state td_gram_state_t;

/* A state at the start of g (g gets a reference). Errors: TD_ERR_NOMEM. */
td_status_t td_gram_state_create(td_gram_t *g, td_gram_state_t **state_p);
/* An independent copy of s. Errors: TD_ERR_NOMEM. */
td_status_t td_gram_state_copy(const td_gram_state_t *s, td_gram_state_t **copy_p);
void td_gram_state_destroy(td_gram_state_t *s);

/* The grammar s walks. */
td_gram_t *td_gram_state_grammar(const td_gram_state_t *s);

/*
 * Advances s over bytes[0..len). TD_OK when the grammar accepts them from s; otherwise
 * TD_ERR_INVALID (quiet: no log, no last error; a rejected token is routine) and s is
 * unchanged. Errors: TD_ERR_NOMEM (s unchanged).
 */
td_status_t td_gram_accept_bytes(td_gram_state_t *s, const void *bytes, size_t len);

/* True when the bytes accepted so far are a complete sentence of the grammar. */
bool td_gram_can_end(const td_gram_state_t *s);
/* True when nothing more can be accepted (every stack is empty): the generation must end. */
bool td_gram_is_done(const td_gram_state_t *s);

/*
 * Serializes s into a malloc'd buffer (*buf_p, *len_p; caller frees): a magic, the
 * grammar's hash and the stacks, little-endian. Errors: TD_ERR_NOMEM.
 */
td_status_t td_gram_state_serialize(const td_gram_state_t *s, uint8_t **buf_p, size_t *len_p);
/*
 * Reads a serialized state back against g (a reference taken). Errors: TD_ERR_FORMAT
 * (truncated, bad magic, a position that is not one of g's), TD_ERR_MISMATCH (serialized
 * against another grammar), TD_ERR_NOMEM.
 */
td_status_t td_gram_state_deserialize(td_gram_t *g, const uint8_t *buf, size_t len,
                                      td_gram_state_t **state_p);

/* ---- vocabulary and token masks ------------------------------------------------------ */

/* What a token is to the grammar. */
typedef enum td_gram_tok {
    TD_GRAM_TOK_TEXT = 0, /* its bytes are text the grammar must accept */
    TD_GRAM_TOK_SPECIAL,  /* control/special: never allowed */
    TD_GRAM_TOK_EOS,      /* ends the generation: allowed only where the grammar may end */
} td_gram_tok_t;

typedef struct td_gram_vocab td_gram_vocab_t;

/*
 * A vocabulary of n tokens: token i's bytes are bytes[i][0..lens[i]) (a byte-fallback token
 * is its one byte; copied), kinds[i] its td_gram_tok_t. A TEXT token with no bytes is never
 * allowed. Errors: TD_ERR_INVALID (n <= 0, a bad kind), TD_ERR_NOMEM.
 */
td_status_t td_gram_vocab_create(int32_t n, const char *const *bytes, const size_t *lens,
                                 const uint8_t *kinds, td_gram_vocab_t **vocab_p);
void td_gram_vocab_destroy(td_gram_vocab_t *v);
int32_t td_gram_vocab_size(const td_gram_vocab_t *v);
/* What token id is to the grammar (SPECIAL for an id outside v): a decoder asks whether a
 * token the mask allowed is an EOS, which ends the generation. */
td_gram_tok_t td_gram_vocab_kind(const td_gram_vocab_t *v, int32_t id);

/* Words of a mask over v: bit (id % 32) of word (id / 32) is token id. */
static inline size_t td_gram_mask_words(int32_t n_vocab)
{
    return ((size_t)n_vocab + 31) / 32;
}

typedef struct td_gram_matcher td_gram_matcher_t;

/* A matcher of g over v (both must outlive it; g gets a reference). Errors: TD_ERR_NOMEM. */
td_status_t td_gram_matcher_create(td_gram_t *g, const td_gram_vocab_t *v, td_gram_matcher_t **m_p);
/* Drops the creator's reference (or a cache's, td_gram_cache_release); the last frees.
 * NULL is a no-op. */
void td_gram_matcher_destroy(td_gram_matcher_t *m);
/* The grammar m matches (owned by m). */
td_gram_t *td_gram_matcher_grammar(const td_gram_matcher_t *m);

/*
 * The tokens allowed next from s (a state of the matcher's grammar) into
 * mask[0..td_gram_mask_words(n_vocab)): a TEXT token whose bytes s accepts, an EOS token
 * where s may end. Allocates only while its caches fill (a stack suffix or a stack-set
 * transition met for the first time). Errors: TD_ERR_INVALID (s of another grammar),
 * TD_ERR_NOMEM.
 */
td_status_t td_gram_fill_mask(td_gram_matcher_t *m, const td_gram_state_t *s, uint32_t *mask);

/*
 * Advances s over token id: a TEXT token by its bytes, an EOS token only where s may end
 * (s then unchanged). TD_ERR_INVALID (quiet) when the token is not allowed (s unchanged).
 */
td_status_t td_gram_accept_token(td_gram_matcher_t *m, td_gram_state_t *s, int32_t id);

/* ---- cache --------------------------------------------------------------------------- */

typedef struct td_gram_cache td_gram_cache_t;

/* A cache of up to cap matchers over v, keyed by td_gram_hash (least recently used goes).
 * Errors: TD_ERR_INVALID (cap < 1), TD_ERR_NOMEM. */
td_status_t td_gram_cache_create(const td_gram_vocab_t *v, int32_t cap, td_gram_cache_t **c_p);
void td_gram_cache_destroy(td_gram_cache_t *c);

/*
 * The matcher of (kind, src): the cached one (a hit keeps its per-suffix masks) or a new
 * compile. The matcher stays valid until the cache is destroyed (an evicted one lives on
 * while referenced: release with td_gram_cache_release). Errors: td_gram_compile's.
 * Guarded by the cache's mutex.
 */
td_status_t td_gram_cache_get(td_gram_cache_t *c, td_gram_kind_t kind, const char *src, size_t len,
                              td_gram_matcher_t **m_p);
void td_gram_cache_release(td_gram_cache_t *c, td_gram_matcher_t *m);
/* Hits and misses so far. */
void td_gram_cache_stats(const td_gram_cache_t *c, uint64_t *hits_p, uint64_t *misses_p);

#endif /* TD_GRAM_H */
