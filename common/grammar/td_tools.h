/*
 * td_tools: tool calling in a model's own words (module td_gram). A model trained for tools
 * writes its calls in the format of its chat template; this module knows three of them,
 * finds which one a template uses, parses a model's output into calls (whole or streamed in
 * pieces of any size), and builds the grammar that makes a model call a tool with arguments
 * valid against the tool's `parameters` schema (OpenAI's tool_choice "required" or a named
 * function).
 *
 *   hermes       Qwen2.5, Qwen3, Hermes:  text <tool_call>\n{"name": N, "arguments": {..}}\n</tool_call>
 *   llama3_json  Llama 3.1/3.2:           {"name": N, "parameters": {..}}  (the whole output)
 *   mistral      Mistral v0.3 and later:  [TOOL_CALLS] [{"name": N, "arguments": {..}}, ...]
 *
 * Ownership: the parser is opaque (create/destroy) and owns its buffered text; events point
 * into it and live until the next call on the parser. Threads: a parser is one caller's;
 * everything else is pure. Errors: statuses with td_last_error() set by the function that
 * decides them.
 */
#ifndef TD_TOOLS_H
#define TD_TOOLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

typedef enum td_tools_format {
    TD_TOOLS_NONE = 0, /* the template has no tool calls */
    TD_TOOLS_HERMES,
    TD_TOOLS_LLAMA3_JSON,
    TD_TOOLS_MISTRAL,
} td_tools_format_t;

/* "none", "hermes", "llama3_json", "mistral". */
const char *td_tools_format_name(td_tools_format_t fmt);

/* The format named `name` (td_tools_format_name's words). TD_ERR_INVALID naming the choices. */
td_status_t td_tools_format_parse(const char *name, td_tools_format_t *fmt_p);

/* The format a chat template writes tool calls in, found in its source: "<tool_call>" is
 * hermes, "[TOOL_CALLS]" mistral, a `"parameters": ` call with Llama's ipython role
 * llama3_json; else TD_TOOLS_NONE. */
td_tools_format_t td_tools_detect(const char *template_src, size_t len);

/* One tool as a request offers it. */
typedef struct td_tool {
    const char *name;       /* NUL-terminated */
    const char *parameters; /* its JSON Schema as JSON text, or NULL: any JSON object */
} td_tool_t;

/*
 * GBNF for an output that is one call (or, with `parallel`, one or more calls) of the tools
 * tools[0..n) in fmt's words, each call's arguments valid against its tool's parameters, and
 * nothing else. *gbnf_p is the caller's (free()). Errors: a tool's parameters schema that
 * td_gram refuses (TD_ERR_UNSUPPORTED, TD_ERR_FORMAT, TD_ERR_RANGE, TD_ERR_INVALID) with
 * *bad_p its index and td_last_error() td_gram's message; TD_ERR_INVALID for no tools or
 * TD_TOOLS_NONE; TD_ERR_NOMEM.
 */
td_status_t td_tools_grammar(td_tools_format_t fmt, const td_tool_t *tools, size_t n, bool parallel,
                             char **gbnf_p, size_t *bad_p);

/* ---- parsing a model's output ---- */

typedef enum td_tools_event_kind {
    TD_TOOLS_CONTENT,    /* text[0..len) is the answer's text */
    TD_TOOLS_CALL,       /* a whole call: name, arguments (JSON text of an object) */
    TD_TOOLS_CALL_BEGIN, /* a streamed call begins (td_tools_parser_stream_args): index, name */
    TD_TOOLS_CALL_ARGS,  /* the next piece of a streamed call's arguments text: index, arguments */
} td_tools_event_kind_t;

typedef struct td_tools_event {
    td_tools_event_kind_t kind;
    const char *text; /* content */
    size_t len;
    uint32_t index;   /* call: 0 for the first call of the output */
    const char *name; /* call: NUL-terminated */
    const char *arguments;
    size_t arguments_len;
} td_tools_event_t;

/* Receives events in output order; returns TD_OK or an error that stops the parser's call. */
typedef td_status_t (*td_tools_event_cb)(void *ctx, const td_tools_event_t *ev);

typedef struct td_tools_parser td_tools_parser_t;

/* A parser of fmt's output (TD_TOOLS_NONE: everything is content); `max_calls` calls at most
 * (0: no bound; later ones are dropped); `max_bytes` bounds the text held while a call is
 * incomplete (past it, the held text is given as content). TD_ERR_NOMEM. */
td_status_t td_tools_parser_create(td_tools_format_t fmt, uint32_t max_calls, size_t max_bytes,
                                   td_tools_parser_t **p_p);

/* Streams arguments (for a client that reads them as they come, as OpenAI's deltas): a call
 * that opens as `{"name": N, "arguments": {` ("parameters" for llama3_json; blanks between the
 * tokens as JSON allows) is given as TD_TOOLS_CALL_BEGIN once that much is read, then its
 * arguments object's text in TD_TOOLS_CALL_ARGS pieces as it arrives, through its closing
 * brace: the pieces joined are the text a TD_TOOLS_CALL would carry. Such a call is taken
 * as a call from its head on: if the output ends (or the JSON goes wrong) inside it, the
 * arguments given are all there is. Other calls (arguments first, arguments written as a
 * string, past max_calls) are given whole, as without streaming. Set before the first feed. */
void td_tools_parser_stream_args(td_tools_parser_t *p, bool on);

/* Feeds the next piece of output. Content that cannot be the start of a call is given at
 * once; text that may be is held until it is known. The callback's error is returned;
 * TD_ERR_NOMEM. */
td_status_t td_tools_parser_feed(td_tools_parser_t *p, const char *text, size_t len,
                                 td_tools_event_cb cb, void *ctx);

/* The output ended: a call that is complete JSON is given as a call, any other held text as
 * content. */
td_status_t td_tools_parser_finish(td_tools_parser_t *p, td_tools_event_cb cb, void *ctx);

/* Calls given so far. */
uint32_t td_tools_parser_calls(const td_tools_parser_t *p);

/* Frees p; NULL is a no-op. */
void td_tools_parser_destroy(td_tools_parser_t *p);

#endif /* TD_TOOLS_H */
