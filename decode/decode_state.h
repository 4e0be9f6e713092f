/*
 * decode_state: the decode node's process state and the messages between its two threads,
 * shared by decode_main.c (the loop thread: gRPC, td_xfer, the router client) and
 * decode_compute.c (the compute thread: the engine and decode_sched). Private to decode/.
 */
#ifndef DECODE_STATE_H
#define DECODE_STATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include "control.pb-c.h"
#include "decode_admit.h"
#include "decode_sched.h"
#include "td_engine.h"
#include "td_grpc.h"
#include "td_list.h"
#include "td_metrics.h"
#include "td_model.h"
#include "td_node.h"
#include "td_node_worker.h"
#include "td_node_xfer_metrics.h"
#include "td_xfer.h"

/* The KV pool's warm-up (decode_warm.c): the first blocks are made resident before the
 * node registers, the rest on this thread, chunk by chunk, each chunk handed to the block
 * manager (td_kv_unhold) only once resident, so neither the engine nor a sender's transfer
 * ever faults a page of the pool (issue 12) and start-up does not wait for the whole pool. */
typedef struct decode_warm {
    pthread_t thread;
    bool started;
    _Atomic bool stop;
    td_xfer_t *xfer;
    td_kv_cache_t *kv;
    const char *node_id;
    uint32_t from, to, chunk; /* blocks [from, to) in chunks of chunk */
    uint64_t t0;
} decode_warm_t;

/* The Steps stream carries every sequence's tokens: it has one subscriber, the router this
 * node registered with (docs/cluster.md "Who may subscribe to Steps"). */
#define DECODE_MAX_SUBSCRIBERS 1
#define DECODE_MAX_ROUTER_ADDRS 8
/* Set in the lease ids a decode node gives its local prefills (td_xfer's count up from 1). */
#define DECODE_LOCAL_LEASE_BIT (1ull << 62)
/* Set in the scheduler ids of the prompts it prefills for another node's lease (kv_out): they
 * meet neither its own leases nor its local ones, and never go out on Steps. */
#define DECODE_KV_OUT_ID_BIT (1ull << 61)

/* The decode node's own keys; the common ones (model, router, host, advertise, node id,
 * ports, threads, log level) are td_node's. */
typedef struct decode_config {
    int64_t kv_blocks;        /* the pool: engine sequences and transfer leases (0: from kv_mem) */
    int64_t kv_mem;           /* MiB the pool may take when kv_blocks is 0 (0: a share of memory) */
    int64_t kv_seqs;          /* kv_blocks 0: the pool holds this many sequences of the model's length */
    int64_t landing_blocks;   /* device pool: host blocks senders write (0: kv_blocks / 4) */
    int64_t max_batch;
    int64_t max_lease_ms;
    int64_t max_requests;     /* admitted + running at most (bounds every queue) */
    int64_t result_queue;     /* step results waiting for the loop */
    int64_t idle_wait_ms;     /* compute thread's bound on one wait */
    int64_t max_batch_tokens; /* tokens one step feeds: decodes + prompt chunks */
    int64_t prefill_chunk;    /* prompt tokens one sequence feeds in a step */
    const char *spec;         /* speculative decoding: off | prompt-lookup | draft-model */
    const char *draft_model;  /* spec draft-model: the drafter's model (NULL: none) */
    int64_t draft_tokens;     /* most draft tokens per sequence and step */
    const char *xfer_host;    /* IPv4 address the KV data plane (UCX listener) binds; NULL: --host,
                                 or --advertise when --host is a wildcard (xfer_listen_ip) */
} decode_config_t;

/* A local prefill's Prefill call (a unified node's, or a decode node's admitted with
 * local_prefill), waiting for its lease's first token (loop thread). */
typedef struct decode_prefill {
    td_list_t link;           /* in decode_state_t.prefills */
    uint64_t lease_id;
    td_grpc_call_t *call;
    uint64_t t0;              /* td_now_ns() at the call */
} decode_prefill_t;

/* A Prefill call for another decode node's lease (kv_out, loop thread): this node prefills the
 * prompt in its own steps (decode_sched kv_out), answers FIRST_TOKEN, sends the KV over td_xfer
 * into that lease as a prefill node does, answers KV_DELIVERED, then lets the blocks go. */
