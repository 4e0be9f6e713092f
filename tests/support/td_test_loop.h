/*
 * td_test_loop: a server on a libuv loop of its own thread, stopped from the test's thread
 * by an async, the way the tests of our servers run them (test_http, test_metrics and
 * grpc_test_service for the gRPC tests): the test talks to the server over 127.0.0.1 while
 * the loop serves, then stops it and checks that every handle closed.
 *
 * The start callback creates the server on the loop's thread before the loop runs; the stop
 * callback closes it on the loop's thread when the test asks. libuv's rule holds: the loop
 * is only touched on its own thread, and the only call from the test's thread is
 * uv_async_send.
 *
 * td_test_http is the common case, an HTTP server (td_http.h) on such a loop.
 *
 * Part of the td_test_support library every tests/unit/test_*.c links; tested by
 * test_test_loop.
 */
#ifndef TD_TEST_LOOP_H
#define TD_TEST_LOOP_H

#include <stdint.h>
#include <uv.h>

#include "td_http.h"
#include "td_status.h"

/* On the loop's thread, before the loop runs: create the server on `loop`. Anything but
 * TD_OK ends the loop at once (the callback closes what it opened). */
typedef td_status_t (*td_test_loop_start_cb)(uv_loop_t *loop, void *data);

/* On the loop's thread, when the test stops it: close the server; the loop ends when its
 * handles have closed. */
typedef void (*td_test_loop_stop_cb)(void *data);

typedef struct td_test_loop {
    uv_loop_t loop;           /* the server's loop: touch it only from its callbacks */
    td_status_t start_status; /* what the start callback returned */
    uv_thread_t thread;
    uv_async_t stop;
    uv_sem_t ready;
    td_test_loop_start_cb start_cb;
    td_test_loop_stop_cb stop_cb;
    void *data;
    int loop_close_rc;
} td_test_loop_t;

/* Starts the thread and its loop, runs start_cb(loop, data) there and returns its status
 * once it has returned (so what it wrote, a port, can be read). Call td_test_loop_stop
 * after it whatever it returned. */
td_status_t td_test_loop_start(td_test_loop_t *l, td_test_loop_start_cb start_cb, td_test_loop_stop_cb stop_cb,
                               void *data);

/* Runs stop_cb(data) on the loop's thread (unless the start failed), waits for the loop to
 * end and the thread to exit, and returns uv_loop_close's result: 0 when every handle was
 * closed, so a test asserts it. */
int td_test_loop_stop(td_test_loop_t *l);

/* An HTTP server on a td_test_loop. */
typedef struct td_test_http {
    td_test_loop_t l;
    td_http_config_t cfg;
    td_http_server_t *srv;
    uint16_t port;
} td_test_http_t;

/* Starts an HTTP server with *cfg (its handler and registry included) on its own loop
 * thread; asserts that it listens, then h->port is its port. */
void td_test_http_start(td_test_http_t *h, const td_http_config_t *cfg);

/* Closes the server, ends its loop and thread; returns uv_loop_close's result (0: every
 * handle closed). */
int td_test_http_stop(td_test_http_t *h);

#endif /* TD_TEST_LOOP_H */
