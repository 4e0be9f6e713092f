/*
 * test_test_loop: td_test_loop, the server-on-a-loop-thread helper of tests/support. The
 * start callback runs on the loop's own thread before td_test_loop_start returns, the stop
 * callback there too when the test stops it, and a loop whose handles all closed reports 0;
 * a failed start is returned and its stop only joins the thread (the stop callback never
 * runs); a handle left open is reported, so a test that asserts 0 catches it.
 */
#include <criterion/criterion.h>
#include <stdatomic.h>

#include "td_test_loop.h"

typedef struct fake_server {
    uv_timer_t timer;  /* the server's one handle */
    uv_thread_t opened_on, closed_on;
    bool fail_start;   /* the start refuses, as a server that cannot bind does */
    bool leave_open;   /* the stop forgets to close the handle */
    _Atomic int ticks; /* timer callbacks: the loop runs */
    int stops;
} fake_server_t;

static void on_tick(uv_timer_t *t)
{
    fake_server_t *f = t->data;
    atomic_fetch_add(&f->ticks, 1);
}

static td_status_t fake_open(uv_loop_t *loop, void *data)
{
    fake_server_t *f = data;
    f->opened_on = uv_thread_self();
    if (f->fail_start)
        return TD_ERR_IO;
    uv_timer_init(loop, &f->timer);
    f->timer.data = f;
    uv_timer_start(&f->timer, on_tick, 1, 1);
    return TD_OK;
}

static void fake_close(void *data)
{
    fake_server_t *f = data;
    f->closed_on = uv_thread_self();
    f->stops++;
    uv_timer_stop(&f->timer);
    if (!f->leave_open)
        uv_close((uv_handle_t *)&f->timer, NULL);
}

Test(test_loop, callbacks_run_on_the_loop_thread_and_every_handle_closes)
{
    fake_server_t f = {0};
    td_test_loop_t l;
    cr_assert_eq(td_test_loop_start(&l, fake_open, fake_close, &f), TD_OK);
    uv_thread_t self = uv_thread_self();
    cr_assert_not(uv_thread_equal(&f.opened_on, &self), "the start ran on the test's thread");
    for (int i = 0; i < 1000 && atomic_load(&f.ticks) < 3; i++)
        uv_sleep(1);
    cr_assert_geq(atomic_load(&f.ticks), 3, "the loop does not run");
    cr_assert_eq(td_test_loop_stop(&l), 0);
    cr_assert_eq(f.stops, 1);
    cr_assert(uv_thread_equal(&f.opened_on, &f.closed_on), "start and stop ran on different threads");
}

Test(test_loop, a_failed_start_is_returned_and_never_stopped)
{
    fake_server_t f = {.fail_start = true};
    td_test_loop_t l;
    cr_assert_eq(td_test_loop_start(&l, fake_open, fake_close, &f), TD_ERR_IO);
    cr_assert_eq(td_test_loop_stop(&l), 0);
    cr_assert_eq(f.stops, 0);
}

Test(test_loop, a_handle_left_open_is_reported)
{
    fake_server_t f = {.leave_open = true};
    td_test_loop_t l;
    cr_assert_eq(td_test_loop_start(&l, fake_open, fake_close, &f), TD_OK);
    cr_assert_eq(td_test_loop_stop(&l), UV_EBUSY);
    /* the loop's thread has ended: close what it left here */
    uv_close((uv_handle_t *)&f.timer, NULL);
    uv_run(&l.loop, UV_RUN_DEFAULT);
    cr_assert_eq(uv_loop_close(&l.loop), 0);
}
