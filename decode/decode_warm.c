/*
 * decode_warm: the decode node's KV pool made resident in the background (decode_state.h).
 *
 * The pool UCX allocates is made resident before the node registers so that no loop, the
 * node's or a sender's writing through shared memory, ever pays its page faults (issue 12).
 * All of it at once made start-up as long as the pool was large (seconds per GiB on a fresh
 * VM). Now registration makes the first DECODE_RESIDENT_AT_START bytes resident; this
 * thread does the rest, DECODE_WARM_CHUNK bytes at a time, and only then hands each chunk's
 * blocks to the block manager, so every block a lease or a sequence can get is resident.
 * Until it is done the node serves with a smaller pool: a request that does not fit waits
 * for blocks (decode_sched), none is dropped.
 */
#include "decode_state.h"

#include "td_log.h"
#include "td_util.h"

#define DECODE_WARM_CHUNK ((size_t)64 << 20)

uint32_t decode_warm_resident(const td_kv_layout_t *layout, uint32_t n_blocks)
{
    size_t per_block = td_kv_pool_bytes(layout, 1);
    size_t n = per_block ? DECODE_RESIDENT_AT_START / per_block : n_blocks;
    return (uint32_t)TD_MAX((size_t)1, TD_MIN(n, (size_t)n_blocks));
}

static void *warm_main(void *arg)
{
    decode_warm_t *w = arg;
    uint32_t b = w->from;
    while (b < w->to && !atomic_load(&w->stop)) {
        uint32_t e = b + TD_MIN(w->chunk, w->to - b);
        if (td_xfer_pool_populate(w->xfer, b, e) != TD_OK) {
            td_warn("decode %s: KV blocks %u and up cannot be made resident (%s): serving with %u of %u blocks",
                    w->node_id, b, td_last_error(), b, w->to);
            return NULL;
        }
        td_kv_unhold(w->kv, (int32_t)e);
        b = e;
    }
    if (b == w->to)
        td_info("decode %s: the whole KV pool (%u blocks) resident %.2f s after start-up", w->node_id, w->to,
                (double)(td_now_ns() - w->t0) * 1e-9);
    return NULL;
}

td_status_t decode_warm_start(decode_state_t *s, uint32_t resident, uint32_t n_blocks)
{
    if (resident >= n_blocks)
        return TD_OK;
    td_status_t st = td_kv_hold(s->kv, (int32_t)resident);
    if (st != TD_OK)
        return st;
    decode_warm_t *w = &s->warm;
    size_t per_block = td_kv_pool_bytes(&s->layout, 1);
    w->xfer = s->xfer;
    w->kv = s->kv;
    w->node_id = s->proc.cfg.node_id;
    w->from = resident;
    w->to = n_blocks;
    w->chunk = (uint32_t)TD_MAX((size_t)1, DECODE_WARM_CHUNK / TD_MAX(per_block, (size_t)1));
    w->t0 = td_now_ns();
    atomic_store(&w->stop, false);
    int e = pthread_create(&w->thread, NULL, warm_main, w);
    if (e != 0) { /* serve with what is resident */
        td_warn("decode %s: cannot start the KV pool's warm-up thread (error %d): serving with %u of %u blocks",
                w->node_id, e, resident, n_blocks);
        return TD_OK;
    }
    w->started = true;
    td_info("decode %s: KV pool: %u of %u blocks resident now, the rest on a background thread", w->node_id,
            resident, n_blocks);
    return TD_OK;
}

void decode_warm_stop(decode_state_t *s)
{
    decode_warm_t *w = &s->warm;
    if (!w->started)
        return;
    atomic_store(&w->stop, true);
    pthread_join(w->thread, NULL);
    w->started = false;
}
