/*
 * router_request: the request lifecycle, from a Generate call accepted by the gateway to its
 * end: the text prompt's tokenization off the loop, the admission queue and its pump, the
 * pick of a pair, the Admit and Prefill calls, a retry on another pair, a node lost under
 * its requests, and the end of a request. See router_main.c for the whole path and
 * docs/cluster.md, "Router".
 *
 * One state field (router_req_t.state) and one function that changes it (req_move): it does
 * the old state's exit work and the new state's entry work, so what holds in a state (in the
 * queue, counted in n_active, a call pending) is set up and torn down in one place.
 *
 *   NEW ──text──▶ TOKENIZING ──ids──┐
 *    │ ids                          ▼
 *    └─────────────────────▶ placed: room and nothing queued ahead? ──no──▶ QUEUED
 *                                   │ yes                                     │ pump: room
 *                                   ▼                                         │
 *           ┌─────────────────▶ ADMIT ◀─────────────────────────────────────────┘
 *           │                     │ Admit answered with a lease
 *           │                     ▼
 *           │                  PREFILL ──Prefill OK──▶ RUNNING
 *           │                     │                       │
 *           │   failed before a token reached the client, a pair left to try;
 *           │   failed after (a migration: max-migrations left, the client's tokens replayed);
 *           │   or the decode node refused the Admit (full): off the node
 *           │                     ▼                       │
 *           └─placed next turn── RETRY ◀──────────────────┘
 *
 *   any state ──▶ ENDED: finished (relay), failed, cancelled, past its deadline, shutdown;
 *                  the request is freed.
 *
 * A retry is never a nested call back into the start: RETRY only marks the request, and the
 * pump (an idle handle, on the loop's next turn) places it again. A function that may end a
 * request says so, and its caller does not touch the request after it.
 */
#include "router_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router_admit.h"
#include "td_log.h"
#include "td_util.h"

static void req_move(router_req_t *r, router_req_state_t to);
static void on_pump_idle(uv_idle_t *h);

/* Room may have appeared (a request left its node, a node reported free blocks) or a
 * request waits to be placed again: the pump runs once the current callback is done (an
 * idle handle keeps the loop from blocking in poll until then), never from inside the code
 * that freed the room. */
void router_want_pump(router_state_t *s)
{
    if (s->pump_wanted || s->shutting_down || !s->handles_up || (!router_queue_len(&s->queue) && !s->n_retry))
        return;
    s->pump_wanted = true;
    uv_idle_start(&s->pump_idle, on_pump_idle);
}

void router_count_outcome(router_state_t *s, const char *outcome)
{
    td_metric_t *m;
    const char *v[] = {outcome};
    if (td_metric_family_get(s->f_requests, v, &m) == TD_OK)
        td_metric_inc(m);
}

/* A pick's placement, counted (tandem_router_prefill_placement_total: two places times the
 * reasons of router_place_reason_t, a bounded set) and said at debug level with its estimates. */
static void count_placement(router_req_t *r, const router_pick_t *pk)
{
    router_state_t *s = r->s;
    td_metric_t *m;
    const char *v[] = {pk->peer ? "peer" : pk->local ? "local" : "remote", router_place_reason_name(pk->reason)};
    if (td_metric_family_get(s->f_placement, v, &m) == TD_OK)
        td_metric_inc(m);
    const router_node_t *dn = router_registry_node_const(s->reg, pk->pair.decode);
    td_debug("request %s: %d prompt tokens prefilled %s (%s) for decode node %s; estimates local %.3f s, remote "
             "%.3f s, peer %.3f s (-1: not possible), local chunk estimated %d tokens a step", r->id, r->n_prompt, v[0],
             v[1], dn ? dn->info.id : "?", pk->local_s, pk->remote_s, pk->peer_s, pk->local ? pk->local_chunk : 0);
}

/* ---- text prompts, encoded off the loop (long ones) ------------------------------------ */

/* A text prompt is encoded on libuv's thread pool: the cost grows with the text (1.4 s for a
 * 3.9 MB prompt of one pre-token, issue 21), and this loop carries every heartbeat and
 * stream. The job owns a copy of the text and the results; its request points at it while
 * REQ_TOKENIZING. A request that ends meanwhile (cancel, deadline, shutdown) orphans it: the
 * job runs to its end and frees itself. At most max-tokenizing jobs at once. The tokenizer
 * is read-only after load, so encoding on another thread is safe. */
struct tok_job {
    uv_work_t work;               /* first: the job is its work request */
    router_req_t *r;              /* NULL once orphaned */
    router_state_t *s;
    const td_tokenizer_t *tok;
    const td_chat_template_t *chat; /* with messages: renders them into the text first */
    td_chat_message_t *messages;    /* [n_messages], strings in the same allocation */
    size_t n_messages;
    char *tools;                    /* the tools array as JSON text for the template, or NULL */
    char *text;
    size_t len;
    int32_t *ids;
    size_t n;
    td_status_t st;
    char why[256];                /* the encoder's message (td_last_error is per thread) */
};

static void tok_work(uv_work_t *w)
{
    tok_job_t *j = (tok_job_t *)w;
    if (j->n_messages) {
        free(j->text);
        j->text = NULL;
        j->st = td_chat_render_messages(j->chat, j->tok, j->messages, j->n_messages, j->tools, &j->text,
                                        &j->len);
        if (j->st == TD_OK)
            j->st = td_chat_encode(j->tok, j->text, j->len, td_tokenizer_add_bos(j->tok), &j->ids, &j->n);
    } else {
        unsigned flags = td_tokenizer_add_bos(j->tok) ? TD_TOK_ADD_BOS : 0;
        j->st = td_tokenizer_encode(j->tok, j->text, j->len, flags, &j->ids, &j->n);
    }
    if (j->st != TD_OK)
        snprintf(j->why, sizeof j->why, "%s", td_last_error());
}

