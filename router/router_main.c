/*
 * router_main: the router process (see router_main.h and docs/cluster.md).
 *
 * Everything runs on one libuv loop: the gateway gRPC server (Generation, Health), the
 * control server (Registry), one client channel per node, and for each decode node a Steps
 * stream that carries every sequence's new token of one step in one message. A request
 * goes: tokenize → pick a pair (router_policy) → Admit on the decode node (lease) →
 * Prefill on the prefill node (KV pushed to the lease) → tokens relayed from the decode
 * node's Steps stream, detokenized, stop strings matched here → last message with finish
 * reason, usage and timings. A failure before any token was sent is retried once on
 * another pair; client cancel and deadlines Release the lease.
 */
#include "router_main.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control.pb-c.h"
#include "health.pb-c.h"
#include "router_conf.h"
#include "router_policy.h"
#include "router_registry.h"
#include "tandem.pb-c.h"
#include "td_grpc.h"
#include "td_http.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_sampler.h"
#include "td_tokenizer.h"
#include "td_util.h"

#define ROUTER_MAX_STOP_IDS 32

typedef struct router_config {
    const char *tokenizer;     /* tokenizer path (a model's tokenizer.bin / .json / dir) */
    const char *model_name;
    const char *host;
    int64_t port;              /* gateway */
    int64_t control_port;
    int64_t metrics_port;
    int64_t max_active;        /* requests in flight; beyond → RESOURCE_EXHAUSTED */
    int64_t default_max_tokens;
    int64_t lease_ms;
    int64_t rpc_timeout_ms;
    int64_t heartbeat_ms;
    int64_t heartbeat_timeout_ms;
    int64_t max_nodes;
    const char *log_level;
} router_config_t;

typedef struct router_peer {
    struct router_state *s;
    td_grpc_channel_t *ch;
    td_grpc_client_call_t *steps;
    uint8_t *xfer_desc;
    size_t xfer_desc_len;
    uint64_t generation;
} router_peer_t;

typedef enum { REQ_ADMIT, REQ_PREFILL, REQ_RUNNING } router_req_state_t;

typedef struct router_state router_state_t;

typedef struct router_req {
    struct router_req *prev, *next;
    router_state_t *s;
    td_grpc_call_t *call;
    char id[64];
    int32_t *prompt;
    int32_t n_prompt;
    int32_t max_tokens;
    Tandem__Control__V1__SamplingParams sampling;
    uint32_t stop_ids[ROUTER_MAX_STOP_IDS];
    size_t n_stop_ids;
    td_stop_t *stop;
    td_detok_t detok;
    router_pick_t pick;
    router_pair_t tried[2];
    int32_t n_tried;
    router_req_state_t state;
    uint64_t decode_gen;
    uint64_t lease_id;
    bool have_lease;
    uint32_t *blocks;          /* the lease's block ids, from Admit */
    size_t n_blocks;
    td_grpc_client_call_t *pending;
    uint32_t completion;
    uint32_t cached;
    bool sent_any;
    uint64_t t_arrival, t_picked, t_prefill, t_first, t_last;
    double transfer_s, prefill_s;
} router_req_t;

struct router_state {
    router_config_t cfg;
    uv_loop_t loop;
    uv_signal_t sigint, sigterm;
    uv_timer_t tick;
    td_tokenizer_t *tok;
    router_registry_t *reg;
    router_policy_config_t policy;
    router_peer_t *peers;
    router_req_t *reqs;
    int32_t n_active;
    uint64_t next_id;
    td_grpc_server_t *gateway, *control;
    td_http_server_t *http;
    td_metrics_t *metrics;
    td_metric_family_t *f_requests;
    td_metric_t *m_ttft, *m_tpot, *m_active, *m_tokens, *m_retries, *m_nodes_prefill, *m_nodes_decode;
    bool shutting_down;
    bool handles_up;
};

static void req_start(router_req_t *r);

/* ---- request end --------------------------------------------------------------------- */

static void count_outcome(router_state_t *s, const char *outcome)
{
    td_metric_t *m;
    const char *v[] = {outcome};
    if (td_metric_family_get(s->f_requests, v, &m) == TD_OK)
        td_metric_inc(m);
}

static void on_release_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data) {}

static void release_lease(router_req_t *r, Tandem__Control__V1__ReleaseRequest__Reason why)
{
    router_state_t *s = r->s;
    if (!r->have_lease)
        return;
    r->have_lease = false;
    int32_t d = r->pick.pair.decode;
    const router_node_t *n = router_registry_node_const(s->reg, d);
    if (!n || s->peers[d].generation != r->decode_gen || !s->peers[d].ch)
        return;
    Tandem__Control__V1__ReleaseRequest q = TANDEM__CONTROL__V1__RELEASE_REQUEST__INIT;
    q.lease_id = r->lease_id;
    q.request_id = r->id;
    q.reason = why;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__release_response__descriptor,
                             .on_done = on_release_done, .timeout_ms = (uint32_t)s->cfg.rpc_timeout_ms};
    td_grpc_channel_call(s->peers[d].ch, "/tandem.control.v1.DecodeNode/Release", &q.base, &o, NULL);
}

