/*
 * td_xfer sending side: a send per request (begin, layers, finish, abort), its DATA
 * operations (AM or put) posted under the in-flight bound, the put path's flush, READY and
 * the verdict (ACK), BIND_ACK, the receiver's ABORTs, and the counting of verdicts.
 */
#include "td_xfer_int.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "td_util.h"

static void hist_observe(td_xfer_stats_t *st, double s)
{
    for (int i = 0; i < TD_XFER_HIST_BUCKETS; i++)
        if (s <= td_xfer_hist_le_s[i])
            st->transfer_hist[i]++;
    st->transfer_seconds_sum += s;
}

void xfer_send_set_status(td_xfer_send_t *s, td_status_t st)
{
    if (s->status == TD_OK && !s->verdict)
        s->status = st;
}

/* Queues the done callback once everything the request owns in UCX has come back. */
void xfer_send_maybe_done(td_xfer_send_t *s)
{
    if (s->done_queued || !s->finished || s->ops_out || s->ready_inflight || s->flush_inflight)
        return;
    if (s->status == TD_OK && !s->verdict) {
        if (!s->ready_posted)
            return; /* drain posts READY */
        return;     /* waiting for the ACK */
    }
    s->done_queued = true;
    td_list_push_back(&s->x->done_list, &s->done_link);
}

/* Adds op's blocks (`bytes`: their K/V, host memory) to the request's checksum. Taken when
 * the op is posted (host source) or its copy landed (device source), under the loop
 * iteration's budget, not for a whole layer at send_layer. */
void xfer_op_checksum(send_op_t *op, const uint8_t *bytes)
{
    td_xfer_send_t *s = op->s;
    size_t bb = td_kv_block_bytes(&s->peer->layout);
    for (uint32_t k = 0; k < op->hdr.n_blocks; k++)
        s->checksum += xfer_block_checksum(bytes + (size_t)k * bb, bb, op->hdr.layer, op->hdr.first_idx + k);
}

/* Bytes the loop thread itself reads or writes to post op: the copy of a shared-memory put
 * and the checksum (a device source's is taken as its copy lands, just before posting).
 * 0 for an op that will be dropped. */
size_t xfer_op_sync_bytes(const send_op_t *op)
{
    const td_xfer_send_t *s = op->s;
    if (!s->peer->alive || s->status != TD_OK)
        return 0;
    return (s->mode == MODE_PUT && s->peer->mapped ? op->len : 0) + (s->p.checksum ? op->len : 0);
}

static void data_sent_cb(void *request, ucs_status_t status, void *user_data)
{
    send_op_t *op = user_data;
    td_xfer_send_t *s = op->s;
    td_xfer_t *x = s->x;
    xfer_stage_give(x, op);
    x->ops_posted--;
    s->ops_out--;
    if (status == UCS_OK)
        x->stats.bytes_sent += op->len;
    else
        xfer_send_set_status(s, status == UCS_ERR_CANCELED ? TD_ERR_STALE : TD_ERR_UNAVAILABLE);
    free(op);
    if (request)
        ucp_request_free(request);
    xfer_send_maybe_done(s);
}

/* An operation may go once its request knows its primitive (and, for puts, is bound);
 * operations of failed requests "go" to be dropped. */
bool xfer_op_ready(const send_op_t *op)
{
    const td_xfer_send_t *s = op->s;
    return !s->peer->alive || s->status != TD_OK || s->mode == MODE_AM || (s->mode == MODE_PUT && s->bound);
}

