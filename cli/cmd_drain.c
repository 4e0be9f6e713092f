/*
 * tandem drain: asks a prefill, decode or unified node to drain (tandem.control.v1.Node/Drain,
 * docs/cluster.md "Draining"): it takes no new request, finishes what runs and exits 0, as
 * on SIGTERM. For an operator (or a Kubernetes preStop hook) who holds the cluster secret but
 * not the node's process. The call is signed like every control call, for the node's id.
 * Prints what the node answered; exit 0 once it accepted, 1 when the call failed (the reason
 * with what to do), 2 for bad flags.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "control.pb-c.h"
#include "td_auth.h"
#include "td_cli.h"
#include "td_grpc.h"
#include "td_node_auth.h"
#include "td_node_conf.h"
#include "td_util.h"

typedef struct drain_call {
    const char *node, *id;
    uint32_t requests, timeout_ms;
    bool answered;
    td_grpc_code_t code;
    char message[256];
    td_grpc_channel_t *ch;
} drain_call_t;

static void on_msg(td_grpc_client_call_t *call, const ProtobufCMessage *msg, void *data)
{
    drain_call_t *d = data;
    const Tandem__Control__V1__DrainResponse *r = (const void *)msg;
    d->requests = r->requests;
    d->timeout_ms = r->timeout_ms;
    d->answered = true;
}

static void on_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *message, void *data)
{
    drain_call_t *d = data;
    d->code = code;
    snprintf(d->message, sizeof d->message, "%s", message && message[0] ? message : td_grpc_code_name(code));
    td_grpc_channel_close(d->ch, NULL, NULL); /* the loop ends once it closed */
    d->ch = NULL;
}

int cmd_drain(int argc, char **argv)
{
    const char *node = NULL, *id = NULL, *secret = NULL;
    int64_t timeout_ms = 0, rpc_timeout_ms = 10000;
    const td_opt_t opts[] = {
        {.name = "node", .type = TD_OPT_STR, .ptr = &node, .arg = "HOST:PORT",
         .help = "the node's control address (its banner's `control ADDR`)"},
        {.name = "node-id", .type = TD_OPT_STR, .ptr = &id, .arg = "ID",
         .help = "the node's id (its --node-id): the call is signed for it"},
        {.name = "cluster-secret-file", .type = TD_OPT_STR, .ptr = &secret, .arg = "FILE",
         .help = "the cluster's secret (docs/security.md); without it the call is unsigned,\n"
                 "which only a node without a secret accepts"},
        TD_OPT_INT("timeout-ms", &timeout_ms, 0, UINT32_MAX,
                   "exit after this long even if requests still run (0: the node's\n--drain-timeout-ms; a larger value is not taken)"),
        TD_OPT_INT("rpc-timeout-ms", &rpc_timeout_ms, 1, 600000, "bound of the call itself"),
    };
    td_opts_t spec = {.prog = "drain", .opts = opts, .n_opts = TD_ARRAY_LEN(opts)};
    td_opts_result_t r = {0};
    if (td_opts_parse(&spec, argc, argv, &r) != TD_OK)
        return 2;
    if (r.help) {
        printf("usage: tandem drain --node HOST:PORT --node-id ID [--cluster-secret-file FILE] [--timeout-ms MS]\n"
               "\n"
               "Drains a prefill, decode or unified node (Node/Drain): it takes no new request,\n"
               "the router sends it none, what runs finishes, then it exits 0, as on SIGTERM.\n"
               "Prints the requests still running when the node answered.\n"
               "\n");
        td_opts_usage(stdout, opts, (int)TD_ARRAY_LEN(opts), true);
        return 0;
    }
    char host[256];
    uint16_t port;
    if (!node || !id) {
        fprintf(stderr, "tandem drain: --node HOST:PORT and --node-id ID are required (see --help)\n");
        return 2;
    }
    if (td_node_conf_split_addr(node, host, sizeof host, &port) != TD_OK)
        return 2; /* said why */
    int rc = 1;
    td_auth_cluster_t *cluster = NULL;
    td_auth_cluster_config_t acc = td_auth_cluster_config_default();
    if (secret && td_auth_cluster_load(secret, &acc, &cluster) != TD_OK)
        return 2;
    uv_loop_t loop;
    uv_loop_init(&loop);
    drain_call_t d = {.node = node, .id = id, .code = TD_GRPC_UNKNOWN};
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    if (td_node_auth_sign_channel(cluster, id, &cc) != TD_OK ||
        td_grpc_channel_create(&loop, host, port, &cc, &d.ch) != TD_OK) {
        fprintf(stderr, "tandem drain: %s\n", td_last_error());
        goto out;
    }
    Tandem__Control__V1__DrainRequest req = TANDEM__CONTROL__V1__DRAIN_REQUEST__INIT;
    req.timeout_ms = (uint32_t)timeout_ms;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__drain_response__descriptor,
                             .on_message = on_msg, .on_done = on_done, .data = &d,
                             .timeout_ms = (uint32_t)rpc_timeout_ms};
    if (td_grpc_channel_call(d.ch, "/tandem.control.v1.Node/Drain", &req.base, &o, NULL) != TD_OK) {
        fprintf(stderr, "tandem drain: %s\n", td_last_error());
        td_grpc_channel_close(d.ch, NULL, NULL);
    }
    uv_run(&loop, UV_RUN_DEFAULT); /* every wait is bounded: the call's timeout */
    if (d.code == TD_GRPC_OK && d.answered) {
        printf("node %s (%s): draining, %u requests running; it exits once they finish, %.1f s at most\n", id,
               node, d.requests, d.timeout_ms * 1e-3);
        rc = 0;
    } else if (d.code == TD_GRPC_UNAUTHENTICATED) {
        fprintf(stderr, "tandem drain: node %s refused the call: %s (give the cluster's --cluster-secret-file and the "
                        "node's exact --node-id)\n", node, d.message);
    } else if (d.code == TD_GRPC_UNIMPLEMENTED) {
        fprintf(stderr, "tandem drain: %s does not serve Node/Drain (a router, or a node older than draining): %s\n",
                node, d.message);
    } else if (d.code != TD_GRPC_UNKNOWN || d.message[0]) {
        fprintf(stderr, "tandem drain: %s: %s (is the node running at that control address?)\n", node, d.message);
    }
out:
    uv_run(&loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&loop) != 0)
        fprintf(stderr, "tandem drain: loop closed with handles open\n");
    td_auth_cluster_destroy(cluster);
    return rc;
}