static void req_free(router_req_t *r)
{
    router_state_t *s = r->s;
    if (r->prev)
        r->prev->next = r->next;
    else
        s->reqs = r->next;
    if (r->next)
        r->next->prev = r->prev;
    s->n_active--;
    td_metric_set(s->m_active, s->n_active);
    if (r->pending) {
        td_grpc_client_call_t *p = r->pending;
        r->pending = NULL;
        td_grpc_client_call_cancel(p); /* its done callback sees r->pending cleared → data NULL */
    }
    if (r->s->tok)
        td_detok_free(&r->detok);
    td_stop_destroy(r->stop);
    free(r->prompt);
    free(r->blocks);
    free(r);
}

/* Ends the gateway stream with an error status and forgets the request. */
static void req_fail(router_req_t *r, td_grpc_code_t code, const char *msg, const char *outcome)
{
    release_lease(r, code == TD_GRPC_DEADLINE_EXCEEDED ? TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_DEADLINE
                                                       : TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_FAILED);
    if (r->call) {
        td_grpc_call_set_data(r->call, NULL);
        td_grpc_call_finish(r->call, code, msg);
        r->call = NULL;
    }
    count_outcome(r->s, outcome);
    req_free(r);
}

/* Failure before a token reached the client: another pair once, else UNAVAILABLE. */
static void req_retry_or_fail(router_req_t *r, const char *why)
{
    release_lease(r, TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_FAILED);
    if (!r->sent_any && r->n_tried < 2) {
        td_info("request %s: retrying on another pair (%s)", r->id, why);
        td_metric_inc(r->s->m_retries);
        req_start(r);
        return;
    }
    char msg[256];
    snprintf(msg, sizeof msg, "request %s failed: %s", r->id, why);
    req_fail(r, TD_GRPC_UNAVAILABLE, msg, "unavailable");
}

static bool send_tokens(router_req_t *r, const uint32_t *ids, size_t n, const char *text, size_t text_len,
                        Tandem__V1__FinishReason finish)
{
    router_state_t *s = r->s;
    Tandem__V1__GenerateResponse m = TANDEM__V1__GENERATE_RESPONSE__INIT;
    Tandem__V1__Usage u = TANDEM__V1__USAGE__INIT;
    Tandem__V1__Timings t = TANDEM__V1__TIMINGS__INIT;
    char *txt = malloc(text_len + 1);
    if (!txt)
        return false;
    memcpy(txt, text, text_len);
    txt[text_len] = '\0';
    m.token_ids = (uint32_t *)ids;
    m.n_token_ids = n;
    m.text = txt;
    if (!r->sent_any || finish != TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED)
        m.request_id = r->id;
    uint64_t now = td_now_ns();
    if (n && !r->t_first) {
        r->t_first = now;
        td_metric_observe(s->m_ttft, (double)(now - r->t_arrival) * 1e-9);
    } else if (n && r->t_last) {
        td_metric_observe(s->m_tpot, (double)(now - r->t_last) * 1e-9 / (double)n);
    }
    if (n)
        r->t_last = now;
    if (finish != TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED) {
        m.finish_reason = finish;
        u.prompt_tokens = (uint32_t)r->n_prompt;
        u.completion_tokens = r->completion;
        u.cached_tokens = r->cached;
        m.usage = &u;
        t.queue_s = (double)(r->t_picked - r->t_arrival) * 1e-9;
        t.prefill_s = r->prefill_s;
        t.transfer_s = r->transfer_s;
        t.first_token_s = r->t_first ? (double)(r->t_first - r->t_arrival) * 1e-9 : 0;
        t.per_token_s = r->completion > 1 ? (double)(r->t_last - r->t_first) * 1e-9 / (r->completion - 1) : 0;
        t.total_s = (double)(now - r->t_arrival) * 1e-9;
        m.timings = &t;
    }
    td_status_t st = td_grpc_call_send(r->call, &m.base);
    free(txt);
    r->sent_any = true;
    td_metric_add(s->m_tokens, (double)n);
    return st == TD_OK;
}

static void req_finish(router_req_t *r, Tandem__V1__FinishReason reason)
{
    const char *text = "";
    size_t len = 0;
    char *tail = NULL;
    if (r->stop && r->s->tok && reason != TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP) {
        const char *a;
        size_t alen;
        td_stop_result_t sr = {0};
        if (td_detok_flush(&r->detok, &a, &alen) == TD_OK && td_stop_feed(r->stop, a, alen, &sr) == TD_OK) {
            const char *b;
            size_t blen = 0;
            if (!sr.matched)
                td_stop_flush(r->stop, &b, &blen);
            if ((tail = malloc(sr.emit_len + blen + 1))) {
                memcpy(tail, sr.emit, sr.emit_len);
                if (blen)
                    memcpy(tail + sr.emit_len, b, blen);
                text = tail;
                len = sr.emit_len + blen;
            }
        }
    }
    send_tokens(r, NULL, 0, text, len, reason);
    free(tail);
    r->have_lease = false; /* the decode node freed it with the finish */
    td_grpc_call_set_data(r->call, NULL);
    td_grpc_call_finish(r->call, TD_GRPC_OK, NULL);
    r->call = NULL;
    count_outcome(r->s, "ok");
    req_free(r);
}

