/*
 * test_router_relay: the real `tandem router` process ($TANDEM_BIN) against fake nodes
 * that this test plays itself (td_node_fake: one server answering PrefillNode and
 * DecodeNode calls, registered as one prefill and one decode node), so every message the
 * router sees from its nodes, and when, is decided here:
 *
 *  - token 0 is relayed exactly once whether the Prefill stream's FIRST_TOKEN or the
 *    lease's first step entry comes first, and a one-message (phase-less) Prefill works;
 *  - log-probabilities go out aligned with the ids, the prompt's with the first message,
 *    token 0's from the Prefill stream: when the decode node's entry for it comes first the
 *    output (and a finish right behind it) is held until the Prefill stream's logprob arrives;
 *  - a client that does not read gets every token, coalesced, once it reads again (no
 *    token dropped), and a client that stays away past max-backlog-tokens gets
 *    RESOURCE_EXHAUSTED and its lease is Released;
 *  - the admission queue: with max-active 1 the waiting requests are admitted by priority
 *    then arrival, beyond max-queue RESOURCE_EXHAUSTED at once, a queued request's
 *    deadline ends it with DEADLINE_EXCEEDED, and a running request's deadline Releases
 *    its lease with reason DEADLINE;
 *  - an Admit refused RESOURCE_EXHAUSTED puts the request back in the queue, and the node
 *    is not asked again at every StepBatch, only after a finish there;
 *  - a sequence the decode node drops while its Prefill still runs: the Prefill call is
 *    cancelled and the request fails over (UNAVAILABLE when no other pair exists);
 *  - a sequence dropped after tokens went out moves to another pair (a migration): the new
 *    Admit carries the tokens the client has (replay_ids), the new Prefill's token 0 is not
 *    relayed again, the stream goes on from the decode node's entries and its last message
 *    says it moved; past --max-migrations it ends UNAVAILABLE naming the bound.
 *
 * Skips when TANDEM_BIN is not set.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "control.pb-c.h"
#include "tandem.pb-c.h"
#include "td_child.h"
#include "td_grpc.h"
#include "td_kv_layout.h"
#include "td_node_fake.h"
#include "td_util.h"

#define MAX_LEASES 16
#define MAX_CALLS 8

typedef struct lease {
    char request_id[64];
    uint64_t id;
    td_grpc_call_t *prefill; /* held open until the scenario ends it */
    bool released;
    int release_reason;
    uint32_t replay[8];           /* AdmitRequest.replay_ids (a moved stream) */
    size_t n_replay;
    bool prefill_logprobs;        /* its Prefill asked for log-probabilities */
} lease_t;

typedef struct gen {
    uint32_t ids[65536];
    size_t n_ids;
    float lps[64];                /* logprobs, in the order they came */
    uint32_t lp_ids[64];
    size_t n_lps;
    size_t n_prompt_lps;          /* prompt logprobs received ... */
    int prompt_lps_msg;           /* ... in this message (1 = the first) */
    int n_messages;
    int finish_reason;
    uint32_t migrations;          /* the last message's usage.migrations */
    bool done;
    td_grpc_code_t code;
    char message[256];
    td_grpc_client_call_t *call;
} gen_t;

typedef struct env {
    td_child_t router;            /* `tandem router`, its stdout piped to us */
    uint16_t gateway_port, control_port;
    uv_loop_t loop;
    uv_timer_t tick;
    td_node_fake_t *nodes;        /* the fake prefill + decode control API */
    td_grpc_channel_t *control;   /* to the router's Registry */
    td_grpc_channel_t *gateway;   /* to the router's Generation */
    int registered;
    lease_t leases[MAX_LEASES];
    int n_leases;
    int n_releases;
    int refuse_admits;            /* refuse this many Admits RESOURCE_EXHAUSTED */
    int n_admit_calls;
    int n_prefill_calls;
    uint32_t prefill_first_token; /* what the fake prefill answers; 0 = hold the call */
    bool prefill_phaseless;       /* answer like a one-message prefill node */
} env_t;

/* ---- fake nodes --------------------------------------------------------------------------- */

static lease_t *lease_by_request(env_t *e, const char *id)
{
    for (int i = e->n_leases - 1; i >= 0; i--) /* the newest: a moved request has several */
        if (!strcmp(e->leases[i].request_id, id))
            return &e->leases[i];
    return NULL;
}

static void on_admit(td_node_fake_t *f, td_grpc_call_t *call, const Tandem__Control__V1__AdmitRequest *q)
{
    env_t *e = td_node_fake_data(f);
    e->n_admit_calls++;
    if (e->refuse_admits > 0) {
        e->refuse_admits--;
        td_grpc_call_finish(call, TD_GRPC_RESOURCE_EXHAUSTED, "fake decode node: full");
        return;
    }
    cr_assert_lt(e->n_leases, MAX_LEASES);
    lease_t *l = &e->leases[e->n_leases++];
    snprintf(l->request_id, sizeof l->request_id, "%s", q->request_id);
    l->id = 100 + (uint64_t)e->n_leases;
    for (size_t i = 0; i < q->n_replay_ids && i < TD_ARRAY_LEN(l->replay); i++)
        l->replay[i] = q->replay_ids[i];
    l->n_replay = q->n_replay_ids;
    td_node_fake_admit_reply(call, l->id, (const uint32_t[]){0, 1, 2, 3}, 4);
}

