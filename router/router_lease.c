/*
 * router_lease: the lease map. A request that holds a decode node's lease (Admit answered)
 * is found by (decode node, lease id) when that node's StepBatch entries arrive, without a
 * scan; releasing a lease tells the decode node (Release) and forgets it here.
 */
#include "router_int.h"

#include "td_util.h"

static uint32_t lease_hash(const router_state_t *s, int32_t decode, uint64_t lease)
{
    uint64_t h = (lease ^ ((uint64_t)(uint32_t)decode << 40)) * 0x9E3779B97F4A7C15ull;
    return (uint32_t)(h >> 32) & (s->lease_buckets - 1);
}

void router_lease_set(router_req_t *r, uint64_t lease)
{
    router_state_t *s = r->s;
    TD_ASSERT(!r->have_lease);
    r->lease_id = lease;
    r->have_lease = true;
    r->decode_tokens = 0;
    uint32_t h = lease_hash(s, r->pick.pair.decode, lease);
    r->lease_next = s->lease_map[h];
    s->lease_map[h] = r;
}

/* The lease is gone (released, finished, or its node lost): its step entries are ignored. */
void router_lease_forget(router_req_t *r)
{
    router_state_t *s = r->s;
    if (!r->have_lease)
        return;
    r->have_lease = false;
    router_req_t **pp = &s->lease_map[lease_hash(s, r->pick.pair.decode, r->lease_id)];
    while (*pp && *pp != r)
        pp = &(*pp)->lease_next;
    TD_ASSERT(*pp == r);
    *pp = r->lease_next;
    r->lease_next = NULL;
}

router_req_t *router_lease_find(router_state_t *s, int32_t decode, uint64_t gen, uint64_t lease)
{
    for (router_req_t *r = s->lease_map[lease_hash(s, decode, lease)]; r; r = r->lease_next)
        if (r->lease_id == lease && r->pick.pair.decode == decode && r->decode_gen == gen)
            return r;
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

