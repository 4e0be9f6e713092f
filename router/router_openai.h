/*
 * router_openai: OpenAI's HTTP API as the router reads and writes it, without any I/O
 * (router_http.c serves it): a /v1/completions or /v1/chat/completions body parsed and
 * checked into the router's own request (td_gen_params_t and the prompt or conversation),
 * and the JSON the client gets back (a whole response, SSE chunks, errors, the model list)
 * written into a growing buffer. docs/openai.md lists what is read and what is refused.
 *
 * Reading follows OpenAI's servers: unknown fields are ignored, a field of the wrong type
 * is a 400 naming it (`param`), null is "not given". Values are handed over as received
 * (td_gen_params_check, run by router_http.c on what this parses, refuses what is out of
 * range with the field's name, which is OpenAI's name too).
 *
 * Pure; any thread; no global state.
 */
#ifndef ROUTER_OPENAI_H
#define ROUTER_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "td_chat_template.h"
#include "td_gen_params.h"
#include "td_gram.h"
#include "td_sampler.h"
#include "td_status.h"
#include "td_tools.h"

#define ROUTER_OAI_MAX_LOGPROBS 20 /* top_logprobs / completions' logprobs at most */
#define ROUTER_OAI_MAX_N 16        /* choices per request (n) at most: each is a sequence on a decode node */

typedef enum { ROUTER_OAI_COMPLETIONS, ROUTER_OAI_CHAT } router_oai_kind_t;

/* What tool_choice asks (docs/openai.md "Tools"). */
typedef enum {
    ROUTER_OAI_TOOLS_NONE,     /* no tools, or "none": the output is text, never parsed */
    ROUTER_OAI_TOOLS_AUTO,     /* free generation, parsed into calls */
    ROUTER_OAI_TOOLS_REQUIRED, /* a grammar makes the output calls of the tools */
    ROUTER_OAI_TOOLS_NAMED,    /* a grammar makes the output a call of tool_choice_name */
} router_oai_tool_choice_t;

/* An error as OpenAI shapes it: {"error": {"message", "type", "param", "code"}}. */
typedef struct router_oai_error {
    int status;               /* HTTP status: 400, 401, 404, 405, 413, 429, 503, ... */
    const char *type;         /* "invalid_request_error", ...; a static string */
    const char *code;         /* NULL (null) or a static string ("model_not_found") */
    char param[64];           /* "" (null) or the request's field */
    char message[512];
} router_oai_error_t;

/* A parsed request. Strings point into doc (or are NULL when not given). */
typedef struct router_oai_req {
    router_oai_kind_t kind;
    cJSON *doc;                       /* owns every string below */
    const char *model;                /* NULL: not given */
    td_gen_params_t gp;               /* as received (not yet validated); stop strings in stops */
    const char *stops[TD_STOP_MAX_STRINGS + 1];
    const char *prompt;               /* completions: a text prompt, or NULL */
    size_t prompt_len;
    uint32_t *prompt_ids;             /* completions: [gp.prompt_len] token ids, or NULL (malloc'ed) */
    td_chat_message_t *messages;      /* chat: [n_messages] (malloc'ed; strings in doc) */
    size_t n_messages;
    int32_t n;                        /* choices wanted, [1, ROUTER_OAI_MAX_N] */
    bool stream, include_usage, echo;
    int32_t logprobs;                 /* -1: none; else the alternatives per token wanted [0, 20] */
    const char *user;
    /* The output constraint (response_format json_object/json_schema, vLLM's guided_* or
     * structured_outputs, llama.cpp's grammar/json_schema), translated to GBNF; NULL: none. */
    char *grammar;                    /* malloc'ed GBNF text, checked by td_gram_compile */
    td_gram_kind_t grammar_kind;      /* what the client sent */
    char grammar_param[64];           /* the field that carried it, for errors */
    /* Tools (chat): the array for the template, each tool's name and parameters, and what
     * tool_choice and parallel_tool_calls ask. */
    const char *tools_json;           /* the tools array as JSON text (in texts), or NULL */
    td_tool_t *tools;                 /* [n_tools] (malloc'ed; strings in doc or texts) */
    size_t n_tools;
    router_oai_tool_choice_t tool_choice;
    const char *tool_choice_name;     /* ROUTER_OAI_TOOLS_NAMED: the function's name */
    bool parallel_tool_calls;         /* false: at most one call */
    bool legacy_functions;            /* the tools came as `functions` (OpenAI's older form): the
                                       * answer is message.function_call, finish "function_call" */
    cJSON *texts;                     /* strings made while reading (JSON texts), owned */
} router_oai_req_t;

/*
 * Parses body[0..len) as a `kind` request into *q (all of it replaced). TD_OK, or
 * TD_ERR_INVALID with *err filled (400, the field in param) for bad JSON, a wrong type, a
 * missing prompt/messages, n outside [1, ROUTER_OAI_MAX_N], best_of other than n, a
 * logit_bias key that is not a token id, too many stops or logprobs past 20;
 * TD_ERR_NOMEM (err: 500). On error *q holds nothing to free; on success free it with
 * router_oai_req_free.
 */
