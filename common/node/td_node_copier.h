/*
 * td_node_copier: a backend's asynchronous device-to-host copies as td_xfer's copier
 * (td_xfer_config_t.d2h), so that a node whose KV pool is in device memory stages it
 * through td_xfer's pinned ring: copy_d2h_start / copy_poll / copy_quiesce / host_pin / host_unpin of
 * kernels/td_backend.h, one for one.
 *
 * Threads: the loop thread that owns the td_xfer (the backend's wake comes from its own).
 */
#ifndef TD_NODE_COPIER_H
#define TD_NODE_COPIER_H

#include "td_backend.h"
#include "td_xfer.h"

/* The copier for be (its arg is be): be must outlive the td_xfer that uses it. */
td_xfer_copier_t td_node_copier(td_backend_t *be);

#endif /* TD_NODE_COPIER_H */
