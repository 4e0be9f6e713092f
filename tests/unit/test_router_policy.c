/*
 * test_router_policy: the registry (join, heartbeat, timeout, rejoin, leave, bounded
 * prefix memory) and pair selection on constructed registries: room, layout
 * compatibility, prefix preference, retry exclusion, and the three failure statuses.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "router_policy.h"
#include "router_registry.h"
#include "td_kv.h"
#include "td_sched_defaults.h"
#include "td_util.h"

#define SEC 1000000000ll

static td_kv_layout_t layout(uint32_t head_dim)
{
    return (td_kv_layout_t){.model_fingerprint = 0x1234, .dtype = TD_F32, .block_size = 16,
                            .n_layers = 5, .n_kv_heads = 4, .head_dim = head_dim,
                            .version = TD_KV_LAYOUT_VERSION};
}

static int32_t join(router_registry_t *reg, const char *id, td_node_role_t role, uint32_t head_dim,
                    int32_t capacity, int64_t now)
{
    td_node_info_t info = {.role = role, .layout = layout(head_dim), .capacity_blocks = capacity,
                               .max_batch = 64};
    snprintf(info.id, sizeof info.id, "%s", id);
    snprintf(info.model, sizeof info.model, "stories");
    snprintf(info.address, sizeof info.address, "127.0.0.1:1");
    int32_t idx = -1;
    cr_assert_eq(router_registry_join(reg, &info, now, &idx), TD_OK, "%s", td_last_error());
    return idx;
}

/* A heartbeat from a node computing prompts at tok_s tokens per second (0: no step yet). */
static void beat_rate(router_registry_t *reg, const char *id, int64_t queued, int32_t running,
                      int32_t free_blocks, double tok_s, int64_t now)
{
    td_node_load_t l = {.queued_prefill_tokens = queued, .running_seqs = running,
                            .free_blocks = free_blocks, .step_ms = 1.0, .prefill_tok_s = tok_s};
    cr_assert_eq(router_registry_heartbeat(reg, id, &l, now), TD_OK);
}

/* A heartbeat from a node fast enough that its queue never holds a prompt back. */
static void beat(router_registry_t *reg, const char *id, int64_t queued, int32_t running,
                 int32_t free_blocks, int64_t now)
{
    beat_rate(reg, id, queued, running, free_blocks, 1e9, now);
}

static router_registry_t *mkreg(void)
{
    router_registry_t *reg;
    router_registry_config_t c = router_registry_config_default();
    c.heartbeat_timeout_ns = 3 * SEC;
    c.prefix_hashes = 64;
    cr_assert_eq(router_registry_create(&c, &reg), TD_OK);
    return reg;
}

static int32_t prompt[1000];

static router_pick_request_t request(int32_t n_prompt, int32_t max_tokens, int64_t now)
{
    for (int i = 0; i < 1000; i++)
        prompt[i] = 1 + (i * 7) % 500;
    return (router_pick_request_t){.model = "stories", .prompt = prompt, .n_prompt = n_prompt,
                                   .max_tokens = max_tokens, .now_ns = now};
}

/* A pick that must succeed. */
static router_pick_t pick_ok(router_registry_t *reg, const router_policy_config_t *pc,
                             const router_pick_request_t *rq)
{
    router_pick_t pk;
    cr_assert_eq(router_policy_pick(reg, pc, rq, &pk), TD_OK, "%s", td_last_error());
    return pk;
}

Test(router_policy, decode_with_room_then_shortest_batch)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    int p = join(reg, "p0", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int d0 = join(reg, "d0", TD_NODE_ROLE_DECODE, 8, 100, 0);
    int d1 = join(reg, "d1", TD_NODE_ROLE_DECODE, 8, 100, 0);
    int d2 = join(reg, "d2", TD_NODE_ROLE_DECODE, 8, 100, 0);
    beat(reg, "p0", 0, 0, 100, 0); /* a fast prefill node: its queue never holds a prompt back */
    beat(reg, "d0", 0, 1, 5, 0);   /* shortest batch but no room for 10 blocks */
    beat(reg, "d1", 0, 7, 50, 0);
    beat(reg, "d2", 0, 3, 20, 0);  /* room, shorter batch than d1: chosen */
    router_pick_request_t rq = request(100, 60, SEC); /* 160 tokens = 10 blocks */
    router_pick_t pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d2);
    cr_assert_eq(pk.pair.prefill, p);
    cr_assert_eq(pk.blocks_needed, 10);
    /* booking it: d2's free blocks and batch change until its next heartbeat */
    router_policy_commit(reg, &rq, &pk);
    cr_assert_eq(router_registry_node(reg, d2)->load.free_blocks, 10);
    cr_assert_eq(router_registry_node(reg, d2)->load.running_seqs, 4);
    cr_assert_eq(router_registry_node(reg, p)->load.queued_prefill_tokens, 100);
    beat(reg, "d2", 0, 3, 9, SEC); /* now d2 has no room: d1 */
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d1);
    (void)d0;
    router_registry_destroy(reg);
}

Test(router_policy, exhausted_range_and_unavailable_are_distinct)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    router_pick_request_t rq = request(100, 60, 0);
    router_pick_t pk = {.pair = {-7, -7}};
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_UNAVAILABLE, "empty registry");
    cr_assert_eq(pk.pair.decode, -7, "output written on failure");
    join(reg, "d0", TD_NODE_ROLE_DECODE, 8, 100, 0);
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_UNAVAILABLE, "no prefill node");
    join(reg, "p0", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    beat(reg, "d0", 0, 0, 4, 0);
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_EXHAUSTED, "no room now");
    router_pick_request_t big = request(1000, 1000, 0); /* 125 blocks > capacity 100 */
    cr_assert_eq(router_policy_pick(reg, &pc, &big, &pk), TD_ERR_RANGE, "never fits");
    rq.model = "other";
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_UNAVAILABLE, "unknown model");
    router_registry_destroy(reg);
}

Test(router_policy, only_compatible_layouts_pair)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    int p8 = join(reg, "p8", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int p16 = join(reg, "p16", TD_NODE_ROLE_PREFILL, 16, 100, 0);
    int d16 = join(reg, "d16", TD_NODE_ROLE_DECODE, 16, 100, 0);
    beat(reg, "p8", 0, 0, 100, 0);      /* idle but incompatible */
    beat(reg, "p16", 5000, 0, 100, 0);  /* busy but the only partner */
    router_pick_request_t rq = request(10, 10, 0);
    router_pick_t pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.prefill, p16);
    cr_assert_eq(pk.pair.decode, d16);
    /* the shortest decode node pairs with nobody: the next one is taken */
    int d8 = join(reg, "d8", TD_NODE_ROLE_DECODE, 8, 100, 0);
    beat(reg, "d16", 0, 0, 100, 0);
    beat(reg, "d8", 0, 5, 100, 0);
    cr_assert_eq(router_registry_leave(reg, "p16"), TD_OK);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d8);
    cr_assert_eq(pk.pair.prefill, p8);
    /* conditional: the shortest decode node, with no prefill partner, prefills itself */
    pc.prefill_policy = ROUTER_PREFILL_CONDITIONAL;
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d16);
    cr_assert_eq(pk.pair.prefill, d16);
    cr_assert(pk.local && pk.reason == ROUTER_PLACE_NO_PREFILL);
    router_registry_destroy(reg);
}

