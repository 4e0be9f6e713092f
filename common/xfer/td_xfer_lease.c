/*
 * td_xfer leases (receiver): a lease reserves pool blocks for one request's KV; this file
 * creates and cancels them, finds them by id, and kills them, returning their blocks only
 * once nothing can write into them any more (the fence).
 */
#include "td_xfer_int.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "td_log.h"
#include "td_util.h"

xfer_lease_t *xfer_lease_find(td_xfer_t *x, uint64_t id)
{
    td_hash_slot_t *e = td_hash_find(&x->lease_ids, id);
    return e ? (xfer_lease_t *)(uintptr_t)e->value : NULL;
}

void xfer_lease_remove(td_xfer_t *x, xfer_lease_t *l)
{
    td_hash_remove(&x->lease_ids, l->id, (uintptr_t)l);
    td_list_remove(&l->link);
    x->stats.leases_live--;
    free(l);
}

/* A device pool's lease gives its landing blocks back (at release or adoption). */
void xfer_landing_give(td_xfer_t *x, xfer_lease_t *l)
{
    for (int32_t i = 0; i < l->n_blocks; i++)
        x->landing_stack[x->stats.landing_free++] = l->blocks[i];
}

/* The one place blocks of a lease go back to the pool. Only once no receive writes. */
void xfer_lease_release(td_xfer_t *x, xfer_lease_t *l)
{
    TD_ASSERT(l->inflight == 0);
    if (l->dev)
        xfer_landing_give(x, l);
    td_kv_unref_blocks_for(x->pool.kv, TD_KV_HOLDER_LEASE, l->dev ? l->dev : l->blocks, l->n_blocks);
    xfer_lease_remove(x, l);
}

/* Returns a dead lease's blocks once nothing can write into them: no rendezvous receive
 * in flight and no put writer still bound. True when l was freed. */
bool xfer_lease_try_release(td_xfer_t *x, xfer_lease_t *l)
{
    if (l->state != LEASE_DEAD || l->inflight > 0 || l->put_writer)
        return false;
    xfer_lease_release(x, l);
    return true;
}

/* Kills a lease: its blocks return now, or when the last receive into them ends (the
 * writer's endpoint is force-closed so that happens promptly), or, when a sender bound
 * for puts may still be writing, once it confirms the abort (quarantine). An adoption in
 * progress stops where it is, and its sender, which sent kv-ready and waits for the
 * answer, is told `verdict`. l may be freed. */
void xfer_lease_fail(td_xfer_t *x, xfer_lease_t *l, td_status_t verdict)
{
    if (l->state == LEASE_DEAD)
        return;
    if (l->state == LEASE_ADOPTING) {
        td_list_remove(&l->adopt_link);
        xfer_send_ack(x, l->ready_ep, l->ready.request_id, l->id, verdict);
    }
    l->state = LEASE_DEAD;
    if (l->put_writer) {
        x->stats.leases_quarantined++;
        l->quarantine_ns = td_now_ns() + (uint64_t)x->cfg.quarantine_ms * 1000000ull;
        xfer_send_ctl(x, l->put_writer->ep, AM_ABORT, l->request_id, l->id, TD_ERR_STALE);
    }
    if (xfer_lease_try_release(x, l))
        return;
    if (l->inflight > 0 && l->writer && !l->writer->closing) {
        td_warn("xfer lease %" PRIu64 " died with %u receives in flight: closing its sender's endpoint",
                l->id, l->inflight);
        l->writer->closing = true;
        xfer_close_ep_force(x, l->writer->ep);
    }
}

/* A lease ended from outside (expiry, cancel, its sender lost, a refused kv-ready): an
 * adoption in progress answers STALE, as a kv-ready arriving after the death would. */
void xfer_lease_kill(td_xfer_t *x, xfer_lease_t *l)
{
    xfer_lease_fail(x, l, TD_ERR_STALE);
}

