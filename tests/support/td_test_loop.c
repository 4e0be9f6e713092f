/*
 * td_test_loop: a server's loop on a thread of its own, stopped by an async, and an HTTP
 * server on one (td_test_loop.h).
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

static td_status_t http_open(uv_loop_t *loop, void *data)
{
    td_test_http_t *h = data;
    td_status_t st = td_http_server_create(loop, &h->cfg, &h->srv);
    if (st == TD_OK)
        h->port = td_http_server_port(h->srv);
    return st;
}

static void http_close(void *data)
{
    td_test_http_t *h = data;
    td_http_server_close(h->srv, NULL, NULL);
}

void td_test_http_start(td_test_http_t *h, const td_http_config_t *cfg)
{
    *h = (td_test_http_t){.cfg = *cfg};
    td_status_t st = td_test_loop_start(&h->l, http_open, http_close, h);
    cr_assert_eq(st, TD_OK, "the HTTP server did not start: %s", td_strerror(st));
}

int td_test_http_stop(td_test_http_t *h)
{
    return td_test_loop_stop(&h->l);
}
