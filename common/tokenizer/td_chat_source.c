/*
 * td_chat_source: the chat template of a model path, rendering a conversation with it and
 * encoding the result (td_chat_source.h).
 */
#include "td_chat_source.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "td_gguf.h"
#include "td_util.h"

/* tokenizer_config.json files of real models are KiBs to a few MiBs (added tokens listed) */
#define CHAT_MAX_CONFIG ((size_t)64 << 20)

/* Compiles src[0..len), naming `where` in the error. */
static td_status_t compile(const char *src, size_t len, const char *where, td_chat_template_t **tmpl_p)
{
    char err[512];
    td_status_t st = td_chat_template_create(src, len, tmpl_p, err, sizeof err);
    if (st != TD_OK)
        return td_errorf(st, "%s: chat template: %s", where, err);
    return TD_OK;
}

/* A GGUF file's tokenizer.chat_template; *found false (no error) when it has none. */
static td_status_t from_gguf(const char *path, td_chat_template_t **tmpl_p, bool *found)
{
    td_gguf_t *g;
    td_status_t st = td_gguf_open(path, &g);
    if (st != TD_OK)
        return st;
    const td_gguf_kv_t *kv = td_gguf_find(g, "tokenizer.chat_template");
    if (kv && kv->type != TD_GGUF_STRING)
        st = td_errorf(TD_ERR_FORMAT, "%s: tokenizer.chat_template is a %s, not a string", path,
                       td_gguf_type_name(kv->type));
    else if (kv) {
        char where[4200];
        snprintf(where, sizeof where, "%s (tokenizer.chat_template)", path);
        st = compile(kv->v.str.data, kv->v.str.len, where, tmpl_p);
        *found = st == TD_OK;
    }
    td_gguf_close(g);
    return st;
}

/* The "chat_template" of a parsed tokenizer_config.json: a string, or the list of
 * {"name", "template"} entries whose "default" one is the chat template. NULL (no error)
 * when absent. */
static td_status_t config_template(const cJSON *cfg, const char *path, const char **src_p)
{
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template"), *it;
    *src_p = NULL;
    if (!ct || cJSON_IsNull(ct))
        return TD_OK;
    if (cJSON_IsString(ct)) {
        *src_p = ct->valuestring;
        return TD_OK;
    }
    if (!cJSON_IsArray(ct))
        return td_errorf(TD_ERR_FORMAT, "%s: chat_template is neither a string nor a list of {name, template}",
                         path);
    cJSON_ArrayForEach(it, ct)
    {
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
        const cJSON *tmpl = cJSON_GetObjectItemCaseSensitive(it, "template");
        if (cJSON_IsString(name) && !strcmp(name->valuestring, "default")) {
            if (!cJSON_IsString(tmpl))
                return td_errorf(TD_ERR_FORMAT, "%s: chat_template entry \"default\" has no template string", path);
            *src_p = tmpl->valuestring;
            return TD_OK;
        }
    }
    return td_errorf(TD_ERR_FORMAT, "%s: chat_template is a list without a \"default\" entry", path);
}

/* dir/tokenizer_config.json's chat_template, else dir/chat_template.jinja (where newer
 * transformers save it); *found false (no error) when neither has one. */
static td_status_t from_dir(const char *dir, td_chat_template_t **tmpl_p, bool *found)
{
    char path[4096];
    char *data = NULL;
    size_t len;
    td_status_t st;
    if ((st = td_path_join(path, sizeof path, dir, "tokenizer_config.json")) != TD_OK)
        return td_errorf(st, "%s: path too long", dir);
    if (td_is_file(path)) {
        if ((st = td_file_read_all(path, CHAT_MAX_CONFIG, &data, &len)) != TD_OK)
            return st;
        size_t bom = td_utf8_bom_len(data, len);
        cJSON *cfg = cJSON_ParseWithLength(data + bom, len - bom);
        free(data);
        if (!cJSON_IsObject(cfg)) {
            cJSON_Delete(cfg);
            return td_errorf(TD_ERR_FORMAT, "%s: not a JSON object", path);
        }
        const char *src;
        if ((st = config_template(cfg, path, &src)) == TD_OK && src) {
            st = compile(src, strlen(src), path, tmpl_p);
            *found = st == TD_OK;
        }
        cJSON_Delete(cfg);
        if (st != TD_OK || *found)
            return st;
    }
    if ((st = td_path_join(path, sizeof path, dir, "chat_template.jinja")) != TD_OK)
        return td_errorf(st, "%s: path too long", dir);
    if (!td_is_file(path))
        return TD_OK;
    if ((st = td_file_read_all(path, CHAT_MAX_CONFIG, &data, &len)) != TD_OK)
        return st;
    st = compile(data, len, path, tmpl_p);
    free(data);
    *found = st == TD_OK;
    return st;
}