typedef struct decode_kv_out {
    td_list_t link;           /* in decode_state_t.kv_outs */
    struct decode_state *s;
    uint64_t id;              /* its scheduler id (DECODE_KV_OUT_ID_BIT set) */
    uint64_t key;             /* td_xfer's request id (td_xfer_request_key of the request id) */
    uint64_t lease_id;        /* the other node's lease, its token and blocks */
    td_xfer_token_t token;
    int32_t *dst_blocks;      /* [n_dst] */
    int32_t n_dst;
    int32_t n_tokens;
    td_xfer_peer_t *peer;     /* the lease holder (s->xfer's) */
    td_grpc_call_t *call;     /* NULL once answered or cancelled */
    td_xfer_send_t *send;     /* the transfer, from the KV's completion until its done callback */
    uint64_t t0, t_first;     /* td_now_ns() at the call, at the first token */
    bool cancel_posted;       /* the compute thread was asked to drop it (a CANCELLED event follows) */
} decode_kv_out_t;

/* Loop → compute (by value in the command ring). */
typedef struct decode_cmd {
    decode_admit_t *admit;     /* NULL: cancel lease_id (or, with release, release it; with
                                  forget, every sequence) */
    bool release;              /* a kv_out prompt's transfer is over: decode_sched_release(lease_id) */
    bool forget;               /* the router dropped this node: decode_sched_cancel_all (every
                                  sequence but the kv_out ones, which the loop cancels one by one) */
    uint64_t lease_id;
    int32_t *blocks;           /* [n_blocks] the landed lease's blocks, one reference each
                                  (TD_KV_HOLDER_LANDED: adopted or released once) */
    int32_t n_blocks;
    int32_t first_token;
    int32_t prompt_posted;     /* a local prefill's prompt: its tokens, counted in prompt_posted
                                  until the compute thread has it (0 otherwise) */
} decode_cmd_t;

/* What one entry of a step's results says of a sequence. */
typedef enum { DECODE_OUT_TOKEN, DECODE_OUT_LENGTH, DECODE_OUT_STOP, DECODE_OUT_FAILED,
               DECODE_OUT_KV_OUT /* a kv_out prompt's KV is complete: token, kv_blocks */ } decode_out_kind_t;

typedef struct decode_out_seq {
    uint64_t lease_id;
    int32_t token;             /* DECODE_OUT_TOKEN: the new token; else -1 */
    decode_out_kind_t kind;
    bool has_logprob;          /* TOKEN of a lease admitted with logprobs, sampled here */
    td_token_logprob_t logprob;
    int32_t *kv_blocks;        /* KV_OUT: [n_kv_blocks] the prompt's blocks, held by the scheduler
                                  until a release command (this copy: the entry's, freed with it) */
    int32_t n_kv_blocks;
} decode_out_seq_t;

/* Compute → loop: one step's results (its address in the result ring), C structs only: the
 * loop turns them into a StepBatch (send_seqs). */
typedef struct decode_out {
    uint64_t step;
    double step_s;
    decode_out_seq_t *seqs;    /* [cap] */
    int32_t n_seqs;
    uint32_t free_blocks;
} decode_out_t;

