/*
 * td_node_conf: the config of the cluster processes (router, prefill, decode): the keys
 * they all read (td_node_config_t) as a td_opts table, parsed together with the process's
 * own table. Every key is accepted as `--key VALUE` / `--key=VALUE` and as a `key = value`
 * line of a `--config FILE` (# comments, blank lines); flags given on the command line win
 * over the file, whatever their order. Defaults are whatever the structs held before parsing.
 *
 * Threads: any; no global state. Errors are logged once (td_errorf) naming the key.
 */
#ifndef TD_NODE_CONF_H
#define TD_NODE_CONF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_opts.h"
#include "td_status.h"

/* The keys every process (or every node) reads. NULL / 0 fields get their defaults in
 * td_node_configure; a process may preset any of them before (e.g. node_id). */
typedef struct td_node_config {
    const char *host;          /* listen address (default 127.0.0.1) */
    const char *advertise;     /* address peers use (default: host; required for a wildcard host) */
    int64_t port;              /* router: gateway gRPC; node: control gRPC (0 = any) */
    int64_t metrics_port;      /* /metrics (0 = any) */
    const char *model_name;    /* the model name served / routed by (default "default") */
    const char *log_level;
    const char *cluster_secret_file; /* the secret every control call is signed with
                                        (docs/security.md); NULL: control plane open */
    const char *api_keys_file; /* router: keys the front doors require; NULL: none */
    bool insecure;             /* allow no cluster secret on a non-loopback --host (warned at
                                  every start); without it such a start is refused */
    bool check_config;         /* --check-config: check the flags and the file, then exit */
    /* nodes only */
    const char *model;         /* model path (required) */
    const char *router;        /* the router's control address HOST:PORT (default 127.0.0.1:7070) */
    const char *node_id;       /* unique node name (default "<prog>0") */
    int64_t threads;           /* compute threads (0 = all cores) */
    const char *device;        /* cpu (default), cuda, cuda:N */
    const char *dtype;         /* weights and KV cache (and CUDA activations): f32|f16|bf16;
                                  NULL: td_device_default_dtype */
    const char *quant;         /* weight matrices quantized at load: q8_0|q4_0; NULL: as stored */
    const char *kv_dtype;      /* KV cache: f32|f16|bf16|q8_0; NULL: as dtype */
    int64_t ctx_size;          /* the longest sequence (prompt + output) the node serves, at most
                                  the model's length (0: the model's); it sizes the KV pools */
    int64_t drain_timeout_ms;  /* SIGTERM / Drain: longest wait for running requests before
                                  the node exits anyway (0: default 300000) */
} td_node_config_t;

/*
 * Parses argv[1..argc) (and its --config FILE) against the common keys of a node (`node`)
 * or of the router, followed by the process's keys[0..n_keys). On --help prints the usage
 * of all of them to stdout and sets r->help. Returns TD_OK or TD_ERR_INVALID (logged,
 * naming the key). The file's strings live in *r until td_opts_result_free.
 */
td_status_t td_node_conf_parse(const char *prog, td_node_config_t *c, bool node, const td_opt_t *keys,
                               int n_keys, int argc, char **argv, td_opts_result_t *r);

/* Splits "host:port" into host (copied into host[0..cap)) and port. TD_ERR_INVALID. */
td_status_t td_node_conf_split_addr(const char *addr, char *host, size_t cap, uint16_t *port_p);

#endif /* TD_NODE_CONF_H */