Test(router_policy, least_queued_work_and_prefix_preference)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    int pa = join(reg, "pa", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int pb = join(reg, "pb", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    join(reg, "d", TD_NODE_ROLE_DECODE, 8, 1000, 0);
    beat(reg, "pa", 300, 0, 100, 0);
    beat(reg, "pb", 200, 0, 100, 0);
    router_pick_request_t rq = request(640, 10, 0); /* 40 blocks of 16 */
    router_pick_t pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.prefill, pb, "least queued wins without prefix knowledge");
    cr_assert_eq(pk.prefix_blocks, 0);
    /* pa saw this prompt before: 40 cached blocks = 640 tokens of work saved > 100 more queued */
    uint64_t h[40];
    cr_assert_eq(td_kv_chain_hashes(0, prompt, 640, 16, h), 40);
    router_registry_note_prefix(reg, pa, h, 40);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.prefill, pa);
    cr_assert_eq(pk.prefix_blocks, 40);
    /* a prompt sharing only the first 3 blocks: 48 tokens saved < 100 more queued */
    router_pick_request_t other = rq;
    int32_t p2[640];
    memcpy(p2, prompt, sizeof p2);
    p2[3 * 16 + 5] ^= 1;
    other.prompt = p2;
    pk = pick_ok(reg, &pc, &other);
    cr_assert_eq(pk.pair.prefill, pb);
    cr_assert_eq(router_registry_prefix_match(reg, pa, h, 40), 40);
    uint64_t h2[40];
    td_kv_chain_hashes(0, p2, 640, 16, h2);
    cr_assert_eq(router_registry_prefix_match(reg, pa, h2, 40), 3);
    /* commit remembers the prompt on the chosen node */
    rq.prompt = p2;
    pk = pick_ok(reg, &pc, &rq);
    router_policy_commit(reg, &rq, &pk);
    cr_assert_eq(router_registry_prefix_match(reg, pb, h2, 40), 40);
    router_registry_destroy(reg);
}

/* Affinity is per tenant: a prompt a tenant's request left on a node draws only that tenant's
 * requests there (the hashes are seeded with its salt); another tenant's, or an unsalted
 * one's, is scored as if the node had never seen it (docs/security.md "Tenants"). */
Test(router_policy, prefix_preference_is_per_tenant)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    int pa = join(reg, "pa", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int pb = join(reg, "pb", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    join(reg, "d", TD_NODE_ROLE_DECODE, 8, 1000, 0);
    beat(reg, "pa", 300, 0, 100, 0);
    beat(reg, "pb", 200, 0, 100, 0);
    router_pick_request_t ra = request(640, 10, 0);
    ra.cache_salt = 0xa11ce;
    uint64_t h[40];
    cr_assert_eq(td_kv_chain_hashes(ra.cache_salt, prompt, 640, 16, h), 40);
    router_registry_note_prefix(reg, pa, h, 40); /* tenant A's prompt went to pa */
    router_pick_t pk = pick_ok(reg, &pc, &ra);
    cr_assert(pk.pair.prefill == pa && pk.prefix_blocks == 40, "A's own prefix draws A to pa");
    static const uint64_t others[] = {0xb0b, 0};
    for (size_t k = 0; k < TD_ARRAY_LEN(others); k++) {
        router_pick_request_t rb = ra;
        rb.cache_salt = others[k];
        pk = pick_ok(reg, &pc, &rb);
        cr_assert(pk.pair.prefill == pb && pk.prefix_blocks == 0, "salt %#llx: prefill %d, %d blocks believed cached",
                  (unsigned long long)others[k], pk.pair.prefill, pk.prefix_blocks);
    }
    /* commit remembers the prompt under its own tenant's hashes */
    router_pick_request_t rb = ra;
    rb.cache_salt = 0xb0b;
    pk = pick_ok(reg, &pc, &rb);
    router_policy_commit(reg, &rb, &pk);
    uint64_t hb[40];
    td_kv_chain_hashes(rb.cache_salt, prompt, 640, 16, hb);
    cr_assert_eq(router_registry_prefix_match(reg, pb, hb, 40), 40);
    cr_assert_eq(router_registry_prefix_match(reg, pb, h, 40), 0, "A's hashes are not B's");
    router_registry_destroy(reg);
}

Test(router_policy, prefix_memory_is_bounded_oldest_first)
{
    router_registry_t *reg = mkreg(); /* 64 hashes per node */
    int p = join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    uint64_t h[200];
    for (int i = 0; i < 200; i++)
        h[i] = 1000 + (uint64_t)i * 0x9e3779b97f4a7c15ull;
    router_registry_note_prefix(reg, p, h, 50);
    router_registry_note_prefix(reg, p, h, 10); /* refreshes 0..9 */
    router_registry_note_prefix(reg, p, h + 50, 20); /* 70 seen: 10..19 forgotten first */
    cr_assert_eq(router_registry_prefix_match(reg, p, h, 10), 10, "refreshed hashes kept");
    cr_assert_eq(router_registry_prefix_match(reg, p, h + 10, 1), 0, "oldest forgotten");
    cr_assert_eq(router_registry_prefix_match(reg, p, h + 16, 54), 54);
    router_registry_note_prefix(reg, p, h + 70, 130);
    cr_assert_eq(router_registry_prefix_match(reg, p, h + 136, 64), 64);
    cr_assert_eq(router_registry_prefix_match(reg, p, h + 135, 1), 0);
    router_registry_destroy(reg);
}

Test(router_policy, retries_exclude_tried_pairs)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    int p0 = join(reg, "p0", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int p1 = join(reg, "p1", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int d0 = join(reg, "d0", TD_NODE_ROLE_DECODE, 8, 100, 0);
    beat(reg, "p1", 50, 0, 100, 0);
    router_pick_request_t rq = request(20, 20, 0);
    router_pick_t pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.prefill, p0);
    router_pair_t tried[2] = {pk.pair};
    rq.exclude = tried;
    rq.n_exclude = 1;
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.prefill, p1, "not this pair again");
    cr_assert_eq(pk.pair.decode, d0);
    tried[1] = pk.pair;
    rq.n_exclude = 2;
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_UNAVAILABLE);
    router_registry_destroy(reg);
}

