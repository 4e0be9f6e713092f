/*
 * router_main: the router process (see router_main.h and docs/cluster.md).
 *
 * Everything runs on one libuv loop: the gateway gRPC server (Generation, Health), the
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
 */
#include "router_main.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control.pb-c.h"
#include "health.pb-c.h"
#include "router_admit.h"
#include "td_node_conf.h"
#include "router_policy.h"
#include "td_node.h"
#include "router_queue.h"
#include "router_registry.h"
#include "tandem.pb-c.h"
#include "td_gen_params.h"
#include "td_grpc.h"
#include "td_log.h"
#include "td_metrics.h"
#include "td_sampler.h"
#include "td_tokenizer.h"
#include "td_util.h"
#include "td_xfer.h"

#define ROUTER_DEADLINE_SLACK_NS 10000000ll /* a reset this close to the deadline counts as the deadline */
/* A stream refused a send (BUSY) and is still unwritable this many loop turns later: its
 * client is not reading, and a backlog past max-backlog-tokens ends it. A refusal within
 * one turn is normal (a burst of StepBatches read at once fills a small send queue before
 * the turn's write); the gRPC layer's prepare hook writes and tells a reading client's
 * call "writable" before the next poll. */
#define ROUTER_BACKLOG_GRACE_TURNS 2

/* The router's own keys; the common ones (model name, host, advertise, gateway and metrics
 * ports, log level) are td_node's. */
typedef struct router_config {
    const char *tokenizer;     /* tokenizer path (a model's tokenizer.bin / .json / dir) */
    int64_t control_port;
    int64_t max_active;        /* requests on nodes at once; more wait in the queue */
    int64_t max_queue;         /* requests waiting at most; beyond → RESOURCE_EXHAUSTED */
    int64_t request_timeout_ms;/* deadline of a request whose client gave none */
    int64_t max_backlog_tokens;/* tokens held for a client not reading; beyond → RESOURCE_EXHAUSTED */
    int64_t send_queue_bytes;  /* per gateway stream: queued bytes before tokens wait in the backlog */
    int64_t default_max_tokens;
    int64_t lease_ms;          /* lease and Prefill bound beyond the estimated prefill wait */
    int64_t max_prefill_wait_ms; /* a busy prefill node takes no prompt it would reach later */
    int64_t max_tokenizing;    /* text prompts being encoded off the loop at most */
    int64_t rpc_timeout_ms;
    int64_t heartbeat_ms;
    int64_t heartbeat_timeout_ms;
    int64_t max_nodes;
} router_config_t;

typedef struct router_peer {
    struct router_state *s;
    td_grpc_channel_t *ch;
    td_grpc_client_call_t *steps;
    uint8_t *xfer_desc;
    size_t xfer_desc_len;
    uint64_t generation;
    bool admit_refused;        /* refused an Admit: believed full until its next heartbeat or a
                                * finish there (its StepBatch free counts do not lift it, so a
                                * node refusing for want of request slots is not asked per step) */
} router_peer_t;

/* TOKENIZING: its text prompt is being encoded on libuv's thread pool (tok_job_t); then
 * QUEUED (waiting for room), ADMIT, PREFILL, RUNNING. */
typedef enum { REQ_TOKENIZING, REQ_QUEUED, REQ_ADMIT, REQ_PREFILL, REQ_RUNNING } router_req_state_t;

/* Where token index 0 came from: the Prefill stream's FIRST_TOKEN or the lease's first
 * SEQ_EVENT_TOKEN entry, whichever came first (the other is dropped); WITHHELD: the
 * prefill's first token is a stop id, so the decode node's finish entry ends the request. */
typedef enum { FIRST_NONE, FIRST_FROM_PREFILL, FIRST_FROM_DECODE, FIRST_WITHHELD } router_first_t;

typedef struct router_state router_state_t;
typedef struct tok_job tok_job_t;

typedef struct router_req {
    struct router_req *prev, *next;
    struct router_req *lease_next;  /* chain in the lease map while have_lease */
    router_queue_entry_t qe;        /* in the admission queue while REQ_QUEUED */
    router_state_t *s;
    td_grpc_call_t *call;
    char id[64];
    int32_t *prompt;
    int32_t n_prompt;
    int32_t max_tokens;
    Tandem__Control__V1__SamplingParams sampling;
    uint32_t stop_ids[TD_GEN_MAX_STOP_IDS];
    size_t n_stop_ids;
    td_stop_t *stop;
    td_detok_t detok;
    bool from_text;            /* the prompt was text the router tokenized (not prompt_ids) */
    tok_job_t *tok_job;        /* while REQ_TOKENIZING: the job encoding the text */
    uint32_t n_no_text;        /* generated ids the router's tokenizer cannot detokenize (the
                                * model's vocabulary is larger): sent with empty text */
    uint32_t first_no_text;    /* the first of them (logged once, when the request ends) */
    router_pick_t pick;
    router_pair_t tried[2];
    int32_t n_tried;
    char retry_why[160];       /* why the last pair failed: the error names it if no other does */
    router_req_state_t state;
    int32_t priority;
    int64_t deadline_ns;       /* td_now_ns() clock; bounds queue, Admit, Prefill, decoding */
    bool on_node;              /* counted in n_active (Admit sent, not yet ended) */
    router_first_t first_src;
    uint32_t first_token;
    uint32_t decode_tokens;    /* SEQ_EVENT_TOKEN entries seen for the current lease */
    /* output not yet queued on the gateway stream (the stream was over its send bound):
     * flushed as one GenerateResponse when it becomes writable */
    uint32_t *out_ids;
    uint32_t n_out, cap_out;
    char *out_text;            /* NUL-terminated */
    size_t n_out_text, cap_out_text;
    bool blocked;              /* the last send was refused (BUSY); wait for writable */
    uint64_t blocked_turn;     /* s->turn when it became blocked */
    bool dirty;                /* output appended during this StepBatch */
    bool sent_msg;             /* a GenerateResponse went out (the first carries the id) */
    uint64_t decode_gen;
    uint64_t lease_id;
    bool have_lease;
    bool call_has_req_deadline; /* the pending node call's deadline is the request's */
    int64_t lease_ttl_ms;       /* this pick's lease and Prefill bound (lease_ttl) */
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
    td_node_t proc;        /* loop, signals, /metrics, common config */
    router_config_t cfg;
    uv_timer_t tick;
    td_tokenizer_t *tok;
    router_registry_t *reg;
    router_policy_config_t policy;
    router_peer_t *peers;
    router_req_t *reqs;        /* every request, queued or on nodes */
    int32_t n_active;          /* requests on nodes (max-active bound) */
    router_queue_t queue;
    router_req_t **lease_map;  /* [lease_buckets] chains by (decode, lease id) */
    uint32_t lease_buckets;    /* power of two */
    uv_idle_t pump_idle;       /* runs pump() after the callback that made room */
    uv_prepare_t turn_prepare; /* counts loop turns (turn) */
    uint64_t turn;
    bool pump_wanted;          /* room may have appeared: try the queue's head after this callback */
    bool pumping;
    int32_t n_tokenizing;      /* tok_job_t on the thread pool (max-tokenizing bound) */
    uint64_t next_id;
    td_grpc_server_t *gateway, *control;
    td_metrics_t *metrics;
    td_metric_family_t *f_requests;
    td_metric_t *m_ttft, *m_tpot, *m_active, *m_tokens, *m_retries, *m_nodes_prefill, *m_nodes_decode;
    td_metric_t *m_queue_depth, *m_queue_s, *m_first_mismatch;
    bool shutting_down;
    bool handles_up;
    char refused[320];         /* the last registration refused, logged once ("id: reason") */
};