static void send_prefill(td_grpc_call_t *call, uint32_t token, Tandem__Control__V1__PrefillPhase phase)
{
    cr_assert_eq(td_node_fake_prefill_send(call, token, phase), TD_OK);
}

static void on_prefill_cancel(td_grpc_call_t *call, td_status_t why, void *call_data)
{
    lease_t *l = call_data;
    if (l)
        l->prefill = NULL;
    td_grpc_call_finish(call, TD_GRPC_CANCELLED, NULL);
}

static void on_prefill(td_node_fake_t *f, td_grpc_call_t *call, const Tandem__Control__V1__PrefillRequest *q)
{
    env_t *e = td_node_fake_data(f);
    lease_t *l = lease_by_request(e, q->request_id);
    cr_assert_not_null(l, "Prefill for %s before its Admit", q->request_id);
    cr_assert_eq(q->lease_id, l->id);
    e->n_prefill_calls++;
    l->prefill_logprobs = q->logprobs != NULL;
    if (e->prefill_phaseless) {
        send_prefill(call, e->prefill_first_token, TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_UNSPECIFIED);
        td_grpc_call_finish(call, TD_GRPC_OK, NULL);
        return;
    }
    if (e->prefill_first_token)
        send_prefill(call, e->prefill_first_token, TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_FIRST_TOKEN);
    l->prefill = call;
    td_grpc_call_set_data(call, l);
    td_grpc_call_on_cancel(call, on_prefill_cancel);
}

/* Ends a held Prefill stream: KV_DELIVERED, then OK. */
static void prefill_deliver(lease_t *l)
{
    cr_assert_not_null(l->prefill);
    send_prefill(l->prefill, 0, TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_KV_DELIVERED);
    td_grpc_call_set_data(l->prefill, NULL);
    td_grpc_call_finish(l->prefill, TD_GRPC_OK, NULL);
    l->prefill = NULL;
}

static void on_release(td_node_fake_t *f, td_grpc_call_t *call, const Tandem__Control__V1__ReleaseRequest *q)
{
    env_t *e = td_node_fake_data(f);
    for (int i = 0; i < e->n_leases; i++)
        if (e->leases[i].id == q->lease_id) {
            e->leases[i].released = true;
            e->leases[i].release_reason = q->reason;
        }
    e->n_releases++;
    Tandem__Control__V1__ReleaseResponse r = TANDEM__CONTROL__V1__RELEASE_RESPONSE__INIT;
    r.released = true;
    td_grpc_call_reply(call, &r.base);
}

/* One StepBatch with one entry per (lease, token, event). */
static td_status_t step(env_t *e, int n, const lease_t *const *ls, const uint32_t *tokens,
                        const Tandem__Control__V1__SeqEvent *events)
{
    td_node_fake_entry_t seqs[8];
    cr_assert_leq(n, 8);
    for (int i = 0; i < n; i++)
        seqs[i] = (td_node_fake_entry_t){.lease_id = ls[i]->id, .token = tokens[i], .event = events[i]};
    cr_assert(td_node_fake_subscribed(e->nodes, 0), "no Steps subscription");
    return td_node_fake_step(e->nodes, 0, seqs, (size_t)n, 1000);
}

static void token(env_t *e, const lease_t *l, uint32_t t)
{
    Tandem__Control__V1__SeqEvent ev = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN;
    cr_assert_eq(step(e, 1, &l, &t, &ev), TD_OK);
}

static void dropped(env_t *e, const lease_t *l)
{
    uint32_t t = 0;
    Tandem__Control__V1__SeqEvent ev = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FAILED;
    cr_assert_eq(step(e, 1, &l, &t, &ev), TD_OK);
}

static void finish(env_t *e, const lease_t *l)
{
    uint32_t t = 0;
    Tandem__Control__V1__SeqEvent ev = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_LENGTH;
    cr_assert_eq(step(e, 1, &l, &t, &ev), TD_OK);
}

/* ---- the router process and the loop ------------------------------------------------------ */

static void on_tick(uv_timer_t *t) {}

static void on_register_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    env_t *e = data;
    cr_assert_eq(code, TD_GRPC_OK, "RegisterNode: %s", msg);
    e->registered++;
}