/* One new token of a running request. */
static void req_token(router_req_t *r, uint32_t token)
{
    r->completion++;
    const char *text = "";
    size_t len = 0;
    bool matched = false;
    if (r->stop && r->s->tok) {
        const char *piece;
        size_t plen;
        td_stop_result_t sr;
        if (td_detok_push(&r->detok, (int32_t)token, &piece, &plen) == TD_OK &&
            td_stop_feed(r->stop, piece, plen, &sr) == TD_OK) {
            text = sr.emit;
            len = sr.emit_len;
            matched = sr.matched;
        }
    }
    if (matched) {
        send_tokens(r, &token, 1, text, len, TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED);
        release_lease(r, TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_CANCELLED);
        r->have_lease = false;
        req_finish(r, TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP);
        return;
    }
    if (!send_tokens(r, &token, 1, text, len, TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED))
        td_warn("request %s: token not queued to the gateway stream", r->id);
}

/* ---- node calls -------------------------------------------------------------------------- */

static void on_prefill_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    router_req_t *r = data;
    const Tandem__Control__V1__PrefillResponse *p = (const void *)msg;
    r->prefill_s = p->prefill_s;
    r->transfer_s = p->transfer_s;
    r->cached = p->cached_tokens;
}

static void on_prefill_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    router_req_t *r = data;
    if (r->pending != c)
        return; /* request already gone */
    r->pending = NULL;
    if (code != TD_GRPC_OK) {
        req_retry_or_fail(r, msg[0] ? msg : td_grpc_code_name(code));
        return;
    }
    r->state = REQ_RUNNING;
}

static void on_admit_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    router_req_t *r = data;
    const Tandem__Control__V1__AdmitResponse *a = (const void *)msg;
    free(r->blocks);
    r->n_blocks = 0;
    if ((r->blocks = malloc((a->n_block_ids + 1) * sizeof *r->blocks))) {
        if (a->n_block_ids)
            memcpy(r->blocks, a->block_ids, a->n_block_ids * sizeof *r->blocks);
        r->n_blocks = a->n_block_ids;
    }
    r->lease_id = a->lease_id;
    r->have_lease = true;
    r->cached = a->cached_tokens;
}

static void on_admit_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    router_req_t *r = data;
    if (r->pending != c)
        return; /* request already gone */
    r->pending = NULL;
    router_state_t *s = r->s;
    if (code != TD_GRPC_OK || !r->have_lease) {
        if (code == TD_GRPC_RESOURCE_EXHAUSTED && r->n_tried >= 2) {
            req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, msg, "exhausted");
            return;
        }
        req_retry_or_fail(r, msg[0] ? msg : td_grpc_code_name(code));
        return;
    }
    router_peer_t *pp = &s->peers[r->pick.pair.prefill], *dp = &s->peers[r->pick.pair.decode];
    const router_node_t *dn = router_registry_node_const(s->reg, r->pick.pair.decode);
    Tandem__Control__V1__PrefillRequest q = TANDEM__CONTROL__V1__PREFILL_REQUEST__INIT;
    q.request_id = r->id;
    q.tokens = (uint32_t *)r->prompt;
    q.n_tokens = (size_t)r->n_prompt;
    q.decode_node_id = dn ? (char *)dn->info.id : "";
    q.block_ids = r->blocks;
    q.n_block_ids = r->n_blocks;
    q.lease_id = r->lease_id;
    q.sampling = &r->sampling;
    q.decode_xfer.data = dp->xfer_desc;
    q.decode_xfer.len = dp->xfer_desc_len;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__prefill_response__descriptor,
                             .on_message = on_prefill_msg, .on_done = on_prefill_done, .data = r,
                             .timeout_ms = (uint32_t)s->cfg.lease_ms};
    r->t_prefill = td_now_ns();
    r->state = REQ_PREFILL;
    if (!pp->ch ||
        td_grpc_channel_call(pp->ch, "/tandem.control.v1.PrefillNode/Prefill", &q.base, &o, &r->pending) != TD_OK) {
        r->pending = NULL;
        req_retry_or_fail(r, "prefill node unreachable");
    }
}

