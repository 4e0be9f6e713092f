/*
 * router_openai: OpenAI's request bodies read into the router's request, and OpenAI's
 * response shapes written (see router_openai.h). Reading is cJSON's; writing is by hand
 * into a buffer, since a streamed request writes one chunk per step and a tree per chunk
 * would cost more than the relay itself.
 */
#include "router_openai.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "td_hash.h"
#include "td_util.h"

/* ---- errors ---------------------------------------------------------------------------- */

void router_oai_error_set(router_oai_error_t *err, int status, const char *type, const char *param,
                          const char *code, const char *fmt, ...)
{
    err->status = status;
    err->type = type;
    err->code = code;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

void router_oai_error_from_code(int grpc_code, const char *msg, router_oai_error_t *err)
{
    int status = 500;
    const char *type = "server_error";
    switch (grpc_code) {
    case 3: status = 400; type = "invalid_request_error"; break;           /* INVALID_ARGUMENT */
    case 16: status = 401; type = "authentication_error"; break;          /* UNAUTHENTICATED */
    case 5: status = 404; type = "not_found_error"; break;                /* NOT_FOUND */
    case 8: status = 429; type = "rate_limit_error"; break;               /* RESOURCE_EXHAUSTED */
    case 14: status = 503; type = "service_unavailable"; break;           /* UNAVAILABLE */
    case 4: status = 504; type = "timeout"; break;                        /* DEADLINE_EXCEEDED */
    default: break;
    }
    router_oai_error_set(err, status, type, NULL, NULL, "%s", msg && msg[0] ? msg : "request failed");
}

/* ---- reading --------------------------------------------------------------------------- */

static void bad_type(router_oai_error_t *err, const char *param, const char *want, const cJSON *got)
{
    const char *what = cJSON_IsString(got) ? "a string" : cJSON_IsBool(got) ? "a boolean"
                       : cJSON_IsNumber(got) ? "a number" : cJSON_IsArray(got) ? "an array"
                       : cJSON_IsObject(got) ? "an object" : "something else";
    router_oai_error_set(err, 400, "invalid_request_error", param, "invalid_type",
                         "Invalid type for '%s': expected %s, but got %s instead.", param, want, what);
}

/* The member `name` of o; NULL when absent or null (OpenAI reads null as not given). */
static const cJSON *member(const cJSON *o, const char *name)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static bool get_number(const cJSON *o, const char *name, double *out, bool *given, router_oai_error_t *err)
{
    const cJSON *v = member(o, name);
    if (given)
        *given = v != NULL;
    if (!v)
        return true;
    if (!cJSON_IsNumber(v)) {
        bad_type(err, name, "a number", v);
        return false;
    }
    *out = v->valuedouble;
    return true;
}

/* An integer: a JSON number without a fraction. */
static bool get_int(const cJSON *o, const char *name, int64_t *out, bool *given, router_oai_error_t *err)
{
    const cJSON *v = member(o, name);
    if (given)
        *given = v != NULL;
    if (!v)
        return true;
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || d != floor(d) || !isfinite(d)) {
        bad_type(err, name, "an integer", v);
        return false;
    }
    /* past int64: kept at the edge of the range, so the range check names it */
    *out = d >= 9.2e18 ? INT64_MAX : d <= -9.2e18 ? INT64_MIN : (int64_t)d;
    return true;
}

static bool get_bool(const cJSON *o, const char *name, bool *out, router_oai_error_t *err)
{
    const cJSON *v = member(o, name);
    if (!v)
        return true;
    if (!cJSON_IsBool(v)) {
        bad_type(err, name, "a boolean", v);
        return false;
    }
    *out = cJSON_IsTrue(v);
    return true;
}

static bool get_string(const cJSON *o, const char *name, const char **out, router_oai_error_t *err)
{
    const cJSON *v = member(o, name);
    if (!v)
        return true;
    if (!cJSON_IsString(v)) {
        bad_type(err, name, "a string", v);
        return false;
    }
    *out = v->valuestring;
    return true;
}

/* Sampling parameters, each TD_SAMPLING_FIELDS row with an OpenAI key, handed over as
 * received (td_gen_params_validate checks ranges by the same names). Two spots are OpenAI's
 * own: temperature defaults to 1, not our greedy 0, and top_k -1 is vLLM's "off". */
static bool read_sampling(const cJSON *o, td_gen_params_t *gp, router_oai_error_t *err)
{
    td_sampling_t *sp = &gp->sampling;
    sp->temperature = 1.0f;
    for (int f = TD_SAMPLING_FIELD_NONE + 1; f < TD_SAMPLING_FIELD_END; f++) {
        const td_sampling_field_desc_t *d = td_sampling_field_desc((td_sampling_field_t)f);
        void *v = td_sampling_field_ptr(sp, d);
        double x;
        int64_t i;
        bool given;
        if (!d->openai)
            continue;
        switch (d->type) {
        case TD_SAMPLING_F32:
            if (!get_number(o, d->openai, &x, &given, err))
                return false;
            if (given)
                *(float *)v = (float)x;
            break;
        case TD_SAMPLING_I32: /* past int32: kept at the edge of the range, so the range check names it */
            if (!get_int(o, d->openai, &i, &given, err))
                return false;
            if (given)
                *(int32_t *)v = i > INT32_MAX ? INT32_MAX : i < INT32_MIN ? INT32_MIN : (int32_t)i;
            break;
        case TD_SAMPLING_U64:
            if (!get_int(o, d->openai, &i, &given, err))
                return false;
            if (given)
                *(uint64_t *)v = (uint64_t)i;
            break;
        }
    }
    if (sp->top_k == -1) /* vLLM's -1 (and 0) is "off", as our 0; other negatives reach the range check */
        sp->top_k = 0;
    return true;
}

static bool read_stop(const cJSON *o, router_oai_req_t *q, router_oai_error_t *err)
{
    const cJSON *v = member(o, "stop");
    size_t n = 0;
    if (!v)
        return true;
    if (cJSON_IsString(v)) {
        q->stops[n++] = v->valuestring;
    } else if (cJSON_IsArray(v)) {
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            if (!cJSON_IsString(e)) {
                bad_type(err, "stop", "a string or an array of strings", v);
                return false;
            }
            if (n == TD_STOP_MAX_STRINGS) {
                router_oai_error_set(err, 400, "invalid_request_error", "stop", NULL,
                                     "'stop' has %d strings, at most %d are allowed", cJSON_GetArraySize(v),
                                     TD_STOP_MAX_STRINGS);
                return false;
            }
            q->stops[n++] = e->valuestring;
        }
    } else {
        bad_type(err, "stop", "a string or an array of strings", v);
        return false;
    }
    q->gp.n_stop_strings = n;
    q->gp.stop_strings = q->stops;
    return true;
}

/* A completions prompt: a string, an array of token ids, or either inside an array of one
 * (one prompt per request: n and batches are refused). */
static bool read_prompt(const cJSON *o, router_oai_req_t *q, router_oai_error_t *err)
{
    const cJSON *v = member(o, "prompt");
    static const char want[] = "a string or an array of token ids";
    if (!v) {
        router_oai_error_set(err, 400, "invalid_request_error", "prompt", NULL, "'prompt' is required");
        return false;
    }
    if (cJSON_IsArray(v) && cJSON_GetArraySize(v) == 1 &&
        (cJSON_IsString(v->child) || cJSON_IsArray(v->child)))
        v = v->child; /* ["text"] or [[ids]] */
    if (cJSON_IsString(v)) {
        q->prompt = v->valuestring;
        q->prompt_len = strlen(v->valuestring);
        q->gp.prompt_is_text = true;
        q->gp.prompt_len = q->prompt_len;
        return true;
    }
    if (!cJSON_IsArray(v)) {
        bad_type(err, "prompt", want, v);
        return false;
    }
    int n = cJSON_GetArraySize(v);
    if (n == 0 || (n > 1 && !cJSON_IsNumber(v->child))) {
        router_oai_error_set(err, 400, "invalid_request_error", "prompt", NULL,
                             n ? "'prompt' holds %d prompts; send one per request" : "'prompt' is empty", n);
        return false;
    }
    if (!(q->prompt_ids = malloc((size_t)n * sizeof *q->prompt_ids))) {
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
        return false;
    }
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, v) {
        double d = e->valuedouble;
        if (!cJSON_IsNumber(e) || d != floor(d) || d < 0 || d > UINT32_MAX) {
            router_oai_error_set(err, 400, "invalid_request_error", "prompt", NULL,
                                 "'prompt' token %zu is not a token id (a non-negative integer)", i);
            return false;
        }
        q->prompt_ids[i++] = (uint32_t)d;
    }
    q->gp.prompt_is_text = false;
    q->gp.prompt_len = i;
    return true;
}