typedef enum { START_OK, START_NO_ROOM, START_ENDED } router_start_t;

static router_start_t req_start(router_req_t *r);
static void req_place(router_req_t *r);
static void on_pump_idle(uv_idle_t *h);

#define REQ_OF_QE(e) ((router_req_t *)((char *)(e) - offsetof(router_req_t, qe)))

/* Room may have appeared (a request left its node, a node reported free blocks): try the
 * queue's head once the current callback is done (an idle handle keeps the loop from
 * blocking in poll until then), never from inside the code that freed the room. */
static void want_pump(router_state_t *s)
{
    if (s->pump_wanted || s->shutting_down || !s->handles_up || !router_queue_len(&s->queue))
        return;
    s->pump_wanted = true;
    uv_idle_start(&s->pump_idle, on_pump_idle);
}

/* ---- lease map: StepBatch entries find their request without a scan -------------------- */

static uint32_t lease_hash(const router_state_t *s, int32_t decode, uint64_t lease)
{
    uint64_t h = (lease ^ ((uint64_t)(uint32_t)decode << 40)) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(h >> 32) & (s->lease_buckets - 1);
}

static void lease_set(router_req_t *r, uint64_t lease)
{
    router_state_t *s = r->s;
    TD_ASSERT(!r->have_lease);
    r->lease_id = lease;
    r->have_lease = true;
    r->decode_tokens = 0;
    uint32_t h = lease_hash(s, r->pick.pair.decode, lease);
    r->lease_next = s->lease_map[h];
    s->lease_map[h] = r;
}

/* The lease is gone (released, finished, or its node lost): its step entries are ignored. */
static void lease_forget(router_req_t *r)
{
    router_state_t *s = r->s;
    if (!r->have_lease)
        return;
    r->have_lease = false;
    router_req_t **pp = &s->lease_map[lease_hash(s, r->pick.pair.decode, r->lease_id)];
    while (*pp && *pp != r)
        pp = &(*pp)->lease_next;
    TD_ASSERT(*pp == r);
    *pp = r->lease_next;
    r->lease_next = NULL;
}

static router_req_t *find_lease(router_state_t *s, int32_t decode, uint64_t gen, uint64_t lease)
{
    for (router_req_t *r = s->lease_map[lease_hash(s, decode, lease)]; r; r = r->lease_next)
        if (r->lease_id == lease && r->pick.pair.decode == decode && r->decode_gen == gen)
            return r;
    return NULL;
}

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
    lease_forget(r);
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

/* The request no longer holds a max-active slot: the queue may move. */
static void req_off_node(router_req_t *r)
{
    router_state_t *s = r->s;
    if (!r->on_node)
        return;
    r->on_node = false;
    s->n_active--;
    td_metric_set(s->m_active, s->n_active);
    want_pump(s);
}

/* ---- text prompts, encoded off the loop ------------------------------------------------ */

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
    char *text;
    size_t len;
    int32_t *ids;
    size_t n;
    td_status_t st;
    char why[256];                /* the encoder's message (td_last_error is per thread) */
};

static void tok_job_orphan(router_req_t *r)
{
    r->tok_job->r = NULL;
    r->tok_job = NULL;
}

static void tok_work(uv_work_t *w)
{
    tok_job_t *j = (tok_job_t *)w;
    unsigned flags = td_tokenizer_bos_id(j->tok) >= 0 ? TD_TOK_ADD_BOS : 0;
    j->st = td_tokenizer_encode(j->tok, j->text, j->len, flags, &j->ids, &j->n);
    if (j->st != TD_OK)
        snprintf(j->why, sizeof j->why, "%s", td_last_error());
}

static void req_arrived(router_req_t *r);
static void req_fail(router_req_t *r, td_grpc_code_t code, const char *msg, const char *outcome);

static void tok_done(uv_work_t *w, int status)
{
    (void)status; /* never cancelled: uv_cancel is not used */
    tok_job_t *j = (tok_job_t *)w;
    router_req_t *r = j->r;
    j->s->n_tokenizing--;
    free(j->text);
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
        snprintf(why, sizeof why, "the router's tokenizer cannot encode the prompt: %s", j->why);
    free(j);
    if (st == TD_ERR_NOMEM)
        req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, "router: out of memory", "exhausted");
    else if (st != TD_OK)
        req_fail(r, TD_GRPC_INVALID_ARGUMENT, why, "invalid");
    else if (r->n_prompt == 0)
        req_fail(r, TD_GRPC_INVALID_ARGUMENT, "the prompt text encodes to no token ids", "invalid");
    else
        req_arrived(r);
}

/* Starts encoding r's text prompt. Errors (r untouched): TD_ERR_EXHAUSTED (max-tokenizing
 * jobs already), TD_ERR_NOMEM. */