static void req_arrived(router_req_t *r);

static void tok_done(uv_work_t *w, int status)
{
    (void)status; /* never cancelled: uv_cancel is not used */
    tok_job_t *j = (tok_job_t *)w;
    router_req_t *r = j->r;
    j->s->n_tokenizing--;
    free(j->text);
    free(j->messages);
    free(j->tools);
    if (!r) {
        free(j->ids);
        free(j);
        return;
    }
    r->tok_job = NULL;
    r->prompt = j->ids;
    r->n_prompt = (int32_t)TD_MIN(j->n, (size_t)INT32_MAX);
    char why[384];
    td_status_t st = j->st;
    if (st != TD_OK && st != TD_ERR_NOMEM)
        snprintf(why, sizeof why, "%s: %s",
                 j->n_messages ? "the router cannot render the conversation with the model's chat template"
                               : "the router's tokenizer cannot encode the prompt",
                 j->why);
    free(j);
    if (st == TD_ERR_NOMEM)
        router_req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, "router: out of memory", "exhausted");
    else if (st != TD_OK)
        router_req_fail(r, TD_GRPC_INVALID_ARGUMENT, why, "invalid");
    else if (r->n_prompt == 0)
        router_req_fail(r, TD_GRPC_INVALID_ARGUMENT, "the prompt text encodes to no token ids", "invalid");
    else
        req_arrived(r);
}

/* A copy of a request's conversation the thread pool can read after the front door's
 * message is gone: one allocation, the messages then their strings. NULL: out of memory. */
static td_chat_message_t *messages_copy(const td_chat_message_t *m, size_t n)
{
    size_t bytes = n * sizeof(td_chat_message_t);
    for (size_t i = 0; i < n; i++) {
        const char *f[] = {m[i].role, m[i].content, m[i].tool_calls, m[i].tool_call_id, m[i].name};
        for (size_t k = 0; k < TD_ARRAY_LEN(f); k++)
            bytes += f[k] ? strlen(f[k]) + 1 : 0;
    }
    td_chat_message_t *out = malloc(bytes);
    if (!out)
        return NULL;
    char *p = (char *)(out + n);
    for (size_t i = 0; i < n; i++) {
        const char *f[] = {m[i].role, m[i].content, m[i].tool_calls, m[i].tool_call_id, m[i].name};
        const char **to[] = {&out[i].role, &out[i].content, &out[i].tool_calls, &out[i].tool_call_id,
                             &out[i].name};
        for (size_t k = 0; k < TD_ARRAY_LEN(f); k++) {
            *to[k] = NULL;
            if (!f[k])
                continue;
            size_t l = strlen(f[k]) + 1;
            *to[k] = memcpy(p, f[k], l);
            p += l;
        }
    }
    return out;
}

/* Text this short (a prompt, or a conversation's roles and contents) is encoded on the loop:
 * the thread pool's round trip (a wakeup and two context switches each way) costs more than
 * encoding it, and was most of an OpenAI chat request's router CPU (bench router --http). */
#define ROUTER_TOKENIZE_INLINE_BYTES 2048

/* Starts encoding r's text prompt, or rendering and encoding its conversation: queued on
 * the thread pool, or with `now` only prepared (r->tok_job set, counted) for the caller to
 * run on the loop. Errors (r untouched): TD_ERR_EXHAUSTED (max-tokenizing jobs already on
 * the pool), TD_ERR_NOMEM. */
static td_status_t tok_start(router_req_t *r, const char *text, size_t len,
                             const td_chat_message_t *messages, size_t n_messages, const char *tools, bool now)
{
    router_state_t *s = r->s;
    if (!now && s->n_tokenizing >= s->cfg.max_tokenizing)
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "router: %d text prompts are being tokenized (max-tokenizing); "
                               "retry later", s->n_tokenizing);
    tok_job_t *j = calloc(1, sizeof *j);
    if (!j || !(j->text = malloc(len ? len : 1)) || (n_messages && !(j->messages = messages_copy(messages, n_messages))) ||
        (tools && n_messages && !(j->tools = strdup(tools)))) {
        if (j) {
            free(j->text);
            free(j->messages);
        }
        free(j);
        return td_errorf_quiet(TD_ERR_NOMEM, "router: out of memory");
    }
    if (len)
        memcpy(j->text, text, len);
    j->len = len;
    j->n_messages = n_messages;
    j->chat = s->chat;
    j->r = r;
    j->s = s;
    j->tok = s->tok;
    if (!now && uv_queue_work(&s->proc.loop, &j->work, tok_work, tok_done) != 0) {
        free(j->text);
        free(j->messages);
        free(j->tools);
        free(j);
        return td_errorf_quiet(TD_ERR_NOMEM, "router: cannot queue the prompt's tokenization");
    }
    s->n_tokenizing++;
    r->tok_job = j;
    return TD_OK;
}

/* ---- deadlines ----------------------------------------------------------------------- */

static bool past_deadline(const router_req_t *r)
{
    return r->deadline_ns && (int64_t)td_now_ns() >= r->deadline_ns;
}

/* An outgoing call's deadline: its own bound, or less when the request's runs out first
 * (remembered, so that the call's DEADLINE_EXCEEDED is the request's: the node call is timed
 * on the loop's millisecond clock and may expire just before td_now_ns passes deadline_ns). */
static uint32_t call_timeout_ms(router_req_t *r, int64_t bound_ms)
{
    r->call_has_req_deadline = false;
    if (!r->deadline_ns)
        return (uint32_t)bound_ms;
    int64_t left = (r->deadline_ns - (int64_t)td_now_ns() + 999999) / 1000000;
    r->call_has_req_deadline = left <= bound_ms;
    return (uint32_t)TD_MAX(1, TD_MIN(bound_ms, left));
}