/* A message's content: a string, or an array of text parts joined into one string (kept in
 * the document: the part array is replaced by it). */
static bool read_content(cJSON *m, size_t i, const char **out, router_oai_error_t *err)
{
    char param[64];
    snprintf(param, sizeof param, "messages[%zu].content", i);
    cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
    if (!c || cJSON_IsNull(c)) {
        *out = "";
        return true;
    }
    if (cJSON_IsString(c)) {
        *out = c->valuestring;
        return true;
    }
    if (!cJSON_IsArray(c)) {
        bad_type(err, param, "a string or an array of text parts", c);
        return false;
    }
    router_oai_buf_t b = {0};
    const cJSON *part;
    cJSON_ArrayForEach(part, c) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(text)) {
            router_oai_buf_free(&b);
            router_oai_error_set(err, 400, "invalid_request_error", param, NULL,
                                 "'%s': only text parts ({\"type\": \"text\", \"text\": ...}) are served", param);
            return false;
        }
        router_oai_buf_puts(&b, text->valuestring);
    }
    router_oai_buf_put(&b, "", 1); /* the NUL */
    cJSON *joined = b.oom ? NULL : cJSON_CreateString(b.p);
    router_oai_buf_free(&b);
    if (!joined || !cJSON_ReplaceItemInObjectCaseSensitive(m, "content", joined)) {
        cJSON_Delete(joined);
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
        return false;
    }
    *out = joined->valuestring;
    return true;
}

/* v printed as JSON text that lives as long as q (in q->texts): *out. */
static bool keep_text(router_oai_req_t *q, const cJSON *v, const char **out, router_oai_error_t *err)
{
    char *printed = cJSON_PrintUnformatted(v);
    cJSON *str = printed ? cJSON_CreateString(printed) : NULL;
    free(printed);
    if (!q->texts)
        q->texts = cJSON_CreateArray();
    if (!str || !q->texts || !cJSON_AddItemToArray(q->texts, str)) {
        cJSON_Delete(str);
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
        return false;
    }
    *out = str->valuestring;
    return true;
}

/* A message's tool-calling members: an assistant's tool_calls (kept as JSON text for the
 * template), a tool result's tool_call_id and name. */
/* An assistant message's function_call (OpenAI's older form of a tool call) as the one
 * tool call [{"type": "function", "function": {"name", "arguments"}}], printed into
 * cm->tool_calls, as the chat template reads calls. */
static bool read_message_function_call(const cJSON *m, size_t i, router_oai_req_t *q, router_oai_error_t *err)
{
    char param[64];
    const cJSON *fc = member(m, "function_call");
    const cJSON *name = cJSON_IsObject(fc) ? member(fc, "name") : NULL;
    snprintf(param, sizeof param, "messages[%zu].function_call", i);
    if (member(m, "tool_calls")) {
        router_oai_error_set(err, 400, "invalid_request_error", param, "conflicting_parameters",
                             "'%s' and 'messages[%zu].tool_calls' are both given: send one", param, i);
        return false;
    }
    if (!cJSON_IsString(name)) {
        router_oai_error_set(err, 400, "invalid_request_error", param, NULL,
                             "'%s' must be {\"name\", \"arguments\"} with a name", param);
        return false;
    }
    cJSON *calls = cJSON_CreateArray(), *c = cJSON_CreateObject();
    if (!calls || !c || !cJSON_AddItemToArray(calls, c)) { /* c is not calls' */
        cJSON_Delete(calls);
        cJSON_Delete(c);
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
        return false;
    }
    bool ok = cJSON_AddStringToObject(c, "type", "function") && cJSON_AddItemReferenceToObject(c, "function", (cJSON *)fc);
    if (!ok)
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
    ok = ok && keep_text(q, calls, &q->messages[i].tool_calls, err);
    cJSON_Delete(calls); /* the reference leaves fc in the body's document */
    return ok;
}

static bool read_message_tools(const cJSON *m, size_t i, router_oai_req_t *q, router_oai_error_t *err)
{
    char param[64];
    td_chat_message_t *cm = &q->messages[i];
    const cJSON *tc = member(m, "tool_calls");
    if (member(m, "function_call") && !read_message_function_call(m, i, q, err))
        return false;
    snprintf(param, sizeof param, "messages[%zu].tool_calls", i);
    if (tc && !cJSON_IsArray(tc)) {
        bad_type(err, param, "an array", tc);
        return false;
    }
    const cJSON *c;
    size_t k = 0;
    cJSON_ArrayForEach(c, tc) {
        const cJSON *fn = cJSON_IsObject(c) ? member(c, "function") : NULL;
        const cJSON *name = fn && cJSON_IsObject(fn) ? member(fn, "name") : NULL;
        if (!cJSON_IsString(name)) {
            snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu].function.name", i, k);
            router_oai_error_set(err, 400, "invalid_request_error", param, NULL,
                                 "'%s' is required: a tool call is {\"id\", \"type\": \"function\", "
                                 "\"function\": {\"name\", \"arguments\"}}", param);
            return false;
        }
        k++;
    }
    if (tc && tc->child && !keep_text(q, tc, &cm->tool_calls, err))
        return false;
    static const char *const strs[] = {"tool_call_id", "name"};
    for (size_t f = 0; f < 2; f++) {
        const cJSON *v = member(m, strs[f]);
        snprintf(param, sizeof param, "messages[%zu].%s", i, strs[f]);
        if (v && !cJSON_IsString(v)) {
            bad_type(err, param, "a string", v);
            return false;
        }
        if (v)
            *(f ? &cm->name : &cm->tool_call_id) = v->valuestring;
    }
    q->gp.prompt_len += (cm->tool_calls ? strlen(cm->tool_calls) : 0) +
                        (cm->tool_call_id ? strlen(cm->tool_call_id) : 0) + (cm->name ? strlen(cm->name) : 0);
    return true;
}

static bool read_messages(const cJSON *o, router_oai_req_t *q, router_oai_error_t *err)
{
    const cJSON *v = member(o, "messages");
    if (!v) {
        router_oai_error_set(err, 400, "invalid_request_error", "messages", NULL, "'messages' is required");
        return false;
    }
    if (!cJSON_IsArray(v)) {
        bad_type(err, "messages", "an array", v);
        return false;
    }
    size_t n = (size_t)cJSON_GetArraySize(v);
    if (!n) {
        router_oai_error_set(err, 400, "invalid_request_error", "messages", NULL, "'messages' is empty");
        return false;
    }
    if (!(q->messages = calloc(n, sizeof *q->messages))) {
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
        return false;
    }
    size_t i = 0;
    cJSON *m;
    cJSON_ArrayForEach(m, v) {
        char param[64];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!cJSON_IsObject(m)) {
            bad_type(err, param, "an object", m);
            return false;
        }
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!cJSON_IsString(role)) {
            snprintf(param, sizeof param, "messages[%zu].role", i);
            if (role)
                bad_type(err, param, "a string", role);
            else
                router_oai_error_set(err, 400, "invalid_request_error", param, NULL, "'%s' is required", param);
            return false;
        }
        /* OpenAI's older form of a tool result: {"role": "function", "name", "content"} */
        q->messages[i].role = strcmp(role->valuestring, "function") ? role->valuestring : "tool";
        if (!read_content(m, i, &q->messages[i].content, err) || !read_message_tools(m, i, q, err))
            return false;
        q->gp.prompt_len += strlen(q->messages[i].role) + strlen(q->messages[i].content) + TD_GEN_MESSAGE_BYTES;
        i++;
    }
    q->n_messages = n;
    q->gp.prompt_is_text = true;
    return true;
}

/* n, the choices wanted: [1, ROUTER_OAI_MAX_N]. best_of (completions) only as n itself:
 * drawing more candidates than are returned, and ranking them, is not served. */
