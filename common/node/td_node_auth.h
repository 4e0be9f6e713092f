/*
 * td_node_auth: td_auth put to work in a cluster process (docs/security.md). One struct per
 * process (in td_node_t) holds its API keys (router: --api-keys-file) and its cluster
 * secret (every process: --cluster-secret-file), and gives:
 *
 * - gates for its gRPC servers: the gateway's (authenticate_head, on the headers, before
 *   any of the request is buffered) checks `authorization: Bearer KEY`
 *   (grpc.health.v1.Health/Check stays open, for load balancers; ClusterStatus, an admin
 *   call, wants a key flagged admin: PERMISSION_DENIED for another), a control server's
 *   (authenticate, on the whole request: the signature covers it) checks the tandem-cluster-auth signature of every
 *   call but Health/Check (Kubernetes' gRPC probes; it tells only SERVING or not). A refused call ends UNAUTHENTICATED before its request is unpacked;
 * - signing for its gRPC channels to other members (td_grpc_channel_config_t.sign);
 * - the check the HTTP front door calls (td_node_auth_check_key);
 * - tandem_auth_api_key_total{outcome} and tandem_auth_cluster_total{outcome} on /metrics;
 * - SIGHUP: the API keys file read again (a bad file keeps the keys in force, logged).
 *
 * Without a file the matching check is off (no gate, no signature), as before issue 15.
 * Threads: the process's loop thread. Nothing here logs a key or the secret.
 */
#ifndef TD_NODE_AUTH_H
#define TD_NODE_AUTH_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "td_auth.h"
#include "td_rate.h"
#include "td_grpc.h"
#include "td_metrics.h"
#include "td_status.h"

#define TD_NODE_AUTH_ROUTER "router" /* the audience of calls to a router */
#define TD_NODE_AUTH_HEALTH_CHECK "/grpc.health.v1.Health/Check" /* open on every server: probes
                                        (load balancers, Kubernetes) carry no key or signature */
#define TD_NODE_AUTH_CLUSTER_STATUS "/tandem.v1.Generation/ClusterStatus" /* the gateway's admin
                                        call: with API keys, only a key flagged admin (PERMISSION_DENIED
                                        for another); Drain is a node's control call (the secret) */

typedef struct td_node_auth {
    const char *prog;                                   /* for logs */
    char audience[TD_AUTH_AUDIENCE_MAX];                /* this process: its node id, or "router" */
    td_auth_keys_t *keys;                               /* NULL: no API keys required */
    td_auth_cluster_t *cluster;                         /* NULL: control plane open */
    td_metric_t *key_outcomes[TD_AUTH_N_OUTCOMES];      /* tandem_auth_api_key_total{outcome} */
    td_metric_t *cluster_outcomes[TD_AUTH_N_OUTCOMES];  /* tandem_auth_cluster_total{outcome} */
    td_metric_t *rate_limited;                          /* tandem_auth_api_key_rate_limited_total */
    td_rate_t *rates;                                   /* [n_rates] a bucket per key (rate=R), by
                                                         * its place; reset when the keys reload */
    size_t n_rates;
    uint64_t rates_generation;                          /* td_auth_keys_generation they are for */
    uv_signal_t sighup;
    bool sighup_up;
    struct {                /* control refusals logged lately, by "method: reason" */
        char line[256];
        int64_t ms;
    } refusals[8];
} td_node_auth_t;

/*
 * Loads keys_file (may be NULL) and secret_file (may be NULL) into *a (zeroed); control
 * calls this process accepts must be signed for `audience` (a node: its node id; the
 * router: TD_NODE_AUTH_ROUTER). Errors (those of td_auth_keys_load / td_auth_cluster_load,
 * logged naming the file; TD_ERR_INVALID for an audience over TD_AUTH_AUDIENCE_MAX - 1
 * bytes): nothing is kept.
 */
td_status_t td_node_auth_load(td_node_auth_t *a, const char *prog, const char *audience, const char *keys_file,
                              const char *secret_file);

/* Registers the counters in `metrics` and, with API keys, watches SIGHUP on `loop`.
 * Errors: those of td_metrics_counter_each. */
td_status_t td_node_auth_serve(td_node_auth_t *a, uv_loop_t *loop, td_metrics_t *metrics);

/* Stops watching SIGHUP (shutdown). */
void td_node_auth_close(td_node_auth_t *a);

/* Frees keys and secret. Repeatable. */
void td_node_auth_free(td_node_auth_t *a);

/* Sets gc's gate for a front door (API keys); without keys clears it. */
void td_node_auth_guard_gateway(td_node_auth_t *a, td_grpc_server_config_t *gc);

/* Sets gc's gate for a control server (cluster secret); without a secret clears it. */
void td_node_auth_guard_control(td_node_auth_t *a, td_grpc_server_config_t *gc);

/* With a secret (cluster non-NULL), makes cc sign every call with a signer of its own, for
 * `audience` (the node id of the node the channel reaches, or TD_NODE_AUTH_ROUTER).
 * Errors: TD_ERR_INVALID (audience), TD_ERR_NOMEM, TD_ERR_IO (no randomness); cc untouched
 * then. */
td_status_t td_node_auth_sign_channel(td_auth_cluster_t *cluster, const char *audience, td_grpc_channel_config_t *cc);

/* Makes cc sign every call with `signer`, which the caller owns and keeps past the channel
 * (a node's one signer toward the router: its channels come and go, its sender id stays). */
void td_node_auth_sign_channel_with(td_auth_signer_t *signer, td_grpc_channel_config_t *cc);

/* The HTTP front door's check of an Authorization header value (NULL: absent), counted
 * in tandem_auth_api_key_total. TD_AUTH_OK too when no keys are configured (not counted). */
td_auth_outcome_t td_node_auth_check_key(td_node_auth_t *a, const char *authorization);

/* td_node_auth_check_key, and *props_p: the matched key's flags (all zero without keys or
 * unless TD_AUTH_OK). */
td_auth_outcome_t td_node_auth_check_key_props(td_node_auth_t *a, const char *authorization,
                                               td_auth_key_props_t *props_p);

/*
 * A request of the key `props` describes (as a check returned them) against its rate=R: true
 * when its bucket (R a second, bursts of max(1, R)) had a token, or the key has no rate;
 * false with *retry_ms_p (>= 1) until it will, counted in
 * tandem_auth_api_key_rate_limited_total. The buckets are the front doors' one set (the
 * gateway's gate takes from them too) and start full again when the keys reload. Loop
 * thread. Out of memory for the buckets: false, *retry_ms_p 1000.
 */
bool td_node_auth_take_rate(td_node_auth_t *a, const td_auth_key_props_t *props, int64_t *retry_ms_p);

#endif /* TD_NODE_AUTH_H */
