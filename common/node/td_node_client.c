/*
 * td_node_client: register + heartbeat loop of a node (see td_node_client.h).
 */
#include "td_node_client.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control.pb-c.h"
#include "td_grpc.h"
#include "td_log.h"
#include "td_node_auth.h"
#include "td_util.h"

struct td_node_client {
    uv_loop_t *loop;
    td_node_client_config_t cfg;
    char router_host[64];      /* as configured: an IP address or a name */
    char router_ip[64];        /* the address the channel connects to (a name: its last lookup) */
    bool router_named;         /* router_host is a name: looked up again for every new channel */
    bool ip_fresh;             /* router_ip was looked up for the next channel */
    bool resolving;            /* a lookup in flight (gai) */
    bool resolve_failed_logged;
    bool timer_closed;
    uv_getaddrinfo_t gai;
    uint8_t *xfer_desc;
    td_node_load_cb load_cb;
    void *data;
    td_grpc_channel_t *ch;
    uv_timer_t timer;
    uint64_t epoch;
    uint32_t interval_ms;
    bool registered;
    bool closing;
    bool call_inflight;
    bool draining;             /* td_node_client_drain: heartbeats say so, no new registration */
    bool drain_told;           /* a heartbeat carrying draining succeeded */
    bool hb_draining;          /* the heartbeat in flight carries draining */
    bool hb_reregister;        /* the heartbeat in flight was answered "reregister" */
    bool refused_logged;       /* the router's refusal was logged (until a registration succeeds) */
    uint32_t backoff_ms;       /* the next wait after a failure: retry_ms, doubled per failure in a
                                  row up to TD_NODE_CLIENT_MAX_BACKOFF_MS, reset by a registration */
    /* one signer for the process's life (with a cluster secret): every channel to the router
       signs as the same sender, so a node that reconnects or is refused over and over takes
       one entry of the router's replay table, not one per attempt */
    td_auth_signer_t signer;
};

/* The longest wait between registration attempts after failures in a row. */
#define TD_NODE_CLIENT_MAX_BACKOFF_MS 2000u

static void schedule(td_node_client_t *c, uint32_t ms);

static void drop_channel(td_node_client_t *c)
{
    if (c->ch) {
        td_grpc_channel_t *ch = c->ch;
        c->ch = NULL;
        td_grpc_channel_close(ch, NULL, NULL);
    }
}

/* The registration is gone (c->registered was true): the node hears it once, with why. */
static void forgotten(td_node_client_t *c, const char *why)
{
    c->registered = false;
    c->epoch = 0;
    if (c->cfg.forgotten && !c->closing)
        c->cfg.forgotten(c->data, why);
}

static void fail(td_node_client_t *c, const char *what, const char *msg)
{
    bool was = c->registered;
    if (was)
        td_warn("node %s: %s failed (%s); %s", c->cfg.info.id, what, msg,
                c->draining ? "draining: not registering again" : "registering again");
    c->registered = false;
    c->epoch = 0;
    drop_channel(c);
    if (!c->closing && !c->draining) {
        schedule(c, c->backoff_ms);
        c->backoff_ms = TD_MIN(c->backoff_ms * 2, TD_MAX(TD_NODE_CLIENT_MAX_BACKOFF_MS, c->cfg.retry_ms));
    }
    if (was) { /* last: the node's callback sees the client as it stays */
        char why[256];
        snprintf(why, sizeof why, "its %s failed (%s): the registration is let go", what, msg);
        forgotten(c, why);
    }
}

static void on_register_msg(td_grpc_client_call_t *call, const ProtobufCMessage *msg, void *data)
{
    td_node_client_t *c = data;
    const Tandem__Control__V1__RegisterResponse *r = (const void *)msg;
    c->epoch = r->epoch;
    c->interval_ms = r->heartbeat_interval_ms ? r->heartbeat_interval_ms : 500;
}

static void on_register_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *message, void *data)
{
    td_node_client_t *c = data;
    c->call_inflight = false;
    if (c->closing)
        return;
    if ((code == TD_GRPC_INVALID_ARGUMENT || code == TD_GRPC_UNAUTHENTICATED) && !c->refused_logged) {
        /* a refusal, not a lost router: said once; it registers again in case it changes */
        td_log(TD_LOG_ERROR, "node %s: the router refused its registration: %s", c->cfg.info.id, message);
        c->refused_logged = true;
    }
    if (code != TD_GRPC_OK || !c->epoch) {
        fail(c, "register", code != TD_GRPC_OK ? message : "no epoch");
        return;
    }
    c->refused_logged = false;
    c->backoff_ms = c->cfg.retry_ms;
    if (!c->registered)
        td_info("node %s: registered with router %s:%u (%s, epoch %llu)", c->cfg.info.id, c->router_host,
                c->cfg.router_port, c->router_ip, (unsigned long long)c->epoch);
    c->registered = true;
    schedule(c, c->interval_ms);
}