void xfer_post_op(td_xfer_t *x, send_op_t *op)
{
    td_xfer_send_t *s = op->s;
    x->acts++;
    if (!s->peer->alive || s->status != TD_OK) {
        xfer_stage_give(x, op);
        s->ops_out--;
        free(op);
        xfer_send_maybe_done(s);
        return;
    }
    if (s->p.checksum && s->p.mem == TD_XFER_MEM_HOST) /* a device source's: stage_landed */
        xfer_op_checksum(op, op->src);
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .cb.send = data_sent_cb,
                               .user_data = op,
                               .flags = UCP_AM_SEND_FLAG_REPLY};
    x->ops_posted++;
    ucs_status_ptr_t r;
    if (s->mode == MODE_PUT) {
        /* Completion = our buffer is reusable; the ep flush before READY makes it remote. */
        uint64_t raddr = s->peer->base + td_kv_block_offset(&s->peer->layout, s->peer->n_blocks, op->hdr.layer,
                                                            op->hdr.dst_block);
        prm.op_attr_mask &= ~(uint32_t)UCP_OP_ATTR_FIELD_FLAGS;
        x->stats.ops_put++;
        if (s->peer->mapped) {
            /* Shared memory: what UCX's sysv/posix put would do (a copy into the mapping,
             * complete in place), with stores that suit a copy nobody here reads again:
             * the destination is read later by the decode engine, not by us, and is not in
             * our cache (ordinary stores would first read every line in and evict the
             * source). Globally visible on return, before READY can follow. */
            void *dst = (char *)s->peer->mapped + (raddr - s->peer->base);
            if (op->len >= x->cfg.put_nt_min)
                td_memcpy_stream(dst, op->src, op->len);
            else
                memcpy(dst, op->src, op->len);
            data_sent_cb(NULL, UCS_OK, op);
            return;
        }
        r = ucp_put_nbx(s->peer->ep, op->src, op->len, raddr, s->peer->rkey, &prm);
    } else {
        x->stats.ops_am++;
        r = ucp_am_send_nbx(s->peer->ep, AM_DATA, &op->hdr, sizeof op->hdr, op->src, op->len, &prm);
    }
    if (r == NULL)
        data_sent_cb(NULL, UCS_OK, op);
    else if (UCS_PTR_IS_ERR(r))
        data_sent_cb(NULL, UCS_PTR_STATUS(r), op);
}

static void ready_sent_cb(void *request, ucs_status_t status, void *user_data)
{
    td_xfer_send_t *s = user_data;
    s->ready_inflight = false;
    if (status != UCS_OK)
        xfer_send_set_status(s, TD_ERR_UNAVAILABLE);
    if (request)
        ucp_request_free(request);
    xfer_send_maybe_done(s);
}

void xfer_post_ready(td_xfer_t *x, td_xfer_send_t *s)
{
    x->acts++;
    s->ready_posted = true;
    s->ready_inflight = true;
    s->ready = (am_ready_hdr_t){.request_id = s->p.request_id,
                                .lease_id = s->p.lease_id,
                                .bytes = s->bytes,
                                .checksum = s->checksum,
                                .n_tokens = s->p.n_tokens,
                                .first_token = s->ready.first_token,
                                .flags = (s->p.checksum ? READY_F_CHECKSUM : 0) |
                                         (s->mode == MODE_PUT ? READY_F_PUT : 0),
                                .layout = s->peer->layout,
                                .token = s->p.token};
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_FLAGS,
                               .cb.send = ready_sent_cb,
                               .user_data = s,
                               .flags = UCP_AM_SEND_FLAG_REPLY};
    ucs_status_ptr_t r = ucp_am_send_nbx(s->peer->ep, AM_READY, &s->ready, sizeof s->ready, NULL, 0, &prm);
    if (r == NULL)
        ready_sent_cb(NULL, UCS_OK, s);
    else if (UCS_PTR_IS_ERR(r))
        ready_sent_cb(NULL, UCS_PTR_STATUS(r), s);
}

/* Lease ids are unique per receiver only: a message names a send together with the
 * endpoint it came on (two receivers both have a lease 1). */
static td_xfer_send_t *send_find(td_xfer_peer_t *peer, uint64_t request_id, uint64_t lease_id)
{
    if (!peer)
        return NULL;
    TD_LIST_FOREACH(n, &peer->sends) {
        td_xfer_send_t *s = TD_CONTAINER_OF(n, td_xfer_send_t, peer_link);
        if (s->p.request_id == request_id && s->p.lease_id == lease_id)
            return s;
    }
    return NULL;
}

ucs_status_t xfer_am_ack_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param)
{
    td_xfer_t *x = arg;
    am_ack_hdr_t h;
    if (!xfer_am_unpack(x, header, header_length, &h, sizeof h, false))
        return UCS_OK;
    td_xfer_send_t *s = send_find(xfer_peer_of_param(x, param), h.request_id, h.lease_id);
    if (!s || s->verdict || !s->ready_posted)
        return UCS_OK; /* already timed out or failed */
    if (s->status == TD_OK)
        s->status = (td_status_t)h.status;
    s->verdict = true;
    xfer_send_maybe_done(s);
    return UCS_OK;
}