static bool read_n(const cJSON *o, router_oai_req_t *q, router_oai_error_t *err)
{
    int64_t n = 1, best_of = 0;
    bool best_given = false;
    if (!get_int(o, "n", &n, NULL, err) || !get_int(o, "best_of", &best_of, &best_given, err))
        return false;
    if (n < 1 || n > ROUTER_OAI_MAX_N) {
        router_oai_error_set(err, 400, "invalid_request_error", "n", NULL,
                             "'n' %lld is out of range [1, %d]: choices per request", (long long)n, ROUTER_OAI_MAX_N);
        return false;
    }
    if (best_given && best_of != n) {
        router_oai_error_set(err, 400, "invalid_request_error", "best_of", "unsupported_value",
                             "'best_of' %lld is not served: it may only equal n (%lld); candidates beyond the "
                             "choices returned are not drawn", (long long)best_of, (long long)n);
        return false;
    }
    q->n = (int32_t)n;
    return true;
}

/* One logit_bias id as written: a JSON key ("1234") or a list entry's first element. */
static bool bias_id(const char *key, double num, bool is_key, int32_t *id_p, router_oai_error_t *err)
{
    char *end = NULL;
    double v = num;
    if (is_key) {
        errno = 0;
        long long x = key[0] >= '0' && key[0] <= '9' ? strtoll(key, &end, 10) : -1;
        v = errno || !end || *end ? -1 : (double)x;
    }
    if (!(v >= 0 && v <= INT32_MAX && v == floor(v))) {
        if (is_key)
            router_oai_error_set(err, 400, "invalid_request_error", "logit_bias", NULL,
                                 "'logit_bias' key '%.40s' is not a token id (a decimal integer >= 0)", key);
        else
            router_oai_error_set(err, 400, "invalid_request_error", "logit_bias", NULL,
                                 "'logit_bias' entry [%g, ...] does not start with a token id (an integer >= 0)", num);
        return false;
    }
    *id_p = (int32_t)v;
    return true;
}

/* OpenAI's logit_bias, {"token id": bias, ...}, or llama.cpp's list form [[id, bias], ...],
 * into the sampling parameters as received: the count, ranges and duplicates are
 * td_gen_params_check's (td_sampling_check_bias), the ids against the model's vocabulary the
 * router's admission check. At most TD_SAMPLING_MAX_LOGIT_BIAS are copied; more are counted,
 * so the check refuses them by number. */
static bool read_logit_bias(const cJSON *o, td_sampling_t *sp, router_oai_error_t *err)
{
    const cJSON *v = member(o, "logit_bias"), *e;
    if (!v)
        return true;
    if (!cJSON_IsObject(v) && !cJSON_IsArray(v)) {
        bad_type(err, "logit_bias", "an object of token id to bias (or a list of [id, bias] pairs)", v);
        return false;
    }
    int32_t n = 0;
    cJSON_ArrayForEach(e, v) {
        const cJSON *b = e;
        int32_t id;
        if (cJSON_IsArray(v)) { /* [id, bias] */
            const cJSON *first = cJSON_GetArrayItem(e, 0);
            b = cJSON_GetArrayItem(e, 1);
            if (!cJSON_IsArray(e) || cJSON_GetArraySize(e) != 2 || !cJSON_IsNumber(first)) {
                bad_type(err, "logit_bias", "an object of token id to bias (or a list of [id, bias] pairs)", e);
                return false;
            }
            if (!bias_id(NULL, first->valuedouble, false, &id, err))
                return false;
        } else if (!bias_id(e->string, 0, true, &id, err)) {
            return false;
        }
        if (!cJSON_IsNumber(b)) {
            router_oai_error_set(err, 400, "invalid_request_error", "logit_bias", "invalid_type",
                                 "'logit_bias' of token %d is not a number", id);
            return false;
        }
        if (n < TD_SAMPLING_MAX_LOGIT_BIAS) {
            sp->logit_bias_ids[n] = id;
            sp->logit_bias[n] = (float)b->valuedouble;
        }
        n += n < INT32_MAX;
    }
    sp->n_logit_bias = n;
    return true;
}

/* Features that change what a request means and are not served: refused by name rather
 * than ignored. */
static bool refuse_unserved(const cJSON *o, bool chat, router_oai_error_t *err)
{
    /* tools and functions (their older form) are read for chat (read_tools) */
    static const char *const unserved[] = {"tools", "functions", "suffix"};
    for (size_t i = 0; i < TD_ARRAY_LEN(unserved); i++) {
        if (chat && strcmp(unserved[i], "suffix"))
            continue;
        const cJSON *v = member(o, unserved[i]);
        if (v && !((cJSON_IsArray(v) || cJSON_IsObject(v)) && !v->child) && !(cJSON_IsString(v) && !v->valuestring[0])) {
            router_oai_error_set(err, 400, "invalid_request_error", unserved[i], "unsupported_parameter",
                                 "'%s' is not served by this server", unserved[i]);
            return false;
        }
    }
    return true;
}

/* ---- structured outputs ---------------------------------------------------------------- */

/* One constraint found in the body: its kind, the field that carried it (for errors) and
 * the value to compile (a string's text, or an object/array printed as JSON). */
typedef struct oai_constraint {
    td_gram_kind_t kind;
    char param[64];
    const cJSON *value; /* NULL for json_object */
} oai_constraint_t;

/* Records the constraint `value` under `param`; a second one is refused (which of them
 * should win is not ours to guess). */
static bool add_constraint(oai_constraint_t *c, bool *have, td_gram_kind_t kind, const char *param,
                           const cJSON *value, router_oai_error_t *err)
{
    if (*have) {
        router_oai_error_set(err, 400, "invalid_request_error", param, "conflicting_parameters",
                             "'%s' and '%s' both constrain the output: give at most one", c->param, param);
        return false;
    }
    *have = true;
    c->kind = kind;
    snprintf(c->param, sizeof c->param, "%s", param);
    c->value = value;
    return true;
}

/* A member that must be a string (regex, GBNF): NULL when absent. */
static bool constraint_string(const cJSON *o, const char *name, const char *param, const cJSON **v_p,
                              router_oai_error_t *err)
{
    const cJSON *v = member(o, name);
    if (v && !cJSON_IsString(v)) {
        bad_type(err, param, "a string", v);
        return false;
    }
    *v_p = v;
    return true;
}

