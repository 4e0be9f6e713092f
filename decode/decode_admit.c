/*
 * decode_admit: AdmitRequest -> decode_admit_t, checked (decode_admit.h).
 */
#include "decode_admit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_util.h"

bool decode_admit_check(const Tandem__Control__V1__AdmitRequest *r, const td_model_config_t *mc, char *why,
                        size_t cap)
{
    if (!r->request_id || !r->request_id[0] || strlen(r->request_id) > DECODE_MAX_REQUEST_ID)
        snprintf(why, cap, "admit: request_id must be 1 .. %d bytes (%zu given)", DECODE_MAX_REQUEST_ID,
                 r->request_id ? strlen(r->request_id) : 0);
    else if (r->n_prompt_ids == 0 || r->n_prompt_ids >= (size_t)mc->max_seq_len)
        snprintf(why, cap, "admit: prompt_ids holds %zu ids, allowed 1 .. %d (the model's length - 1)",
                 r->n_prompt_ids, mc->max_seq_len - 1);
    else if (r->n_prompt_ids != r->prompt_tokens)
        snprintf(why, cap, "admit: prompt_tokens %u, but prompt_ids holds %zu ids", r->prompt_tokens,
                 r->n_prompt_ids);
    else if (r->max_tokens == 0)
        snprintf(why, cap, "admit: max_tokens 0, at least 1");
    else if (r->n_stop_ids > DECODE_MAX_STOP_IDS)
        snprintf(why, cap, "admit: %zu stop_ids, at most %d", r->n_stop_ids, DECODE_MAX_STOP_IDS);
    else if (!isfinite(r->tpot_objective_s) || r->tpot_objective_s < 0)
        snprintf(why, cap, "admit: tpot_objective_s %g, a number of seconds >= 0 required (0: none)",
                 (double)r->tpot_objective_s);
    else if (r->n_replay_ids >= r->max_tokens || r->n_replay_ids >= (size_t)mc->max_seq_len - r->n_prompt_ids)
        snprintf(why, cap, "admit: %zu replay_ids, fewer than max_tokens %u and the model's length %d - "
                 "%zu prompt ids required", r->n_replay_ids, r->max_tokens, mc->max_seq_len, r->n_prompt_ids);
    else
        return true;
    return false;
}

/* n ids (prompt_ids or replay_ids, named `what`) into a new array at *out, each inside the
 * vocabulary of mc. NULL *out for n == 0. */
static td_grpc_code_t read_ids(const uint32_t *ids, size_t n, const char *what, const td_model_config_t *mc,
                               int32_t **out, char *why, size_t cap)
{
    *out = NULL;
    if (n == 0)
        return TD_GRPC_OK;
    if (!(*out = malloc(n * sizeof **out))) {
        snprintf(why, cap, "decode node: out of memory");
        return TD_GRPC_RESOURCE_EXHAUSTED;
    }
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= (uint32_t)mc->vocab_size) {
            snprintf(why, cap, "admit: %s[%zu] = %u is outside the vocabulary of %d ids", what, i, ids[i],
                     mc->vocab_size);
            return TD_GRPC_INVALID_ARGUMENT;
        }
        (*out)[i] = (int32_t)ids[i];
    }
    return TD_GRPC_OK;
}

/* The request's sampling and logprobs into a, checked against the model (an Admit's and a
 * peer's Prefill call's alike) */
static td_grpc_code_t read_sampling(const Tandem__V1__SamplingParams *sp, const Tandem__V1__LogprobsRequest *lp,
                                    const td_model_config_t *mc, decode_admit_t *a, char *why, size_t cap)
{
    a->sampling = td_node_sampling_from_proto(sp);
    if (td_sampling_validate(&a->sampling, why, cap) != TD_OK ||
        !td_sampling_check_bias(&a->sampling, mc->vocab_size, why, cap) ||
        td_node_logprobs_from_proto(lp, &a->logprobs, why, cap) != TD_OK)
        return TD_GRPC_INVALID_ARGUMENT;
    return TD_GRPC_OK;
}

