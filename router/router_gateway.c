/*
 * router_gateway: the gateway API (tandem.v1.Generation, grpc.health.v1.Health). Generate
 * checks a request at the edge (td_gen_params), builds its router_req_t and hands it to the
 * lifecycle (router_request.c); ListModels and ClusterStatus answer from the registry.
 */
#include "router_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "health.pb-c.h"
#include "router_admit.h"
#include "td_util.h"

/* ---- gateway API ----------------------------------------------------------------------- */

static void on_generate_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    router_req_t *r = call_data;
    if (r) {
        /* a client's own deadline timer often resets the stream just before ours fires */
        bool deadline = why == TD_ERR_TIMEOUT ||
                        (r->deadline_ns && (int64_t)td_now_ns() + ROUTER_DEADLINE_SLACK_NS >= r->deadline_ns);
        r->call = NULL;
        router_lease_release(r, deadline ? TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_DEADLINE
                                  : TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_CANCELLED);
        router_count_outcome(r->s, deadline ? "deadline" : "cancelled");
        router_req_end(r);
    }
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
}

/* The gateway stream drained below its bound: the pending output goes out now. */
static void on_generate_writable(td_grpc_call_t *call, void *call_data)
{
    router_req_t *r = call_data;
    if (!r)
        return;
    r->blocked = false;
    router_out_flush(r);
}

/* The edge: a GenerateRequest's parameters as our own struct, for the one validation every
 * front door runs (td_gen_params.h). Handed over as received but for what proto3 cannot
 * tell from unset: top_p and repetition_penalty 0 mean "off" (proto/tandem.proto); negative,
 * NaN and infinite values reach the check and are refused. The strings stay q's. */
static td_gen_params_t gen_params_from_proto(const Tandem__V1__GenerateRequest *q)
{
    td_gen_params_t gp = td_gen_params_default();
    gp.max_tokens = q->max_tokens;
    gp.prompt_is_text = q->n_prompt_ids == 0;
    gp.prompt_len = q->n_prompt_ids ? q->n_prompt_ids : strlen(q->prompt);
    for (size_t i = 0; i < q->n_messages; i++) /* a conversation: its text counts as the prompt */
        gp.prompt_len += strlen(q->messages[i]->role) + strlen(q->messages[i]->content);
    gp.n_stop_ids = q->n_stop_ids;
    gp.n_stop_strings = q->n_stop_strings;
    gp.stop_strings = (const char *const *)q->stop_strings;
    gp.sampling = td_node_sampling_from_proto(q->sampling);
    return gp;
}

void on_generate(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    const Tandem__V1__GenerateRequest *q = (const void *)msg;
    if (s->shutting_down) {
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "router shutting down");
        return;
    }
    if (q->model[0] && strcmp(q->model, s->proc.cfg.model_name)) {
        td_grpc_call_finish(call, TD_GRPC_NOT_FOUND, "unknown model (see ListModels)");
        return;
    }
    const td_gen_params_t gp = gen_params_from_proto(q);
    char why[384] = "";
    if (td_gen_params_validate(&gp, why, sizeof why) != TD_OK) {
        router_count_outcome(s, "invalid");
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    router_req_t *r = calloc(1, sizeof *r);
    if (!r) {
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "router: out of memory");
        return;
    }
    r->s = s;
    r->t_arrival = td_now_ns();
    if (q->request_id[0])
        snprintf(r->id, sizeof r->id, "%s", q->request_id);
    else
        snprintf(r->id, sizeof r->id, "r%llu", (unsigned long long)++s->next_id);
    td_status_t st = TD_OK;
    if (q->n_messages) {
        if (q->n_prompt_ids || q->prompt[0]) {
            st = TD_ERR_INVALID;
            snprintf(why, sizeof why, "send a conversation (messages) or a prompt (prompt or prompt_ids), not both");
        } else if (!s->chat) {
            st = TD_ERR_INVALID;
            snprintf(why, sizeof why, "this router has no chat template for its model (%s): send prompt or prompt_ids",
                     s->tok ? "the tokenizer's model has none" : "no --tokenizer");
        } else {
            r->from_text = true; /* rendered and encoded off the loop (router_req_submit) */
        }
    } else if (q->n_prompt_ids) {
        if ((r->prompt = malloc(q->n_prompt_ids * sizeof(int32_t)))) {
            for (size_t i = 0; i < q->n_prompt_ids; i++) /* above INT32_MAX: negative, refused below */
                r->prompt[i] = (int32_t)q->prompt_ids[i];
            r->n_prompt = (int32_t)q->n_prompt_ids;
        } else {
            st = TD_ERR_NOMEM;
        }
    } else if (!q->prompt[0]) {
        st = TD_ERR_INVALID;
        snprintf(why, sizeof why, "the prompt is empty: send prompt (text) or prompt_ids");
    } else if (!s->tok) {
        st = TD_ERR_INVALID;
        snprintf(why, sizeof why, "this router has no tokenizer (--tokenizer) for a text prompt: send prompt_ids");
    } else {
        r->from_text = true; /* encoded off the loop once the rest is checked (router_req_submit) */
    }
    if (st == TD_OK && q->n_stop_strings && !s->tok) {
        st = TD_ERR_INVALID;
        snprintf(why, sizeof why, "this router has no tokenizer (--tokenizer) to match stop strings: send stop_ids");
    }
    if (st == TD_OK && q->n_stop_strings &&
        (st = td_stop_create((const char *const *)q->stop_strings, (int32_t)q->n_stop_strings, &r->stop)) != TD_OK)
        snprintf(why, sizeof why, "stop strings: %s", td_last_error()); /* validated: out of memory */
    r->max_tokens = gp.max_tokens ? (int32_t)gp.max_tokens : (int32_t)s->cfg.default_max_tokens;
    if (st != TD_OK) {
        bool nomem = st == TD_ERR_NOMEM;
        free(r->prompt);
        td_stop_destroy(r->stop);
        free(r);
        router_count_outcome(s, nomem ? "exhausted" : "invalid");
        td_grpc_call_finish(call, nomem ? TD_GRPC_RESOURCE_EXHAUSTED : TD_GRPC_INVALID_ARGUMENT,
                            nomem ? "router: out of memory" : why);
        return;
    }
    r->sampling = gp.sampling;
    if (q->n_stop_ids) /* bounded above; protobuf-c leaves the array NULL when empty */
        memcpy(r->stop_ids, q->stop_ids, q->n_stop_ids * sizeof *q->stop_ids);
    r->n_stop_ids = q->n_stop_ids;
    if (!r->stop)
        td_stop_create(NULL, 0, &r->stop);
    if (s->tok)
        td_detok_init(&r->detok, s->tok);
    r->call = call;
    td_grpc_call_set_data(call, r);
    td_grpc_call_on_cancel(call, on_generate_cancel);
    td_grpc_call_on_writable(call, on_generate_writable);
    r->priority = q->priority ? q->priority->value : 0;
    /* the client's grpc-timeout (the gRPC layer also ends the stream then), else the
     * configured default: bounds the queue wait, Admit, Prefill and decoding */
    uint64_t dl_ms = td_grpc_call_deadline(call), now_ms = uv_now(&s->proc.loop);
    if (dl_ms)
        r->deadline_ns = (int64_t)r->t_arrival + (int64_t)(dl_ms > now_ms ? dl_ms - now_ms : 0) * 1000000;
    else if (s->cfg.request_timeout_ms)
        r->deadline_ns = (int64_t)r->t_arrival + s->cfg.request_timeout_ms * 1000000;
    router_req_submit(r, q->prompt, r->from_text ? strlen(q->prompt) : 0, q->messages, q->n_messages);
}

