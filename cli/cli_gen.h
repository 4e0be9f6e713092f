/*
 * cli_gen: local generation, shared by `tandem generate` (one prompt) and `tandem chat` (a
 * conversation, turn after turn): the options they share, a session (model, tokenizer, chat
 * template, backend, engine) and one generation on it: prefill the prompt in chunks after
 * the prefix the engine already caches, decode with the sampling parameters, stream the
 * text (stop strings held back until decided) and report timings on stderr.
 *
 * Threads: the command's one thread. Errors: logged where decided (td_errorf).
 */
#ifndef CLI_GEN_H
#define CLI_GEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "td_backend.h"
#include "td_chat_template.h"
#include "td_engine.h"
#include "td_gen_params.h"
#include "td_gram.h"
#include "td_model.h"
#include "td_opts.h"
#include "td_progress.h"
#include "td_sampler.h"
#include "td_spec.h"
#include "td_tokenizer.h"

/* The options of a local generation (and generate's --server ones, unused by chat). */
typedef struct cli_gen_opts {
    const char *model;
    const char *tokenizer;
    const char *prompt;
    const char *prompt_ids;
    bool chat;                 /* the prompt is a user message rendered with the chat template */
    const char *system;        /* a system message before it (chat only) */
    td_device_spec_t device;
    int dtype;                 /* -1: weights as stored, f32 KV and activations */
    int quant;                 /* --quant: a block td_dtype_t, or -1 */
    int kv_dtype;              /* --kv-dtype: f32, f16, bf16 or Q8_0; -1: as dtype */
    int64_t max_tokens;        /* -1 (not given): up to the model's length */
    bool max_tokens_given;     /* -1 given is refused, not taken as "not given" */
    int64_t threads;
    int64_t prefill_chunk;
    size_t kv_mem;
    bool print_ids;
    int64_t logprobs;          /* --logprobs N: each generated token's log-probability and N
                                  alternatives (0..20); -1 = off */
    bool prompt_logprobs;      /* --prompt-logprobs (with --logprobs): the prompt's too */
    td_sampling_t sampling;
    const char *stops[TD_STOP_MAX_STRINGS];
    int32_t n_stops;           /* given; only the first TD_STOP_MAX_STRINGS are kept (more are refused) */
    int32_t stop_ids[TD_GEN_MAX_STOP_IDS];
    int32_t n_stop_ids;        /* given; as n_stops */
    td_spec_config_t spec;     /* --spec, --draft-tokens (speculative decoding; off by default) */
    /* structured output (generate): at most one of these flags; gram is what it compiled to
     * (cli_gen_grammar), NULL: unconstrained */
    const char *json_schema;   /* --json-schema FILE */
    const char *grammar;       /* --grammar FILE (GBNF) */
    const char *regex;         /* --regex R */
    const char *choice;        /* --choice A,B,... */
    bool json_object;          /* --json-object */
    td_gram_t *gram;
    td_gram_kind_t gram_kind;  /* and what it was compiled from (sent as is with --server) */
    char *gram_src;            /* malloc'd, gram_len bytes; freed with gram (cli_gen_grammar_free) */
    size_t gram_len;
    const char *draft_model;   /* --draft-model PATH: the draft-model drafter's model */
    /* generate --server mode */
    const char *server;        /* HOST:PORT of a router's gateway */
    const char *model_name;    /* GenerateRequest.model; NULL = the server's default */
    const char *request_id;
    int64_t tpot_objective_ms; /* GenerateRequest.tpot_objective_ms; 0 = the router's */
    float timeout_s;           /* whole call, sent as grpc-timeout */
    float connect_timeout_s;   /* until the server answers a health check */
    const char *local_only;    /* the first local-only flag given, to refuse with --server */
} cli_gen_opts_t;

/* The defaults: nothing given, max_tokens -1, dtype and quant -1, td_sampling_default(). */
cli_gen_opts_t cli_gen_opts_default(void);

/*
 * The sampling flags of generate and chat: one td_opts entry per TD_SAMPLING_FIELDS row with
 * a flag (td_sampler.h), in row order. A float goes straight into o->sampling; an integer is
 * read through ints[] (td_opts' int64_t, wide enough that a negative or too large value
 * reaches cli_gen_validate, which names the field's range) and copied into o->sampling by
 * cli_gen_sampling_apply after parsing. Holds pointers into o and into itself: used where
 * cli_gen_sampling_flags_init put it, never copied.
 */