/* A node call ended with `code`: true when that is the request's own deadline passing, not a
 * fault of the node (no retry, no mark against the node). */
static bool call_hit_req_deadline(const router_req_t *r, td_grpc_code_t code)
{
    return code == TD_GRPC_DEADLINE_EXCEEDED && r->call_has_req_deadline;
}

/* ---- the end of a request -------------------------------------------------------------- */

/* Answers the client with an error (its front door's fail) and frees the request. */
void router_req_fail(router_req_t *r, td_grpc_code_t code, const char *msg, const char *outcome)
{
    router_lease_release(r, code == TD_GRPC_DEADLINE_EXCEEDED ? TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_DEADLINE
                                                       : TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_FAILED);
    if (r->client) {
        r->sink->fail(r, code, msg);
        r->client = NULL;
    }
    router_count_outcome(r->s, outcome);
    router_req_end(r);
}

/* The front door's client went away (a cancel, a reset or closed connection, or its own
 * deadline: `deadline`), r->client already cleared by the front door: the lease is released
 * (its blocks freed on the decode node) and r ends. */
void router_req_client_gone(router_req_t *r, bool deadline)
{
    /* a client's own deadline timer often resets the stream just before ours fires */
    deadline = deadline || (r->deadline_ns && (int64_t)td_now_ns() + ROUTER_DEADLINE_SLACK_NS >= r->deadline_ns);
    r->client = NULL;
    router_lease_release(r, deadline ? TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_DEADLINE
                                     : TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_CANCELLED);
    router_count_outcome(r->s, deadline ? "deadline" : "cancelled");
    router_req_end(r);
}

/* The client's stream drained below its bound: the pending output goes out now. */
void router_req_writable(router_req_t *r)
{
    r->blocked = false;
    router_out_flush(r, td_now_ns());
}

/* Frees r (the move to ENDED); the caller has answered or detached its client. */
void router_req_end(router_req_t *r)
{
    req_move(r, REQ_ENDED);
}

/*
 * r's pair failed after tokens reached its client: the stream moves to another pair (RETRY,
 * placed by the pump like a retry) that re-prefills the prompt and replays the tokens the
 * client has (r->resumed; AdmitRequest.replay_ids), so it continues with exactly the tokens
 * the lost pair would have sent; at most max-migrations times, then UNAVAILABLE naming why.
 * Ends r or moves it off its node.
 */
static void req_migrate_or_fail(router_req_t *r, const char *why)
{
    router_state_t *s = r->s;
    char msg[384];
    if (r->finish_deferred) { /* the decode node had finished it: only token 0's logprob was due */
        router_req_finish(r, r->deferred_reason);
        return;
    }
    router_model_facts_t mf;
    router_admit_model_facts(s->reg, s->proc.cfg.model_name, (int64_t)td_now_ns(), &mf);
    if (r->completion >= (uint32_t)r->max_tokens ||
        (mf.max_seq_len && (int64_t)r->n_prompt + r->completion >= mf.max_seq_len)) {
        router_req_finish(r, ROUTER_FINISH_LENGTH); /* it was done: the finish entry was lost with the node */
        return;
    }
    if (r->n_migrations >= s->cfg.max_migrations) {
        if (s->cfg.max_migrations)
            snprintf(msg, sizeof msg, "request %s failed after %u tokens: %s; it moved to another pair %d times "
                     "already (max-migrations %lld)", r->id, r->completion, why, r->n_migrations,
                     (long long)s->cfg.max_migrations);
        else
            snprintf(msg, sizeof msg, "request %s failed after %u tokens: %s; streams are not moved "
                     "(max-migrations 0)", r->id, r->completion, why);
        router_req_fail(r, TD_GRPC_UNAVAILABLE, msg, "unavailable");
        return;
    }
    r->n_migrations++;
    td_metric_inc(s->m_migrations);
    td_info("request %s: moving to another pair after %u tokens (%s), move %d of at most %lld", r->id,
            r->completion, why, r->n_migrations, (long long)s->cfg.max_migrations);
    snprintf(r->retry_why, sizeof r->retry_why, "%s", why);
    if (r->first_lp_wait) { /* token 0 came from the lost decode node; its logprob was due from the Prefill */
        td_warn("request %s: token 0's log-probability was lost with its pair; it goes out with logprob 0", r->id);
        r->first_lp_wait = false;
    }
    r->resumed = r->completion;
    if (!r->t_lost)
        r->t_lost = td_now_ns();
    r->decode_tokens = 0;
    r->tried[0] = r->pick.pair; /* not that pair again; a lost node is down anyway */
    r->n_tried = 1;
    req_move(r, REQ_RETRY);
    router_out_flush(r, td_now_ns()); /* output held for token 0's logprob, if any */
}

/* A pair failed: before a token reached the client, another pair once (RETRY), else
 * UNAVAILABLE; after, a migration (req_migrate_or_fail). Ends r or moves it off its node. */