static td_status_t tok_start(router_req_t *r, const char *text, size_t len)
{
    router_state_t *s = r->s;
    if (s->n_tokenizing >= s->cfg.max_tokenizing)
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "router: %d text prompts are being tokenized (max-tokenizing); "
                               "retry later", s->n_tokenizing);
    tok_job_t *j = calloc(1, sizeof *j);
    if (!j || !(j->text = malloc(len ? len : 1))) {
        free(j);
        return td_errorf_quiet(TD_ERR_NOMEM, "router: out of memory");
    }
    memcpy(j->text, text, len);
    j->len = len;
    j->r = r;
    j->s = s;
    j->tok = s->tok;
    if (uv_queue_work(&s->proc.loop, &j->work, tok_work, tok_done) != 0) {
        free(j->text);
        free(j);
        return td_errorf_quiet(TD_ERR_NOMEM, "router: cannot queue the prompt's tokenization");
    }
    s->n_tokenizing++;
    r->tok_job = j;
    r->state = REQ_TOKENIZING;
    return TD_OK;
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
    lease_forget(r);
    if (r->tok_job)
        tok_job_orphan(r); /* the job finishes on its thread and frees itself */
    if (r->qe.queued) {
        router_queue_remove(&s->queue, &r->qe);
        td_metric_set(s->m_queue_depth, router_queue_len(&s->queue));
    }
    req_off_node(r);
    if (r->pending) {
        td_grpc_client_call_t *p = r->pending;
        r->pending = NULL;
        td_grpc_client_call_cancel(p); /* its done callback sees r->pending cleared → data NULL */
    }
    if (r->n_no_text)
        td_warn("request %s: %u generated ids have no text in the router's tokenizer (%d ids), the first "
                "%u; they were streamed as ids with empty text",
                r->id, r->n_no_text, td_tokenizer_vocab_size(s->tok), r->first_no_text);
    if (r->s->tok)
        td_detok_free(&r->detok);
    td_stop_destroy(r->stop);
    free(r->prompt);
    free(r->blocks);
    free(r->out_ids);
    free(r->out_text);
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

/* Failure before a token reached the client: another pair once, else UNAVAILABLE. */
static void req_retry_or_fail(router_req_t *r, td_grpc_code_t code, const char *why)
{
    if (r->pending) { /* e.g. the decode node dropped the sequence while its Prefill still ran */
        td_grpc_client_call_t *pc = r->pending;
        r->pending = NULL;
        td_grpc_client_call_cancel(pc); /* its done callback sees r->pending cleared */
    }
    release_lease(r, TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_FAILED);
    if (past_deadline(r) || call_hit_req_deadline(r, code)) {
        req_fail(r, TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded", "deadline");
        return;
    }
    if (!r->sent_any && r->n_tried < 2) {
        td_info("request %s: retrying on another pair (%s)", r->id, why);
        snprintf(r->retry_why, sizeof r->retry_why, "%s", why);
        td_metric_inc(r->s->m_retries);
        req_off_node(r);
        r->first_src = FIRST_NONE;
        req_place(r);
        return;
    }
    char msg[256];
    snprintf(msg, sizeof msg, "request %s failed: %s", r->id, why);
    req_fail(r, TD_GRPC_UNAVAILABLE, msg, "unavailable");
}

/* ---- output: pending tokens, one GenerateResponse per flush ---------------------------- */

/* Room for one more id and text_len more bytes (plus the NUL) in the pending output. The
 * buffers are kept across flushes, so a running request stops allocating after its first
 * few tokens. */
static bool out_reserve(router_req_t *r, size_t text_len)
{
    if (r->n_out == r->cap_out) {
        uint32_t cap = r->cap_out ? r->cap_out * 2 : 8;
        uint32_t *p = realloc(r->out_ids, cap * sizeof *p);
        if (!p)
            return false;
        r->out_ids = p;
        r->cap_out = cap;
    }
    if (r->n_out_text + text_len + 1 > r->cap_out_text) {
        size_t cap = TD_MAX(TD_MAX(r->cap_out_text * 2, r->n_out_text + text_len + 1), (size_t)64);
        char *p = realloc(r->out_text, cap);
        if (!p)
            return false;
        r->out_text = p;
        r->cap_out_text = cap;
    }
    return true;
}

/* text may be NULL when len is 0 (an empty stop matcher's emit). */
static void out_append_text(router_req_t *r, const char *text, size_t len)
{
    if (len)
        memcpy(r->out_text + r->n_out_text, text, len);
    r->n_out_text += len;
    r->out_text[r->n_out_text] = '\0';
}

/* The pending output as a message (pointers into r; valid until the next append). */
static void out_message(router_req_t *r, Tandem__V1__GenerateResponse *m)
{
    m->token_ids = r->out_ids;
    m->n_token_ids = r->n_out;
    m->text = r->out_text ? r->out_text : "";
    if (!r->sent_msg)
        m->request_id = r->id;
}

/* The pending output was queued on the stream at `now`: TTFT/TPOT and token counts. */
static void out_account(router_req_t *r, uint64_t now)
{
    router_state_t *s = r->s;
    uint32_t n = r->n_out;
    if (n && !r->t_first) {
        r->t_first = now;
        td_metric_observe(s->m_ttft, (double)(now - r->t_arrival) * 1e-9);
    } else if (n && r->t_last) {
        td_metric_observe(s->m_tpot, (double)(now - r->t_last) * 1e-9 / (double)n);
    }
    if (n)
        r->t_last = now;
    td_metric_add(s->m_tokens, (double)n);
    r->sent_msg = true;
}

static void out_clear(router_req_t *r)
{
    r->n_out = 0;
    r->n_out_text = 0;
    if (r->out_text)
        r->out_text[0] = '\0';
}

/* Queues the pending output as one GenerateResponse, unless the stream is over its send
 * bound: then it stays pending until the writable callback. */
static void out_flush(router_req_t *r)
{
    if (r->blocked || !r->call || (!r->n_out && !r->n_out_text))
        return;
    Tandem__V1__GenerateResponse m = TANDEM__V1__GENERATE_RESPONSE__INIT;
    out_message(r, &m);
    td_status_t st = td_grpc_call_send(r->call, &m.base);
    if (st == TD_ERR_BUSY) {
        r->blocked = true;
        r->blocked_turn = r->s->turn;
        return;
    }
    if (st != TD_OK) {
        if (st != TD_ERR_CANCELLED) /* the cancel callback ends it otherwise */
            td_warn("request %s: %u tokens not queued to the gateway stream: %s", r->id, r->n_out, td_strerror(st));
        return;
    }
    out_account(r, td_now_ns());
    out_clear(r);
}

/* The last message (pending output, finish reason, usage, timings), queued past the send
 * bound (the backlog is bounded by max-backlog-tokens), and the stream ends OK. */
static void req_finish(router_req_t *r, Tandem__V1__FinishReason reason)
{
    router_state_t *s = r->s;
    router_peer_t *dp = &s->peers[r->pick.pair.decode];
    if (dp->generation == r->decode_gen)
        dp->admit_refused = false; /* its blocks and request slot are free again */
    if (r->stop && s->tok && reason != TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP) {
        const char *a;
        size_t alen;
        td_stop_result_t sr = {0};
        if (td_detok_flush(&r->detok, &a, &alen) == TD_OK && td_stop_feed(r->stop, a, alen, &sr) == TD_OK) {
            const char *b = NULL;
            size_t blen = 0;
            if (!sr.matched)
                td_stop_flush(r->stop, &b, &blen);
            if (out_reserve(r, sr.emit_len + blen)) {
                out_append_text(r, sr.emit, sr.emit_len);
                if (blen)
                    out_append_text(r, b, blen);
            }
        }
    }
    lease_forget(r); /* the decode node freed it with the finish (or was told to) */
    Tandem__V1__GenerateResponse m = TANDEM__V1__GENERATE_RESPONSE__INIT;
    Tandem__V1__Usage u = TANDEM__V1__USAGE__INIT;
    Tandem__V1__Timings t = TANDEM__V1__TIMINGS__INIT;
    out_message(r, &m);
    m.request_id = r->id;
    uint64_t now = td_now_ns();
    bool had_first = r->t_first != 0;
    m.finish_reason = reason;
    u.prompt_tokens = (uint32_t)r->n_prompt;
    u.completion_tokens = r->completion;
    u.cached_tokens = r->cached;
    m.usage = &u;
    out_account(r, now);
    t.queue_s = (double)(r->t_picked - r->t_arrival) * 1e-9;
    t.prefill_s = r->prefill_s;
    t.transfer_s = r->transfer_s;
    t.first_token_s = r->t_first ? (double)(r->t_first - r->t_arrival) * 1e-9 : 0;
    t.per_token_s = r->completion > 1 && had_first ? (double)(r->t_last - r->t_first) * 1e-9 / (r->completion - 1) : 0;
    t.total_s = (double)(now - r->t_arrival) * 1e-9;
    m.timings = &t;
    if (r->call) {
        td_grpc_call_set_data(r->call, NULL);
        td_grpc_call_reply(r->call, &m.base);
        r->call = NULL;
    }
    count_outcome(s, "ok");
    req_free(r);
}

static bool is_stop_id(const router_req_t *r, uint32_t token)
{
    for (size_t i = 0; i < r->n_stop_ids; i++)
        if (r->stop_ids[i] == token)
            return true;
    return r->s->tok && td_tokenizer_is_eos(r->s->tok, (int32_t)token);
}

/* The client has not drained its stream for ROUTER_BACKLOG_GRACE_TURNS loop turns and its
 * backlog is past the bound. */
static bool backlog_over(const router_req_t *r)
{
    return r->blocked && (int64_t)r->n_out > r->s->cfg.max_backlog_tokens &&
           r->s->turn - r->blocked_turn >= ROUTER_BACKLOG_GRACE_TURNS;
}

static void req_fail_slow(router_req_t *r)
{
    char msg[160];
    snprintf(msg, sizeof msg, "request %s: the client is not reading its stream (%u tokens pending)", r->id, r->n_out);
    td_warn("%s", msg);
    req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, msg, "slow_client");
}