static void req_start(router_req_t *r)
{
    router_state_t *s = r->s;
    router_pick_request_t pr = {.model = s->cfg.model_name, .prompt = r->prompt, .n_prompt = r->n_prompt,
                                .max_tokens = r->max_tokens, .exclude = r->tried, .n_exclude = r->n_tried,
                                .now_ns = (int64_t)td_now_ns()};
    router_pick_t pick;
    td_status_t st = router_policy_pick(s->reg, &s->policy, &pr, &pick);
    if (st != TD_OK) {
        if (st == TD_ERR_EXHAUSTED)
            req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, "no decode node has room now; retry later", "exhausted");
        else if (st == TD_ERR_RANGE)
            req_fail(r, TD_GRPC_INVALID_ARGUMENT, "prompt + max_tokens exceed every decode node's KV pool", "invalid");
        else
            req_fail(r, TD_GRPC_UNAVAILABLE, r->n_tried ? "the retry found no other pair" : "no prefill/decode pair is up",
                     "unavailable");
        return;
    }
    router_policy_commit(s->reg, &pr, &pick);
    r->pick = pick;
    r->tried[r->n_tried++] = pick.pair;
    r->decode_gen = s->peers[pick.pair.decode].generation;
    r->t_picked = td_now_ns();
    r->state = REQ_ADMIT;
    r->have_lease = false;
    Tandem__Control__V1__AdmitRequest q = TANDEM__CONTROL__V1__ADMIT_REQUEST__INIT;
    q.request_id = r->id;
    q.prompt_tokens = (uint32_t)r->n_prompt;
    q.max_tokens = (uint32_t)r->max_tokens;
    q.lease_ms = (uint32_t)s->cfg.lease_ms;
    q.sampling = &r->sampling;
    q.stop_ids = r->stop_ids;
    q.n_stop_ids = r->n_stop_ids;
    q.prompt_ids = (uint32_t *)r->prompt;
    q.n_prompt_ids = (size_t)r->n_prompt;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__admit_response__descriptor,
                             .on_message = on_admit_msg, .on_done = on_admit_done, .data = r,
                             .timeout_ms = (uint32_t)s->cfg.rpc_timeout_ms};
    router_peer_t *dp = &s->peers[pick.pair.decode];
    if (!dp->ch || !dp->steps ||
        td_grpc_channel_call(dp->ch, "/tandem.control.v1.DecodeNode/Admit", &q.base, &o, &r->pending) != TD_OK) {
        r->pending = NULL;
        req_retry_or_fail(r, "decode node unreachable");
    }
}

/* ---- decode node step streams ---------------------------------------------------------- */

static router_req_t *find_lease(router_state_t *s, int32_t decode, uint64_t gen, uint64_t lease)
{
    for (router_req_t *r = s->reqs; r; r = r->next)
        if (r->have_lease && r->lease_id == lease && r->pick.pair.decode == decode && r->decode_gen == gen)
            return r;
    return NULL;
}

static void on_steps_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    router_peer_t *p = data;
    router_state_t *s = p->s;
    int32_t d = (int32_t)(p - s->peers);
    const Tandem__Control__V1__StepBatch *b = (const void *)msg;
    for (size_t i = 0; i < b->n_seqs; i++) {
        const Tandem__Control__V1__SeqStep *q = b->seqs[i];
        router_req_t *r = find_lease(s, d, p->generation, q->lease_id);
        if (!r || !r->call)
            continue;
        switch (q->event) {
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN: req_token(r, q->token); break;
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_LENGTH:
            req_finish(r, TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH);
            break;
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_STOP:
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_EOS:
            req_finish(r, TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP);
            break;
        default:
            r->have_lease = false;
            req_retry_or_fail(r, "the decode node dropped the sequence");
            break;
        }
    }
}

/* A decode node is gone (stream ended, or silent past the heartbeat bound). */
static void decode_lost(router_state_t *s, int32_t d, const char *why)
{
    router_peer_t *p = &s->peers[d];
    for (router_req_t *r = s->reqs, *next; r; r = next) {
        next = r->next;
        if (r->pick.pair.decode == d && r->decode_gen == p->generation && r->n_tried) {
            r->have_lease = false;
            if (r->pending) {
                td_grpc_client_call_t *pc = r->pending;
                r->pending = NULL;
                td_grpc_client_call_cancel(pc);
            }
            req_retry_or_fail(r, why);
        }
    }
}

static void peer_drop(router_state_t *s, int32_t idx)
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

static void on_steps_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    router_peer_t *p = data;
    router_state_t *s = p->s;
    if (p->steps != c)
        return;
    p->steps = NULL;
    int32_t d = (int32_t)(p - s->peers);
    const router_node_t *n = router_registry_node_const(s->reg, d);
    td_warn("router: decode node %s lost (%s: %s)", n ? n->info.id : "?", td_grpc_code_name(code), msg);
    decode_lost(s, d, "decode node lost");
    if (n)
        router_registry_leave(s->reg, n->info.id); /* it registers again if it comes back */
    p->generation++;
    peer_drop(s, d);
}

/* ---- control API --------------------------------------------------------------------- */

static void print_nodes(router_state_t *s)
{
    int np = 0, nd = 0;
    int64_t now = (int64_t)td_now_ns();
    for (int32_t i = 0; i < router_registry_slots(s->reg); i++) {
        const router_node_t *n = router_registry_node_const(s->reg, i);
        if (n && router_registry_is_live(s->reg, i, now) && (n->info.role != ROUTER_ROLE_DECODE || s->peers[i].steps))
            n->info.role == ROUTER_ROLE_DECODE ? nd++ : np++;
    }
    td_metric_set(s->m_nodes_prefill, np);
    td_metric_set(s->m_nodes_decode, nd);
    printf("nodes: %d prefill, %d decode\n", np, nd);
    fflush(stdout);
}

static void on_steps_first(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    on_steps_msg(c, msg, data);
}

