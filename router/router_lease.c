/*
 * router_lease: the lease map. A request that holds a decode node's lease (Admit answered)
 * is found by (decode node, lease id) when that node's StepBatch entries arrive, without a
 * scan; releasing a lease tells the decode node (Release) and forgets it here.
 *
 * The map is a td_hash from the pair folded into 64 bits to the request (its address); the
 * fold may collide, so a find checks the request's own fields. Only requests on a node hold
 * a lease, at most max-active of them: the table, made with room for that many, never
 * grows, so setting a lease cannot fail.
 */
#include "router_int.h"

#include <stdint.h>

#include "td_util.h"

static uint64_t lease_key(int32_t decode, uint64_t lease)
{
    return lease ^ ((uint64_t)(uint32_t)decode << 40);
}

void router_lease_set(router_req_t *r, uint64_t lease)
{
    router_state_t *s = r->s;
    TD_ASSERT(!r->have_lease);
    r->lease_id = lease;
    r->have_lease = true;
    r->decode_tokens = 0;
    td_status_t st = td_hash_put(&s->leases, lease_key(r->pick.pair.decode, lease), (uintptr_t)r);
    TD_ASSERT(st == TD_OK); /* sized for max-active at startup: it does not grow */
}

/* The lease is gone (released, finished, or its node lost): its step entries are ignored. */
void router_lease_forget(router_req_t *r)
{
    router_state_t *s = r->s;
    if (!r->have_lease)
        return;
    r->have_lease = false;
    bool found = td_hash_remove(&s->leases, lease_key(r->pick.pair.decode, r->lease_id), (uintptr_t)r);
    TD_ASSERT(found);
}

router_req_t *router_lease_find(router_state_t *s, int32_t decode, uint64_t gen, uint64_t lease)
{
    td_hash_slot_t *e = td_hash_find(&s->leases, lease_key(decode, lease));
    for (; e; e = td_hash_find_next(&s->leases, e)) {
        router_req_t *r = (router_req_t *)(uintptr_t)e->value;
        if (r->lease_id == lease && r->pick.pair.decode == decode && r->decode_gen == gen)
            return r;
    }
    return NULL;
}

static void on_release_done(td_grpc_client_call_t *c, td_grpc_code_t code, const char *msg, void *data) {}

void router_lease_release(router_req_t *r, Tandem__Control__V1__ReleaseRequest__Reason why)
{
    router_state_t *s = r->s;
    if (!r->have_lease)
        return;
    router_lease_forget(r);
    int32_t d = r->pick.pair.decode;
    const router_node_t *n = router_registry_node_const(s->reg, d);
    if (!n || s->peers[d].generation != r->decode_gen || !s->peers[d].ch)
        return;
    Tandem__Control__V1__ReleaseRequest q = TANDEM__CONTROL__V1__RELEASE_REQUEST__INIT;
    q.lease_id = r->lease_id;
    q.request_id = r->id;
    q.reason = why;
    td_grpc_call_opts_t o = {.response_desc = &tandem__control__v1__release_response__descriptor,
                             .on_done = on_release_done, .timeout_ms = (uint32_t)s->cfg.rpc_timeout_ms};
    td_grpc_channel_call(s->peers[d].ch, "/tandem.control.v1.DecodeNode/Release", &q.base, &o, NULL);
}

