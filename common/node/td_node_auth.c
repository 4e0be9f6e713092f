/*
 * td_node_auth: API keys and the cluster secret of a cluster process (see td_node_auth.h).
 */
#include "td_node_auth.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_util.h"

#define REFUSAL_LOG_MS 10000 /* the same refusal (method and reason, any peer) is logged again
                                after this long: a node retrying every 200 ms is one line */

td_status_t td_node_auth_load(td_node_auth_t *a, const char *prog, const char *audience, const char *keys_file,
                              const char *secret_file)
{
    a->prog = prog;
    if (strlen(audience) >= sizeof a->audience)
        return td_errorf(TD_ERR_INVALID, "%s: node id '%s' is over %zu bytes", prog, audience, sizeof a->audience - 1);
    strcpy(a->audience, audience);
    td_status_t st;
    if (keys_file && (st = td_auth_keys_load(keys_file, &a->keys)) != TD_OK)
        return st;
    td_auth_cluster_config_t cc = td_auth_cluster_config_default();
    if (secret_file && (st = td_auth_cluster_load(secret_file, &cc, &a->cluster)) != TD_OK) {
        td_auth_keys_destroy(a->keys);
        a->keys = NULL;
        return st;
    }
    if (a->keys)
        td_info("%s: %zu api keys from %s", prog, td_auth_keys_count(a->keys), keys_file);
    if (a->cluster)
        td_info("%s: control plane signed with the cluster secret of %s", prog, secret_file);
    return TD_OK;
}

static void on_sighup(uv_signal_t *h, int signum)
{
    td_node_auth_t *a = h->data;
    if (td_auth_keys_reload(a->keys) == TD_OK)
        td_info("%s: api keys reloaded from %s: %zu keys", a->prog, td_auth_keys_path(a->keys),
                td_auth_keys_count(a->keys));
    else
        td_warn("%s: api keys file %s not reloaded (above); the keys loaded before stay in force (%zu)", a->prog,
                td_auth_keys_path(a->keys), td_auth_keys_count(a->keys));
}

td_status_t td_node_auth_serve(td_node_auth_t *a, uv_loop_t *loop, td_metrics_t *metrics)
{
    static const char *const outcomes[TD_AUTH_N_OUTCOMES] = {"ok", "missing", "wrong"};
    td_status_t st;
    if (a->keys && !a->key_outcomes[0] &&
        (st = td_metrics_counter_each(metrics, "tandem_auth_api_key_total",
                                      "Front-door requests by the API key they presented", "outcome", outcomes,
                                      TD_AUTH_N_OUTCOMES, a->key_outcomes)) != TD_OK)
        return st;
    const td_metric_def_t rl = TD_METRIC_DEF_COUNTER("tandem_auth_api_key_rate_limited_total",
                                                     "Front-door requests refused by their API key's rate limit "
                                                     "(rate=R)", &a->rate_limited);
    if (a->keys && !a->rate_limited && (st = td_metrics_register_all(metrics, &rl, 1)) != TD_OK)
        return st;
    if (a->cluster && !a->cluster_outcomes[0] &&
        (st = td_metrics_counter_each(metrics, "tandem_auth_cluster_total",
                                      "Control calls received by the cluster signature they carried", "outcome",
                                      outcomes, TD_AUTH_N_OUTCOMES, a->cluster_outcomes)) != TD_OK)
        return st;
    if (a->keys && !a->sighup_up) {
        uv_signal_init(loop, &a->sighup);
        a->sighup.data = a;
        uv_signal_start(&a->sighup, on_sighup, SIGHUP);
        uv_unref((uv_handle_t *)&a->sighup); /* it never keeps the loop alive */
        a->sighup_up = true;
    }
    return TD_OK;
}

void td_node_auth_close(td_node_auth_t *a)
{
    if (a->sighup_up) {
        uv_close((uv_handle_t *)&a->sighup, NULL);
        a->sighup_up = false;
    }
}

void td_node_auth_free(td_node_auth_t *a)
{
    free(a->rates);
    a->rates = NULL;
    a->n_rates = 0;
    td_auth_keys_destroy(a->keys);
    a->keys = NULL;
    td_auth_cluster_destroy(a->cluster);
    a->cluster = NULL;
}