/* The template of one path: a GGUF file, a directory, or a file in a directory (a
 * tokenizer.json: its folder). */
static td_status_t from_path(const char *path, td_chat_template_t **tmpl_p, bool *found)
{
    if (td_is_dir(path))
        return from_dir(path, tmpl_p, found);
    if (td_gguf_is_gguf(path))
        return from_gguf(path, tmpl_p, found);
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if ((size_t)(slash - path) < sizeof dir)
        snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    else
        return td_errorf(TD_ERR_RANGE, "%s: path too long", path);
    return from_dir(dir, tmpl_p, found);
}

td_status_t td_chat_template_for_model(const char *model_path, const char *tokenizer_path,
                                       td_chat_template_t **tmpl_p)
{
    bool found = false;
    td_status_t st = from_path(model_path, tmpl_p, &found);
    if (st != TD_OK || found)
        return st;
    if (tokenizer_path && strcmp(tokenizer_path, model_path)) {
        if ((st = from_path(tokenizer_path, tmpl_p, &found)) != TD_OK || found)
            return st;
        return td_errorf_quiet(
            TD_ERR_NOT_FOUND,
            "%s has no chat template, nor has its tokenizer %s (GGUF tokenizer.chat_template, "
            "tokenizer_config.json chat_template or chat_template.jinja): chat needs one; "
            "give the prompt without --chat",
            model_path, tokenizer_path);
    }
    /* not logged: a model without a template is an error only to a caller that asked for
       chat (--chat logs it); a server starts and serves prompts */
    return td_errorf_quiet(
        TD_ERR_NOT_FOUND,
        "%s has no chat template (GGUF tokenizer.chat_template, tokenizer_config.json "
        "chat_template or chat_template.jinja): chat needs one; give the prompt without --chat",
        model_path);
}

td_status_t td_chat_render_messages(const td_chat_template_t *t, const td_tokenizer_t *tok,
                                    const td_chat_message_t *messages, size_t n, const char *tools,
                                    char **text_p, size_t *len_p)
{
    td_chat_render_t r = td_chat_render_default();
    r.tools = tools;
    r.messages = messages;
    r.n_messages = n;
    r.add_generation_prompt = true;
    r.bos_token = td_tokenizer_id_to_piece(tok, td_tokenizer_bos_id(tok), NULL);
    const int32_t *eos;
    if (td_tokenizer_eos_ids(tok, &eos) > 0)
        r.eos_token = td_tokenizer_id_to_piece(tok, eos[0], NULL);
    char err[512];
    td_status_t st = td_chat_template_render(t, &r, text_p, len_p, err, sizeof err);
    if (st != TD_OK)
        return td_errorf(st, "chat template: %s", err);
    return TD_OK;
}

td_status_t td_chat_encode(const td_tokenizer_t *tok, const char *text, size_t len, bool add_bos,
                           int32_t **ids_p, size_t *n_p)
{
    size_t bos_len = 0;
    const char *bos = td_tokenizer_id_to_piece(tok, td_tokenizer_bos_id(tok), &bos_len);
    if (bos && bos_len && len >= bos_len && !memcmp(text, bos, bos_len))
        add_bos = false;
    return td_tokenizer_encode(tok, text, len, add_bos ? TD_TOK_ADD_BOS : 0, ids_p, n_p);
}
