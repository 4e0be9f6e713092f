/*
 * td_chat_template: a model's chat template (GGUF tokenizer.chat_template, or
 * tokenizer_config.json's chat_template) rendered into the prompt text (module td_tok).
 *
 * Chat templates are Jinja2 programs; this is an interpreter for the subset real templates
 * use (ChatML/SmolLM, Qwen2, Llama 3, Mistral), rendering byte for byte what Python's
 * jinja2 renders with the environment Hugging Face uses (trim_blocks, lstrip_blocks,
 * raise_exception). tests/fixtures/chat holds the checked templates and conversations.
 *
 * Supported: text, {{ expr }}, {% if/elif/else/endif %}, {% for x in xs %} and
 * {% for k, v in pairs %} (with a loop filter `if cond`, {% else %} and
 * loop.index0/index/revindex/revindex0/first/last/length), {% set name = expr %},
 * {% set ns.attr = expr %}, whitespace control ({%- -%} {{- -}} {%+ +%}), {# comments #};
 * expressions: string, integer, boolean and none literals, [lists], variables, x.attr, x[i],
 * x[a:b:c], comparisons, and/or/not, in / not in, + - * // % ~, `a if c else b`; filters
 * trim, length/count, upper, lower, default/d, string, tojson (indent=N; Hugging Face's:
 * json.dumps with ensure_ascii off), items, list, join, first, last, select/reject,
 * selectattr/rejectattr (with a test name and argument, e.g. "equalto"); methods of strings
 * (startswith, endswith, split, strip, lstrip, rstrip, upper, lower) and mappings (items,
 * keys, values, get); tests defined, undefined, none, string, number, integer, float,
 * mapping, sequence, iterable, boolean, true, false, even, odd (and `is not`); calls
 * raise_exception(msg), range(n) and namespace(name=value, ...). `tools` and messages'
 * tool_calls arrive as JSON and become mappings, lists, strings, integers, floats, booleans
 * and none (64 levels deep at most). Anything else is refused at compile time (or, for a
 * filter applied to an unsupported value, at render time) with the line and column.
 *
 * A template is hostile input: compiling never crashes or reads past the source, nesting
 * is limited, and rendering is bounded by td_chat_render_t's limits (output bytes,
 * evaluation steps, working memory), each a clear error.
 *
 * Ownership: a compiled template is immutable and owns all it points to; one
 * td_chat_template_destroy frees it. Threads: any number of threads may render one
 * compiled template at once. Errors: every failing call writes a message (line and column
 * in the template, then what was wrong or expected) into err[0..err_cap) when err is not
 * NULL, and leaves its outputs untouched.
 */
#ifndef TD_CHAT_TEMPLATE_H
#define TD_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

typedef struct td_chat_template td_chat_template_t;

/* One turn of a conversation: strings NUL-terminated, owned by the caller. The template
 * sees a mapping with role and content, then only the optional keys given (not NULL). */
typedef struct td_chat_message {
    const char *role;         /* "system", "user", "assistant", "tool", ... */
    const char *content;
    const char *tool_calls;   /* assistant: OpenAI's tool_calls array as JSON text, or NULL;
                               * a function.arguments holding an object's JSON text is handed
                               * to the template as that object (as vLLM does) */
    const char *tool_call_id; /* tool: the call answered, or NULL */
    const char *name;         /* tool: the function's name, or NULL */
} td_chat_message_t;

/* What one render sees and the bounds it runs under (td_chat_render_default()). */
typedef struct td_chat_render {
    const td_chat_message_t *messages; /* [n_messages] */
    size_t n_messages;
    const char *bos_token; /* NULL: undefined in the template */
    const char *eos_token; /* NULL: undefined in the template */
    const char *tools;     /* OpenAI's tools array as JSON text (bound as `tools`), or NULL:
                            * undefined */
    bool add_generation_prompt;
    size_t max_output;  /* bytes of rendered text */
    uint64_t max_steps; /* expression evaluations + loop iterations */
    size_t max_memory;  /* bytes of working values (strings, lists) during one render */
} td_chat_render_t;

/* No messages, no tokens, add_generation_prompt false; 1 MiB of output, 1,000,000
 * steps, 64 MiB of working memory. */
td_chat_render_t td_chat_render_default(void);

/* Compiles src[0..len). *tmpl_p on success. ERR_FORMAT for a syntax error, ERR_UNSUPPORTED
 * for Jinja outside the subset above, ERR_RANGE for nesting deeper than 64, ERR_NOMEM. */
td_status_t td_chat_template_create(const char *src, size_t len, td_chat_template_t **tmpl_p,
                                    char *err, size_t err_cap);

/* Renders t with r into a malloc'd NUL-terminated string *out_p (length *len_p when
 * len_p is not NULL); the caller frees it with free(). ERR_INVALID when the template calls
 * raise_exception (the message is the template's) or does something invalid for these
 * values (an attribute of an undefined value, adding a string to a number);
 * ERR_EXHAUSTED when a limit of r is reached; ERR_UNSUPPORTED; ERR_NOMEM. */
td_status_t td_chat_template_render(const td_chat_template_t *t, const td_chat_render_t *r,
                                    char **out_p, size_t *len_p, char *err, size_t err_cap);

/* The template's source text (NUL-terminated, owned by t), *len_p its length when not NULL. */
const char *td_chat_template_source(const td_chat_template_t *t, size_t *len_p);

/* Frees t; NULL is a no-op. */
void td_chat_template_destroy(td_chat_template_t *t);

#endif /* TD_CHAT_TEMPLATE_H */
