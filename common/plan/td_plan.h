/*
 * td_plan: the capacity planner's model of a tandem cluster (`tandem plan`, docs/goodput.md
 * "Capacity planning"). A discrete-event simulator in the manner of DistServe's: requests
 * arrive (Poisson, or a trace's times), the router places each on a prefill node and a decode
 * node (router_policy's ranking: the decode node with the fewest sequences, then the prefill
 * node with the fewest queued prompt tokens; or, conditionally, on the decode node itself, and
 * under follow on another decode node: td_place, the router's own arithmetic), prefill nodes batch
 * prompts head-first up to
 * their token budget (prefill_sched), the KV moves to the decode node after a transfer delay,
 * decode nodes step continuous batches (decode_sched) and a "unified" node does both with
 * chunked prefill (a what-if: the colocated alternative). Step times come from a measured
 * profile (td_plan_profile_t: affine and quadratic fits, `tandem plan profile`); the fits
 * (td_plan_fit) and the reading of a decode step from streams a client timed through a cluster
 * (td_plan_decode_window, `plan profile --gateway`) are here too, pure like the rest.
 *
 * Everything here is pure: time is simulated, nothing reads a clock or a file, results depend
 * only on the inputs (and the seed of td_plan_arrivals). A node's speed varies as the
 * profile measured it varying (td_plan_profile_t's speed factors, drawn per node and window
 * from a fixed sequence). What it leaves out, on purpose: KV memory beyond a token budget (no
 * preemption), prefix caching, sampling and stop strings (every request generates exactly its
 * output length), network jitter apart from the speed factors.
 *
 * Threads: any; no shared state (each call allocates its own and frees it).
 */
#ifndef TD_PLAN_H
#define TD_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

/* The most speed factors a profile holds (plan profile's --speed-requests). */
#define TD_PLAN_SPEED_MAX 256
/* With speed factors td_plan_simulate runs the requests again with other draws until it has
 * about TD_PLAN_SPEED_REQUESTS of them (at most TD_PLAN_SPEED_REPLICAS runs) and reports them
 * pooled: a trace of 80 requests is read off 4000 draws, not off the few its own run makes. */
#define TD_PLAN_SPEED_REQUESTS 4000
#define TD_PLAN_SPEED_REPLICAS 64

/* Step times in seconds, fitted from measurements (tandem plan profile). */
typedef struct td_plan_profile {
    double prefill_a_s, prefill_b_s, prefill_c_s; /* prefill step of T tokens in chunks of t_i tokens
                                                     ending at position e_i: a + b*T + c*sum(t_i e_i)
                                                     (attention: each new token reads its context;
                                                     one prompt of T tokens: a + b*T + c*T^2) */
    double decode_a_s, decode_b_s, decode_c_s;    /* decode step of B sequences holding C context
                                                     tokens in all: a + b*B + c*C */
    double xfer_a_s, xfer_b_s;                    /* KV of a P-token prompt reaches its decode node
                                                     a + b*P after the prompt's last chunk */
    double overhead_s;                            /* router and RPC hops: added to every request's
                                                     first token (and so to its end) */
    /* How a node's speed varies over time: during window k (of speed_window_s seconds) a node
     * computes at 1 / speed_f[j] of the fits' speed, j drawn for that node and window from a
     * fixed sequence (the simulation stays deterministic; td_plan_step_elapsed). The factors are what
     * `plan profile` measured: lone requests' mean step over their median, so the fits stay the
     * median and the factors the spread around it. n_speed 0: every step exactly the fit. */
    double speed_f[TD_PLAN_SPEED_MAX];
    int32_t n_speed;
    double speed_window_s;
} td_plan_profile_t;

/* The modelled step times (never below 1 us); attn = sum over the step's chunks of chunk
 * tokens x the position the chunk ends at. The fits alone: the speed factors are the simulator's. */
double td_plan_prefill_step_s(const td_plan_profile_t *p, int64_t tokens, double attn);
double td_plan_decode_step_s(const td_plan_profile_t *p, int64_t batch, int64_t context_tokens);
/* A step of a decode or unified node that feeds prompt chunks (prompt tokens, their attn) beside
 * `batch` decoding sequences holding context_tokens: the prefill step of its prompt tokens plus the
 * decode step of its decoding rows, each with its fixed cost (batch 0: the prefill step alone).
 * Measured on a follow cluster's decode nodes past capacity (docs/goodput.md, issue 37): 22.9 ms
 * for 10.6 prompt tokens and 3.4 rows, where the rows at the prompt tokens' rate said 18.5 ms. */
