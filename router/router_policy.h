/*
 * router_policy: which (prefill, decode) pair serves a request.
 *
 * A draining node (td_node_load_t.draining, from its heartbeats) is never chosen.
 *
 * 1. Decode node: live, serving the request's model, with room — free KV blocks >= the
 *    blocks the request holds there at most (router_admit_kv_blocks: prompt plus max_tokens
 *    capped by the model's length, in its layout) — then the fewest prompt tokens it
 *    still prefills itself (a unified node's queue, a local prefill; 0 for a decode node
 *    fed by prefill nodes), then the shortest running batch (ties: shorter recent step
 *    time, more free blocks, lower index). A prompt queued on a unified node stalls every
 *    sequence there for its chunks, so its queue weighs first (as tandem plan simulates).
 * 2. Prefill node for that decode node: live, same model, KV layout identical to the
 *    decode node's (td_kv_layout_compare), the pair not excluded; the least estimated
 *    work wins: queued prefill tokens plus the prompt tokens it would still compute,
 *    where prompt blocks it is believed to hold (router_registry_note_prefix) count as
 *    free, weighted by prefix_weight (ties: lower index). A prefill node that already has
 *    work queued takes the prompt only if it would be done within max_prefill_wait_s at the
 *    rate the node reports (prompt tokens per second of step time); one that has reported
 *    no rate yet takes nothing while it has work. An idle node always takes a prompt. So
 *    prompts wait in the router's queue, holding no decode blocks, instead of behind a
 *    prefill queue that would outlast their decode lease.
 * 3. If no prefill node pairs with the best decode node, the next decode node is tried.
 * 4. A unified node (TD_NODE_ROLE_UNIFIED) is ranked with the decode nodes by the same
 *    rule and is its own prefill node: the pair {d, d} (excluded only as that pair), so the
 *    router's one request path (Admit, Prefill, Steps) runs on one node with no transfer.
 *    Decode and unified nodes may serve one model side by side (a mixed cluster).
 * 5. Conditional disaggregation (prefill_policy ROUTER_PREFILL_CONDITIONAL; the default,
 *    ROUTER_PREFILL_DISAGGREGATED, always sends a decode node's prompts to a prefill node):
 *    a decode node may prefill the prompt itself, the pair {d, d} as for a unified node
 *    (Admit asks it: AdmitRequest.local_prefill), chunked beside its running streams. Per
 *    request, for the decode node of step 1, two estimates of when it holds the prompt's KV:
 *      remote = the best prefill partner's wait (step 2: its queued work and the prompt's
 *               tokens it has not cached, at its reported rate) + the transfer
 *               (xfer_fixed_s + the prompt's KV bytes / xfer_bytes_per_s);
 *      local  = the steps it takes the decode node to feed its own queued prompt tokens and
 *               this prompt's uncached ones (prefix hashes it was sent) in chunks of
 *               c = min(those tokens, its step budget max_step_tokens - running,
 *               (objective - step_ms) x rate) a step, each step taking step_ms (its
 *               decode-only pace) + c / its local prefill rate (prefill_tok_s: 1 / the
 *               per-token prompt cost of its step-cost fit, td_stepcost); the objective is
 *               the tightest of the request's (or tpot_objective_s) and the one the node
 *               reports for its own sequences. A node that has reported no local
 *               rate yet is assumed at half its partner's rate (it computes chunks beside its
 *               decodes, in smaller batches), or half assumed_tok_s without one: slow, so the
 *               first local prefill of a node is one that wins by a margin, and it measures
 *               the rate.
 *    The arithmetic is td_place's (common/base/td_place.h), which tandem plan simulates too.
 *    Local when it is sooner (and, with ttft_objective_s, the remote side would pass that
 *    objective: td_place_local_wins). The node itself keeps every step with a chunk within the
 *    tightest objective of its sequences (each Admit carries the request's:
 *    AdmitRequest.tpot_objective_s; decode_sched sizes the chunks from its fit). Otherwise remote. The reasons (router_place_reason_t): faster (either
 *    side), tpot (the streams' own pace leaves no room within the objective for one prompt
 *    token a step), step_budget (the running batch fills max_step_tokens: no room for a chunk),
 *    prompt_logprobs (only a prefill node computes them), no_prefill (no prefill node pairs:
 *    local, within the objective if a chunk fits, else at the TD_DECODE_PAST_OBJECTIVE_CHUNK
 *    token a step the node then feeds, and priced so: rule 6's peers compare with that),
 *    prefill_busy (every partner busy past max_prefill_wait_s: local if a chunk fits the
 *    objective, else the request waits).
 *
 * 6. Roles that follow the load (ROUTER_PREFILL_FOLLOW, `--prefill-policy follow`): rule 5, and
 *    then every decode node may also prefill for another one (a "peer"; not a unified node: it
 *    has no KV transfer). For the decode node of step 1, each other live decode node e of the
 *    model whose KV layout is the same, that has free blocks for the prompt, and whose steps
 *    leave room within the tightest of the request's and its own TPOT objectives (a peer busy
 *    past the objective never takes a prompt) is estimated as rule 5's local estimate on e
 *    (its queued prompt tokens and this prompt's, at its local rate, in its chunks) plus the
 *    transfer to d; the soonest peer is taken over rule 5's choice when it is sooner
 *    (td_place_peer_wins: not over a prefill node that meets the TTFT objective), or when rule
 *    5 found neither side. The pair is {e, d} (pick.peer): Admit to d leases the blocks, the
 *    Prefill call goes to e, which prefills the prompt in its own steps and sends the KV
 *    (docs/cluster.md "Prefill for another decode node"). A request with prompt logprobs never
 *    goes to a peer; a retry after a failed {e, d} excludes that pair.
 *
 * Outcomes: TD_OK with the pair; TD_ERR_EXHAUSTED when live decode nodes of the model
 * exist but none has room now, or every prefill partner is busy past max_prefill_wait_s
 * (the router queues the request); TD_ERR_RANGE when
 * the request needs more blocks than any live decode node has at all, or its prompt is too
 * long for the model (the message is router_admit_check_size's); TD_ERR_UNAVAILABLE
 * when no live node of a needed role serves the model, none pairs compatibly, or every
 * pair is excluded (retries). Errors are quiet (td_errorf_quiet): the router reports them
 * on the request's stream.
 *
 * Threads: the router's loop thread, with its registry. No I/O, no clock.
 */
