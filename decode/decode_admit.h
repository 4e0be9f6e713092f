/*
 * decode_admit: an AdmitRequest read into the decode node's own form (decode_admit_t), every
 * field checked on the way; what on_admit (decode_main.c) needs before it leases blocks.
 *
 * Two steps, so that a malformed request hears INVALID_ARGUMENT before a draining or full
 * node says UNAVAILABLE or RESOURCE_EXHAUSTED: decode_admit_check (the message's own shape:
 * ids, counts, lengths) runs before the node's gate (td_node_take_or_refuse), decode_admit_read
 * (the copies, the vocabulary, sampling and logprobs, the unified role's limits) after it.
 * The kv-ready that later brings the KV is checked here too (decode_admit_ready_check). What
 * these pass, the scheduler takes as valid (decode_sched.h, decode_request_t): this is the
 * node's one check of a request. Loop thread; pure but for the allocation.
 */
#ifndef DECODE_ADMIT_H
#define DECODE_ADMIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "control.pb-c.h"
#include "td_grpc.h"
#include "td_list.h"
#include "td_model.h"
#include "td_node.h"
#include "td_xfer.h"

#define DECODE_MAX_STOP_IDS 32
#define DECODE_MAX_REQUEST_ID 255 /* bytes of AdmitRequest.request_id (the router's are < 64) */

/* An admitted request whose KV has not arrived yet (loop thread). */
typedef struct decode_admit {
    td_list_t link;  /* in decode_state_t.admits */
    uint64_t lease_id;
    uint64_t deadline_ns;
    int32_t *prompt;
    int32_t n_prompt;
    td_sampling_t sampling;
    int32_t max_tokens;
    int32_t stop_ids[DECODE_MAX_STOP_IDS];
    int32_t n_stop_ids;
    td_logprobs_want_t logprobs; /* AdmitRequest.logprobs */
    bool ignore_eos;
    int32_t *replay;             /* [n_replay] AdmitRequest.replay_ids (a migrated stream), or NULL */
    int32_t n_replay;
    uint64_t cache_salt;         /* AdmitRequest.cache_salt: seeds its prefix-cache hashes */
    bool local;                  /* prefilled here, not by a transfer: every admission of a
                                    unified node, a decode node's when the router asked
                                    (AdmitRequest.local_prefill). No blocks are leased; the
                                    router's Prefill call hands it to the compute thread */
    double tpot_objective_s;     /* AdmitRequest.tpot_objective_s (0: none): bounds the prompt
                                    chunks of the node's steps while it runs (decode_sched) */
    char *grammar;               /* AdmitRequest.grammar (GBNF), or NULL: unconstrained */
    bool kv_out;                 /* a Prefill call for another decode node's lease
                                    (decode_admit_read_kv_out): prefilled here, its KV sent there;
                                    max_tokens 1, no stops, replay or lease of this node */
} decode_admit_t;

/* The request's shape against the model mc: false with the reason in why (INVALID_ARGUMENT). */
bool decode_admit_check(const Tandem__Control__V1__AdmitRequest *r, const td_model_config_t *mc, char *why,
                        size_t cap);

/* A checked request (decode_admit_check) read into a new *a_p (lease_id and deadline 0, not
 * linked; local when the node is unified or the request asks local_prefill). TD_GRPC_OK;
 * else INVALID_ARGUMENT (an id outside the vocabulary, bad sampling or logprobs, prompt
 * logprobs asked of a local prefill: a unified node's, or local_prefill) or
 * RESOURCE_EXHAUSTED (out of memory), the reason in why and *a_p untouched. */
td_grpc_code_t decode_admit_read(const Tandem__Control__V1__AdmitRequest *r, const td_model_config_t *mc,
                                 bool unified, decode_admit_t **a_p, char *why, size_t cap);

/* A kv-ready of admission a from the prefill node (the data plane's message, as untrusted as
 * an AdmitRequest): true when it covers a's whole prompt and its first token is inside the
 * vocabulary of mc; else false with the reason in why (the request then fails). */
bool decode_admit_ready_check(const decode_admit_t *a, const td_xfer_ready_t *r, const td_model_config_t *mc,
                              char *why, size_t cap);

/* A Prefill call for another decode node's lease (conditional disaggregation's peer
 * prefill, docs/cluster.md "Prefill for another decode node"), checked as a prefill node
 * checks it (the prompt within the model and its vocabulary, block ids for every block of
 * it, sampling, logprobs, a 16-byte xfer token), read into a new *a_p (kv_out; lease_id
 * and deadline 0, not linked) and the destination blocks into a new *dst_p [*n_dst_p].
 * TD_GRPC_OK; else INVALID_ARGUMENT (prompt logprobs among them: this node computes
 * prompts in chunks inside its decode steps) or RESOURCE_EXHAUSTED (out of memory), the
 * reason in why and nothing allocated. */
td_grpc_code_t decode_admit_read_kv_out(const Tandem__Control__V1__PrefillRequest *r, const td_model_config_t *mc,
                                        uint32_t block_size, decode_admit_t **a_p, int32_t **dst_p,
                                        int32_t *n_dst_p, char *why, size_t cap);

/* Frees an admission (NULL-safe). */
void decode_admit_free(decode_admit_t *a);

#endif /* DECODE_ADMIT_H */