/* One new token of a request, appended to its pending output (the caller flushes).
 * Returns false when the request ended here (stop string, backlog bound, no memory). */
static bool out_token(router_req_t *r, uint32_t token)
{
    router_state_t *s = r->s;
    const char *text = "";
    size_t len = 0;
    bool matched = false;
    if (s->tok && !td_tokenizer_id_to_piece(s->tok, (int32_t)token, NULL)) {
        /* a model's vocabulary may be padded past its tokenizer's: the id goes out without
         * text, counted and logged once per request (req_free), the stream left as it was */
        if (!r->n_no_text++)
            r->first_no_text = token;
    } else if (r->stop && s->tok) {
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
    if (!out_reserve(r, len)) {
        req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, "router: out of memory", "exhausted");
        return false;
    }
    r->completion++;
    r->sent_any = true; /* committed to the client: no transparent retry from here on */
    r->out_ids[r->n_out++] = token;
    out_append_text(r, text, len);
    if (matched) {
        release_lease(r, TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_CANCELLED);
        req_finish(r, TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP);
        return false;
    }
    if (backlog_over(r)) {
        req_fail_slow(r);
        return false;
    }
    r->dirty = true;
    return true;
}

static void first_mismatch(router_req_t *r, const char *sent_by, uint32_t sent, uint32_t other)
{
    td_warn("request %s: first token %u came from the %s, the other source says %u; the client got %u", r->id, sent,
            sent_by, other, sent);
    td_metric_inc(r->s->m_first_mismatch);
}

/* Token index 0 from the Prefill stream: sent at once unless the lease's first step entry
 * already sent it (then it is only compared), or it is a stop id (the decode node's finish
 * entry will end the request). May end r. */
static void first_from_prefill(router_req_t *r, uint32_t token)
{
    switch (r->first_src) {
    case FIRST_NONE:
        r->first_token = token;
        if (is_stop_id(r, token)) {
            r->first_src = FIRST_WITHHELD;
            return;
        }
        r->first_src = FIRST_FROM_PREFILL;
        if (out_token(r, token)) {
            r->dirty = false;
            out_flush(r);
        }
        return;
    case FIRST_FROM_DECODE:
        if (token != r->first_token)
            first_mismatch(r, "decode node", r->first_token, token);
        return;
    default: return;
    }
}

/* The lease's first SEQ_EVENT_TOKEN entry: true when it is to be relayed (it came first). */
static bool first_from_decode(router_req_t *r, uint32_t token)
{
    switch (r->first_src) {
    case FIRST_FROM_PREFILL:
        if (token != r->first_token)
            first_mismatch(r, "prefill node", r->first_token, token);
        return false;
    case FIRST_WITHHELD: first_mismatch(r, "decode node", token, r->first_token); /* fall through */
    default:
        r->first_src = FIRST_FROM_DECODE;
        r->first_token = token;
        return true;
    }
}

/* ---- node calls -------------------------------------------------------------------------- */

