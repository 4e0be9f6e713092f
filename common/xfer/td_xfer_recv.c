/*
 * td_xfer receiving side: endpoints accepted from senders (and their loss), and the
 * receiver's active-message handlers: DATA into the pool, READY, HELLO, BIND, ABORT_ACK.
 *
 * Anyone who reaches the listener can connect and send (UCX authenticates nobody), so a
 * message naming a live lease is taken only with the lease's token, and only from the
 * endpoint that first presented it (lease_admits): the owner. One that fails is dropped
 * and counted (rejected_token, rejected_endpoint) and leaves the lease as it was; a kv-ready
 * from the owner whose contents do not check is refused to it (rejected_malformed) and the
 * lease lives on until its deadline or cancel. docs/security.md, "The KV data plane".
 */
#include "td_xfer_int.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_util.h"

/* Why a message naming a live lease was dropped: the index into x->reject_log_ns. */
typedef enum reject_why { REJECT_TOKEN, REJECT_ENDPOINT, REJECT_MALFORMED } reject_why_t;

#define REJECT_LOG_NS 10000000000ull /* a rejection of the same reason is logged again only
                                        after this long: a flood must not flood the log */

/* Equal tokens, in time independent of where they differ (no early exit), so that the time
 * a refusal takes does not tell a guesser how much of a token it has right. */
static bool token_equal(const td_xfer_token_t *a, const td_xfer_token_t *b)
{
    volatile uint8_t d = 0;
    for (size_t i = 0; i < sizeof a->b; i++)
        d |= (uint8_t)(a->b[i] ^ b->b[i]);
    return d == 0;
}

/* Counts a dropped message, and logs it (rate-limited per reason). */
static void reject(td_xfer_t *x, reject_why_t why, const char *what, const xfer_lease_t *l)
{
    static const char *const text[] = {"without the lease's token", "from an endpoint that does not own the lease",
                                       "that does not match the lease"};
    uint64_t *n = why == REJECT_TOKEN      ? &x->stats.rejected_token
                  : why == REJECT_ENDPOINT ? &x->stats.rejected_endpoint
                                           : &x->stats.rejected_malformed;
    (*n)++;
    uint64_t now = td_now_ns();
    if (x->reject_log_ns[why] == 0 || now - x->reject_log_ns[why] >= REJECT_LOG_NS) {
        x->reject_log_ns[why] = now;
        td_warn("xfer %s: %s for lease %" PRIu64 " %s, dropped (%" PRIu64 " so far; the lease is unharmed)",
                x->name, what, l->id, text[why], *n);
    }
}

/* The checks every BIND, DATA and READY naming a live lease passes first: the lease's
 * token, then the endpoint (c, NULL when UCX gave none) is the lease's owner or the lease
 * has none yet (the caller makes c the owner once it takes the message). False: dropped
 * and counted. */
static bool lease_admits(td_xfer_t *x, const xfer_lease_t *l, const td_xfer_token_t *token, const xfer_conn_t *c,
                         const char *what)
{
    if (!token_equal(&l->token, token)) {
        reject(x, REJECT_TOKEN, what, l);
        return false;
    }
    if (!c || (l->owner && l->owner != c)) {
        reject(x, REJECT_ENDPOINT, what, l);
        return false;
    }
    return true;
}

static void conn_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    xfer_conn_t *c = arg;
    td_xfer_t *x = c->x;
    td_info("xfer sender endpoint lost: %s", ucs_status_string(status));
    /* Leases this sender was writing can never complete: release them now. */
    TD_LIST_FOREACH_SAFE(n, &x->leases) {
        xfer_lease_t *l = TD_CONTAINER_OF(n, xfer_lease_t, link);
        /* An adoption whose sender cannot hear the verdict stops: that sender reports the
         * transfer failed, so the request must not run here. */
        bool lost = l->state == LEASE_ADOPTING && l->ready_ep == ep;
        if (l->ready_ep == ep)
            l->ready_ep = NULL;
        if (l->owner == c) { /* nobody else may write it: it can never complete */
            l->owner = NULL;
            lost = true;
        }
        if (l->writer == c) {
            l->writer = NULL;
            lost = true;
        }
        if (l->put_writer == c) {
            l->put_writer = NULL; /* its endpoint is gone: it cannot write any more */
            lost = true;
        }
        if (lost) {
            if (l->state != LEASE_DEAD) {
                x->stats.leases_sender_lost++;
                xfer_lease_kill(x, l);
            } else {
                xfer_lease_try_release(x, l);
            }
        }
    }
    if (!c->closing) {
        c->closing = true;
        xfer_close_ep_force(x, ep);
    }
    td_list_remove(&c->link);
    free(c);
}