static void on_register(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    const Tandem__Control__V1__RegisterRequest *q = (const void *)msg;
    router_node_info_t info = {0};
    if (!q->node_id || strlen(q->node_id) >= sizeof info.id || strlen(q->model) >= sizeof info.model ||
        strlen(q->control_address) >= sizeof info.address || !q->layout || !q->capacity) {
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, "register: id, model, address, layout, capacity required");
        return;
    }
    strcpy(info.id, q->node_id);
    strcpy(info.model, q->model);
    strcpy(info.address, q->control_address);
    info.role = q->role == TANDEM__CONTROL__V1__ROLE__ROLE_DECODE ? ROUTER_ROLE_DECODE : ROUTER_ROLE_PREFILL;
    info.layout = (td_kv_layout_t){.model_fingerprint = q->layout->model_fingerprint, .dtype = q->layout->dtype,
                                   .block_size = q->layout->block_size, .n_layers = q->layout->n_layers,
                                   .n_kv_heads = q->layout->n_kv_heads, .head_dim = q->layout->head_dim,
                                   .version = q->layout->version};
    info.capacity_blocks = (int32_t)q->capacity->total_kv_blocks;
    info.max_batch = (int32_t)q->capacity->max_batch;
    char host[ROUTER_ADDRESS_MAX];
    uint16_t port;
    int32_t old = router_registry_find(s->reg, info.id);
    if (old >= 0) { /* a restart: whatever ran there is gone */
        decode_lost(s, old, "node re-registered");
        s->peers[old].generation++;
        peer_drop(s, old);
    }
    int32_t idx;
    if (router_conf_split_addr(info.address, host, sizeof host, &port) != TD_OK ||
        router_registry_join(s->reg, &info, (int64_t)td_now_ns(), &idx) != TD_OK) {
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, td_last_error());
        return;
    }
    router_peer_t *p = &s->peers[idx];
    p->s = s;
    p->generation++;
    free(p->xfer_desc);
    p->xfer_desc = NULL;
    p->xfer_desc_len = 0;
    if (q->ucx_worker_address.len && (p->xfer_desc = malloc(q->ucx_worker_address.len))) {
        memcpy(p->xfer_desc, q->ucx_worker_address.data, q->ucx_worker_address.len);
        p->xfer_desc_len = q->ucx_worker_address.len;
    }
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    if (td_grpc_channel_create(&s->loop, host, port, &cc, &p->ch) != TD_OK) {
        router_registry_leave(s->reg, info.id);
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "router cannot reach the node's control address");
        return;
    }
    if (info.role == ROUTER_ROLE_DECODE) {
        Tandem__Control__V1__StepsRequest sr = TANDEM__CONTROL__V1__STEPS_REQUEST__INIT;
        sr.router_id = "router";
        td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__step_batch__descriptor,
                                 .on_message = on_steps_first, .on_done = on_steps_done, .data = p};
        if (td_grpc_channel_call(p->ch, "/tandem.control.v1.DecodeNode/Steps", &sr.base, &o, &p->steps) != TD_OK) {
            p->steps = NULL;
            peer_drop(s, idx);
            router_registry_leave(s->reg, info.id);
            td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "router cannot subscribe to the node's steps");
            return;
        }
    }
    td_info("router: node %s (%s) registered at %s", info.id, info.role == ROUTER_ROLE_DECODE ? "decode" : "prefill",
            info.address);
    Tandem__Control__V1__RegisterResponse resp = TANDEM__CONTROL__V1__REGISTER_RESPONSE__INIT;
    resp.epoch = p->generation;
    resp.heartbeat_interval_ms = (uint32_t)s->cfg.heartbeat_ms;
    resp.heartbeat_timeout_ms = (uint32_t)s->cfg.heartbeat_timeout_ms;
    td_grpc_call_reply(call, &resp.base);
    print_nodes(s);
}

static void on_heartbeat(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    const Tandem__Control__V1__HeartbeatRequest *q = (const void *)msg;
    Tandem__Control__V1__HeartbeatResponse resp = TANDEM__CONTROL__V1__HEARTBEAT_RESPONSE__INIT;
    int32_t idx = q->node_id ? router_registry_find(s->reg, q->node_id) : -1;
    if (idx < 0 || s->peers[idx].generation != q->epoch) {
        resp.reregister = true;
    } else {
        router_node_load_t l = {0};
        if (q->load) {
            l.queued_prefill_tokens = (int64_t)q->load->queued_prefill_tokens;
            l.running_seqs = (int32_t)q->load->running_sequences;
            l.free_blocks = (int32_t)q->load->free_kv_blocks;
            l.step_ms = q->load->n_recent_step_s ? q->load->recent_step_s[q->load->n_recent_step_s - 1] * 1e3 : 0;
        }
        router_registry_heartbeat(s->reg, q->node_id, &l, (int64_t)td_now_ns());
    }
    td_grpc_call_reply(call, &resp.base);
}

/* ---- gateway API ----------------------------------------------------------------------- */

static void on_generate_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    router_req_t *r = call_data;
    if (r) {
        r->call = NULL;
        release_lease(r, why == TD_ERR_TIMEOUT ? TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_DEADLINE
                                               : TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_CANCELLED);
        count_outcome(r->s, why == TD_ERR_TIMEOUT ? "deadline" : "cancelled");
        req_free(r);
    }
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
}

