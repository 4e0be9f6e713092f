/*
 * td_node_conf: the common keys of the cluster processes, parsed by td_opts (see td_node_conf.h).
 */
#include "td_node_conf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_util.h"

#define TD_NODE_CONF_MAX_KEYS 64

/* The common keys of a node (or of the router) into out[]; returns how many. */
static int common_keys(td_node_config_t *c, bool node, td_opt_t *out)
{
    int n = 0;
    if (node)
        out[n++] = (td_opt_t)TD_OPT_STRING("model", &c->model, "model path (required)");
    out[n++] = (td_opt_t)TD_OPT_STRING("model-name", &c->model_name,
                                       node ? "name the router routes by" : "the model name served");
    if (node)
        out[n++] = (td_opt_t)TD_OPT_STRING("router", &c->router, "router control address HOST:PORT");
    out[n++] = (td_opt_t)TD_OPT_STRING("host", &c->host,
                                       "address to listen on (0.0.0.0: every interface; needs --advertise)");
    out[n++] = (td_opt_t)TD_OPT_STRING("advertise", &c->advertise,
                                       "address peers reach this process at (default: --host)");
    if (node)
        out[n++] = (td_opt_t)TD_OPT_STRING("node-id", &c->node_id, "unique node name");
    out[n++] = (td_opt_t)TD_OPT_INT("port", &c->port, 0, 65535,
                                    node ? "control gRPC port (0 = any)" : "gateway gRPC port (0 = any)");
    out[n++] = (td_opt_t)TD_OPT_INT("metrics-port", &c->metrics_port, 0, 65535, "/metrics port (0 = any)");
    if (node) {
        out[n++] = (td_opt_t)TD_OPT_INT("threads", &c->threads, 0, 4096, "compute threads (0 = all cores)");
        out[n++] = (td_opt_t)TD_OPT_STRING("device", &c->device, "cpu, cuda (GPU 0) or cuda:N");
        out[n++] = (td_opt_t)TD_OPT_STRING("dtype", &c->dtype,
                                           "f32|f16|bf16: weights and KV cache (and CUDA activations); "
                                           "default: cpu: weights as stored, KV f32; cuda: the model's dtype. "
                                           "Paired nodes must agree");
        out[n++] = (td_opt_t)TD_OPT_STRING("quant", &c->quant,
                                           "q8_0|q4_0: quantize an f32/f16/bf16 model's weight matrices at "
                                           "load (CPU); default: as stored. Paired nodes must agree");
        out[n++] = (td_opt_t)TD_OPT_STRING("kv-dtype", &c->kv_dtype,
                                           "f32|f16|bf16|q8_0: the KV cache (q8_0: half of f16's memory, CPU); "
                                           "default: as --dtype. Paired nodes must agree");
        out[n++] = (td_opt_t)TD_OPT_INT("ctx-size", &c->ctx_size, 2, 1 << 26,
                                        "the longest sequence (prompt + output tokens) served, as llama-server's "
                                        "-c: at most the model's length; the KV pools are sized from it. "
                                        "Default: the model's length");
        out[n++] = (td_opt_t)TD_OPT_INT("drain-timeout-ms", &c->drain_timeout_ms, 1, 86400000,
                                        "SIGTERM or a Drain call: the node takes no new request and exits once "
                                        "its running ones finish, or after this long");
    }
    out[n++] = (td_opt_t)TD_OPT_STRING("cluster-secret-file", &c->cluster_secret_file,
                                       "file holding the secret the router and its nodes share; every control "
                                       "call is signed with it (docs/security.md); default: none, open");
    out[n++] = (td_opt_t){.name = "insecure", .type = TD_OPT_BOOL, .ptr = &c->insecure,
                          .help = "run with no --cluster-secret-file on a --host other than loopback: the "
                                  "control plane is then open to anyone who reaches it (warned at every "
                                  "start); without it such a start is refused"};
    if (!node)
        out[n++] = (td_opt_t)TD_OPT_STRING("api-keys-file", &c->api_keys_file,
                                           "API keys the gateway and HTTP API require (one a line, # comments; "
                                           "reloaded on SIGHUP); default: none, open");
    out[n++] = (td_opt_t)TD_OPT_STRING("log-level", &c->log_level, "error|warn|info|debug");
    out[n++] = (td_opt_t){.name = "check-config", .type = TD_OPT_BOOL, .ptr = &c->check_config,
                          .help = "check the flags and the --config file (keys, values, addresses), print "
                                  "'config ok' and exit 0 (2 when bad) without starting: deploy files, "
                                  "systemd ExecStartPre"};
    return n;
}

td_status_t td_node_conf_parse(const char *prog, td_node_config_t *c, bool node, const td_opt_t *keys,
                               int n_keys, int argc, char **argv, td_opts_result_t *r)
{
    td_opt_t all[TD_NODE_CONF_MAX_KEYS];
    int n = common_keys(c, node, all);
    TD_ASSERT(n + n_keys <= TD_NODE_CONF_MAX_KEYS);
    memcpy(all + n, keys, (size_t)n_keys * sizeof *keys);
    n += n_keys;
    td_opts_t spec = {.prog = prog, .opts = all, .n_opts = n, .config_file = true};
    td_status_t st = td_opts_parse(&spec, argc, argv, r);
    if (st == TD_OK && r->help) {
        printf("usage: tandem %s [--config FILE] [--key VALUE]...\n\n", prog);
        td_opts_usage(stdout, all, n, true);
        printf("\nEvery key can also be given as 'key = value' in the --config file; flags win.\n");
    }
    return st;
}

td_status_t td_node_conf_split_addr(const char *addr, char *host, size_t cap, uint16_t *port_p)
{
    const char *colon = addr ? strrchr(addr, ':') : NULL;
    if (!colon || colon == addr || (size_t)(colon - addr) >= cap)
        return td_errorf(TD_ERR_INVALID, "address '%s' is not HOST:PORT", addr ? addr : "");
    int64_t port;
    if (td_parse_i64(colon + 1, 1, 65535, "port", &port) != TD_OK)
        return TD_ERR_INVALID;
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = '\0';
    *port_p = (uint16_t)port;
    return TD_OK;
}
