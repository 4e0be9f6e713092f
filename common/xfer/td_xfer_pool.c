/*
 * td_xfer pool: the receiver's registered pool (host memory, or a device pool's host landing
 * area), made resident and mapped into UCX once, its description for senders, and the
 * block manager that leases draw from.
 */
#include "td_xfer_int.h"

#include <stdlib.h>
#include <string.h>

#include "td_log.h"
#include "td_util.h"

/* Makes blocks [b0, b1) of every layer of a pool of n_blocks at base resident (zeroed
 * where the kernel has no MADV_POPULATE_WRITE: the pool is ours, the range cannot vanish). */
static td_status_t populate_blocks(uint8_t *base, const td_kv_layout_t *l, uint32_t n_blocks, uint32_t b0,
                                   uint32_t b1, int n_threads)
{
    size_t bb = td_kv_block_bytes(l), n = (size_t)(b1 - b0) * bb;
    for (uint32_t layer = 0; layer < l->n_layers && n; layer++) {
        uint8_t *p = base + td_kv_block_offset(l, n_blocks, layer, b0);
        td_status_t st = td_mem_populate(p, n, n_threads, true);
        if (st == TD_ERR_UNSUPPORTED)
            memset(p, 0, n);
        else if (st != TD_OK)
            return st;
    }
    return TD_OK;
}

td_status_t td_xfer_pool_populate(td_xfer_t *x, uint32_t b0, uint32_t b1)
{
    if (!x->have_pool || x->dev_base || b0 > b1 || b1 > x->pool.n_blocks)
        return td_errorf(TD_ERR_INVALID, "xfer: populate blocks %u .. %u of a host pool of %u", b0, b1,
                         x->have_pool && !x->dev_base ? x->pool.n_blocks : 0);
    return populate_blocks(x->pool.base, &x->pool.layout, x->pool.n_blocks, b0, b1, 1);
}