static void on_generate(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    const Tandem__V1__GenerateRequest *q = (const void *)msg;
    if (s->shutting_down) {
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "router shutting down");
        return;
    }
    if (q->model[0] && strcmp(q->model, s->cfg.model_name)) {
        td_grpc_call_finish(call, TD_GRPC_NOT_FOUND, "unknown model (see ListModels)");
        return;
    }
    if (s->n_active >= s->cfg.max_active) {
        count_outcome(s, "exhausted");
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "router: too many requests in flight");
        return;
    }
    if (q->n_stop_ids > ROUTER_MAX_STOP_IDS || q->n_stop_strings > TD_STOP_MAX_STRINGS) {
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, "too many stop ids or stop strings");
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
    int32_t vocab = s->tok ? td_tokenizer_vocab_size(s->tok) : INT32_MAX;
    if (q->n_prompt_ids) {
        if (!(r->prompt = malloc(q->n_prompt_ids * sizeof(int32_t))))
            st = TD_ERR_NOMEM;
        for (size_t i = 0; st == TD_OK && i < q->n_prompt_ids; i++) {
            if (q->prompt_ids[i] >= (uint32_t)vocab)
                st = TD_ERR_INVALID;
            else
                r->prompt[i] = (int32_t)q->prompt_ids[i];
        }
        r->n_prompt = (int32_t)q->n_prompt_ids;
    } else if (!s->tok) {
        st = TD_ERR_INVALID; /* no tokenizer: ids only */
    } else {
        size_t n = 0;
        unsigned flags = td_tokenizer_bos_id(s->tok) >= 0 ? TD_TOK_ADD_BOS : 0;
        st = td_tokenizer_encode(s->tok, q->prompt, strlen(q->prompt), flags, &r->prompt, &n);
        r->n_prompt = (int32_t)n;
    }
    char why[256] = "the prompt is empty or has ids outside the vocabulary";
    tandem__control__v1__sampling_params__init(&r->sampling);
    td_sampling_t ts = td_sampling_default();
    if (q->sampling) {
        ts.temperature = q->sampling->temperature;
        ts.top_k = (int32_t)TD_MIN(q->sampling->top_k, (uint32_t)INT32_MAX);
        ts.top_p = q->sampling->top_p > 0 ? q->sampling->top_p : 1.0f;
        ts.min_p = q->sampling->min_p;
        ts.repetition_penalty = q->sampling->repetition_penalty > 0 ? q->sampling->repetition_penalty : 1.0f;
        ts.seed = q->sampling->seed;
    }
    if (st == TD_OK && r->n_prompt > 0 && td_sampling_validate(&ts, why, sizeof why) != TD_OK)
        st = TD_ERR_INVALID;
    if (st == TD_OK && q->n_stop_strings && !s->tok)
        st = TD_ERR_INVALID;
    if (st == TD_OK && r->n_prompt > 0 && q->n_stop_strings &&
        (td_stop_create((const char *const *)q->stop_strings, (int32_t)q->n_stop_strings, &r->stop) != TD_OK))
        st = TD_ERR_INVALID;
    if (st != TD_OK || r->n_prompt == 0) {
        free(r->prompt);
        td_stop_destroy(r->stop);
        free(r);
        count_outcome(s, "invalid");
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, why);
        return;
    }
    r->sampling.temperature = ts.temperature;
    r->sampling.top_k = (uint32_t)ts.top_k;
    r->sampling.top_p = ts.top_p;
    r->sampling.min_p = ts.min_p;
    r->sampling.repetition_penalty = ts.repetition_penalty;
    r->sampling.seed = ts.seed;
    r->max_tokens = q->max_tokens ? (int32_t)TD_MIN(q->max_tokens, (uint32_t)INT32_MAX) : (int32_t)s->cfg.default_max_tokens;
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
    r->next = s->reqs;
    if (s->reqs)
        s->reqs->prev = r;
    s->reqs = r;
    s->n_active++;
    td_metric_set(s->m_active, s->n_active);
    req_start(r);
}

static void on_list_models(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    Tandem__V1__ModelInfo mi = TANDEM__V1__MODEL_INFO__INIT;
    mi.name = (char *)s->cfg.model_name;
    mi.vocab_size = s->tok ? (uint32_t)td_tokenizer_vocab_size(s->tok) : 0;
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

static void on_cluster_status(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
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
        x->role = nd->info.role == ROUTER_ROLE_DECODE ? TANDEM__V1__NODE_ROLE__NODE_ROLE_DECODE
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
    td_grpc_call_reply(call, &resp.base);
    free(ptrs);
    free(st);
}

static void on_health(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    router_state_t *s = data;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    resp.status = s->shutting_down ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
                                   : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    td_grpc_call_reply(call, &resp.base);
}

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
            if (n->info.role == ROUTER_ROLE_DECODE)
                decode_lost(s, i, "decode node stopped heartbeating");
            router_registry_leave(s->reg, n->info.id);
            s->peers[i].generation++;
            peer_drop(s, i);
            changed = true;
        }
    }
    if (changed)
        print_nodes(s);
}

