/*
 * td_xfer peers (sender): an endpoint per receiver, made by td_xfer_connect from the
 * receiver's description, wired up by HELLO/HELLO_ACK, where put or active messages is
 * chosen, and failed with all its sends when the receiver is lost.
 */
#include "td_xfer_int.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_log.h"

void xfer_peer_fail(td_xfer_peer_t *peer, td_status_t st)
{
    td_xfer_t *x = peer->x;
    if (peer->alive) {
        peer->alive = false;
        xfer_close_ep_force(x, peer->ep);
    }
    TD_LIST_FOREACH(n, &peer->sends) {
        td_xfer_send_t *s = TD_CONTAINER_OF(n, td_xfer_send_t, peer_link);
        xfer_send_set_status(s, st);
    }
    /* Queued operations of this peer never reach UCX. */
    TD_LIST_FOREACH_SAFE(n, &x->queue) {
        send_op_t *op = TD_CONTAINER_OF(n, send_op_t, link);
        if (op->s->peer == peer) {
            td_list_remove(&op->link);
            op->s->ops_out--;
            xfer_send_maybe_done(op->s);
            free(op);
        }
    }
    TD_LIST_FOREACH(m, &peer->sends)
        xfer_send_maybe_done(TD_CONTAINER_OF(m, td_xfer_send_t, peer_link));
}

static void peer_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    td_xfer_peer_t *peer = arg;
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &peer->ip, ip, sizeof ip);
    td_warn("xfer peer %s:%u lost: %s", ip, peer->port, ucs_status_string(status));
    xfer_peer_fail(peer, TD_ERR_UNAVAILABLE);
}

td_xfer_peer_t *xfer_peer_of_param(td_xfer_t *x, const ucp_am_recv_param_t *param)
{
    ucp_ep_h ep = xfer_am_reply_ep(param);
    return ep ? xfer_peer_of_ep(x, ep) : NULL;
}

/* True when the endpoint's RMA lanes are a native RDMA transport (not TCP's AM emulation,
 * not shared memory, which is judged by whether the rkey maps the pool). */
static bool ep_rma_is_rdma(ucp_ep_h ep, char *lanes, size_t cap)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return false;
    ucp_ep_print_info(ep, f);
    fclose(f);
    bool rdma = false;
    lanes[0] = 0;
    for (char *line = strtok(buf, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strstr(line, "rma"))
            continue;
        if (!lanes[0])
            snprintf(lanes, cap, "%s", line + strspn(line, " #"));
        if (strstr(line, "rc_") || strstr(line, "dc_") || strstr(line, "ud_") || strstr(line, "mlx") ||
            strstr(line, "gga"))
            rdma = true;
    }
    free(buf);
    return rdma;
}

/* At hello (the endpoint is wired up): put or AM for this peer. */
static void peer_decide(td_xfer_t *x, td_xfer_peer_t *peer)
{
    char ip[INET_ADDRSTRLEN];
    char lanes[160] = "";
    inet_ntop(AF_INET, &peer->ip, ip, sizeof ip);
    peer->use_put = false;
    if (x->cfg.rma == TD_XFER_RMA_AM)
        goto out;
    ucs_status_t st = ucp_ep_rkey_unpack(peer->ep, peer->rkey_buf, &peer->rkey);
    if (st != UCS_OK) {
        peer->rkey = NULL;
        td_warn("xfer peer %s:%u: rkey unusable (%s): kv goes by active messages", ip, peer->port,
                ucs_status_string(st));
        goto out;
    }
    void *mapped = NULL;
    bool shm = ucp_rkey_ptr(peer->rkey, peer->base, &mapped) == UCS_OK;
    bool rdma = ep_rma_is_rdma(peer->ep, lanes, sizeof lanes);
    peer->use_put = x->cfg.rma == TD_XFER_RMA_PUT || shm || rdma;
    if (peer->use_put && shm) {
        /* Not faulted in ahead: the receiver made its pages resident at startup, and each
         * copy maps the pages it writes (a minor fault per 4 KiB page, about as much again
         * as the copy itself, inside the per-iteration budget). Faulting in the whole mapping
         * here cost 1.5 s of the loop for a 2 GiB pool (issue 12), and on a thread it still
         * took 0.4 s of CPU per 2 GiB from the first request's prefill (TTFT 1.7-2.4 s on an
         * 8 GiB pool); lazily, only the pages used are paid for, a few per request. */
        peer->mapped = mapped;
    }
out:
    td_info("xfer peer %s:%u: kv by %s (rma %s%s%s)", ip, peer->port, peer->use_put ? "put" : "active messages",
            x->cfg.rma == TD_XFER_RMA_AUTO ? "auto" : x->cfg.rma == TD_XFER_RMA_PUT ? "put" : "am",
            lanes[0] ? ", " : "", lanes);
}

