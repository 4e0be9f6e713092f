/*
 * router_main: the router process (see router_main.h and docs/cluster.md).
 *
 * Everything runs on one libuv loop: the gateway gRPC server (Generation, Health), the
 * OpenAI HTTP API (--http-port, router_http.c; the same requests through another sink), the
 * control server (Registry), one client channel per node, and for each decode node a Steps
 * stream that carries every sequence's new token of one step in one message. A request
 * goes: tokenize → wait in the admission queue (router_queue) until a decode node has room
 * and fewer than max-active requests are on nodes → pick a pair (router_policy) → Admit
 * on the decode node (lease) → Prefill on the prefill node (KV pushed to the lease; its
 * FIRST_TOKEN is relayed at once) → tokens relayed from the decode node's Steps stream
 * (found by a lease map), detokenized, stop strings matched here, one GenerateResponse per
 * request per StepBatch, held in a bounded backlog while the client's stream is full →
 * last message with finish reason, usage and timings. Token 0 arrives twice (Prefill and
 * the lease's first step entry) and is sent once, from whichever comes first. A failure
 * before any token was sent is retried once on another pair; one deadline (the client's
 * grpc-timeout or request-timeout-ms) bounds the queue, Admit, Prefill and decoding;
 * client cancel and deadlines Release the lease. docs/cluster.md, "Router".
 *
 * This file holds the process's life, top to bottom: the loop's tick (nodes that went
 * silent, deadlines), shutdown, the servers' methods and metrics, and router_main (config,
 * subsystems, the loop, teardown). The rest of the router is one file per seam, listed in
 * router_int.h.
 */
#include "router_main.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "health.pb-c.h"
#include "router_int.h"
#include "td_log.h"
#include "td_util.h"

/* ---- main loop --------------------------------------------------------------------------- */