/* The constraints a body may carry, OpenAI's, vLLM's and llama.cpp's names, into *c. */
static bool find_constraint(const cJSON *o, oai_constraint_t *c, bool *have, router_oai_error_t *err)
{
    const cJSON *rf = member(o, "response_format");
    if (rf) {
        const cJSON *t = cJSON_IsObject(rf) ? cJSON_GetObjectItemCaseSensitive(rf, "type") : NULL;
        if (!cJSON_IsObject(rf)) {
            bad_type(err, "response_format", "an object", rf);
            return false;
        }
        if (!cJSON_IsString(t)) {
            router_oai_error_set(err, 400, "invalid_request_error", "response_format.type", NULL,
                                 "'response_format.type' is required: \"text\", \"json_object\" or \"json_schema\"");
            return false;
        }
        if (!strcmp(t->valuestring, "json_object")) {
            if (!add_constraint(c, have, TD_GRAM_JSON_OBJECT, "response_format", NULL, err))
                return false;
        } else if (!strcmp(t->valuestring, "json_schema")) {
            const cJSON *js = member(rf, "json_schema");
            const cJSON *schema = js && cJSON_IsObject(js) ? member(js, "schema") : NULL;
            if (!js || !cJSON_IsObject(js)) {
                bad_type(err, "response_format.json_schema", "an object", js ? js : rf);
                return false;
            }
            const cJSON *strict = member(js, "strict");
            if (strict && !cJSON_IsBool(strict)) {
                bad_type(err, "response_format.json_schema.strict", "a boolean", strict);
                return false;
            }
            /* OpenAI allows the schema left out: then any JSON object, as json_object */
            if (schema && !cJSON_IsObject(schema) && !cJSON_IsBool(schema)) {
                bad_type(err, "response_format.json_schema.schema", "an object", schema);
                return false;
            }
            if (!add_constraint(c, have, schema ? TD_GRAM_JSON_SCHEMA : TD_GRAM_JSON_OBJECT,
                                "response_format.json_schema.schema", schema, err))
                return false;
        } else if (strcmp(t->valuestring, "text")) {
            router_oai_error_set(err, 400, "invalid_request_error", "response_format.type", "unsupported_value",
                                 "'response_format.type' \"%.32s\" is not one of \"text\", \"json_object\", "
                                 "\"json_schema\"", t->valuestring);
            return false;
        }
    }
    /* vLLM's guided_* fields, its newer structured_outputs object, llama.cpp's fields */
    const cJSON *so = member(o, "structured_outputs");
    if (so && !cJSON_IsObject(so)) {
        bad_type(err, "structured_outputs", "an object", so);
        return false;
    }
    static const struct {
        const char *name, *param;
        bool in_so;
        td_gram_kind_t kind;
    } fields[] = {
        {"guided_json", "guided_json", false, TD_GRAM_JSON_SCHEMA},
        {"guided_regex", "guided_regex", false, TD_GRAM_REGEX},
        {"guided_choice", "guided_choice", false, TD_GRAM_CHOICE},
        {"guided_grammar", "guided_grammar", false, TD_GRAM_GBNF},
        {"json", "structured_outputs.json", true, TD_GRAM_JSON_SCHEMA},
        {"regex", "structured_outputs.regex", true, TD_GRAM_REGEX},
        {"choice", "structured_outputs.choice", true, TD_GRAM_CHOICE},
        {"grammar", "structured_outputs.grammar", true, TD_GRAM_GBNF},
        {"json_schema", "json_schema", false, TD_GRAM_JSON_SCHEMA},
        {"grammar", "grammar", false, TD_GRAM_GBNF},
    };
    for (size_t i = 0; i < TD_ARRAY_LEN(fields); i++) {
        const cJSON *in = fields[i].in_so ? so : o;
        if (!in)
            continue;
        const cJSON *v = NULL;
        switch (fields[i].kind) {
        case TD_GRAM_REGEX:
        case TD_GRAM_GBNF:
            if (!constraint_string(in, fields[i].name, fields[i].param, &v, err))
                return false;
            break;
        case TD_GRAM_CHOICE:
            if ((v = member(in, fields[i].name)) && !cJSON_IsArray(v)) {
                bad_type(err, fields[i].param, "an array of strings", v);
                return false;
            }
            break;
        default: /* a schema: an object, or (vLLM) its JSON text */
            if ((v = member(in, fields[i].name)) && !cJSON_IsObject(v) && !cJSON_IsString(v) && !cJSON_IsBool(v)) {
                bad_type(err, fields[i].param, "an object", v);
                return false;
            }
            break;
        }
        if (v && !add_constraint(c, have, fields[i].kind, fields[i].param, v, err))
            return false;
    }
    if (so) {
        const cJSON *jo = member(so, "json_object");
        bool want = false;
        if (jo && !get_bool(so, "json_object", &want, err)) {
            snprintf(err->param, sizeof err->param, "structured_outputs.json_object");
            return false;
        }
        if (want && !add_constraint(c, have, TD_GRAM_JSON_OBJECT, "structured_outputs.json_object", NULL, err))
            return false;
    }
    return true;
}

/*
 * Reads the output constraint, if any, and translates it to GBNF (q->grammar): compiling
 * it here checks it whole, so an unsupported keyword, a bad regex or a grammar that cannot
 * match is a 400 naming the field and the keyword before any node is asked, and the nodes
 * only ever compile GBNF. Bounded by TD_GRAM_MAX_SOURCE and the expansion bounds.
 */
static bool read_constraint(const cJSON *o, router_oai_req_t *q, router_oai_error_t *err)
{
    oai_constraint_t c = {0};
    bool have = false;
    if (!find_constraint(o, &c, &have, err))
        return false;
    if (!have)
        return true;
    char *printed = NULL;
    const char *src = "";
    size_t len = 0;
    if (c.value && cJSON_IsString(c.value)) {
        src = c.value->valuestring;
        len = strlen(src);
    } else if (c.value) {
        if (!(printed = cJSON_PrintUnformatted(c.value))) {
            router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
            return false;
        }
        src = printed;
        len = strlen(printed);
    }
    td_status_t st = td_gram_to_gbnf(c.kind, src, len, &q->grammar);
    free(printed);
    if (st == TD_ERR_NOMEM) {
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
        return false;
    }
    if (st != TD_OK) {
        router_oai_error_set(err, 400, "invalid_request_error", c.param,
                             st == TD_ERR_UNSUPPORTED ? "unsupported_value" : "invalid_value", "'%s': %s", c.param,
                             td_last_error());
        return false;
    }
    q->grammar_kind = c.kind;
    snprintf(q->grammar_param, sizeof q->grammar_param, "%s", c.param);
    return true;
}

/* ---- tools ----------------------------------------------------------------------------- */

td_status_t router_oai_tools_read(router_oai_req_t *q, const cJSON *tools, const char *choice, const char *name,
                                  const char *choice_param, router_oai_error_t *err)
{
    if (tools && !cJSON_IsArray(tools)) {
        bad_type(err, "tools", "an array", tools);
        return TD_ERR_INVALID;
    }
    size_t n = tools ? (size_t)cJSON_GetArraySize(tools) : 0;
    if (n && !(q->tools = calloc(n, sizeof *q->tools))) {
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
        return TD_ERR_NOMEM;
    }
    const cJSON *t;
    char param[64];
    cJSON_ArrayForEach(t, tools) {
        size_t i = q->n_tools;
        const cJSON *type = cJSON_IsObject(t) ? member(t, "type") : NULL;
        const cJSON *fn = cJSON_IsObject(t) ? member(t, "function") : NULL;
        const cJSON *fname = cJSON_IsObject(fn) ? member(fn, "name") : NULL;
        snprintf(param, sizeof param, "tools[%zu]", i);
        if (!cJSON_IsObject(t) || !cJSON_IsString(type) || strcmp(type->valuestring, "function") ||
            !cJSON_IsString(fname) || !fname->valuestring[0]) {
            router_oai_error_set(err, 400, "invalid_request_error", param, NULL,
                                 "'%s' must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                                 "\"description\": ..., \"parameters\": {...}}} with a name", param);
            return TD_ERR_INVALID;
        }
        const cJSON *params = member(fn, "parameters");
        if (params && !cJSON_IsObject(params)) {
            snprintf(param, sizeof param, "tools[%zu].function.parameters", i);
            bad_type(err, param, "an object (a JSON Schema)", params);
            return TD_ERR_INVALID;
        }
        q->tools[i].name = fname->valuestring;
        if (params && !keep_text(q, params, &q->tools[i].parameters, err))
            return TD_ERR_INVALID;
        q->n_tools++;
    }
    if (n && !keep_text(q, tools, &q->tools_json, err))
        return TD_ERR_INVALID;
    if (q->tools_json)
        q->gp.prompt_len += strlen(q->tools_json);
    q->tool_choice = n ? ROUTER_OAI_TOOLS_AUTO : ROUTER_OAI_TOOLS_NONE;
    if (choice) {
        static const char *const words[] = {"none", "auto", "required"};
        size_t k = 0;
        while (k < 3 && strcmp(choice, words[k]))
            k++;
        if (k == 3) {
            router_oai_error_set(err, 400, "invalid_request_error", choice_param, "unsupported_value",
                                 "'%s' \"%.32s\" is not one of \"none\", \"auto\", \"required\" or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}", choice_param, choice);
            return TD_ERR_INVALID;
        }
        q->tool_choice = (router_oai_tool_choice_t)k;
    } else if (name) {
        size_t k = 0;
        while (k < q->n_tools && strcmp(q->tools[k].name, name))
            k++;
        if (k == q->n_tools) {
            router_oai_error_set(err, 400, "invalid_request_error", choice_param, NULL,
                                 "'%s' \"%.64s\" is not one of the tools", choice_param, name);
            return TD_ERR_INVALID;
        }
        q->tool_choice = ROUTER_OAI_TOOLS_NAMED;
        q->tool_choice_name = name;
    }
    if (q->tool_choice != ROUTER_OAI_TOOLS_NONE && !n) {
        router_oai_error_set(err, 400, "invalid_request_error", choice_param, NULL,
                             "'%s' asks for a tool call, but the request has no tools", choice_param);
        return TD_ERR_INVALID;
    }
    return TD_OK;
}