static void count(td_metric_t *const *series, td_auth_outcome_t o)
{
    if (series[o])
        td_metric_inc(series[o]);
}

/* The gateway's gate, on the headers: an unauthenticated call costs no buffering. */
static td_grpc_code_t gateway_gate(td_grpc_call_t *call, void *data, char *why, size_t cap)
{
    td_node_auth_t *a = data;
    if (!strcmp(td_grpc_call_method(call), TD_NODE_AUTH_HEALTH_CHECK))
        return TD_GRPC_OK;
    td_auth_key_props_t kp;
    td_auth_outcome_t o = td_auth_keys_check_bearer_props(a->keys, td_grpc_call_header(call, "authorization"), &kp);
    count(a->key_outcomes, o);
    if (o != TD_AUTH_OK) {
        snprintf(why, cap, o == TD_AUTH_MISSING ? "an API key is required: send metadata authorization: Bearer KEY"
                                                : "the API key is not valid");
        return TD_GRPC_UNAUTHENTICATED;
    }
    if (!kp.admin && !strcmp(td_grpc_call_method(call), TD_NODE_AUTH_CLUSTER_STATUS)) {
        snprintf(why, cap, "%s is an admin call (it shows the cluster's nodes and their addresses): use a key whose "
                 "line in the API keys file is 'KEY admin'", TD_NODE_AUTH_CLUSTER_STATUS);
        return TD_GRPC_PERMISSION_DENIED;
    }
    int64_t retry_ms;
    if (!td_node_auth_take_rate(a, &kp, &retry_ms)) {
        snprintf(why, cap, "the API key's rate limit (%g requests a second) is reached: retry in %lld ms", kp.rate,
                 (long long)retry_ms);
        return TD_GRPC_RESOURCE_EXHAUSTED;
    }
    return TD_GRPC_OK;
}

bool td_node_auth_take_rate(td_node_auth_t *a, const td_auth_key_props_t *props, int64_t *retry_ms_p)
{
    if (!a->keys || props->rate <= 0)
        return true;
    size_t n = td_auth_keys_count(a->keys);
    uint64_t gen = td_auth_keys_generation(a->keys);
    if (!a->rates || a->n_rates != n || a->rates_generation != gen) { /* new keys: every bucket full */
        free(a->rates);
        a->n_rates = 0;
        if (!(a->rates = calloc(n, sizeof *a->rates))) {
            *retry_ms_p = 1000;
            return false;
        }
        a->n_rates = n;
        a->rates_generation = gen;
    }
    if (props->index >= a->n_rates)
        return true; /* not a place of these keys (props from before a reload) */
    double burst = props->rate > 1 ? props->rate : 1;
    if (td_rate_take(&a->rates[props->index], props->rate, burst, (int64_t)td_now_ns(), retry_ms_p))
        return true;
    if (a->rate_limited)
        td_metric_inc(a->rate_limited);
    return false;
}

/* Logs a refused control call: each new reason at once, a repeat at most every
 * REFUSAL_LOG_MS, so a flood of forgeries costs no disk. */
static void log_refusal(td_node_auth_t *a, td_grpc_call_t *call, const char *why)
{
    char peer[64] = "?";
    struct sockaddr_storage ss;
    if (td_grpc_call_peer(call, &ss) == TD_OK) {
        char ip[48];
        uint16_t port;
        if (ss.ss_family == AF_INET6) {
            uv_ip6_name((const struct sockaddr_in6 *)&ss, ip, sizeof ip);
            port = ntohs(((const struct sockaddr_in6 *)&ss)->sin6_port);
            snprintf(peer, sizeof peer, "[%s]:%u", ip, port);
        } else {
            uv_ip4_name((const struct sockaddr_in *)&ss, ip, sizeof ip);
            port = ntohs(((const struct sockaddr_in *)&ss)->sin_port);
            snprintf(peer, sizeof peer, "%s:%u", ip, port);
        }
    }
    char line[sizeof a->refusals[0].line];
    snprintf(line, sizeof line, "%s: %s", td_grpc_call_method(call), why);
    int64_t now = td_auth_now_ms();
    int slot = 0; /* the same line's, else the oldest */
    for (int i = 0; i < (int)TD_ARRAY_LEN(a->refusals); i++) {
        if (!strcmp(a->refusals[i].line, line)) {
            slot = i;
            break;
        }
        if (a->refusals[i].ms < a->refusals[slot].ms)
            slot = i;
    }
    if (strcmp(a->refusals[slot].line, line) || now - a->refusals[slot].ms >= REFUSAL_LOG_MS) {
        td_warn("%s: %s from %s refused (cluster authentication): %s", a->prog, td_grpc_call_method(call), peer, why);
        memcpy(a->refusals[slot].line, line, sizeof line);
        a->refusals[slot].ms = now;
    }
}

