/*
 * td_xfer loop: progress on the node's libuv loop (drain, called from every handle), the
 * deferred work it runs outside UCX callbacks (run_deferred), the bound on synchronous
 * work per loop iteration (budget_fits), and the deadline tick (on_tick). See td_xfer.c
 * for the whole picture.
 */
#include "td_xfer_int.h"

#include <inttypes.h>
#include <stdlib.h>

#include "td_log.h"
#include "td_util.h"

/* Synchronous work on the loop thread (our shared-memory copies, checksums) is bounded per
 * loop iteration by cfg.loop_budget_bytes; an iteration is counted from one uv_prepare to
 * the next, so it holds one timer phase and one poll phase. Work that does not fit waits for
 * the next iteration, which drain() makes come without sleeping. The first piece of an
 * iteration always fits (one operation, at most max_op_bytes, may exceed the budget alone). */
bool xfer_budget_fits(td_xfer_t *x, size_t bytes)
{
    if (x->budget_turn != x->turn) {
        x->budget_turn = x->turn;
        x->budget_used = 0;
    }
    if (bytes == 0 || x->budget_used == 0 || x->budget_used + bytes <= x->cfg.loop_budget_bytes)
        return true;
    x->budget_hit = true;
    return false;
}

void xfer_budget_charge(td_xfer_t *x, size_t bytes)
{
    x->budget_used += bytes;
}

static void run_deferred(td_xfer_t *x)
{
    xfer_close_pending_eps(x);
    xfer_run_aborts(x);
    /* Requests learn their primitive once their peer answered HELLO; put requests bind. */
    TD_LIST_FOREACH(pn, &x->peers) {
        td_xfer_peer_t *peer = TD_CONTAINER_OF(pn, td_xfer_peer_t, link);
        if (!peer->hello_done || !peer->alive)
            continue;
        TD_LIST_FOREACH(n, &peer->sends) {
            td_xfer_send_t *s = TD_CONTAINER_OF(n, td_xfer_send_t, peer_link);
            if (s->mode != MODE_UNDECIDED || s->status != TD_OK)
                continue;
            s->mode = peer->use_put ? MODE_PUT : MODE_AM;
            x->acts++;
            if (s->mode == MODE_PUT)
                xfer_send_bind(x, peer->ep, s->p.request_id, s->p.lease_id, &s->p.token);
        }
    }
    /* Post queued DATA under the in-flight bound (in order, skipping requests still
     * waiting for their peer or bind), and READY for requests whose data is in. A
     * device-source op first copies into the staging ring and goes when that is done. */
    xfer_poll_copies(x);
    td_list_t *qn = x->queue.next;
    bool stage_full = false; /* device-source ops keep their order behind one that waits */
    while (qn != &x->queue && x->ops_posted < x->cfg.max_inflight_ops) {
        send_op_t *op = TD_CONTAINER_OF(qn, send_op_t, link);
        qn = qn->next;
        if (!xfer_op_ready(op))
            continue;
        if (op->s->p.mem == TD_XFER_MEM_CUDA && op->s->status == TD_OK && op->s->peer->alive) {
            if (!stage_full && !xfer_copy_begin(x, op))
                stage_full = true; /* its piece frees up as posted ops complete */
            continue;
        }
        size_t cost = xfer_op_sync_bytes(op);
        if (!xfer_budget_fits(x, cost))
            break; /* the rest goes next loop iteration */
        xfer_budget_charge(x, cost);
        td_list_remove(&op->link);
        xfer_post_op(x, op);
    }
    xfer_poll_copies(x); /* a copier that finished inside start: those ops go now */
    xfer_adopt_run(x);
    TD_LIST_FOREACH(pn, &x->peers) {
        td_xfer_peer_t *peer = TD_CONTAINER_OF(pn, td_xfer_peer_t, link);
        TD_LIST_FOREACH(n, &peer->sends) {
            td_xfer_send_t *s = TD_CONTAINER_OF(n, td_xfer_send_t, peer_link);
            if (!s->finished || s->ready_posted || s->status != TD_OK || s->ops_out != 0)
                continue;
            if (s->mode == MODE_PUT && !s->flushed) {
                if (!s->flush_inflight)
                    xfer_post_flush(s); /* on shared memory it is often complete at once */
                if (!s->flushed || s->status != TD_OK)
                    continue;
            }
            xfer_post_ready(x, s);
        }
    }
    while (!td_list_empty(&x->done_list)) {
        td_xfer_send_t *s = TD_CONTAINER_OF(x->done_list.next, td_xfer_send_t, done_link);
        td_list_remove(&s->done_link);
        td_status_t st = s->status;
        td_xfer_done_cb cb = s->p.done; /* NULL: td_xfer_destroy made the callback or owed none */
        void *arg = s->p.arg;
        uint64_t rid = s->p.request_id;
        if (cb)
            xfer_send_count(x, s);
        xfer_send_free(s);
        if (cb) {
            x->delivered++;
            cb(arg, rid, st);
        }
    }
    while (!td_list_empty(&x->ready_list)) {
        ready_event_t *ev = TD_CONTAINER_OF(x->ready_list.next, ready_event_t, link);
        td_list_remove(&ev->link);
        x->delivered++;
        if (x->on_ready) {
            x->on_ready(x->ready_arg, &ev->r);
        } else {
            td_kv_unref_blocks_for(x->pool.kv, TD_KV_HOLDER_LANDED, ev->r.blocks, ev->r.n_blocks);
        }
        free(ev);
    }
}

