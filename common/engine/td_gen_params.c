/*
 * td_gen_params: the one validation of a generation request (contract in td_gen_params.h).
 * The sampling fields are td_sampling_validate's, which the nodes also run on what the router
 * forwards; this adds the request's lengths and counts.
 */
#include "td_gen_params.h"

#include <stdio.h>
#include <string.h>

td_gen_params_t td_gen_params_default(void)
{
    return (td_gen_params_t){.sampling = td_sampling_default()};
}

static const td_gen_field_names_t field_names[TD_GEN_FIELD_COUNT] = {
#define TD_GEN_FIELD_NAMES(id, req, flag, oai, chat) [TD_GEN_FIELD_##id] = {req, flag, oai, chat},
    TD_GEN_FIELDS(TD_GEN_FIELD_NAMES)
#undef TD_GEN_FIELD_NAMES
};

td_gen_field_names_t td_gen_field_names(td_gen_field_t f)
{
    const td_sampling_field_desc_t *d = td_sampling_field_desc((td_sampling_field_t)f);
    if (d) /* a sampling field: TD_SAMPLING_FIELDS' names, one OpenAI key for both APIs */
        return (td_gen_field_names_t){d->name, d->flag ? d->flag : "", d->openai ? d->openai : "",
                                      d->openai ? d->openai : ""};
    if (f > TD_GEN_FIELD_NONE && f < TD_GEN_FIELD_COUNT)
        return field_names[f];
    return (td_gen_field_names_t){"", "", "", ""};
}

td_gen_field_t td_gen_params_check(const td_gen_params_t *p, char *why, size_t why_cap)
{
    char msg[256];
    td_gen_field_t f = TD_GEN_FIELD_NONE;
    td_sampling_field_t sf;
    if (p->max_tokens < 0 || p->max_tokens > TD_GEN_MAX_TOKENS) {
        f = TD_GEN_FIELD_MAX_TOKENS;
        snprintf(msg, sizeof msg, "max_tokens %lld is out of range [0, %d]", (long long)p->max_tokens,
                 TD_GEN_MAX_TOKENS);
    } else if (p->tpot_objective_ms < 0 || p->tpot_objective_ms > TD_GEN_MAX_TPOT_MS) {
        f = TD_GEN_FIELD_TPOT_OBJECTIVE;
        snprintf(msg, sizeof msg, "tpot_objective_ms %lld is out of range [0, %d] (0: the router's objective)",
                 (long long)p->tpot_objective_ms, TD_GEN_MAX_TPOT_MS);
    } else if (p->prompt_len > TD_GEN_MAX_PROMPT) {
        f = TD_GEN_FIELD_PROMPT;
        snprintf(msg, sizeof msg, "prompt is %zu %s long, at most %u allowed", p->prompt_len,
                 p->prompt_is_text ? "bytes" : "ids", TD_GEN_MAX_PROMPT);
    } else if ((sf = td_sampling_check(&p->sampling, msg, sizeof msg)) != TD_SAMPLING_FIELD_NONE) {
        f = (td_gen_field_t)sf; /* numbered alike; msg names the field */
    } else if (!td_sampling_check_bias(&p->sampling, 0, msg, sizeof msg)) {
        f = TD_GEN_FIELD_LOGIT_BIAS; /* the ids against the model's vocabulary: by who knows it */
    } else if (p->n_stop_ids > TD_GEN_MAX_STOP_IDS) {
        f = TD_GEN_FIELD_STOP_IDS;
        snprintf(msg, sizeof msg, "stop_ids has %zu ids, at most %d allowed", p->n_stop_ids, TD_GEN_MAX_STOP_IDS);
    } else if (p->logprobs.on && (p->logprobs.top < 0 || p->logprobs.top > TD_LOGPROBS_MAX_TOP)) {
        f = TD_GEN_FIELD_TOP_LOGPROBS;
        snprintf(msg, sizeof msg, "top_logprobs %d is out of range [0, %d]", p->logprobs.top, TD_LOGPROBS_MAX_TOP);
    } else if (p->logprobs.on && p->logprobs.prompt && !p->prompt_is_text && p->prompt_len > TD_LOGPROBS_MAX_PROMPT) {
        f = TD_GEN_FIELD_PROMPT_LOGPROBS;
        snprintf(msg, sizeof msg, "prompt_logprobs asked for a prompt of %zu ids, at most %d allowed", p->prompt_len,
                 TD_LOGPROBS_MAX_PROMPT);
    } else if (p->n_stop_strings > TD_STOP_MAX_STRINGS) {
        f = TD_GEN_FIELD_STOP_STRINGS;
        snprintf(msg, sizeof msg, "stop_strings has %zu strings, at most %d allowed", p->n_stop_strings, TD_STOP_MAX_STRINGS);
    } else {
        for (size_t i = 0; i < p->n_stop_strings; i++) {
            size_t len = strlen(p->stop_strings[i]);
            if (len > TD_STOP_MAX_LEN) {
                f = TD_GEN_FIELD_STOP_STRINGS;
                snprintf(msg, sizeof msg, "stop string %zu is %zu bytes long, at most %d allowed", i, len,
                         TD_STOP_MAX_LEN);
                break;
            }
        }
    }
    if (f != TD_GEN_FIELD_NONE && why && why_cap > 0)
        snprintf(why, why_cap, "%s", msg);
    return f;
}

td_status_t td_gen_params_validate(const td_gen_params_t *p, char *why, size_t why_cap)
{
    char msg[256];
    if (td_gen_params_check(p, msg, sizeof msg) == TD_GEN_FIELD_NONE)
        return TD_OK;
    if (why && why_cap > 0)
        snprintf(why, why_cap, "%s", msg);
    return td_errorf_quiet(TD_ERR_INVALID, "%s", msg);
}
