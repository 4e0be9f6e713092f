/*
 * router_control: the control API (tandem.control.v1.Registry): a node registers (checked
 * at the edge, then a channel to it and, for a decode node, its Steps stream) and
 * heartbeats its load; the peers' channels and the nodes-up gauges.
 */
#include "router_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_node_conf.h"
#include "td_util.h"
#include "td_xfer.h"

/* Closes a peer's Steps stream and channel (their callbacks then see nothing of it). */
void router_peer_drop(router_state_t *s, int32_t idx)
{
    router_peer_t *p = &s->peers[idx];
    if (p->steps) {
        td_grpc_client_call_t *c = p->steps;
        p->steps = NULL;
        td_grpc_client_call_cancel(c);
    }
    if (p->ch) {
        td_grpc_channel_close(p->ch, NULL, NULL);
        p->ch = NULL;
    }
}

/* A node is gone: its Steps stream ended, it went silent past heartbeat-timeout-ms, or it
 * registered again (a restart). The requests on it fail over (`why` is their reason), it
 * leaves the registry unless it is joining again (`leave` false), and its peer's stream and
 * channel close; whatever its old generation still sends is ignored. */
void router_node_gone(router_state_t *s, int32_t idx, const char *why, bool leave)
{
    router_decode_lost(s, idx, why);
    const router_node_t *n = router_registry_node_const(s->reg, idx);
    if (leave && n) {
        /* its gauges go with it: a dashboard sums live nodes, and ids that come and go
           (restarts under new names) must not grow /metrics without bound */
        const char *v[] = {n->info.id, td_node_role_name(n->info.role)};
        for (size_t i = 0; i < ROUTER_NODE_GAUGES; i++)
            if (s->f_node[i])
                td_metric_family_remove(s->f_node[i], v);
        router_registry_leave(s->reg, n->info.id); /* it registers again if it comes back */
    }
    s->peers[idx].generation++;
    router_peer_drop(s, idx);
}

/* The node's load as gauges labelled by node and role (what `tandem plan` and dashboards
 * read: utilisation per node). A node that leaves takes its series with it
 * (router_node_gone). */
void router_node_load_metrics(router_state_t *s, int32_t idx, const td_node_load_t *l)
{
    const router_node_t *n = router_registry_node_const(s->reg, idx);
    if (!n)
        return;
    const char *v[] = {n->info.id, td_node_role_name(n->info.role)};
    const double value[ROUTER_NODE_GAUGES] = {
        [ROUTER_NODE_QUEUED] = (double)l->queued_prefill_tokens, [ROUTER_NODE_RUNNING] = l->running_seqs,
        [ROUTER_NODE_FREE] = l->free_blocks, [ROUTER_NODE_BLOCKS] = n->info.capacity_blocks,
        [ROUTER_NODE_STEP] = l->step_ms * 1e-3, [ROUTER_NODE_DRAINING] = l->draining};
    for (size_t i = 0; i < ROUTER_NODE_GAUGES; i++) {
        td_metric_t *m;
        if (s->f_node[i] && td_metric_family_get(s->f_node[i], v, &m) == TD_OK)
            td_metric_set(m, value[i]);
    }
}

/* ---- control API --------------------------------------------------------------------- */

void router_print_nodes(router_state_t *s)
{
    int np = 0, nd = 0, nu = 0;
    int64_t now = (int64_t)td_now_ns();
    for (int32_t i = 0; i < router_registry_slots(s->reg); i++) {
        const router_node_t *n = router_registry_node_const(s->reg, i);
        if (!n || !router_registry_is_live(s->reg, i, now) || (td_node_role_decodes(n->info.role) && !s->peers[i].steps))
            continue;
        n->info.role == TD_NODE_ROLE_DECODE ? nd++ : n->info.role == TD_NODE_ROLE_UNIFIED ? nu++ : np++;
    }
    td_metric_set(s->m_nodes_prefill, np);
    td_metric_set(s->m_nodes_decode, nd);
    td_metric_set(s->m_nodes_unified, nu);
    /* the unified count only when there are some: the line is what scripts wait for */
    if (nu)
        printf("nodes: %d prefill, %d decode, %d unified\n", np, nd, nu);
    else
        printf("nodes: %d prefill, %d decode\n", np, nd);
    fflush(stdout);
}

static void on_steps_first(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    router_on_steps_msg(c, msg, data);
}