Test(router_policy, node_down_after_heartbeat_timeout_and_rejoin)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    join(reg, "p0", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int d0 = join(reg, "d0", TD_NODE_ROLE_DECODE, 8, 100, 0);
    int d1 = join(reg, "d1", TD_NODE_ROLE_DECODE, 8, 100, 0);
    beat(reg, "d0", 0, 0, 100, 0);
    beat(reg, "d1", 0, 9, 100, 0);
    beat(reg, "p0", 0, 0, 100, 2 * SEC);
    beat(reg, "d1", 0, 9, 100, 2 * SEC);
    router_pick_request_t rq = request(20, 20, 3 * SEC);
    router_pick_t pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d0, "3 s of silence is still within the bound");
    rq.now_ns = 3 * SEC + 1;
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d1, "d0 silent past the bound is not chosen");
    cr_assert_eq(router_registry_expire(reg, 3 * SEC + 1), 1);
    cr_assert(!router_registry_node(reg, d0)->up);
    cr_assert_eq(router_registry_expire(reg, 3 * SEC + 1), 0, "already down");
    rq.now_ns = 6 * SEC;
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_UNAVAILABLE, "everyone silent");
    /* d0 comes back with a heartbeat, d1 with a new registration */
    beat(reg, "d0", 0, 4, 100, 6 * SEC);
    beat(reg, "p0", 0, 0, 100, 6 * SEC);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d0);
    int d1b = join(reg, "d1", TD_NODE_ROLE_DECODE, 8, 100, 6 * SEC);
    cr_assert_eq(d1b, d1, "rejoin keeps the slot");
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d1, "rejoined idle node has the shortest batch");
    td_node_load_t l = {0};
    cr_assert_eq(router_registry_heartbeat(reg, "ghost", &l, 0), TD_ERR_NOT_FOUND);
    cr_assert_eq(router_registry_leave(reg, "ghost"), TD_ERR_NOT_FOUND);
    router_registry_destroy(reg);
}

Test(router_policy, registration_is_checked)
{
    router_registry_config_t c = router_registry_config_default();
    c.max_nodes = 2;
    router_registry_t *reg;
    cr_assert_eq(router_registry_create(&c, &reg), TD_OK);
    td_node_info_t info = {.role = TD_NODE_ROLE_DECODE, .layout = layout(8), .capacity_blocks = 10,
                               .max_batch = 8, .model = "stories", .address = "127.0.0.1:1"};
    cr_assert_eq(router_registry_join(reg, &info, 0, NULL), TD_ERR_INVALID, "empty id");
    snprintf(info.id, sizeof info.id, "a");
    cr_assert_eq(router_registry_join(reg, &info, 0, NULL), TD_OK);
    snprintf(info.id, sizeof info.id, "b");
    cr_assert_eq(router_registry_join(reg, &info, 0, NULL), TD_OK);
    snprintf(info.id, sizeof info.id, "c");
    cr_assert_eq(router_registry_join(reg, &info, 0, NULL), TD_ERR_EXHAUSTED);
    cr_assert_eq(router_registry_leave(reg, "a"), TD_OK);
    cr_assert_eq(router_registry_join(reg, &info, 0, NULL), TD_OK, "a freed slot is reused");
    cr_assert_eq(router_registry_find(reg, "c"), 0);
    router_registry_destroy(reg);
}

/* Each field of a registration is checked on its own, and the refusal names the field and
 * the value it had. */
Test(router_policy, every_registration_field_is_checked_by_name)
{
    const td_node_info_t good = {.id = "d0", .role = TD_NODE_ROLE_DECODE, .model = "stories",
                                     .layout = layout(8), .address = "127.0.0.1:1",
                                     .capacity_blocks = 10, .max_batch = 8, .vocab_size = 32000,
                                     .max_seq_len = 2048};
    cr_assert_eq(router_registry_validate(&good), TD_OK, "%s", td_last_error());
    struct {
        const char *what;
        td_node_info_t info;
        const char *says;
    } cases[] = {
        {"role 99", good, "role 99 is not PREFILL (1), DECODE (2) or UNIFIED (3)"},
        {"role 0", good, "role 0"},
        {"empty model", good, "model is empty"},
        {"a model with a newline", good, "model has byte 0x0a at offset 3"},
        {"an id with a space", good, "node_id has byte 0x20 at offset 1"},
        {"an empty address", good, "control_address is empty"},
        {"block size 0", good, "layout: kv layout out of range: block_size 0"},
        {"layout version 9", good, "layout: kv layout version 9 unknown"},
        {"dtype 200", good, "layout: kv layout dtype 200 unknown"},
        {"no blocks", good, "capacity.total_kv_blocks 0, at least 1"},
        {"max_batch 0", good, "capacity.max_batch 0, allowed 1 .. 65536"},
        {"a vocabulary of 2^30", good, "capacity.vocab_size 1073741824, allowed 0 (unknown) .. 16777216"},
        {"max_seq_len -1", good, "capacity.max_seq_len -1"},
    };
    cases[0].info.role = 99;
    cases[1].info.role = 0;
    cases[2].info.model[0] = 0;
    snprintf(cases[3].info.model, sizeof cases[3].info.model, "sto\nries");
    snprintf(cases[4].info.id, sizeof cases[4].info.id, "d 0");
    cases[5].info.address[0] = 0;
    cases[6].info.layout.block_size = 0;
    cases[7].info.layout.version = 9;
    cases[8].info.layout.dtype = 200;
    cases[9].info.capacity_blocks = 0;
    cases[10].info.max_batch = 0;
    cases[11].info.vocab_size = 1 << 30;
    cases[12].info.max_seq_len = -1;
    router_registry_t *reg = mkreg();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cr_assert_eq(router_registry_validate(&cases[i].info), TD_ERR_INVALID, "%s accepted", cases[i].what);
        cr_assert(strstr(td_last_error(), cases[i].says), "%s: \"%s\" does not say \"%s\"", cases[i].what,
                  td_last_error(), cases[i].says);
        cr_assert_eq(router_registry_join(reg, &cases[i].info, 0, NULL), TD_ERR_INVALID, "%s joined", cases[i].what);
        cr_assert_eq(router_registry_find(reg, cases[i].info.id), -1, "%s left a trace", cases[i].what);
    }
    router_registry_destroy(reg);
}

/* A live node's id is its own: a second registration under it is refused and changes
 * nothing; once the first is gone (silent past the bound, or left after its channel or
 * stream failed) the same id registers again, as a restarted node does. */
Test(router_policy, a_live_id_is_refused_a_dead_one_is_taken_over)
{
    router_registry_t *reg = mkreg(); /* heartbeat timeout 3 s */
    int d0 = join(reg, "d0", TD_NODE_ROLE_DECODE, 8, 100, 0);
    const router_node_t *n = router_registry_node(reg, d0);
    uint64_t gen = n->generation;
    td_node_info_t other = n->info;
    snprintf(other.address, sizeof other.address, "10.0.0.9:4444");
    other.capacity_blocks = 7;
    cr_assert_eq(router_registry_join(reg, &other, 1 * SEC, NULL), TD_ERR_BUSY, "a live id taken over");
    cr_assert(strstr(td_last_error(), "node id d0 is taken by a live node (at 127.0.0.1:1"), "%s", td_last_error());
    n = router_registry_node(reg, d0);
    cr_assert_eq(n->generation, gen, "the live registration is untouched");
    cr_assert_str_eq(n->info.address, "127.0.0.1:1");
    cr_assert_eq(n->info.capacity_blocks, 100);
    cr_assert(router_registry_is_live(reg, d0, 1 * SEC));
    beat(reg, "d0", 0, 0, 100, 2 * SEC);
    cr_assert_eq(router_registry_join(reg, &other, 4 * SEC, NULL), TD_ERR_BUSY, "heartbeats keep it live");
    /* silent past the bound: a restart under the same id takes the slot */
    int32_t idx = -1;
    cr_assert_eq(router_registry_join(reg, &other, 5 * SEC + 1, &idx), TD_OK, "%s", td_last_error());
    cr_assert_eq(idx, d0, "the restarted node keeps the slot");
    n = router_registry_node(reg, d0);
    cr_assert_gt(n->generation, gen, "a new registration is a new epoch");
    cr_assert_str_eq(n->info.address, "10.0.0.9:4444");
    /* marked down (its channel failed) before the bound: also taken over */
    router_registry_node(reg, d0)->up = false;
    cr_assert_eq(router_registry_join(reg, &other, 5 * SEC + 2, NULL), TD_OK, "%s", td_last_error());
    /* left (its stream ended): registers again */
    cr_assert_eq(router_registry_leave(reg, "d0"), TD_OK);
    cr_assert_eq(router_registry_join(reg, &other, 5 * SEC + 3, NULL), TD_OK, "%s", td_last_error());
    router_registry_destroy(reg);
}