typedef struct cli_gen_sampling_flags {
    td_opt_t opts[TD_SAMPLING_FIELD_END];
    int n_opts;
    int64_t ints[TD_SAMPLING_FIELD_END]; /* [field id] the integer fields while parsing */
} cli_gen_sampling_flags_t;

void cli_gen_sampling_flags_init(cli_gen_sampling_flags_t *f, cli_gen_opts_t *o);
void cli_gen_sampling_apply(const cli_gen_sampling_flags_t *f, cli_gen_opts_t *o);

/* A command's flags in --help order: head[0..n_head), the sampling flags, tail[0..n_tail),
 * into opts[0..cap) (cap must hold them all). Returns how many. */
int cli_gen_opts_join(td_opt_t *opts, int cap, const td_opt_t *head, int n_head, const cli_gen_sampling_flags_t *f,
                      const td_opt_t *tail, int n_tail);

/* The sampling flags for a usage synopsis, "[--temperature T] [--top-k K] ...", wrapped at
 * about 100 columns, each line opening with indent and ending with a newline. */
void cli_gen_sampling_synopsis(FILE *out, const cli_gen_sampling_flags_t *f, const char *indent);

/* td_opts parse fns: --stop and --stop-id (repeatable; opt->ptr is the cli_gen_opts_t),
 * --log-level (sets the log level); --quant is td_cli.h's cli_opt_quant. */
td_status_t cli_gen_parse_stop(const td_opt_t *opt, const char *v);
td_status_t cli_gen_parse_stop_id(const td_opt_t *opt, const char *v);
/* --logit-bias ID=BIAS (repeatable; opt->ptr is the cli_gen_opts_t): an entry of
 * o->sampling's logit bias; the count and duplicates are td_gen_params_check's, the id
 * against the vocabulary the generation's (or the router's). */
td_status_t cli_gen_parse_logit_bias(const td_opt_t *opt, const char *v);
td_status_t cli_gen_parse_log_level(const td_opt_t *opt, const char *v);

/* The speculative decoding flags of generate and chat: three td_opt_t initialisers, --spec
 * into o->spec.mode (td_cli.h's cli_opt_spec), --draft-model into o->draft_model and
 * --draft-tokens into the int64_t *k; cli_gen_spec_resolve after parsing. */
#define CLI_GEN_SPEC_OPTS(o, k)                                                                                   \
    {.name = "spec", .type = TD_OPT_FN, .ptr = &(o)->spec.mode, .parse = cli_opt_spec, .arg = "MODE",            \
     .help = "speculative decoding: off (default) | prompt-lookup (drafts copied from\n"                          \
             "earlier in the prompt and output) | draft-model (--draft-model drafts); the\n"                      \
             "output is the same token for token, logprobs included"},                                           \
    {.name = "draft-model", .type = TD_OPT_STR, .ptr = &(o)->draft_model, .arg = "PATH",                          \
     .help = "a small model sharing the vocabulary that drafts (implies --spec draft-model)"},                   \
    {.name = "draft-tokens", .type = TD_OPT_I64, .ptr = (k), .min = 1, .max = TD_SPEC_MAX_DRAFT, .arg = "K",      \
     .help = "most draft tokens verified per step (default 8; adaptive below it)"}

/* After CLI_GEN_SPEC_OPTS were parsed: --draft-tokens k into o->spec, and --spec and
 * --draft-model reconciled (td_spec_resolve_mode); on a conflict prints "tandem CMD: why"
 * and returns false (a usage error). */
bool cli_gen_spec_resolve(const char *cmd, cli_gen_opts_t *o, int64_t k);

/* Checks o's request parameters with td_gen_params_validate (the gateway's check) for a
 * prompt of prompt_len bytes; on failure prints "tandem CMD: --flag: why" and returns false. */
bool cli_gen_validate(const char *cmd, const cli_gen_opts_t *o, bool prompt_is_text, size_t prompt_len);

/*
 * Compiles o's structured-output flag (reading the file of --json-schema / --grammar) into
 * o->gram, keeping its kind and source text (o->gram_kind, o->gram_src: what --server sends,
 * for the router to compile); nothing when none is given. Errors (printed as "tandem CMD: --flag: why"): two
 * such flags, an unreadable file, any td_gram_compile refusal. Release with td_gram_unref.
 */
bool cli_gen_grammar(const char *cmd, cli_gen_opts_t *o);
/* Releases what cli_gen_grammar set (o->gram, o->gram_src); twice is harmless. */
void cli_gen_grammar_free(cli_gen_opts_t *o);

