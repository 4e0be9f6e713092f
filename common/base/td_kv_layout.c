/*
 * td_kv_layout: comparison and validation of KV layout descriptors.
 */
#include "td_kv_layout.h"

#include <inttypes.h>
#include <stdio.h>

#include "td_quant.h"

_Static_assert(sizeof(td_block_q8_0_t) == TD_KV_Q8_0_BYTES && TD_QK == TD_KV_Q8_0_ELEMS,
               "td_kv_bytes's Q8_0 block is td_quant's");

td_status_t td_kv_layout_compare(const td_kv_layout_t *here, const td_kv_layout_t *peer, char *why,
                                 size_t why_cap)
{
    const char *field = NULL;
    uint64_t a = 0, b = 0;
#define CMP(f)                                  \
    if (!field && here->f != peer->f) {         \
        field = #f;                             \
        a = here->f;                            \
        b = peer->f;                            \
    }
    CMP(version)
    CMP(model_fingerprint)
    CMP(dtype)
    CMP(block_size)
    CMP(n_layers)
    CMP(n_kv_heads)
    CMP(head_dim)
#undef CMP
    if (!field)
        return TD_OK;
    if (why && why_cap) {
        if (a == here->dtype && b == peer->dtype && field[0] == 'd')
            snprintf(why, why_cap, "kv layout mismatch: dtype %s here, %s at peer",
                     td_dtype_name((td_dtype_t)a), td_dtype_name((td_dtype_t)b));
        else if (field[0] == 'm')
            snprintf(why, why_cap, "kv layout mismatch: model_fingerprint %016" PRIx64
                     " here, %016" PRIx64 " at peer (different model or config)", a, b);
        else
            snprintf(why, why_cap, "kv layout mismatch: %s %" PRIu64 " here, %" PRIu64 " at peer",
                     field, a, b);
    }
    return TD_ERR_MISMATCH;
}

td_status_t td_kv_layout_validate(const td_kv_layout_t *l)
{
    if (l->version != TD_KV_LAYOUT_VERSION)
        return td_errorf_quiet(TD_ERR_UNSUPPORTED, "kv layout version %u unknown (this build: %u)",
                               l->version, TD_KV_LAYOUT_VERSION);
    if (!td_kv_dtype_valid(l->dtype))
        return td_errorf_quiet(TD_ERR_INVALID, "kv layout dtype %u unknown", l->dtype);
    if (l->block_size == 0 || l->block_size > 1024 || l->n_layers == 0 || l->n_layers > 1024 ||
        l->n_kv_heads == 0 || l->n_kv_heads > 1024 || l->head_dim == 0 || l->head_dim > 1024)
        return td_errorf_quiet(TD_ERR_RANGE,
                               "kv layout out of range: block_size %u n_layers %u n_kv_heads %u head_dim %u",
                               l->block_size, l->n_layers, l->n_kv_heads, l->head_dim);
    if (l->head_dim % td_dtype_block_elems((td_dtype_t)l->dtype) != 0)
        return td_errorf_quiet(TD_ERR_INVALID, "kv layout: head_dim %u is not whole %s blocks of %zu",
                               l->head_dim, td_dtype_name((td_dtype_t)l->dtype),
                               td_dtype_block_elems((td_dtype_t)l->dtype));
    return TD_OK;
}