/* A prefill node with work queued takes a prompt only if it would reach it within
 * max_prefill_wait_s at the rate it reports; an idle node always takes one; a busy node
 * that reported no rate takes none. Otherwise EXHAUSTED: the router queues the request,
 * holding no decode blocks, instead of leasing blocks that would expire in a prefill queue. */
Test(router_policy, busy_prefill_nodes_hold_requests_in_the_router)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    cr_assert_float_eq(pc.max_prefill_wait_s, 5.0, 1e-9);
    int p0 = join(reg, "p0", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int p1 = join(reg, "p1", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    join(reg, "d0", TD_NODE_ROLE_DECODE, 8, 100, 0);
    beat(reg, "d0", 0, 0, 100, 0);
    router_pick_request_t rq = request(100, 10, SEC);
    router_pick_t pk;

    /* both idle, no rate yet: the first takes it, its wait at the assumed rate (lease sizing) */
    beat_rate(reg, "p0", 0, 0, 100, 0, 0);
    beat_rate(reg, "p1", 0, 0, 100, 0, 0);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.prefill, p0);
    cr_assert_float_eq(pk.prefill_wait_s, 100 / pc.assumed_tok_s, 1e-9);
    /* p0 busy without a rate: p1 */
    beat_rate(reg, "p0", 50, 0, 100, 0, SEC);
    cr_assert_eq(pick_ok(reg, &pc, &rq).pair.prefill, p1);
    /* both busy: p0 at 100 tok/s would reach it in (400 + 100) / 100 = 5 s: within the bound */
    beat_rate(reg, "p0", 400, 0, 100, 100, SEC);
    beat_rate(reg, "p1", 10, 0, 100, 0, SEC);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.prefill, p0);
    cr_assert_float_eq(pk.prefill_wait_s, 5.0, 1e-9);
    /* one token more and no node is free: EXHAUSTED, naming the bound */
    beat_rate(reg, "p0", 401, 0, 100, 100, SEC);
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_EXHAUSTED);
    cr_assert(strstr(td_last_error(), "busy"), "%s", td_last_error());
    /* a faster node with more work queued is preferred over none */
    beat_rate(reg, "p1", 4000, 0, 100, 1000, SEC);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.prefill, p1);
    cr_assert_float_eq(pk.prefill_wait_s, 4.1, 1e-9);
    /* with no bound, queued work only ranks nodes */
    pc.max_prefill_wait_s = 0;
    beat_rate(reg, "p1", 5000, 0, 100, 0, SEC);
    cr_assert_eq(pick_ok(reg, &pc, &rq).pair.prefill, p0);
    router_registry_destroy(reg);
}

/* Unified nodes are ranked by the prompt tokens they still prefill before their batch: a
 * prompt there stalls every running sequence for its chunks, so a node that only decodes
 * (more sequences, no prompt) takes the next one; a pick books its prompt on the node
 * itself, so a burst between heartbeats spreads by queued tokens. */
Test(router_policy, unified_nodes_ranked_by_queued_prompt_first)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    router_pick_request_t rq = request(200, 20, 0);
    int u0 = join(reg, "u0", TD_NODE_ROLE_UNIFIED, 8, 1000, 0);
    int u1 = join(reg, "u1", TD_NODE_ROLE_UNIFIED, 8, 1000, 0);
    beat(reg, "u0", 234, 1, 1000, 0); /* one sequence, its prompt not yet prefilled */
    beat(reg, "u1", 0, 3, 1000, 0);   /* three sequences generating */
    router_pick_t pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, u1, "the node with no prompt queued, though it runs more");
    cr_assert_eq(pk.pair.prefill, u1);
    router_policy_commit(reg, &rq, &pk);
    cr_assert_eq(router_registry_node(reg, u1)->load.queued_prefill_tokens, 200, "the prompt is booked there");
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, u1, "200 queued tokens against 234");
    router_policy_commit(reg, &rq, &pk);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, u0, "400 queued tokens against 234");
    /* equal queues: the shorter batch */
    beat(reg, "u0", 0, 2, 1000, 0);
    beat(reg, "u1", 0, 1, 1000, 0);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, u1);
    router_registry_destroy(reg);
}

/* A unified node is ranked with the decode nodes and is its own prefill node: the pair
 * {u, u}; with a (prefill, decode) pair beside it the ranking picks either; a tried {u, u}
 * is excluded as that pair only; a prefill node never pairs with a unified node. */
Test(router_policy, unified_nodes_pair_with_themselves)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = router_policy_config_default();
    router_pick_request_t rq = request(20, 20, 0);
    int u0 = join(reg, "u0", TD_NODE_ROLE_UNIFIED, 8, 100, 0);
    router_pick_t pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.prefill, u0, "no prefill node needed");
    cr_assert_eq(pk.pair.decode, u0);
    cr_assert_eq(pk.blocks_needed, 3);
    router_policy_commit(reg, &rq, &pk);
    cr_assert_eq(router_registry_node(reg, u0)->load.running_seqs, 1, "booked as a decode node");
    /* a pair beside it: a shorter batch wins, whichever kind */
    int p0 = join(reg, "p0", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int d0 = join(reg, "d0", TD_NODE_ROLE_DECODE, 8, 100, 0);
    beat(reg, "p0", 0, 0, 100, 0);
    beat(reg, "d0", 0, 0, 100, 0);
    beat(reg, "u0", 0, 2, 100, 0);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d0);
    cr_assert_eq(pk.pair.prefill, p0, "the prefill node pairs with the decode node, never the unified one");
    beat(reg, "d0", 0, 5, 100, 0);
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, u0);
    cr_assert_eq(pk.pair.prefill, u0);
    /* retries: {u0, u0} tried leaves (p0, d0); both tried: none */
    router_pair_t tried[2] = {pk.pair};
    rq.exclude = tried;
    rq.n_exclude = 1;
    pk = pick_ok(reg, &pc, &rq);
    cr_assert_eq(pk.pair.decode, d0);
    cr_assert_eq(pk.pair.prefill, p0);
    tried[1] = pk.pair;
    rq.n_exclude = 2;
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_UNAVAILABLE);
    /* no room on any: exhausted, as for decode nodes */
    rq.n_exclude = 0;
    beat(reg, "u0", 0, 0, 2, 0);
    beat(reg, "d0", 0, 0, 2, 0);
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_EXHAUSTED);
    router_registry_destroy(reg);
}