/* The node retries a refused registration: the same refusal is logged once. */
static void register_refused(router_state_t *s, const char *id, const char *reason)
{
    char why[sizeof s->refused];
    if (snprintf(why, sizeof why, "%s: %s", id, reason) < 0) /* truncated is fine: it only dedups */
        why[0] = 0;
    if (strcmp(why, s->refused)) {
        td_warn("router: registration of node %s refused: %s", id, reason);
        memcpy(s->refused, why, sizeof why);
    }
}

/* What the protobuf message itself must hold before it becomes a td_node_info_t: the
 * strings fit, the role is in the enum, layout and capacity are present and in range, the
 * transfer descriptor is bounded (the prefill node checks its content when it connects).
 * false: why[] says which field. */
/* Every EOS id inside the vocabulary the node registers (any id when it says none). */
static bool eos_ids_in_vocab(const Tandem__Control__V1__Capacity *c)
{
    for (size_t i = 0; i < c->n_eos_ids; i++)
        if (c->eos_ids[i] > INT32_MAX || (c->vocab_size && c->eos_ids[i] >= c->vocab_size))
            return false;
    return true;
}

static bool register_edge_check(const Tandem__Control__V1__RegisterRequest *q, char *why, size_t cap)
{
    const char *id = q->node_id && q->node_id[0] ? q->node_id : "?";
    if (!q->node_id || !q->node_id[0])
        snprintf(why, cap, "register: node_id is empty");
    else if (strlen(q->node_id) >= TD_NODE_ID_MAX)
        snprintf(why, cap, "register: node_id is %zu bytes, at most %d", strlen(q->node_id), TD_NODE_ID_MAX - 1);
    else if (q->role != TANDEM__CONTROL__V1__ROLE__ROLE_PREFILL && q->role != TANDEM__CONTROL__V1__ROLE__ROLE_DECODE &&
             q->role != TANDEM__CONTROL__V1__ROLE__ROLE_UNIFIED)
        snprintf(why, cap, "register: node %s: role %d is not PREFILL (1), DECODE (2) or UNIFIED (3)", id, (int)q->role);
    else if (!q->model || strlen(q->model) >= TD_NODE_MODEL_MAX)
        snprintf(why, cap, "register: node %s: model is %zu bytes, at most %d", id, q->model ? strlen(q->model) : 0,
                 TD_NODE_MODEL_MAX - 1);
    else if (!q->control_address || strlen(q->control_address) >= TD_NODE_ADDRESS_MAX)
        snprintf(why, cap, "register: node %s: control_address is %zu bytes, at most %d", id,
                 q->control_address ? strlen(q->control_address) : 0, TD_NODE_ADDRESS_MAX - 1);
    else if (!q->layout)
        snprintf(why, cap, "register: node %s: layout is missing", id);
    else if (!q->capacity)
        snprintf(why, cap, "register: node %s: capacity is missing", id);
    else if (q->capacity->total_kv_blocks > INT32_MAX || q->capacity->max_batch > INT32_MAX)
        snprintf(why, cap, "register: node %s: capacity.total_kv_blocks %u or max_batch %u is over %d", id,
                 q->capacity->total_kv_blocks, q->capacity->max_batch, INT32_MAX);
    else if (q->capacity->vocab_size > ROUTER_MAX_VOCAB)
        snprintf(why, cap, "register: node %s: capacity.vocab_size %u, allowed 0 (unknown) .. %d", id,
                 q->capacity->vocab_size, ROUTER_MAX_VOCAB);
    else if (q->capacity->n_eos_ids > TD_NODE_MAX_EOS)
        snprintf(why, cap, "register: node %s: capacity.eos_ids has %zu ids, at most %d", id, q->capacity->n_eos_ids,
                 TD_NODE_MAX_EOS);
    else if (!eos_ids_in_vocab(q->capacity))
        snprintf(why, cap, "register: node %s: an id of capacity.eos_ids is past its vocab_size %u", id,
                 q->capacity->vocab_size);
    else if (q->capacity->max_seq_len > ROUTER_MAX_SEQ_LEN)
        snprintf(why, cap, "register: node %s: capacity.max_seq_len %u, allowed 0 (unknown) .. %d", id,
                 q->capacity->max_seq_len, ROUTER_MAX_SEQ_LEN);
    else if (q->ucx_worker_address.len > TD_XFER_DESC_MAX)
        snprintf(why, cap, "register: node %s: ucx_worker_address is %zu bytes, at most %d (td_xfer_describe)", id,
                 q->ucx_worker_address.len, TD_XFER_DESC_MAX);
    else
        return true;
    return false;
}