void router_req_retry_or_fail(router_req_t *r, td_grpc_code_t code, const char *why)
{
    router_lease_release(r, TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_FAILED);
    if (past_deadline(r) || call_hit_req_deadline(r, code)) {
        router_req_fail(r, TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded", "deadline");
        return;
    }
    if (r->completion) {
        req_migrate_or_fail(r, why);
        return;
    }
    if (r->n_tried < 2) {
        td_info("request %s: retrying on another pair (%s)", r->id, why);
        snprintf(r->retry_why, sizeof r->retry_why, "%s", why);
        td_metric_inc(r->s->m_retries);
        r->first_src = FIRST_NONE;
        req_move(r, REQ_RETRY);
        return;
    }
    char msg[256];
    snprintf(msg, sizeof msg, "request %s failed: %s", r->id, why);
    router_req_fail(r, TD_GRPC_UNAVAILABLE, msg, "unavailable");
}

/* r's decode node is gone, or dropped r's sequence: the lease went with it (no Release). */
void router_req_lost(router_req_t *r, const char *why)
{
    router_lease_forget(r);
    router_req_retry_or_fail(r, TD_GRPC_UNAVAILABLE, why);
}

/* A decode node is gone (its Steps stream ended, it went silent, or it registered again):
 * the requests on it fail over. */
void router_decode_lost(router_state_t *s, int32_t d, const char *why)
{
    router_peer_t *p = &s->peers[d];
    router_node_t *n = router_registry_node(s->reg, d);
    if (n)
        n->up = false; /* so that the retries below go elsewhere */
    TD_LIST_FOREACH_SAFE(it, &s->reqs) {
        router_req_t *r = TD_CONTAINER_OF(it, router_req_t, link);
        if (router_req_on_node(r) && r->pick.pair.decode == d && r->decode_gen == p->generation)
            router_req_lost(r, why);
    }
}

/* ---- node calls ---------------------------------------------------------------------- */

static void on_prefill_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    router_req_t *r = data;
    if (r->pending != c)
        return;
    const Tandem__Control__V1__PrefillResponse *p = (const void *)msg;
    if (r->resumed) {
        /* a moved stream: the prompt's token 0 again, which the client has (a unified node
         * answers with its first entry instead: token `resumed`, relayed from Steps) */
        if (p->phase != TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_KV_DELIVERED &&
            r->pick.pair.prefill != r->pick.pair.decode && p->first_token != r->gen[0]) {
            td_warn("request %s: moved, the new prefill node's first token is %u, the client got %u", r->id,
                    p->first_token, r->gen[0]);
            td_metric_inc(r->s->m_first_mismatch);
        }
        return;
    }
    switch (p->phase) {
    case TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_KV_DELIVERED: r->transfer_s = p->transfer_s; return;
    case TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_FIRST_TOKEN:
        r->prefill_s = p->prefill_s;
        r->cached = p->cached_tokens;
        break;
    default: /* a one-message prefill node: first token and KV delivered at once */
        r->prefill_s = p->prefill_s;
        r->transfer_s = p->transfer_s;
        r->cached = p->cached_tokens;
        break;
    }
    router_first_from_prefill(r, p); /* may end r */
}

/* A node whose channel failed is not chosen again until it registers anew (its
 * heartbeats are answered "reregister" meanwhile), so a retry goes elsewhere. */
static void node_unreachable(router_state_t *s, int32_t idx)
{
    router_node_t *n = idx >= 0 ? router_registry_node(s->reg, idx) : NULL;
    if (n && (!s->peers[idx].ch || !td_grpc_channel_is_usable(s->peers[idx].ch)))
        n->up = false;
}

static void on_prefill_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    router_req_t *r = data;
    if (r->pending != c)
        return; /* request already gone */
    r->pending = NULL;
    if (code != TD_GRPC_OK) {
        node_unreachable(r->s, r->pick.pair.prefill);
        router_req_retry_or_fail(r, code, msg[0] ? msg : td_grpc_code_name(code));
        return;
    }
    req_move(r, REQ_RUNNING);
    if (r->client && r->sink->prefilled)
        r->sink->prefilled(r);
}

static void on_admit_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    router_req_t *r = data;
    if (r->pending != c || r->have_lease)
        return;
    const Tandem__Control__V1__AdmitResponse *a = (const void *)msg;
    free(r->blocks);
    r->n_blocks = 0;
    if ((r->blocks = malloc((a->n_block_ids + 1) * sizeof *r->blocks))) {
        if (a->n_block_ids)
            memcpy(r->blocks, a->block_ids, a->n_block_ids * sizeof *r->blocks);
        r->n_blocks = a->n_block_ids;
    }
    r->xfer_token_len = a->xfer_token.len == sizeof r->xfer_token ? sizeof r->xfer_token : 0;
    if (r->xfer_token_len)
        memcpy(r->xfer_token, a->xfer_token.data, sizeof r->xfer_token);
    router_lease_set(r, a->lease_id);
    if (!r->resumed) /* a moved stream keeps its first pair's figure */
        r->cached = a->cached_tokens;
}

static void on_admit_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    router_req_t *r = data;
    if (r->pending != c)
        return; /* request already gone */
    r->pending = NULL;
    router_state_t *s = r->s;
    int32_t d = r->pick.pair.decode;
    if (code == TD_GRPC_RESOURCE_EXHAUSTED && !r->have_lease && !past_deadline(r)) {
        /* fuller than its last report: believe it full until it reports again, and wait in
         * the queue at the request's old place (the pair is not used up as a retry) */
        router_node_t *n = router_registry_node(s->reg, d);
        if (n && s->peers[d].generation == r->decode_gen) {
            n->load.free_blocks = 0;
            s->peers[d].admit_refused = true;
        }
        r->n_tried--;
        req_move(r, REQ_RETRY);
        return;
    }
    if (code == TD_GRPC_INVALID_ARGUMENT) { /* e.g. longer than the model: no other node takes it */
        router_req_fail(r, TD_GRPC_INVALID_ARGUMENT, msg[0] ? msg : "the decode node refused the request as invalid", "invalid");
        return;
    }
    if (code != TD_GRPC_OK || !r->have_lease) {
        node_unreachable(s, d);
        router_req_retry_or_fail(r, code, msg[0] ? msg : td_grpc_code_name(code));
        return;
    }
    req_move(r, REQ_PREFILL);
}