void xfer_conn_cb(ucp_conn_request_h req, void *arg)
{
    td_xfer_t *x = arg;
    if (x->destroying) { /* shutting down: no new senders */
        ucp_listener_reject(x->listener, req);
        return;
    }
    xfer_conn_t *c = calloc(1, sizeof *c);
    if (!c) {
        td_errorf(TD_ERR_NOMEM, "xfer: no memory for a connection, rejected");
        ucp_listener_reject(x->listener, req);
        return;
    }
    c->x = x;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                          .conn_request = req,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {conn_err_cb, c}};
    ucs_status_t st = ucp_ep_create(x->worker, &ep, &c->ep);
    if (st != UCS_OK) {
        xfer_ucx_err(st, "accept");
        free(c);
        return;
    }
    td_list_push_back(&x->conns, &c->link);
}

static xfer_conn_t *conn_of_ep(td_xfer_t *x, ucp_ep_h ep)
{
    TD_LIST_FOREACH(n, &x->conns) {
        xfer_conn_t *c = TD_CONTAINER_OF(n, xfer_conn_t, link);
        if (c->ep == ep)
            return c;
    }
    return NULL;
}

static void lease_check_ready(td_xfer_t *x, xfer_lease_t *l)
{
    if (x->destroying)
        return; /* nothing is adopted during shutdown: the sender's endpoint closes */
    if (l->state == LEASE_LIVE && l->ready_pending && l->inflight == 0 && l->bytes == l->ready.bytes) {
        l->ready_pending = false;
        xfer_adopt_start(x, l); /* xfer_adopt_run takes it from drain, a piece per budget */
    }
}

static void recv_done_cb(void *request, ucs_status_t status, size_t length, void *user_data)
{
    recv_op_t *op = user_data;
    xfer_lease_t *l = op->lease;
    td_xfer_t *x = op->x;
    l->inflight--;
    if (status == UCS_OK) {
        l->bytes += op->len;
        x->stats.bytes_received += op->len;
    }
    free(op);
    if (request)
        ucp_request_free(request);
    if (l->state == LEASE_DEAD) {
        xfer_lease_try_release(x, l);
        return;
    }
    lease_check_ready(x, l);
}

ucs_status_t xfer_am_data_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                             const ucp_am_recv_param_t *param)
{
    td_xfer_t *x = arg;
    am_data_hdr_t h;
    if (!xfer_am_unpack(x, header, header_length, &h, sizeof h, true))
        return UCS_OK;
    xfer_lease_t *l = xfer_lease_find(x, h.lease_id);
    size_t bb = td_kv_block_bytes(&x->pool.layout);
    if (!l || l->state != LEASE_LIVE || x->destroying) {
        /* Fence: returning without receiving refuses a rendezvous; eager bytes are dropped. */
        x->stats.discarded_data++;
        return UCS_OK;
    }
    ucp_ep_h ep = xfer_am_reply_ep(param);
    xfer_conn_t *c = ep ? conn_of_ep(x, ep) : NULL;
    if (!lease_admits(x, l, &h.token, c, "data"))
        return UCS_OK; /* refused unread, as for a dead lease */
    bool ok = h.layer < x->pool.layout.n_layers && h.n_blocks > 0 && length == (size_t)h.n_blocks * bb &&
              (uint64_t)h.first_idx + h.n_blocks <= (uint64_t)l->n_blocks;
    for (uint32_t k = 0; ok && k < h.n_blocks; k++)
        ok = (uint32_t)l->blocks[h.first_idx + k] == h.dst_block + k;
    if (!ok) {
        td_errorf(TD_ERR_PROTOCOL, "xfer lease %" PRIu64 ": data for layer %u blocks %u+%u not in the lease, dropped",
                  h.lease_id, h.layer, h.dst_block, h.n_blocks);
        x->stats.fail_protocol++;
        return UCS_OK;
    }
    l->owner = l->writer = c;
    char *dst = (char *)x->pool.base + td_kv_block_offset(&x->pool.layout, x->pool.n_blocks, h.layer, h.dst_block);
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
        memcpy(dst, data, length);
        l->bytes += length;
        x->stats.bytes_received += length;
        lease_check_ready(x, l);
        return UCS_OK;
    }
    recv_op_t *op = malloc(sizeof *op);
    if (!op) {
        td_errorf(TD_ERR_NOMEM, "xfer lease %" PRIu64 ": no memory to receive, refused", h.lease_id);
        return UCS_OK;
    }
    op->x = x;
    op->lease = l;
    op->len = length;
    ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                                               UCP_OP_ATTR_FIELD_MEMH,
                               .cb.recv_am = recv_done_cb,
                               .user_data = op,
                               .memh = x->memh};
    l->inflight++;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(x->worker, data, dst, length, &prm);
    if (UCS_PTR_IS_ERR(r)) {
        l->inflight--;
        xfer_ucx_err(UCS_PTR_STATUS(r), "receive data");
        free(op);
    } else if (r == NULL) {
        recv_done_cb(NULL, UCS_OK, length, op);
    }
    return UCS_OK;
}

