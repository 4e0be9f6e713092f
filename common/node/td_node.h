/*
 * td_node: the process skeleton the three cluster processes (router, prefill node,
 * decode node) share, so that each thing they all do is done one way: the common config
 * keys with the process's own table (--config FILE, flags, --help, --log-level), the
 * listen/advertise address rule, the libuv loop with SIGINT/SIGTERM, the /metrics HTTP
 * server, registration with the router (nodes), and shutdown sequencing. The process's
 * main loop stays visible in its main.c:
 *
 *     if (!td_node_configure(&s->proc, &spec, keys, n_keys, argc, argv, &rc))
 *         return rc;                          // --help (0) or a bad config (2)
 *     ... its subsystems on &s->proc.loop ...
 *     td_node_serve(&s->proc, metrics);   // /metrics, signals
 *     td_node_register(&s->proc, ...);    // nodes: router client, banner
 *     rc = td_node_run(&s->proc);
 *   out:
 *     td_node_stop(&s->proc);             // shutdown if not begun, drain, close loop
 *     ... its subsystems freed in reverse ...
 *     td_node_free(&s->proc);
 *
 * Addresses: --host is where the process listens (every server, and the decode node's
 * UCX listener); --advertise is where peers reach it (the control address a node registers,
 * the UCX address in a decode node's transfer descriptor, the banner's addresses). It
 * defaults to --host; a wildcard --host (0.0.0.0, ::) without --advertise is refused, since
 * a node registering 0.0.0.0:PORT is never reachable by its peers.
 *
 * Shutdown (SIGINT, the router's SIGTERM, or td_node_shutdown): the process's on_shutdown
 * callback first (stop its compute thread, close its servers and handles), then the router
 * client, /metrics and the signal handles; the loop ends once every handle closed; exit 0.
 *
 * Draining (a node's SIGTERM, a Node/Drain call, td_node_drain): the node takes no new
 * request (the process refuses them while td_node_draining), its heartbeat tells the router
 * at once (which then routes nothing to it), its health turns NOT_SERVING, and it shuts down
 * as above once spec.busy says nothing runs (its control server sent what it queued) and
 * the router heard the drain (TD_NODE_DRAIN_TELL_MS at most), or after the drain timeout
 * (--drain-timeout-ms) with a warning naming how many requests were still running.
 * A second SIGTERM, or SIGINT, stops it at once. SIGTERM is what Kubernetes, systemd and
 * Slurm send; `tandem local` stops its processes with SIGINT (at once, as before).
 *
 * Threads: the process's loop thread. No global state.
 */
#ifndef TD_NODE_H
#define TD_NODE_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "control.pb-c.h"
#include "td_node_conf.h"
#include "td_node_client.h"
#include "td_node_auth.h"
#include "td_backend.h"
#include "td_engine.h"
#include "td_gram.h"
#include "td_http.h"
#include "td_metrics.h"
#include "td_metrics_loop.h"
#include "td_model.h"
#include "td_sampler.h"
#include "td_status.h"
#include "td_tokenizer.h"

#define TD_NODE_ADDR_MAX TD_NODE_ADDRESS_MAX

typedef enum td_node_kind {
    TD_NODE_ROUTER, /* the router: gateway + control servers, no registration */
    TD_NODE_NODE,   /* a prefill or decode node: a model, registers with a router */
} td_node_kind_t;

/* The process's part of shutdown: called once, on the loop thread, before the skeleton
 * closes the router client, /metrics and the signals. Must close every handle it opened. */
typedef void (*td_node_shutdown_cb)(void *data);

/* Nodes: requests still on the node (queued, running, or with bytes the control server has
 * not yet written); draining ends when it returns 0. Loop thread. */
typedef int32_t (*td_node_busy_cb)(void *data);

typedef struct td_node_spec {
    const char *prog;          /* "router", "prefill", "decode": usage, logs, banner */
    td_node_kind_t kind;
    td_node_shutdown_cb on_shutdown;
    td_node_busy_cb busy;      /* nodes: required (draining); router: NULL (SIGTERM stops) */
    void *data;
} td_node_spec_t;