td_status_t router_oai_parse(router_oai_kind_t kind, const char *body, size_t len, router_oai_req_t *q,
                             router_oai_error_t *err);

/*
 * The tools array `tools` (OpenAI's chat "tools"; NULL: none) and what tool_choice asks into
 * q: `choice` one of "none", "auto", "required", or else `name` a tool's name, or both NULL
 * (auto with tools, else none); choice_param names the field in errors. The one reading of
 * tools both front doors use (router_oai_parse; the gRPC gateway, which parses
 * GenerateRequest.tools_json into q->doc first). Strings stay in tools' document; q->texts
 * gets the JSON texts. TD_ERR_INVALID with *err (400): a tool that is not {"type":
 * "function", "function": {"name", "parameters"?: object}}, an unknown choice or name, a
 * choice of a call without tools; TD_ERR_NOMEM (err: 500). q is freed by router_oai_req_free.
 */
td_status_t router_oai_tools_read(router_oai_req_t *q, const cJSON *tools, const char *choice, const char *name,
                                  const char *choice_param, router_oai_error_t *err);

/*
 * For a chat request with tools, checks them against the model's tool-call format `fmt`
 * (the router's, from its chat template or --tool-call-format) and, for tool_choice required
 * or a named function, puts the grammar of such calls in q->grammar. TD_OK (also without
 * tools), or TD_ERR_INVALID with *err (400): tools for a model without a format, a
 * parameters schema td_gram refuses (param tools[i].function.parameters, the keyword named),
 * a forced call with another output constraint (conflicting_parameters); TD_ERR_NOMEM.
 */
td_status_t router_oai_tools_prepare(router_oai_req_t *q, td_tools_format_t fmt, router_oai_error_t *err);

/* Frees what q holds. NULL-safe, repeatable. */
void router_oai_req_free(router_oai_req_t *q);

