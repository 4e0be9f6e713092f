/*
 * td_node_worker: the compute thread of a cluster node and the two bounded rings that
 * connect it to the node's libuv loop, so that the prefill and decode nodes hand work
 * over one way (docs/cluster.md "Process skeleton"). td_node is the process; this is
 * the thread inside it that owns the engine.
 *
 *     loop thread                                  compute thread (cfg.run)
 *     td_node_worker_post(msg)  ── in ring ──▶      td_node_worker_take(idle) → msgs[n]
 *     cfg.on_events(events[n]) ◀── out ring ──     td_node_worker_emit(ev)
 *                              uv_async_send
 *
 * Both rings hold fixed-size items (copied in and out), are sized once at init and live
 * under one mutex; a condition variable wakes the compute thread, uv_async_send the loop.
 * The loop never blocks: a post into a full ring fails and the caller decides. The
 * compute thread waits at most cfg.wait_ms at a time, re-checking the stop flag: when it
 * is idle and nothing was posted, and while the out ring is full.
 *
 *     td_node_worker_init(&s->worker, &s->proc.loop, &cfg);   // rings, async handle
 *     td_node_worker_start(&s->worker);                       // the thread runs cfg.run
 *   on_shutdown:
 *     td_node_worker_stop(&s->worker);   // stop flag, join, close the async handle
 *   teardown, after td_node_stop closed the loop:
 *     while (td_node_worker_pop_in(&s->worker, &msg)) ...     // what nobody took
 *     while (td_node_worker_pop_out(&s->worker, &ev)) ...
 *     td_node_worker_free(&s->worker);
 *
 * Caller-allocated (zeroed), embedded in the node's state struct. No global state.
 */
#ifndef TD_NODE_WORKER_H
#define TD_NODE_WORKER_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_status.h"

/* Loop thread: the events drained from the out ring, oldest first ([n] items of
 * cfg.event_size bytes, valid until the callback returns; the callback may post). */
typedef void (*td_node_worker_events_cb)(void *data, void *events, int32_t n);

/* The compute thread's body: runs until td_node_worker_take returns -1. */
typedef void (*td_node_worker_run_cb)(void *data);

typedef struct td_node_worker_config {
    const char *name;          /* "prefill", "decode": logs */
    size_t msg_size;           /* bytes of one loop → compute message */
    int32_t msg_cap;           /* messages waiting at most (>= 1) */
    size_t event_size;         /* bytes of one compute → loop event */
    int32_t event_cap;         /* events waiting at most (>= 1) */
    int64_t wait_ms;           /* the longest single wait of the compute thread (>= 1) */
    td_node_worker_run_cb run;
    td_node_worker_events_cb on_events;
    void *data;                /* passed to run and on_events */
} td_node_worker_config_t;

/* One direction: a ring of fixed-size items and the reader's copy of its last drain. */
typedef struct td_node_worker_ring {
    uint8_t *items;            /* [cap][size], under the worker's mu */
    uint8_t *local;            /* [cap][size] the reader's last drain */
    size_t size;
    int32_t cap, head, n;
} td_node_worker_ring_t;

typedef struct td_node_worker {
    td_node_worker_config_t cfg;
    uv_async_t async;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;         /* wakes the compute thread: a message, room, or stop */
    td_node_worker_ring_t in;   /* loop → compute messages */
    td_node_worker_ring_t out;  /* compute → loop events */
    bool stop;                 /* under mu */
    bool up;                   /* initialised: mutex, cond, rings, async handle */
    bool started, closed;
} td_node_worker_t;

/*
 * Allocates the rings and puts the async handle on `loop`. Loop thread. Errors:
 * TD_ERR_NOMEM (logged here), and then w is as it was (zeroed): stop and free are no-ops.
 * On success the handle is open until td_node_worker_stop, which the node's on_shutdown
 * must call (also when a later init step failed).
 */
td_status_t td_node_worker_init(td_node_worker_t *w, uv_loop_t *loop, const td_node_worker_config_t *cfg);

/* Starts the compute thread (cfg.run). Loop thread, once. Errors: TD_ERR_NOMEM when the
 * thread cannot be created (logged here). */
td_status_t td_node_worker_start(td_node_worker_t *w);

/*
 * Loop thread: queues a copy of msg (cfg.msg_size bytes) for the compute thread and wakes
 * it. False when the ring is full (nothing queued; the caller decides). Never blocks; also
 * after td_node_worker_stop (the message then stays for td_node_worker_pop_in).
 */
bool td_node_worker_post(td_node_worker_t *w, const void *msg);

/*
 * Compute thread: takes every message posted since the last take, oldest first, into
 * *msgs_p ([n] items, the thread's own copy, valid until the next take) and returns n.
 * When `idle` (the caller has nothing else to do) and nothing is there, first waits for a
 * message, at most cfg.wait_ms (then 0). Returns -1 once the worker is stopping: the
 * thread's body must return.
 */
int32_t td_node_worker_take(td_node_worker_t *w, bool idle, void **msgs_p);

/*
 * Compute thread: queues a copy of ev (cfg.event_size bytes) for the loop and wakes it,
 * waiting while the ring is full (cfg.wait_ms at a time, re-checking the stop flag).
 * False when the worker is stopping and the ring stayed full: ev was not queued and
 * what it refers to is still the caller's.
 */
bool td_node_worker_emit(td_node_worker_t *w, const void *ev);

/* Loop thread: sets the stop flag, joins the compute thread and closes the async handle.
 * Repeatable; a no-op on a worker init did not set up. */
void td_node_worker_stop(td_node_worker_t *w);

/* After td_node_worker_stop: the oldest message the compute thread did not take (copied
 * to *msg_p) / the oldest event the loop did not drain (to *ev_p). False when none is left. */
bool td_node_worker_pop_in(td_node_worker_t *w, void *msg_p);
bool td_node_worker_pop_out(td_node_worker_t *w, void *ev_p);

/* Frees the rings and the lock, once the loop closed the async handle (after
 * td_node_stop). Call pop_in/pop_out first for items that own memory. Zeroed-safe,
 * repeatable. */
void td_node_worker_free(td_node_worker_t *w);

#endif /* TD_NODE_WORKER_H */