/* Caller-allocated (zeroed), embedded in the process's state struct. */
typedef struct td_node {
    td_node_config_t cfg;
    td_node_spec_t spec;
    uv_loop_t loop;            /* valid after a true td_node_configure */
    char router_host[64];      /* nodes: split from cfg.router */
    uint16_t router_port;
    char address[TD_NODE_ADDR_MAX]; /* nodes: advertise:port, once registered */
    char default_id[32];
    td_device_spec_t device;   /* nodes: parsed cfg.device */
    int dtype;                 /* nodes: parsed cfg.dtype; -1 (not given) until load_model
                                  applies td_device_default_dtype */
    int quant;                 /* nodes: parsed cfg.quant (a block td_dtype_t), -1: none */
    int kv_dtype;              /* nodes: parsed cfg.kv_dtype, -1: as dtype */
    td_opts_result_t conf;     /* the --config file's strings (cfg points into them) */
    td_http_server_t *http;
    td_metrics_loop_t *loop_metrics; /* loop lag and longest run, beside /metrics */
    td_node_client_t *client;
    td_node_auth_t auth;       /* API keys (router) and cluster secret, from the config */
    uv_signal_t sigint, sigterm;
    uv_timer_t drain_timer;    /* draining: checks spec.busy every TD_NODE_DRAIN_POLL_MS */
    uint64_t drain_start_ns, drain_end_ns; /* td_now_ns() at the start; the timeout's end */
    long fd_limit;             /* open files this process may hold (td_fd_limit_raise at
                                  configure; -1: unknown): the router sizes its caps from it */
    bool loop_up, signals_up, shutting_down, draining, drain_timer_up;
} td_node_t;

#define TD_NODE_DRAIN_POLL_MS 50
#define TD_NODE_DRAIN_TELL_MS 2000 /* an idle draining node's longest wait for the router to hear it */
#define TD_NODE_DRAIN_TIMEOUT_MS 300000 /* --drain-timeout-ms default */

/*
 * Reads the config: the common keys of spec->kind followed by keys[0..n_keys), from
 * --config FILE and argv (td_node_conf), then --log-level, the node's --model and --router,
 * and the address rule; loads the API keys and cluster secret files (td_node_auth); then
 * initialises the loop. True: go on. False: return *exit_p
 * from main (0 after --help, 2 for a bad config, the reason logged once). The strings in
 * p->cfg stay valid until td_node_free.
 */
bool td_node_configure(td_node_t *p, const td_node_spec_t *spec, const td_opt_t *keys, int n_keys,
                       int argc, char **argv, int *exit_p);

/* True for an address that listens on every interface ("0.0.0.0", "::", "[::]", ""). */
bool td_node_is_wildcard(const char *host);

/* True for a loopback address literal (127.0.0.0/8, ::1, [::1]): only this machine reaches
 * it, so the control plane may run there without a cluster secret. */
bool td_node_is_loopback(const char *host);

/*
 * Starts /metrics on cfg.host:cfg.metrics_port (serving `metrics`, which the caller keeps
 * alive until td_node_stop returned), the loop's own series in it (td_metrics_loop:
 * lag and longest run of callbacks), the auth counters (td_node_auth_serve: SIGHUP reloads
 * the API keys) and the SIGINT/SIGTERM watch. Errors: those of
 * td_http_server_create (logged there); the signals are watched in any case, so
 * td_node_stop can shut down.
 */
td_status_t td_node_serve(td_node_t *p, td_metrics_t *metrics);

/* The /metrics port (0 before td_node_serve). */
uint16_t td_node_metrics_port(const td_node_t *p);

/*
 * Nodes: registers with the router. Fills nc's router address, info.id, info.model and
 * info.address (cfg.advertise:control_port) from the config; the caller sets the rest
 * (role, layout, capacity, max_batch, max_seq_len, xfer_desc...). Prints the banner
 * "<prog> <id>: control ADDR metrics http://ADV:PORT/metrics" to stdout. Errors: those of
 * td_node_client_create (nothing started).
 */
