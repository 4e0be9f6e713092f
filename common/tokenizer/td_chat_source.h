/*
 * td_chat_source: a model's conversation turned into prompt token ids (module td_tok): where
 * the chat template of a model path is found, how a conversation is rendered with it, and
 * how the rendered text is encoded. The one place `tandem generate --chat`, `tandem chat`
 * and the router's chat requests go through, so a conversation means the same ids
 * everywhere.
 *
 * The template is, in this order of looking:
 *   - a GGUF model file's `tokenizer.chat_template` string;
 *   - a Hugging Face model directory's tokenizer_config.json "chat_template": a string, or
 *     the list form [{"name": "default", "template": "..."}, ...] (the "default" entry);
 *   - the same beside the tokenizer (a tokenizer directory, or the folder of a
 *     tokenizer.json), when the tokenizer is given apart from the model.
 * It is rendered by td_chat_template with add_generation_prompt true and bos_token /
 * eos_token the tokenizer's BOS piece and first EOS piece, as Hugging Face's
 * apply_chat_template passes them.
 *
 * Encoding follows Hugging Face and llama.cpp: special tokens written in the rendered text
 * ("<|im_start|>", "<s>") become their ids, and a BOS is prepended only when the model adds
 * one and the text does not already start with the BOS text (templates such as Llama 3's
 * write it themselves).
 *
 * Threads: every function is reentrant; a compiled template and a tokenizer may be shared.
 */
#ifndef TD_CHAT_SOURCE_H
#define TD_CHAT_SOURCE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_chat_template.h"
#include "td_status.h"
#include "td_tokenizer.h"

/*
 * Finds and compiles the chat template of `model_path` (a GGUF file or a model directory),
 * else of `tokenizer_path` (NULL: not looked at), as the header says. On success *tmpl_p is
 * the caller's (td_chat_template_destroy). Errors: TD_ERR_NOT_FOUND, not logged (a caller
 * that needs chat logs td_last_error(); a server serves prompts without), when neither has
 * a template (the message names what was looked at and says chat needs one); logged: TD_ERR_FORMAT
 * for an unreadable tokenizer_config.json, a chat_template of the wrong type, a list without
 * a "default" entry, or a template that does not compile (with its line and column);
 * TD_ERR_UNSUPPORTED for Jinja outside td_chat_template's subset; TD_ERR_IO; TD_ERR_NOMEM.
 */
td_status_t td_chat_template_for_model(const char *model_path, const char *tokenizer_path,
                                       td_chat_template_t **tmpl_p);

/*
 * Renders messages[0..n) with t for `tok` (bos_token / eos_token its pieces, undefined where
 * it has none), `tools` (OpenAI's tools array as JSON text, or NULL: undefined) and
 * add_generation_prompt true, into a malloc'd NUL-terminated *text_p (caller frees) of
 * *len_p bytes (len_p may be NULL). Errors, logged: those of td_chat_template_render (a
 * template's raise_exception message is passed on).
 */
td_status_t td_chat_render_messages(const td_chat_template_t *t, const td_tokenizer_t *tok,
                                    const td_chat_message_t *messages, size_t n, const char *tools,
                                    char **text_p, size_t *len_p);

/*
 * Encodes a rendered conversation text[0..len): special tokens in the text become their ids;
 * BOS is prepended when add_bos (the model adds one) and the text does not start with the BOS
 * piece. *ids_p / *n_p as td_tokenizer_encode (caller frees). Errors: td_tokenizer_encode's.
 */
td_status_t td_chat_encode(const td_tokenizer_t *tok, const char *text, size_t len, bool add_bos,
                           int32_t **ids_p, size_t *n_p);

#endif /* TD_CHAT_SOURCE_H */