void on_register(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    const Tandem__Control__V1__RegisterRequest *q = (const void *)msg;
    td_node_info_t info = {0};
    char why[768];
    if (!register_edge_check(q, why, sizeof why)) {
        register_refused(s, q->node_id && q->node_id[0] ? q->node_id : "?", why);
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    strcpy(info.id, q->node_id);
    strcpy(info.model, q->model);
    strcpy(info.address, q->control_address);
    info.role = (td_node_role_t)q->role; /* checked: PREFILL, DECODE or UNIFIED */
    info.layout = (td_kv_layout_t){.model_fingerprint = q->layout->model_fingerprint, .dtype = q->layout->dtype,
                                   .block_size = q->layout->block_size, .n_layers = q->layout->n_layers,
                                   .n_kv_heads = q->layout->n_kv_heads, .head_dim = q->layout->head_dim,
                                   .version = q->layout->version};
    info.capacity_blocks = (int32_t)q->capacity->total_kv_blocks;
    info.max_batch = (int32_t)q->capacity->max_batch;
    info.vocab_size = (int32_t)TD_MIN(q->capacity->vocab_size, (uint32_t)INT32_MAX);
    info.max_seq_len = (int32_t)TD_MIN(q->capacity->max_seq_len, (uint32_t)INT32_MAX);
    info.max_step_tokens = (int32_t)TD_MIN(q->capacity->max_prefill_tokens, (uint32_t)INT32_MAX);
    info.n_eos = (int32_t)q->capacity->n_eos_ids; /* checked: at most TD_NODE_MAX_EOS, in the vocabulary */
    for (int32_t i = 0; i < info.n_eos; i++)
        info.eos_ids[i] = (int32_t)q->capacity->eos_ids[i];
    char host[TD_NODE_ADDRESS_MAX];
    uint16_t port;
    if (router_registry_validate(&info) != TD_OK) {
        register_refused(s, info.id, td_last_error());
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, td_last_error());
        return;
    }
    if (td_node_conf_split_addr(info.address, host, sizeof host, &port) != TD_OK || !port) {
        snprintf(why, sizeof why, "register: node %s: control_address \"%s\" is not HOST:PORT with a port 1 .. 65535",
                 info.id, info.address);
        register_refused(s, info.id, why);
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    /* A live node's id is refused (docs/cluster.md "Node identity"): ending its streams for
     * whoever registers under its name would let any caller break its requests. A restarted
     * node gets in once the old registration is gone: its channel failed, its Steps stream
     * ended (the registration left then), or it was silent past heartbeat-timeout-ms. */
    int64_t now = (int64_t)td_now_ns();
    int32_t old = router_registry_find(s->reg, info.id);
    if (old >= 0 && (!s->peers[old].ch || !td_grpc_channel_is_usable(s->peers[old].ch)))
        router_registry_node(s->reg, old)->up = false; /* its process is gone */
    if (old >= 0 && router_registry_is_live(s->reg, old, now)) {
        const router_node_t *o = router_registry_node_const(s->reg, old);
        snprintf(why, sizeof why, "register: node id %s is taken by a live node (at %s, heard from %lld ms ago): "
                 "a restarted node registers once the old one is gone (%lld ms of silence); another node needs "
                 "another id", info.id, o->info.address, (long long)((now - o->last_heartbeat_ns) / 1000000),
                 (long long)s->cfg.heartbeat_timeout_ms);
        register_refused(s, info.id, why);
        td_grpc_call_finish(call, TD_GRPC_ALREADY_EXISTS, why);
        return;
    }
    if (old >= 0) { /* a restart: whatever ran there is gone */
        router_node_gone(s, old, "node restarted", false);
    }
    int32_t idx;
    if (router_registry_join(s->reg, &info, now, &idx) != TD_OK) {
        register_refused(s, info.id, td_last_error());
        if (old >= 0) /* its old registration's peer is gone: not chosen again */
            router_registry_leave(s->reg, info.id);
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, td_last_error());
        return;
    }
    router_peer_t *p = &s->peers[idx];
    p->s = s;
    p->generation++;
    p->admit_refused = false;
    free(p->xfer_desc);
    p->xfer_desc = NULL;
    p->xfer_desc_len = 0;
    if (q->ucx_worker_address.len && (p->xfer_desc = malloc(q->ucx_worker_address.len))) {
        memcpy(p->xfer_desc, q->ucx_worker_address.data, q->ucx_worker_address.len);
        p->xfer_desc_len = q->ucx_worker_address.len;
    }
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    if (td_node_auth_sign_channel(s->proc.auth.cluster, info.id, &cc) != TD_OK ||
        td_grpc_channel_create(&s->proc.loop, host, port, &cc, &p->ch) != TD_OK) {
        router_registry_leave(s->reg, info.id);
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "router cannot reach the node's control address");
        return;
    }
    if (td_node_role_decodes(info.role)) {
        Tandem__Control__V1__StepsRequest sr = TANDEM__CONTROL__V1__STEPS_REQUEST__INIT;
        sr.router_id = "router";
        td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__step_batch__descriptor,
                                 .on_message = on_steps_first, .on_done = router_on_steps_done, .data = p};
        if (td_grpc_channel_call(p->ch, "/tandem.control.v1.DecodeNode/Steps", &sr.base, &o, &p->steps) != TD_OK) {
            p->steps = NULL;
            router_peer_drop(s, idx);
            router_registry_leave(s->reg, info.id);
            td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "router cannot subscribe to the node's steps");
            return;
        }
    }
    td_info("router: node %s (%s) registered at %s", info.id, td_node_role_name(info.role),
            info.address);
    Tandem__Control__V1__RegisterResponse resp = TANDEM__CONTROL__V1__REGISTER_RESPONSE__INIT;
    resp.epoch = p->generation;
    resp.heartbeat_interval_ms = (uint32_t)s->cfg.heartbeat_ms;
    resp.heartbeat_timeout_ms = (uint32_t)s->cfg.heartbeat_timeout_ms;
    td_grpc_call_reply(call, &resp.base);
    router_print_nodes(s);
}