/* A fresh token: 128 bits of the kernel's CSPRNG (getrandom(2), never blocking once the
 * pool is initialised at boot). Why random and not an HMAC of the lease id under the
 * cluster secret: the receiver keeps each lease's state anyway (16 more bytes), a random
 * token needs no key in the data plane, works the same with no cluster secret set (tandem
 * local, tests), and one lease's token says nothing about another's. */
static td_status_t token_make(td_xfer_token_t *t)
{
    size_t got = 0;
    while (got < sizeof t->b) {
        ssize_t n = getrandom(t->b + got, sizeof t->b - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return td_errorf(TD_ERR_IO, "xfer lease: getrandom: %s", strerror(errno));
        got += (size_t)n;
    }
    return TD_OK;
}

td_status_t td_xfer_lease_create(td_xfer_t *x, uint64_t request_id, int32_t n_blocks, uint32_t ttl_ms,
                                 int32_t *blocks_out, uint64_t *lease_id_p, td_xfer_token_t *token_p)
{
    if (!x->have_pool || !x->pool.kv)
        return td_errorf(TD_ERR_INVALID, "xfer lease: no pool or no block manager registered");
    bool dev = x->dev_base != NULL;
    uint32_t pool_blocks = dev ? x->dev_n_blocks : x->pool.n_blocks;
    if (n_blocks <= 0 || (uint32_t)n_blocks > pool_blocks || (uint32_t)n_blocks > x->pool.n_blocks || ttl_ms == 0)
        return td_errorf(TD_ERR_INVALID, "xfer lease: n_blocks %d (pool %u, landing %u) ttl_ms %u out of range",
                         n_blocks, pool_blocks, dev ? x->pool.n_blocks : pool_blocks, ttl_ms);
    if (dev && (uint32_t)n_blocks > x->stats.landing_free)
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "xfer lease: %d landing blocks requested, %u free", n_blocks,
                               x->stats.landing_free);
    td_xfer_token_t token;
    td_status_t st = token_make(&token);
    if (st != TD_OK)
        return st;
    xfer_lease_t *l = calloc(1, sizeof *l + (size_t)n_blocks * (dev ? 2 : 1) * sizeof(int32_t));
    uint64_t id = x->next_lease_id + 1;
    if (!l || td_hash_put(&x->lease_ids, id, (uintptr_t)l) != TD_OK) {
        free(l);
        return td_errorf(TD_ERR_NOMEM, "xfer lease: out of memory");
    }
    st = td_kv_alloc_blocks_for(x->pool.kv, TD_KV_HOLDER_LEASE, n_blocks, dev ? l->blocks + n_blocks : l->blocks);
    if (st != TD_OK) {
        td_hash_remove(&x->lease_ids, id, (uintptr_t)l);
        free(l);
        return st; /* EXHAUSTED is not logged: the scheduler decides */
    }
    if (dev) {
        l->dev = l->blocks + n_blocks;
        for (int32_t i = 0; i < n_blocks; i++)
            l->blocks[i] = x->landing_stack[--x->stats.landing_free];
    }
    l->id = x->next_lease_id = id;
    l->request_id = request_id;
    l->token = token;
    l->n_blocks = n_blocks;
    l->deadline_ns = td_now_ns() + (uint64_t)ttl_ms * 1000000ull;
    l->state = LEASE_LIVE;
    td_list_push_back(&x->leases, &l->link);
    x->stats.leases_live++;
    x->stats.leases_created++;
    memcpy(blocks_out, l->blocks, (size_t)n_blocks * sizeof(int32_t));
    *lease_id_p = l->id;
    *token_p = token;
    return TD_OK;
}

td_status_t td_xfer_lease_cancel(td_xfer_t *x, uint64_t lease_id)
{
    xfer_lease_t *l = xfer_lease_find(x, lease_id);
    if (!l || l->state == LEASE_DEAD) /* an adoption in progress stops: the request went */
        return td_errorf_quiet(TD_ERR_STALE, "xfer lease %" PRIu64 " is not live", lease_id);
    x->stats.leases_cancelled++;
    xfer_lease_kill(x, l);
    return TD_OK;
}
