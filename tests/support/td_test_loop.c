/*
 * td_test_loop: a server's loop on a thread of its own, stopped by an async (td_test_loop.h).
 */
#include "td_test_loop.h"

#include <criterion/criterion.h>

static void on_stop(uv_async_t *a)
{
    td_test_loop_t *l = a->data;
    l->stop_cb(l->data);
    uv_close((uv_handle_t *)&l->stop, NULL);
}

static void loop_thread(void *arg)
{
    td_test_loop_t *l = arg;
    uv_loop_init(&l->loop);
    uv_async_init(&l->loop, &l->stop, on_stop);
    l->stop.data = l;
    l->start_status = l->start_cb(&l->loop, l->data);
    if (l->start_status != TD_OK)
        uv_close((uv_handle_t *)&l->stop, NULL);
    uv_sem_post(&l->ready);
    uv_run(&l->loop, UV_RUN_DEFAULT);
    l->loop_close_rc = uv_loop_close(&l->loop);
}

td_status_t td_test_loop_start(td_test_loop_t *l, td_test_loop_start_cb start_cb, td_test_loop_stop_cb stop_cb,
                               void *data)
{
    *l = (td_test_loop_t){.start_cb = start_cb, .stop_cb = stop_cb, .data = data};
    cr_assert_eq(uv_sem_init(&l->ready, 0), 0);
    cr_assert_eq(uv_thread_create(&l->thread, loop_thread, l), 0);
    uv_sem_wait(&l->ready);
    uv_sem_destroy(&l->ready);
    return l->start_status;
}

int td_test_loop_stop(td_test_loop_t *l)
{
    if (l->start_status == TD_OK)
        uv_async_send(&l->stop);
    uv_thread_join(&l->thread);
    return l->loop_close_rc;
}