static void on_heartbeat_msg(td_grpc_client_call_t *call, const ProtobufCMessage *msg, void *data)
{
    td_node_client_t *c = data;
    if (((const Tandem__Control__V1__HeartbeatResponse *)msg)->reregister)
        c->hb_reregister = true;
}

static void on_heartbeat_done(td_grpc_client_call_t *call, td_grpc_code_t code, const char *message, void *data)
{
    td_node_client_t *c = data;
    c->call_inflight = false;
    bool reregister = c->hb_reregister;
    c->hb_reregister = false;
    if (c->closing)
        return;
    if (code != TD_GRPC_OK) {
        fail(c, "heartbeat", message);
        return;
    }
    if (reregister) { /* the router forgot us */
        if (!c->draining)
            schedule(c, 0);
        forgotten(c, "the router answered its heartbeat \"reregister\": it dropped the node");
        return;
    }
    if (c->hb_draining && !c->drain_told) {
        c->drain_told = true;
        td_info("node %s: the router knows it drains", c->cfg.info.id);
    }
    schedule(c, c->draining && !c->drain_told ? 0 : c->interval_ms);
}

static bool ensure_channel(td_node_client_t *c)
{
    if (c->ch && td_grpc_channel_is_usable(c->ch))
        return true;
    drop_channel(c);
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    c->ip_fresh = false; /* a later channel looks the name up again */
    if (c->cfg.cluster) /* the signer was made with the client */
        td_node_auth_sign_channel_with(&c->signer, &cc);
    return td_grpc_channel_create(c->loop, c->router_ip, c->cfg.router_port, &cc, &c->ch) == TD_OK;
}

static void send_register(td_node_client_t *c)
{
    const td_node_info_t *in = &c->cfg.info;
    Tandem__Control__V1__KvLayout lay = TANDEM__CONTROL__V1__KV_LAYOUT__INIT;
    lay.model_fingerprint = in->layout.model_fingerprint;
    lay.dtype = in->layout.dtype;
    lay.block_size = in->layout.block_size;
    lay.n_layers = in->layout.n_layers;
    lay.n_kv_heads = in->layout.n_kv_heads;
    lay.head_dim = in->layout.head_dim;
    lay.version = in->layout.version;
    Tandem__Control__V1__Capacity cap = TANDEM__CONTROL__V1__CAPACITY__INIT;
    cap.total_kv_blocks = (uint32_t)in->capacity_blocks;
    cap.max_batch = (uint32_t)in->max_batch;
    cap.max_prefill_tokens = c->cfg.max_prefill_tokens;
    cap.max_seq_len = (uint32_t)in->max_seq_len;
    cap.vocab_size = (uint32_t)in->vocab_size;
    uint32_t eos[TD_NODE_MAX_EOS];
    for (int32_t i = 0; i < in->n_eos && i < TD_NODE_MAX_EOS; i++)
        eos[i] = (uint32_t)in->eos_ids[i];
    cap.n_eos_ids = (size_t)TD_MAX(TD_MIN(in->n_eos, TD_NODE_MAX_EOS), 0);
    cap.eos_ids = eos;
    Tandem__Control__V1__RegisterRequest req = TANDEM__CONTROL__V1__REGISTER_REQUEST__INIT;
    req.node_id = (char *)in->id;
    req.role = in->role == TD_NODE_ROLE_DECODE    ? TANDEM__CONTROL__V1__ROLE__ROLE_DECODE
               : in->role == TD_NODE_ROLE_UNIFIED ? TANDEM__CONTROL__V1__ROLE__ROLE_UNIFIED
                                                  : TANDEM__CONTROL__V1__ROLE__ROLE_PREFILL;
    req.model = (char *)in->model;
    req.layout = &lay;
    req.control_address = (char *)in->address;
    req.ucx_worker_address.data = c->xfer_desc;
    req.ucx_worker_address.len = c->cfg.xfer_desc_len;
    req.capacity = &cap;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__register_response__descriptor,
                             .on_message = on_register_msg, .on_done = on_register_done, .data = c,
                             .timeout_ms = c->cfg.rpc_timeout_ms};
    c->epoch = 0;
    if (td_grpc_channel_call(c->ch, "/tandem.control.v1.Registry/RegisterNode", &req.base, &o, NULL) != TD_OK)
        fail(c, "register", td_last_error());
    else
        c->call_inflight = true;
}