static void on_prefill_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    router_req_t *r = data;
    if (r->pending != c)
        return;
    const Tandem__Control__V1__PrefillResponse *p = (const void *)msg;
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
    first_from_prefill(r, p->first_token); /* may end r */
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
        req_retry_or_fail(r, code, msg[0] ? msg : td_grpc_code_name(code));
        return;
    }
    r->state = REQ_RUNNING;
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
    lease_set(r, a->lease_id);
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
    if (code == TD_GRPC_RESOURCE_EXHAUSTED && !r->have_lease && !r->sent_any && !past_deadline(r)) {
        /* fuller than its last report: believe it full until it reports again, and wait in
         * the queue at the request's old place (the pair is not used up as a retry) */
        router_node_t *n = router_registry_node(s->reg, d);
        if (n && s->peers[d].generation == r->decode_gen) {
            n->load.free_blocks = 0;
            s->peers[d].admit_refused = true;
        }
        r->n_tried--;
        req_off_node(r);
        req_place(r);
        return;
    }
    if (code == TD_GRPC_INVALID_ARGUMENT) { /* e.g. longer than the model: no other node takes it */
        req_fail(r, TD_GRPC_INVALID_ARGUMENT, msg[0] ? msg : "the decode node refused the request as invalid", "invalid");
        return;
    }
    if (code != TD_GRPC_OK || !r->have_lease) {
        node_unreachable(s, d);
        req_retry_or_fail(r, code, msg[0] ? msg : td_grpc_code_name(code));
        return;
    }
    router_peer_t *pp = &s->peers[r->pick.pair.prefill], *dp = &s->peers[d];
    const router_node_t *dn = router_registry_node_const(s->reg, d);
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
                             .timeout_ms = call_timeout_ms(r, r->lease_ttl_ms)};
    r->t_prefill = td_now_ns();
    r->state = REQ_PREFILL;
    if (!pp->ch ||
        td_grpc_channel_call(pp->ch, "/tandem.control.v1.PrefillNode/Prefill", &q.base, &o, &r->pending) != TD_OK) {
        r->pending = NULL;
        node_unreachable(s, r->pick.pair.prefill);
        req_retry_or_fail(r, TD_GRPC_UNAVAILABLE, "prefill node unreachable");
    }
}

/* The checks that depend on the model's live nodes (router_admit): prompt ids within its
 * vocabulary, prompt + max_tokens within its largest decode pool. Run at arrival and again
 * when the request is put on a pair (nodes may have come meanwhile). False: `why` says why. */
static bool req_admissible(const router_req_t *r, char *why, size_t why_len)
{
    const router_state_t *s = r->s;
    const char *model = s->proc.cfg.model_name;
    int64_t now = (int64_t)td_now_ns();
    router_model_facts_t mf;
    router_admit_model_facts(s->reg, model, now, &mf);
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

/* Puts r on a pair now: START_OK (Admit sent; r may since have been retried or ended),
 * START_NO_ROOM (no decode node has room: r untouched, to wait in the queue), START_ENDED
 * (r failed and is freed). */
static router_start_t req_start(router_req_t *r)
{
    router_state_t *s = r->s;
    if (past_deadline(r)) {
        req_fail(r, TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded before a decode node had room", "deadline");
        return START_ENDED;
    }
    char why[384];
    if (!req_admissible(r, why, sizeof why)) {
        req_fail(r, TD_GRPC_INVALID_ARGUMENT, why, "invalid");
        return START_ENDED;
    }
    router_pick_request_t pr = {.model = s->proc.cfg.model_name, .prompt = r->prompt, .n_prompt = r->n_prompt,
                                .max_tokens = r->max_tokens, .exclude = r->tried, .n_exclude = r->n_tried,
                                .now_ns = (int64_t)td_now_ns()};
    router_pick_t pick;
    td_status_t st = router_policy_pick(s->reg, &s->policy, &pr, &pick);
    if (st != TD_OK) {
        if (st == TD_ERR_EXHAUSTED)
            return START_NO_ROOM;
        if (st == TD_ERR_RANGE) { /* the size check above saw the same registry: not reached */
            req_fail(r, TD_GRPC_INVALID_ARGUMENT, td_last_error(), "invalid");
        } else {
            char why[384]; /* the policy's reason, copied before the release can log another */
            if (r->retry_why[0])
                snprintf(why, sizeof why, "request %s failed on its pair (%s) and %s", r->id, r->retry_why,
                         td_last_error());
            else
                snprintf(why, sizeof why, "%s", td_last_error());
            req_fail(r, TD_GRPC_UNAVAILABLE, why, "unavailable");
        }
        return START_ENDED;
    }
    router_policy_commit(s->reg, &pr, &pick);
    r->pick = pick;
    r->tried[r->n_tried++] = pick.pair;
    r->decode_gen = s->peers[pick.pair.decode].generation;
    if (!r->t_picked) /* the first pick only (an Admit refusal or a retry picks again) */
        td_metric_observe(s->m_queue_s, (double)(td_now_ns() - r->t_arrival) * 1e-9);
    r->t_picked = td_now_ns();
    r->state = REQ_ADMIT;
    r->on_node = true;
    s->n_active++;
    td_metric_set(s->m_active, s->n_active);
    Tandem__Control__V1__AdmitRequest q = TANDEM__CONTROL__V1__ADMIT_REQUEST__INIT;
    q.request_id = r->id;
    q.prompt_tokens = (uint32_t)r->n_prompt;
    q.max_tokens = (uint32_t)r->max_tokens;
    r->lease_ttl_ms = lease_ttl(s, &pick);
    q.lease_ms = (uint32_t)r->lease_ttl_ms;
    q.sampling = &r->sampling;
    q.stop_ids = r->stop_ids;
    q.n_stop_ids = r->n_stop_ids;
    q.prompt_ids = (uint32_t *)r->prompt;
    q.n_prompt_ids = (size_t)r->n_prompt;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__admit_response__descriptor,
                             .on_message = on_admit_msg, .on_done = on_admit_done, .data = r,
                             .timeout_ms = call_timeout_ms(r, s->cfg.rpc_timeout_ms)};
    router_peer_t *dp = &s->peers[pick.pair.decode];
    if (!dp->ch || !dp->steps ||
        td_grpc_channel_call(dp->ch, "/tandem.control.v1.DecodeNode/Admit", &q.base, &o, &r->pending) != TD_OK) {
        r->pending = NULL;
        node_unreachable(s, pick.pair.decode);
        req_retry_or_fail(r, TD_GRPC_UNAVAILABLE, "decode node unreachable");
    }
    return START_OK;
}

/* Starts the queue's head while there is room (max-active and a decode node with room);
 * the head waiting for room holds back those behind it (FIFO within a priority). */
static void pump(router_state_t *s)
{
    if (s->pumping)
        return;
    s->pumping = true;
    router_queue_entry_t *e;
    while (!s->shutting_down && s->n_active < s->cfg.max_active && (e = router_queue_peek(&s->queue))) {
        router_req_t *r = REQ_OF_QE(e);
        router_queue_remove(&s->queue, e);
        if (req_start(r) == START_NO_ROOM) {
            td_status_t st = router_queue_push(&s->queue, e, r->priority, r->deadline_ns, 0);
            TD_ASSERT(st == TD_OK); /* it was just taken out */
            break;
        }
    }
    td_metric_set(s->m_queue_depth, router_queue_len(&s->queue));
    s->pumping = false;
}

static void on_pump_idle(uv_idle_t *h)
{
    router_state_t *s = h->data;
    uv_idle_stop(h);
    s->pump_wanted = false;
    pump(s);
}

/* A request without a node (new, or put back for a retry or an Admit refusal): started at
 * once when nothing waits ahead of it and there is room, else queued at its place; a full
 * queue refuses it (RESOURCE_EXHAUSTED). */
static void req_place(router_req_t *r)
{
    router_state_t *s = r->s;
    r->state = REQ_QUEUED;
    if (!s->pumping && router_queue_len(&s->queue) == 0 && s->n_active < s->cfg.max_active &&
        req_start(r) != START_NO_ROOM)
        return;
    if (router_queue_push(&s->queue, &r->qe, r->priority, r->deadline_ns, (int64_t)td_now_ns()) != TD_OK) {
        req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, "router: admission queue full; retry later", "exhausted");
        return;
    }
    td_metric_set(s->m_queue_depth, router_queue_len(&s->queue));
    want_pump(s);
}