ucs_status_t xfer_am_bind_ack_cb(void *arg, const void *header, size_t header_length, void *data,
                                 size_t length, const ucp_am_recv_param_t *param)
{
    td_xfer_t *x = arg;
    am_ack_hdr_t h;
    if (!xfer_am_unpack(x, header, header_length, &h, sizeof h, false))
        return UCS_OK;
    td_xfer_send_t *s = send_find(xfer_peer_of_param(x, param), h.request_id, h.lease_id);
    if (!s || s->mode != MODE_PUT || s->bound)
        return UCS_OK;
    if (h.status == TD_OK)
        s->bound = true;
    else
        xfer_send_set_status(s, (td_status_t)h.status);
    xfer_send_maybe_done(s);
    return UCS_OK;
}

static void drop_queued(td_xfer_t *x, td_xfer_send_t *s)
{
    TD_LIST_FOREACH_SAFE(n, &x->queue) {
        send_op_t *op = TD_CONTAINER_OF(n, send_op_t, link);
        if (op->s == s) {
            td_list_remove(&op->link);
            s->ops_out--;
            free(op);
        }
    }
}

ucs_status_t xfer_am_abort_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                              const ucp_am_recv_param_t *param)
{
    td_xfer_t *x = arg;
    am_ack_hdr_t h;
    ucp_ep_h ep = xfer_am_reply_ep(param);
    td_xfer_peer_t *peer = ep ? xfer_peer_of_ep(x, ep) : NULL;
    if (!xfer_am_unpack(x, header, header_length, &h, sizeof h, false) || !peer)
        return UCS_OK;
    td_xfer_send_t *s = send_find(peer, h.request_id, h.lease_id);
    if (s && !s->done_queued) {
        xfer_send_set_status(s, TD_ERR_STALE);
        drop_queued(x, s);
        xfer_send_maybe_done(s);
    }
    abort_job_t *j = calloc(1, sizeof *j);
    if (!j)
        return UCS_OK; /* the receiver's quarantine bound releases the blocks */
    j->peer = peer;
    j->request_id = h.request_id;
    j->lease_id = h.lease_id;
    td_list_push_back(&x->aborts, &j->link);
    return UCS_OK;
}

static void abort_flushed_cb(void *request, ucs_status_t status, void *user_data)
{
    abort_job_t *j = user_data;
    if (status == UCS_OK)
        j->flushed = true;
    else
        j->failed = true;
    if (request)
        ucp_request_free(request);
}

void xfer_run_aborts(td_xfer_t *x)
{
    TD_LIST_FOREACH_SAFE(n, &x->aborts) {
        abort_job_t *j = TD_CONTAINER_OF(n, abort_job_t, link);
        if (!j->flush_posted) {
            td_xfer_send_t *s = send_find(j->peer, j->request_id, j->lease_id);
            if (j->peer->alive && s && s->ops_out > 0)
                continue; /* its posted puts are not back yet */
            if (!j->peer->alive) {
                j->failed = true;
            } else {
                j->flush_posted = true;
                ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                                           .cb.send = abort_flushed_cb,
                                           .user_data = j};
                ucs_status_ptr_t r = ucp_ep_flush_nbx(j->peer->ep, &prm);
                if (r == NULL)
                    abort_flushed_cb(NULL, UCS_OK, j);
                else if (UCS_PTR_IS_ERR(r))
                    abort_flushed_cb(NULL, UCS_PTR_STATUS(r), j);
            }
        }
        if (j->flushed && j->peer->alive)
            xfer_send_ctl(x, j->peer->ep, AM_ABORT_ACK, j->request_id, j->lease_id, TD_OK);
        if (j->flushed || j->failed) {
            x->acts++;
            td_list_remove(&j->link);
            free(j);
        }
    }
}

static void put_flushed_cb(void *request, ucs_status_t status, void *user_data)
{
    td_xfer_send_t *s = user_data;
    s->flush_inflight = false;
    if (status == UCS_OK)
        s->flushed = true;
    else
        xfer_send_set_status(s, TD_ERR_UNAVAILABLE);
    if (request)
        ucp_request_free(request);
    xfer_send_maybe_done(s);
}