ucs_status_t xfer_am_ready_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                              const ucp_am_recv_param_t *param)
{
    td_xfer_t *x = arg;
    am_ready_hdr_t h;
    ucp_ep_h ep = xfer_am_reply_ep(param);
    if (!xfer_am_unpack(x, header, header_length, &h, sizeof h, true))
        return UCS_OK;
    if (x->destroying) {
        xfer_send_ack(x, ep, h.request_id, h.lease_id, TD_ERR_UNAVAILABLE); /* this node is going */
        return UCS_OK;
    }
    xfer_lease_t *l = xfer_lease_find(x, h.lease_id);
    if (!l || l->state != LEASE_LIVE) {
        td_info("xfer request %" PRIu64 " lease %" PRIu64 ": kv-ready for a dead lease, discarded", h.request_id,
                h.lease_id);
        x->stats.discarded_ready++;
        xfer_send_ack(x, ep, h.request_id, h.lease_id, TD_ERR_STALE);
        return UCS_OK;
    }
    xfer_conn_t *c = ep ? conn_of_ep(x, ep) : NULL;
    if (!lease_admits(x, l, &h.token, c, "kv-ready")) {
        /* the answer a dead lease gets: it tells a guesser nothing */
        xfer_send_ack(x, ep, h.request_id, h.lease_id, TD_ERR_STALE);
        return UCS_OK;
    }
    char why[160];
    td_status_t verdict = TD_OK;
    if (td_kv_layout_compare(&x->pool.layout, &h.layout, why, sizeof why) != TD_OK) {
        verdict = td_errorf(TD_ERR_MISMATCH, "xfer request %" PRIu64 ": %s; refused", h.request_id, why);
        x->stats.fail_mismatch++;
    } else if (h.request_id != l->request_id ||
               (uint64_t)h.n_tokens > (uint64_t)l->n_blocks * x->pool.layout.block_size || h.n_tokens == 0) {
        verdict = td_errorf(TD_ERR_MISMATCH,
                            "xfer lease %" PRIu64 ": kv-ready for request %" PRIu64 " with %u tokens, lease is for "
                            "request %" PRIu64 " with %d blocks; refused",
                            l->id, h.request_id, h.n_tokens, l->request_id, l->n_blocks);
        x->stats.fail_mismatch++;
    } else if (h.bytes != (uint64_t)x->pool.layout.n_layers * TD_DIV_CEIL(h.n_tokens, x->pool.layout.block_size) *
                              td_kv_block_bytes(&x->pool.layout) ||
               l->bytes > h.bytes) {
        verdict = td_errorf(TD_ERR_PROTOCOL, "xfer lease %" PRIu64 ": kv-ready announces %" PRIu64
                            " bytes, received %" PRIu64 "; refused", l->id, h.bytes, l->bytes);
        x->stats.fail_protocol++;
    }
    if (verdict == TD_OK && (h.flags & READY_F_PUT) && l->put_writer != c) {
        verdict = td_errorf(TD_ERR_PROTOCOL, "xfer lease %" PRIu64 ": kv-ready for puts from a sender not bound to "
                            "it; refused", l->id);
        x->stats.fail_protocol++;
    }
    if (verdict != TD_OK) {
        /* Refused to its sender; the lease is not killed by what one message says: it ends
         * by its deadline or cancel (the sender's failure reaches the router, which releases
         * it), or a correct kv-ready may still come. */
        reject(x, REJECT_MALFORMED, "kv-ready", l);
        xfer_send_ack(x, ep, h.request_id, h.lease_id, verdict);
        return UCS_OK;
    }
    l->owner = c;
    if (h.flags & READY_F_PUT) {
        /* The sender flushed its puts before READY: the bytes are in place. */
        x->stats.bytes_received += h.bytes - l->bytes;
        l->bytes = h.bytes;
    }
    l->ready = h;
    l->ready_ep = ep;
    l->ready_pending = true;
    lease_check_ready(x, l);
    return UCS_OK;
}