/* ---- conditional disaggregation (router_policy.h, rule 5) ------------------------------ */

/* A decode node whose steps feed at most step_tokens tokens (its max-batch-tokens). */
static int32_t join_decode(router_registry_t *reg, const char *id, int32_t step_tokens)
{
    td_node_info_t info = {.role = TD_NODE_ROLE_DECODE, .layout = layout(8), .capacity_blocks = 1000,
                           .max_batch = 64, .max_step_tokens = step_tokens};
    snprintf(info.id, sizeof info.id, "%s", id);
    snprintf(info.model, sizeof info.model, "stories");
    snprintf(info.address, sizeof info.address, "127.0.0.1:1");
    int32_t idx = -1;
    cr_assert_eq(router_registry_join(reg, &info, 0, &idx), TD_OK, "%s", td_last_error());
    return idx;
}

/* A decode node's heartbeat: its running batch, decode-only step time and local prefill rate. */
static void beat_decode(router_registry_t *reg, const char *id, int64_t queued, int32_t running, double step_ms,
                        double local_tok_s)
{
    td_node_load_t l = {.queued_prefill_tokens = queued, .running_seqs = running, .free_blocks = 1000,
                        .step_ms = step_ms, .prefill_tok_s = local_tok_s};
    cr_assert_eq(router_registry_heartbeat(reg, id, &l, 0), TD_OK);
}

static router_policy_config_t conditional(void)
{
    router_policy_config_t pc = router_policy_config_default();
    pc.prefill_policy = ROUTER_PREFILL_CONDITIONAL;
    pc.tpot_objective_s = 0.1;
    return pc;
}

/* The pick with its placement, said on failure. */
static router_pick_t place(router_registry_t *reg, const router_policy_config_t *pc, const router_pick_request_t *rq,
                           bool want_local, router_place_reason_t want_reason)
{
    router_pick_t pk = pick_ok(reg, pc, rq);
    cr_assert(pk.local == want_local && pk.reason == want_reason,
              "placed %s (%s), want %s (%s); estimates local %.3f s, remote %.3f s", pk.local ? "local" : "remote",
              router_place_reason_name(pk.reason), want_local ? "local" : "remote",
              router_place_reason_name(want_reason), pk.local_s, pk.remote_s);
    cr_assert_eq(pk.local, pk.pair.prefill == pk.pair.decode);
    return pk;
}

Test(router_policy, conditional_short_suffix_behind_a_long_prefill_queue_goes_local)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = conditional();
    int p = join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int d = join_decode(reg, "d", 512);
    beat_rate(reg, "p", 3000, 0, 100, 1000, 0);  /* 3 s of queued prompts */
    beat_decode(reg, "d", 0, 4, 20, 800);         /* 4 streams at 20 ms a step */
    router_pick_request_t rq = request(32, 10, 0);
    router_pick_t pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.pair.decode, d);
    /* one chunk of 32 at 800 tokens/s beside a 20 ms step: 60 ms, within the 100 ms objective */
    cr_assert_float_eq(pk.local_s, 0.06, 1e-9);
    cr_assert_float_eq(pk.prefill_wait_s, pk.local_s, 1e-12, "the lease is sized by the local estimate");
    cr_assert_gt(pk.remote_s, 3.0);
    /* with a TTFT objective the remote side meets (3.2 s within 5 s), sooner gains nothing:
       remote; one it would pass (2 s): local */
    pc.ttft_objective_s = 5.0;
    place(reg, &pc, &rq, false, ROUTER_PLACE_FASTER);
    pc.ttft_objective_s = 2.0;
    place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    pc.ttft_objective_s = 0;
    /* the disaggregated policy (the default) sends it to the queue regardless */
    router_policy_config_t dis = router_policy_config_default();
    pk = place(reg, &dis, &rq, false, ROUTER_PLACE_POLICY);
    cr_assert_eq(pk.pair.prefill, p);
    /* the booked local prompt counts in the decode node's queue until its next heartbeat */
    pk = pick_ok(reg, &pc, &rq);
    router_policy_commit(reg, &rq, &pk);
    cr_assert_eq(router_registry_node_const(reg, d)->load.queued_prefill_tokens, 32);
    router_registry_destroy(reg);
}

Test(router_policy, conditional_long_suffix_on_an_idle_prefill_node_goes_remote)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = conditional();
    int p = join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    join_decode(reg, "d", 512);
    beat_rate(reg, "p", 0, 0, 100, 2000, 0);
    beat_decode(reg, "d", 0, 0, 20, 500); /* idle: its TPOT is nobody's */
    router_pick_request_t rq = request(640, 10, 0);
    /* local: 16 steps of 40 tokens at 500/s, each 20 + 80 ms within the 100 ms objective (1.6 s);
       remote: 0.32 s and the transfer */
    router_pick_t pk = place(reg, &pc, &rq, false, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.pair.prefill, p);
    cr_assert_float_eq(pk.local_s, 16 * (0.02 + 40 / 500.0), 1e-9);
    /* the transfer: 40 blocks of 5 layers x 4096 bytes at 1 GB/s, plus 2 ms */
    cr_assert_float_eq(pk.remote_s, 640 / 2000.0 + 0.002 + 40 * 5 * 4096 / 1e9, 1e-9);
    router_registry_destroy(reg);
}

Test(router_policy, conditional_prefix_cached_on_the_prefill_node_goes_remote)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = conditional();
    int p = join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    join_decode(reg, "d", 1024);
    beat_rate(reg, "p", 600, 0, 100, 1000, 0);
    beat_decode(reg, "d", 0, 0, 20, 1000);
    router_pick_request_t rq = request(640, 10, 0);
    /* uncached: the 600 queued tokens make the prefill node later (1.24 s vs 8 steps of 80 tokens
       within the objective, 0.8 s) */
    place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    /* the prefill node holds the whole prompt: 600 queued tokens only (0.6 s) */
    uint64_t h[40];
    cr_assert_eq(td_kv_chain_hashes(0, prompt, 640, 16, h), 40);
    router_registry_note_prefix(reg, p, h, 40);
    router_pick_t pk = place(reg, &pc, &rq, false, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.prefix_blocks, 40);
    /* a prefix the decode node holds counts for it the same way */
    router_registry_note_prefix(reg, router_registry_find(reg, "d"), h, 40);
    place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    router_registry_destroy(reg);
}