/* What a local command holds. Zero-initialise, then cli_gen_open; cli_gen_close always. */
typedef struct cli_gen {
    td_model_t *model;
    td_tokenizer_t *tok;       /* NULL when none was found and none was needed */
    td_chat_template_t *chat;  /* the model's chat template (o->chat only) */
    td_backend_t *be;
    td_engine_t *eng;          /* after cli_gen_start_engine */
    bool add_bos;              /* the model starts a text prompt with BOS */
    bool stop_at_tok_eos;      /* the tokenizer's EOS / end-of-turn ids stop too (chat) */
    td_model_t *draft_model;   /* --spec draft-model: the drafter's model, engine and state */
    td_engine_t *draft_eng;
    td_spec_draft_t *draft;
    td_progress_t load;        /* the load's phases on stderr when it takes over a second */
} cli_gen_t;

/*
 * Loads o->model, its tokenizer (o->tokenizer, else the one beside the model; a missing one is
 * an error when need_tok, naming the flag to give), the chat template with o->chat, and opens
 * the backend. Errors logged; g is left for cli_gen_close.
 */
td_status_t cli_gen_open(cli_gen_t *g, const cli_gen_opts_t *o, bool need_tok);

/*
 * Creates the engine with *ec (o's --dtype/--quant/--kv-mem applied; room for a verify step of
 * --draft-tokens + 1 rows when o->spec is on) and a KV pool of the blocks kv_tokens tokens
 * need, within the KV budget; with --spec draft-model also the draft model's engine (same
 * backend and dtypes, a pool as large), after checking that it shares the vocabulary.
 */
td_status_t cli_gen_start_engine(cli_gen_t *g, const cli_gen_opts_t *o, td_engine_config_t *ec,
                                 int64_t kv_tokens);

/* Frees what g holds, in reverse; safe on a zeroed or partly opened g. */
void cli_gen_close(cli_gen_t *g);

/* A conversation's prompt ids: messages rendered with g's chat template and encoded
 * (td_chat_source.h). *ids_p malloc'd (caller frees). */
td_status_t cli_gen_chat_prompt(cli_gen_t *g, const td_chat_message_t *messages, size_t n,
                                int32_t **ids_p, size_t *n_p);

/* Checks prompt ids against the model (vocabulary, length; at least one id). */
td_status_t cli_gen_check_prompt(const cli_gen_t *g, const int32_t *ids, size_t n);

/* One generation's outcome. */
typedef struct cli_gen_result {
    size_t n_prompt;
    int32_t n_cached;          /* prompt tokens whose KV the engine's prefix cache held */
    int64_t n_gen;
    int32_t *ids;              /* [n_gen] generated ids, malloc'd (cli_gen_result_free) */
    char *text;                /* the text written to stdout, NUL-terminated, malloc'd */
    size_t text_len;
    uint64_t t_prefill_ns, t_first_ns, t_total_ns;
    td_token_logprob_t *lps;   /* [n_gen] with o->logprobs >= 0, else NULL */
    td_token_logprob_t *prompt_lps; /* [n_prompt] with o->prompt_logprobs, else NULL */
    td_spec_stats_t spec;      /* speculative decoding's counters (all 0 when off) */
} cli_gen_result_t;

void cli_gen_result_free(cli_gen_result_t *r);

/* Prints lps[0..n) to stdout, one line each, the same for a local and a --server run:
 * "logprob WHAT I ID LOGPROB[ ID:LOGPROB...]" (WHAT: prompt or gen; %.6f). */
void cli_gen_print_logprobs(const char *what, const td_token_logprob_t *lps, size_t n);

/*
 * Generates after prompt[0..n) on seq (an empty sequence: the engine's cached prefix is
 * attached first) at most max_new tokens, streaming text to stdout (ids with
 * o->print_ids, printed at the end). Stops at a stop id (the model's EOS ids, o's, and with
 * stop_at_tok_eos the tokenizer's), a stop string, max_new, or a full KV cache (warned).
 * With o->spec on, drafts are verified several tokens a step (td_spec.h); the tokens, text
 * and logprobs are the same as without. seq keeps its tokens' KV for the caller to end. *r is
 * filled on success.
 */
td_status_t cli_gen_run(cli_gen_t *g, const cli_gen_opts_t *o, td_kv_seq_t *seq, const int32_t *prompt,
                        size_t n, int64_t max_new, cli_gen_result_t *r);

/* The timings line on stderr: prompt tokens (and cached ones when show_cached) and
 * tokens/s, generation tokens and tokens/s, time to first token; with speculation a second
 * line: verify steps, drafted and accepted tokens, acceptance, tokens per step. */
void cli_gen_report(const cli_gen_result_t *r, bool show_cached);

#endif /* CLI_GEN_H */
