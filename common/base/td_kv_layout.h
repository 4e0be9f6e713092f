/*
 * td_kv_layout: the one description of how KV-cache bytes are laid out, shared by the
 * engine, every kernel backend, the KV block manager and the transfer layer.
 *
 * The pool is layer-major so that one layer's blocks are contiguous and runs of adjacent
 * block ids coalesce into one transfer:
 *
 *   pool[n_layers][n_blocks][2 (K, V)][block_size][n_kv_heads][head_dim]   (dtype)
 *
 * dtype is a float type or Q8_0 (td_quant.h: blocks of 32 values with an f16 scale, as
 * llama.cpp's -ctk q8_0), whose blocks run along head_dim (a multiple of 32): each token's
 * head row is head_dim / 32 whole blocks, so every offset below is a whole number of them.
 *
 * K of block b in layer l starts at element ((l * n_blocks + b) * 2 + 0) * block_elems,
 * V at ((l * n_blocks + b) * 2 + 1) * block_elems, with block_elems =
 * block_size * n_kv_heads * head_dim. A token at position p of a sequence lives in block
 * block_table[p / block_size], row p % block_size. Nodes exchange a td_kv_layout_t (without
 * n_blocks, which is each node's own) and refuse to move blocks when any field differs.
 */
#ifndef TD_KV_LAYOUT_H
#define TD_KV_LAYOUT_H

#include <stdbool.h>
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

/* A Q8_0 block (td_quant.h td_block_q8_0_t, checked in td_kv_layout.c): its values and bytes */
#define TD_KV_Q8_0_ELEMS 32
#define TD_KV_Q8_0_BYTES 34

/* Whether KV elements may be stored as `dtype`: f32, f16, bf16 or Q8_0. */
static inline bool td_kv_dtype_valid(uint32_t dtype)
{
    return td_dtype_is_float((int)dtype) || dtype == TD_Q8_0;
}

/* Bytes of n KV elements of `dtype` (n a multiple of its block: head rows are); 0 for a
 * dtype that is not td_kv_dtype_valid or an n that is not whole blocks. Header-only (the
 * CUDA module calls it and links no td_dtype functions). */
static inline size_t td_kv_bytes(uint32_t dtype, size_t n)
{
    if (dtype == TD_Q8_0)
        return n % TD_KV_Q8_0_ELEMS == 0 ? n / TD_KV_Q8_0_ELEMS * TD_KV_Q8_0_BYTES : 0;
    return td_dtype_is_float((int)dtype) ? n * td_dtype_size((td_dtype_t)dtype) : 0;
}

/* Bytes of K+V of one block in one layer (the unit of a transfer). */
static inline size_t td_kv_block_bytes(const td_kv_layout_t *l)
{
    return 2 * td_kv_bytes(l->dtype, td_kv_block_elems(l));
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