/* The fields that carried q's tools and its choice of them, for errors: "functions" and
 * "function_call" (the older form), or "tools" and "tool_choice". */
static const char *tools_field(const router_oai_req_t *q)
{
    return q->legacy_functions ? "functions" : "tools";
}

static const char *choice_field(const router_oai_req_t *q)
{
    return q->legacy_functions ? "function_call" : "tool_choice";
}

/* OpenAI's older form of tools: `functions` ([{"name", "description", "parameters"}]) and
 * `function_call` ("none", "auto" or {"name"}), read as tools of those functions and the
 * tool_choice it says, at most one call (the older answer has one function_call). Either
 * beside its newer form is a 400 naming both. */
static bool read_functions(const cJSON *o, router_oai_req_t *q, router_oai_error_t *err)
{
    const cJSON *fns = member(o, "functions"), *fc = member(o, "function_call");
    const cJSON *tools_new = member(o, "tools"), *tc_new = member(o, "tool_choice");
    if (tools_new || tc_new) {
        const char *old = fns ? "functions" : "function_call", *new = tools_new ? "tools" : "tool_choice";
        router_oai_error_set(err, 400, "invalid_request_error", old, "conflicting_parameters",
                             "'%s' and '%s' are both given: send one form ('functions' and 'function_call' "
                             "are the older form of 'tools' and 'tool_choice')", old, new);
        return false;
    }
    if (fns && !cJSON_IsArray(fns)) {
        bad_type(err, "functions", "an array", fns);
        return false;
    }
    char param[64];
    size_t i = 0;
    const cJSON *f;
    cJSON_ArrayForEach(f, fns) { /* named as functions[i] here, before they are read as tools */
        const cJSON *name = cJSON_IsObject(f) ? member(f, "name") : NULL, *params = cJSON_IsObject(f) ? member(f, "parameters") : NULL;
        snprintf(param, sizeof param, "functions[%zu]", i);
        if (!cJSON_IsString(name) || !name->valuestring[0]) {
            router_oai_error_set(err, 400, "invalid_request_error", param, NULL,
                                 "'%s' must be {\"name\": ..., \"description\": ..., \"parameters\": {...}} "
                                 "with a name", param);
            return false;
        }
        if (params && !cJSON_IsObject(params)) {
            snprintf(param, sizeof param, "functions[%zu].parameters", i);
            bad_type(err, param, "an object (a JSON Schema)", params);
            return false;
        }
        i++;
    }
    const char *word = NULL, *name = NULL, *cparam = "function_call";
    if (cJSON_IsString(fc)) {
        word = fc->valuestring;
        if (strcmp(word, "none") && strcmp(word, "auto")) {
            router_oai_error_set(err, 400, "invalid_request_error", "function_call", "unsupported_value",
                                 "'function_call' \"%.32s\" is not \"none\", \"auto\" or {\"name\": ...}", word);
            return false;
        }
    } else if (fc) {
        const cJSON *fname = cJSON_IsObject(fc) ? member(fc, "name") : NULL;
        if (!cJSON_IsString(fname)) {
            bad_type(err, "function_call", "\"none\", \"auto\" or {\"name\": ...}", fc);
            return false;
        }
        name = fname->valuestring;
        cparam = "function_call.name";
    }
    /* the functions as a tools array: {"type": "function", "function": <functions[i]>}, each a
     * reference into the body's document, where the names stay */
    cJSON *tools = fns && fns->child ? cJSON_CreateArray() : NULL;
    bool ok = !fns || !fns->child || tools;
    const cJSON *wrap = tools ? fns : NULL;
    cJSON_ArrayForEach(f, wrap) {
        cJSON *t = cJSON_CreateObject();
        ok = t && cJSON_AddItemToArray(tools, t) && cJSON_AddStringToObject(t, "type", "function") &&
             cJSON_AddItemReferenceToObject(t, "function", (cJSON *)f);
        if (!ok)
            break;
    }
    if (!ok) {
        cJSON_Delete(tools);
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
        return false;
    }
    q->legacy_functions = fns && fns->child;
    q->parallel_tool_calls = false;
    td_status_t st = router_oai_tools_read(q, tools, word, name, cparam, err);
    cJSON_Delete(tools); /* what q keeps is in the body's document or printed into q->texts */
    return st == TD_OK;
}

/* tools, tool_choice and parallel_tool_calls (chat), or functions and function_call. */
static bool read_tools(const cJSON *o, router_oai_req_t *q, router_oai_error_t *err)
{
    if (member(o, "functions") || member(o, "function_call"))
        return read_functions(o, q, err);
    q->parallel_tool_calls = true;
    if (!get_bool(o, "parallel_tool_calls", &q->parallel_tool_calls, err))
        return false;
    /* tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name"}} */
    const cJSON *tc = member(o, "tool_choice");
    const char *word = NULL, *name = NULL, *param = "tool_choice";
    if (cJSON_IsString(tc)) {
        word = tc->valuestring;
    } else if (tc) {
        const cJSON *fn = cJSON_IsObject(tc) ? member(tc, "function") : NULL;
        const cJSON *fname = cJSON_IsObject(fn) ? member(fn, "name") : NULL;
        if (!cJSON_IsString(fname)) {
            bad_type(err, "tool_choice", "\"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                         "\"function\": {\"name\": ...}}", tc);
            return false;
        }
        name = fname->valuestring;
        param = "tool_choice.function.name";
    }
    return router_oai_tools_read(q, member(o, "tools"), word, name, param, err) == TD_OK;
}

td_status_t router_oai_tools_prepare(router_oai_req_t *q, td_tools_format_t fmt, router_oai_error_t *err)
{
    if (!q->n_tools || q->tool_choice == ROUTER_OAI_TOOLS_NONE)
        return TD_OK;
    if (fmt == TD_TOOLS_NONE) {
        router_oai_error_set(err, 400, "invalid_request_error", tools_field(q), "unsupported_parameter",
                             "this model's chat template has no tool-call format that the router knows "
                             "(hermes <tool_call>, llama3_json, mistral [TOOL_CALLS]); start the router with "
                             "--tool-call-format, or send %s \"none\"",
                             choice_field(q));
        return TD_ERR_INVALID;
    }
    if (q->tool_choice == ROUTER_OAI_TOOLS_AUTO)
        return TD_OK;
    if (q->grammar) {
        router_oai_error_set(err, 400, "invalid_request_error", choice_field(q), "conflicting_parameters",
                             "'%s' %s constrains the output to tool calls, and '%s' constrains it too: "
                             "give one of them", choice_field(q), q->tool_choice == ROUTER_OAI_TOOLS_NAMED ? "(a function)"
                             : "\"required\"", q->grammar_param);
        return TD_ERR_INVALID;
    }
    td_tool_t named;
    const td_tool_t *tools = q->tools;
    size_t n = q->n_tools, bad = 0;
    if (q->tool_choice == ROUTER_OAI_TOOLS_NAMED) {
        for (size_t k = 0; k < q->n_tools; k++)
            if (!strcmp(q->tools[k].name, q->tool_choice_name)) {
                named = q->tools[k];
                bad = k;
            }
        tools = &named;
        n = 1;
    }
    size_t named_at = bad;
    td_status_t st = td_tools_grammar(fmt, tools, n, q->parallel_tool_calls, &q->grammar, &bad);
    if (st == TD_ERR_NOMEM) {
        router_oai_error_set(err, 500, "server_error", NULL, NULL, "router: out of memory");
        return st;
    }
    if (st) {
        char param[64];
        size_t at = q->tool_choice == ROUTER_OAI_TOOLS_NAMED ? named_at : bad;
        if (bad < n)
            snprintf(param, sizeof param, q->legacy_functions ? "functions[%zu].parameters"
                                                              : "tools[%zu].function.parameters", at);
        else
            snprintf(param, sizeof param, "%s", tools_field(q));
        router_oai_error_set(err, 400, "invalid_request_error", param,
                             st == TD_ERR_UNSUPPORTED ? "unsupported_value" : "invalid_value", "'%s': %s", param,
                             td_last_error());
        return TD_ERR_INVALID;
    }
    q->grammar_kind = TD_GRAM_GBNF;
    snprintf(q->grammar_param, sizeof q->grammar_param, "%s", choice_field(q));
    return TD_OK;
}