double td_plan_mixed_step_s(const td_plan_profile_t *p, int64_t prompt_tokens, double attn, int64_t batch,
                            int64_t context_tokens);

/* The cluster to simulate: either n_prefill + n_decode (both >= 1) or n_unified >= 1. */
typedef struct td_plan_cluster {
    int32_t n_prefill, n_decode, n_unified;
    int32_t prefill_max_batch_tokens; /* prefill node's token budget per step (2048) */
    int32_t prefill_max_batch;        /* prompts per prefill step (64) */
    int32_t decode_max_batch;         /* running sequences per decode (or unified) node (64) */
    int32_t unified_chunk;            /* prompt tokens one sequence feeds per unified step (256) */
    int32_t unified_max_batch_tokens; /* tokens per unified step (512) */
    /* (the defaults: td_sched_defaults.h, the nodes' own) */
    int64_t decode_kv_tokens;         /* prompt + output tokens a decode node holds at once; the
                                         router queues requests that fit nowhere (0: unbounded) */
    /* Conditional disaggregation (the router's prefill-policy conditional; P:D clusters only):
     * each prompt is prefilled on its decode node itself, chunked into its steps as a unified
     * node's (unified_chunk, unified_max_batch_tokens), when td_place says so from what the
     * router would know then: the nodes' queued prompt tokens, running sequences and their
     * measured paces (moving means of their simulated steps, as the nodes report them). */
    bool conditional;
    /* Roles that follow the load (the router's prefill-policy follow; n_prefill may be 0): what
     * conditional does, and a prompt may instead be prefilled by another decode node (a peer)
     * when td_place says the decode node holds its KV sooner so (td_place_peer_estimate,
     * td_place_peer_wins: the router's rule 6): the peer chunks it into its own steps within the
     * objective, as its own local prompts, then sends the KV (the profile's transfer), and the
     * first token leaves once it is sent. */
    bool follow;
    double tpot_objective_s;          /* conditional, follow: the router's tpot-objective (0.1 s) */
    double ttft_objective_s;          /* conditional, follow: the router's ttft-objective (0: none) */
} td_plan_cluster_t;

/* tandem's defaults (docs/scheduling.md), one prefill and one decode node. */
td_plan_cluster_t td_plan_cluster_default(void);

/* The speed factor of node `node` (any numbering the caller keeps) at time t in the simulation's
 * replica `replica`: 1 without factors. */
double td_plan_speed(const td_plan_profile_t *p, uint32_t replica, int32_t node, double t);

/* Seconds node `node` takes from time `now` for a step the fits time at dt: window by window
 * at each one's factor (a step spanning windows averages them; past 64 windows, the rest at
 * the factors' mean). dt without factors. */
double td_plan_step_elapsed(const td_plan_profile_t *p, uint32_t replica, int32_t node, double now, double dt);

typedef struct td_plan_request {
    double arrival_s;
    int32_t input_len, output_len; /* both >= 1 */
} td_plan_request_t;

typedef struct td_plan_slo {
    double ttft_s, tpot_s; /* <= 0: not an objective */
} td_plan_slo_t;

/* What a simulated run measured, with bench serve's definitions (docs/bench.md): duration is
 * first arrival to last end, goodput = requests meeting every objective / duration,
 * attainment = those / all, TPOT leaves out one-token requests, percentiles as numpy's. */
typedef struct td_plan_result {
    size_t n, good;
    double duration_s, throughput, goodput, attainment;
    double ttft_mean_s, ttft_p50_s, ttft_p90_s, ttft_p99_s, tpot_p50_s, tpot_p90_s, tpot_p99_s;
    double prefill_busy, decode_busy; /* fraction of the duration the nodes of the kind stepped,
                                         averaged over them (unified: both the same) */
    size_t placed_local, placed_peer; /* prompts prefilled by their own decode node (conditional,
                                         follow) and by a peer decode node (follow); the rest by a
                                         prefill or unified node (the router's placement counts) */
} td_plan_result_t;