Test(router_policy, conditional_tight_tpot_chunks_a_prompt_within_the_objective_or_sends_it_remote)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = conditional();
    join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int d = join_decode(reg, "d", 512);
    beat_rate(reg, "p", 3000, 0, 100, 1000, 0);
    beat_decode(reg, "d", 0, 8, 30, 800);
    router_pick_request_t rq = request(200, 10, 0);
    /* 8 streams at 30 ms a step leave 70 ms of the 100 ms objective: 56 prompt tokens a step at
       800/s, so 4 steps of 100 ms (0.4 s) against 3.2 s in the prefill node's queue (the node
       sizes its chunks itself, from the same fit it reports) */
    router_pick_t pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.pair.prefill, d);
    cr_assert_eq(pk.local_chunk, 56);
    cr_assert_float_eq(pk.local_s, 4 * (0.03 + 56 / 800.0), 1e-9);
    /* 35 ms: 4 tokens a step, 50 steps (1.75 s), still sooner */
    pc.tpot_objective_s = 0.035;
    pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.local_chunk, 4);
    /* 30 ms, the streams' own pace: no room for a prompt token */
    pc.tpot_objective_s = 0.030;
    pk = place(reg, &pc, &rq, false, ROUTER_PLACE_TPOT);
    cr_assert_lt(pk.local_s, 0);
    /* nobody running there yet does not lift the bound: streams join while it prefills */
    beat_decode(reg, "d", 0, 0, 30, 800);
    place(reg, &pc, &rq, false, ROUTER_PLACE_TPOT);
    /* the whole prompt in one step where the objective allows it (a 300 ms step) */
    pc.tpot_objective_s = 0.3;
    pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.local_chunk, 200);
    router_registry_destroy(reg);
}

/* The objective a local prefill is held to is the tightest of the request's own (else the
 * router's) and the one the decode node reports for its sequences; the Admit carries the
 * request's (else, on a decode node under the conditional policy, the router's). */
Test(router_policy, conditional_tightest_of_the_requests_and_the_nodes_tpot_objectives)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = conditional();
    join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    join_decode(reg, "d", 512);
    beat_rate(reg, "p", 3000, 0, 100, 1000, 0);
    beat_decode(reg, "d", 0, 8, 30, 800);
    router_pick_request_t rq = request(200, 10, 0);
    /* the router's 100 ms: 56 tokens a step; the Admit holds the request to it */
    router_pick_t pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.local_chunk, 56);
    cr_assert_float_eq(pk.tpot_objective_s, 0.1, 1e-12);
    /* the request's own 35 ms: 4 tokens a step */
    rq.tpot_objective_s = 0.035;
    pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.local_chunk, 4);
    cr_assert_float_eq(pk.tpot_objective_s, 0.035, 1e-12);
    /* a stream on the node holds it to 30 ms, its own pace: remote, whatever the request allows */
    rq.tpot_objective_s = 0.5;
    td_node_load_t l = {.running_seqs = 8, .free_blocks = 1000, .step_ms = 30, .prefill_tok_s = 800,
                        .tpot_objective_s = 0.030};
    cr_assert_eq(router_registry_heartbeat(reg, "d", &l, 0), TD_OK);
    pk = place(reg, &pc, &rq, false, ROUTER_PLACE_TPOT);
    cr_assert_float_eq(pk.tpot_objective_s, 0.5, 1e-12, "the request's own goes with it");
    /* what the node keeps back from the objective for its steps' spread counts too: 2 ms of the
       request's 40 ms leave 8 ms, 6 tokens a step at 800/s (10 ms: 8) */
    l.tpot_objective_s = 0;
    l.step_spread_s = 0.002;
    cr_assert_eq(router_registry_heartbeat(reg, "d", &l, 0), TD_OK);
    rq.tpot_objective_s = 0.04;
    pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.local_chunk, 6);
    l.step_spread_s = 0;
    /* a looser one on the node leaves the request's (35 ms) the tightest */
    l.tpot_objective_s = 0.2;
    cr_assert_eq(router_registry_heartbeat(reg, "d", &l, 0), TD_OK);
    rq.tpot_objective_s = 0.035;
    pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.local_chunk, 4);
    /* the disaggregated policy sends the request's objective only */
    router_policy_config_t dis = router_policy_config_default();
    rq.tpot_objective_s = 0;
    cr_assert_eq(pick_ok(reg, &dis, &rq).tpot_objective_s, 0);
    rq.tpot_objective_s = 0.05;
    cr_assert_float_eq(pick_ok(reg, &dis, &rq).tpot_objective_s, 0.05, 1e-12);
    router_registry_destroy(reg);
}

Test(router_policy, conditional_decode_node_near_its_step_budget_goes_remote)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = conditional();
    join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    join_decode(reg, "d", 64);
    beat_rate(reg, "p", 3000, 0, 100, 1000, 0);
    router_pick_request_t rq = request(16, 10, 0);
    /* its steps take 95 ms: 4 prompt tokens a step fit the 100 ms objective (0.4 s) */
    beat_decode(reg, "d", 0, 4, 95, 800);
    router_pick_t pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.local_chunk, 4);
    /* at 99.5 ms not one */
    beat_decode(reg, "d", 0, 4, 99.5, 800);
    place(reg, &pc, &rq, false, ROUTER_PLACE_TPOT);
    /* a running batch that fills max-batch-tokens (64) leaves no room for a chunk */
    beat_decode(reg, "d", 0, 64, 10, 800);
    pk = place(reg, &pc, &rq, false, ROUTER_PLACE_STEP_BUDGET);
    cr_assert_lt(pk.local_s, 0);
    /* 60 running leave 4 tokens a step: four steps of 10 + 5 ms */
    beat_decode(reg, "d", 0, 60, 10, 800);
    pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_float_eq(pk.local_s, 4 * (0.01 + 4 / 800.0), 1e-9);
    router_registry_destroy(reg);
}

Test(router_policy, conditional_without_a_prefill_node_prefills_locally)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = conditional();
    int d = join_decode(reg, "d", 512);
    beat_decode(reg, "d", 0, 8, 90, 100); /* however slow: there is nowhere else */
    router_pick_request_t rq = request(400, 10, 0);
    router_pick_t pk = place(reg, &pc, &rq, true, ROUTER_PLACE_NO_PREFILL);
    cr_assert(pk.pair.prefill == d && pk.pair.decode == d);
    /* the disaggregated policy has no pair */
    router_policy_config_t dis = router_policy_config_default();
    cr_assert_eq(router_policy_pick(reg, &dis, &rq, &pk), TD_ERR_UNAVAILABLE);
    /* prompt logprobs are a prefill node's alone: none, so no pair either */
    rq.prompt_logprobs = true;
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_UNAVAILABLE);
    router_registry_destroy(reg);
}

