/*
 * td_node_fake: the control API of prefill and decode nodes with no model behind them, for
 * what measures or tests the router alone: `tandem bench router`'s no-op nodes and
 * test_router_relay's scripted nodes. The kit serves the calls on a td_grpc server
 * (DecodeNode Admit, Release and Steps; PrefillNode Prefill: those the user gives a
 * callback for), keeps the Steps subscriptions, and writes the nodes' messages (an Admit's
 * lease, a Prefill phase, a StepBatch). What to answer, and when, is the user's: its
 * callbacks get each decoded request and own the call (reply or finish it, now or later).
 * Registering with the router is the user's too (td_node_client, or RegisterNode by hand).
 *
 * Thread: the loop's. Errors: td_node_fake_create's are described (td_errorf).
 */
#ifndef TD_NODE_FAKE_H
#define TD_NODE_FAKE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "control.pb-c.h"
#include "td_grpc.h"
#include "td_sampler.h"
#include "td_status.h"

#define TD_NODE_FAKE_MAX_SUBS 2 /* Steps subscriptions kept at once */

typedef struct td_node_fake td_node_fake_t;

/* NULL: that method is not served. */
typedef struct td_node_fake_ops {
    void (*admit)(td_node_fake_t *f, td_grpc_call_t *call,
                  const Tandem__Control__V1__AdmitRequest *q);
    void (*release)(td_node_fake_t *f, td_grpc_call_t *call,
                    const Tandem__Control__V1__ReleaseRequest *q);
    void (*prefill)(td_node_fake_t *f, td_grpc_call_t *call,
                    const Tandem__Control__V1__PrefillRequest *q);
    /* a Steps subscription came (or replaced the one in its slot) */
    void (*subscribed)(td_node_fake_t *f, int sub);
    /* subscription `sub`, blocked by a TD_ERR_BUSY step, can take a step again */
    void (*writable)(td_node_fake_t *f, int sub);
} td_node_fake_ops_t;

typedef struct td_node_fake_config {
    const char *host;                /* where to listen; port ephemeral */
    uint32_t max_concurrent_streams; /* per connection; 0: td_grpc's default */
    bool steps;                      /* serve DecodeNode/Steps */
    /* The Steps router_id that picks subscription slot i (i >= 1); any other router_id
     * takes slot 0. A new subscription in a taken slot ends the old one (ABORTED). */
    const char *sub_router_ids[TD_NODE_FAKE_MAX_SUBS];
} td_node_fake_config_t;

/* host 127.0.0.1, td_grpc's stream bound, Steps served, one subscription slot. */
td_node_fake_config_t td_node_fake_config_default(void);

/* Serves the calls of `ops` on loop; data is the user's (td_node_fake_data). Errors: the
 * server's (TD_ERR_IO for a port that cannot be bound, TD_ERR_NOMEM). */
td_status_t td_node_fake_create(uv_loop_t *loop, const td_node_fake_config_t *c,
                                const td_node_fake_ops_t *ops, void *data, td_node_fake_t **f_p);

/* Closes the server (open calls get their cancel callbacks, the subscriptions end) and
 * frees the kit once it closed. NULL is a no-op. */
void td_node_fake_close(td_node_fake_t *f);

void *td_node_fake_data(const td_node_fake_t *f);
uint16_t td_node_fake_port(const td_node_fake_t *f);

/* Ends an Admit with its lease and the block ids (copied). */
void td_node_fake_admit_reply(td_grpc_call_t *call, uint64_t lease_id, const uint32_t *blocks,
                              size_t n_blocks);

/* One PrefillResponse (first_token, phase) on a Prefill stream; td_grpc_call_send's status. */
td_status_t td_node_fake_prefill_send(td_grpc_call_t *call, uint32_t first_token,
                                      Tandem__Control__V1__PrefillPhase phase);

/* The last PrefillResponse of a stream, queued whatever the send queue holds, and OK. */
void td_node_fake_prefill_reply(td_grpc_call_t *call, uint32_t first_token,
                                Tandem__Control__V1__PrefillPhase phase);

/* One PrefillResponse FIRST_TOKEN with log-probabilities: the first token's (first) and, when
 * n_prompt > 0, the prompt's (prompt[0..n_prompt)); td_grpc_call_send's status. */
td_status_t td_node_fake_prefill_send_logprobs(td_grpc_call_t *call, uint32_t first_token,
                                               const td_token_logprob_t *first,
                                               const td_token_logprob_t *prompt, size_t n_prompt);

/* One entry of a StepBatch: a token (event TOKEN) or how a sequence ended. */
typedef struct td_node_fake_entry {
    uint64_t lease_id;
    uint32_t token;
    Tandem__Control__V1__SeqEvent event;
    const td_token_logprob_t *logprob; /* SeqStep.logprob; NULL = none */
} td_node_fake_entry_t;

/*
 * One StepBatch of e[0..n) on subscription `sub`, saying free_kv_blocks are free; steps are
 * numbered 1, 2, ... across the node's subscriptions, a number taken only by a batch that
 * was sent. TD_ERR_BUSY: not sent; the subscription is blocked until the writable callback.
 * TD_ERR_UNAVAILABLE: no subscription in that slot. TD_ERR_NOMEM. Other: the stream is
 * gone (the subscription ends at its cancel callback).
 */
td_status_t td_node_fake_step(td_node_fake_t *f, int sub, const td_node_fake_entry_t *e, size_t n,
                              uint32_t free_kv_blocks);

/* Subscription `sub` is open / is blocked by a TD_ERR_BUSY step. */
bool td_node_fake_subscribed(const td_node_fake_t *f, int sub);
bool td_node_fake_blocked(const td_node_fake_t *f, int sub);

/* The number of the last StepBatch sent (0 before the first). */
uint64_t td_node_fake_last_step(const td_node_fake_t *f);

#endif /* TD_NODE_FAKE_H */