static bool read_logprobs(const cJSON *o, router_oai_req_t *q, router_oai_error_t *err)
{
    int64_t top = 0;
    bool top_given = false;
    q->logprobs = -1;
    if (q->kind == ROUTER_OAI_CHAT) {
        bool want = false;
        if (!get_bool(o, "logprobs", &want, err) || !get_int(o, "top_logprobs", &top, &top_given, err))
            return false;
        if (top_given && !want) {
            router_oai_error_set(err, 400, "invalid_request_error", "top_logprobs", NULL,
                                 "'top_logprobs' needs 'logprobs': true");
            return false;
        }
        if (!want)
            return true;
    } else {
        if (!get_int(o, "logprobs", &top, &top_given, err))
            return false;
        if (!top_given)
            return true;
    }
    const char *p = q->kind == ROUTER_OAI_CHAT ? "top_logprobs" : "logprobs";
    if (top < 0 || top > ROUTER_OAI_MAX_LOGPROBS) {
        router_oai_error_set(err, 400, "invalid_request_error", p, NULL, "'%s' %lld is out of range [0, %d]", p,
                             (long long)top, ROUTER_OAI_MAX_LOGPROBS);
        return false;
    }
    q->logprobs = (int32_t)top;
    return true;
}

td_status_t router_oai_parse(router_oai_kind_t kind, const char *body, size_t len, router_oai_req_t *q,
                             router_oai_error_t *err)
{
    memset(q, 0, sizeof *q);
    q->kind = kind;
    q->gp = td_gen_params_default();
    q->logprobs = -1;
    q->n = 1;
    const char *end = NULL;
    q->doc = cJSON_ParseWithLengthOpts(body, len, &end, false);
    while (q->doc && end < body + len && (*end == ' ' || *end == '\t' || *end == '\r' || *end == '\n'))
        end++;
    if (q->doc && end != body + len) { /* cJSON stops after the value: what follows is garbage */
        cJSON_Delete(q->doc);
        q->doc = NULL;
    }
    if (!q->doc) {
        size_t at = end && end >= body ? (size_t)(end - body) : 0;
        router_oai_error_set(err, 400, "invalid_request_error", NULL, NULL,
                             "the body is not valid JSON (at byte %zu of %zu)", at, len);
        goto err_free;
    }
    const cJSON *o = q->doc;
    if (!cJSON_IsObject(o)) {
        router_oai_error_set(err, 400, "invalid_request_error", NULL, NULL, "the body must be a JSON object");
        goto err_free;
    }
    int64_t max_tokens = 0, max_completion_tokens = 0;
    bool mt_given = false, mct_given = false;
    const cJSON *so = member(o, "stream_options");
    if (!get_string(o, "model", &q->model, err) || !get_int(o, "max_tokens", &max_tokens, &mt_given, err) ||
        !get_int(o, "max_completion_tokens", &max_completion_tokens, &mct_given, err) ||
        !read_sampling(o, &q->gp, err) || !read_logit_bias(o, &q->gp.sampling, err) || !read_n(o, q, err) ||
        !read_stop(o, q, err) || !refuse_unserved(o, kind == ROUTER_OAI_CHAT, err) ||
        !read_logprobs(o, q, err) || !read_constraint(o, q, err) || !get_bool(o, "stream", &q->stream, err) ||
        !get_string(o, "user", &q->user, err) || !get_bool(o, "ignore_eos", &q->gp.ignore_eos, err) ||
        !get_int(o, "tpot_objective_ms", &q->gp.tpot_objective_ms, NULL, err))
        goto err_free;
    if (kind == ROUTER_OAI_COMPLETIONS && !get_bool(o, "echo", &q->echo, err))
        goto err_free;
    if (so && !cJSON_IsObject(so)) {
        bad_type(err, "stream_options", "an object", so);
        goto err_free;
    }
    if (so && !get_bool(so, "include_usage", &q->include_usage, err)) {
        snprintf(err->param, sizeof err->param, "stream_options.include_usage");
        goto err_free;
    }
    /* chat's newer name wins; 0 (and absent) is the router's default-max-tokens */
    if ((mct_given ? max_completion_tokens : max_tokens) < 0) {
        const char *p = mct_given ? "max_completion_tokens" : "max_tokens";
        router_oai_error_set(err, 400, "invalid_request_error", p, NULL, "'%s' %lld must be at least 1", p,
                             (long long)(mct_given ? max_completion_tokens : max_tokens));
        goto err_free;
    }
    q->gp.max_tokens = mct_given ? max_completion_tokens : mt_given ? max_tokens : 0;
    if (kind == ROUTER_OAI_CHAT ? !read_messages(o, q, err) || !read_tools(o, q, err) : !read_prompt(o, q, err))
        goto err_free;
    return TD_OK;
err_free:
    router_oai_req_free(q);
    return err->status == 500 ? TD_ERR_NOMEM : TD_ERR_INVALID;
}

void router_oai_req_free(router_oai_req_t *q)
{
    if (!q)
        return;
    cJSON_Delete(q->doc);
    cJSON_Delete(q->texts);
    free(q->tools);
    q->tools = NULL;
    q->texts = NULL;
    free(q->prompt_ids);
    free(q->messages);
    free(q->grammar);
    q->grammar = NULL;
    q->doc = NULL;
    q->prompt_ids = NULL;
    q->messages = NULL;
}

/* (router_openai.h) A call's id: OpenAI's "call_" and 24 letters and digits, or for Mistral's template, which
 * checks them, 9; made from the request's id and the call's index, so each is unique. */
/* Contract: router_openai.h. Errors: the parser's (TD_ERR_NOMEM, a call too long). */
td_status_t router_oai_tools_feed(td_tools_parser_t *p, size_t *fed, const char *text, size_t n, bool last,
                                  td_tools_event_cb cb, void *ctx)
{
    td_status_t st = TD_OK;
    if (n > *fed)
        st = td_tools_parser_feed(p, text + *fed, n - *fed, cb, ctx);
    *fed = n;
    if (st == TD_OK && last)
        st = td_tools_parser_finish(p, cb, ctx);
    return st;
}

void router_oai_tool_call_id(const char *req_id, td_tools_format_t fmt, uint32_t choice, uint32_t index, char id[40])
{
    static const char ALNUM[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    bool mistral = fmt == TD_TOOLS_MISTRAL;
    size_t n = mistral ? 9 : 24, k = 0;
    if (!mistral)
        k = (size_t)snprintf(id, 40, "call_");
    uint64_t h = td_fnv1a64(TD_FNV1A64_INIT, req_id, strlen(req_id));
    if (choice) /* choice 0's ids are those of an n = 1 request */
        h = td_fnv1a64(h, &choice, sizeof choice);
    h = td_fnv1a64(h, &index, sizeof index);
    for (size_t i = 0; i < n; i++) {
        if (i % 10 == 9)
            h = td_fnv1a64(h, &i, sizeof i);
        id[k++] = ALNUM[h % 62];
        h /= 62;
    }
    id[k] = '\0';
}

/* ---- writing --------------------------------------------------------------------------- */

void router_oai_buf_free(router_oai_buf_t *b)
{
    free(b->p);
    *b = (router_oai_buf_t){0};
}

static bool buf_reserve(router_oai_buf_t *b, size_t more)
{
    if (b->oom)
        return false;
    if (b->n + more + 1 <= b->cap)
        return true;
    size_t cap = TD_MAX(b->cap * 2, b->n + more + 1);
    cap = TD_MAX(cap, (size_t)256);
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

void router_oai_buf_put(router_oai_buf_t *b, const char *s, size_t len)
{
    if (!buf_reserve(b, len))
        return;
    if (len)
        memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = '\0';
}

void router_oai_buf_puts(router_oai_buf_t *b, const char *s)
{
    router_oai_buf_put(b, s, strlen(s));
}

void router_oai_buf_printf(router_oai_buf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !buf_reserve(b, (size_t)n))
        return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)n;
}

/* The length of the valid UTF-8 sequence at s[0..left), or 0 when it is not one (overlong
 * forms, surrogates and code points past U+10FFFF included): libutf8proc's decoder. */