Test(router_policy, conditional_busy_partners_logprobs_retries_and_unknown_rates)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = conditional();
    int p = join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int d = join_decode(reg, "d", 512);
    router_pick_request_t rq = request(32, 10, 0);
    /* the partner is busy past max_prefill_wait_s (8 s of work): local while the TPOT allows */
    beat_rate(reg, "p", 8000, 0, 100, 1000, 0);
    beat_decode(reg, "d", 0, 2, 20, 800);
    place(reg, &pc, &rq, true, ROUTER_PLACE_PREFILL_BUSY);
    /* ... else (its steps leave no room within the objective) the request waits in the router's queue */
    beat_decode(reg, "d", 0, 2, 100, 800);
    router_pick_t pk;
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_EXHAUSTED);
    /* prompt logprobs: always a prefill node */
    beat_rate(reg, "p", 3000, 0, 100, 1000, 0);
    beat_decode(reg, "d", 0, 2, 20, 800);
    rq.prompt_logprobs = true;
    place(reg, &pc, &rq, false, ROUTER_PLACE_PROMPT_LOGPROBS);
    rq.prompt_logprobs = false;
    /* a retry after the local pair failed goes to the partner */
    router_pair_t tried[1] = {{.prefill = d, .decode = d}};
    rq.exclude = tried;
    rq.n_exclude = 1;
    pk = place(reg, &pc, &rq, false, ROUTER_PLACE_FASTER);
    cr_assert_eq(pk.pair.prefill, p);
    rq.exclude = NULL;
    rq.n_exclude = 0;
    /* no local rate reported yet: half the partner's, 500 tokens/s: 20 ms + 64 ms */
    beat_decode(reg, "d", 0, 2, 20, 0);
    pk = place(reg, &pc, &rq, true, ROUTER_PLACE_FASTER);
    cr_assert_float_eq(pk.local_s, 0.02 + 32 / 500.0, 1e-9);
    /* neither reported one (an idle partner takes a prompt whatever its rate): the partner at
       assumed_tok_s (0.64 s), the decode node at half that, 2 tokens in the 80 ms a step leaves
       (16 steps, 1.6 s) */
    beat_rate(reg, "p", 0, 0, 100, 0, 0);
    pk = place(reg, &pc, &rq, false, ROUTER_PLACE_FASTER);
    cr_assert_float_eq(pk.local_s, 16 * (0.02 + 2 / 25.0), 1e-9);
    router_registry_destroy(reg);
}

/* ---- roles that follow the load (router_policy.h, rule 6) ------------------------------- */

static router_policy_config_t follow(void)
{
    router_policy_config_t pc = conditional();
    pc.prefill_policy = ROUTER_PREFILL_FOLLOW;
    return pc;
}

/* The KV transfer of n prompt tokens in the test layout (blocks of 16, 5 layers x 4096 bytes a
 * block, at the default 1 GB/s and 2 ms). */
static double xfer_s(int n)
{
    return 0.002 + (double)((n + 15) / 16) * 5 * 4096 / 1e9;
}

/* The pick, said on failure, with where it placed the prompt: 'l' local, 'r' remote, 'p' peer. */
static router_pick_t place_at(router_registry_t *reg, const router_policy_config_t *pc, const router_pick_request_t *rq,
                              char want)
{
    router_pick_t pk = pick_ok(reg, pc, rq);
    char at = pk.peer ? 'p' : pk.local ? 'l' : 'r';
    cr_assert_eq(at, want, "placed '%c', want '%c'; estimates local %.3f s, remote %.3f s, peer %.3f s", at, want,
                 pk.local_s, pk.remote_s, pk.peer_s);
    cr_assert_eq(pk.local, pk.pair.prefill == pk.pair.decode);
    cr_assert(!(pk.peer && pk.local));
    return pk;
}

Test(router_policy, follow_a_short_prompt_goes_local)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = follow();
    int d1 = join_decode(reg, "d1", 512);
    join_decode(reg, "d2", 512);
    beat_decode(reg, "d1", 0, 2, 20, 800);
    beat_decode(reg, "d2", 0, 3, 20, 800);
    router_pick_request_t rq = request(32, 10, 0);
    /* one chunk on d1 (60 ms) against the same chunk on d2 and its transfer */
    router_pick_t pk = place_at(reg, &pc, &rq, 'l');
    cr_assert_eq(pk.pair.decode, d1);
    cr_assert_float_eq(pk.local_s, 0.06, 1e-9);
    cr_assert_float_eq(pk.peer_s, 0.06 + xfer_s(32), 1e-9);
    router_registry_destroy(reg);
}

Test(router_policy, follow_a_long_prompt_behind_a_busy_self_goes_to_an_idle_peer)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = follow();
    int d1 = join_decode(reg, "d1", 512), d2 = join_decode(reg, "d2", 512);
    beat_decode(reg, "d1", 0, 1, 70, 400); /* one long stream: 70 ms steps leave 30 ms, 12 tokens */
    beat_decode(reg, "d2", 0, 2, 10, 2000); /* fast steps: 180 tokens a step within 100 ms */
    router_pick_request_t rq = request(600, 10, 0);
    router_pick_t pk = place_at(reg, &pc, &rq, 'p');
    cr_assert(pk.pair.decode == d1 && pk.pair.prefill == d2, "the decode node is picked by the ranking, the "
              "prompt goes to the peer");
    cr_assert_float_eq(pk.local_s, 50 * (0.07 + 12 / 400.0), 1e-9);
    cr_assert_float_eq(pk.peer_s, 4 * (0.01 + 180 / 2000.0) + xfer_s(600), 1e-9);
    cr_assert_float_eq(pk.prefill_wait_s, 4 * (0.01 + 180 / 2000.0), 1e-9, "the lease is sized by the peer's prefill");
    cr_assert_float_eq(pk.tpot_objective_s, 0.1, 1e-9);
    /* booked: the peer's queue holds the prompt until its next heartbeat, which ranks it behind
       for new streams and makes it a later peer */
    router_policy_commit(reg, &rq, &pk);
    cr_assert_eq(router_registry_node_const(reg, d2)->load.queued_prefill_tokens, 600);
    cr_assert_eq(router_registry_node_const(reg, d1)->load.running_seqs, 2);
    /* the conditional policy has no peers: the slow local prefill */
    router_policy_config_t cond = conditional();
    beat_decode(reg, "d2", 0, 2, 10, 2000);
    place_at(reg, &cond, &rq, 'l');
    /* a retry after the peer pair failed does not go back to it */
    router_pair_t tried[1] = {{.prefill = d2, .decode = d1}};
    rq.exclude = tried;
    rq.n_exclude = 1;
    place_at(reg, &pc, &rq, 'l');
    rq.exclude = NULL;
    rq.n_exclude = 0;
    /* prompt logprobs are never a peer's (nor a local prefill's): nowhere, with no prefill node */
    rq.prompt_logprobs = true;
    cr_assert_eq(router_policy_pick(reg, &pc, &rq, &pk), TD_ERR_UNAVAILABLE);
    router_registry_destroy(reg);
}

Test(router_policy, follow_a_prefill_node_when_it_is_sooner)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = follow();
    int p = join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int d1 = join_decode(reg, "d1", 512), d2 = join_decode(reg, "d2", 512);
    beat_decode(reg, "d1", 0, 1, 70, 400);
    beat_decode(reg, "d2", 0, 2, 10, 2000);
    router_pick_request_t rq = request(600, 10, 0);
    beat_rate(reg, "p", 0, 0, 100, 5000, 0); /* 0.12 s: sooner than the peer's 0.4 s */
    router_pick_t pk = place_at(reg, &pc, &rq, 'r');
    cr_assert(pk.pair.prefill == p && pk.pair.decode == d1);
    beat_rate(reg, "p", 0, 0, 100, 1000, 0); /* 0.6 s: the peer is sooner */
    pk = place_at(reg, &pc, &rq, 'p');
    cr_assert(pk.pair.prefill == d2 && pk.pair.decode == d1);
    /* a prefill node that meets the TTFT objective keeps the prompt off the peer's streams */
    pc.ttft_objective_s = 1.0;
    place_at(reg, &pc, &rq, 'r');
    pc.ttft_objective_s = 0.5;
    place_at(reg, &pc, &rq, 'p');
    router_registry_destroy(reg);
}