/* ---- decode node step streams ---------------------------------------------------------- */

static void on_steps_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    router_peer_t *p = data;
    router_state_t *s = p->s;
    int32_t d = (int32_t)(p - s->peers);
    const Tandem__Control__V1__StepBatch *b = (const void *)msg;
    bool any = false;
    for (size_t i = 0; i < b->n_seqs; i++) {
        const Tandem__Control__V1__SeqStep *q = b->seqs[i];
        router_req_t *r = find_lease(s, d, p->generation, q->lease_id);
        if (!r || !r->call)
            continue;
        switch (q->event) {
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN:
            if (r->decode_tokens++ == 0 && !first_from_decode(r, q->token))
                break; /* token 0 already sent from the Prefill stream */
            any |= out_token(r, q->token);
            break;
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_LENGTH:
            req_finish(r, TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH);
            break;
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_STOP:
            req_finish(r, TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP);
            break;
        case TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_EOS:
            req_finish(r, TANDEM__V1__FINISH_REASON__FINISH_REASON_EOS);
            break;
        default:
            lease_forget(r);
            req_retry_or_fail(r, TD_GRPC_UNAVAILABLE, "the decode node dropped the sequence");
            break;
        }
    }
    /* after the entries: a finish among them lifts an Admit refusal */
    router_node_t *node = router_registry_node(s->reg, d);
    if (node && !p->admit_refused)
        node->load.free_blocks = (int32_t)TD_MIN(b->free_kv_blocks, (uint32_t)INT32_MAX);
    /* one GenerateResponse per request per step, whatever the entries were */
    for (size_t i = 0; any && i < b->n_seqs; i++) {
        router_req_t *r = find_lease(s, d, p->generation, b->seqs[i]->lease_id);
        if (r && r->dirty) {
            r->dirty = false;
            out_flush(r);
        }
    }
    want_pump(s);
}

