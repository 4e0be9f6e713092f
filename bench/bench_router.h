/*
 * bench_router (private to bench/): what bench_router.c (options, the router process, the
 * load generator, the phases and the output) and bench_router_nodes.c (the no-op prefill and
 * decode nodes and the child process that runs them) share: the run's state and the calls
 * between the two.
 */
#ifndef BENCH_ROUTER_H
#define BENCH_ROUTER_H

#include "td_bench.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include "td_http_client.h"
#include "control.pb-c.h"
#include "router_registry.h"
#include "td_child.h"
#include "td_node_client.h"
#include "tandem.pb-c.h"
#include "td_grpc.h"
#include "td_log.h"
#include "td_model.h"
#include "td_node_fake.h"
#include "td_opts.h"
#include "td_stats.h"
#include "td_util.h"

#define RB_MODEL "bench"
#define RB_CAPACITY_BLOCKS (1 << 30)
#define RB_BLOCK 16
#define RB_MAX_PROMPT 4096
#define RB_SUB_ROUTER 0
#define RB_SUB_DIRECT 1
#define RB_DIRECT_PREFIX "direct/"

typedef struct rb_opts {
    double duration_s;        /* per phase */
    double warmup_s;
    int concurrency;          /* phase a */
    int connections;          /* gateway connections */
    int streams;              /* phase c */
    int stream_tokens;        /* max_tokens of a phase c stream */
    int prompt_tokens;
    int router_cpu, bench_cpu;
    const char *tandem;
    const char *router_log;   /* the router's --log-level */
    const char *phases;       /* which of "abc" to run */
    bool json;
    bool http;                /* the load through the OpenAI HTTP API */
    double hold_s;            /* > 0: no phases; the router and no-op nodes serve another load generator */
} rb_opts_t;

/* A lease of the no-op decode node: admitted, then live once Prefill ran. */
typedef struct rb_lease {
    uint64_t id;              /* (generation << 32) | slot; 0 = free slot */
    uint32_t remaining;       /* tokens still to emit */
    uint32_t live_idx;        /* index in its subscriber's live array, or UINT32_MAX */
    uint64_t ready_turn;      /* first stepper turn that may emit it */
    uint8_t sub;              /* RB_SUB_ROUTER or RB_SUB_DIRECT */
    uint32_t next_free;
} rb_lease_t;

/* The leases a Steps subscriber of the no-op decode node streams (the subscription itself
 * is td_node_fake's, slot RB_SUB_ROUTER or RB_SUB_DIRECT). */
typedef struct rb_sub {
    uint32_t *live;           /* lease slots */
    uint32_t n_live, cap_live;
} rb_sub_t;

typedef enum { PH_IDLE, PH_RPS, PH_LAT, PH_RELAY } rb_phase_t;

typedef struct rb_slot {
    struct rb_state *s;
    td_grpc_client_call_t *call;
    td_http_client_t *http;  /* --http: the slot's connection (NULL until the first call) */
    uint64_t t_start;
    uint32_t tokens;
} rb_slot_t;

typedef struct rb_samples {
    double *v;
    size_t n, cap;
} rb_samples_t;

typedef struct rb_state {
    rb_opts_t o;
    uv_loop_t loop;
    bool loop_up;
    uv_timer_t wake;
    bool wake_up;
    uv_signal_t term[2];      /* --hold: SIGTERM and SIGINT end the hold (cleanup still runs) */
    bool term_up, term_seen;
    /* router process (its stdout piped to us: router.out_fd, until watched on the loop) */
    td_child_t router;
    uv_pipe_t router_out;
    bool router_out_open;
    /* the no-op nodes' child process (forked, not exec'd: its own loop; this struct is
     * copied by fork); nodes.out_fd: its reports, until watched on the loop */
    td_child_t nodes;
    int nodes_fd;             /* child: where it reports */
    uv_pipe_t nodes_out;
    bool nodes_out_open;
    char nodes_line[256];
    size_t nodes_len;
    uint16_t prefill_port, decode_port;
    bool nodes_ready, nodes_ready_sent;
    uv_signal_t sigterm;
    bool sigterm_up;
    char sink[4096];
    char host[64];
    uint16_t gw_port, ctl_port, http_port;
    char tok_dir[256];        /* --http: the router's tokenizer (removed at the end) */
    char *http_req[2];        /* --http: the request bytes, max_tokens 1 and stream-tokens */
    size_t http_req_len[2];
    /* no-op nodes */
    td_node_fake_t *prefill_node, *decode_node;
    td_node_client_t *prefill_cli, *decode_cli;
    rb_lease_t *leases;
    uint32_t n_leases, cap_leases, free_head;
    uint32_t lease_gen;
    rb_sub_t subs[2];
    uv_idle_t stepper;
    bool stepping, stepper_up;
    uint64_t turn;
    td_node_fake_entry_t *step_buf; /* [step_cap] a StepBatch's entries */
    uint32_t step_cap;
    /* load generator */
    td_grpc_channel_t **gw;
    td_grpc_channel_t *d_decode, *d_prefill;
    td_grpc_client_call_t *d_steps;
    uint32_t *prompt;
    uint32_t call_timeout_ms; /* every call's deadline: longer than a phase */
    rb_phase_t phase;
    bool issuing;
    rb_slot_t *slots;
    int n_slots;
    int outstanding;
    uint64_t ok, errors, tokens, issued;
    char first_error[200];
    /* phase b */
    bool lat_busy, lat_direct_next;
    uint64_t lat_t0, lat_lease, lat_seq;
    rb_samples_t lat_router, lat_direct;
    bool failed;              /* a setup or protocol failure: stop */
    bool stopping;            /* children are being stopped on purpose */
} rb_state_t;

/* The no-op nodes have registered with the router (the router's registry says so). */
bool rb_nodes_up(rb_state_t *s);

/* Forks the process that runs the no-op prefill and decode nodes (before the loop starts);
 * its report lines come back on a pipe, read by rb_on_nodes_out. */
td_status_t rb_nodes_fork(rb_state_t *s);

/* Parent: the nodes' process's report lines. */
void rb_on_nodes_out(uv_stream_t *st, ssize_t n, const uv_buf_t *buf);

#endif /* BENCH_ROUTER_H */