#define RUN_UNTIL(e, cond)                                                                      \
    do {                                                                                        \
        uint64_t t0_ = td_now_ns();                                                             \
        while (!(cond) && td_now_ns() - t0_ < 20000000000ull)                                   \
            uv_run(&(e)->loop, UV_RUN_ONCE);                                                    \
        cr_assert((cond), "timed out waiting for %s", #cond);                                   \
    } while (0)

static void register_node(env_t *e, const char *id, Tandem__Control__V1__Role role, uint16_t port)
{
    Tandem__Control__V1__KvLayout kl = TANDEM__CONTROL__V1__KV_LAYOUT__INIT;
    kl.model_fingerprint = 0x1234;
    kl.dtype = TD_F32;
    kl.block_size = 16;
    kl.n_layers = 2;
    kl.n_kv_heads = 2;
    kl.head_dim = 8;
    kl.version = TD_KV_LAYOUT_VERSION;
    Tandem__Control__V1__Capacity cap = TANDEM__CONTROL__V1__CAPACITY__INIT;
    cap.total_kv_blocks = 1000;
    cap.max_batch = 64;
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    Tandem__Control__V1__RegisterRequest q = TANDEM__CONTROL__V1__REGISTER_REQUEST__INIT;
    q.node_id = (char *)id;
    q.role = role;
    q.model = "default";
    q.layout = &kl;
    q.control_address = addr;
    q.capacity = &cap;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__register_response__descriptor,
                             .on_done = on_register_done, .data = e, .timeout_ms = 5000};
    cr_assert_eq(td_grpc_channel_call(e->control, "/tandem.control.v1.Registry/RegisterNode", &q.base, &o, NULL),
                 TD_OK);
}

/* Reads "key: HOST:PORT" lines of the router's stdout until both ports are known. */
static void read_ports(env_t *e)
{
    char line[512];
    while ((!e->gateway_port || !e->control_port) &&
           td_child_read_line(&e->router, 10000, line, sizeof line) == TD_OK) {
        const char *colon = strrchr(line, ':');
        if (!strncmp(line, "gateway: ", 9) && colon)
            e->gateway_port = (uint16_t)atoi(colon + 1);
        else if (!strncmp(line, "control: ", 9) && colon)
            e->control_port = (uint16_t)atoi(colon + 1);
    }
    cr_assert(e->gateway_port && e->control_port, "the router did not print its ports");
}

static void env_start(env_t *e, const char *const *router_args)
{
    const char *bin = getenv("TANDEM_BIN");
    if (!bin || !*bin)
        cr_skip_test("TANDEM_BIN is not set (ctest sets it to the tandem binary)");
    signal(SIGPIPE, SIG_IGN);
    memset(e, 0, sizeof *e);
    /* the fake nodes never heartbeat, so the prefill node reports no rate and the router's
       own bookings never drain: no prefill-wait bound (router_policy), or a second request
       would wait for a rate that never comes */
    char *argv[32] = {"tandem", "router", "--log-level", "error", "--heartbeat-timeout-ms", "600000",
                      "--max-prefill-wait-ms", "0"};
    int argc = 8;
    for (int i = 0; router_args && router_args[i]; i++)
        argv[argc++] = (char *)router_args[i];
    argv[argc] = NULL;
    td_child_config_t rc = td_child_config_default();
    rc.file = bin;
    rc.argv = argv;
    rc.out = TD_CHILD_OUT_PIPE;
    rc.die_with_parent = true; /* a failed assertion ends the test process */
    cr_assert_eq(td_child_spawn(&rc, &e->router), TD_OK, "%s", td_last_error());
    read_ports(e);
    cr_assert_eq(uv_loop_init(&e->loop), 0);
    uv_timer_init(&e->loop, &e->tick);
    uv_timer_start(&e->tick, on_tick, 10, 10);
    static const td_node_fake_ops_t ops = {.admit = on_admit, .release = on_release, .prefill = on_prefill};
    td_node_fake_config_t fc = td_node_fake_config_default();
    cr_assert_eq(td_node_fake_create(&e->loop, &fc, &ops, e, &e->nodes), TD_OK, "%s", td_last_error());
    td_grpc_channel_config_t cc = td_grpc_channel_config_default();
    cr_assert_eq(td_grpc_channel_create(&e->loop, "127.0.0.1", e->control_port, &cc, &e->control), TD_OK);
    cc.initial_window_bytes = 65535; /* the smallest: a paused client holds the router back soon */
    cr_assert_eq(td_grpc_channel_create(&e->loop, "127.0.0.1", e->gateway_port, &cc, &e->gateway), TD_OK);
    uint16_t port = td_node_fake_port(e->nodes);
    register_node(e, "p0", TANDEM__CONTROL__V1__ROLE__ROLE_PREFILL, port);
    register_node(e, "d0", TANDEM__CONTROL__V1__ROLE__ROLE_DECODE, port);
    RUN_UNTIL(e, e->registered == 2 && td_node_fake_subscribed(e->nodes, 0));
}

static void env_stop(env_t *e)
{
    int status = 0;
    td_child_stop_all(&e->router, 1, SIGTERM, 10000, &status);
    td_child_close(&e->router);
    for (int i = 0; i < e->n_leases; i++)
        if (e->leases[i].prefill) {
            td_grpc_call_set_data(e->leases[i].prefill, NULL);
            td_grpc_call_finish(e->leases[i].prefill, TD_GRPC_CANCELLED, NULL);
        }
    td_grpc_channel_close(e->control, NULL, NULL);
    td_grpc_channel_close(e->gateway, NULL, NULL);
    td_node_fake_close(e->nodes);
    uv_close((uv_handle_t *)&e->tick, NULL);
    uv_run(&e->loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&e->loop), 0, "test loop has handles left");
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "router exit status %d", status);
}