/* A decode node is gone (stream ended, or silent past the heartbeat bound). */
static void decode_lost(router_state_t *s, int32_t d, const char *why)
{
    router_peer_t *p = &s->peers[d];
    router_node_t *n = router_registry_node(s->reg, d);
    if (n)
        n->up = false; /* so that the retries below go elsewhere */
    for (router_req_t *r = s->reqs, *next; r; r = next) {
        next = r->next;
        if (r->on_node && r->pick.pair.decode == d && r->decode_gen == p->generation) {
            lease_forget(r);
            if (r->pending) {
                td_grpc_client_call_t *pc = r->pending;
                r->pending = NULL;
                td_grpc_client_call_cancel(pc);
            }
            req_retry_or_fail(r, TD_GRPC_UNAVAILABLE, why);
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
        if (n && router_registry_is_live(s->reg, i, now) && (n->info.role != TD_NODE_ROLE_DECODE || s->peers[i].steps))
            n->info.role == TD_NODE_ROLE_DECODE ? nd++ : np++;
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
static bool register_edge_check(const Tandem__Control__V1__RegisterRequest *q, char *why, size_t cap)
{
    const char *id = q->node_id && q->node_id[0] ? q->node_id : "?";
    if (!q->node_id || !q->node_id[0])
        snprintf(why, cap, "register: node_id is empty");
    else if (strlen(q->node_id) >= TD_NODE_ID_MAX)
        snprintf(why, cap, "register: node_id is %zu bytes, at most %d", strlen(q->node_id), TD_NODE_ID_MAX - 1);
    else if (q->role != TANDEM__CONTROL__V1__ROLE__ROLE_PREFILL && q->role != TANDEM__CONTROL__V1__ROLE__ROLE_DECODE)
        snprintf(why, cap, "register: node %s: role %d is not PREFILL (1) or DECODE (2)", id, (int)q->role);
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

static void on_register(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
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
    info.role = (td_node_role_t)q->role; /* checked: PREFILL or DECODE */
    info.layout = (td_kv_layout_t){.model_fingerprint = q->layout->model_fingerprint, .dtype = q->layout->dtype,
                                   .block_size = q->layout->block_size, .n_layers = q->layout->n_layers,
                                   .n_kv_heads = q->layout->n_kv_heads, .head_dim = q->layout->head_dim,
                                   .version = q->layout->version};
    info.capacity_blocks = (int32_t)q->capacity->total_kv_blocks;
    info.max_batch = (int32_t)q->capacity->max_batch;
    info.vocab_size = (int32_t)TD_MIN(q->capacity->vocab_size, (uint32_t)INT32_MAX);
    info.max_seq_len = (int32_t)TD_MIN(q->capacity->max_seq_len, (uint32_t)INT32_MAX);
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
        decode_lost(s, old, "node restarted");
        s->peers[old].generation++;
        peer_drop(s, old);
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
    if (td_grpc_channel_create(&s->proc.loop, host, port, &cc, &p->ch) != TD_OK) {
        router_registry_leave(s->reg, info.id);
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "router cannot reach the node's control address");
        return;
    }
    if (info.role == TD_NODE_ROLE_DECODE) {
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
    td_info("router: node %s (%s) registered at %s", info.id, info.role == TD_NODE_ROLE_DECODE ? "decode" : "prefill",
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
        }
        router_registry_heartbeat(s->reg, q->node_id, &l, (int64_t)td_now_ns());
        s->peers[idx].admit_refused = false;
        want_pump(s);
    }
    td_grpc_call_reply(call, &resp.base);
}

/* ---- gateway API ----------------------------------------------------------------------- */

static void on_generate_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    router_req_t *r = call_data;
    if (r) {
        /* a client's own deadline timer often resets the stream just before ours fires */
        bool deadline = why == TD_ERR_TIMEOUT ||
                        (r->deadline_ns && (int64_t)td_now_ns() + ROUTER_DEADLINE_SLACK_NS >= r->deadline_ns);
        r->call = NULL;
        release_lease(r, deadline ? TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_DEADLINE
                                  : TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_CANCELLED);
        count_outcome(r->s, deadline ? "deadline" : "cancelled");
        req_free(r);
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
    out_flush(r);
}

static void on_generate(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
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
    /* the one validation every front door runs (td_gen_params.h), on the request as received
     * but for what proto3 cannot tell from unset: top_p and repetition_penalty 0 mean "off"
     * (proto/tandem.proto); negative, NaN and infinite values reach the check and are refused */
    td_gen_params_t gp = td_gen_params_default();
    gp.max_tokens = q->max_tokens;
    gp.prompt_is_text = q->n_prompt_ids == 0;
    gp.prompt_len = q->n_prompt_ids ? q->n_prompt_ids : strlen(q->prompt);
    gp.n_stop_ids = q->n_stop_ids;
    gp.n_stop_strings = q->n_stop_strings;
    gp.stop_strings = (const char *const *)q->stop_strings;
    if (q->sampling) {
        gp.sampling.temperature = q->sampling->temperature;
        /* a top_k past INT32_MAX keeps every token, as INT32_MAX does */
        gp.sampling.top_k = (int32_t)TD_MIN(q->sampling->top_k, (uint32_t)INT32_MAX);
        gp.sampling.top_p = q->sampling->top_p == 0.0f ? 1.0f : q->sampling->top_p;
        gp.sampling.min_p = q->sampling->min_p;
        gp.sampling.repetition_penalty =
            q->sampling->repetition_penalty == 0.0f ? 1.0f : q->sampling->repetition_penalty;
        gp.sampling.seed = q->sampling->seed;
    }
    char why[384] = "";
    if (td_gen_params_validate(&gp, why, sizeof why) != TD_OK) {
        count_outcome(s, "invalid");
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
    if (q->n_prompt_ids) {
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
        r->from_text = true; /* encoded off the loop once the rest is checked (tok_start) */
    }
    tandem__control__v1__sampling_params__init(&r->sampling);
    const td_sampling_t ts = gp.sampling;
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
        count_outcome(s, nomem ? "exhausted" : "invalid");
        td_grpc_call_finish(call, nomem ? TD_GRPC_RESOURCE_EXHAUSTED : TD_GRPC_INVALID_ARGUMENT,
                            nomem ? "router: out of memory" : why);
        return;
    }
    r->sampling.temperature = ts.temperature;
    r->sampling.top_k = (uint32_t)ts.top_k;
    r->sampling.top_p = ts.top_p;
    r->sampling.min_p = ts.min_p;
    r->sampling.repetition_penalty = ts.repetition_penalty;
    r->sampling.seed = ts.seed;
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
    router_queue_entry_init(&r->qe);
    r->next = s->reqs;
    if (s->reqs)
        s->reqs->prev = r;
    s->reqs = r;
    if (!r->from_text) {
        req_arrived(r);
    } else if ((st = tok_start(r, q->prompt, strlen(q->prompt))) != TD_OK) {
        snprintf(why, sizeof why, "%s", td_last_error());
        req_fail(r, TD_GRPC_RESOURCE_EXHAUSTED, why, "exhausted");
    }
}

/* A request whose prompt ids are known: checked against the model's live nodes
 * (router_admit), then started or queued. */
static void req_arrived(router_req_t *r)
{
    char why[384];
    if (!req_admissible(r, why, sizeof why)) {
        req_fail(r, TD_GRPC_INVALID_ARGUMENT, why, "invalid");
        return;
    }
    req_place(r);
}

static void on_list_models(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
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
            if (n->info.role == TD_NODE_ROLE_DECODE)
                decode_lost(s, i, "decode node stopped heartbeating");
            router_registry_leave(s->reg, n->info.id);
            s->peers[i].generation++;
            peer_drop(s, i);
            changed = true;
        }
    }
    if (changed)
        print_nodes(s);
    /* deadlines the gRPC layer does not watch (request-timeout-ms; a client's own
     * grpc-timeout also ends the stream there): in the queue, then on nodes */
    router_queue_entry_t *e;
    while ((e = router_queue_pop_expired(&s->queue, now)))
        req_fail(REQ_OF_QE(e), TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded waiting for a decode node with room",
                 "deadline");
    td_metric_set(s->m_queue_depth, router_queue_len(&s->queue));
    for (router_req_t *r = s->reqs, *next; r; r = next) {
        next = r->next;
        if (r->on_node && r->deadline_ns && now >= r->deadline_ns)
            req_fail(r, TD_GRPC_DEADLINE_EXCEEDED, "deadline exceeded", "deadline");
        else if (backlog_over(r))
            req_fail_slow(r);
    }
}

/* The router's part of shutdown (td_node_shutdown closes /metrics and the signals). */
static void on_shutdown(void *data)
{
    router_state_t *s = data;
    s->shutting_down = true;
    while (s->reqs)
        req_fail(s->reqs, TD_GRPC_UNAVAILABLE, "router shutting down", "unavailable");
    for (int32_t i = 0; s->peers && i < (int32_t)s->cfg.max_nodes; i++)
        peer_drop(s, i);
    td_grpc_server_close(s->gateway, NULL, NULL);
    td_grpc_server_close(s->control, NULL, NULL);
    s->gateway = s->control = NULL;
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
        (st = td_metrics_gauge(m, "tandem_router_decode_nodes_up", "decode nodes registered, live and streaming", &s->m_nodes_decode)) ||
        (st = td_metrics_gauge(m, "tandem_router_queue_depth", "requests waiting in the admission queue", &s->m_queue_depth)) ||
        (st = td_metrics_histogram(m, "tandem_router_queue_seconds", "request arrival until a pair was chosen",
                                   td_metrics_latency_buckets, td_metrics_latency_n_buckets, &s->m_queue_s)) ||
        (st = td_metrics_counter(m, "tandem_router_first_token_mismatch_total",
                                 "first tokens on which the Prefill stream and the decode node disagreed", &s->m_first_mismatch)))
        return st;
    return TD_OK;
}