static void send_heartbeat(td_node_client_t *c)
{
    td_node_load_t l = {0};
    c->load_cb(c->data, &l);
    Tandem__Control__V1__Load load = TANDEM__CONTROL__V1__LOAD__INIT;
    load.queued_prefill_tokens = (uint64_t)(l.queued_prefill_tokens > 0 ? l.queued_prefill_tokens : 0);
    load.running_sequences = (uint32_t)(l.running_seqs > 0 ? l.running_seqs : 0);
    load.free_kv_blocks = (uint32_t)(l.free_blocks > 0 ? l.free_blocks : 0);
    float step_s = (float)(l.step_ms * 1e-3);
    load.recent_step_s = &step_s;
    load.n_recent_step_s = 1;
    load.prefill_tokens_per_s = (float)l.prefill_tok_s;
    load.tpot_objective_s = (float)l.tpot_objective_s;
    load.step_spread_s = (float)l.step_spread_s;
    load.draining = c->draining;
    c->hb_draining = c->draining;
    Tandem__Control__V1__HeartbeatRequest req = TANDEM__CONTROL__V1__HEARTBEAT_REQUEST__INIT;
    req.node_id = (char *)c->cfg.info.id;
    req.epoch = c->epoch;
    req.load = &load;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__heartbeat_response__descriptor,
                             .on_message = on_heartbeat_msg, .on_done = on_heartbeat_done, .data = c,
                             .timeout_ms = c->cfg.rpc_timeout_ms};
    if (td_grpc_channel_call(c->ch, "/tandem.control.v1.Registry/Heartbeat", &req.base, &o, NULL) != TD_OK)
        fail(c, "heartbeat", td_last_error());
    else
        c->call_inflight = true;
}

static void free_client(td_node_client_t *c)
{
    free(c->xfer_desc);
    free(c);
}

/* A router given by name (a Kubernetes Service, a DNS entry) is looked up off the loop
 * before each new channel, so a router that comes back at another address is found. */
static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    td_node_client_t *c = req->data;
    c->resolving = false;
    const struct addrinfo *a = res; /* IPv4 first (td_xfer's data plane is IPv4), else IPv6 */
    while (a && a->ai_family != AF_INET)
        a = a->ai_next;
    for (a = a ? a : res; a && a->ai_family != AF_INET && a->ai_family != AF_INET6;)
        a = a->ai_next;
    if (status == 0 && a) {
        if (a->ai_family == AF_INET)
            uv_ip4_name((const struct sockaddr_in *)a->ai_addr, c->router_ip, sizeof c->router_ip);
        else
            uv_ip6_name((const struct sockaddr_in6 *)a->ai_addr, c->router_ip, sizeof c->router_ip);
        c->ip_fresh = true;
        c->resolve_failed_logged = false;
    } else if (!c->closing && !c->resolve_failed_logged) {
        td_warn("node %s: router %s does not resolve (%s); trying again every %u ms", c->cfg.info.id, c->router_host,
                status ? uv_strerror(status) : "no IPv4 or IPv6 address", c->cfg.retry_ms);
        c->resolve_failed_logged = true;
    }
    uv_freeaddrinfo(res);
    if (c->closing) {
        if (c->timer_closed)
            free_client(c);
        return;
    }
    schedule(c, c->ip_fresh ? 0 : c->cfg.retry_ms);
}

static void on_timer(uv_timer_t *t)
{
    td_node_client_t *c = t->data;
    if (c->closing || c->call_inflight || c->resolving)
        return;
    if (c->router_named && !c->ip_fresh && !(c->ch && td_grpc_channel_is_usable(c->ch))) {
        struct addrinfo hints = {.ai_socktype = SOCK_STREAM};
        char port[8];
        snprintf(port, sizeof port, "%u", c->cfg.router_port);
        c->gai.data = c;
        int rc = uv_getaddrinfo(c->loop, &c->gai, on_resolved, c->router_host, port, &hints);
        if (rc == 0)
            c->resolving = true;
        else
            schedule(c, c->cfg.retry_ms);
        return;
    }
    if (!ensure_channel(c)) {
        schedule(c, c->cfg.retry_ms);
        return;
    }
    if (c->registered)
        send_heartbeat(c);
    else if (!c->draining)
        send_register(c);
}