#ifndef ROUTER_POLICY_H
#define ROUTER_POLICY_H

#include <stdbool.h>
#include <stdint.h>

#include "router_registry.h"
#include "td_status.h"

/* Where a decode node's prompts are prefilled. */
typedef enum router_prefill_policy {
    ROUTER_PREFILL_DISAGGREGATED, /* always on a prefill node (the default) */
    ROUTER_PREFILL_CONDITIONAL,   /* per request, where the KV is ready sooner (rule 5) */
    ROUTER_PREFILL_FOLLOW,        /* rule 5, or on another decode node when that is sooner (rule 6) */
} router_prefill_policy_t;

/* "disaggregated", "conditional" or "follow" into *p_p; TD_ERR_INVALID (quiet) for anything else. */
td_status_t router_prefill_policy_parse(const char *name, router_prefill_policy_t *p_p);

typedef struct router_policy_config {
    float prefix_weight;    /* work saved per cached prompt token, in queued tokens (1.0) */
    router_prefill_policy_t prefill_policy; /* (ROUTER_PREFILL_DISAGGREGATED) */
    double tpot_objective_s;/* conditional: the longest decode step a local prefill's chunks may
                               make for the streams there (0.1 s): it sizes the chunks */
    double ttft_objective_s;/* conditional: > 0, a prompt goes local only when the remote
                               estimate passes it (td_place_local_wins; 0: whenever sooner) */
    double xfer_fixed_s;    /* conditional: a KV transfer's fixed cost (0.002 s) */
    double xfer_bytes_per_s;/* conditional: KV transfer bandwidth (1e9) */
    int32_t max_hash_blocks;/* most prompt blocks hashed for prefix scoring (4096) */
    double max_prefill_wait_s; /* longest estimated prefill wait a busy node is given (5 s;
                                  0: no bound) */
    double assumed_tok_s;   /* rate assumed for a node that reported none, for prefill_wait_s
                               only (50 tokens/s: slow on purpose, it sizes a lease) */
} router_policy_config_t;

router_policy_config_t router_policy_config_default(void);

/* A pair, by registry index; prefill == decode: the decode (or unified) node prefills the
 * prompt itself. */
typedef struct router_pair {
    int32_t prefill;
    int32_t decode;
} router_pair_t;

