/*
 * td_node_copier: td_xfer's device-to-host copier on a td_backend (see the header).
 */
#include "td_node_copier.h"

static td_status_t copier_start(void *arg, void *dst, const void *src, size_t bytes, td_xfer_wake_cb wake,
                                void *wake_arg, uint64_t *ticket_p)
{
    td_backend_t *be = arg;
    return be->ops->copy_d2h_start(be, dst, src, bytes, wake, wake_arg, ticket_p);
}

static td_status_t copier_poll(void *arg, uint64_t ticket)
{
    td_backend_t *be = arg;
    return be->ops->copy_poll(be, ticket);
}

static void copier_quiesce(void *arg)
{
    td_backend_t *be = arg;
    be->ops->copy_quiesce(be);
}

static td_status_t copier_pin(void *arg, void *host, size_t bytes)
{
    td_backend_t *be = arg;
    return be->ops->host_pin(be, host, bytes);
}

static void copier_unpin(void *arg, void *host)
{
    td_backend_t *be = arg;
    be->ops->host_unpin(be, host);
}

td_xfer_copier_t td_node_copier(td_backend_t *be)
{
    return (td_xfer_copier_t){
        .start = copier_start, .poll = copier_poll, .quiesce = copier_quiesce, .pin = copier_pin, .unpin = copier_unpin, .arg = be};
}