/* Nodes silent past the heartbeat bound: their requests fail over or end UNAVAILABLE. */
static void on_tick(uv_timer_t *t)
{
    router_state_t *s = t->data;
    int64_t now = (int64_t)td_now_ns();
    bool changed = false;
    for (int32_t i = 0; i < router_registry_slots(s->reg); i++) {
        const router_node_t *n = router_registry_node_const(s->reg, i);
        if (n && !router_registry_is_live(s->reg, i, now)) {
            td_warn("router: node %s missed heartbeats; dropped", n->info.id);
            router_node_gone(s, i, "node stopped heartbeating", true);
            changed = true;
        }
    }
    if (changed)
        router_print_nodes(s);
    /* deadlines the gRPC layer does not watch (request-timeout-ms; a client's own
     * grpc-timeout also ends the stream there): in the queue, then on nodes */
    router_queue_entry_t *e;
    while ((e = router_queue_pop_expired(&s->queue, now)))
        router_req_fail(REQ_OF_QE(e), TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded waiting for a decode node with room",
                 "deadline");
    td_metric_set(s->m_queue_depth, router_queue_len(&s->queue));
    TD_LIST_FOREACH_SAFE(it, &s->reqs) {
        router_req_t *r = TD_CONTAINER_OF(it, router_req_t, link);
        if (router_req_on_node(r) && r->deadline_ns && now >= r->deadline_ns)
            router_req_fail(r, TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded", "deadline");
        else if (router_backlog_over(r))
            router_req_fail_slow(r);
    }
}

/* The router's part of shutdown (td_node_shutdown closes /metrics and the signals). */
static void on_shutdown(void *data)
{
    router_state_t *s = data;
    s->shutting_down = true;
    while (!td_list_empty(&s->reqs))
        router_req_fail(TD_CONTAINER_OF(td_list_first(&s->reqs), router_req_t, link), TD_GRPC_UNAVAILABLE,
                        "router shutting down", "unavailable");
    for (int32_t i = 0; s->peers && i < (int32_t)s->cfg.max_nodes; i++)
        router_peer_drop(s, i);
    td_grpc_server_close(s->gateway, NULL, NULL);
    td_grpc_server_close(s->control, NULL, NULL);
    td_http_server_close(s->http, NULL, NULL); /* streams still draining their last bytes end */
    s->gateway = s->control = NULL;
    s->http = NULL;
    if (s->handles_up) {
        uv_close((uv_handle_t *)&s->tick, NULL);
        uv_close((uv_handle_t *)&s->pump_idle, NULL);
        uv_close((uv_handle_t *)&s->turn_prepare, NULL);
    }
}

static void on_turn(uv_prepare_t *h)
{
    router_state_t *s = h->data;
    s->turn++;
}

static td_status_t add_methods(router_state_t *s)
{
    static const td_grpc_method_t gateway[] = {
        {"/tandem.v1.Generation/Generate", &tandem__v1__generate_request__descriptor, on_generate},
        {"/tandem.v1.Generation/ListModels", &tandem__v1__list_models_request__descriptor, on_list_models},
        {"/tandem.v1.Generation/ClusterStatus", &tandem__v1__cluster_status_request__descriptor, on_cluster_status},
        {"/grpc.health.v1.Health/Check", &grpc__health__v1__health_check_request__descriptor, on_health},
    };
    static const td_grpc_method_t control[] = {
        {"/tandem.control.v1.Registry/RegisterNode", &tandem__control__v1__register_request__descriptor, on_register},
        {"/tandem.control.v1.Registry/Heartbeat", &tandem__control__v1__heartbeat_request__descriptor, on_heartbeat},
    };
    td_status_t st = td_grpc_server_add_methods(s->gateway, gateway, TD_ARRAY_LEN(gateway), s);
    if (st != TD_OK)
        return st;
    return td_grpc_server_add_methods(s->control, control, TD_ARRAY_LEN(control), s);
}

/* Token-count buckets of the prompt and output length histograms: about two per octave, so
 * the planner's length distribution is within ~25% of the truth (docs/metrics.md). */
static const double token_buckets[] = {1,    2,    4,    8,    12,   16,   24,   32,   48,   64,    96,    128,  192,
                                       256,  384,  512,  768,  1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384};

static td_status_t init_metrics(router_state_t *s)
{
    const char *outcome[] = {"outcome"}, *node_role[] = {"node", "role"};
    td_status_t st = td_metrics_register(s->metrics, TD_METRIC_COUNTER, "tandem_router_requests_total",
                                         "Generate requests by outcome (ok, cancelled, deadline, exhausted, invalid, unavailable)",
                                         outcome, 1, NULL, 0, &s->f_requests);
    if (st != TD_OK)
        return st;
    const char *where_reason[] = {"where", "reason"};
    if ((st = td_metrics_register(s->metrics, TD_METRIC_COUNTER, "tandem_router_prefill_placement_total",
                                  "prompts by where they were prefilled (local: on the decode or unified node; "
                                  "remote: on a prefill node; peer: on another decode node, --prefill-policy follow) "
                                  "and why (router_policy.h)",
                                  where_reason, 2, NULL, 0, &s->f_placement)) != TD_OK)
        return st;
    static const struct {
        const char *name, *help;
    } per_node[ROUTER_NODE_GAUGES] = {
        [ROUTER_NODE_QUEUED] = {"tandem_router_node_queued_prefill_tokens",
                                "prompt tokens queued on the node (last heartbeat)"},
        [ROUTER_NODE_RUNNING] = {"tandem_router_node_running_sequences",
                                 "sequences running on the node (last heartbeat)"},
        [ROUTER_NODE_FREE] = {"tandem_router_node_kv_blocks_free", "free KV blocks of the node (last heartbeat)"},
        [ROUTER_NODE_BLOCKS] = {"tandem_router_node_kv_blocks", "KV blocks of the node's pool (as registered)"},
        [ROUTER_NODE_STEP] = {"tandem_router_node_step_seconds", "the node's recent step time (last heartbeat; a decode or unified node: "
                                                    "of its steps without prompt chunks)"},
        [ROUTER_NODE_DRAINING] = {"tandem_router_node_draining",
                                  "1 while the node drains (SIGTERM or Drain): routed nothing new"},
    };
    for (size_t i = 0; i < ROUTER_NODE_GAUGES; i++)
        if ((st = td_metrics_register(s->metrics, TD_METRIC_GAUGE, per_node[i].name, per_node[i].help, node_role, 2,
                                      NULL, 0, &s->f_node[i])) != TD_OK)
            return st;
    const td_metric_def_t defs[] = {
        TD_METRIC_DEF_HISTOGRAM("tandem_router_ttft_seconds", "request arrival to first token sent",
                                td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_ttft),
        TD_METRIC_DEF_HISTOGRAM("tandem_router_tpot_seconds", "time per output token after the first",
                                td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_tpot),
        TD_METRIC_DEF_GAUGE("tandem_router_active_requests", "requests in flight", &s->m_active),
        TD_METRIC_DEF_COUNTER("tandem_router_relayed_tokens_total", "tokens relayed to gateways", &s->m_tokens),
        TD_METRIC_DEF_COUNTER("tandem_router_retries_total",
                              "requests retried on another pair before a token was sent (a node lost mid-prompt, "
                              "an Admit or Prefill failed)", &s->m_retries),
        TD_METRIC_DEF_COUNTER("tandem_router_migrations_total",
                              "streams moved to another pair after their decode node was lost mid-stream",
                              &s->m_migrations),
        TD_METRIC_DEF_HISTOGRAM("tandem_router_migration_seconds",
                                "a stream's pair lost until its next token was sent on the new pair",
                                td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_migration_s),
        TD_METRIC_DEF_GAUGE("tandem_router_prefill_nodes_up", "prefill nodes registered and live", &s->m_nodes_prefill),
        TD_METRIC_DEF_GAUGE("tandem_router_decode_nodes_up", "decode nodes registered, live and streaming",
                            &s->m_nodes_decode),
        TD_METRIC_DEF_GAUGE("tandem_router_unified_nodes_up", "unified nodes registered, live and streaming",
                            &s->m_nodes_unified),
        TD_METRIC_DEF_GAUGE("tandem_router_queue_depth", "requests waiting in the admission queue", &s->m_queue_depth),
        TD_METRIC_DEF_HISTOGRAM("tandem_router_queue_seconds", "request arrival until a pair was chosen",
                                td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_queue_s),
        TD_METRIC_DEF_COUNTER("tandem_router_requests_arrived_total",
                              "requests accepted by a front door (valid), counted as they arrive", &s->m_arrived),
        TD_METRIC_DEF_HISTOGRAM("tandem_router_prompt_tokens", "prompt tokens of a request placed for routing",
                                token_buckets, TD_ARRAY_LEN(token_buckets), &s->m_prompt_tokens),
        TD_METRIC_DEF_HISTOGRAM("tandem_router_output_tokens", "tokens generated by a request that ended ok",
                                token_buckets, TD_ARRAY_LEN(token_buckets), &s->m_output_tokens),
        TD_METRIC_DEF_COUNTER("tandem_router_first_token_mismatch_total",
                              "first tokens on which the Prefill stream and the decode node disagreed",
                              &s->m_first_mismatch),
    };
    return td_metrics_register_all(s->metrics, defs, TD_ARRAY_LEN(defs));
}

/* ---- startup and teardown --------------------------------------------------------------- */

/* The tokenizer and its chat template, the registry, the peers, the admission queue, the
 * lease map and the metrics. */
static td_status_t init_subsystems(router_state_t *s)
{
    const router_config_t *cfg = &s->cfg;
    td_status_t st;
    s->started_unix = (int64_t)time(NULL);
    router_registry_config_t rc = router_registry_config_default();
    rc.max_nodes = (int32_t)cfg->max_nodes;
    rc.heartbeat_timeout_ns = cfg->heartbeat_timeout_ms * 1000000;
    s->policy = router_policy_config_default();
    s->policy.max_prefill_wait_s = (double)cfg->max_prefill_wait_ms * 1e-3;
    s->policy.tpot_objective_s = (double)cfg->tpot_objective_ms * 1e-3;
    s->policy.ttft_objective_s = (double)cfg->ttft_objective_ms * 1e-3;
    s->policy.xfer_fixed_s = (double)cfg->xfer_fixed_us * 1e-6;
    s->policy.xfer_bytes_per_s = (double)cfg->xfer_mb_per_s * 1e6;
    if ((st = router_prefill_policy_parse(cfg->prefill_policy, &s->policy.prefill_policy)) != TD_OK)
        return td_errorf(st, "router: %s", td_last_error());
    if ((cfg->tokenizer && (st = td_tokenizer_load(cfg->tokenizer, &s->tok)) != TD_OK) ||
        (st = router_registry_create(&rc, &s->reg)) != TD_OK ||
        (st = td_auth_salt_key(s->proc.auth.cluster, s->cache_salt_key)) != TD_OK)
        return st;
    if (s->proc.auth.keys && cfg->share_prefix_cache)
        td_info("router: --share-prefix-cache: every API key's prompts share one prefix cache (a key can learn "
                "whether another sent a prompt)");
    else if (s->proc.auth.keys && !s->proc.auth.cluster)
        td_info("router: prefix cache kept apart per tenant, under salts made at this start (no cluster secret): "
                "after a restart, what the nodes cached is not hit again");
    /* the chat template beside the tokenizer (a GGUF file's, tokenizer_config.json's): without
     * one, conversations are refused and prompts still served */
    if (s->tok && (st = td_chat_template_for_model(cfg->tokenizer, NULL, &s->chat)) != TD_OK) {
        if (st != TD_ERR_NOT_FOUND) /* a template that is there but unusable was logged as an error */
            td_info("router: the chat template cannot be used: conversations are refused, prompts are served");
        else
            td_info("router: %s has no chat template: /v1/chat/completions and gRPC conversations are refused; "
                    "/v1/completions and prompts are served", cfg->tokenizer);
    }
    /* tool calls: in the template's format unless the flag names one */
    if (strcmp(cfg->tool_call_format, "auto")) {
        if ((st = td_tools_format_parse(cfg->tool_call_format, &s->tool_format)) != TD_OK)
            return td_errorf(st, "router: --tool-call-format: %s (or auto)", td_last_error());
    } else if (s->chat) {
        size_t len;
        const char *src = td_chat_template_source(s->chat, &len);
        s->tool_format = td_tools_detect(src, len);
    }
    if (s->chat)
        td_info("router: tool calls in the %s format%s", td_tools_format_name(s->tool_format),
                strcmp(cfg->tool_call_format, "auto") ? " (--tool-call-format)" : " (from the chat template)");
    if (!(s->peers = calloc((size_t)cfg->max_nodes, sizeof *s->peers)))
        return td_errorf(TD_ERR_NOMEM, "router: out of memory");
    for (int64_t i = 0; i < cfg->max_nodes; i++)
        s->peers[i].s = s;
    router_queue_init(&s->queue, (int32_t)cfg->max_queue);
    if (td_hash_init(&s->leases, (size_t)cfg->max_active) != TD_OK)
        return td_errorf(TD_ERR_NOMEM, "router: out of memory for the lease map");
    if ((st = td_metrics_create(&s->metrics)) != TD_OK)
        return st;
    return init_metrics(s);
}

/* The OpenAI-compatible HTTP API (--http-port), with /metrics too. */
static td_status_t open_http(router_state_t *s)
{
    const router_config_t *cfg = &s->cfg;
    td_http_config_t hc = td_http_config_default();
    hc.name = "openai";
    hc.host = s->proc.cfg.host;
    hc.port = (uint16_t)cfg->http_port;
    hc.max_body_bytes = (size_t)cfg->http_max_body_bytes;
    hc.max_connections = (uint32_t)cfg->http_max_connections;
    hc.idle_timeout_ms = (uint32_t)cfg->http_idle_timeout_ms;
    /* a whole (non-streamed) answer comes when the request ends: its own deadline */
    hc.request_timeout_ms = (uint32_t)(cfg->http_request_timeout_ms ? cfg->http_request_timeout_ms
                                       : cfg->request_timeout_ms ? cfg->request_timeout_ms + 10000 : 86400000);
    hc.max_write_queue_bytes = (size_t)cfg->send_queue_bytes;
    hc.metrics = s->metrics;
    hc.metrics_name = "tandem_router_http_connections_closed_total";
    hc.body_timeout_ms = (uint32_t)cfg->body_timeout_ms;
    hc.body_budget = &s->body_budget;
    hc.on_head = router_http_head;
    hc.handler = router_http_handler;
    hc.handler_data = s;
    hc.error_body = router_http_error_body;
    return td_http_server_create(&s->proc.loop, &hc, &s->http);
}

/* The gateway and control servers, the HTTP API, /metrics, the loop's tick and hooks; then
 * the addresses on stdout. */
/* Descriptors kept from the public doors for the control plane: two per node (its channel to
 * the router's control port, the router's to it), /metrics scrapers, the tokenizer's and
 * logs' files. */
static long control_reserve(const router_config_t *cfg)
{
    return 2 * cfg->max_nodes + 256;
}

/* The gateways' connection caps within the open-file limit, the control plane's reserve
 * kept: both as configured when they fit, else cut in proportion (and said). Before, the
 * caps (1024 + 4096) assumed more descriptors than the common soft limit of 1024, so idle
 * clients could take them all and no node could register. */
static void size_caps(router_state_t *s)
{
    router_config_t *cfg = &s->cfg;
    long limit = s->proc.fd_limit, reserve = control_reserve(cfg);
    int64_t http = cfg->http_port >= 0 ? cfg->http_max_connections : 0, want = cfg->gateway_max_connections + http;
    if (limit < 0 || want <= limit - reserve) {
        td_info("router: open-file limit %ld: gateway connections at most %lld (gRPC) + %lld (HTTP), %ld kept for "
                "the control plane", limit, (long long)cfg->gateway_max_connections, (long long)http, reserve);
        return;
    }
    long room = TD_MAX(limit - reserve, 2L);
    int64_t g = TD_MAX((int64_t)1, (int64_t)((double)room * (double)cfg->gateway_max_connections / (double)want));
    cfg->gateway_max_connections = g;
    if (http)
        cfg->http_max_connections = TD_MAX((int64_t)1, (int64_t)room - g);
    td_warn("router: open-file limit %ld: gateway connections cut to %lld (gRPC) + %lld (HTTP) to keep %ld for the "
            "control plane; raise the limit (ulimit -n, LimitNOFILE) for more", limit, (long long)g,
            (long long)(http ? cfg->http_max_connections : 0), reserve);
}

static td_status_t serve(router_state_t *s)
{
    const router_config_t *cfg = &s->cfg;
    const td_node_config_t *pc = &s->proc.cfg;
    td_status_t st;
    size_caps(s);
    s->body_budget = (td_rpc_budget_t){.limit = (size_t)cfg->max_body_bytes_in_flight};
    td_grpc_server_config_t gc = td_grpc_server_config_default();
    gc.host = pc->host;
    gc.port = (uint16_t)pc->port;
    gc.metrics = s->metrics;
    gc.send_queue_bytes = (size_t)cfg->send_queue_bytes;
    /* the public door: its requests share the HTTP API's budget of bodies in flight and must
     * arrive whole within the body timeout (HEADERS -> END_STREAM) */
    gc.body_budget = &s->body_budget;
    gc.request_timeout_ms = (uint32_t)cfg->body_timeout_ms;
    /* clients' connections: capped within the open-file limit, closed when idle, and held to
       nghttp2's rapid-reset guard (a flooding connection gets GOAWAY); the control servers
       keep the high allowance the router's own cancels need */
    gc.max_connections = (uint32_t)cfg->gateway_max_connections;
    gc.idle_timeout_ms = (uint32_t)cfg->gateway_idle_timeout_ms;
    gc.max_resets_per_s = 0;
    /* long requests are unpacked on the thread pool, as long HTTP bodies are parsed there
     * (router_http.c): 64 KiB of the costliest protobuf (empty sub-messages) is ~1 ms */
    gc.unpack_off_loop_bytes = 64 << 10;
    gc.max_unpacking = (uint32_t)cfg->max_tokenizing;
    td_node_auth_guard_gateway(&s->proc.auth, &gc);
    if ((st = td_grpc_server_create(&s->proc.loop, &gc, &s->gateway)) != TD_OK)
        return st;
    gc.port = (uint16_t)cfg->control_port;
    gc.send_queue_bytes = td_grpc_server_config_default().send_queue_bytes;
    gc.body_budget = NULL; /* members' calls: bounded by the cluster's own size */
    gc.unpack_off_loop_bytes = 0;
    gc.request_timeout_ms = td_grpc_server_config_default().request_timeout_ms;
    gc.max_connections = td_grpc_server_config_default().max_connections;
    gc.idle_timeout_ms = td_grpc_server_config_default().idle_timeout_ms;
    gc.max_resets_per_s = td_grpc_server_config_default().max_resets_per_s;
    td_node_auth_guard_control(&s->proc.auth, &gc);
    if ((st = td_grpc_server_create(&s->proc.loop, &gc, &s->control)) != TD_OK || (st = add_methods(s)) != TD_OK)
        return st;
    if (cfg->http_port >= 0 && (st = open_http(s)) != TD_OK)
        return st;
    if ((st = td_node_serve(&s->proc, s->metrics)) != TD_OK)
        return st;
    uv_timer_init(&s->proc.loop, &s->tick);
    s->tick.data = s;
    uv_timer_start(&s->tick, on_tick, 50, 50);
    uv_idle_init(&s->proc.loop, &s->pump_idle);
    s->pump_idle.data = s;
    uv_prepare_init(&s->proc.loop, &s->turn_prepare);
    s->turn_prepare.data = s;
    uv_prepare_start(&s->turn_prepare, on_turn);
    s->handles_up = true;
    printf("gateway: %s:%u\n", pc->advertise, td_grpc_server_port(s->gateway));
    if (s->http)
        printf("openai: http://%s:%u/v1\n", pc->advertise, td_http_server_port(s->http));
    printf("control: %s:%u\nmetrics: http://%s:%u/metrics\n", pc->advertise, td_grpc_server_port(s->control),
           pc->advertise, td_node_metrics_port(&s->proc));
    fflush(stdout);
    return TD_OK;
}

/* Everything router_main made, in reverse, whatever got made (NULL-safe closers). */
static void free_state(router_state_t *s)
{
    td_node_stop(&s->proc);
    for (int64_t i = 0; s->peers && i < s->cfg.max_nodes; i++)
        free(s->peers[i].xfer_desc);
    free(s->peers);
    td_hash_free(&s->leases);
    router_registry_destroy(s->reg);
    td_chat_template_destroy(s->chat);
    td_tokenizer_destroy(s->tok);
    td_metrics_destroy(s->metrics);
    td_node_free(&s->proc);
}

int router_main(int argc, char **argv)
{
    router_state_t st_, *s = &st_;
    memset(s, 0, sizeof *s);
    td_list_init(&s->reqs);
    router_config_t *cfg = &s->cfg;
    const td_node_config_t *pc = &s->proc.cfg;
    *cfg = (router_config_t){.control_port = 0, .max_active = 1024, .max_queue = 4096, .request_timeout_ms = 300000,
                             .max_backlog_tokens = 4096, .send_queue_bytes = 256 << 10, .default_max_tokens = 256,
                             .lease_ms = 10000, .max_prefill_wait_ms = 5000, .prefill_policy = "disaggregated",
                             .tool_call_format = "auto",
                             .tpot_objective_ms = 100, .xfer_fixed_us = 2000, .xfer_mb_per_s = 1000,
                             .max_tokenizing = 64, .rpc_timeout_ms = 5000, .heartbeat_ms = 200,
                             .heartbeat_timeout_ms = 1500, .max_nodes = 256, .http_port = -1,
                             .http_max_body_bytes = 2 << 20, .http_max_connections = 4096,
                             .gateway_max_connections = 1024, .gateway_idle_timeout_ms = 300000,
                             .http_idle_timeout_ms = 30000, .http_request_timeout_ms = 0, .max_migrations = 2,
                             .max_body_bytes_in_flight = 64 << 20, .body_timeout_ms = 10000};
    const td_opt_t keys[] = {
        TD_OPT_STRING("tokenizer", &cfg->tokenizer, "tokenizer path (none: prompts as ids only, no text)"),
        TD_OPT_INT("control-port", &cfg->control_port, 0, 65535, "control gRPC port (0 = any)"),
        TD_OPT_INT("max-active", &cfg->max_active, 1, 1 << 20, "requests on nodes at once; more wait in the queue"),
        TD_OPT_INT("max-queue", &cfg->max_queue, 0, 1 << 20,
                   "requests waiting for room at most; beyond → RESOURCE_EXHAUSTED"),
        TD_OPT_INT("request-timeout-ms", &cfg->request_timeout_ms, 0, 86400000,
                   "deadline of a request without grpc-timeout (0 = none)"),
        TD_OPT_INT("max-backlog-tokens", &cfg->max_backlog_tokens, 1, 1 << 24,
                   "tokens held for a client not reading its stream; beyond → RESOURCE_EXHAUSTED"),
        TD_OPT_INT("send-queue-bytes", &cfg->send_queue_bytes, 1, 1 << 30,
                   "bytes queued per gateway stream before tokens wait in the router's backlog"),
        TD_OPT_INT("default-max-tokens", &cfg->default_max_tokens, 1, 1 << 20, "max_tokens when a request gives 0"),
        TD_OPT_INT("lease-ms", &cfg->lease_ms, 10, 600000,
                   "decode lease and Prefill bound, beyond twice the estimated prefill wait"),
        TD_OPT_INT("max-tokenizing", &cfg->max_tokenizing, 1, 4096,
                   "long text prompts encoded and long HTTP bodies parsed off the loop at once; beyond → "
                   "RESOURCE_EXHAUSTED / 429"),
        TD_OPT_INT("max-prefill-wait-ms", &cfg->max_prefill_wait_ms, 0, 600000,
                   "a prefill node with work queued takes no prompt it would reach later than this (0 = no bound)"),
        TD_OPT_STRING("tool-call-format", &cfg->tool_call_format,
                      "how the model writes tool calls: auto (found in its chat template) | hermes (<tool_call>) | "
                      "llama3_json | mistral ([TOOL_CALLS]) | none; docs/openai.md \"Tools\""),
        TD_OPT_STRING("prefill-policy", &cfg->prefill_policy,
                      "where a decode node's prompts are prefilled: disaggregated (on a prefill node, the default) "
                      "| conditional (per request, on the decode node itself when that is sooner and keeps its "
                      "streams within tpot-objective-ms; docs/scheduling.md) | follow (conditional, or on another "
                      "decode node that prefills it and sends the KV, when that is sooner)"),
        TD_OPT_INT("tpot-objective-ms", &cfg->tpot_objective_ms, 1, 600000,
                   "conditional: the TPOT objective of a request that gives none (tpot_objective_ms): a decode "
                   "node keeps each step with prompt chunks of its own within the tightest of its streams'"),
        TD_OPT_INT("ttft-objective-ms", &cfg->ttft_objective_ms, 0, 600000,
                   "conditional: prefill a prompt on its decode node only when the prefill node would pass this "
                   "time to the prompt's KV (0, the default: whenever the decode node is sooner)"),
        TD_OPT_INT("xfer-fixed-us", &cfg->xfer_fixed_us, 0, 60000000,
                   "conditional: a KV transfer's fixed cost in the remote estimate"),
        TD_OPT_INT("xfer-mb-per-s", &cfg->xfer_mb_per_s, 1, 1000000,
                   "conditional: KV transfer bandwidth in the remote estimate (MB/s)"),
        TD_OPT_INT("rpc-timeout-ms", &cfg->rpc_timeout_ms, 10, 600000, "bound of Admit/Release calls"),
        TD_OPT_INT("heartbeat-ms", &cfg->heartbeat_ms, 10, 60000, "heartbeat interval asked of nodes"),
        TD_OPT_INT("heartbeat-timeout-ms", &cfg->heartbeat_timeout_ms, 20, 600000, "silence before a node is dropped"),
        TD_OPT_INT("max-nodes", &cfg->max_nodes, 1, 65536, "registered nodes at most"),
        TD_OPT_INT("max-migrations", &cfg->max_migrations, 0, 64,
                   "moves of a stream whose decode node is lost mid-stream (re-prefill and replay on a live "
                   "pair); beyond → UNAVAILABLE (0 = never move)"),
        TD_OPT_INT("http-port", &cfg->http_port, -1, 65535,
                   "OpenAI-compatible HTTP API (-1 = off, 0 = any); docs/openai.md"),
        {.name = "share-prefix-cache", .type = TD_OPT_BOOL, .ptr = &cfg->share_prefix_cache,
         .help = "every API key's prompts share one prefix cache, as without keys (default: each tenant its "
                 "own; docs/security.md \"Tenants\")"},
        {.name = "http-metrics", .type = TD_OPT_BOOL, .ptr = &cfg->http_metrics,
         .help = "serve /metrics on the HTTP API port too, without a key (default: only on --metrics-port, "
                 "which should face the monitoring network only)"},
        TD_OPT_INT("max-body-bytes-in-flight", &cfg->max_body_bytes_in_flight, 4096, (int64_t)1 << 40,
                   "request bodies held at once across all HTTP and gateway connections; beyond → 503 / "
                   "RESOURCE_EXHAUSTED (docs/security.md)"),
        TD_OPT_INT("body-timeout-ms", &cfg->body_timeout_ms, 100, 600000,
                   "a request (HTTP or gateway) must arrive whole within this of its first byte; beyond → "
                   "408 and close / stream reset"),
        TD_OPT_INT("http-max-body-bytes", &cfg->http_max_body_bytes, 1024, 1 << 30,
                   "HTTP request body at most; beyond → 413"),
        TD_OPT_INT("gateway-max-connections", &cfg->gateway_max_connections, 1, 1 << 20,
                   "gRPC gateway connections at most (with http-max-connections, cut to fit the open-file limit)"),
        TD_OPT_INT("gateway-idle-timeout-ms", &cfg->gateway_idle_timeout_ms, 1000, 86400000,
                   "a gateway connection with no call running this long is closed"),
        TD_OPT_INT("http-max-connections", &cfg->http_max_connections, 1, 1 << 20,
                   "HTTP connections at once; beyond, the oldest idle one is closed"),
        TD_OPT_INT("http-idle-timeout-ms", &cfg->http_idle_timeout_ms, 1, 86400000,
                   "an HTTP connection without a request is closed after this"),
        TD_OPT_INT("http-request-timeout-ms", &cfg->http_request_timeout_ms, 0, 86400000,
                   "an HTTP request must be read and its answer begun within this "
                   "(0 = request-timeout-ms + 10 s, so a whole answer is not cut short)"),
    };
    const td_node_spec_t spec = {.prog = "router", .kind = TD_NODE_ROUTER, .on_shutdown = on_shutdown, .data = s};
    int rc;
    if (!td_node_configure(&s->proc, &spec, keys, (int)TD_ARRAY_LEN(keys), argc, argv, &rc))
        return rc;
    rc = 1;
    if (cfg->http_port > 0 && cfg->http_port == pc->metrics_port) {
        td_errorf(TD_ERR_INVALID, "router: --http-port and --metrics-port are both %lld: they are two listeners; "
                  "leave --metrics-port 0 or give it another port", (long long)cfg->http_port);
        rc = 2;
        goto out;
    }
    if (init_subsystems(s) != TD_OK || serve(s) != TD_OK)
        goto out;

    rc = td_node_run(&s->proc);
out:
    free_state(s);
    return rc;
}