static td_grpc_code_t control_gate(td_grpc_call_t *call, const void *request, size_t len, void *data, char *why,
                                   size_t cap)
{
    td_node_auth_t *a = data;
    if (!strcmp(td_grpc_call_method(call), TD_NODE_AUTH_HEALTH_CHECK))
        return TD_GRPC_OK; /* SERVING or not, nothing more: Kubernetes' probes cannot sign */
    char reason[200];
    td_auth_outcome_t o = td_auth_verify(a->cluster, td_auth_now_ms(), a->audience, td_grpc_call_method(call),
                                         td_grpc_call_header(call, TD_AUTH_HEADER), request, len, reason,
                                         sizeof reason);
    count(a->cluster_outcomes, o);
    if (o == TD_AUTH_OK)
        return TD_GRPC_OK;
    log_refusal(a, call, reason);
    snprintf(why, cap, "cluster authentication failed: %s", reason);
    return TD_GRPC_UNAUTHENTICATED;
}

void td_node_auth_guard_gateway(td_node_auth_t *a, td_grpc_server_config_t *gc)
{
    gc->authenticate = NULL;
    gc->authenticate_head = a->keys ? gateway_gate : NULL;
    gc->auth_data = a->keys ? a : NULL;
}

void td_node_auth_guard_control(td_node_auth_t *a, td_grpc_server_config_t *gc)
{
    gc->authenticate = a->cluster ? control_gate : NULL;
    gc->authenticate_head = NULL;
    gc->auth_data = a->cluster ? a : NULL;
}

static td_status_t sign_call(void *data, const char *method, const void *request, size_t len, char *value,
                             size_t cap)
{
    return td_auth_sign(data, td_auth_now_ms(), method, request, len, value, cap);
}

td_status_t td_node_auth_sign_channel(td_auth_cluster_t *cluster, const char *audience, td_grpc_channel_config_t *cc)
{
    if (!cluster)
        return TD_OK;
    td_auth_signer_t *s = malloc(sizeof *s);
    if (!s)
        return td_errorf(TD_ERR_NOMEM, "cluster auth: out of memory for a signer");
    td_status_t st = td_auth_signer_init(s, cluster, audience);
    if (st != TD_OK) {
        free(s);
        return st;
    }
    cc->sign_header = TD_AUTH_HEADER;
    cc->sign = sign_call;
    cc->sign_data = s;
    cc->sign_free = free;
    return TD_OK;
}

void td_node_auth_sign_channel_with(td_auth_signer_t *signer, td_grpc_channel_config_t *cc)
{
    cc->sign_header = TD_AUTH_HEADER;
    cc->sign = sign_call;
    cc->sign_data = signer;
    cc->sign_free = NULL;
}

td_auth_outcome_t td_node_auth_check_key(td_node_auth_t *a, const char *authorization)
{
    td_auth_key_props_t kp;
    return td_node_auth_check_key_props(a, authorization, &kp);
}

td_auth_outcome_t td_node_auth_check_key_props(td_node_auth_t *a, const char *authorization,
                                               td_auth_key_props_t *props_p)
{
    *props_p = (td_auth_key_props_t){0};
    if (!a->keys)
        return TD_AUTH_OK;
    td_auth_outcome_t o = td_auth_keys_check_bearer_props(a->keys, authorization, props_p);
    count(a->key_outcomes, o);
    return o;
}
