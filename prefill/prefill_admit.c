/*
 * prefill_admit: PrefillRequest -> prefill_admit_t, checked (prefill_admit.h).
 */
#include "prefill_admit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_node.h"
#include "td_util.h"

static td_grpc_code_t admit_check(const Tandem__Control__V1__PrefillRequest *r, const td_model_config_t *mc,
                                  uint32_t block_size, prefill_admit_t *a, char *why, size_t cap)
{
    if (r->n_tokens == 0 || r->n_tokens >= (size_t)mc->max_seq_len ||
        r->n_block_ids < (size_t)TD_DIV_CEIL((int64_t)r->n_tokens, (int64_t)block_size)) {
        snprintf(why, cap, "prefill: %zu tokens (1 .. %d) and at least ceil(tokens / %u) block ids are "
                 "required (%zu given)", r->n_tokens, mc->max_seq_len - 1, block_size, r->n_block_ids);
        return TD_GRPC_INVALID_ARGUMENT;
    }
    if (!(a->tokens = malloc(r->n_tokens * sizeof(int32_t))) ||
        !(a->dst_blocks = malloc(r->n_block_ids * sizeof(int32_t)))) {
        snprintf(why, cap, "prefill node: out of memory");
        return TD_GRPC_RESOURCE_EXHAUSTED;
    }
    for (size_t i = 0; i < r->n_tokens; i++) {
        if (r->tokens[i] >= (uint32_t)mc->vocab_size) {
            snprintf(why, cap, "prefill: token %u at %zu is outside the vocabulary [0, %d)", r->tokens[i], i,
                     mc->vocab_size);
            return TD_GRPC_INVALID_ARGUMENT;
        }
        a->tokens[i] = (int32_t)r->tokens[i];
    }
    a->n_tokens = (int32_t)r->n_tokens;
    for (size_t i = 0; i < r->n_block_ids; i++)
        a->dst_blocks[i] = (int32_t)r->block_ids[i];
    a->n_dst = (int32_t)r->n_block_ids;
    a->cache_salt = r->cache_salt;
    a->sampling = td_node_sampling_from_proto(r->sampling);
    if (td_sampling_validate(&a->sampling, why, cap) != TD_OK ||
        !td_sampling_check_bias(&a->sampling, mc->vocab_size, why, cap) ||
        td_node_logprobs_from_proto(r->logprobs, &a->logprobs, why, cap) != TD_OK)
        return TD_GRPC_INVALID_ARGUMENT;
    if (a->logprobs.prompt && a->n_tokens > TD_LOGPROBS_MAX_PROMPT) {
        snprintf(why, cap, "prefill: prompt logprobs of %d tokens asked, at most %d", a->n_tokens,
                 TD_LOGPROBS_MAX_PROMPT);
        return TD_GRPC_INVALID_ARGUMENT;
    }
    if (r->grammar && r->grammar[0] && !(a->grammar = strdup(r->grammar))) {
        snprintf(why, cap, "prefill node: out of memory");
        return TD_GRPC_RESOURCE_EXHAUSTED;
    }
    return TD_GRPC_OK;
}

td_grpc_code_t prefill_admit_read(const Tandem__Control__V1__PrefillRequest *r, const td_model_config_t *mc,
                                  uint32_t block_size, prefill_admit_t *a, char *why, size_t cap)
{
    *a = (prefill_admit_t){0};
    td_grpc_code_t code = admit_check(r, mc, block_size, a, why, cap);
    if (code != TD_GRPC_OK)
        prefill_admit_free(a);
    return code;
}

void prefill_admit_free(prefill_admit_t *a)
{
    if (!a)
        return;
    free(a->tokens);
    free(a->dst_blocks);
    free(a->grammar);
    *a = (prefill_admit_t){0};
}