/* ADMIT's entry work: the Admit call to the picked decode node. May end r or move it on. */
static void send_admit(router_req_t *r)
{
    router_state_t *s = r->s;
    Tandem__Control__V1__AdmitRequest q = TANDEM__CONTROL__V1__ADMIT_REQUEST__INIT;
    Tandem__V1__SamplingParams sp;
    td_node_sampling_to_proto(&r->sampling, &sp);
    q.request_id = r->id;
    q.prompt_tokens = (uint32_t)r->n_prompt;
    q.max_tokens = (uint32_t)r->max_tokens;
    q.lease_ms = (uint32_t)r->lease_ttl_ms;
    q.sampling = &sp;
    q.ignore_eos = r->ignore_eos;
    q.stop_ids = r->stop_ids;
    q.n_stop_ids = r->n_stop_ids;
    q.prompt_ids = (uint32_t *)r->prompt;
    q.n_prompt_ids = (size_t)r->n_prompt;
    Tandem__V1__LogprobsRequest lq;
    td_node_logprobs_to_proto(&r->logprobs, &lq);
    q.logprobs = r->logprobs.on ? &lq : NULL;
    q.replay_ids = r->gen; /* a moved stream: what its client has */
    q.n_replay_ids = r->resumed;
    q.cache_salt = r->cache_salt;
    q.local_prefill = r->pick.pair.prefill == r->pick.pair.decode; /* no transfer: it prefills the prompt */
    q.tpot_objective_s = (float)r->pick.tpot_objective_s; /* the node bounds its chunks by it */
    q.grammar = r->grammar ? r->grammar : "";
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__admit_response__descriptor,
                             .on_message = on_admit_msg, .on_done = on_admit_done, .data = r,
                             .timeout_ms = call_timeout_ms(r, s->cfg.rpc_timeout_ms)};
    router_peer_t *dp = &s->peers[r->pick.pair.decode];
    if (!dp->ch || !dp->steps ||
        td_grpc_channel_call(dp->ch, "/tandem.control.v1.DecodeNode/Admit", &q.base, &o, &r->pending) != TD_OK) {
        r->pending = NULL;
        node_unreachable(s, r->pick.pair.decode);
        router_req_retry_or_fail(r, TD_GRPC_UNAVAILABLE, "decode node unreachable");
    }
}

/* PREFILL's entry work: the Prefill call to the picked prefill node, with the lease the
 * Admit got. May end r or move it on. */
static void send_prefill(router_req_t *r)
{
    router_state_t *s = r->s;
    int32_t d = r->pick.pair.decode;
    router_peer_t *pp = &s->peers[r->pick.pair.prefill], *dp = &s->peers[d];
    const router_node_t *dn = router_registry_node_const(s->reg, d);
    Tandem__Control__V1__PrefillRequest q = TANDEM__CONTROL__V1__PREFILL_REQUEST__INIT;
    Tandem__V1__SamplingParams sp;
    td_node_sampling_to_proto(&r->sampling, &sp);
    q.request_id = r->id;
    q.tokens = (uint32_t *)r->prompt;
    q.n_tokens = (size_t)r->n_prompt;
    q.decode_node_id = dn ? (char *)dn->info.id : "";
    q.block_ids = r->blocks;
    q.n_block_ids = r->n_blocks;
    q.lease_id = r->lease_id;
    q.xfer_token.data = r->xfer_token;
    q.xfer_token.len = r->xfer_token_len;
    q.sampling = &sp;
    q.decode_xfer.data = dp->xfer_desc;
    q.decode_xfer.len = dp->xfer_desc_len;
    Tandem__V1__LogprobsRequest lq;
    td_node_logprobs_to_proto(&r->logprobs, &lq);
    q.logprobs = r->logprobs.on && !r->resumed ? &lq : NULL; /* moved: the client has token 0's */
    q.cache_salt = r->cache_salt;
    q.grammar = r->grammar ? r->grammar : "";
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__prefill_response__descriptor,
                             .on_message = on_prefill_msg, .on_done = on_prefill_done, .data = r,
                             .timeout_ms = call_timeout_ms(r, r->lease_ttl_ms)};
    r->t_prefill = td_now_ns();
    if (!pp->ch ||
        td_grpc_channel_call(pp->ch, "/tandem.control.v1.PrefillNode/Prefill", &q.base, &o, &r->pending) != TD_OK) {
        r->pending = NULL;
        node_unreachable(s, r->pick.pair.prefill);
        router_req_retry_or_fail(r, TD_GRPC_UNAVAILABLE, "prefill node unreachable");
    }
}

/* ---- placing a request on a pair ------------------------------------------------------- */

/* The checks that depend on the model's live nodes (router_admit): prompt and logit_bias ids within its
 * vocabulary, prompt + max_tokens within its largest decode pool. Run at arrival and again
 * when the request is put on a pair (nodes may have come meanwhile). False: `why` says why. */
static bool req_admissible(const router_req_t *r, char *why, size_t why_len)
{
    const router_state_t *s = r->s;
    const char *model = s->proc.cfg.model_name;
    int64_t now = (int64_t)td_now_ns();
    router_model_facts_t mf;
    router_admit_model_facts(s->reg, model, now, &mf);
    if (r->logprobs.prompt && r->n_prompt > TD_LOGPROBS_MAX_PROMPT) {
        snprintf(why, why_len, "prompt_logprobs asked for a prompt of %d tokens, at most %d allowed", r->n_prompt,
                 TD_LOGPROBS_MAX_PROMPT);
        return false;
    }
    if (!td_sampling_check_bias(&r->sampling, mf.vocab_size, why, why_len)) /* ids: the model's vocabulary */
        return false;
    return router_admit_check_ids(r->prompt, r->n_prompt, mf.vocab_size, model, r->from_text, why, why_len) == TD_OK &&
           router_admit_check_size(s->reg, model, r->n_prompt, r->max_tokens, now, why, why_len) == TD_OK;
}