/* Fills *err (status, type, param or NULL, code or NULL; message printf-style). */
void router_oai_error_set(router_oai_error_t *err, int status, const char *type, const char *param,
                          const char *code, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* The OpenAI status and type for a failure in the router's vocabulary (gRPC codes):
 * INVALID_ARGUMENT 400, UNAUTHENTICATED 401, NOT_FOUND 404, RESOURCE_EXHAUSTED 429,
 * UNAVAILABLE 503, DEADLINE_EXCEEDED 504, others 500. */
void router_oai_error_from_code(int grpc_code, const char *msg, router_oai_error_t *err);

/* ---- writing ------------------------------------------------------------------------- */

/* A growing byte buffer; on out of memory `oom` is set and further appends do nothing. */
typedef struct router_oai_buf {
    char *p;
    size_t n, cap;
    bool oom;
} router_oai_buf_t;

void router_oai_buf_free(router_oai_buf_t *b);
void router_oai_buf_put(router_oai_buf_t *b, const char *s, size_t len);
void router_oai_buf_puts(router_oai_buf_t *b, const char *s);
void router_oai_buf_printf(router_oai_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* s[0..len) as a JSON string, quoted; bytes that are not valid UTF-8 become U+FFFD (a
 * token may end inside a character; the detokenizer holds those back, ids without text
 * may not). */
void router_oai_buf_json_str(router_oai_buf_t *b, const char *s, size_t len);

/* What every response of one request shares. */
typedef struct router_oai_resp {
    router_oai_kind_t kind;
    const char *id;           /* "cmpl-..." / "chatcmpl-..." */
    const char *model;
    int64_t created;          /* unix seconds */
    int32_t index;            /* a chunk's choices[0].index: the choice it belongs to (n > 1) */
    bool legacy_functions;    /* chat with `functions`: a call is written in the older shape
                               * (message.function_call, delta.function_call) */
} router_oai_resp_t;

/* The usage object's numbers. */
typedef struct router_oai_usage {
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
    uint32_t migrations;      /* > 0: "migrations", tandem's own field (the stream moved) */
} router_oai_usage_t;

/* A token's text for log-probabilities: its bytes into buf[0..cap), the length returned
 * (at most cap; 0 for none). */
typedef size_t (*router_oai_token_text_cb)(void *ctx, int32_t id, char *buf, size_t cap);

/* Log-probabilities of n tokens as the value of choices[0].logprobs: completions'
 * {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (offsets counted from
 * text_offset0, token texts laid end to end), or chat's {"content": [{"token", "logprob",
 * "bytes", "top_logprobs"}], "refusal": null}. With first_null the first token's logprob
 * and alternatives are null (a prompt's first token has no context: echo). Non-finite
 * logprobs are written as -9999.0 (JSON has no -inf). Returns the text offset after the
 * last token (text_offset0 plus their texts' bytes), for the next message's. */
size_t router_oai_logprobs(router_oai_buf_t *b, router_oai_kind_t kind, const td_token_logprob_t *lps, size_t n,
                           bool first_null, size_t text_offset0, router_oai_token_text_cb text_cb, void *ctx);

/* One SSE event "data: {chunk}\n\n" with text[0..len) as choices[0].text (index rs->index; completions) or
 * .delta.content (chat; the first chunk, `first`, also carries role "assistant"); logprobs
 * the JSON of choices[0].logprobs (router_oai_logprobs) or NULL (null); finish_reason
 * ("stop", "length") or NULL (null); with `usage_null` ("include_usage" was asked) the
 * chunk carries "usage": null as OpenAI's do. */
void router_oai_chunk(router_oai_buf_t *b, const router_oai_resp_t *rs, bool first, const char *text, size_t len,
                      const char *logprobs, const char *finish_reason, bool usage_null);

/* A streamed tool call of choice rs->index: two SSE events, the call's index, id, type and
 * function name (with role "assistant" when `first`), then its arguments text args[0..len).
 * name NULL: only the second (the next piece of streamed arguments); args NULL: only the
 * first (a call whose arguments follow in pieces). With rs->legacy_functions, OpenAI's older
 * deltas: delta.function_call {"name", "arguments": ""}, then {"arguments"} (no index, no id). */
void router_oai_tool_call_chunk(router_oai_buf_t *b, const router_oai_resp_t *rs, bool first, uint32_t index,
                                const char *id, const char *name, const char *args, size_t len, bool usage_null);

/* A tool call's id for both front doors: "call_" and 24 letters and digits (9 and no prefix
 * for Mistral's format, whose template checks them), made from the request's id, the choice
 * (n > 1) and the call's index in it, so each is unique. */
void router_oai_tool_call_id(const char *req_id, td_tools_format_t fmt, uint32_t choice, uint32_t index, char id[40]);

/* Both front doors' streaming bookkeeping: a request's output text[0..n) of which *fed bytes
 * already went through parser p; feeds the rest (and with `last` ends the parser), events to
 * cb. *fed becomes n, so a send refused as busy and made again from the same text does not
 * feed it twice; the caller sets *fed to 0 once that text is gone (sent and cleared). */
td_status_t router_oai_tools_feed(td_tools_parser_t *p, size_t *fed, const char *text, size_t n, bool last,
                                  td_tools_event_cb cb, void *ctx);

/* One tool call of a whole answer's message.tool_calls array: {"id", "type", "function":
 * {"name", "arguments"}} appended to b (a "," first unless it is index 0). */
void router_oai_tool_call_json(router_oai_buf_t *b, uint32_t index, const char *id, const char *name,
                               const char *args, size_t len);

/* The one call of a whole answer to a request with `functions` (OpenAI's older form):
 * message.function_call's value {"name", "arguments"} appended to b. */
void router_oai_function_call_json(router_oai_buf_t *b, const char *name, const char *args, size_t len);

/* The last chunk when usage was asked: "choices": [] and the usage. */
void router_oai_usage_chunk(router_oai_buf_t *b, const router_oai_resp_t *rs, const router_oai_usage_t *u);

/* "data: [DONE]\n\n" */
void router_oai_done(router_oai_buf_t *b);

/* A whole (non-streamed) response: the text as choices[0].text or .message.content, its
 * logprobs (as router_oai_chunk's), finish_reason and the usage. */
void router_oai_response(router_oai_buf_t *b, const router_oai_resp_t *rs, const char *text, size_t len,
                         const char *logprobs, const char *finish_reason, const router_oai_usage_t *u);

/* A whole response of several choices (n > 1): begin (the head and "choices": [), then one
 * choice each, indexes 0, 1, ... in order (as router_oai_response's choice, with that
 * index; tool_calls as router_oai_response_tools', NULL for none), then end (the usage of
 * them all). router_oai_response is these three for one. */
void router_oai_response_begin(router_oai_buf_t *b, const router_oai_resp_t *rs);
void router_oai_response_choice(router_oai_buf_t *b, const router_oai_resp_t *rs, int32_t index, const char *text,
                                size_t len, const char *tool_calls, const char *logprobs, const char *reason);
void router_oai_response_end(router_oai_buf_t *b, const router_oai_usage_t *u);

/* router_oai_response for chat with message.tool_calls: tool_calls the items written by
 * router_oai_tool_call_json (without brackets); the content null when it is empty. With
 * rs->legacy_functions, tool_calls is router_oai_function_call_json's object, written as
 * message.function_call. */
void router_oai_response_tools(router_oai_buf_t *b, const router_oai_resp_t *rs, const char *text, size_t len,
                               const char *tool_calls, const char *logprobs, const char *finish_reason,
                               const router_oai_usage_t *u);

/* {"error": {...}} */
void router_oai_error_json(router_oai_buf_t *b, const router_oai_error_t *err);

/* GET /v1/models: one model, `created` unix seconds. */
void router_oai_models(router_oai_buf_t *b, const char *model, int64_t created);

#endif /* ROUTER_OPENAI_H */