td_status_t td_node_register(td_node_t *p, td_node_client_config_t *nc, uint16_t control_port,
                                 td_node_load_cb load_cb, void *data);

/*
 * Nodes: loads cfg.model and opens the backend of cfg.device (td_backend_open: cfg.threads
 * CPU threads, or CUDA activations in cfg.dtype), the one way every node gets its model.
 * Outputs set only on success (the model freed on a backend failure). Errors: those of
 * td_model_load / td_backend_open, logged there.
 */
td_status_t td_node_load_model(td_node_t *p, td_model_t **model_p, td_backend_t **be_p);

/*
 * Nodes: sizes the KV pool before anything is allocated (td_engine_kv_plan with pp) and
 * prints "<prog> <id>: kv pool <plan>" to stderr, whatever the log level (tandem local's
 * users read it). Outputs set only on success. Errors: those of td_engine_kv_plan (logged
 * there, naming the sizes and the flag to lower).
 */
td_status_t td_node_plan_kv(const td_node_t *p, const td_model_t *model, const td_engine_config_t *ec,
                                const td_kv_plan_params_t *pp, int64_t *n_blocks_p, size_t *pool_bytes_p);

/* Nodes: the engine defaults with cfg.dtype applied to the weights and the KV cache. */
td_engine_config_t td_node_engine_config(const td_node_t *p);

/*
 * The one conversion of sampling parameters from the wire (tandem.v1.SamplingParams: a
 * GenerateRequest's at the gateway, an AdmitRequest's or PrefillRequest's at the nodes;
 * NULL = the defaults, greedy), so every process reads a request alike and a seeded request
 * samples alike on each side of the split. Driven by TD_SAMPLING_FIELDS (td_sampler.h): each
 * .wire row is the proto field of the same name. A 0 on the wire is unset and means the
 * field's default (so an unset top_p or repetition_penalty means 1); a top_k past INT32_MAX
 * keeps every token, as INT32_MAX does. The logit bias lists are copied (their
 * check, td_sampling_check_bias, refuses lists of two lengths or too long). Not validated: the caller runs td_sampling_validate
 * (or td_gen_params_validate). Any thread.
 */
td_sampling_t td_node_sampling_from_proto(const Tandem__V1__SamplingParams *p);

/* The one conversion back: s into *p (initialised here; no allocation: the logit bias lists
 * point into *s, which must outlive *p). */
void td_node_sampling_to_proto(const td_sampling_t *s, Tandem__V1__SamplingParams *p);

/*
 * Log-probabilities on the wire, converted in one place for the router and both nodes.
 * td_node_logprobs_from_proto reads a LogprobsRequest (NULL = none) into *w and checks it:
 * TD_ERR_INVALID with "top_logprobs N is out of range [0, 20]" in why (quiet; the RPC edge
 * reports it). td_node_logprobs_to_proto writes it back (w->on false: leave the field
 * absent; *p is initialised either way).
 */
td_status_t td_node_logprobs_from_proto(const Tandem__V1__LogprobsRequest *p, td_logprobs_want_t *w,
                                        char *why, size_t why_cap);
void td_node_logprobs_to_proto(const td_logprobs_want_t *w, Tandem__V1__LogprobsRequest *p);

/* A TokenLogprob message with room for its alternatives, filled without allocation
 * (pointers into itself: do not copy it once filled). */
typedef struct td_node_logprob_msg {
    Tandem__V1__TokenLogprob m;
    Tandem__V1__TopLogprob top[TD_LOGPROBS_MAX_TOP];
    Tandem__V1__TopLogprob *ptrs[TD_LOGPROBS_MAX_TOP];
} td_node_logprob_msg_t;