/* How long a pick's decode lease lives, and its Prefill call may take: lease-ms for the
 * transfer and the node calls, plus twice the time the prefill node is estimated to need
 * before this prompt's first token (router_policy: its queued work at its reported rate), so
 * a long prompt on a slow node or behind a queue is not cut off by a fixed bound, while a
 * lost router still frees the blocks in bounded time. At most 600 s (the decode node's
 * max-lease-ms caps it too). */
static int64_t lease_ttl(const router_state_t *s, const router_pick_t *pick)
{
    double ms = (double)s->cfg.lease_ms + 2e3 * pick->prefill_wait_s;
    return (int64_t)TD_MIN(ms, 600000.0);
}

typedef enum { START_OK, START_NO_ROOM, START_ENDED } router_start_t;

/* Puts r on a pair now (moves it to ADMIT): START_OK (r may since have moved on, or ended:
 * do not touch it), START_NO_ROOM (no decode node has room: r untouched), START_ENDED (r
 * failed and is freed). */
static router_start_t req_start(router_req_t *r)
{
    router_state_t *s = r->s;
    if (past_deadline(r)) {
        router_req_fail(r, TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded before a decode node had room", "deadline");
        return START_ENDED;
    }
    char why[384];
    if (!req_admissible(r, why, sizeof why)) {
        router_req_fail(r, TD_GRPC_INVALID_ARGUMENT, why, "invalid");
        return START_ENDED;
    }
    router_pick_request_t pr = {.model = s->proc.cfg.model_name, .prompt = r->prompt, .n_prompt = r->n_prompt,
                                .max_tokens = r->max_tokens, .exclude = r->tried, .n_exclude = r->n_tried,
                                .prompt_logprobs = r->logprobs.prompt, .now_ns = (int64_t)td_now_ns(),
                                .cache_salt = r->cache_salt, .tpot_objective_s = r->tpot_objective_s};
    router_pick_t pick;
    td_status_t st = router_policy_pick(s->reg, &s->policy, &pr, &pick);
    if (st != TD_OK) {
        if (st == TD_ERR_EXHAUSTED)
            return START_NO_ROOM;
        if (st == TD_ERR_RANGE) { /* the size check above saw the same registry: not reached */
            router_req_fail(r, TD_GRPC_INVALID_ARGUMENT, td_last_error(), "invalid");
        } else {
            char why[384]; /* the policy's reason, copied before the release can log another */
            if (r->retry_why[0] && r->completion)
                snprintf(why, sizeof why, "request %s failed on its pair after %u tokens (%s) and cannot move: %s",
                         r->id, r->completion, r->retry_why, td_last_error());
            else if (r->retry_why[0])
                snprintf(why, sizeof why, "request %s failed on its pair (%s) and %s", r->id, r->retry_why,
                         td_last_error());
            else
                snprintf(why, sizeof why, "%s", td_last_error());
            router_req_fail(r, TD_GRPC_UNAVAILABLE, why, "unavailable");
        }
        return START_ENDED;
    }
    router_policy_commit(s->reg, &pr, &pick);
    count_placement(r, &pick);
    r->pick = pick;
    r->tried[r->n_tried++] = pick.pair;
    r->decode_gen = s->peers[pick.pair.decode].generation;
    if (!r->t_picked) /* the first pick only (an Admit refusal or a retry picks again) */
        td_metric_observe(s->m_queue_s, (double)(td_now_ns() - r->t_arrival) * 1e-9);
    r->t_picked = td_now_ns();
    r->lease_ttl_ms = lease_ttl(s, &pick);
    req_move(r, REQ_ADMIT);
    return START_OK;
}

/* A request without a node (its prompt ids known, or back for a retry or after an Admit
 * refusal): started at once when nothing waits ahead of it and there is room, else queued
 * at its place; a full queue refuses it (RESOURCE_EXHAUSTED). May end r. */
static void req_place(router_req_t *r)
{
    router_state_t *s = r->s;
    if (router_queue_len(&s->queue) == 0 && s->n_active < s->cfg.max_active && req_start(r) != START_NO_ROOM)
        return;
    req_move(r, REQ_QUEUED);
}

/* A request whose prompt ids are known: checked against the model's live nodes
 * (router_admit), then placed. May end r. */
static void req_arrived(router_req_t *r)
{
    char why[384];
    if (!req_admissible(r, why, sizeof why)) {
        router_req_fail(r, TD_GRPC_INVALID_ARGUMENT, why, "invalid");
        return;
    }
    td_metric_observe(r->s->m_prompt_tokens, (double)r->n_prompt);
    req_place(r);
}

/*
 * The request a front door describes, with what only the router knows checked: which prompt
 * was sent and whether this router can read it (a tokenizer for text and stop strings, a
 * chat template for a conversation). The parameters (spec->gp) are the front door's to
 * check, once (td_gen_params_validate or _check, which names the field in its own words),
 * before this is called: here they are valid, the bounds the copies below rely on asserted.
 * The model name is the front door's to check too (its error differs). TD_OK: *r_p is a new request
 * (REQ_NEW, not yet anyone's): the front door sets r->sink and r->client, then calls
 * router_req_submit with the same spec. Errors (*r_p untouched): TD_ERR_INVALID or
 * TD_ERR_NOMEM, with *code_p the code to answer and `why` the message for the client
 * (counted in the requests' outcomes here). Loop thread.
 */
td_status_t router_req_open(router_state_t *s, const router_req_spec_t *spec, td_grpc_code_t *code_p,
                            char *why, size_t why_cap, router_req_t **r_p)
{
    const td_gen_params_t *gp = &spec->gp;
    why[0] = '\0';
    TD_ASSERT(gp->max_tokens >= 0 && gp->max_tokens <= TD_GEN_MAX_TOKENS && gp->n_stop_ids <= TD_GEN_MAX_STOP_IDS &&
              gp->n_stop_strings <= TD_STOP_MAX_STRINGS && gp->prompt_len <= TD_GEN_MAX_PROMPT);
    router_req_t *r = calloc(1, sizeof *r);
    if (!r)
        goto err_nomem;
    r->s = s;
    r->t_arrival = td_now_ns();
    if (spec->request_id && spec->request_id[0])
        snprintf(r->id, sizeof r->id, "%s", spec->request_id);
    else
        snprintf(r->id, sizeof r->id, "r%llu", (unsigned long long)++s->next_id);
    td_status_t st = TD_OK;
    if (spec->n_messages) {
        if (!gp->prompt_is_text || (spec->prompt && spec->prompt_text_len)) {
            st = TD_ERR_INVALID;
            snprintf(why, why_cap, "send a conversation (messages) or a prompt (prompt or prompt_ids), not both");
        } else if (!s->chat) {
            st = TD_ERR_INVALID;
            snprintf(why, why_cap, "this router has no chat template for its model (%s): send a prompt",
                     s->tok ? "the tokenizer's model has none" : "no --tokenizer");
        } else {
            r->from_text = true; /* rendered and encoded off the loop (router_req_submit) */
        }
    } else if (!gp->prompt_is_text) {
        if ((r->prompt = malloc(gp->prompt_len * sizeof(int32_t)))) {
            for (size_t i = 0; i < gp->prompt_len; i++) /* above INT32_MAX: negative, refused later */
                r->prompt[i] = (int32_t)spec->prompt_ids[i];
            r->n_prompt = (int32_t)gp->prompt_len;
        } else {
            st = TD_ERR_NOMEM;
        }
    } else if (!spec->prompt || !spec->prompt_text_len) {
        st = TD_ERR_INVALID;
        snprintf(why, why_cap, "the prompt is empty: send prompt (text) or prompt_ids");
    } else if (!s->tok) {
        st = TD_ERR_INVALID;
        snprintf(why, why_cap, "this router has no tokenizer (--tokenizer) for a text prompt: send prompt_ids");
    } else {
        r->from_text = true; /* encoded off the loop once the rest is checked (router_req_submit) */
    }
    if (st == TD_OK && gp->n_stop_strings && !s->tok) {
        st = TD_ERR_INVALID;
        snprintf(why, why_cap, "this router has no tokenizer (--tokenizer) to match stop strings: send stop_ids");
    }
    if (st == TD_OK && (st = td_stop_create(gp->stop_strings, (int32_t)gp->n_stop_strings, &r->stop)) != TD_OK)
        snprintf(why, why_cap, "stop strings: %s", td_last_error()); /* valid: out of memory */
    if (st == TD_OK && spec->grammar && !(r->grammar = strdup(spec->grammar)))
        st = TD_ERR_NOMEM;
    if (st != TD_OK) {
        free(r->prompt);
        free(r->grammar);
        td_stop_destroy(r->stop);
        free(r);
        if (st == TD_ERR_NOMEM)
            goto err_nomem;
        router_count_outcome(s, "invalid");
        *code_p = TD_GRPC_INVALID_ARGUMENT;
        return TD_ERR_INVALID;
    }
    r->max_tokens = gp->max_tokens ? (int32_t)gp->max_tokens : (int32_t)s->cfg.default_max_tokens;
    r->sampling = gp->sampling;
    r->logprobs = gp->logprobs;
    r->ignore_eos = gp->ignore_eos;
    r->tpot_objective_s = (double)gp->tpot_objective_ms * 1e-3;
    if (gp->n_stop_ids) /* bounded by the front door's validation (asserted above) */
        memcpy(r->stop_ids, spec->stop_ids, gp->n_stop_ids * sizeof *spec->stop_ids);
    r->n_stop_ids = gp->n_stop_ids;
    if (s->tok)
        td_detok_init(&r->detok, s->tok);
    r->priority = spec->priority;
    r->cache_salt = spec->cache_salt;
    /* the client's deadline, else the configured default: bounds the queue wait, Admit,
     * Prefill and decoding */
    if (spec->timeout_ms > 0)
        r->deadline_ns = (int64_t)r->t_arrival + spec->timeout_ms * 1000000;
    else if (s->cfg.request_timeout_ms)
        r->deadline_ns = (int64_t)r->t_arrival + s->cfg.request_timeout_ms * 1000000;
    td_metric_inc(s->m_arrived);
    *r_p = r;
    return TD_OK;
err_nomem:
    router_count_outcome(s, "exhausted");
    snprintf(why, why_cap, "router: out of memory");
    *code_p = TD_GRPC_RESOURCE_EXHAUSTED;
    return TD_ERR_NOMEM;
}

/* A new request from router_req_open (its sink and client set) begins its life: a text
 * prompt or a conversation is encoded off the loop, prompt ids are checked and placed. May
 * end r (refused: its client is answered through the sink). */
void router_req_submit(router_req_t *r, const router_req_spec_t *spec)
{
    router_state_t *s = r->s;
    TD_ASSERT(r->sink && r->client && r->state == REQ_NEW);
    router_queue_entry_init(&r->qe);
    td_list_push_front(&s->reqs, &r->link);
    if (!r->from_text) {
        req_arrived(r);
        return;
    }
    /* a text prompt whose bytes already make more tokens than any node takes is refused
     * before it is encoded (a conversation is not: a template may drop or trim text) */
    char why[384];
    if (!spec->n_messages &&
        router_admit_check_text_size(s->reg, s->proc.cfg.model_name, s->tok, spec->prompt_text_len, r->max_tokens,
                                     (int64_t)td_now_ns(), why, sizeof why) != TD_OK) {
        router_req_fail(r, TD_GRPC_INVALID_ARGUMENT, why, "invalid");
        return;
    }
    bool now = (spec->n_messages ? spec->gp.prompt_len : spec->prompt_text_len) <= ROUTER_TOKENIZE_INLINE_BYTES;
    if (tok_start(r, spec->prompt, spec->n_messages ? 0 : spec->prompt_text_len, spec->messages,
                  spec->n_messages, spec->tools_json, now) != TD_OK) {
        snprintf(why, sizeof why, "%s", td_last_error());
        router_req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, why, "exhausted");
        return;
    }
    if (now) { /* the job's two halves, here: may end r */
        uv_work_t *w = &r->tok_job->work;
        tok_work(w);
        tok_done(w, 0);
        return;
    }
    req_move(r, REQ_TOKENIZING);
}

