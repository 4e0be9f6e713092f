/*
 * test_router_worker: the nodes' compute thread and its rings, on a real libuv loop and a
 * real thread: messages reach the compute thread in order and its events reach the loop
 * in order; a full message ring refuses a post (the loop never waits) and keeps what it
 * holds for pop_in; an idle take comes back empty after its bounded wait; a compute thread
 * waiting on a full event ring is released by stop (the event refused, the queued ones
 * kept for pop_out); a post after stop is kept; every test closes its loop with no handle
 * left open.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "td_node_worker.h"
#include "td_status.h"
#include "td_util.h"

typedef struct fixture {
    uv_loop_t loop;
    uv_timer_t guard;          /* ends a test whose events never come */
    td_node_worker_t w;
    int32_t got[64];           /* events the loop received */
    int32_t n_got, want;
    int32_t first_take;        /* the compute thread's first take (idle test) */
    int32_t emitted;           /* emits that succeeded (full-ring test) */
    bool refused;              /* an emit returned false */
    bool timed_out;
} fixture_t;

static void on_guard(uv_timer_t *t)
{
    fixture_t *f = t->data;
    f->timed_out = true;
    td_node_worker_stop(&f->w);
    uv_close((uv_handle_t *)&f->guard, NULL);
}

/* Loop: keeps the events; once `want` came, stops the worker and the guard. */
static void on_events(void *data, void *events, int32_t n)
{
    fixture_t *f = data;
    const int32_t *ev = events;
    for (int32_t i = 0; i < n && f->n_got < (int32_t)TD_ARRAY_LEN(f->got); i++)
        f->got[f->n_got++] = ev[i];
    if (f->n_got >= f->want) {
        td_node_worker_stop(&f->w);
        uv_close((uv_handle_t *)&f->guard, NULL);
    }
}

/* Compute: each message m comes back as event 10 * m. */
static void run_echo(void *data)
{
    fixture_t *f = data;
    for (;;) {
        void *taken;
        int32_t n = td_node_worker_take(&f->w, true, &taken);
        if (n < 0)
            return;
        for (int32_t i = 0; i < n; i++) {
            int32_t ev = 10 * ((int32_t *)taken)[i];
            td_node_worker_emit(&f->w, &ev);
        }
    }
}

/* Compute: records its first (idle) take, then reports it as an event. */
static void run_idle(void *data)
{
    fixture_t *f = data;
    void *taken;
    f->first_take = td_node_worker_take(&f->w, true, &taken);
    int32_t ev = 7;
    td_node_worker_emit(&f->w, &ev);
    while (td_node_worker_take(&f->w, true, &taken) >= 0) {
    }
}

/* Compute: emits 0, 1, 2, ... until an emit is refused (the loop never drains). */
static void run_flood(void *data)
{
    fixture_t *f = data;
    for (int32_t i = 0; i < 1000; i++) {
        if (!td_node_worker_emit(&f->w, &i)) {
            f->refused = true;
            break;
        }
        f->emitted++;
    }
    void *taken;
    while (td_node_worker_take(&f->w, true, &taken) >= 0) {
    }
}

static void setup(fixture_t *f, td_node_worker_run_cb run, int32_t msg_cap, int32_t event_cap, int64_t wait_ms)
{
    memset(f, 0, sizeof *f);
    cr_assert_eq(uv_loop_init(&f->loop), 0);
    uv_timer_init(&f->loop, &f->guard);
    f->guard.data = f;
    uv_timer_start(&f->guard, on_guard, 10000, 0);
    td_node_worker_config_t cfg = {.name = "test", .msg_size = sizeof(int32_t), .msg_cap = msg_cap,
                                  .event_size = sizeof(int32_t), .event_cap = event_cap, .wait_ms = wait_ms,
                                  .run = run, .on_events = on_events, .data = f};
    cr_assert_eq(td_node_worker_init(&f->w, &f->loop, &cfg), TD_OK, "%s", td_last_error());
}

/* Runs the loop until every handle closed, closes it (fails on a handle left open) and
 * frees the worker. */
static void finish(fixture_t *f)
{
    uv_run(&f->loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&f->loop), 0, "a handle was left open");
    td_node_worker_free(&f->w);
}

