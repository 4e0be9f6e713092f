/*
 * prefill_admit: a PrefillRequest read into the prefill node's own form (prefill_admit_t),
 * every field checked on the way: the node's one check of what the router sends (the
 * decode node's counterpart is decode_admit.h). What it passes, the scheduler takes as valid
 * (prefill_sched.h, prefill_request_t). A malformed request from the network is refused here
 * with INVALID_ARGUMENT and a message naming the field; it never reaches the scheduler.
 * Loop thread; pure but for the allocation.
 */
#ifndef PREFILL_ADMIT_H
#define PREFILL_ADMIT_H

#include <stddef.h>
#include <stdint.h>

#include "control.pb-c.h"
#include "td_grpc.h"
#include "td_model.h"
#include "td_sampler.h"

/* A checked prompt to prefill: what prefill_request_t needs, and where its KV goes. */
typedef struct prefill_admit {
    int32_t *tokens;             /* [n_tokens] the prompt, ids in [0, vocabulary) */
    int32_t n_tokens;            /* 1 .. model length - 1 */
    int32_t *dst_blocks;         /* [n_dst] the decode node's leased blocks, n_dst >= ceil(n_tokens / block) */
    int32_t n_dst;
    td_sampling_t sampling;      /* valid (td_sampling_validate) */
    td_logprobs_want_t logprobs; /* PrefillRequest.logprobs: top in [0, TD_LOGPROBS_MAX_TOP]; prompt
                                    only with n_tokens <= TD_LOGPROBS_MAX_PROMPT */
    uint64_t cache_salt;         /* PrefillRequest.cache_salt (any value: 0 = none) */
    char *grammar;               /* PrefillRequest.grammar (GBNF), or NULL: unconstrained */
} prefill_admit_t;

/*
 * Reads r against the model mc and the KV layout's block_size into *a (its arrays the
 * caller's, prefill_admit_free). TD_GRPC_OK; else INVALID_ARGUMENT (no tokens or more than
 * the model's length - 1, too few block ids, a token outside the vocabulary, bad sampling or
 * logprobs, prompt logprobs of a prompt too long) or RESOURCE_EXHAUSTED (out of memory),
 * the reason in why and *a left empty.
 */
td_grpc_code_t prefill_admit_read(const Tandem__Control__V1__PrefillRequest *r, const td_model_config_t *mc,
                                  uint32_t block_size, prefill_admit_t *a, char *why, size_t cap);

/* Frees a's arrays and empties it (NULL-safe; an empty one is a no-op). */
void prefill_admit_free(prefill_admit_t *a);

#endif /* PREFILL_ADMIT_H */