/* The pump: requests back for a retry are placed again (in the order of s->reqs, newest
 * first, as they were when a lost node failed them over at once), then the queue's head is
 * started while there is room (max-active and a decode node with room); the head waiting for
 * room holds back those behind it (FIFO within a priority). */
static void on_pump_idle(uv_idle_t *h)
{
    router_state_t *s = h->data;
    uv_idle_stop(h);
    s->pump_wanted = false;
    TD_LIST_FOREACH_SAFE(it, &s->reqs) {
        router_req_t *r = TD_CONTAINER_OF(it, router_req_t, link);
        if (!s->n_retry || s->shutting_down)
            break;
        if (r->state == REQ_RETRY)
            req_place(r); /* may end r */
    }
    router_queue_entry_t *e;
    while (!s->shutting_down && s->n_active < s->cfg.max_active && (e = router_queue_peek(&s->queue)))
        if (req_start(REQ_OF_QE(e)) == START_NO_ROOM)
            break; /* it stays at the head */
    td_metric_set(s->m_queue_depth, router_queue_len(&s->queue));
}

/* ---- the one place a request changes state --------------------------------------------- */

/*
 * Moves r from its state to `to`: the old state's exit work, then the new state's entry work.
 *   exit TOKENIZING: a job still encoding is orphaned (it frees itself)
 *   exit QUEUED:     out of the admission queue
 *   exit RETRY:      off the retry count
 *   exit ADMIT, PREFILL, RUNNING (to a state off the node): the pending node call is
 *                    cancelled, the lease forgotten, the max-active slot freed (the pump may run)
 *   enter QUEUED:    into the admission queue at its place; a full queue ends r
 *   enter RETRY:     counted; the pump places it on the loop's next turn
 *   enter ADMIT:     counted in max-active; the Admit call (r->pick set by req_start)
 *   enter PREFILL:   the Prefill call
 *   enter ENDED:     unlinked and freed (the caller has ended its gateway call)
 * Entry work that fails moves r on itself (retry, or end): after a move to QUEUED, ADMIT,
 * PREFILL or ENDED the caller does not touch r.
 */
