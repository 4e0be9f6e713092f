/*
 * td_gen_params: the parameters of one generation request, and the one check of them that
 * every front door runs (the CLI's `tandem generate`, the router's gRPC gateway, and the HTTP
 * front door), so that a request one of them refuses is refused by all, with the same words.
 *
 * Each front door turns its own input (flags, a GenerateRequest, JSON) into a td_gen_params_t
 * first: what "not given" means on its wire is settled there (proto3 cannot tell 0 from unset,
 * so the gateway reads top_p and repetition_penalty 0 as 1, "off"; see proto/tandem.proto),
 * and everything else is handed over as received, so that td_gen_params_validate sees a
 * negative, NaN or infinite value and refuses it by name instead of a front door mapping it
 * to "off" without a word. What needs the model (prompt ids inside the vocabulary, prompt and
 * output within its length and the KV pools) is checked later, by the one who knows it.
 */
#ifndef TD_GEN_PARAMS_H
#define TD_GEN_PARAMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_sampler.h"
#include "td_status.h"

#define TD_GEN_MAX_TOKENS INT32_MAX    /* max_tokens at most */
#define TD_GEN_MAX_STOP_IDS 32         /* stop ids per request */
#define TD_GEN_MAX_TPOT_MS 3600000     /* tpot_objective_ms at most (an hour) */
#define TD_GEN_MAX_PROMPT (4u << 20)   /* prompt bytes (text) or ids: the gateway's 4 MiB message */
/* What each message of a conversation adds to its prompt length beyond its role and content
 * (the chat template's markup around it, at least): 2M empty messages were 0 bytes, slipped
 * past TD_GEN_MAX_PROMPT and were rendered on the router's loop. */
#define TD_GEN_MESSAGE_BYTES 16u

typedef struct td_gen_params {
    int64_t max_tokens;              /* new tokens at most, [0, TD_GEN_MAX_TOKENS]; what 0 means
                                        is the front door's (the gateway: its default-max-tokens) */
    td_sampling_t sampling;          /* ranges of td_sampling_validate */
    size_t prompt_len;               /* bytes of a text prompt (a conversation: its roles and
                                        contents, and TD_GEN_MESSAGE_BYTES a message) or count
                                        of prompt ids, [0, TD_GEN_MAX_PROMPT] */
    bool prompt_is_text;             /* prompt_len counts bytes (else ids); for the message */
    size_t n_stop_ids;               /* [0, TD_GEN_MAX_STOP_IDS] */
    size_t n_stop_strings;           /* [0, TD_STOP_MAX_STRINGS] */
    const char *const *stop_strings; /* [n_stop_strings] NUL-terminated, each at most
                                        TD_STOP_MAX_LEN bytes; read only when n_stop_strings
                                        is in range; borrowed */
    td_logprobs_want_t logprobs;     /* off by default; top in [0, TD_LOGPROBS_MAX_TOP]; prompt:
                                        a prompt of ids at most TD_LOGPROBS_MAX_PROMPT long (a
                                        text prompt's length is checked once it is encoded) */
    bool ignore_eos;                 /* the model's EOS ids do not end the output (stop ids and
                                        stop strings still do): fixed output lengths, as vLLM's
                                        ignore_eos; false by default */
    int64_t tpot_objective_ms;       /* the request's TPOT objective, [0, TD_GEN_MAX_TPOT_MS];
                                        0 (the default): the router's --tpot-objective-ms */
} td_gen_params_t;

/* max_tokens 0, td_sampling_default(), an empty prompt, no stop ids or strings, no
 * log-probabilities. */
td_gen_params_t td_gen_params_default(void);

/*
 * The fields td_gen_params_check reports. The sampling fields come first, numbered as
 * td_sampling_field_t, with their names from TD_SAMPLING_FIELDS; the request's own follow,
 * each with its names where the front doors show it:
 * X(ID, request field, `tandem generate` flag, OpenAI completions key, OpenAI chat key) ("": the
 * front door has none; the request field begins td_gen_params_validate's message).
 */
#define TD_GEN_FIELDS(X)                                                                          \
    X(MAX_TOKENS, "max_tokens", "--max-tokens", "max_tokens", "max_tokens")                       \
    X(PROMPT, "prompt", "--prompt", "prompt", "messages")                                          \
    X(STOP_IDS, "stop_ids", "--stop-id", "stop", "stop")                                           \
    X(STOP_STRINGS, "stop_strings", "--stop", "stop", "stop")                                      \
    X(TOP_LOGPROBS, "top_logprobs", "--logprobs", "logprobs", "top_logprobs")                      \
    X(PROMPT_LOGPROBS, "prompt_logprobs", "--prompt-logprobs", "logprobs", "top_logprobs")        \
    X(LOGIT_BIAS, "logit_bias", "--logit-bias", "logit_bias", "logit_bias")                       \
    X(TPOT_OBJECTIVE, "tpot_objective_ms", "--tpot-objective-ms", "tpot_objective_ms", "tpot_objective_ms")

typedef enum td_gen_field {
    TD_GEN_FIELD_NONE = 0, /* every field in range */
#define TD_GEN_FIELD_SAMPLING(ID, ...) TD_GEN_FIELD_##ID = TD_SAMPLING_FIELD_##ID,
    TD_SAMPLING_FIELDS(TD_GEN_FIELD_SAMPLING)
#undef TD_GEN_FIELD_SAMPLING
#define TD_GEN_FIELD_ENUM(id, req, flag, oai, chat) TD_GEN_FIELD_##id,
    TD_GEN_FIELDS(TD_GEN_FIELD_ENUM)
#undef TD_GEN_FIELD_ENUM
    TD_GEN_FIELD_COUNT
} td_gen_field_t;

typedef struct td_gen_field_names {
    const char *request;      /* GenerateRequest's field, as the message begins */
    const char *flag;         /* tandem generate's flag ("" none) */
    const char *openai;       /* the OpenAI completions API's key ("" none) */
    const char *openai_chat;  /* the OpenAI chat API's key ("" none) */
} td_gen_field_names_t;

/* The names of field f (NONE and out-of-range values: all ""). */
td_gen_field_names_t td_gen_field_names(td_gen_field_t f);

/* td_gen_params_validate's check, returning which field failed (TD_GEN_FIELD_NONE: all in
 * range) with the message in why (if non-NULL); sets no last error. Pure. */
td_gen_field_t td_gen_params_check(const td_gen_params_t *p, char *why, size_t why_cap);

/*
 * Checks every field's range; NaN and infinities are refused. TD_OK, or TD_ERR_INVALID with
 * a message naming the field, its value and the allowed range ("top_p -0.5 is out of range
 * (0, 1]", "stop string 0 is 300 bytes long, at most 256 allowed"), in `why` if non-NULL and
 * as this thread's last error; the first fault found is reported. The message begins with the
 * field's request name (TD_GEN_FIELDS or TD_SAMPLING_FIELDS; "stop string N" for one stop string); a front door
 * that names the field in its own words asks td_gen_params_check. Does not log: a bad request
 * is the client's error, reported by the front door. Pure; any thread.
 */
td_status_t td_gen_params_validate(const td_gen_params_t *p, char *why, size_t why_cap);

#endif /* TD_GEN_PARAMS_H */