static void schedule(td_node_client_t *c, uint32_t ms)
{
    uv_timer_start(&c->timer, on_timer, ms, 0);
}

td_status_t td_node_client_create(uv_loop_t *loop, const td_node_client_config_t *cfg,
                                      td_node_load_cb load_cb, void *data, td_node_client_t **c_p)
{
    if (!cfg->router_host || strlen(cfg->router_host) >= 64 || !load_cb || !cfg->info.id[0])
        return td_errorf(TD_ERR_INVALID, "node client: router address, node id and load callback are required");
    td_node_client_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_errorf(TD_ERR_NOMEM, "node client: out of memory");
    c->loop = loop;
    c->cfg = *cfg;
    strcpy(c->router_host, cfg->router_host);
    c->cfg.router_host = c->router_host;
    const char *ip = strcmp(cfg->router_host, "localhost") ? cfg->router_host : "127.0.0.1";
    struct sockaddr_in a4;
    struct sockaddr_in6 a6;
    c->router_named = uv_ip4_addr(ip, 0, &a4) != 0 && uv_ip6_addr(ip, 0, &a6) != 0;
    snprintf(c->router_ip, sizeof c->router_ip, "%s", c->router_named ? "" : ip);
    if (!c->cfg.info.max_seq_len)
        c->cfg.info.max_seq_len = (int32_t)TD_MIN(cfg->max_seq_len, (uint32_t)INT32_MAX);
    if (!c->cfg.rpc_timeout_ms)
        c->cfg.rpc_timeout_ms = 2000;
    if (!c->cfg.retry_ms)
        c->cfg.retry_ms = 200;
    c->backoff_ms = c->cfg.retry_ms;
    if (cfg->cluster) {
        td_status_t st = td_auth_signer_init(&c->signer, cfg->cluster, TD_NODE_AUTH_ROUTER);
        if (st != TD_OK) {
            free(c);
            return st;
        }
    }
    if (cfg->xfer_desc_len) {
        if (!(c->xfer_desc = malloc(cfg->xfer_desc_len))) {
            free(c);
            return td_errorf(TD_ERR_NOMEM, "node client: out of memory");
        }
        memcpy(c->xfer_desc, cfg->xfer_desc, cfg->xfer_desc_len);
    }
    c->load_cb = load_cb;
    c->data = data;
    uv_timer_init(loop, &c->timer);
    c->timer.data = c;
    schedule(c, 0);
    *c_p = c;
    return TD_OK;
}

void td_node_client_drain(td_node_client_t *c)
{
    if (!c || c->draining || c->closing)
        return;
    c->draining = true;
    if (c->registered && !c->call_inflight)
        schedule(c, 0);
    /* a call in flight: its completion schedules the next heartbeat, which says it */
}

bool td_node_client_drain_told(const td_node_client_t *c)
{
    return !c || !c->registered || c->drain_told;
}

bool td_node_client_registered(const td_node_client_t *c)
{
    return c && c->registered;
}

static void on_timer_closed(uv_handle_t *h)
{
    td_node_client_t *c = h->data;
    c->timer_closed = true;
    if (!c->resolving) /* else on_resolved frees it (cancelled) */
        free_client(c);
}

bool td_node_client_router_ip(const td_node_client_t *c, struct sockaddr_storage *addr_p)
{
    if (!c || !c->router_ip[0])
        return false;
    return uv_ip4_addr(c->router_ip, 0, (struct sockaddr_in *)addr_p) == 0 ||
           uv_ip6_addr(c->router_ip, 0, (struct sockaddr_in6 *)addr_p) == 0;
}

void td_node_client_close(td_node_client_t *c)
{
    if (!c)
        return;
    c->closing = true;
    drop_channel(c); /* ends an in-flight call with CANCELLED; its callback sees closing */
    if (c->resolving)
        uv_cancel((uv_req_t *)&c->gai); /* on_resolved runs (UV_EAI_CANCELED) and frees */
    uv_close((uv_handle_t *)&c->timer, on_timer_closed);
}