static void req_move(router_req_t *r, router_req_state_t to)
{
    router_state_t *s = r->s;
    router_req_state_t from = r->state;
    TD_ASSERT(from != REQ_ENDED && from != to);
    switch (from) {
    case REQ_TOKENIZING:
        if (r->tok_job) { /* the job finishes on its thread and frees itself */
            r->tok_job->r = NULL;
            r->tok_job = NULL;
        }
        break;
    case REQ_QUEUED:
        if (router_queue_entry_queued(&r->qe)) { /* the deadline sweep may have taken it out */
            router_queue_remove(&s->queue, &r->qe);
            td_metric_set(s->m_queue_depth, router_queue_len(&s->queue));
        }
        break;
    case REQ_RETRY: s->n_retry--; break;
    default: break;
    }
    bool on_node_to = to == REQ_ADMIT || to == REQ_PREFILL || to == REQ_RUNNING;
    if (router_req_on_node(r) && !on_node_to) {
        if (r->pending) {
            td_grpc_client_call_t *p = r->pending;
            r->pending = NULL;
            td_grpc_client_call_cancel(p); /* its done callback sees r->pending cleared */
        }
        router_lease_forget(r);
        s->n_active--;
        td_metric_set(s->m_active, s->n_active);
        router_want_pump(s);
    }
    r->state = to;
    switch (to) {
    case REQ_QUEUED:
        if (router_queue_push(&s->queue, &r->qe, r->priority, r->deadline_ns, (int64_t)td_now_ns()) != TD_OK) {
            router_req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, "router: admission queue full; retry later", "exhausted");
            return;
        }
        td_metric_set(s->m_queue_depth, router_queue_len(&s->queue));
        router_want_pump(s);
        return;
    case REQ_RETRY:
        s->n_retry++;
        router_want_pump(s);
        return;
    case REQ_ADMIT:
        s->n_active++;
        td_metric_set(s->m_active, s->n_active);
        send_admit(r); /* may move r on, or end it */
        return;
    case REQ_PREFILL:
        send_prefill(r); /* idem */
        return;
    case REQ_ENDED:
        td_list_remove(&r->link);
        if (r->n_no_text)
            td_warn("request %s: %u generated ids have no text in the router's tokenizer (%d ids), the first "
                    "%u; they were streamed as ids with empty text",
                    r->id, r->n_no_text, td_tokenizer_vocab_size(s->tok), r->first_no_text);
        if (s->tok)
            td_detok_free(&r->detok);
        td_stop_destroy(r->stop);
        free(r->grammar);
        free(r->prompt);
        free(r->blocks);
        free(r->out.ids);
        free(r->out.text);
        free(r->out.lps);
        free(r->out.prompt_lps);
        free(r->gen);
        free(r);
        return;
    default: return;
    }
}
