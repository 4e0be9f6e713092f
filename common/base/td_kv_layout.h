/*
 * td_kv_layout: the one description of how KV-cache bytes are laid out, shared by the
 * engine, every kernel backend, the KV block manager and the transfer layer.
 *
 * The pool is layer-major so that one layer's blocks are contiguous and runs of adjacent
 * block ids coalesce into one transfer:
 *
 *   pool[n_layers][n_blocks][2 (K, V)][block_size][n_kv_heads][head_dim]   (dtype)
 *
 * K of block b in layer l starts at element ((l * n_blocks + b) * 2 + 0) * block_elems,
 * V at ((l * n_blocks + b) * 2 + 1) * block_elems, with block_elems =
 * block_size * n_kv_heads * head_dim. A token at position p of a sequence lives in block
 * block_table[p / block_size], row p % block_size. Nodes exchange a td_kv_layout_t (without
 * n_blocks, which is each node's own) and refuse to move blocks when any field differs.
 */
#ifndef TD_KV_LAYOUT_H
#define TD_KV_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "td_dtype.h"
#include "td_status.h"

#define TD_KV_LAYOUT_VERSION 1u

typedef struct td_kv_layout {
    uint64_t model_fingerprint; /* td_model_fingerprint() of the weights' shapes and config */
    uint32_t dtype;             /* td_dtype_t of K and V elements */
    uint32_t block_size;        /* tokens per block */
    uint32_t n_layers;
    uint32_t n_kv_heads;
    uint32_t head_dim;
    uint32_t version;           /* TD_KV_LAYOUT_VERSION */
} td_kv_layout_t;

/* Elements of K (or of V) in one block of one layer. */
static inline size_t td_kv_block_elems(const td_kv_layout_t *l)
{
    return (size_t)l->block_size * l->n_kv_heads * l->head_dim;
}

/* Bytes of K+V of one block in one layer (the unit of a transfer). */
static inline size_t td_kv_block_bytes(const td_kv_layout_t *l)
{
    return 2 * td_kv_block_elems(l) * td_dtype_size((td_dtype_t)l->dtype);
}

/* Byte offset of block `b` of layer `layer` (its K; V follows K) in a pool of n_blocks. */
static inline size_t td_kv_block_offset(const td_kv_layout_t *l, uint32_t n_blocks, uint32_t layer,
                                        uint32_t b)
{
    return ((size_t)layer * n_blocks + b) * td_kv_block_bytes(l);
}

/* Bytes of a whole pool of n_blocks. */
static inline size_t td_kv_pool_bytes(const td_kv_layout_t *l, uint32_t n_blocks)
{
    return (size_t)l->n_layers * n_blocks * td_kv_block_bytes(l);
}

/*
 * Compares two layouts. TD_OK when they are the same; otherwise TD_ERR_MISMATCH with a
 * message in `why` (if non-NULL) naming the first differing field and both values, e.g.
 * "kv layout mismatch: head_dim 128 here, 64 at peer". Does not log.
 */
td_status_t td_kv_layout_compare(const td_kv_layout_t *here, const td_kv_layout_t *peer, char *why,
                                 size_t why_cap);

/* Checks that every field is in range (dtype known, sizes > 0, version known). */
td_status_t td_kv_layout_validate(const td_kv_layout_t *l);

#endif /* TD_KV_LAYOUT_H */
