/*
 * td_node_worker: a node's compute thread and its two bounded rings (see td_node_worker.h).
 * The timed waits run on CLOCK_MONOTONIC, so a wall-clock step neither stretches nor
 * skips them.
 */
#include "td_node_worker.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "td_log.h"
#include "td_util.h"

/* One wait on w->cv (mu held), at most cfg.wait_ms. */
static void wait_bounded(td_node_worker_t *w)
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

/* ---- rings (the caller holds mu, or the compute thread is joined) ---------------------- */

static bool ring_alloc(td_node_worker_ring_t *r, size_t size, int32_t cap)
{
    r->size = size;
    r->cap = cap;
    r->items = calloc((size_t)cap, size);
    r->local = calloc((size_t)cap, size);
    return r->items && r->local;
}

static void ring_free(td_node_worker_ring_t *r)
{
    free(r->items);
    free(r->local);
    memset(r, 0, sizeof *r);
}

static uint8_t *ring_at(const td_node_worker_ring_t *r, int32_t i)
{
    return r->items + (size_t)((r->head + i) % r->cap) * r->size;
}

/* Appends a copy of item; false when the ring is full. */
static bool ring_push(td_node_worker_ring_t *r, const void *item)
{
    if (r->n == r->cap)
        return false;
    memcpy(ring_at(r, r->n), item, r->size);
    r->n++;
    return true;
}

/* Moves every item, oldest first, into r->local; returns how many. */
static int32_t ring_drain(td_node_worker_ring_t *r)
{
    int32_t n = r->n;
    for (int32_t i = 0; i < n; i++)
        memcpy(r->local + (size_t)i * r->size, ring_at(r, i), r->size);
    r->head = (r->head + n) % r->cap;
    r->n = 0;
    return n;
}

/* Moves the oldest item into *out; false when the ring is empty. */
static bool ring_pop(td_node_worker_ring_t *r, void *out)
{
    if (r->n == 0)
        return false;
    memcpy(out, ring_at(r, 0), r->size);
    r->head = (r->head + 1) % r->cap;
    r->n--;
    return true;
}

/* ---- the worker ----------------------------------------------------------------------- */

static void on_async(uv_async_t *h)
{
    td_node_worker_t *w = h->data;
    pthread_mutex_lock(&w->mu);
    int32_t n = ring_drain(&w->out);
    pthread_cond_broadcast(&w->cv); /* room again */
    pthread_mutex_unlock(&w->mu);
    if (n > 0)
        w->cfg.on_events(w->cfg.data, w->out.local, n);
}

static void *thread_main(void *arg)
{
    td_node_worker_t *w = arg;
    w->cfg.run(w->cfg.data);
    return NULL;
}

td_status_t td_node_worker_init(td_node_worker_t *w, uv_loop_t *loop, const td_node_worker_config_t *cfg)
{
    TD_ASSERT(cfg->msg_size > 0 && cfg->msg_cap > 0 && cfg->event_size > 0 && cfg->event_cap > 0 &&
              cfg->wait_ms > 0 && cfg->run && cfg->on_events);
    memset(w, 0, sizeof *w);
    w->cfg = *cfg;
    if (!ring_alloc(&w->in, cfg->msg_size, cfg->msg_cap) || !ring_alloc(&w->out, cfg->event_size, cfg->event_cap))
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
    ring_free(&w->in);
    ring_free(&w->out);
    memset(w, 0, sizeof *w);
    return td_errorf(TD_ERR_NOMEM, "%s: out of memory for the compute thread's queues of %d and %d",
                     cfg->name, cfg->msg_cap, cfg->event_cap);
}

td_status_t td_node_worker_start(td_node_worker_t *w)
{
    TD_ASSERT(w->up && !w->started);
    if (pthread_create(&w->thread, NULL, thread_main, w) != 0)
        return td_errorf(TD_ERR_NOMEM, "%s: cannot start the compute thread", w->cfg.name);
    w->started = true;
    return TD_OK;
}

bool td_node_worker_post(td_node_worker_t *w, const void *msg)
{
    pthread_mutex_lock(&w->mu);
    bool ok = ring_push(&w->in, msg);
    if (ok)
        pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return ok;
}

int32_t td_node_worker_take(td_node_worker_t *w, bool idle, void **msgs_p)
{
    pthread_mutex_lock(&w->mu);
    if (!w->stop && w->in.n == 0 && idle)
        wait_bounded(w);
    int32_t n = w->stop ? -1 : ring_drain(&w->in);
    pthread_mutex_unlock(&w->mu);
    *msgs_p = w->in.local;
    return n;
}

bool td_node_worker_emit(td_node_worker_t *w, const void *ev)
{
    pthread_mutex_lock(&w->mu);
    while (w->out.n == w->out.cap && !w->stop)
        wait_bounded(w);
    bool ok = ring_push(&w->out, ev);
    pthread_mutex_unlock(&w->mu);
    if (ok) {
        uv_async_send(&w->async);
        /* A node on one core (taskset, a cgroup of one CPU): the loop thread just woken
           shares it with this thread, and the scheduler would let it run only at its next
           tick (4 ms at HZ=250), so a step's tokens and a layer's KV would leave up to a tick
           late (decode ITLs came in multiples of 4 ms). Yielding hands it the core now; with
           a core to spare it is a no-op. */
        sched_yield();
    }
    return ok;
}

void td_node_worker_stop(td_node_worker_t *w)
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

bool td_node_worker_pop_in(td_node_worker_t *w, void *msg_p)
{
    TD_ASSERT(!w->started);
    return w->up && ring_pop(&w->in, msg_p);
}

bool td_node_worker_pop_out(td_node_worker_t *w, void *ev_p)
{
    TD_ASSERT(!w->started);
    return w->up && ring_pop(&w->out, ev_p);
}

void td_node_worker_free(td_node_worker_t *w)
{
    if (!w->up)
        return;
    TD_ASSERT(!w->started);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    ring_free(&w->in);
    ring_free(&w->out);
    memset(w, 0, sizeof *w);
}