td_grpc_code_t decode_admit_read(const Tandem__Control__V1__AdmitRequest *r, const td_model_config_t *mc,
                                 bool unified, decode_admit_t **a_p, char *why, size_t cap)
{
    decode_admit_t *a = calloc(1, sizeof *a);
    if (!a) {
        snprintf(why, cap, "decode node: out of memory");
        return TD_GRPC_RESOURCE_EXHAUSTED;
    }
    td_grpc_code_t code = read_ids(r->prompt_ids, r->n_prompt_ids, "prompt_ids", mc, &a->prompt, why, cap);
    if (code == TD_GRPC_OK)
        code = read_ids(r->replay_ids, r->n_replay_ids, "replay_ids", mc, &a->replay, why, cap);
    a->n_prompt = (int32_t)r->n_prompt_ids;
    a->n_replay = (int32_t)r->n_replay_ids;
    if (code == TD_GRPC_OK)
        code = read_sampling(r->sampling, r->logprobs, mc, a, why, cap);
    if (code == TD_GRPC_OK && r->grammar && r->grammar[0] && !(a->grammar = strdup(r->grammar))) {
        snprintf(why, cap, "decode node: out of memory");
        code = TD_GRPC_RESOURCE_EXHAUSTED;
    }
    a->local = unified || r->local_prefill;
    a->tpot_objective_s = r->tpot_objective_s;
    if (code == TD_GRPC_OK && a->local && a->logprobs.prompt) {
        if (unified)
            snprintf(why, cap, "admit: prompt logprobs are not served by a unified node (it computes prompts "
                               "in chunks inside decode steps); send them to a prefill/decode pair");
        else
            snprintf(why, cap, "admit: prompt logprobs are not served with local_prefill (the decode node "
                               "computes the prompt in chunks inside its decode steps); leave local_prefill "
                               "off so that a prefill node computes it");
        code = TD_GRPC_INVALID_ARGUMENT;
    }
    if (code != TD_GRPC_OK) {
        decode_admit_free(a);
        return code;
    }
    a->max_tokens = (int32_t)TD_MIN(r->max_tokens, (uint32_t)INT32_MAX);
    for (size_t i = 0; i < r->n_stop_ids; i++)
        a->stop_ids[i] = (int32_t)r->stop_ids[i];
    a->n_stop_ids = (int32_t)r->n_stop_ids;
    a->ignore_eos = r->ignore_eos;
    a->cache_salt = r->cache_salt;
    *a_p = a;
    return TD_GRPC_OK;
}

td_grpc_code_t decode_admit_read_kv_out(const Tandem__Control__V1__PrefillRequest *r, const td_model_config_t *mc,
                                        uint32_t block_size, decode_admit_t **a_p, int32_t **dst_p,
                                        int32_t *n_dst_p, char *why, size_t cap)
{
    if (r->n_tokens == 0 || r->n_tokens >= (size_t)mc->max_seq_len ||
        r->n_block_ids < (size_t)TD_DIV_CEIL((int64_t)r->n_tokens, (int64_t)block_size)) {
        snprintf(why, cap, "prefill: %zu tokens (1 .. %d) and at least ceil(tokens / %u) block ids are "
                 "required (%zu given)", r->n_tokens, mc->max_seq_len - 1, block_size, r->n_block_ids);
        return TD_GRPC_INVALID_ARGUMENT;
    }
    if (r->xfer_token.len != sizeof(td_xfer_token_t)) {
        snprintf(why, cap, "prefill: the call carries a kv transfer token of %zu bytes, not %zu",
                 r->xfer_token.len, sizeof(td_xfer_token_t));
        return TD_GRPC_INVALID_ARGUMENT;
    }
    decode_admit_t *a = calloc(1, sizeof *a);
    int32_t *dst = malloc(r->n_block_ids * sizeof *dst);
    if (!a || !dst) {
        free(a), free(dst);
        snprintf(why, cap, "decode node: out of memory");
        return TD_GRPC_RESOURCE_EXHAUSTED;
    }
    td_grpc_code_t code = read_ids(r->tokens, r->n_tokens, "tokens", mc, &a->prompt, why, cap);
    a->n_prompt = (int32_t)r->n_tokens;
    if (code == TD_GRPC_OK)
        code = read_sampling(r->sampling, r->logprobs, mc, a, why, cap);
    if (code == TD_GRPC_OK && a->logprobs.prompt) {
        snprintf(why, cap, "prefill: prompt logprobs are not served by a decode node (it computes prompts in "
                           "chunks inside its decode steps); send the call to a prefill node");
        code = TD_GRPC_INVALID_ARGUMENT;
    }
    if (code == TD_GRPC_OK && r->grammar && r->grammar[0] && !(a->grammar = strdup(r->grammar))) {
        snprintf(why, cap, "decode node: out of memory");
        code = TD_GRPC_RESOURCE_EXHAUSTED;
    }
    if (code != TD_GRPC_OK) {
        decode_admit_free(a);
        free(dst);
        return code;
    }
    for (size_t i = 0; i < r->n_block_ids; i++)
        dst[i] = (int32_t)r->block_ids[i];
    a->kv_out = true;
    a->max_tokens = 1;
    a->cache_salt = r->cache_salt;
    *a_p = a;
    *dst_p = dst;
    *n_dst_p = (int32_t)r->n_block_ids;
    return TD_GRPC_OK;
}

bool decode_admit_ready_check(const decode_admit_t *a, const td_xfer_ready_t *r, const td_model_config_t *mc,
                              char *why, size_t cap)
{
    if ((int64_t)r->n_tokens != a->n_prompt)
        snprintf(why, cap, "kv-ready with %u tokens, prompt has %d", r->n_tokens, a->n_prompt);
    else if (r->first_token < 0 || r->first_token >= mc->vocab_size)
        snprintf(why, cap, "kv-ready's first token %d is outside the vocabulary of %d ids", r->first_token,
                 mc->vocab_size);
    else
        return true;
    return false;
}

void decode_admit_free(decode_admit_t *a)
{
    if (a) {
        free(a->prompt);
        free(a->replay);
        free(a->grammar);
        free(a);
    }
}