/*
 * Simulates reqs[0..n) (arrival times ascending) on cluster c with profile p. TD_OK and *res_p
 * written; TD_ERR_INVALID (a cluster with no node of a kind, limits < 1, a request of length
 * < 1, times out of order) or TD_ERR_NOMEM, logged. Deterministic. With speed factors the
 * result is the replicas' (TD_PLAN_SPEED_REQUESTS) pooled: n counts every replica's requests,
 * duration their durations summed.
 */
td_status_t td_plan_simulate(const td_plan_profile_t *p, const td_plan_cluster_t *c, const td_plan_request_t *reqs,
                             size_t n, const td_plan_slo_t *slo, td_plan_result_t *res_p);

/* A workload's request lengths, used in order and cycled. */
typedef struct td_plan_lengths {
    const int32_t *input_len, *output_len; /* [n] */
    size_t n;
} td_plan_lengths_t;

/* n requests with Poisson arrivals at `rate` (exponential gaps from a PRNG seeded with seed;
 * the same seed gives the same gaps scaled by 1/rate) and lengths from L. */
void td_plan_arrivals(uint64_t seed, double rate, size_t n, const td_plan_lengths_t *L, td_plan_request_t *reqs);

/* How the searches below simulate one rate. */
typedef struct td_plan_search {
    size_t n_requests;     /* per simulated run (1000) */
    uint64_t seed;         /* arrivals (1) */
    double min_attainment; /* a rate is sustained at this SLO attainment (0.9) */
    td_plan_slo_t slo;
} td_plan_search_t;

td_plan_search_t td_plan_search_default(void);

/* Simulates cluster c at `rate`: *res_p as td_plan_simulate. */
td_status_t td_plan_at_rate(const td_plan_profile_t *p, const td_plan_cluster_t *c, const td_plan_lengths_t *L,
                            const td_plan_search_t *s, double rate, td_plan_result_t *res_p);

/*
 * The highest rate (requests/s, within 1%) cluster c sustains at s->min_attainment: *rate_p
 * (0 when 0.01 requests/s is not: the objectives are below the unloaded latency) and the run
 * at that rate (or at 0.01/s) in *res_p (optional). The runs are s->n_requests long, so a rate
 * up to a few percent past capacity may pass in the queue a finite run builds. Errors as td_plan_simulate.
 */
td_status_t td_plan_max_rate(const td_plan_profile_t *p, const td_plan_cluster_t *c, const td_plan_lengths_t *L,
                             const td_plan_search_t *s, double *rate_p, td_plan_result_t *res_p);

/*
 * Least squares: coef[0..k) minimising |X coef - y| over n rows of X (row-major, n x k,
 * k <= 4). TD_ERR_INVALID when the columns are dependent (or n < k).
 */
td_status_t td_plan_fit(const double *x, const double *y, size_t n, int k, double *coef);

/*
 * A decode measurement through a cluster: B streams started together, each a prompt of `prompt`
 * tokens and a generation the client saw as messages (first at first_s, then gaps_s[0..n_gaps),
 * seconds) carrying `tokens` tokens in all. While all B generated (after the last stream's first
 * message, before the first stream's last) every decode step gave each stream one token.
 */
typedef struct td_plan_stream {
    double first_s;         /* the first message's arrival, on a clock shared by the streams */
    const double *gaps_s;   /* [n_gaps] between consecutive messages */
    uint32_t n_gaps;
    uint32_t tokens;        /* tokens the stream carried (the server's usage) */
} td_plan_stream_t;

typedef struct td_plan_decode_point {
    double step_s;          /* median over the streams of window time / tokens in it; NAN: none */
    double context;         /* median context of the step that made a stream's middle window token */
    double gaps_per_stream; /* message gaps inside the window, a stream on average */
    double tokens_per_message; /* tokens / messages, the streams' mean (> 1: messages merged) */
} td_plan_decode_point_t;

/*
 * The decode step of batch n from streams[0..n): per stream, the time from its first to its last
 * message inside the window over the tokens between them, a message counted as tokens /
 * messages tokens (a router or client that fell behind sends several in one; messages read
 * together, gaps of 0, cost nothing). No I/O; TD_ERR_NOMEM.
 */
td_status_t td_plan_decode_window(const td_plan_stream_t *streams, size_t n, int64_t prompt,
                                  td_plan_decode_point_t *point_p);

#endif /* TD_PLAN_H */