Test(router_policy, follow_never_a_peer_busy_past_the_objective)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = follow();
    int d1 = join_decode(reg, "d1", 512);
    join_decode(reg, "d2", 512);
    beat_decode(reg, "d1", 0, 1, 70, 400);
    router_pick_request_t rq = request(600, 10, 0);
    /* the peer's own streams step at the objective: not one prompt token fits beside them */
    beat_decode(reg, "d2", 0, 2, 100, 2000);
    router_pick_t pk = place_at(reg, &pc, &rq, 'l');
    cr_assert_lt(pk.peer_s, 0);
    /* ... nor within the tightest objective of its sequences (40 ms: its 10 ms steps leave room
       under the request's 100 ms, not under theirs less its spread) */
    td_node_load_t l = {.running_seqs = 2, .free_blocks = 1000, .step_ms = 10, .prefill_tok_s = 2000,
                        .tpot_objective_s = 0.04, .step_spread_s = 0.03};
    cr_assert_eq(router_registry_heartbeat(reg, "d2", &l, 0), TD_OK);
    place_at(reg, &pc, &rq, 'l');
    /* its running batch fills its step budget */
    beat_decode(reg, "d2", 0, 512, 10, 2000);
    place_at(reg, &pc, &rq, 'l');
    /* it has no free blocks for the prompt (38) */
    l = (td_node_load_t){.running_seqs = 2, .free_blocks = 37, .step_ms = 10, .prefill_tok_s = 2000};
    cr_assert_eq(router_registry_heartbeat(reg, "d2", &l, 0), TD_OK);
    place_at(reg, &pc, &rq, 'l');
    /* room again: the peer */
    beat_decode(reg, "d2", 0, 2, 10, 2000);
    place_at(reg, &pc, &rq, 'p');
    /* a unified node is no peer (it sends no KV) */
    join(reg, "u", TD_NODE_ROLE_UNIFIED, 8, 1000, 0);
    td_node_load_t ul = {.running_seqs = 50, .free_blocks = 1000, .step_ms = 1, .prefill_tok_s = 1e6};
    cr_assert_eq(router_registry_heartbeat(reg, "u", &ul, 0), TD_OK);
    pk = place_at(reg, &pc, &rq, 'p');
    cr_assert_eq(pk.pair.decode, d1);
    router_registry_destroy(reg);
}

/* Where the ranked decode node has no room for a chunk and its prefill partner is busy, rule 5
 * moves the stream to the next decode node, which prefills it itself; rule 6 keeps the stream
 * where the ranking put it and has the other node prefill it. */
Test(router_policy, follow_a_peer_where_neither_local_nor_remote_can)
{
    router_registry_t *reg = mkreg();
    router_policy_config_t pc = follow();
    int p = join(reg, "p", TD_NODE_ROLE_PREFILL, 8, 100, 0);
    int d1 = join_decode(reg, "d1", 512), d2 = join_decode(reg, "d2", 512);
    beat_rate(reg, "p", 8000, 0, 100, 1000, 0); /* busy past max_prefill_wait_s */
    beat_decode(reg, "d1", 0, 2, 100, 800);      /* no room within the objective */
    beat_decode(reg, "d2", 0, 3, 20, 800);
    router_pick_request_t rq = request(32, 10, 0);
    router_pick_t pk;
    router_policy_config_t cond = conditional();
    (void)p;
    cr_assert_eq(router_policy_pick(reg, &cond, &rq, &pk), TD_OK);
    cr_assert(pk.pair.decode == d2 && pk.pair.prefill == d2);
    pk = place_at(reg, &pc, &rq, 'p');
    cr_assert(pk.pair.prefill == d2 && pk.pair.decode == d1);
    router_registry_destroy(reg);
}

/* With no prefill node a decode node whose own streams pass the objective still prefills a
 * prompt it is given, at the one token a step its scheduler then feeds
 * (TD_DECODE_PAST_OBJECTIVE_CHUNK): priced so, a peer with room wins, where chunks the node
 * would not run (511 tokens: 0.46 s) kept the prompt there for a minute of one-token steps. */
Test(router_policy, a_decode_node_past_its_objective_prices_its_prompt_at_a_token_a_step)
{
    router_registry_t *reg = mkreg();
    int d1 = join_decode(reg, "d1", 512), d2 = join_decode(reg, "d2", 512);
    beat_decode(reg, "d1", 0, 1, 100, 4000); /* its stream's step is the objective itself */
    beat_decode(reg, "d2", 0, 2, 50, 400);   /* room for 20 prompt tokens a step */
    router_pick_request_t rq = request(600, 10, 0);
    router_policy_config_t cond = conditional();
    router_pick_t pk = place(reg, &cond, &rq, true, ROUTER_PLACE_NO_PREFILL);
    cr_assert(pk.pair.decode == d1 && pk.pair.prefill == d1);
    cr_assert_eq(pk.local_chunk, TD_DECODE_PAST_OBJECTIVE_CHUNK);
    cr_assert_float_eq(pk.local_s, 600 * (0.1 + 1 / 4000.0), 1e-9);
    router_policy_config_t pc = follow();
    pk = place_at(reg, &pc, &rq, 'p');
    cr_assert(pk.pair.decode == d1 && pk.pair.prefill == d2, "the peer with room prefills it");
    cr_assert_lt(pk.peer_s, 4.0);
    router_registry_destroy(reg);
}

Test(router_policy, prefill_policy_names)
{
    router_prefill_policy_t p;
    cr_assert_eq(router_prefill_policy_parse("follow", &p), TD_OK);
    cr_assert_eq(p, ROUTER_PREFILL_FOLLOW);
    cr_assert_eq(router_prefill_policy_parse("conditional", &p), TD_OK);
    cr_assert_eq(p, ROUTER_PREFILL_CONDITIONAL);
    cr_assert_eq(router_prefill_policy_parse("disaggregated", &p), TD_OK);
    cr_assert_eq(p, ROUTER_PREFILL_DISAGGREGATED);
    p = ROUTER_PREFILL_CONDITIONAL;
    cr_assert_eq(router_prefill_policy_parse("colocated", &p), TD_ERR_INVALID);
    cr_assert_eq(p, ROUTER_PREFILL_CONDITIONAL, "a refused name changes nothing");
    cr_assert(strstr(td_last_error(), "disaggregated") && strstr(td_last_error(), "conditional"));
    for (int r = 0; r < ROUTER_PLACE_REASONS; r++)
        cr_assert(strcmp(router_place_reason_name((router_place_reason_t)r), "?"), "reason %d has no name", r);
}
