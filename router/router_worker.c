/*
 * router_worker: a node's compute thread and its two bounded rings (see router_worker.h).
 * The timed waits run on CLOCK_MONOTONIC, so a wall-clock step neither stretches nor
 * skips them.
 */
#include "router_worker.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "td_log.h"
#include "td_util.h"

/* One wait on w->cv (mu held), at most cfg.wait_ms. */
static void wait_bounded(router_worker_t *w)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ms = w->cfg.wait_ms;
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&w->cv, &w->mu, &ts);
}

static void on_async(uv_async_t *h)
{
    router_worker_t *w = h->data;
    size_t sz = w->cfg.event_size;
    pthread_mutex_lock(&w->mu);
    int32_t n = w->out_n;
    for (int32_t i = 0; i < n; i++)
        memcpy(w->out_local + (size_t)i * sz, w->out + (size_t)((w->out_head + i) % w->cfg.event_cap) * sz, sz);
    w->out_head = (w->out_head + n) % w->cfg.event_cap;
    w->out_n = 0;
    pthread_cond_broadcast(&w->cv); /* room again */
    pthread_mutex_unlock(&w->mu);
    if (n > 0)
        w->cfg.on_events(w->cfg.data, w->out_local, n);
}

static void *thread_main(void *arg)
{
    router_worker_t *w = arg;
    w->cfg.run(w->cfg.data);
    return NULL;
}

td_status_t router_worker_init(router_worker_t *w, uv_loop_t *loop, const router_worker_config_t *cfg)
{
    TD_ASSERT(cfg->msg_size > 0 && cfg->msg_cap > 0 && cfg->event_size > 0 && cfg->event_cap > 0 &&
              cfg->wait_ms > 0 && cfg->run && cfg->on_events);
    memset(w, 0, sizeof *w);
    w->cfg = *cfg;
    w->in = calloc((size_t)cfg->msg_cap, cfg->msg_size);
    w->in_local = calloc((size_t)cfg->msg_cap, cfg->msg_size);
    w->out = calloc((size_t)cfg->event_cap, cfg->event_size);
    w->out_local = calloc((size_t)cfg->event_cap, cfg->event_size);
    if (!w->in || !w->in_local || !w->out || !w->out_local)
        goto err_rings;
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0)
        goto err_rings;
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (rc != 0)
        goto err_rings;
    if (pthread_mutex_init(&w->mu, NULL) != 0)
        goto err_cond;
    if (uv_async_init(loop, &w->async, on_async) != 0)
        goto err_mutex;
    w->async.data = w;
    w->up = true;
    return TD_OK;

err_mutex:
    pthread_mutex_destroy(&w->mu);
err_cond:
    pthread_cond_destroy(&w->cv);
err_rings:
    free(w->in);
    free(w->in_local);
    free(w->out);
    free(w->out_local);
    memset(w, 0, sizeof *w);
    return td_errorf(TD_ERR_NOMEM, "%s: out of memory for the compute thread's queues of %d and %d",
                     cfg->name, cfg->msg_cap, cfg->event_cap);
}

td_status_t router_worker_start(router_worker_t *w)
{
    TD_ASSERT(w->up && !w->started);
    if (pthread_create(&w->thread, NULL, thread_main, w) != 0)
        return td_errorf(TD_ERR_NOMEM, "%s: cannot start the compute thread", w->cfg.name);
    w->started = true;
    return TD_OK;
}

bool router_worker_post(router_worker_t *w, const void *msg)
{
    size_t sz = w->cfg.msg_size;
    pthread_mutex_lock(&w->mu);
    bool ok = w->in_n < w->cfg.msg_cap;
    if (ok) {
        memcpy(w->in + (size_t)((w->in_head + w->in_n) % w->cfg.msg_cap) * sz, msg, sz);
        w->in_n++;
        pthread_cond_signal(&w->cv);
    }
    pthread_mutex_unlock(&w->mu);
    return ok;
}

int32_t router_worker_take(router_worker_t *w, bool idle, void **msgs_p)
{
    size_t sz = w->cfg.msg_size;
    pthread_mutex_lock(&w->mu);
    if (!w->stop && w->in_n == 0 && idle)
        wait_bounded(w);
    if (w->stop) {
        pthread_mutex_unlock(&w->mu);
        return -1;
    }
    int32_t n = w->in_n;
    for (int32_t i = 0; i < n; i++)
        memcpy(w->in_local + (size_t)i * sz, w->in + (size_t)((w->in_head + i) % w->cfg.msg_cap) * sz, sz);
    w->in_head = (w->in_head + n) % w->cfg.msg_cap;
    w->in_n = 0;
    pthread_mutex_unlock(&w->mu);
    *msgs_p = w->in_local;
    return n;
}

bool router_worker_emit(router_worker_t *w, const void *ev)
{
    size_t sz = w->cfg.event_size;
    pthread_mutex_lock(&w->mu);
    while (w->out_n == w->cfg.event_cap && !w->stop)
        wait_bounded(w);
    bool ok = w->out_n < w->cfg.event_cap;
    if (ok) {
        memcpy(w->out + (size_t)((w->out_head + w->out_n) % w->cfg.event_cap) * sz, ev, sz);
        w->out_n++;
    }
    pthread_mutex_unlock(&w->mu);
    if (ok)
        uv_async_send(&w->async);
    return ok;
}

void router_worker_stop(router_worker_t *w)
{
    if (!w->up || w->closed)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (w->started)
        pthread_join(w->thread, NULL);
    w->started = false;
    uv_close((uv_handle_t *)&w->async, NULL);
    w->closed = true;
}

bool router_worker_pop_in(router_worker_t *w, void *msg_p)
{
    if (!w->up || w->in_n == 0)
        return false;
    TD_ASSERT(!w->started);
    memcpy(msg_p, w->in + (size_t)w->in_head * w->cfg.msg_size, w->cfg.msg_size);
    w->in_head = (w->in_head + 1) % w->cfg.msg_cap;
    w->in_n--;
    return true;
}

bool router_worker_pop_out(router_worker_t *w, void *ev_p)
{
    if (!w->up || w->out_n == 0)
        return false;
    TD_ASSERT(!w->started);
    memcpy(ev_p, w->out + (size_t)w->out_head * w->cfg.event_size, w->cfg.event_size);
    w->out_head = (w->out_head + 1) % w->cfg.event_cap;
    w->out_n--;
    return true;
}

void router_worker_free(router_worker_t *w)
{
    if (!w->up)
        return;
    TD_ASSERT(!w->started);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(w->in);
    free(w->in_local);
    free(w->out);
    free(w->out_local);
    memset(w, 0, sizeof *w);
}