void on_heartbeat(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    const Tandem__Control__V1__HeartbeatRequest *q = (const void *)msg;
    Tandem__Control__V1__HeartbeatResponse resp = TANDEM__CONTROL__V1__HEARTBEAT_RESPONSE__INIT;
    int32_t idx = q->node_id ? router_registry_find(s->reg, q->node_id) : -1;
    if (idx < 0 || s->peers[idx].generation != q->epoch || !s->peers[idx].ch ||
        !td_grpc_channel_is_usable(s->peers[idx].ch)) { /* a failed channel: a new registration makes a new one */
        resp.reregister = true;
    } else {
        td_node_load_t l = {0};
        if (q->load) {
            /* clamped to what the node registered: a wrapped or absurd count is not believed */
            const router_node_t *n = router_registry_node_const(s->reg, idx);
            l.queued_prefill_tokens = (int64_t)TD_MIN(q->load->queued_prefill_tokens, (uint64_t)INT64_MAX);
            l.running_seqs = (int32_t)TD_MIN(q->load->running_sequences, (uint32_t)INT32_MAX);
            l.free_blocks = (int32_t)TD_MIN(q->load->free_kv_blocks, (uint32_t)n->info.capacity_blocks);
            float step_s = q->load->n_recent_step_s ? q->load->recent_step_s[q->load->n_recent_step_s - 1] : 0;
            l.step_ms = isfinite(step_s) && step_s > 0 ? step_s * 1e3 : 0;
            float tps = q->load->prefill_tokens_per_s;
            l.prefill_tok_s = isfinite(tps) && tps > 0 ? tps : 0; /* a hint: garbage is "unknown" */
            float tpot = q->load->tpot_objective_s;
            l.tpot_objective_s = isfinite(tpot) && tpot > 0 ? tpot : 0;
            float spread = q->load->step_spread_s;
            l.step_spread_s = isfinite(spread) && spread > 0 ? spread : 0;
            l.draining = q->load->draining;
        }
        const router_node_t *n = router_registry_node_const(s->reg, idx);
        if (l.draining && !n->load.draining) /* one line per drain: a node never stops draining */
            td_info("router: node %s is draining: no new request goes to it; its running ones finish", q->node_id);
        router_registry_heartbeat(s->reg, q->node_id, &l, (int64_t)td_now_ns());
        router_node_load_metrics(s, idx, &l);
        s->peers[idx].admit_refused = false;
        router_want_pump(s);
    }
    td_grpc_call_reply(call, &resp.base);
}

