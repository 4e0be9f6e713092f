/*
 * td_node_client: the node side of the router's registry protocol, shared by prefill
 * and decode nodes. Registers the node (RegisterNode), then heartbeats its load on a timer
 * at the interval the router asks for. When the router is unreachable, a call fails, or the
 * router answers "reregister" (it restarted), the client drops its channel and registers
 * again after retry_ms, forever, until closed: nodes and routers may start in any order.
 * Losing a registration is said to the node (config.forgotten): the router fails or moves
 * every request it gave the node under it, so the node drops what it still runs for them.
 * A router given by name (router_host not an IP address: a Kubernetes Service, a DNS
 * entry) is looked up (uv_getaddrinfo, off the loop) before every new channel.
 *
 * Threads: the node's loop thread. The load callback runs there too.
 */
#ifndef TD_NODE_CLIENT_H
#define TD_NODE_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "td_auth.h"
#include "td_node_info.h"
#include "td_kv_layout.h"
#include "td_status.h"

typedef struct td_node_client td_node_client_t;

/* The node lost its registration, and with it every request the router gave it under it:
 * the router has failed or moved them, or will (docs/cluster.md "A node the router
 * dropped"), and reads none of their tokens. `why` is a sentence for the node's log. */
typedef void (*td_node_forgotten_cb)(void *data, const char *why);

typedef struct td_node_client_config {
    const char *router_host;     /* the router's control address */
    uint16_t router_port;
    td_node_info_t info;     /* id, role, model, layout, control address, capacity, the
                                    model's vocab_size (0 = not told) */
    const void *xfer_desc;       /* decode nodes: td_xfer_describe() bytes (copied); else NULL */
    size_t xfer_desc_len;
    uint32_t max_seq_len;        /* the model's length (registered as info.max_seq_len when
                                    that is 0) */
    uint32_t max_prefill_tokens; /* token budget per step (a prefill node's batch; a decode or
                                    unified node's decodes and prompt chunks) */
    uint32_t rpc_timeout_ms;     /* bound of each RegisterNode / Heartbeat call */
    uint32_t retry_ms;           /* wait before registering again after a failure */
    td_auth_cluster_t *cluster;  /* the cluster secret every call is signed with; NULL: none
                                    (borrowed: outlives the client) */
    /* Called (loop thread, with the load callback's data) once per registration lost: a
       heartbeat answered "reregister" (the router dropped the node: silent past its heartbeat
       timeout, its channel or Steps stream failed), before the client registers again; or a
       call of a registered client failed (a router restart, a lost connection, a heartbeat
       past rpc_timeout_ms), where the client lets the registration go, never heartbeats it
       again, so the router drops it within its heartbeat timeout if it has not. Not while
       closing, not for a registration attempt that failed. NULL: not told. */
    td_node_forgotten_cb forgotten;
} td_node_client_config_t;

/* Fills *load with the node's current load (called before every heartbeat). */
typedef void (*td_node_load_cb)(void *data, td_node_load_t *load);

/*
 * Starts registering at once. Errors: TD_ERR_INVALID, TD_ERR_NOMEM (nothing started).
 */
td_status_t td_node_client_create(uv_loop_t *loop, const td_node_client_config_t *cfg,
                                      td_node_load_cb load_cb, void *data,
                                      td_node_client_t **c_p);

/*
 * The node drains: every heartbeat from now on says so (Load.draining), the next one is sent
 * at once (or as soon as the call in flight ends), and a node that loses its registration
 * does not register again (it only finishes what it runs). NULL is a no-op.
 */
void td_node_client_drain(td_node_client_t *c);

/* True once the router heard the drain (a heartbeat saying so succeeded), or when there is
 * no router to tell (not registered, or NULL). */
bool td_node_client_drain_told(const td_node_client_t *c);

/* The address the client reaches the router at (the IP of --router, or what its name last
 * resolved to) into *addr_p (port 0); false before a name resolved. */
bool td_node_client_router_ip(const td_node_client_t *c, struct sockaddr_storage *addr_p);

/* True while the last RegisterNode/Heartbeat succeeded. */
bool td_node_client_registered(const td_node_client_t *c);

/* Stops timers and calls; the client is freed once its handles closed (run the loop). */
void td_node_client_close(td_node_client_t *c);

#endif /* TD_NODE_CLIENT_H */