/* Put path: every put of the request is complete locally; flush the endpoint so they are
 * complete at the receiver before READY tells it so. */
void xfer_post_flush(td_xfer_send_t *s)
{
    s->x->acts++;
    s->flush_inflight = true;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                               .cb.send = put_flushed_cb,
                               .user_data = s};
    ucs_status_ptr_t r = ucp_ep_flush_nbx(s->peer->ep, &prm);
    if (r == NULL)
        put_flushed_cb(NULL, UCS_OK, s);
    else if (UCS_PTR_IS_ERR(r))
        put_flushed_cb(NULL, UCS_PTR_STATUS(r), s);
}

td_status_t td_xfer_send_begin(td_xfer_t *x, td_xfer_peer_t *peer, const td_xfer_send_params_t *p,
                               td_xfer_send_t **s_p)
{
    if (p->mem == TD_XFER_MEM_CUDA) {
        size_t bb = td_kv_block_bytes(&peer->layout);
        if (!x->cfg.d2h || bb > x->cfg.staging_bytes / 2)
            return td_errorf(TD_ERR_INVALID, "xfer request %" PRIu64 ": a device-memory source needs a device-to-host "
                             "copier (td_xfer_config_t.d2h) and a staging ring of two blocks at least (%zu bytes; "
                             "staging_bytes is %zu)", p->request_id, 2 * bb, x->cfg.staging_bytes);
        td_status_t st = xfer_stage_alloc(x);
        if (st != TD_OK)
            return st;
    } else if (p->mem != TD_XFER_MEM_HOST) {
        return td_errorf(TD_ERR_INVALID, "xfer request %" PRIu64 ": unknown memory type %d", p->request_id,
                         (int)p->mem);
    }
    if (!peer->alive)
        return td_errorf(TD_ERR_UNAVAILABLE, "xfer request %" PRIu64 ": peer is gone, connect again", p->request_id);
    uint32_t bs = peer->layout.block_size;
    if (p->n_tokens == 0 || p->n_dst_blocks <= 0 || !p->done ||
        (uint64_t)p->n_dst_blocks * bs < p->n_tokens)
        return td_errorf(TD_ERR_INVALID, "xfer request %" PRIu64 ": %u tokens do not fit %d blocks of %u",
                         p->request_id, p->n_tokens, p->n_dst_blocks, bs);
    for (int32_t i = 0; i < p->n_dst_blocks; i++)
        if (p->dst_blocks[i] < 0 || (uint32_t)p->dst_blocks[i] >= peer->n_blocks)
            return td_errorf(TD_ERR_INVALID, "xfer request %" PRIu64 ": destination block %d outside the pool of %u",
                             p->request_id, p->dst_blocks[i], peer->n_blocks);
    td_xfer_send_t *s = calloc(1, sizeof *s);
    int32_t *blocks = malloc((size_t)p->n_dst_blocks * sizeof *blocks);
    uint8_t *seen = calloc(peer->layout.n_layers, 1);
    if (!s || !blocks || !seen) {
        free(s);
        free(blocks);
        free(seen);
        return td_errorf(TD_ERR_NOMEM, "xfer request %" PRIu64 ": out of memory", p->request_id);
    }
    memcpy(blocks, p->dst_blocks, (size_t)p->n_dst_blocks * sizeof *blocks);
    s->x = x;
    s->peer = peer;
    s->p = *p;
    s->p.dst_blocks = s->dst_blocks = blocks;
    s->layer_seen = seen;
    s->n_used = (int32_t)TD_DIV_CEIL(p->n_tokens, bs);
    s->start_ns = td_now_ns();
    s->deadline_ns = s->start_ns + (uint64_t)x->cfg.send_timeout_ms * 1000000ull;
    td_list_init(&s->done_link);
    td_list_push_back(&peer->sends, &s->peer_link);
    x->stats.transfers_inflight++;
    *s_p = s;
    return TD_OK;
}