/* ---- the gateway client -------------------------------------------------------------------- */

static void on_gen_msg(td_grpc_client_call_t *c, const ProtobufCMessage *msg, void *data)
{
    gen_t *g = data;
    const Tandem__V1__GenerateResponse *m = (const void *)msg;
    for (size_t i = 0; i < m->n_token_ids && g->n_ids < TD_ARRAY_LEN(g->ids); i++)
        g->ids[g->n_ids++] = m->token_ids[i];
    g->n_messages++;
    for (size_t i = 0; i < m->n_logprobs && g->n_lps < TD_ARRAY_LEN(g->lps); i++) {
        g->lp_ids[g->n_lps] = m->logprobs[i]->token_id;
        g->lps[g->n_lps++] = m->logprobs[i]->logprob;
    }
    if (m->n_prompt_logprobs) {
        g->n_prompt_lps += m->n_prompt_logprobs;
        g->prompt_lps_msg = g->n_messages;
    }
    if (m->finish_reason)
        g->finish_reason = m->finish_reason;
    if (m->usage)
        g->migrations = m->usage->migrations;
}

static void on_gen_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data)
{
    gen_t *g = data;
    g->done = true;
    g->code = code;
    g->call = NULL;
    snprintf(g->message, sizeof g->message, "%s", msg);
}

static void generate_lp(env_t *e, gen_t *g, const char *id, int32_t priority, bool has_priority, uint32_t timeout_ms,
                        const Tandem__V1__LogprobsRequest *lp)
{
    uint32_t prompt[3] = {1, 2, 3};
    Tandem__V1__Priority p = TANDEM__V1__PRIORITY__INIT;
    p.value = priority;
    Tandem__V1__GenerateRequest q = TANDEM__V1__GENERATE_REQUEST__INIT;
    q.prompt_ids = prompt;
    q.n_prompt_ids = 3;
    q.max_tokens = 16;
    q.request_id = (char *)id;
    if (has_priority)
        q.priority = &p;
    q.logprobs = (Tandem__V1__LogprobsRequest *)lp;
    memset(g, 0, sizeof *g);
    td_grpc_call_opts_t o = {.response_desc = &tandem__v1__generate_response__descriptor, .on_message = on_gen_msg,
                             .on_done = on_gen_done, .data = g, .timeout_ms = timeout_ms};
    cr_assert_eq(td_grpc_channel_call(e->gateway, "/tandem.v1.Generation/Generate", &q.base, &o, &g->call), TD_OK);
}

static void generate(env_t *e, gen_t *g, const char *id, int32_t priority, bool has_priority, uint32_t timeout_ms)
{
    generate_lp(e, g, id, priority, has_priority, timeout_ms, NULL);
}

/* Request "a" while the fake prefill node holds its Prefill call open; returns its lease
 * once that call arrived. */
static lease_t *start_held_prefill(env_t *e, gen_t *g)
{
    e->prefill_first_token = 0; /* hold the Prefill stream */
    generate(e, g, "a", 0, false, 0);
    RUN_UNTIL(e, e->n_leases == 1 && e->leases[0].prefill);
    return &e->leases[0];
}

/* Waits until g ended and checks that it ended OK with exactly the ids want[0..n). */
static void expect_ids(env_t *e, gen_t *g, const uint32_t *want, size_t n)
{
    RUN_UNTIL(e, g->done);
    cr_assert_eq(g->code, TD_GRPC_OK, "%s", g->message);
    cr_assert_eq(g->n_ids, n);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(g->ids[i], want[i], "token %zu is %u, not %u", i, g->ids[i], want[i]);
}

/* ---- tests ----------------------------------------------------------------------------------- */

TestSuite(router_relay, .timeout = 120);