typedef struct decode_state {
    td_node_t proc;       /* loop, signals, /metrics, router client, common config */
    decode_config_t cfg;
    td_node_worker_t worker;   /* the compute thread, its command and result rings */
    uv_timer_t sweep;
    td_model_t *model;
    td_backend_t *be;
    td_engine_t *eng;
    decode_sched_t *sched;
    td_node_gram_t gram;      /* structured output (empty when the model has no tokenizer) */
    td_model_t *draft_model;  /* --draft-model: the drafter's model, engine and state (open_draft) */
    td_engine_t *draft_eng;
    td_spec_draft_t *draft;
    td_kv_layout_t layout;
    td_kv_cache_t *kv;        /* the engine's block manager, shared with td_xfer's leases */
    td_xfer_t *xfer;
    td_grpc_server_t *grpc;
    td_metrics_t *metrics;
    td_node_xfer_metrics_t xfer_metrics; /* td_xfer's statistics on /metrics */
    td_metric_t *m_used, *m_free, *m_running, *m_waiting, *m_tokens, *m_steps, *m_step_s, *m_batch,
        *m_admits, *m_refused, *m_releases, *m_prefill_tokens, *m_window_released,
        *m_token_cost, *m_tpot; /* the step-cost fit's time a prompt token; the tightest objective */
    uint64_t window_released; /* decode_sched_stats' count already added to m_window_released */
    td_metric_t *m_spec_verify, *m_spec_drafted, *m_spec_accepted, *m_spec_acceptance, *m_spec_tokens_per_step;
    td_spec_stats_t spec_seen; /* compute thread: the counters already added to the metrics */
    bool unified;             /* the unified role: no td_xfer, every prompt prefilled here */
    uint64_t next_lease;      /* local prefills' lease ids (DECODE_LOCAL_LEASE_BIT set on a
                                 decode node, whose td_xfer numbers its leases from 1) */
    td_list_t prefills;       /* local prefills' decode_prefill_t awaiting a first token */
    int32_t n_prefills;
    td_list_t kv_outs;        /* decode_kv_out_t: prompts prefilled here for other nodes' leases */
    int32_t n_kv_outs;
    uint64_t next_kv_out;     /* their scheduler ids (DECODE_KV_OUT_ID_BIT set) */
    td_metric_t *m_kv_out, *m_kv_out_failed; /* Prefill calls for other nodes' leases: served, failed */
    td_list_t admits; /* decode_admit_t, newest first */
    int32_t n_admits;
    td_grpc_call_t *subs[DECODE_MAX_SUBSCRIBERS];
    int n_subs;
    /* the router's addresses (--router resolved at startup): only a peer at one of them may
       subscribe to Steps; router_local: the router is on this host (any local peer then) */
    struct sockaddr_storage router_addrs[DECODE_MAX_ROUTER_ADDRS];
    int n_router_addrs;
    bool router_local;
    _Atomic int32_t load_running, load_free;
    /* the router ranks unified nodes (and weighs a decode node's local prefill) by the prompt
       tokens they still feed: those in the
       scheduler (load_context, refreshed once commands are taken and after each step) and
       those posted to the compute thread and not yet taken (prompt_posted); the compute thread
       stores the first before it takes from the second, so a prompt is counted (maybe twice
       for a moment) from its Prefill call until its last chunk */
    _Atomic int64_t load_context, prompt_posted;
    /* draining's count of work (decode_busy): admissions posted to the compute thread and not
       yet in load_running, step results not yet sent on Steps */
    _Atomic int32_t admits_posted, outs_unsent;
    /* the heartbeat's pace figures (compute thread; decode_compute.c pace_note): step_ns a moving
       mean of the steps without prompt chunks (the running streams' pace), milli_tok_s the
       prompt tokens per second of the step-cost fit (1 / per_prefill_s, the local prefill rate,
       x 1000; 0 while it has no fit), tpot_us the tightest TPOT objective of the sequences
       (decode_sched_stats; 0: none) */
    _Atomic int64_t step_ns, milli_tok_s, tpot_us, spread_ns; /* spread_ns: the fit's spread_s */
    bool shutting_down;
    bool forget_pending;      /* the router dropped this node and the forget command found the
                                 ring full: the sweep posts it again; Admit refused meanwhile */
    bool handles_up;          /* the sweep timer initialised */
    size_t pool_bytes;        /* the KV pool (td_engine_kv_plan) */
    decode_warm_t warm;       /* the pool's background warm-up (decode_warm.c) */
    /* compute thread: admissions taken while no step result could be allocated, reported
       FAILED with the next one ([cmd_ring_size]: at most one per command) */
    uint64_t *failed;
    int32_t n_failed;
    bool backoff;             /* out of memory: wait idle-wait-ms before the next try */
    /* loop thread: the StepBatch being sent, its entries made from a decode_out_t's */
    Tandem__Control__V1__SeqStep *batch_seqs; /* [batch_cap] */
    Tandem__Control__V1__SeqStep **batch_ptrs; /* [batch_cap] what the StepBatch points at */
    td_node_logprob_msg_t *batch_lps;          /* [batch_cap] the entries' log-probabilities */
    int32_t batch_cap;
} decode_state_t;

/* The command ring's bound (decode_compute.c says why). */
int32_t decode_cmd_ring_size(const decode_config_t *cfg);

/* Frees a step result (NULL-safe). */
void decode_out_free(decode_out_t *o);

/* The compute thread's body (td_node_worker_config_t.run, arg the decode_state_t): takes the
 * loop's commands, steps the scheduler, hands each step's results back. */
void decode_compute_main(void *arg);

/* The part of a pool of n_blocks made resident before the node registers (the rest is
 * warmed on a thread): DECODE_RESIDENT_AT_START bytes' worth, at least one block. */
#define DECODE_RESIDENT_AT_START ((size_t)256 << 20)
uint32_t decode_warm_resident(const td_kv_layout_t *layout, uint32_t n_blocks);
/* Holds back blocks [resident, n_blocks) of s->kv and starts warming them (their pages made
 * resident, then handed to the block manager). TD_OK at once when resident >= n_blocks. */
td_status_t decode_warm_start(decode_state_t *s, uint32_t resident, uint32_t n_blocks);
/* Stops and joins the warm-up (idempotent): before s->xfer or s->kv go. */
void decode_warm_stop(decode_state_t *s);

#endif /* DECODE_STATE_H */