static size_t utf8_seq(const unsigned char *s, size_t left)
{
    utf8proc_int32_t cp;
    utf8proc_ssize_t n = utf8proc_iterate(s, (utf8proc_ssize_t)left, &cp);
    return n > 0 ? (size_t)n : 0;
}

void router_oai_buf_json_str(router_oai_buf_t *b, const char *s, size_t len)
{
    static const char hex[] = "0123456789abcdef";
    /* the worst case, every byte an invalid one written as \ufffd: 6 bytes each, quotes */
    if (!buf_reserve(b, len * 6 + 2))
        return;
    char *o = b->p + b->n;
    const unsigned char *u = (const unsigned char *)s;
    *o++ = '"';
    for (size_t i = 0; i < len;) {
        unsigned c = u[i];
        if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
            *o++ = (char)c;
            i++;
            continue;
        }
        if (c < 0x80) {
            *o++ = '\\';
            switch (c) {
            case '"': *o++ = '"'; break;
            case '\\': *o++ = '\\'; break;
            case '\n': *o++ = 'n'; break;
            case '\r': *o++ = 'r'; break;
            case '\t': *o++ = 't'; break;
            default:
                *o++ = 'u';
                *o++ = '0';
                *o++ = '0';
                *o++ = hex[c >> 4];
                *o++ = hex[c & 15];
                break;
            }
            i++;
            continue;
        }
        size_t n = utf8_seq(u + i, len - i);
        if (n) {
            memcpy(o, u + i, n);
            o += n;
            i += n;
        } else {
            memcpy(o, "\\ufffd", 6);
            o += 6;
            i++;
        }
    }
    *o++ = '"';
    b->n = (size_t)(o - b->p);
    b->p[b->n] = '\0';
}

/* v in decimal: every chunk of a stream carries "created" (printf was a third of the
 * router's CPU per relayed token) */