typedef struct router_pick_request {
    const char *model;
    const int32_t *prompt;        /* [n_prompt] token ids (for prefix hashes) */
    int32_t n_prompt;             /* >= 1 */
    int32_t max_tokens;           /* >= 1 */
    const router_pair_t *exclude; /* [n_exclude] pairs already tried for this request */
    int32_t n_exclude;
    bool prompt_logprobs;         /* the request wants the prompt's log-probabilities: only a
                                     prefill node computes them, never a local prefill */
    int64_t now_ns;
    uint64_t cache_salt;          /* seeds the prompt's block hashes: its tenant's (0: none) */
    double tpot_objective_s;      /* the request's own TPOT objective (GenerateRequest's); 0: the
                                     policy's tpot_objective_s */
} router_pick_request_t;

/* Why a pick's prompt is prefilled where it is (tandem_router_prefill_placement_total's
 * reason label: router_place_reason_name). */
typedef enum router_place_reason {
    ROUTER_PLACE_POLICY,          /* remote: the disaggregated policy */
    ROUTER_PLACE_UNIFIED,         /* local: a unified node prefills every prompt */
    ROUTER_PLACE_FASTER,          /* the side estimated to hold the KV sooner */
    ROUTER_PLACE_TPOT,            /* remote: the decode node's pace leaves no room for a chunk within
                                     the TPOT objective */
    ROUTER_PLACE_STEP_BUDGET,     /* remote: the running batch fills the decode node's step budget */
    ROUTER_PLACE_PROMPT_LOGPROBS, /* remote: the request wants prompt logprobs */
    ROUTER_PLACE_NO_PREFILL,      /* local: no prefill node pairs with the decode node */
    ROUTER_PLACE_PREFILL_BUSY,    /* local: every prefill partner is busy past max_prefill_wait_s */
    ROUTER_PLACE_REASONS
} router_place_reason_t;

/* "policy", "unified", "faster", "tpot", "step_budget", "prompt_logprobs", "no_prefill",
 * "prefill_busy". */
const char *router_place_reason_name(router_place_reason_t r);

typedef struct router_pick {
    router_pair_t pair;
    int32_t blocks_needed;  /* decode blocks for prompt + max_tokens */
    int32_t prefix_blocks;  /* prompt blocks believed cached on the prefill node */
    double prefill_wait_s;  /* estimated time until the prefill node has computed this prompt
                               (its queued work and the prompt's uncached tokens at its rate,
                               or at assumed_tok_s); a local prefill on a decode node: its
                               local estimate; 0 on a unified node */
    bool local;             /* pair.prefill == pair.decode: prefilled on the decode node */
    bool peer;              /* follow: pair.prefill is another decode node, which prefills the
                               prompt and sends its KV (rule 6) */
    router_place_reason_t reason;
    double local_s, remote_s; /* conditional: the two estimates compared (rule 5; < 0: that
                                 side was not possible) */
    double peer_s;          /* follow: the soonest peer's estimate (rule 6; < 0: none could) */
    int32_t local_chunk;    /* conditional, local: the prompt tokens a step of the decode node
                               was estimated to feed it (the node sizes its chunks itself) */
    double tpot_objective_s; /* what the decode node holds the request to (AdmitRequest's): the
                               request's own; else, under the conditional policy on a decode
                               node, the policy's; 0: none */
} router_pick_t;

/*
 * Chooses a pair (see the file comment). *pick_p written on success only. Errors:
 * TD_ERR_EXHAUSTED, TD_ERR_RANGE, TD_ERR_UNAVAILABLE as above, TD_ERR_INVALID (bad
 * request fields), TD_ERR_NOMEM.
 */
td_status_t router_policy_pick(const router_registry_t *reg, const router_policy_config_t *cfg,
                               const router_pick_request_t *req, router_pick_t *pick_p);

/*
 * Books a chosen pair in the registry until the nodes' next heartbeats overwrite it, so
 * that requests routed in between see the load they add: the decode node's free blocks
 * drop by blocks_needed and its running batch grows by one, the prefill node's queued
 * tokens grow by the prompt, and the prompt's block hashes are remembered as cached there.
 */
void router_policy_commit(router_registry_t *reg, const router_pick_request_t *req,
                          const router_pick_t *pick);

#endif /* ROUTER_POLICY_H */