void td_node_logprob_to_proto(const td_token_logprob_t *lp, td_node_logprob_msg_t *out);
/* Messages for lps[0..n) in one allocation (*mem_p: free() it once they are sent), *msgs_p
 * pointing at [n] of them, for a repeated TokenLogprob field. Errors: TD_ERR_NOMEM (quiet:
 * the caller says what for). */
td_status_t td_node_logprobs_to_proto_array(const td_token_logprob_t *lps, size_t n,
                                            Tandem__V1__TokenLogprob ***msgs_p, void **mem_p);

/* The message into *lp; alternatives past TD_LOGPROBS_MAX_TOP are dropped. */
void td_node_logprob_from_proto(const Tandem__V1__TokenLogprob *m, td_token_logprob_t *lp);

/*
 * Nodes: begins draining (see the top of this file) with the bound timeout_ms (0: the
 * config's drain-timeout-ms; else the smaller of both). Once begun, a later call changes
 * nothing. Loop thread; after td_node_serve.
 */
void td_node_drain(td_node_t *p, uint32_t timeout_ms);

/* True once draining began: the process refuses new work (UNAVAILABLE, "draining"). */
bool td_node_draining(const td_node_t *p);

/* The gate a node's request handler passes before it takes work: while draining it finishes
 * the call UNAVAILABLE "<what> draining: it takes no new request", with `pending` at `cap`
 * RESOURCE_EXHAUSTED "<what>: <full>"; either way it counts `refused` and returns false.
 * True: take the work. Loop thread. */
bool td_node_take_or_refuse(const td_node_t *p, td_grpc_call_t *call, td_metric_t *refused, const char *what,
                            int64_t pending, int64_t cap, const char *full);

/*
 * Nodes: adds to the node's control server the methods every node serves the same way,
 * with p as their data:
 * - grpc.health.v1.Health/Check (open without the cluster secret, for Kubernetes' probes):
 *   service "" (or the node's role service, e.g. "tandem.control.v1.DecodeNode"): SERVING
 *   once registered with the router and not draining, else NOT_SERVING (readiness);
 *   service "liveness": SERVING while the loop runs, draining included; another: NOT_FOUND.
 * - tandem.control.v1.Node/Drain: td_node_drain, answered with the requests still running.
 * The caller's control gate (td_node_auth_guard_control) lets Health/Check through.
 * Errors: those of td_grpc_server_add_methods.
 */
td_status_t td_node_serve_control(td_node_t *p, td_grpc_server_t *srv);

/* Runs the loop until shutdown has closed every handle. Returns 0 (the exit status). */
int td_node_run(td_node_t *p);

/* Begins shutdown (once; later calls do nothing): spec.on_shutdown, then the router
 * client, /metrics and the signals are closed. Loop thread. */
void td_node_shutdown(td_node_t *p);

/* After run, or on an init failure: shuts down if not begun, runs the loop until the
 * closes finish and closes it (a warning names handles left open). No-op without a loop. */
void td_node_stop(td_node_t *p);

/* Frees what configure kept (the config file's strings). NULL-safe, repeatable. */
void td_node_free(td_node_t *p);

/* Structured output on a node: the model's tokenizer, its grammar vocabulary and a cache of
 * compiled grammars (every field NULL when the model has no tokenizer beside it). */
typedef struct td_node_gram {
    td_tokenizer_t *tok;
    td_gram_vocab_t *vocab;   /* td_constrain_vocab of the model */
    td_gram_cache_t *cache;   /* TD_NODE_GRAM_CACHE grammars, least recently used out */
} td_node_gram_t;

#define TD_NODE_GRAM_CACHE 16

/*
 * Nodes: fills *g for model (zeroed first). A model with no tokenizer beside it, or one
 * td_tokenizer_load cannot read (warned), is no error: g stays empty and requests with a
 * grammar are refused by name. Errors: TD_ERR_NOMEM (g empty). Loop thread, at startup.
 */
td_status_t td_node_gram_open(const td_model_t *model, td_node_gram_t *g);
/* Frees what g holds. Repeatable. */
void td_node_gram_close(td_node_gram_t *g);

#endif /* TD_NODE_H */
