/*
 * test_node_client: the node side of the registry protocol (td_node_client) against a scripted
 * router (a td_grpc server answering RegisterNode and Heartbeat as each test says), on one
 * real loop. A node hears once, with a reason, each time it loses its registration: a
 * heartbeat answered "reregister" (the router dropped it; heard before it registers again)
 * and a failed heartbeat (the client lets the registration go); a refused registration, the
 * heartbeats of a live registration, a new registration and closing the client say nothing.
 * (issue 37: a decode node the router dropped kept running what the router had failed or
 * moved, decode_main.c on_forgotten.) Every test closes its loop with no handle open.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "control.pb-c.h"
#include "td_grpc.h"
#include "td_log.h"
#include "td_node_client.h"
#include "td_util.h"

typedef enum { HB_OK, HB_REREGISTER, HB_FAIL } hb_mode_t;

typedef struct env {
    uv_loop_t loop;
    td_grpc_server_t *srv;
    td_node_client_t *client;
    int refuse_registers;   /* the next this many RegisterNode calls are refused */
    hb_mode_t hb;           /* how the next heartbeat is answered (then HB_OK again) */
    int registers, refused, heartbeats;
    uint64_t epoch;
    int forgotten;          /* the node's callback: how many times */
    int registers_at_forgotten; /* registrations the router had answered when it last ran */
    char why[256];          /* its last reason */
} env_t;

static void on_register(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    (void)msg;
    env_t *e = data;
    if (e->refuse_registers > 0) {
        e->refuse_registers--;
        e->refused++;
        td_grpc_call_finish(call, TD_GRPC_INVALID_ARGUMENT, "register: refused by the test");
        return;
    }
    e->registers++;
    Tandem__Control__V1__RegisterResponse r = TANDEM__CONTROL__V1__REGISTER_RESPONSE__INIT;
    r.epoch = ++e->epoch;
    r.heartbeat_interval_ms = 10;
    r.heartbeat_timeout_ms = 1000;
    td_grpc_call_reply(call, &r.base);
}

static void on_heartbeat(td_grpc_call_t *call, const ProtobufCMessage *msg, void *data)
{
    env_t *e = data;
    const Tandem__Control__V1__HeartbeatRequest *q = (const void *)msg;
    cr_assert_eq(q->epoch, e->epoch, "a heartbeat for epoch %llu, the registration's is %llu",
                 (unsigned long long)q->epoch, (unsigned long long)e->epoch);
    e->heartbeats++;
    hb_mode_t m = e->hb;
    e->hb = HB_OK;
    if (m == HB_FAIL) {
        td_grpc_call_finish(call, TD_GRPC_UNAVAILABLE, "heartbeat: failed by the test");
        return;
    }
    Tandem__Control__V1__HeartbeatResponse r = TANDEM__CONTROL__V1__HEARTBEAT_RESPONSE__INIT;
    r.reregister = m == HB_REREGISTER;
    td_grpc_call_reply(call, &r.base);
}

static void load_cb(void *data, td_node_load_t *l)
{
    (void)data;
    memset(l, 0, sizeof *l);
}

static void forgotten_cb(void *data, const char *why)
{
    env_t *e = data;
    e->forgotten++;
    e->registers_at_forgotten = e->registers;
    snprintf(e->why, sizeof e->why, "%s", why);
}

#define RUN_UNTIL(e, cond)                                                                      \
    do {                                                                                        \
        uint64_t t0_ = td_now_ns();                                                             \
        while (!(cond) && td_now_ns() - t0_ < 10000000000ull)                                   \
            uv_run(&(e)->loop, UV_RUN_ONCE);                                                    \
        cr_assert((cond), "timed out waiting for %s", #cond);                                   \
    } while (0)

static void env_start(env_t *e, int refuse_registers)
{
    memset(e, 0, sizeof *e);
    td_log_set_level(TD_LOG_ERROR);
    cr_assert_eq(uv_loop_init(&e->loop), 0);
    e->refuse_registers = refuse_registers;
    td_grpc_server_config_t gc = td_grpc_server_config_default();
    gc.host = "127.0.0.1";
    gc.port = 0;
    static const td_grpc_method_t methods[] = {
        {"/tandem.control.v1.Registry/RegisterNode", &tandem__control__v1__register_request__descriptor, on_register},
        {"/tandem.control.v1.Registry/Heartbeat", &tandem__control__v1__heartbeat_request__descriptor, on_heartbeat},
    };
    cr_assert_eq(td_grpc_server_create(&e->loop, &gc, &e->srv), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_grpc_server_add_methods(e->srv, methods, TD_ARRAY_LEN(methods), e), TD_OK);
    td_node_client_config_t nc = {.router_host = "127.0.0.1", .router_port = td_grpc_server_port(e->srv),
                                  .rpc_timeout_ms = 2000, .retry_ms = 10, .forgotten = forgotten_cb};
    snprintf(nc.info.id, sizeof nc.info.id, "n0");
    snprintf(nc.info.model, sizeof nc.info.model, "m");
    snprintf(nc.info.address, sizeof nc.info.address, "127.0.0.1:1");
    nc.info.role = TD_NODE_ROLE_DECODE;
    cr_assert_eq(td_node_client_create(&e->loop, &nc, load_cb, e, &e->client), TD_OK, "%s", td_last_error());
}

/* Closing the client says nothing either; every handle closes. */
static void env_end(env_t *e)
{
    int before = e->forgotten;
    td_node_client_close(e->client);
    td_grpc_server_close(e->srv, NULL, NULL);
    uv_run(&e->loop, UV_RUN_DEFAULT);
    cr_assert_eq(e->forgotten, before, "closing the client said the registration was lost");
    cr_assert_eq(uv_loop_close(&e->loop), 0, "a handle was left open");
}

Test(node_client, a_reregister_answer_is_heard_once_before_registering_again, .timeout = 30)
{
    env_t e;
    env_start(&e, 1);
    RUN_UNTIL(&e, e.registers == 1 && e.heartbeats >= 3);
    cr_assert_eq(e.refused, 1);
    cr_assert_eq(e.forgotten, 0, "a refused registration or live heartbeats said the registration was lost");
    cr_assert(td_node_client_registered(e.client));

    e.hb = HB_REREGISTER;
    RUN_UNTIL(&e, e.forgotten == 1);
    cr_assert_eq(e.registers_at_forgotten, 1, "heard only after registering again");
    cr_assert(strstr(e.why, "reregister"), "why: %s", e.why);
    int hb = e.heartbeats;
    RUN_UNTIL(&e, e.registers == 2 && e.heartbeats >= hb + 3);
    cr_assert_eq(e.forgotten, 1, "the new registration or its heartbeats said it was lost again");
    env_end(&e);
}

Test(node_client, a_failed_heartbeat_lets_the_registration_go_and_says_so, .timeout = 30)
{
    env_t e;
    env_start(&e, 0);
    RUN_UNTIL(&e, e.registers == 1 && e.heartbeats >= 2);
    e.hb = HB_FAIL;
    RUN_UNTIL(&e, e.forgotten == 1);
    cr_assert(strstr(e.why, "heartbeat failed"), "why: %s", e.why);
    int hb = e.heartbeats;
    RUN_UNTIL(&e, e.registers == 2 && e.heartbeats >= hb + 3);
    cr_assert_eq(e.forgotten, 1);
    /* and once more: each lost registration is heard */
    e.hb = HB_REREGISTER;
    RUN_UNTIL(&e, e.forgotten == 2);
    RUN_UNTIL(&e, e.registers == 3);
    env_end(&e);
}