static void shutdown_begin(router_state_t *s)
{
    if (s->shutting_down)
        return;
    s->shutting_down = true;
    td_info("router: shutting down");
    while (s->reqs)
        req_fail(s->reqs, TD_GRPC_UNAVAILABLE, "router shutting down", "unavailable");
    for (int32_t i = 0; i < (int32_t)s->cfg.max_nodes; i++)
        peer_drop(s, i);
    td_grpc_server_close(s->gateway, NULL, NULL);
    td_grpc_server_close(s->control, NULL, NULL);
    td_http_server_close(s->http, NULL, NULL);
    s->gateway = s->control = NULL;
    s->http = NULL;
    if (s->handles_up) {
        uv_close((uv_handle_t *)&s->tick, NULL);
        uv_close((uv_handle_t *)&s->sigint, NULL);
        uv_close((uv_handle_t *)&s->sigterm, NULL);
    }
}

static void on_signal(uv_signal_t *h, int signum)
{
    shutdown_begin(h->data);
}

static td_status_t add_methods(router_state_t *s)
{
    td_status_t st;
    if ((st = td_grpc_server_add_method(s->gateway, "/tandem.v1.Generation/Generate",
                                        &tandem__v1__generate_request__descriptor, on_generate, s)) ||
        (st = td_grpc_server_add_method(s->gateway, "/tandem.v1.Generation/ListModels",
                                        &tandem__v1__list_models_request__descriptor, on_list_models, s)) ||
        (st = td_grpc_server_add_method(s->gateway, "/tandem.v1.Generation/ClusterStatus",
                                        &tandem__v1__cluster_status_request__descriptor, on_cluster_status, s)) ||
        (st = td_grpc_server_add_method(s->gateway, "/grpc.health.v1.Health/Check",
                                        &grpc__health__v1__health_check_request__descriptor, on_health, s)) ||
        (st = td_grpc_server_add_method(s->control, "/tandem.control.v1.Registry/RegisterNode",
                                        &tandem__control__v1__register_request__descriptor, on_register, s)) ||
        (st = td_grpc_server_add_method(s->control, "/tandem.control.v1.Registry/Heartbeat",
                                        &tandem__control__v1__heartbeat_request__descriptor, on_heartbeat, s)))
        return st;
    return TD_OK;
}

static td_status_t init_metrics(router_state_t *s)
{
    td_metrics_t *m = s->metrics;
    const char *outcome[] = {"outcome"};
    td_status_t st;
    if ((st = td_metrics_register(m, TD_METRIC_COUNTER, "tandem_router_requests_total",
                                  "Generate requests by outcome (ok, cancelled, deadline, exhausted, invalid, unavailable)",
                                  outcome, 1, NULL, 0, &s->f_requests)) ||
        (st = td_metrics_histogram(m, "tandem_router_ttft_seconds", "request arrival to first token sent",
                                   td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_ttft)) ||
        (st = td_metrics_histogram(m, "tandem_router_tpot_seconds", "time per output token after the first",
                                   td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_tpot)) ||
        (st = td_metrics_gauge(m, "tandem_router_active_requests", "requests in flight", &s->m_active)) ||
        (st = td_metrics_counter(m, "tandem_router_relayed_tokens_total", "tokens relayed to gateways", &s->m_tokens)) ||
        (st = td_metrics_counter(m, "tandem_router_retries_total", "requests retried on another pair", &s->m_retries)) ||
        (st = td_metrics_gauge(m, "tandem_router_prefill_nodes_up", "prefill nodes registered and live", &s->m_nodes_prefill)) ||
        (st = td_metrics_gauge(m, "tandem_router_decode_nodes_up", "decode nodes registered, live and streaming", &s->m_nodes_decode)))
        return st;
    return TD_OK;
}

