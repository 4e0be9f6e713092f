/*
 * td_xfer adoption (receiver): the job that takes a lease whose bytes are all in to a
 * ready event, a budgeted piece per loop iteration (checksum, device-pool copy).
 */
#include "td_xfer_int.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "td_util.h"

/* ---- adoption (receiver) ------------------------------------------------------------------
 * Once kv-ready is checked and every byte is in, adoption is a job over (layer, block),
 * advanced by xfer_adopt_run from drain under the loop iteration's budget (xfer_budget_fits), a
 * piece at a time: the checksum of the landed blocks when kv-ready carries one, and on a
 * device pool one copy_h2d per run of blocks contiguous in both block sets, layer by
 * layer. A piece is at most max_op_bytes (one block at least), so no loop iteration
 * verifies or copies more than max(budget, one piece) of a long prompt's KV. Meanwhile
 * the lease stays in x->leases (ADOPTING: data and binds for it are refused, its deadline,
 * cancel and the loss of its sender end it as any live lease's, the sender then told
 * STALE). The ACK and the ready event come once every piece is verified and copied. */

void xfer_adopt_start(td_xfer_t *x, xfer_lease_t *l)
{
    l->state = LEASE_ADOPTING;
    l->adopt_layer = 0;
    l->adopt_idx = 0;
    l->adopt_sum = 0;
    td_list_push_back(&x->adopting, &l->adopt_link);
    x->acts++;
}

/* Blocks in the next piece at l's cursor: one layer, at most max_op_bytes, and, when
 * there is a copy, contiguous in the landing blocks and in the pool blocks. */
static uint32_t adopt_piece_blocks(const td_xfer_t *x, const xfer_lease_t *l, uint32_t n_used)
{
    size_t cap = TD_MAX((size_t)1, x->cfg.max_op_bytes / td_kv_block_bytes(&x->pool.layout));
    uint32_t i = l->adopt_idx, n = 1;
    while ((size_t)n < cap && i + n < n_used &&
           (!l->dev || (l->blocks[i + n] == l->blocks[i] + (int32_t)n && l->dev[i + n] == l->dev[i] + (int32_t)n)))
        n++;
    return n;
}

/* Verifies and copies the n blocks at l's cursor (landed bytes: x->pool is the landing
 * area on a device pool). Errors: copy_h2d's, logged here. */
static td_status_t adopt_piece(td_xfer_t *x, xfer_lease_t *l, uint32_t n)
{
    const td_kv_layout_t *ly = &x->pool.layout;
    size_t bb = td_kv_block_bytes(ly);
    uint32_t layer = l->adopt_layer, i = l->adopt_idx;
    if (l->ready.flags & READY_F_CHECKSUM) {
        for (uint32_t k = 0; k < n; k++) {
            size_t off = td_kv_block_offset(ly, x->pool.n_blocks, layer, (uint32_t)l->blocks[i + k]);
            l->adopt_sum += xfer_block_checksum((char *)x->pool.base + off, bb, layer, i + k);
        }
        x->stats.bytes_verified += (uint64_t)n * bb;
    }
    if (l->dev) {
        char *dst = (char *)x->dev_base + td_kv_block_offset(ly, x->dev_n_blocks, layer, (uint32_t)l->dev[i]);
        const char *src =
            (const char *)x->pool.base + td_kv_block_offset(ly, x->pool.n_blocks, layer, (uint32_t)l->blocks[i]);
        td_status_t st = x->pool.copy_h2d(x->pool.copy_arg, dst, src, (size_t)n * bb);
        if (st != TD_OK)
            return td_errorf(st, "xfer request %" PRIu64 " lease %" PRIu64 ": copy into the device pool failed: %s",
                             l->ready.request_id, l->id, td_last_error());
        x->stats.bytes_copied_h2d += (uint64_t)n * bb;
    }
    return TD_OK;
}

/* Every piece is done: the checksum decides; the landing blocks go back (their bytes are
 * in the pool), the pool blocks' references pass to the ready event, the sender gets OK. */
static void adopt_finish(td_xfer_t *x, xfer_lease_t *l)
{
    am_ready_hdr_t *rd = &l->ready;
    if ((rd->flags & READY_F_CHECKSUM) && l->adopt_sum != rd->checksum) {
        td_errorf(TD_ERR_PROTOCOL, "xfer request %" PRIu64 " lease %" PRIu64 ": checksum mismatch, not adopted",
                  rd->request_id, l->id);
        x->stats.fail_protocol++;
        xfer_lease_fail(x, l, TD_ERR_PROTOCOL);
        return;
    }
    ready_event_t *ev = malloc(sizeof *ev + (size_t)l->n_blocks * sizeof(int32_t));
    if (!ev) {
        td_errorf(TD_ERR_NOMEM, "xfer lease %" PRIu64 ": no memory for the ready event", l->id);
        xfer_lease_fail(x, l, TD_ERR_NOMEM);
        return;
    }
    td_list_remove(&l->adopt_link);
    if (l->dev)
        xfer_landing_give(x, l);
    memcpy(ev->blocks, l->dev ? l->dev : l->blocks, (size_t)l->n_blocks * sizeof(int32_t));
    /* The lease's references become the ready event's: from here only its receiver adopts
     * or releases them (td_kv aborts any other release, the lease's included). */
    td_kv_pass_blocks(x->pool.kv, ev->blocks, l->n_blocks, TD_KV_HOLDER_LEASE, TD_KV_HOLDER_LANDED);
    ev->r = (td_xfer_ready_t){.request_id = rd->request_id, .lease_id = l->id, .blocks = ev->blocks,
                              .n_blocks = l->n_blocks, .n_tokens = rd->n_tokens,
                              .first_token = rd->first_token};
    td_list_push_back(&x->ready_list, &ev->link);
    x->stats.leases_adopted++;
    xfer_send_ack(x, l->ready_ep, rd->request_id, l->id, TD_OK);
    xfer_lease_remove(x, l); /* block references pass to the ready callback */
}

/* Takes l's adoption on as far as the iteration's budget allows. False: the budget stopped
 * it (the rest goes next iteration); true: it ended, adopted or failed (l is gone). */
static bool adopt_advance(td_xfer_t *x, xfer_lease_t *l)
{
    const td_kv_layout_t *ly = &x->pool.layout;
    uint32_t n_used = TD_DIV_CEIL(l->ready.n_tokens, ly->block_size);
    size_t passes = ((l->ready.flags & READY_F_CHECKSUM) ? 1u : 0u) + (l->dev ? 1u : 0u); /* over each byte */
    while (passes && l->adopt_layer < ly->n_layers) {
        uint32_t n = adopt_piece_blocks(x, l, n_used);
        size_t cost = (size_t)n * td_kv_block_bytes(ly) * passes;
        if (!xfer_budget_fits(x, cost))
            return false;
        xfer_budget_charge(x, cost);
        td_status_t st = adopt_piece(x, l, n);
        if (st != TD_OK) {
            xfer_lease_fail(x, l, st); /* the sender's verdict is the copy's error */
            return true;
        }
        l->adopt_idx += n;
        if (l->adopt_idx == n_used) {
            l->adopt_idx = 0;
            l->adopt_layer++;
        }
    }
    adopt_finish(x, l);
    return true;
}

/* Adoption jobs, oldest first, until they are done or the budget is spent. */
void xfer_adopt_run(td_xfer_t *x)
{
    while (!td_list_empty(&x->adopting)) {
        if (!adopt_advance(x, TD_CONTAINER_OF(x->adopting.next, xfer_lease_t, adopt_link)))
            return;
        x->acts++; /* its ACK is posted: drain goes round */
    }
}
