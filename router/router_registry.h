/*
 * router_registry: the router's table of nodes. Each node registers with its identity
 * (id, role, model, KV layout, address, capacity), then reports its load in heartbeats
 * (queued prefill tokens, running sequences, free KV blocks, recent step time). A node
 * whose last heartbeat is older than the configured bound is down and is not chosen; a
 * later heartbeat or a new registration with the same id brings it back. The id of a live
 * node is its own: a registration under it is refused (router_registry_join).
 *
 * Time is always passed in ("now", nanoseconds on any monotonic clock) so the owner's
 * event loop and the tests decide what time it is; the registry never reads a clock.
 *
 * Per node the registry keeps a bounded set of the block hashes (td_kv_chain_hashes)
 * of prompts recently prefilled there, oldest forgotten first: the router's guess of what that
 * node's prefix cache holds, used by router_policy to favour cache hits.
 *
 * Threads: one thread (the router's loop) uses a registry. No I/O.
 */
#ifndef ROUTER_REGISTRY_H
#define ROUTER_REGISTRY_H

#include <stdbool.h>
#include <stdint.h>

#include "td_kv_layout.h"
#include "td_node_info.h"
#include "td_status.h"

/* Sanity bounds of a registration (a node beyond them is refused, not believed). */
#define ROUTER_MAX_BATCH 65536          /* capacity.max_batch */
#define ROUTER_MAX_VOCAB (1 << 24)      /* capacity.vocab_size: 16M ids (Gemma: 256k) */
#define ROUTER_MAX_SEQ_LEN (1 << 26)    /* capacity.max_seq_len: 64M tokens */

typedef struct router_node {
    td_node_info_t info;
    td_node_load_t load;  /* last heartbeat plus the router's own assignments since */
    int64_t last_heartbeat_ns;
    bool up;
    uint64_t generation;      /* bumped at every (re)registration */
    struct router_prefix_set *prefix; /* recent block hashes of prompts it prefilled, private */
} router_node_t;

typedef struct router_registry_config {
    int32_t max_nodes;             /* registered nodes at most (1024) */
    int64_t heartbeat_timeout_ns;  /* silence after which a node is down (3 s) */
    int32_t prefix_hashes;         /* block hashes remembered per node (8192) */
} router_registry_config_t;

router_registry_config_t router_registry_config_default(void);

typedef struct router_registry router_registry_t;

/* Errors: TD_ERR_INVALID (a limit <= 0), TD_ERR_NOMEM. */
td_status_t router_registry_create(const router_registry_config_t *cfg, router_registry_t **reg_p);
void router_registry_destroy(router_registry_t *reg);

/*
 * Checks a registration on its own: id and model non-empty printable ASCII without spaces,
 * role PREFILL or DECODE, control address non-empty, layout valid (td_kv_layout_validate),
 * capacity_blocks >= 1, max_batch 1 .. ROUTER_MAX_BATCH, vocab_size 0 .. ROUTER_MAX_VOCAB,
 * max_seq_len 0 .. ROUTER_MAX_SEQ_LEN. TD_ERR_INVALID (quiet) with a message naming the
 * field and its value; router_registry_join calls it first.
 */
td_status_t router_registry_validate(const td_node_info_t *info);

/*
 * Registers a node (or re-registers one with the same id whose old registration is no
 * longer live: its info is replaced, it is up, its load is reset and its remembered prefix
 * hashes are forgotten, since a restarted node has an empty cache). An id held by a LIVE
 * node (up and heard from within the timeout) is refused: a second process under that id
 * must not take over the live node's slot (and end its work); a restarted node gets in once
 * its old registration is dropped (silence, a failed channel or stream). The load starts as
 * "idle with capacity_blocks free". *index_p (may be NULL) receives its index, stable until
 * it leaves. Nodes of one model must agree on its vocabulary: a node whose vocab_size
 * differs from that of another live node of the same model (both known, i.e. > 0) is
 * refused, the message naming both nodes and sizes.
 * Errors (quiet, the RPC edge reports them): TD_ERR_INVALID (router_registry_validate, a
 * vocabulary that differs), TD_ERR_BUSY (the id is a live node's: ALREADY_EXISTS on the
 * wire), TD_ERR_EXHAUSTED (max_nodes reached), TD_ERR_NOMEM.
 */
td_status_t router_registry_join(router_registry_t *reg, const td_node_info_t *info,
                                 int64_t now_ns, int32_t *index_p);

/* Removes a node. TD_ERR_NOT_FOUND (quiet) when unknown. Indexes of others are unchanged. */
td_status_t router_registry_leave(router_registry_t *reg, const char *id);

/* Records a heartbeat: load replaced, node up. TD_ERR_NOT_FOUND (quiet) when the id never
 * registered (the node must register again, e.g. after a router restart). */
td_status_t router_registry_heartbeat(router_registry_t *reg, const char *id,
                                      const td_node_load_t *load, int64_t now_ns);

/* Marks down every node silent for longer than the timeout; returns how many went down
 * now. The policy also treats such nodes as down without this call. */
int32_t router_registry_expire(router_registry_t *reg, int64_t now_ns);

/* True when the node is up and heard from within the timeout at now_ns. */
bool router_registry_is_live(const router_registry_t *reg, int32_t index, int64_t now_ns);

/* Slots: indexes 0..router_registry_slots()-1; router_registry_node() is NULL for an empty
 * slot. The pointer is valid until the next join/leave. */
int32_t router_registry_slots(const router_registry_t *reg);
router_node_t *router_registry_node(router_registry_t *reg, int32_t index);
const router_node_t *router_registry_node_const(const router_registry_t *reg, int32_t index);
/* Index of a node by id, or -1. */
int32_t router_registry_find(const router_registry_t *reg, const char *id);

/* Remembers block hashes as present in a node's prefix cache (oldest forgotten first). */
void router_registry_note_prefix(router_registry_t *reg, int32_t index, const uint64_t *hashes,
                                 int32_t n);

/* How many leading hashes of hashes[0..n) the node is believed to hold (a chain: the first
 * absent one ends the match). 0 for a node without remembered hashes. */
int32_t router_registry_prefix_match(const router_registry_t *reg, int32_t index,
                                     const uint64_t *hashes, int32_t n);

const router_registry_config_t *router_registry_config(const router_registry_t *reg);

#endif /* ROUTER_REGISTRY_H */