/* ucp_worker_progress calls per drain at most. Each call handles a bounded number of
 * transport events (UCX_TCP_MAX_POLL, 16 by default; a shared-memory FIFO's few elements),
 * so a peer streaming a long transfer in cannot keep one drain going for the whole of it:
 * the loop serves its other handles and comes round again without sleeping. */
#define PROGRESS_MAX 16

static void drain(td_xfer_t *x)
{
    unsigned calls = 0;
    x->budget_hit = false;
    for (;;) {
        while (calls < PROGRESS_MAX && ucp_worker_progress(x->worker))
            calls++;
        /* Deferred work can make more deferred work without any UCX event (a put and a
         * flush complete in place on shared memory): go round until it is quiet, or the
         * loop would sleep until the next tick. */
        uint64_t acts = x->acts;
        run_deferred(x);
        if (calls >= PROGRESS_MAX || x->budget_hit) {
            /* Bounded: the rest is the next iteration's; an active idle handle keeps this
             * iteration's poll from sleeping, and xfer_on_prepare drains again then. */
            uv_idle_start(&x->idle, xfer_on_idle);
            return;
        }
        calls++;
        if (ucp_worker_progress(x->worker) || x->acts != acts)
            continue;
        if (!td_list_empty(&x->done_list) || !td_list_empty(&x->ready_list))
            continue;
        ucs_status_t st = ucp_worker_arm(x->worker);
        if (st == UCS_OK)
            return;
        if (st != UCS_ERR_BUSY) {
            xfer_ucx_err(st, "worker arm");
            return;
        }
    }
}

/* Every handle callback: drain, then, during shutdown, the next step of it (which may close
 * the handles: nothing of x is touched after it). */
void xfer_on_poll(uv_poll_t *h, int status, int events)
{
    td_xfer_t *x = h->data;
    drain(x);
    if (x->destroying)
        xfer_close_step(x);
}

void xfer_on_copy_wake(uv_async_t *h)
{
    td_xfer_t *x = h->data;
    if (x->destroying && x->close_phase == CLOSE_DONE)
        return; /* a copy that outlived shutdown's bound: UCX is gone, the ring leaked */
    drain(x);
    if (x->destroying)
        xfer_close_step(x);
}

void xfer_on_idle(uv_idle_t *h)
{
    uv_idle_stop(h);
}

/* A callback made here, just before the loop blocks, may have changed what its owner
 * waits for (uv_run(UV_RUN_ONCE) loops checking a flag): an active idle handle makes this
 * turn's poll non-blocking, so the loop comes round at once instead of at the next tick. */
void xfer_on_prepare(uv_prepare_t *h)
{
    td_xfer_t *x = h->data;
    x->turn++; /* a new loop iteration: a new budget (xfer_budget_fits) */
    uint64_t before = x->delivered;
    drain(x);
    if (x->destroying) {
        xfer_close_step(x);
        return;
    }
    if (x->delivered != before)
        uv_idle_start(&x->idle, xfer_on_idle);
}

/* The deadline scan: every live lease and send, each tick. Its cost is bounded by the
 * requests a node holds at once (leases and sends, a few hundred), not by their bytes. */
void xfer_on_tick(uv_timer_t *h)
{
    td_xfer_t *x = h->data;
    if (x->destroying) { /* during shutdown the tick watches its phase's deadline */
        drain(x);
        xfer_close_step(x);
        return;
    }
    uint64_t now = td_now_ns();
    TD_LIST_FOREACH_SAFE(n, &x->leases) {
        xfer_lease_t *l = TD_CONTAINER_OF(n, xfer_lease_t, link);
        /* An adopting lease too: adopted before its deadline or not at all (the decode node
         * forgets an admission soon after it). */
        if (l->state != LEASE_DEAD && now >= l->deadline_ns) {
            td_info("xfer lease %" PRIu64 " request %" PRIu64 " expired, %d blocks return", l->id, l->request_id,
                    l->n_blocks);
            x->stats.leases_expired++;
            xfer_lease_kill(x, l);
        } else if (l->state == LEASE_DEAD && l->put_writer && now >= l->quarantine_ns) {
            /* A frozen sender never confirms: the remaining risk (docs/xfer.md). */
            td_warn("xfer lease %" PRIu64 ": its put writer did not confirm the abort in %u ms; %d blocks return "
                    "anyway", l->id, x->cfg.quarantine_ms, l->n_blocks);
            x->stats.quarantine_timeouts++;
            l->put_writer = NULL;
            xfer_lease_try_release(x, l);
        }
    }
    TD_LIST_FOREACH(pn, &x->peers) {
        td_xfer_peer_t *peer = TD_CONTAINER_OF(pn, td_xfer_peer_t, link);
        bool stuck = false;
        TD_LIST_FOREACH(m, &peer->sends) {
            td_xfer_send_t *s = TD_CONTAINER_OF(m, td_xfer_send_t, peer_link);
            if (!s->done_queued && !s->verdict && now >= s->deadline_ns) {
                td_errorf(TD_ERR_TIMEOUT, "xfer request %" PRIu64 ": no verdict after %u ms", s->p.request_id,
                          x->cfg.send_timeout_ms);
                xfer_send_set_status(s, TD_ERR_TIMEOUT);
                s->verdict = true;
                stuck = true;
            }
        }
        /* A frozen receiver is invisible to UCX: the only way to get the operations
         * back is to close the endpoint; its other requests fail as unavailable. */
        if (stuck && peer->alive)
            xfer_peer_fail(peer, TD_ERR_UNAVAILABLE);
        else if (stuck)
            TD_LIST_FOREACH(m, &peer->sends)
                xfer_send_maybe_done(TD_CONTAINER_OF(m, td_xfer_send_t, peer_link));
    }
    drain(x);
}