/* HELLO: answer at once; the sender holds its data until this reaches it. */
ucs_status_t xfer_am_hello_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                              const ucp_am_recv_param_t *param)
{
    td_xfer_t *x = arg;
    am_ack_hdr_t h;
    ucp_ep_h ep = xfer_am_reply_ep(param);
    if (!xfer_am_unpack(x, header, header_length, &h, sizeof h, false))
        return UCS_OK;
    xfer_send_ctl(x, ep, AM_HELLO_ACK, h.request_id, 0, x->have_pool && !x->destroying ? TD_OK : TD_ERR_UNAVAILABLE);
    return UCS_OK;
}

/* BIND: a sender is about to put into a live lease's blocks; from now on a death of the
 * lease keeps them out of the pool until it confirms (fence for puts). */
ucs_status_t xfer_am_bind_cb(void *arg, const void *header, size_t header_length, void *data, size_t length,
                             const ucp_am_recv_param_t *param)
{
    td_xfer_t *x = arg;
    am_ack_hdr_t h;
    ucp_ep_h ep = xfer_am_reply_ep(param);
    if (!xfer_am_unpack(x, header, header_length, &h, sizeof h, true))
        return UCS_OK;
    xfer_lease_t *l = xfer_lease_find(x, h.lease_id);
    xfer_conn_t *c = ep ? conn_of_ep(x, ep) : NULL;
    td_status_t st = TD_OK;
    if (x->destroying) {
        st = TD_ERR_UNAVAILABLE;
    } else if (!l || l->state != LEASE_LIVE) {
        x->stats.discarded_data++;
        st = TD_ERR_STALE;
    } else if (!lease_admits(x, l, &h.token, c, "bind")) {
        st = TD_ERR_STALE; /* the answer a dead lease gets: it tells a guesser nothing */
    } else if (h.request_id != l->request_id) {
        td_errorf(TD_ERR_PROTOCOL, "xfer lease %" PRIu64 ": bind for request %" PRIu64 " refused (lease is for "
                  "request %" PRIu64 ")", l->id, h.request_id, l->request_id);
        x->stats.fail_protocol++;
        st = TD_ERR_PROTOCOL;
    } else {
        l->owner = l->put_writer = c;
    }
    xfer_send_ctl(x, ep, AM_BIND_ACK, h.request_id, h.lease_id, st);
    return UCS_OK;
}

/* ABORT_ACK: the bound writer flushed and stopped; the quarantined blocks may return. */
ucs_status_t xfer_am_abort_ack_cb(void *arg, const void *header, size_t header_length, void *data,
                                  size_t length, const ucp_am_recv_param_t *param)
{
    td_xfer_t *x = arg;
    am_ack_hdr_t h;
    ucp_ep_h ep = xfer_am_reply_ep(param);
    if (!xfer_am_unpack(x, header, header_length, &h, sizeof h, false))
        return UCS_OK;
    xfer_lease_t *l = xfer_lease_find(x, h.lease_id);
    if (l && l->state == LEASE_DEAD && l->put_writer && ep && l->put_writer == conn_of_ep(x, ep)) {
        l->put_writer = NULL;
        xfer_lease_try_release(x, l);
    }
    return UCS_OK;
}