Test(router_relay, first_token_from_prefill_then_duplicate_dropped)
{
    env_t e;
    env_start(&e, NULL);
    e.prefill_first_token = 7;
    static gen_t g;
    generate(&e, &g, "a", 0, false, 0);
    RUN_UNTIL(&e, e.n_leases == 1 && e.leases[0].prefill && g.n_ids == 1);
    cr_assert_eq(g.ids[0], 7, "token 0 is relayed from FIRST_TOKEN before any step");
    lease_t *l = &e.leases[0];
    prefill_deliver(l);
    token(&e, l, 7); /* the decode node reports the prefill's token again: dropped */
    token(&e, l, 8);
    token(&e, l, 9);
    finish(&e, l);
    expect_ids(&e, &g, (const uint32_t[]){7, 8, 9}, 3);
    cr_assert_eq(g.finish_reason, TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    env_stop(&e);
}

Test(router_relay, first_token_from_decode_then_prefill_dropped)
{
    env_t e;
    env_start(&e, NULL);
    static gen_t g;
    lease_t *l = start_held_prefill(&e, &g);
    token(&e, l, 7);
    token(&e, l, 8);
    RUN_UNTIL(&e, g.n_ids == 2);
    send_prefill(l->prefill, 7, TANDEM__CONTROL__V1__PREFILL_PHASE__PREFILL_PHASE_FIRST_TOKEN); /* late: dropped */
    prefill_deliver(l);
    token(&e, l, 9);
    finish(&e, l);
    expect_ids(&e, &g, (const uint32_t[]){7, 8, 9}, 3);
    env_stop(&e);
}

/* The decode node's entry for token 0 (an adopted sequence's: no logprob) comes before the
 * Prefill stream's FIRST_TOKEN: nothing goes out until the latter gives token 0's logprob,
 * then ids and logprobs go out aligned, the prompt's with the first message. */
Test(router_relay, logprobs_token0_waits_for_the_prefill_stream)
{
    env_t e;
    env_start(&e, NULL);
    static gen_t g;
    Tandem__V1__LogprobsRequest lq = TANDEM__V1__LOGPROBS_REQUEST__INIT;
    lq.top_logprobs = 1;
    lq.prompt = true;
    e.prefill_first_token = 0; /* hold the Prefill stream */
    generate_lp(&e, &g, "a", 0, false, 0, &lq);
    RUN_UNTIL(&e, e.n_leases == 1 && e.leases[0].prefill);
    lease_t *l = &e.leases[0];
    const td_token_logprob_t lp8 = {.token = 8, .logprob = -0.5f, .n_top = 1, .top = {{8, -0.5f}}};
    td_node_fake_entry_t seqs[2] = {
        {.lease_id = l->id, .token = 7, .event = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN},
        {.lease_id = l->id, .token = 8, .event = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN, .logprob = &lp8}};
    cr_assert_eq(td_node_fake_step(e.nodes, 0, &seqs[0], 1, 1000), TD_OK);
    cr_assert_eq(td_node_fake_step(e.nodes, 0, &seqs[1], 1, 1000), TD_OK);
    uint64_t t0 = td_now_ns();
    while (td_now_ns() - t0 < 300000000ull) /* 0.3 s: the steps have long reached the router */
        uv_run(&e.loop, UV_RUN_NOWAIT);
    cr_assert_eq(g.n_messages, 0, "the output went out before token 0's logprob came");
    const td_token_logprob_t lp7 = {.token = 7, .logprob = -0.25f, .n_top = 1, .top = {{7, -0.25f}}};
    const td_token_logprob_t prompt[3] = {{.token = 1}, {.token = 2, .logprob = -3.0f}, {.token = 3, .logprob = -4.0f}};
    cr_assert_eq(td_node_fake_prefill_send_logprobs(l->prefill, 7, &lp7, prompt, 3), TD_OK);
    RUN_UNTIL(&e, g.n_ids == 2);
    cr_assert_eq(g.n_lps, 2);
    cr_assert(g.lp_ids[0] == 7 && g.lps[0] == -0.25f, "token 0: %u %g", g.lp_ids[0], (double)g.lps[0]);
    cr_assert(g.lp_ids[1] == 8 && g.lps[1] == -0.5f, "token 1: %u %g", g.lp_ids[1], (double)g.lps[1]);
    cr_assert_eq(g.n_prompt_lps, 3);
    cr_assert_eq(g.prompt_lps_msg, 1, "the prompt's logprobs came in message %d", g.prompt_lps_msg);
    prefill_deliver(l);
    const td_token_logprob_t lp9 = {.token = 9, .logprob = -1.0f};
    td_node_fake_entry_t s9 = {.lease_id = l->id, .token = 9, .event = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN,
                               .logprob = &lp9};
    cr_assert_eq(td_node_fake_step(e.nodes, 0, &s9, 1, 1000), TD_OK);
    finish(&e, l);
    expect_ids(&e, &g, (const uint32_t[]){7, 8, 9}, 3);
    cr_assert_eq(g.n_lps, 3);
    cr_assert(g.lp_ids[2] == 9 && g.lps[2] == -1.0f);
    env_stop(&e);
}

/* max_tokens 1 as the decode node reports it: token 0 and the finish in one StepBatch, before
 * the Prefill stream's FIRST_TOKEN: the last message waits for token 0's logprob. */
Test(router_relay, logprobs_a_finish_waits_for_token0s_logprob)
{
    env_t e;
    env_start(&e, NULL);
    static gen_t g;
    Tandem__V1__LogprobsRequest lq = TANDEM__V1__LOGPROBS_REQUEST__INIT;
    lq.prompt = true;
    e.prefill_first_token = 0;
    generate_lp(&e, &g, "a", 0, false, 0, &lq);
    RUN_UNTIL(&e, e.n_leases == 1 && e.leases[0].prefill);
    lease_t *l = &e.leases[0];
    td_node_fake_entry_t seqs[2] = {
        {.lease_id = l->id, .token = 7, .event = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN},
        {.lease_id = l->id, .event = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FINISHED_LENGTH}};
    cr_assert_eq(td_node_fake_step(e.nodes, 0, seqs, 2, 1000), TD_OK);
    uint64_t t0 = td_now_ns();
    while (td_now_ns() - t0 < 300000000ull)
        uv_run(&e.loop, UV_RUN_NOWAIT);
    cr_assert(!g.done && g.n_messages == 0, "the request ended before token 0's logprob came");
    const td_token_logprob_t lp7 = {.token = 7, .logprob = -0.75f};
    const td_token_logprob_t prompt[3] = {{.token = 1}, {.token = 2, .logprob = -3.0f}, {.token = 3, .logprob = -4.0f}};
    cr_assert_eq(td_node_fake_prefill_send_logprobs(l->prefill, 7, &lp7, prompt, 3), TD_OK);
    expect_ids(&e, &g, (const uint32_t[]){7}, 1);
    cr_assert(g.n_lps == 1 && g.lps[0] == -0.75f);
    cr_assert_eq(g.n_prompt_lps, 3);
    cr_assert_eq(g.finish_reason, TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    env_stop(&e); /* the ended request cancelled its Prefill call */
}

Test(router_relay, phaseless_prefill_reply_counts_once)
{
    env_t e;
    env_start(&e, NULL);
    e.prefill_first_token = 5;
    e.prefill_phaseless = true;
    static gen_t g;
    generate(&e, &g, "a", 0, false, 0);
    RUN_UNTIL(&e, g.n_ids == 1);
    lease_t *l = &e.leases[0];
    token(&e, l, 5);
    token(&e, l, 6);
    finish(&e, l);
    expect_ids(&e, &g, (const uint32_t[]){5, 6}, 2);
    env_stop(&e);
}

/* Enough single-token steps to fill a paused client's 64 KiB window and the router's send
 * queue even when coalesced: ids of 4 varint bytes, 160 KB of them. */
#define FLOOD 40000
#define BIG 0x200000u

/* Sends a single-token step for l, waiting out the router's TD_ERR_BUSY. */
static void flood_step(env_t *e, const lease_t *l, uint32_t id)
{
    td_status_t st;
    while ((st = step(e, 1, (const lease_t *const[]){l}, &id,
                      (Tandem__Control__V1__SeqEvent[]){TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_TOKEN})) ==
           TD_ERR_BUSY)
        uv_run(&e->loop, UV_RUN_ONCE);
    cr_assert_eq(st, TD_OK);
}

/* Starts request "a", pauses its client after the first token (token 1) and returns its
 * lease. */
static lease_t *start_paused_client(env_t *e, gen_t *g)
{
    e->prefill_first_token = 1;
    e->prefill_phaseless = true;
    generate(e, g, "a", 0, false, 0);
    RUN_UNTIL(e, g->n_ids == 1);
    td_grpc_client_call_pause(g->call, true);
    lease_t *l = &e->leases[0];
    token(e, l, 1);
    return l;
}

Test(router_relay, paused_client_gets_every_token_coalesced)
{
    env_t e;
    const char *args[] = {"--send-queue-bytes", "1024", "--max-backlog-tokens", "100000", NULL};
    env_start(&e, args);
    static gen_t g;
    lease_t *l = start_paused_client(&e, &g); /* then steps BIG+2 .. BIG+FLOOD */
    for (uint32_t t = 2; t <= FLOOD; t++)
        flood_step(&e, l, BIG + t);
    finish(&e, l);
    /* let the router take every step while the client still does not read */
    for (int i = 0; i < 100; i++)
        uv_run(&e.loop, UV_RUN_NOWAIT);
    usleep(200000);
    td_grpc_client_call_pause(g.call, false);
    RUN_UNTIL(&e, g.done);
    cr_assert_eq(g.code, TD_GRPC_OK, "%s", g.message);
    cr_assert_eq(g.n_ids, FLOOD);
    cr_assert_eq(g.ids[0], 1);
    for (uint32_t i = 1; i < FLOOD; i++)
        cr_assert_eq(g.ids[i], BIG + i + 1, "token %u", i);
    cr_assert_lt(g.n_messages, FLOOD, "a backlog goes out coalesced (%d messages)", g.n_messages);
    env_stop(&e);
}

Test(router_relay, client_not_reading_past_bound_ends_exhausted_and_releases)
{
    env_t e;
    const char *args[] = {"--send-queue-bytes", "1024", "--max-backlog-tokens", "64", NULL};
    env_start(&e, args);
    static gen_t g;
    lease_t *l = start_paused_client(&e, &g);
    /* A router that reads a burst of steps in one loop turn sends it as one message, which
     * its send bound admits (it bounds what is queued before a send, not one message): only
     * the tokens after that wait in the backlog. The router is stopped while a burst is
     * sent, so that this happens every run (a loaded machine did it by chance); then steps
     * go on until the router ends the request, bounded by time, not by a count that the
     * burst may swallow. */
    uint32_t t = 2;
    kill(e.router.pid, SIGSTOP);
    for (; t < 2 + 1000; t++)
        flood_step(&e, l, BIG + t);
    kill(e.router.pid, SIGCONT);
    uint64_t t0 = td_now_ns();
    for (; !l->released && td_now_ns() - t0 < 20000000000ull; t++) {
        flood_step(&e, l, BIG + t);
        uv_run(&e.loop, UV_RUN_NOWAIT);
    }
    cr_assert(l->released, "the router did not release the lease after %u tokens to a client that reads none", t - 1);
    td_grpc_client_call_pause(g.call, false);
    RUN_UNTIL(&e, g.done);
    /* The router ends it RESOURCE_EXHAUSTED; when a message was already half on the wire the
     * server cannot end it with trailers and resets the stream (CANCEL) instead. */
    cr_assert(g.code == TD_GRPC_RESOURCE_EXHAUSTED ||
                  (g.code == TD_GRPC_CANCELLED && strstr(g.message, "reset by the server")),
              "%s: %s", td_grpc_code_name(g.code), g.message);
    env_stop(&e);
}

Test(router_relay, queue_admits_by_priority_then_arrival)
{
    env_t e;
    const char *args[] = {"--max-active", "1", NULL};
    env_start(&e, args);
    e.prefill_first_token = 1;
    e.prefill_phaseless = true;
    static gen_t g[5];
    const char *ids[5] = {"a", "b", "c", "d", "e"};
    int32_t prio[5] = {0, 0, 5, 9, 0};
    for (int i = 0; i < 5; i++)
        generate(&e, &g[i], ids[i], prio[i], i != 1, 0); /* b: no priority field = 0 */
    const char *want[5] = {"a", "d", "c", "b", "e"};
    for (int k = 0; k < 5; k++) {
        RUN_UNTIL(&e, e.n_leases == k + 1);
        cr_assert_str_eq(e.leases[k].request_id, want[k], "admission %d", k);
        gen_t *gk = &g[e.leases[k].request_id[0] - 'a'];
        RUN_UNTIL(&e, gk->n_ids == 1); /* a decode node steps a lease only after its Prefill */
        finish(&e, &e.leases[k]);
    }
    for (int i = 0; i < 5; i++) {
        RUN_UNTIL(&e, g[i].done);
        cr_assert_eq(g[i].code, TD_GRPC_OK, "%s: %s", ids[i], g[i].message);
    }
    env_stop(&e);
}

Test(router_relay, queue_bound_refuses_at_once)
{
    env_t e;
    const char *args[] = {"--max-active", "1", "--max-queue", "1", NULL};
    env_start(&e, args);
    e.prefill_first_token = 1;
    e.prefill_phaseless = true;
    static gen_t g[3];
    generate(&e, &g[0], "a", 0, false, 0);
    RUN_UNTIL(&e, g[0].n_ids == 1);
    generate(&e, &g[1], "b", 0, false, 0);
    generate(&e, &g[2], "c", 0, false, 0);
    RUN_UNTIL(&e, g[2].done);
    cr_assert_eq(g[2].code, TD_GRPC_RESOURCE_EXHAUSTED, "%s", g[2].message);
    cr_assert_not(g[1].done);
    finish(&e, &e.leases[0]);
    RUN_UNTIL(&e, g[1].n_ids == 1);
    finish(&e, &e.leases[1]);
    RUN_UNTIL(&e, g[0].done && g[1].done);
    cr_assert_eq(g[0].code, TD_GRPC_OK);
    cr_assert_eq(g[1].code, TD_GRPC_OK);
    env_stop(&e);
}

Test(router_relay, deadline_in_queue_and_on_node)
{
    env_t e;
    const char *args[] = {"--max-active", "1", "--request-timeout-ms", "300", NULL};
    env_start(&e, args);
    e.prefill_first_token = 1;
    e.prefill_phaseless = true;
    static gen_t a, b;
    generate(&e, &a, "a", 0, false, 1000);       /* the client's deadline, 1 s: ends in the gRPC layer */
    RUN_UNTIL(&e, e.n_leases == 1);
    generate(&e, &b, "b", 0, false, 0);          /* the router's default, 300 ms: expires in the queue
                                                  * behind a, which never finishes */
    RUN_UNTIL(&e, b.done);
    cr_assert_not(a.done, "a ends at its own deadline, after b's");
    RUN_UNTIL(&e, a.done && b.done);
    cr_assert_eq(a.code, TD_GRPC_DEADLINE_EXCEEDED, "%s", a.message);
    cr_assert_eq(b.code, TD_GRPC_DEADLINE_EXCEEDED, "%s", b.message);
    RUN_UNTIL(&e, e.leases[0].released);
    cr_assert_eq(e.leases[0].release_reason, TANDEM__CONTROL__V1__RELEASE_REQUEST__REASON__REASON_DEADLINE);
    cr_assert_eq(e.n_leases, 1, "b was never admitted");
    env_stop(&e);
}

Test(router_relay, sequence_dropped_during_prefill_cancels_it_and_fails_over)
{
    env_t e;
    env_start(&e, NULL);
    static gen_t g;
    lease_t *l = start_held_prefill(&e, &g);
    uint32_t t = 0;
    Tandem__Control__V1__SeqEvent ev = TANDEM__CONTROL__V1__SEQ_EVENT__SEQ_EVENT_FAILED;
    cr_assert_eq(step(&e, 1, (const lease_t *const[]){l}, &t, &ev), TD_OK);
    /* nothing was sent, but the only pair was tried: UNAVAILABLE; the Prefill is cancelled */
    RUN_UNTIL(&e, g.done && !l->prefill);
    cr_assert_eq(g.code, TD_GRPC_UNAVAILABLE, "%s: %s", td_grpc_code_name(g.code), g.message);
    cr_assert_eq(g.n_ids, 0);
    env_stop(&e);
}

Test(router_relay, admit_refused_waits_in_queue_without_asking_per_step)
{
    env_t e;
    env_start(&e, NULL);
    e.prefill_first_token = 1;
    e.prefill_phaseless = true;
    static gen_t a, b;
    generate(&e, &a, "a", 0, false, 0);
    RUN_UNTIL(&e, a.n_ids == 1);
    e.refuse_admits = 1;
    generate(&e, &b, "b", 0, false, 0);
    RUN_UNTIL(&e, e.n_admit_calls == 2);
    lease_t *la = &e.leases[0];
    for (uint32_t t = 1; t <= 20; t++) /* t = 1: the prefill's token again, dropped */
        token(&e, la, t);                 /* each StepBatch says 1000 blocks are free */
    RUN_UNTIL(&e, a.n_ids == 20);
    cr_assert_eq(e.n_admit_calls, 2, "the refusing node was asked again per step (%d Admits)", e.n_admit_calls);
    cr_assert_not(b.done, "b waits in the queue: %s", b.message);
    finish(&e, la);
    RUN_UNTIL(&e, e.n_leases == 2 && b.n_ids == 1);
    cr_assert_str_eq(e.leases[1].request_id, "b");
    finish(&e, &e.leases[1]);
    RUN_UNTIL(&e, a.done && b.done);
    cr_assert_eq(a.code, TD_GRPC_OK, "%s", a.message);
    cr_assert_eq(b.code, TD_GRPC_OK, "%s", b.message);
    env_stop(&e);
}

Test(router_relay, dropped_after_tokens_moves_and_replays)
{
    env_t e;
    env_start(&e, (const char *const[]){"--max-migrations", "1", NULL});
    register_node(&e, "p1", TANDEM__CONTROL__V1__ROLE__ROLE_PREFILL, td_node_fake_port(e.nodes));
    RUN_UNTIL(&e, e.registered == 3);
    e.prefill_first_token = 7;
    e.prefill_phaseless = true;
    static gen_t a, b;
    generate(&e, &a, "a", 0, false, 0);
    RUN_UNTIL(&e, e.n_leases == 1 && a.n_ids == 1);
    token(&e, &e.leases[0], 7); /* the decode node's token 0: dropped */
    token(&e, &e.leases[0], 8);
    token(&e, &e.leases[0], 9);
    RUN_UNTIL(&e, a.n_ids == 3);
    dropped(&e, &e.leases[0]);
    /* moved: a new Admit (the other prefill node with d0) with what the client has, then
       its Prefill (the router has the lease: the decode node's entries are matched) */
    RUN_UNTIL(&e, e.n_leases == 2 && e.leases[1].n_replay == 3 && e.n_prefill_calls == 2);
    cr_assert_str_eq(e.leases[1].request_id, "a");
    cr_assert(e.leases[1].replay[0] == 7 && e.leases[1].replay[1] == 8 && e.leases[1].replay[2] == 9);
    token(&e, &e.leases[1], 10); /* its Prefill answered 7 (token 0 again): not relayed */
    token(&e, &e.leases[1], 11);
    finish(&e, &e.leases[1]);
    expect_ids(&e, &a, (const uint32_t[]){7, 8, 9, 10, 11}, 5);
    cr_assert_eq(a.migrations, 1, "usage.migrations %u", a.migrations);

    /* a second loss: past --max-migrations 1 */
    generate(&e, &b, "b", 0, false, 0);
    RUN_UNTIL(&e, e.n_leases == 3 && b.n_ids == 1);
    token(&e, &e.leases[2], 7); /* token 0 again: dropped */
    token(&e, &e.leases[2], 8);
    RUN_UNTIL(&e, b.n_ids == 2);
    dropped(&e, &e.leases[2]);
    RUN_UNTIL(&e, e.n_leases == 4 && e.leases[3].n_replay == 2 && e.n_prefill_calls == 4);
    token(&e, &e.leases[3], 9);
    RUN_UNTIL(&e, b.n_ids == 3);
    dropped(&e, &e.leases[3]);
    RUN_UNTIL(&e, b.done);
    cr_assert_eq(b.code, TD_GRPC_UNAVAILABLE, "%s: %s", td_grpc_code_name(b.code), b.message);
    cr_assert(strstr(b.message, "max-migrations 1"), "%s", b.message);
    cr_assert(b.n_ids == 3 && b.ids[0] == 7 && b.ids[1] == 8 && b.ids[2] == 9);
    env_stop(&e);
}