Test(td_node_worker, messages_and_events_keep_their_order, .timeout = 30)
{
    fixture_t f;
    setup(&f, run_echo, 8, 2, 50); /* an event ring of 2: the compute thread waits for room */
    f.want = 6;
    cr_assert_eq(td_node_worker_start(&f.w), TD_OK);
    for (int32_t m = 1; m <= 6; m++)
        cr_assert(td_node_worker_post(&f.w, &m), "message %d refused by a ring of 8", m);
    finish(&f);
    cr_assert_not(f.timed_out, "only %d of 6 events reached the loop", f.n_got);
    cr_assert_eq(f.n_got, 6);
    for (int32_t i = 0; i < 6; i++)
        cr_assert_eq(f.got[i], 10 * (i + 1), "event %d is %d", i, f.got[i]);
}

Test(td_node_worker, full_message_ring_refuses_and_keeps_what_it_holds, .timeout = 30)
{
    fixture_t f;
    setup(&f, run_echo, 3, 4, 50); /* never started: nothing takes */
    for (int32_t m = 1; m <= 3; m++)
        cr_assert(td_node_worker_post(&f.w, &m));
    int32_t extra = 4;
    cr_assert_not(td_node_worker_post(&f.w, &extra), "a full ring took a fourth message");
    td_node_worker_stop(&f.w);
    td_node_worker_stop(&f.w); /* repeatable */
    uv_timer_stop(&f.guard);
    uv_close((uv_handle_t *)&f.guard, NULL);
    int32_t m;
    for (int32_t want = 1; want <= 3; want++) {
        cr_assert(td_node_worker_pop_in(&f.w, &m));
        cr_assert_eq(m, want);
    }
    cr_assert_not(td_node_worker_pop_in(&f.w, &m), "the refused message was queued");
    finish(&f);
}

Test(td_node_worker, idle_take_returns_empty_after_its_wait, .timeout = 30)
{
    fixture_t f;
    setup(&f, run_idle, 4, 4, 20);
    f.first_take = -2;
    f.want = 1;
    cr_assert_eq(td_node_worker_start(&f.w), TD_OK);
    finish(&f);
    cr_assert_not(f.timed_out, "the idle take never came back");
    cr_assert_eq(f.first_take, 0, "an idle take with nothing posted returned %d", f.first_take);
    cr_assert_eq(f.n_got, 1);
    cr_assert_eq(f.got[0], 7);
}

Test(td_node_worker, stop_releases_an_emit_waiting_on_a_full_ring, .timeout = 30)
{
    fixture_t f;
    setup(&f, run_flood, 4, 2, 20);
    cr_assert_eq(td_node_worker_start(&f.w), TD_OK);
    td_node_worker_stop(&f.w); /* the loop never ran: the ring stays full, the thread waits */
    cr_assert(f.refused, "the waiting emit was not refused at stop");
    cr_assert_eq(f.emitted, 2, "%d events queued in a ring of 2", f.emitted);
    int32_t post_after_stop = 9;
    cr_assert(td_node_worker_post(&f.w, &post_after_stop), "a post after stop was refused");
    uv_timer_stop(&f.guard);
    uv_close((uv_handle_t *)&f.guard, NULL);
    int32_t v;
    for (int32_t want = 0; want < 2; want++) {
        cr_assert(td_node_worker_pop_out(&f.w, &v));
        cr_assert_eq(v, want);
    }
    cr_assert_not(td_node_worker_pop_out(&f.w, &v));
    cr_assert(td_node_worker_pop_in(&f.w, &v));
    cr_assert_eq(v, 9);
    cr_assert_not(td_node_worker_pop_in(&f.w, &v));
    finish(&f);
    cr_assert_eq(f.n_got, 0, "events drained after stop: the async handle was closed");
}

Test(td_node_worker, zeroed_worker_stop_and_free_are_no_ops)
{
    td_node_worker_t w;
    memset(&w, 0, sizeof w);
    int32_t v;
    td_node_worker_stop(&w);
    cr_assert_not(td_node_worker_pop_in(&w, &v));
    cr_assert_not(td_node_worker_pop_out(&w, &v));
    td_node_worker_free(&w);
    td_node_worker_free(&w);
}