int router_main(int argc, char **argv)
{
    router_state_t st_, *s = &st_;
    memset(s, 0, sizeof *s);
    router_config_t *cfg = &s->cfg;
    *cfg = (router_config_t){.model_name = "default", .host = "127.0.0.1", .port = 0, .control_port = 0,
                             .max_active = 1024, .default_max_tokens = 256, .lease_ms = 10000,
                             .rpc_timeout_ms = 5000, .heartbeat_ms = 200, .heartbeat_timeout_ms = 1500,
                             .max_nodes = 256};
    const router_conf_key_t keys[] = {
        {"tokenizer", ROUTER_CONF_STR, &cfg->tokenizer, 0, 0, "tokenizer path (none: prompts as ids only, no text)"},
        {"model-name", ROUTER_CONF_STR, &cfg->model_name, 0, 0, "the model name served"},
        {"host", ROUTER_CONF_STR, &cfg->host, 0, 0, "address to serve on"},
        {"port", ROUTER_CONF_I64, &cfg->port, 0, 65535, "gateway gRPC port (0 = any)"},
        {"control-port", ROUTER_CONF_I64, &cfg->control_port, 0, 65535, "control gRPC port (0 = any)"},
        {"metrics-port", ROUTER_CONF_I64, &cfg->metrics_port, 0, 65535, "/metrics port (0 = any)"},
        {"max-active", ROUTER_CONF_I64, &cfg->max_active, 1, 1 << 20, "requests in flight at most"},
        {"default-max-tokens", ROUTER_CONF_I64, &cfg->default_max_tokens, 1, 1 << 20, "max_tokens when a request gives 0"},
        {"lease-ms", ROUTER_CONF_I64, &cfg->lease_ms, 10, 600000, "decode lease and prefill bound"},
        {"rpc-timeout-ms", ROUTER_CONF_I64, &cfg->rpc_timeout_ms, 10, 600000, "bound of Admit/Release calls"},
        {"heartbeat-ms", ROUTER_CONF_I64, &cfg->heartbeat_ms, 10, 60000, "heartbeat interval asked of nodes"},
        {"heartbeat-timeout-ms", ROUTER_CONF_I64, &cfg->heartbeat_timeout_ms, 20, 600000, "silence before a node is dropped"},
        {"max-nodes", ROUTER_CONF_I64, &cfg->max_nodes, 1, 65536, "registered nodes at most"},
        {"log-level", ROUTER_CONF_STR, &cfg->log_level, 0, 0, "error|warn|info|debug"},
    };
    int n_keys = (int)TD_ARRAY_LEN(keys);
    router_conf_store_t store;
    bool help;
    if (router_conf_parse("router", keys, n_keys, argc, argv, &store, &help) != TD_OK) {
        router_conf_free(&store);
        return 2;
    }
    if (help) {
        router_conf_usage("router", keys, n_keys);
        router_conf_free(&store);
        return 0;
    }
    if ((cfg->log_level && td_log_parse_level(cfg->log_level) < 0)) {
        fprintf(stderr, "tandem router: bad --log-level\n");
        router_conf_free(&store);
        return 2;
    }
    if (cfg->log_level)
        td_log_set_level((td_log_level_t)td_log_parse_level(cfg->log_level));
    int rc = 1;
    uv_loop_init(&s->loop);
    td_status_t st;
    router_registry_config_t rc_ = router_registry_config_default();
    rc_.max_nodes = (int32_t)cfg->max_nodes;
    rc_.heartbeat_timeout_ns = cfg->heartbeat_timeout_ms * 1000000;
    s->policy = router_policy_config_default();
    if ((cfg->tokenizer && (st = td_tokenizer_load(cfg->tokenizer, &s->tok)) != TD_OK) ||
        (st = router_registry_create(&rc_, &s->reg)) != TD_OK)
        goto out;
    if (!(s->peers = calloc((size_t)cfg->max_nodes, sizeof *s->peers))) {
        td_errorf(TD_ERR_NOMEM, "router: out of memory");
        goto out;
    }
    for (int64_t i = 0; i < cfg->max_nodes; i++)
        s->peers[i].s = s;
    if ((st = td_metrics_create(&s->metrics)) != TD_OK || (st = init_metrics(s)) != TD_OK)
        goto out;
    td_grpc_server_config_t gc = td_grpc_server_config_default();
    gc.host = cfg->host;
    gc.port = (uint16_t)cfg->port;
    gc.metrics = s->metrics;
    if ((st = td_grpc_server_create(&s->loop, &gc, &s->gateway)) != TD_OK)
        goto out;
    gc.port = (uint16_t)cfg->control_port;
    if ((st = td_grpc_server_create(&s->loop, &gc, &s->control)) != TD_OK || (st = add_methods(s)) != TD_OK)
        goto out;
    td_http_config_t hc = td_http_config_default();
    hc.host = cfg->host;
    hc.port = (uint16_t)cfg->metrics_port;
    hc.handler = td_http_metrics_handler;
    hc.handler_data = s->metrics;
    if ((st = td_http_server_create(&s->loop, &hc, &s->http)) != TD_OK)
        goto out;
    uv_timer_init(&s->loop, &s->tick);
    s->tick.data = s;
    uv_timer_start(&s->tick, on_tick, 100, 100);
    uv_signal_init(&s->loop, &s->sigint);
    uv_signal_init(&s->loop, &s->sigterm);
    s->sigint.data = s->sigterm.data = s;
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    s->handles_up = true;
    printf("gateway: %s:%u\ncontrol: %s:%u\nmetrics: http://%s:%u/metrics\n", cfg->host,
           td_grpc_server_port(s->gateway), cfg->host, td_grpc_server_port(s->control), cfg->host,
           td_http_server_port(s->http));
    fflush(stdout);

    uv_run(&s->loop, UV_RUN_DEFAULT);
    rc = 0;
out:
    if (!s->shutting_down) {
        shutdown_begin(s);
        uv_run(&s->loop, UV_RUN_DEFAULT);
    }
    if (uv_loop_close(&s->loop) != 0)
        td_warn("router: loop closed with handles open");
    for (int64_t i = 0; s->peers && i < cfg->max_nodes; i++)
        free(s->peers[i].xfer_desc);
    free(s->peers);
    router_registry_destroy(s->reg);
    td_tokenizer_destroy(s->tok);
    td_metrics_destroy(s->metrics);
    router_conf_free(&store);
    return rc;
}