td_status_t td_xfer_register_pool(td_xfer_t *x, const td_xfer_pool_t *pool, td_xfer_ready_cb on_ready, void *arg)
{
    if (x->have_pool)
        return td_errorf(TD_ERR_INVALID, "xfer: a pool is already registered");
    if (!x->listener)
        return td_errorf(TD_ERR_INVALID, "xfer: a receiving pool needs a listener (listen_ip)");
    bool dev = pool->mem == TD_XFER_MEM_CUDA;
    if (pool->mem != TD_XFER_MEM_HOST && !dev)
        return td_errorf(TD_ERR_INVALID, "xfer: unknown pool memory type %d", (int)pool->mem);
    if (dev && (!pool->base || !pool->copy_h2d || pool->landing_blocks == 0))
        return td_errorf(TD_ERR_INVALID, "xfer: a device pool needs its base, copy_h2d and landing_blocks");
    if (td_kv_layout_validate(&pool->layout) != TD_OK)
        return td_errorf(TD_ERR_INVALID, "xfer: %s", td_last_error());
    if (pool->n_blocks == 0)
        return td_errorf(TD_ERR_INVALID, "xfer: pool needs n_blocks");
    /* What UCX sees: the host pool, or a device pool's landing area. base NULL: UCX
     * allocates (sysv/posix segment first), which is what lets a sender on this host put
     * with a memcpy into its mapping of the pool. */
    void *ucx_base = dev ? NULL : pool->base;
    uint32_t ucx_blocks = dev ? pool->landing_blocks : pool->n_blocks;
    int32_t *stack = NULL;
    if (dev && !(stack = malloc((size_t)ucx_blocks * sizeof *stack)))
        return td_errorf(TD_ERR_NOMEM, "xfer: no memory for %u landing block ids", ucx_blocks);
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                             UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                               .address = ucx_base,
                               .length = td_kv_pool_bytes(&pool->layout, ucx_blocks),
                               .flags = ucx_base ? 0 : UCP_MEM_MAP_ALLOCATE};
    ucs_status_t st = ucp_mem_map(x->ctx, &mp, &x->memh);
    if (st != UCS_OK) {
        free(stack);
        return xfer_ucx_err(st, ucx_base ? "register pool" : dev ? "allocate landing area" : "allocate pool");
    }
    ucp_mem_attr_t ma = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
    st = ucp_mem_query(x->memh, &ma);
    if (st == UCS_OK)
        st = ucp_rkey_pack(x->ctx, x->memh, &x->rkey_buf, &x->rkey_len);
    if (st != UCS_OK) {
        ucp_mem_unmap(x->ctx, x->memh);
        free(stack);
        return xfer_ucx_err(st, "pack rkey");
    }
    if (!ucx_base) {
        /* Ours: resident now, at startup before the node registers, not page by page under
         * the first transfers (the receive path and the senders' mappings would pay it on
         * their loops): all of it, or (resident_blocks) the first blocks of every layer, the
         * caller making the rest resident with td_xfer_pool_populate before its block
         * manager hands them out. */
        uint32_t first = dev || !pool->resident_blocks ? ucx_blocks : TD_MIN(pool->resident_blocks, ucx_blocks);
        size_t bytes = td_kv_pool_bytes(&pool->layout, first);
        uint64_t t0 = td_now_ns();
        td_status_t ps = populate_blocks(ma.address, &pool->layout, ucx_blocks, 0, first,
                                         TD_MIN(td_cpu_count(), 8));
        if (ps != TD_OK) {
            td_status_t e = td_errorf(TD_ERR_NOMEM, "xfer: the %s (%zu MiB) cannot be made resident (%s): lower "
                                      "--kv-mem or --kv-blocks", dev ? "landing area" : "KV pool", bytes >> 20,
                                      td_last_error());
            ucp_rkey_buffer_release(x->rkey_buf);
            x->rkey_buf = NULL;
            ucp_mem_unmap(x->ctx, x->memh);
            x->memh = NULL;
            free(stack);
            return e;
        }
        td_info("xfer %s: %s of %zu MiB resident in %.2f s", x->name, dev ? "landing area" : "KV pool", bytes >> 20,
                (double)(td_now_ns() - t0) * 1e-9);
    }
    x->pool = *pool;
    x->pool.base = ma.address;
    x->pool.n_blocks = ucx_blocks;
    if (dev) {
        x->dev_base = pool->base;
        x->dev_n_blocks = pool->n_blocks;
        x->landing_stack = stack;
        for (uint32_t i = 0; i < ucx_blocks; i++) /* popped from the top: 0, 1, 2, ... */
            stack[i] = (int32_t)(ucx_blocks - 1 - i);
        x->stats.landing_free = ucx_blocks;
    }
    x->on_ready = on_ready;
    x->ready_arg = arg;
    x->have_pool = true;
    return TD_OK;
}

td_status_t td_xfer_describe(td_xfer_t *x, void *buf, size_t cap, size_t *len_p)
{
    if (!x->have_pool)
        return td_errorf(TD_ERR_INVALID, "xfer describe: no pool registered");
    xfer_desc_wire_t w = {.magic = XFER_DESC_MAGIC,
                          .rkey_len = (uint32_t)x->rkey_len,
                          .layout = x->pool.layout,
                          .base = (uint64_t)(uintptr_t)x->pool.base,
                          .n_blocks = x->pool.n_blocks,
                          .port = x->listen_port,
                          .ip = x->listen_ip};
    size_t need = sizeof w + x->rkey_len;
    if (need > cap)
        return td_errorf(TD_ERR_RANGE, "xfer describe: needs %zu bytes, buffer has %zu", need, cap);
    memcpy(buf, &w, sizeof w);
    memcpy((char *)buf + sizeof w, x->rkey_buf, x->rkey_len);
    *len_p = need;
    return TD_OK;
}

td_status_t td_xfer_pool_set_kv(td_xfer_t *x, td_kv_cache_t *kv)
{
    if (!x->have_pool || x->pool.kv)
        return td_errorf(TD_ERR_INVALID, "xfer: set the block manager once, after td_xfer_register_pool");
    x->pool.kv = kv;
    return TD_OK;
}

void *td_xfer_pool_base(const td_xfer_t *x)
{
    return !x->have_pool ? NULL : x->dev_base ? x->dev_base : x->pool.base;
}