td_status_t td_xfer_send_layer(td_xfer_send_t *s, uint32_t layer, const void *src_layer, const int32_t *src_blocks)
{
    td_xfer_t *x = s->x;
    const td_kv_layout_t *lay = &s->peer->layout;
    if (s->finished || layer >= lay->n_layers || s->layer_seen[layer]) {
        td_status_t st = td_errorf(TD_ERR_INVALID, "xfer request %" PRIu64 ": layer %u %s", s->p.request_id, layer,
                                   layer >= lay->n_layers ? "out of range" : "sent twice or after finish");
        xfer_send_set_status(s, st);
        return st;
    }
    if (s->status != TD_OK)
        return s->status;
    s->layer_seen[layer] = 1;
    s->layers_sent++;
    size_t bb = td_kv_block_bytes(lay);
    bool device = s->p.mem == TD_XFER_MEM_CUDA;
    /* One operation moves at most max_op_bytes (one block at least): no single copy or
     * checksum on the loop grows with the prompt. A device-source operation is staged whole:
     * at most half the ring, so two fit. */
    size_t max_bytes = device ? TD_MIN(x->cfg.max_op_bytes, x->cfg.staging_bytes / 2) : x->cfg.max_op_bytes;
    int32_t max_run = (int32_t)TD_MIN(TD_MAX(max_bytes / bb, (size_t)1), (size_t)INT32_MAX);
    for (int32_t i = 0; i < s->n_used;) {
        /* One operation per run contiguous in the destination and in the source. */
        int32_t j = i + 1;
        while (j < s->n_used && j - i < max_run && s->dst_blocks[j] == s->dst_blocks[j - 1] + 1 &&
               src_blocks[j] == src_blocks[j - 1] + 1)
            j++;
        send_op_t *op = malloc(sizeof *op);
        if (!op) {
            xfer_send_set_status(s, td_errorf(TD_ERR_NOMEM, "xfer request %" PRIu64 ": out of memory",
                                              s->p.request_id));
            return TD_ERR_NOMEM;
        }
        *op = (send_op_t){0};
        op->s = s;
        op->hdr = (am_data_hdr_t){.lease_id = s->p.lease_id, .layer = layer, .dst_block = (uint32_t)s->dst_blocks[i],
                                  .n_blocks = (uint32_t)(j - i), .first_idx = (uint32_t)i,
                                  .token = s->p.token};
        op->src = (const char *)src_layer + (size_t)src_blocks[i] * bb;
        op->len = (size_t)(j - i) * bb;
        s->bytes += op->len; /* its checksum is taken when it is posted (xfer_op_checksum) */
        s->ops_out++;
        td_list_push_back(&x->queue, &op->link);
        i = j;
    }
    return TD_OK;
}

void td_xfer_send_finish(td_xfer_send_t *s, int32_t first_token)
{
    if (s->finished)
        return;
    s->finished = true;
    s->ready.first_token = first_token;
    if (s->layers_sent != s->peer->layout.n_layers)
        xfer_send_set_status(s, td_errorf(TD_ERR_INVALID, "xfer request %" PRIu64 ": finished with %u of %u layers",
                                          s->p.request_id, s->layers_sent, s->peer->layout.n_layers));
    xfer_send_maybe_done(s);
}

/* Counts a send's verdict, once, as its done callback is made. */
void xfer_send_count(td_xfer_t *x, const td_xfer_send_t *s)
{
    td_status_t st = s->status;
    x->stats.transfers_inflight--;
    if (st == TD_OK) {
        x->stats.transfers_ok++;
        hist_observe(&x->stats, (double)(td_now_ns() - s->start_ns) * 1e-9);
    } else if (st == TD_ERR_UNAVAILABLE) {
        x->stats.fail_peer++;
    } else if (st == TD_ERR_TIMEOUT) {
        x->stats.fail_timeout++;
    } else if (st == TD_ERR_STALE) {
        x->stats.fail_stale++;
    } else if (st == TD_ERR_MISMATCH) {
        x->stats.fail_mismatch++;
    } else {
        x->stats.fail_protocol++;
    }
}

void xfer_send_free(td_xfer_send_t *s)
{
    td_list_remove(&s->peer_link);
    free(s->layer_seen);
    free(s->dst_blocks);
    free(s);
}

void td_xfer_send_abort(td_xfer_send_t *s, td_status_t why)
{
    if (s->done_queued || s->verdict)
        return;
    xfer_send_set_status(s, why == TD_OK ? TD_ERR_CANCELLED : why);
    drop_queued(s->x, s);
    s->finished = true;
    xfer_send_maybe_done(s);
}