static void buf_int(router_oai_buf_t *b, int64_t v)
{
    char d[24], *e = d + sizeof d, *p = e;
    uint64_t u = v < 0 ? 0 - (uint64_t)v : (uint64_t)v;
    do {
        *--p = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        *--p = '-';
    router_oai_buf_put(b, p, (size_t)(e - p));
}

/* {"id":..,"object":..,"created":..,"model":.., */
static void head(router_oai_buf_t *b, const router_oai_resp_t *rs, const char *object)
{
    router_oai_buf_puts(b, "{\"id\":");
    router_oai_buf_json_str(b, rs->id, strlen(rs->id));
    router_oai_buf_puts(b, ",\"object\":\"");
    router_oai_buf_puts(b, object);
    router_oai_buf_puts(b, "\",\"created\":");
    buf_int(b, rs->created);
    router_oai_buf_puts(b, ",\"model\":");
    router_oai_buf_json_str(b, rs->model, strlen(rs->model));
}

static void finish_reason(router_oai_buf_t *b, const char *reason)
{
    if (reason) {
        router_oai_buf_puts(b, ",\"finish_reason\":\"");
        router_oai_buf_puts(b, reason);
        router_oai_buf_puts(b, "\"}");
    } else
        router_oai_buf_puts(b, ",\"finish_reason\":null}");
}

static void usage(router_oai_buf_t *b, const router_oai_usage_t *u)
{
    router_oai_buf_printf(b,
                          "\"usage\":{\"prompt_tokens\":%u,\"completion_tokens\":%u,\"total_tokens\":%u,"
                          "\"prompt_tokens_details\":{\"cached_tokens\":%u}",
                          u->prompt_tokens, u->completion_tokens, u->prompt_tokens + u->completion_tokens,
                          u->cached_tokens);
    if (u->migrations) /* only then: the object stays OpenAI's own otherwise */
        router_oai_buf_printf(b, ",\"migrations\":%u", u->migrations);
    router_oai_buf_puts(b, "}");
}

static void num(router_oai_buf_t *b, float v)
{
    router_oai_buf_printf(b, "%.9g", isfinite(v) ? (double)v : -9999.0);
}

static void bytes_array(router_oai_buf_t *b, const char *t, size_t n)
{
    router_oai_buf_puts(b, "[");
    for (size_t i = 0; i < n; i++)
        router_oai_buf_printf(b, i ? ",%u" : "%u", (unsigned char)t[i]);
    router_oai_buf_puts(b, "]");
}

size_t router_oai_logprobs(router_oai_buf_t *b, router_oai_kind_t kind, const td_token_logprob_t *lps, size_t n,
                           bool first_null, size_t text_offset0, router_oai_token_text_cb text_cb, void *ctx)
{
    char t[256];
    size_t off = text_offset0;
    if (kind == ROUTER_OAI_CHAT) {
        router_oai_buf_puts(b, "{\"content\":[");
        for (size_t i = 0; i < n; i++) {
            size_t tl = text_cb(ctx, lps[i].token, t, sizeof t);
            off += tl;
            router_oai_buf_puts(b, i ? ",{\"token\":" : "{\"token\":");
            router_oai_buf_json_str(b, t, tl);
            router_oai_buf_puts(b, ",\"logprob\":");
            num(b, lps[i].logprob);
            router_oai_buf_puts(b, ",\"bytes\":");
            bytes_array(b, t, tl);
            router_oai_buf_puts(b, ",\"top_logprobs\":[");
            for (int32_t k = 0; k < lps[i].n_top; k++) {
                size_t kl = text_cb(ctx, lps[i].top[k].token, t, sizeof t);
                router_oai_buf_puts(b, k ? ",{\"token\":" : "{\"token\":");
                router_oai_buf_json_str(b, t, kl);
                router_oai_buf_puts(b, ",\"logprob\":");
                num(b, lps[i].top[k].logprob);
                router_oai_buf_puts(b, ",\"bytes\":");
                bytes_array(b, t, kl);
                router_oai_buf_puts(b, "}");
            }
            router_oai_buf_puts(b, "]}");
        }
        router_oai_buf_puts(b, "],\"refusal\":null}");
        return off;
    }
    router_oai_buf_puts(b, "{\"tokens\":[");
    for (size_t i = 0; i < n; i++) {
        size_t tl = text_cb(ctx, lps[i].token, t, sizeof t);
        if (i)
            router_oai_buf_puts(b, ",");
        router_oai_buf_json_str(b, t, tl);
    }
    router_oai_buf_puts(b, "],\"token_logprobs\":[");
    for (size_t i = 0; i < n; i++) {
        if (i)
            router_oai_buf_puts(b, ",");
        if (i == 0 && first_null)
            router_oai_buf_puts(b, "null");
        else
            num(b, lps[i].logprob);
    }
    router_oai_buf_puts(b, "],\"top_logprobs\":[");
    for (size_t i = 0; i < n; i++) {
        if (i)
            router_oai_buf_puts(b, ",");
        if (i == 0 && first_null) {
            router_oai_buf_puts(b, "null");
            continue;
        }
        router_oai_buf_puts(b, "{");
        for (int32_t k = 0; k < lps[i].n_top; k++) {
            size_t kl = text_cb(ctx, lps[i].top[k].token, t, sizeof t);
            if (k)
                router_oai_buf_puts(b, ",");
            router_oai_buf_json_str(b, t, kl); /* two ids of one text: the later key repeats, as OpenAI's */
            router_oai_buf_puts(b, ":");
            num(b, lps[i].top[k].logprob);
        }
        router_oai_buf_puts(b, "}");
    }
    router_oai_buf_puts(b, "],\"text_offset\":[");
    for (size_t i = 0; i < n; i++) {
        router_oai_buf_printf(b, i ? ",%zu" : "%zu", off);
        off += text_cb(ctx, lps[i].token, t, sizeof t);
    }
    router_oai_buf_puts(b, "]}");
    return off;
}

void router_oai_chunk(router_oai_buf_t *b, const router_oai_resp_t *rs, bool first, const char *text, size_t len,
                      const char *logprobs, const char *reason, bool usage_null)
{
    bool chat = rs->kind == ROUTER_OAI_CHAT;
    router_oai_buf_puts(b, "data: ");
    head(b, rs, chat ? "chat.completion.chunk" : "text_completion");
    if (chat) {
        router_oai_buf_printf(b, ",\"choices\":[{\"index\":%d,\"delta\":{", rs->index);
        if (first)
            router_oai_buf_puts(b, "\"role\":\"assistant\",");
        if (first || len || !reason) { /* the last chunk's delta is {} when it has no text */
            router_oai_buf_puts(b, "\"content\":");
            router_oai_buf_json_str(b, text, len);
        }
        router_oai_buf_puts(b, "},\"logprobs\":");
    } else {
        router_oai_buf_printf(b, ",\"choices\":[{\"index\":%d,\"text\":", rs->index);
        router_oai_buf_json_str(b, text, len);
        router_oai_buf_puts(b, ",\"logprobs\":");
    }
    router_oai_buf_puts(b, logprobs ? logprobs : "null");
    finish_reason(b, reason);
    router_oai_buf_puts(b, usage_null ? "],\"usage\":null}\n\n" : "]}\n\n");
}

void router_oai_usage_chunk(router_oai_buf_t *b, const router_oai_resp_t *rs, const router_oai_usage_t *u)
{
    router_oai_buf_puts(b, "data: ");
    head(b, rs, rs->kind == ROUTER_OAI_CHAT ? "chat.completion.chunk" : "text_completion");
    router_oai_buf_puts(b, ",\"choices\":[],");
    usage(b, u);
    router_oai_buf_puts(b, "}\n\n");
}

void router_oai_done(router_oai_buf_t *b)
{
    router_oai_buf_puts(b, "data: [DONE]\n\n");
}

void router_oai_response_begin(router_oai_buf_t *b, const router_oai_resp_t *rs)
{
    head(b, rs, rs->kind == ROUTER_OAI_CHAT ? "chat.completion" : "text_completion");
    router_oai_buf_puts(b, ",\"choices\":[");
}

void router_oai_tool_call_json(router_oai_buf_t *b, uint32_t index, const char *id, const char *name,
                               const char *args, size_t len)
{
    if (index)
        router_oai_buf_puts(b, ",");
    router_oai_buf_puts(b, "{\"id\":");
    router_oai_buf_json_str(b, id, strlen(id));
    router_oai_buf_puts(b, ",\"type\":\"function\",\"function\":{\"name\":");
    router_oai_buf_json_str(b, name, strlen(name));
    router_oai_buf_puts(b, ",\"arguments\":");
    router_oai_buf_json_str(b, args, len);
    router_oai_buf_puts(b, "}}");
}

void router_oai_function_call_json(router_oai_buf_t *b, const char *name, const char *args, size_t len)
{
    router_oai_buf_puts(b, "{\"name\":");
    router_oai_buf_json_str(b, name, strlen(name));
    router_oai_buf_puts(b, ",\"arguments\":");
    router_oai_buf_json_str(b, args, len);
    router_oai_buf_puts(b, "}");
}

void router_oai_tool_call_chunk(router_oai_buf_t *b, const router_oai_resp_t *rs, bool first, uint32_t index,
                                const char *id, const char *name, const char *args, size_t len, bool usage_null)
{
    for (int part = name ? 0 : 1; part < (args ? 2 : 1); part++) {
        router_oai_buf_puts(b, "data: ");
        head(b, rs, "chat.completion.chunk");
        router_oai_buf_printf(b, ",\"choices\":[{\"index\":%d,\"delta\":{", rs->index);
        if (first && part == 0)
            router_oai_buf_puts(b, "\"role\":\"assistant\",\"content\":null,");
        if (rs->legacy_functions) { /* the older delta.function_call: the name, then arguments */
            router_oai_buf_puts(b, "\"function_call\":{");
            if (part == 0) {
                router_oai_buf_puts(b, "\"name\":");
                router_oai_buf_json_str(b, name, strlen(name));
                router_oai_buf_puts(b, ",\"arguments\":\"\"}");
            } else {
                router_oai_buf_puts(b, "\"arguments\":");
                router_oai_buf_json_str(b, args, len);
                router_oai_buf_puts(b, "}");
            }
        } else if (part == 0) { /* OpenAI's first delta of a call: id, type, name, empty arguments */
            router_oai_buf_printf(b, "\"tool_calls\":[{\"index\":%u,\"id\":", index);
            router_oai_buf_json_str(b, id, strlen(id));
            router_oai_buf_puts(b, ",\"type\":\"function\",\"function\":{\"name\":");
            router_oai_buf_json_str(b, name, strlen(name));
            router_oai_buf_puts(b, ",\"arguments\":\"\"}}]");
        } else {
            router_oai_buf_printf(b, "\"tool_calls\":[{\"index\":%u,\"function\":{\"arguments\":", index);
            router_oai_buf_json_str(b, args, len);
            router_oai_buf_puts(b, "}}]");
        }
        router_oai_buf_puts(b, "},\"logprobs\":null");
        finish_reason(b, NULL);
        router_oai_buf_puts(b, usage_null ? "],\"usage\":null}\n\n" : "]}\n\n");
    }
}

void router_oai_response_choice(router_oai_buf_t *b, const router_oai_resp_t *rs, int32_t index, const char *text,
                                size_t len, const char *tool_calls, const char *logprobs, const char *reason)
{
    if (index > 0)
        router_oai_buf_puts(b, ",");
    if (rs->kind == ROUTER_OAI_CHAT) {
        router_oai_buf_printf(b, "{\"index\":%d,\"message\":{\"role\":\"assistant\",\"content\":", index);
        if (tool_calls && !len)
            router_oai_buf_puts(b, "null");
        else
            router_oai_buf_json_str(b, text, len);
        if (tool_calls && rs->legacy_functions) { /* the one call, router_oai_function_call_json's */
            router_oai_buf_puts(b, ",\"function_call\":");
            router_oai_buf_puts(b, tool_calls);
        } else if (tool_calls) {
            router_oai_buf_puts(b, ",\"tool_calls\":[");
            router_oai_buf_puts(b, tool_calls);
            router_oai_buf_puts(b, "]");
        }
        router_oai_buf_puts(b, "},\"logprobs\":");
    } else {
        router_oai_buf_printf(b, "{\"index\":%d,\"text\":", index);
        router_oai_buf_json_str(b, text, len);
        router_oai_buf_puts(b, ",\"logprobs\":");
    }
    router_oai_buf_puts(b, logprobs ? logprobs : "null");
    finish_reason(b, reason);
}

void router_oai_response_end(router_oai_buf_t *b, const router_oai_usage_t *u)
{
    router_oai_buf_puts(b, "],");
    usage(b, u);
    router_oai_buf_puts(b, "}");
}

void router_oai_response(router_oai_buf_t *b, const router_oai_resp_t *rs, const char *text, size_t len,
                         const char *logprobs, const char *reason, const router_oai_usage_t *u)
{
    router_oai_response_tools(b, rs, text, len, NULL, logprobs, reason, u);
}

void router_oai_response_tools(router_oai_buf_t *b, const router_oai_resp_t *rs, const char *text, size_t len,
                               const char *tool_calls, const char *logprobs, const char *reason,
                               const router_oai_usage_t *u)
{
    router_oai_response_begin(b, rs);
    router_oai_response_choice(b, rs, 0, text, len, tool_calls, logprobs, reason);
    router_oai_response_end(b, u);
}

void router_oai_error_json(router_oai_buf_t *b, const router_oai_error_t *err)
{
    router_oai_buf_puts(b, "{\"error\":{\"message\":");
    router_oai_buf_json_str(b, err->message, strlen(err->message));
    router_oai_buf_puts(b, ",\"type\":");
    router_oai_buf_json_str(b, err->type, strlen(err->type));
    router_oai_buf_puts(b, ",\"param\":");
    if (err->param[0])
        router_oai_buf_json_str(b, err->param, strlen(err->param));
    else
        router_oai_buf_puts(b, "null");
    router_oai_buf_puts(b, ",\"code\":");
    if (err->code)
        router_oai_buf_json_str(b, err->code, strlen(err->code));
    else
        router_oai_buf_puts(b, "null");
    router_oai_buf_puts(b, "}}");
}

void router_oai_models(router_oai_buf_t *b, const char *model, int64_t created)
{
    router_oai_buf_puts(b, "{\"object\":\"list\",\"data\":[{\"id\":");
    router_oai_buf_json_str(b, model, strlen(model));
    router_oai_buf_printf(b, ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"tandem\"}]}", (long long)created);
}
