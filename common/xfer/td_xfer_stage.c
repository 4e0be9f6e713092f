/*
 * td_xfer staging (sender, device-memory sources): the pinned host ring that a device
 * source's operations are copied into through the node's copier (td_xfer_config_t.d2h)
 * before UCX sends them, handed out in pieces that return in order.
 */
#include "td_xfer_int.h"

#include <inttypes.h>
#include <stdlib.h>

#include "td_util.h"

/* Takes `len` contiguous bytes of the ring for op (its piece), or returns false when they
 * are not free yet (the op waits in the queue). A piece never wraps: the end of the ring
 * is skipped (and counted in the piece) when it is too short. */
static bool stage_take(td_xfer_t *x, send_op_t *op)
{
    size_t cap = x->cfg.staging_bytes, len = op->len, off, span;
    if (x->stage_used == 0)
        x->stage_head = x->stage_tail = 0;
    size_t h = x->stage_head, t = x->stage_tail;
    if (x->stage_used > 0 && h <= t) { /* free space is [h, t) */
        if (t - h < len)
            return false;
        off = h, span = len;
    } else if (cap - h >= len) {       /* free space is [h, cap) and [0, t) */
        off = h, span = len;
    } else if (t >= len) {
        off = 0, span = cap - h + len;
    } else {
        return false;
    }
    stage_piece_t *pc = malloc(sizeof *pc);
    if (!pc)
        return false; /* tried again on the next drain */
    *pc = (stage_piece_t){.span = span};
    td_list_push_back(&x->stage_pieces, &pc->link);
    x->stage_head = (off + len) % cap;
    x->stage_used += span;
    op->piece = pc;
    op->staged = x->stage + off;
    return true;
}

/* op's piece is no longer read by UCX: the ring's tail moves past every done piece. */
void xfer_stage_give(td_xfer_t *x, send_op_t *op)
{
    if (!op->piece)
        return;
    op->piece->done = true;
    op->piece = NULL;
    while (!td_list_empty(&x->stage_pieces)) {
        stage_piece_t *pc = TD_CONTAINER_OF(x->stage_pieces.next, stage_piece_t, link);
        if (!pc->done)
            break;
        td_list_remove(&pc->link);
        x->stage_tail = (x->stage_tail + pc->span) % x->cfg.staging_bytes;
        x->stage_used -= pc->span;
        free(pc);
    }
}

static void copy_wake_cb(void *arg)
{
    uv_async_send(&((td_xfer_t *)arg)->copy_wake);
}

/* Starts copying a device-source op into its piece of the ring. */
static td_status_t stage_start(td_xfer_t *x, send_op_t *op)
{
    const td_xfer_copier_t *c = x->cfg.d2h;
    td_status_t st = c->start(c->arg, op->staged, op->src, op->len, copy_wake_cb, x, &op->ticket);
    if (st != TD_OK)
        return td_errorf(st, "xfer request %" PRIu64 ": copying layer %u from device memory failed: %s",
                         op->s->p.request_id, op->hdr.layer, td_last_error());
    return TD_OK;
}

/* A device-source op's copy is done: its bytes are the ring's (and its blocks go into the
 * request's checksum, which could not read device memory at send_layer). */
static void stage_landed(send_op_t *op)
{
    if (op->s->p.checksum)
        xfer_op_checksum(op, op->staged);
    op->src = op->staged;
}

/* Takes a device-source op from the queue into the copying list: a piece of the ring and
 * a started copy (it counts against max_inflight_ops from now on). False when the ring has
 * no room for it yet (the op stays queued). */
bool xfer_copy_begin(td_xfer_t *x, send_op_t *op)
{
    if (!stage_take(x, op))
        return false;
    td_list_remove(&op->link);
    x->acts++;
    td_status_t st = stage_start(x, op);
    if (st != TD_OK) {
        xfer_send_set_status(op->s, st);
        xfer_post_op(x, op); /* drops it: the request failed */
        return true;
    }
    x->ops_posted++;
    td_list_push_back(&x->copying, &op->link);
    return true;
}

/* Copies finish in the order they started: the ops at the front whose copy is done go to
 * UCX (or are dropped when their request failed meanwhile). An op whose copy runs keeps
 * its piece of the ring whatever happens to its request: the device still writes there. */
void xfer_poll_copies(td_xfer_t *x)
{
    while (!td_list_empty(&x->copying)) {
        send_op_t *op = TD_CONTAINER_OF(x->copying.next, send_op_t, link);
        size_t cost = xfer_op_sync_bytes(op); /* its checksum, then posting it */
        if (!xfer_budget_fits(x, cost))
            return; /* next iteration (a copy that is done stays done) */
        td_status_t st = x->cfg.d2h->poll(x->cfg.d2h->arg, op->ticket);
        if (st == TD_ERR_BUSY)
            return;
        xfer_budget_charge(x, cost);
        td_list_remove(&op->link);
        x->ops_posted--;
        if (st != TD_OK)
            xfer_send_set_status(op->s, td_errorf(st, "xfer request %" PRIu64 ": copying layer %u from device memory "
                                                  "failed: %s", op->s->p.request_id, op->hdr.layer, td_last_error()));
        else if (op->s->status == TD_OK)
            stage_landed(op);
        xfer_post_op(x, op);
    }
}

/* The staging ring, at the first device-memory send: allocated, then page-locked by the
 * copier so that its copies land there directly. */
td_status_t xfer_stage_alloc(td_xfer_t *x)
{
    if (x->stage)
        return TD_OK;
    size_t bytes = TD_DIV_CEIL(x->cfg.staging_bytes, 4096) * 4096;
    uint8_t *ring = aligned_alloc(4096, bytes);
    if (!ring)
        return td_errorf(TD_ERR_NOMEM, "xfer: no memory for a staging ring of %zu bytes", x->cfg.staging_bytes);
    const td_xfer_copier_t *c = x->cfg.d2h;
    if (c->pin) {
        td_status_t st = c->pin(c->arg, ring, bytes);
        if (st != TD_OK) {
            free(ring);
            return td_errorf(st, "xfer: cannot pin a staging ring of %zu bytes: %s (lower staging_bytes)", bytes,
                             td_last_error());
        }
        x->stage_pinned = true;
    }
    x->stage = ring;
    return TD_OK;
}