td_xfer_peer_t *xfer_peer_of_ep(td_xfer_t *x, ucp_ep_h ep)
{
    TD_LIST_FOREACH(n, &x->peers) {
        td_xfer_peer_t *p = TD_CONTAINER_OF(n, td_xfer_peer_t, link);
        if (p->alive && p->ep == ep)
            return p;
    }
    return NULL;
}

ucs_status_t xfer_am_hello_ack_cb(void *arg, const void *header, size_t header_length, void *data,
                                  size_t length, const ucp_am_recv_param_t *param)
{
    td_xfer_t *x = arg;
    am_ack_hdr_t h;
    if (!xfer_am_unpack(x, header, header_length, &h, sizeof h, false))
        return UCS_OK;
    TD_LIST_FOREACH(n, &x->peers) {
        td_xfer_peer_t *p = TD_CONTAINER_OF(n, td_xfer_peer_t, link);
        if (p->cookie == h.request_id && p->alive && !p->hello_done) {
            if (h.status != TD_OK) {
                xfer_peer_fail(p, TD_ERR_UNAVAILABLE);
                return UCS_OK;
            }
            p->hello_done = true;
            peer_decide(x, p);
        }
    }
    return UCS_OK;
}

td_status_t td_xfer_connect(td_xfer_t *x, const void *desc, size_t desc_len, const td_kv_layout_t *mine,
                            td_xfer_peer_t **peer_p)
{
    xfer_desc_wire_t w;
    if (desc_len < sizeof w)
        return td_errorf(TD_ERR_FORMAT, "xfer connect: description of %zu bytes is too short", desc_len);
    memcpy(&w, desc, sizeof w);
    if (w.magic != XFER_DESC_MAGIC || desc_len != sizeof w + w.rkey_len)
        return td_errorf(TD_ERR_FORMAT, "xfer connect: not a tandem xfer description (magic %08x, %zu bytes)",
                         w.magic, desc_len);
    char why[160];
    if (td_kv_layout_compare(mine, &w.layout, why, sizeof why) != TD_OK) {
        x->stats.fail_mismatch++;
        return td_errorf(TD_ERR_MISMATCH, "xfer connect: %s; refusing to send KV to this node", why);
    }
    TD_LIST_FOREACH(n, &x->peers) {
        td_xfer_peer_t *p = TD_CONTAINER_OF(n, td_xfer_peer_t, link);
        if (p->alive && p->ip == w.ip && p->port == w.port) {
            p->layout = w.layout;
            p->n_blocks = w.n_blocks;
            *peer_p = p;
            return TD_OK;
        }
    }
    td_xfer_peer_t *p = calloc(1, sizeof *p);
    void *rkey_buf = malloc(w.rkey_len ? w.rkey_len : 1);
    if (!p || !rkey_buf) {
        free(p);
        free(rkey_buf);
        return td_errorf(TD_ERR_NOMEM, "xfer connect: out of memory");
    }
    memcpy(rkey_buf, (const char *)desc + sizeof w, w.rkey_len);
    p->rkey_buf = rkey_buf;
    p->rkey_len = w.rkey_len;
    p->base = w.base;
    p->cookie = ++x->next_cookie;
    p->x = x;
    p->ip = w.ip;
    p->port = w.port;
    p->layout = w.layout;
    p->n_blocks = w.n_blocks;
    td_list_init(&p->sends);
    struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons(w.port), .sin_addr.s_addr = w.ip};
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                          .sockaddr = {(struct sockaddr *)&sin, sizeof sin},
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {peer_err_cb, p}};
    ucs_status_t st = ucp_ep_create(x->worker, &ep, &p->ep);
    if (st != UCS_OK) {
        free(p->rkey_buf);
        free(p);
        return xfer_ucx_err(st, "connect");
    }
    p->alive = true;
    td_list_push_back(&x->peers, &p->link);
    /* Nothing else goes before the answer: UCX 1.13 mishandles larger messages pending
     * across the endpoint's wire-up reconfiguration (mm "Invalid am_short_iov length"). */
    xfer_send_ctl(x, p->ep, AM_HELLO, p->cookie, 0, TD_OK);
    *peer_p = p;
    return TD_OK;
}

bool td_xfer_peer_alive(const td_xfer_peer_t *peer)
{
    return peer->alive;
}
