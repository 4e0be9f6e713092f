/*
 * td_place: the arithmetic of conditional disaggregation (docs/scheduling.md "Conditional
 * disaggregation"): given what a decode node and its best prefill partner report, when would
 * the decode node hold a prompt's KV if it prefilled the prompt itself (local), when if a
 * prefill node did and sent it (remote), and which is chosen. The router's policy
 * (router_policy.c, rule 5) and the capacity planner's simulation of it (td_plan.c) both call
 * these, so the planner predicts the decision the router makes, not a copy of it that drifts.
 *
 * Pure: no clock, no I/O, no state. Times in seconds, rates in prompt tokens per second.
 */
#ifndef TD_PLACE_H
#define TD_PLACE_H

#include <stdbool.h>
#include <stdint.h>

/* The router's defaults, which the planner simulates too: the prompt tokens per second assumed of
 * a node that has measured no rate yet (slow on purpose: it also sizes a lease), and the longest
 * step a local prefill's chunks may give the decode node's running streams. */
#define TD_PLACE_ASSUMED_TOK_S 50.0
#define TD_PLACE_TPOT_OBJECTIVE_S 0.1

/* What the decode node reports and what the prompt would cost it. */
typedef struct td_place_local {
    int64_t queued_tokens;   /* prompt tokens it still prefills itself (earlier local prompts) */
    int64_t new_tokens;      /* this prompt's tokens it would compute (not cached there); >= 1 */
    int64_t max_step_tokens; /* tokens one of its steps carries at most (its max-batch-tokens;
                                <= 0: no bound) */
    int32_t running;         /* sequences running there, one token each a step */
    double step_s;           /* its step without prompt chunks (the streams' pace) */
    double prefill_tok_s;    /* its local prefill rate: prompt tokens per second of the time
                                chunks add to its steps (> 0; td_place_local_rate) */
    double tpot_objective_s; /* > 0: a step with a chunk of this prompt stays within it, for the
                                streams running there and those that join while it runs */
    double spread_s;         /* what the node keeps back from the objective when it sizes a chunk
                                (its step-cost fit's spread, td_stepcost_chunk); 0: none */
    int64_t floor_tokens;    /* > 0: where the objective leaves room for no prompt token, price
                                chunks of this many (what the node then feeds a step, its
                                TD_DECODE_PAST_OBJECTIVE_CHUNK) instead of TD_PLACE_NO_TPOT_ROOM */
} td_place_local_t;

/* The rate to price a local prefill at: the node's measured one, or, before it has one, half its
 * partner's (chunks run beside decodes, in smaller batches than a prefill node's), or half
 * `assumed` without a partner's: slow on purpose, so a node's first local prefill is one that
 * wins by a margin, and it then measures its own. Never below 1e-3. */
double td_place_local_rate(double measured_tok_s, double partner_tok_s, double assumed_tok_s);

/* Whether the decode node can prefill the prompt itself now. */
typedef enum td_place_fit {
    TD_PLACE_FITS,         /* chunks of >= 1 token a step */
    TD_PLACE_NO_STEP_ROOM, /* its running batch fills its step budget (max_step_tokens) */
    TD_PLACE_NO_TPOT_ROOM, /* its steps leave no time within the objective for one prompt token */
} td_place_fit_t;

typedef struct td_place_estimate {
    int64_t chunk;  /* prompt tokens a step feeds: min(W, max_step_tokens - running,
                       (tpot_objective_s - spread_s - step_s) * rate), W = queued + new tokens */
    double step_s;  /* each of those steps: step_s + chunk / rate (within the objective) */
    double local_s; /* when the node holds the KV: ceil(W / chunk) steps */
} td_place_estimate_t;

/* The local estimate into *e_p (written only with TD_PLACE_FITS). */
td_place_fit_t td_place_local_estimate(const td_place_local_t *l, td_place_estimate_t *e_p);

/* The remote estimate: the partner's wait until it has computed the prompt, plus the transfer
 * of kv_bytes (a fixed cost and a bandwidth). */
double td_place_remote_estimate(double wait_s, double kv_bytes, double xfer_fixed_s, double xfer_bytes_per_s);

/* The choice, once the local estimate fits: local when it is sooner and, with a TTFT objective
 * (> 0), the remote side would pass it. A local prompt costs the decode node's streams the
 * chunks' time; where the prefill node meets the objective anyway, sooner gains no goodput and
 * risks the streams' TPOT (the first sweep of issue 37: conditional lost to disaggregation at
 * every rate disaggregation kept up with). 0: sooner alone. */
bool td_place_local_wins(double local_s, double remote_s, double ttft_objective_s);

/* Roles that follow the load (the router's `follow` policy): another decode node (a peer) may
 * prefill the prompt and send its KV, estimated as that node's local prefill
 * (td_place_local_estimate over what it reports) plus the transfer (td_place_remote_estimate with
 * that wait). The peer is taken over the choice made without it (chosen_s: the local or the
 * remote estimate chosen; < 0: neither was possible) when it is sooner, except that a remote
 * choice that meets the TTFT objective (> 0) stays: a prefill node is there for prompts, while a
 * peer's chunks cost its own streams. peer_s < 0: no peer could. */
bool td_place_peer_wins(double peer_s, double chosen_s, bool chosen_remote, double ttft_objective_s);

/* A peer's estimate (rule 6): when the decode node would hold the prompt's KV if the peer whose
 * figures are l (this prompt its new tokens, its chunks within the tightest of the request's and
 * its own TPOT objectives) prefilled it: the peer's local estimate plus the transfer of kv_bytes
 * (td_place_remote_estimate). -1 when the peer cannot (td_place_local_estimate does not fit: its
 * running batch fills its step budget, or its steps leave no room within the objective); else
 * the peer's local estimate alone into *wait_s_p (what sizes the lease). The router's best_peer
 * and the planner's simulation of follow take the soonest of these over the peers they may use. */
double td_place_peer_estimate(const td_place_local_t *l, double kv_bytes, double xfer_fixed_s, double xfer_bytes_per_s,
                              double *wait_s_p);

#endif /* TD_PLACE_H */