int router_main(int argc, char **argv)
{
    router_state_t st_, *s = &st_;
    memset(s, 0, sizeof *s);
    router_config_t *cfg = &s->cfg;
    const td_node_config_t *pc = &s->proc.cfg;
    *cfg = (router_config_t){.control_port = 0, .max_active = 1024, .max_queue = 4096, .request_timeout_ms = 300000,
                             .max_backlog_tokens = 4096, .send_queue_bytes = 256 << 10, .default_max_tokens = 256,
                             .lease_ms = 10000, .max_prefill_wait_ms = 5000, .max_tokenizing = 64, .rpc_timeout_ms = 5000, .heartbeat_ms = 200,
                             .heartbeat_timeout_ms = 1500, .max_nodes = 256};
    const td_node_conf_key_t keys[] = {
        {"tokenizer", TD_NODE_CONF_STR, &cfg->tokenizer, 0, 0, "tokenizer path (none: prompts as ids only, no text)"},
        {"control-port", TD_NODE_CONF_I64, &cfg->control_port, 0, 65535, "control gRPC port (0 = any)"},
        {"max-active", TD_NODE_CONF_I64, &cfg->max_active, 1, 1 << 20, "requests on nodes at once; more wait in the queue"},
        {"max-queue", TD_NODE_CONF_I64, &cfg->max_queue, 0, 1 << 20,
         "requests waiting for room at most; beyond → RESOURCE_EXHAUSTED"},
        {"request-timeout-ms", TD_NODE_CONF_I64, &cfg->request_timeout_ms, 0, 86400000,
         "deadline of a request without grpc-timeout (0 = none)"},
        {"max-backlog-tokens", TD_NODE_CONF_I64, &cfg->max_backlog_tokens, 1, 1 << 24,
         "tokens held for a client not reading its stream; beyond → RESOURCE_EXHAUSTED"},
        {"send-queue-bytes", TD_NODE_CONF_I64, &cfg->send_queue_bytes, 1, 1 << 30,
         "bytes queued per gateway stream before tokens wait in the router's backlog"},
        {"default-max-tokens", TD_NODE_CONF_I64, &cfg->default_max_tokens, 1, 1 << 20, "max_tokens when a request gives 0"},
        {"lease-ms", TD_NODE_CONF_I64, &cfg->lease_ms, 10, 600000,
         "decode lease and Prefill bound, beyond twice the estimated prefill wait"},
        {"max-tokenizing", TD_NODE_CONF_I64, &cfg->max_tokenizing, 1, 4096,
         "text prompts encoded off the loop at once; beyond → RESOURCE_EXHAUSTED"},
        {"max-prefill-wait-ms", TD_NODE_CONF_I64, &cfg->max_prefill_wait_ms, 0, 600000,
         "a prefill node with work queued takes no prompt it would reach later than this (0 = no bound)"},
        {"rpc-timeout-ms", TD_NODE_CONF_I64, &cfg->rpc_timeout_ms, 10, 600000, "bound of Admit/Release calls"},
        {"heartbeat-ms", TD_NODE_CONF_I64, &cfg->heartbeat_ms, 10, 60000, "heartbeat interval asked of nodes"},
        {"heartbeat-timeout-ms", TD_NODE_CONF_I64, &cfg->heartbeat_timeout_ms, 20, 600000, "silence before a node is dropped"},
        {"max-nodes", TD_NODE_CONF_I64, &cfg->max_nodes, 1, 65536, "registered nodes at most"},
    };
    const td_node_spec_t spec = {.prog = "router", .kind = TD_NODE_ROUTER, .on_shutdown = on_shutdown, .data = s};
    int rc;
    if (!td_node_configure(&s->proc, &spec, keys, (int)TD_ARRAY_LEN(keys), argc, argv, &rc))
        return rc;
    rc = 1;
    td_status_t st;
    router_registry_config_t rc_ = router_registry_config_default();
    rc_.max_nodes = (int32_t)cfg->max_nodes;
    rc_.heartbeat_timeout_ns = cfg->heartbeat_timeout_ms * 1000000;
    s->policy = router_policy_config_default();
    s->policy.max_prefill_wait_s = (double)cfg->max_prefill_wait_ms * 1e-3;
    if ((cfg->tokenizer && (st = td_tokenizer_load(cfg->tokenizer, &s->tok)) != TD_OK) ||
        (st = router_registry_create(&rc_, &s->reg)) != TD_OK)
        goto out;
    if (!(s->peers = calloc((size_t)cfg->max_nodes, sizeof *s->peers))) {
        td_errorf(TD_ERR_NOMEM, "router: out of memory");
        goto out;
    }
    for (int64_t i = 0; i < cfg->max_nodes; i++)
        s->peers[i].s = s;
    router_queue_init(&s->queue, (int32_t)cfg->max_queue);
    for (s->lease_buckets = 64; s->lease_buckets < 2 * (uint64_t)cfg->max_active;)
        s->lease_buckets *= 2;
    if (!(s->lease_map = calloc(s->lease_buckets, sizeof *s->lease_map))) {
        td_errorf(TD_ERR_NOMEM, "router: out of memory");
        goto out;
    }
    if ((st = td_metrics_create(&s->metrics)) != TD_OK || (st = init_metrics(s)) != TD_OK)
        goto out;
    td_grpc_server_config_t gc = td_grpc_server_config_default();
    gc.host = pc->host;
    gc.port = (uint16_t)pc->port;
    gc.metrics = s->metrics;
    gc.send_queue_bytes = (size_t)cfg->send_queue_bytes;
    if ((st = td_grpc_server_create(&s->proc.loop, &gc, &s->gateway)) != TD_OK)
        goto out;
    gc.port = (uint16_t)cfg->control_port;
    gc.send_queue_bytes = td_grpc_server_config_default().send_queue_bytes;
    if ((st = td_grpc_server_create(&s->proc.loop, &gc, &s->control)) != TD_OK || (st = add_methods(s)) != TD_OK)
        goto out;
    if ((st = td_node_serve(&s->proc, s->metrics)) != TD_OK)
        goto out;
    uv_timer_init(&s->proc.loop, &s->tick);
    s->tick.data = s;
    uv_timer_start(&s->tick, on_tick, 50, 50);
    uv_idle_init(&s->proc.loop, &s->pump_idle);
    s->pump_idle.data = s;
    uv_prepare_init(&s->proc.loop, &s->turn_prepare);
    s->turn_prepare.data = s;
    uv_prepare_start(&s->turn_prepare, on_turn);
    s->handles_up = true;
    printf("gateway: %s:%u\ncontrol: %s:%u\nmetrics: http://%s:%u/metrics\n", pc->advertise,
           td_grpc_server_port(s->gateway), pc->advertise, td_grpc_server_port(s->control), pc->advertise,
           td_node_metrics_port(&s->proc));
    fflush(stdout);

    rc = td_node_run(&s->proc);
out:
    td_node_stop(&s->proc);
    for (int64_t i = 0; s->peers && i < cfg->max_nodes; i++)
        free(s->peers[i].xfer_desc);
    free(s->peers);
    free(s->lease_map);
    router_registry_destroy(s->reg);
    td_tokenizer_destroy(s->tok);
    td_metrics_destroy(s->metrics);
    td_node_free(&s->proc);
    return rc;
}