void on_list_models(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    Tandem__V1__ModelInfo mi = TANDEM__V1__MODEL_INFO__INIT;
    mi.name = (char *)s->proc.cfg.model_name;
    router_model_facts_t mf;
    router_admit_model_facts(s->reg, s->proc.cfg.model_name, (int64_t)td_now_ns(), &mf);
    /* the model's own vocabulary where its nodes told it, else the tokenizer's */
    mi.vocab_size = mf.vocab_size ? (uint32_t)mf.vocab_size
                                  : s->tok ? (uint32_t)td_tokenizer_vocab_size(s->tok) : 0;
    mi.max_seq_len = (uint32_t)mf.max_seq_len;
    for (int32_t i = 0; i < router_registry_slots(s->reg); i++) {
        const router_node_t *n = router_registry_node_const(s->reg, i);
        if (n)
            mi.fingerprint = n->info.layout.model_fingerprint;
    }
    Tandem__V1__ModelInfo *list[] = {&mi};
    Tandem__V1__ListModelsResponse resp = TANDEM__V1__LIST_MODELS_RESPONSE__INIT;
    resp.models = list;
    resp.n_models = 1;
    td_grpc_call_reply(call, &resp.base);
}

void on_cluster_status(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    int32_t slots = router_registry_slots(s->reg), n = 0;
    Tandem__V1__NodeStatus *st = calloc((size_t)slots + 1, sizeof *st);
    Tandem__V1__NodeStatus **ptrs = calloc((size_t)slots + 1, sizeof *ptrs);
    int64_t now = (int64_t)td_now_ns();
    for (int32_t i = 0; st && ptrs && i < slots; i++) {
        const router_node_t *nd = router_registry_node_const(s->reg, i);
        if (!nd)
            continue;
        Tandem__V1__NodeStatus *x = &st[n];
        tandem__v1__node_status__init(x);
        x->node_id = (char *)nd->info.id;
        x->role = nd->info.role == TD_NODE_ROLE_DECODE ? TANDEM__V1__NODE_ROLE__NODE_ROLE_DECODE
                                                      : TANDEM__V1__NODE_ROLE__NODE_ROLE_PREFILL;
        x->state = router_registry_is_live(s->reg, i, now) ? TANDEM__V1__NODE_STATE__NODE_STATE_UP
                                                           : TANDEM__V1__NODE_STATE__NODE_STATE_DOWN;
        x->model = (char *)nd->info.model;
        x->address = (char *)nd->info.address;
        x->queued_prefill_tokens = (uint64_t)TD_MAX(nd->load.queued_prefill_tokens, 0);
        x->running_sequences = (uint32_t)TD_MAX(nd->load.running_seqs, 0);
        x->free_kv_blocks = (uint32_t)TD_MAX(nd->load.free_blocks, 0);
        x->total_kv_blocks = (uint32_t)nd->info.capacity_blocks;
        x->kv_occupancy = nd->info.capacity_blocks
                              ? 1.0 - (double)x->free_kv_blocks / (double)nd->info.capacity_blocks : 0;
        x->last_heartbeat_age_s = (double)(now - nd->last_heartbeat_ns) * 1e-9;
        ptrs[n] = x;
        n++;
    }
    Tandem__V1__ClusterStatusResponse resp = TANDEM__V1__CLUSTER_STATUS_RESPONSE__INIT;
    resp.nodes = ptrs;
    resp.n_nodes = (size_t)n;
    resp.active_requests = (uint32_t)s->n_active;
    resp.queued_requests = (uint32_t)router_queue_len(&s->queue);
    td_grpc_call_reply(call, &resp.base);
    free(ptrs);
    free(st);
}

void on_health(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = s->shutting_down ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
                                   : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    td_grpc_call_reply(call, &resp.base);
}

