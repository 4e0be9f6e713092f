/*
 * Tests of td_kv, the paged KV block manager: pool accounting, all-or-nothing
 * allocation, reference counts, fork and copy-on-write, the prefix cache (hits, the chain
 * property, LRU eviction), truncate, adopt, and a randomized stress test that simulates
 * the pool's contents to catch any wrong sharing.
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "td_kv.h"
#include "td_util.h"

static td_kv_cache_t *make_cache(int32_t n_blocks, int32_t block_size, bool prefix)
{
    td_kv_config_t cfg = { .n_blocks = n_blocks, .block_size = block_size, .prefix_cache = prefix };
    td_kv_cache_t *c = NULL;
    cr_assert_eq(td_kv_cache_create(&cfg, &c), TD_OK);
    return c;
}

static td_kv_stats_t stats_of(const td_kv_cache_t *c)
{
    td_kv_stats_t s;
    td_kv_get_stats(c, &s);
    cr_assert_eq(s.free + s.cached + s.used + s.held, s.n_blocks);
    cr_assert_eq(td_kv_cache_check(c), TD_OK, "%s", td_last_error());
    return s;
}

/* reserve + commit without sharing (asserts no copy was needed) */
static void append(td_kv_cache_t *c, td_kv_seq_t *s, const int32_t *toks, int32_t n)
{
    td_kv_cow_t cow;
    cr_assert_eq(td_kv_seq_reserve(c, s, s->n_tokens + n, &cow), TD_OK);
    cr_assert_eq(cow.n, 0);
    cr_assert_eq(td_kv_seq_commit(c, s, toks, n), TD_OK);
}

/* One sequence computes toks[0..n) and ends (its full blocks stay cached when the prefix
 * cache is on). */
static void run_and_end(td_kv_cache_t *c, const int32_t *toks, int32_t n)
{
    td_kv_seq_t s;
    td_kv_seq_init(&s);
    append(c, &s, toks, n);
    td_kv_seq_free(c, &s);
}

/* How many of toks[0..n) a new sequence gets from the prefix cache (the sequence is freed
 * again). */
static int32_t cached_prefix(td_kv_cache_t *c, const int32_t *toks, int32_t n)
{
    td_kv_seq_t s;
    td_kv_seq_init(&s);
    int32_t n_cached = -1;
    cr_assert_eq(td_kv_seq_match_prefix(c, &s, toks, n, n, &n_cached), TD_OK);
    td_kv_seq_free(c, &s);
    return n_cached;
}

Test(kv, create_rejects_bad_config)
{
    td_kv_config_t cfg = { .n_blocks = 0, .block_size = 16 };
    td_kv_cache_t *c = NULL;
    cr_assert_eq(td_kv_cache_create(&cfg, &c), TD_ERR_INVALID);
    cfg = (td_kv_config_t){ .n_blocks = 4, .block_size = 0 };
    cr_assert_eq(td_kv_cache_create(&cfg, &c), TD_ERR_INVALID);
    cr_assert_null(c);
    td_kv_cache_destroy(NULL);
}

Test(kv, alloc_free_counts)
{
    td_kv_cache_t *c = make_cache(8, 16, true);
    cr_assert_eq(td_kv_block_size(c), 16);
    cr_assert_eq(td_kv_available(c), 8);
    int32_t ids[8];
    cr_assert_eq(td_kv_alloc_blocks(c, 3, ids), TD_OK);
    /* a fresh pool hands out ascending ids so transfers coalesce */
    cr_assert(ids[0] == 0 && ids[1] == 1 && ids[2] == 2);
    td_kv_stats_t s = stats_of(c);
    cr_assert(s.free == 5 && s.used == 3 && s.cached == 0);
    for (int i = 0; i < 3; i++)
        cr_assert_eq(td_kv_block_refs(c, ids[i]), 1);
    for (int i = 0; i < 3; i++)
        td_kv_unref_block(c, ids[i]);
    s = stats_of(c);
    cr_assert(s.free == 8 && s.used == 0);
    cr_assert_eq(td_kv_alloc_blocks(c, 0, ids), TD_OK);
    td_kv_cache_destroy(c);
}

Test(kv, exhaustion_is_all_or_nothing)
{
    td_kv_cache_t *c = make_cache(8, 4, true);
    int32_t ids[8];
    cr_assert_eq(td_kv_alloc_blocks(c, 5, ids), TD_OK);
    int32_t more[4] = { -7, -7, -7, -7 };
    cr_assert_eq(td_kv_alloc_blocks(c, 4, more), TD_ERR_EXHAUSTED);
    cr_assert_eq(more[0], -7);
    td_kv_stats_t s = stats_of(c);
    cr_assert(s.free == 3 && s.used == 5);

    /* a reserve that does not fit changes neither the sequence nor the pool */
    td_kv_seq_t seq;
    td_kv_seq_init(&seq);
    int32_t toks[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
    append(c, &seq, toks, 8); /* 2 blocks, 1 left */
    td_kv_seq_t before = seq;
    td_kv_cow_t cow = { .n = 99 };
    cr_assert_eq(td_kv_seq_reserve(c, &seq, 8 + 4 * 2, &cow), TD_ERR_EXHAUSTED);
    cr_assert_eq(cow.n, 99);
    cr_assert(seq.n_blocks == before.n_blocks && seq.n_tokens == before.n_tokens);
    s = stats_of(c);
    cr_assert(s.free == 1 && s.used == 7);
    cr_assert_eq(td_kv_seq_reserve(c, &seq, 12, &cow), TD_OK);
    cr_assert_eq(td_kv_available(c), 0);
    td_kv_seq_free(c, &seq);
    for (int i = 0; i < 5; i++)
        td_kv_unref_block(c, ids[i]);
    s = stats_of(c);
    cr_assert_eq(s.used, 0);
    td_kv_cache_destroy(c);
}

/* A decode node holds back the part of its pool not yet resident (decode_warm.c): no
 * allocation gets a held block, they count as neither free nor used, and td_kv_unhold hands
 * them out as they become resident. */
Test(kv, held_blocks_are_never_allocated_until_unheld)
{
    td_kv_cache_t *c = make_cache(16, 4, true);
    cr_assert_eq(td_kv_hold(c, 0), TD_ERR_INVALID);
    cr_assert_eq(td_kv_hold(c, 17), TD_ERR_INVALID);
    cr_assert_eq(td_kv_hold(c, 4), TD_OK);
    td_kv_stats_t s = stats_of(c);
    cr_assert(s.n_blocks == 16 && s.free == 4 && s.used == 0 && s.held == 12, "free %d used %d held %d", s.free,
              s.used, s.held);
    cr_assert_eq(td_kv_available(c), 4);
    cr_assert_eq(td_kv_cache_check(c), TD_OK, "%s", td_last_error());
    int32_t ids[16];
    cr_assert_eq(td_kv_alloc_blocks(c, 5, ids), TD_ERR_EXHAUSTED);
    cr_assert_eq(td_kv_alloc_blocks(c, 4, ids), TD_OK);
    for (int i = 0; i < 4; i++)
        cr_assert_lt(ids[i], 4, "block %d handed out while held", ids[i]);
    cr_assert_eq(td_kv_hold(c, 8), TD_ERR_INVALID, "a hold on a pool in use");
    cr_assert_eq(td_kv_unhold(c, 10), 10);
    cr_assert_eq(td_kv_unhold(c, 6), 10, "unhold never takes blocks back");
    s = stats_of(c);
    cr_assert(s.free == 6 && s.used == 4 && s.held == 6, "free %d used %d held %d", s.free, s.used, s.held);
    cr_assert_eq(td_kv_cache_check(c), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_kv_alloc_blocks(c, 6, ids + 4), TD_OK);
    for (int i = 4; i < 10; i++)
        cr_assert(ids[i] >= 4 && ids[i] < 10, "block %d outside the unheld range", ids[i]);
    cr_assert_eq(td_kv_alloc_blocks(c, 1, ids + 10), TD_ERR_EXHAUSTED);
    cr_assert_eq(td_kv_unhold(c, 99), 16);
    cr_assert_eq(td_kv_available(c), 6);
    for (int i = 0; i < 10; i++)
        td_kv_unref_block(c, ids[i]);
    s = stats_of(c);
    cr_assert(s.free == 16 && s.used == 0 && s.held == 0);
    cr_assert_eq(td_kv_cache_check(c), TD_OK, "%s", td_last_error());
    td_kv_cache_destroy(c);
}

Test(kv, refcounts)
{
    td_kv_cache_t *c = make_cache(4, 4, false);
    int32_t id;
    cr_assert_eq(td_kv_alloc_blocks(c, 1, &id), TD_OK);
    td_kv_ref_block(c, id);
    td_kv_ref_block(c, id);
    cr_assert_eq(td_kv_block_refs(c, id), 3);
    td_kv_unref_block(c, id);
    td_kv_unref_block(c, id);
    cr_assert_eq(stats_of(c).used, 1);
    td_kv_unref_block(c, id);
    cr_assert_eq(td_kv_block_refs(c, id), 0);
    cr_assert_eq(stats_of(c).free, 4);
    td_kv_cache_destroy(c);
}

Test(kv, double_free_aborts, .signal = SIGABRT)
{
    td_kv_cache_t *c = make_cache(4, 4, false);
    int32_t id;
    cr_assert_eq(td_kv_alloc_blocks(c, 1, &id), TD_OK);
    td_kv_unref_block(c, id);
    td_kv_unref_block(c, id);
}

Test(kv, ref_of_free_block_aborts, .signal = SIGABRT)
{
    td_kv_cache_t *c = make_cache(4, 4, false);
    td_kv_ref_block(c, 2);
}

Test(kv, fork_and_copy_on_write)
{
    td_kv_cache_t *c = make_cache(16, 4, true);
    td_kv_seq_t a, b;
    td_kv_seq_init(&a);
    td_kv_seq_init(&b);
    int32_t toks[6] = { 10, 11, 12, 13, 14, 15 };
    append(c, &a, toks, 6);
    cr_assert_eq(a.n_blocks, 2);
    cr_assert_eq(td_kv_seq_fork(c, &a, &b), TD_OK);
    cr_assert_eq(b.n_tokens, 6);
    cr_assert_eq(b.n_blocks, 2);
    cr_assert_eq(memcmp(b.tokens, toks, sizeof toks), 0);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(b.blocks[i], a.blocks[i]);
        cr_assert_eq(td_kv_block_refs(c, a.blocks[i]), 2);
    }
    int32_t shared_partial = a.blocks[1];

    /* b writes position 6, inside the shared partial block: it gets a private copy */
    td_kv_cow_t cow;
    cr_assert_eq(td_kv_seq_reserve(c, &b, 7, &cow), TD_OK);
    cr_assert_eq(cow.n, 1);
    cr_assert_eq(cow.src[0], shared_partial);
    cr_assert_eq(cow.dst[0], b.blocks[1]);
    cr_assert_neq(b.blocks[1], shared_partial);
    cr_assert_eq(b.blocks[0], a.blocks[0]); /* the full block stays shared */
    cr_assert_eq(td_kv_block_refs(c, shared_partial), 1);
    cr_assert_eq(td_kv_block_refs(c, b.blocks[1]), 1);
    cr_assert_eq(td_kv_block_refs(c, a.blocks[0]), 2);
    int32_t t7 = 99;
    cr_assert_eq(td_kv_seq_commit(c, &b, &t7, 1), TD_OK);

    /* a now owns its partial block alone: no copy */
    cr_assert_eq(td_kv_seq_reserve(c, &a, 8, &cow), TD_OK);
    cr_assert_eq(cow.n, 0);
    cr_assert_eq(a.blocks[1], shared_partial);

    /* committing into a shared block without reserve is refused */
    td_kv_seq_t d;
    td_kv_seq_init(&d);
    cr_assert_eq(td_kv_seq_fork(c, &a, &d), TD_OK);
    cr_assert_eq(td_kv_seq_commit(c, &d, &t7, 1), TD_ERR_INVALID);

    td_kv_seq_free(c, &a);
    td_kv_seq_free(c, &b);
    td_kv_seq_free(c, &d);
    cr_assert_eq(stats_of(c).used, 0);
    td_kv_cache_destroy(c);
}

Test(kv, fork_at_block_boundary_needs_no_copy)
{
    td_kv_cache_t *c = make_cache(8, 4, false);
    td_kv_seq_t a, b;
    td_kv_seq_init(&a);
    td_kv_seq_init(&b);
    int32_t toks[4] = { 1, 2, 3, 4 };
    td_kv_cow_t cow;
    cr_assert_eq(td_kv_seq_reserve(c, &a, 12, &cow), TD_OK); /* reserved ahead */
    cr_assert_eq(td_kv_seq_commit(c, &a, toks, 4), TD_OK);
    cr_assert_eq(td_kv_seq_fork(c, &a, &b), TD_OK);
    cr_assert_eq(b.n_blocks, 1); /* only blocks holding tokens are shared */
    cr_assert_eq(td_kv_seq_blocks_needed(c, &b, 5), 1);
    cr_assert_eq(td_kv_seq_reserve(c, &b, 5, &cow), TD_OK);
    cr_assert_eq(cow.n, 0);
    cr_assert_eq(b.n_blocks, 2);
    cr_assert_neq(b.blocks[1], a.blocks[1]);
    td_kv_seq_free(c, &a);
    td_kv_seq_free(c, &b);
    cr_assert_eq(stats_of(c).free, 8);
    td_kv_cache_destroy(c);
}

Test(kv, prefix_cache_hit_after_sequence_ends)
{
    td_kv_cache_t *c = make_cache(8, 4, true);
    td_kv_seq_t a;
    td_kv_seq_init(&a);
    int32_t toks[10] = { 5, 6, 7, 8, 9, 10, 11, 12, 13, 14 };
    append(c, &a, toks, 10);
    cr_assert_eq(a.n_hashed, 2);
    uint64_t hashes[2];
    cr_assert_eq(td_kv_chain_hashes(0, toks, 10, 4, hashes), 2);
    cr_assert_eq(a.last_hash, hashes[1]);
    int32_t b0 = a.blocks[0], b1 = a.blocks[1];
    td_kv_seq_free(c, &a);
    td_kv_stats_t s = stats_of(c);
    cr_assert(s.cached == 2 && s.used == 0 && s.free == 6);

    td_kv_seq_t b;
    td_kv_seq_init(&b);
    int32_t n_cached = -1;
    cr_assert_eq(td_kv_seq_match_prefix(c, &b, toks, 10, 10, &n_cached), TD_OK);
    cr_assert_eq(n_cached, 8);
    cr_assert(b.n_tokens == 8 && b.n_blocks == 2 && b.blocks[0] == b0 && b.blocks[1] == b1);
    cr_assert(b.n_hashed == 2 && b.last_hash == hashes[1]);
    s = stats_of(c);
    cr_assert(s.cached == 0 && s.used == 2 && s.prefix_hits == 2 && s.prefix_lookups == 2);
    append(c, &b, toks + 8, 2);

    /* max_tokens caps the match to whole blocks */
    td_kv_seq_t d;
    td_kv_seq_init(&d);
    cr_assert_eq(td_kv_seq_match_prefix(c, &d, toks, 10, 7, &n_cached), TD_OK);
    cr_assert_eq(n_cached, 4);
    cr_assert_eq(td_kv_block_refs(c, b0), 2);
    /* a non-empty sequence is refused */
    cr_assert_eq(td_kv_seq_match_prefix(c, &d, toks, 10, 10, &n_cached), TD_ERR_INVALID);
    td_kv_seq_free(c, &b);
    td_kv_seq_free(c, &d);
    td_kv_cache_destroy(c);
}

Test(kv, no_prefix_cache_means_no_hits)
{
    td_kv_cache_t *c = make_cache(8, 4, false);
    int32_t toks[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
    run_and_end(c, toks, 8);
    cr_assert_eq(stats_of(c).free, 8);
    cr_assert_eq(cached_prefix(c, toks, 8), 0);
    td_kv_cache_destroy(c);
}

Test(kv, chain_property)
{
    td_kv_cache_t *c = make_cache(16, 4, true);
    int32_t toks[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
    run_and_end(c, toks, 8);

    /* the second block's tokens as a first block: different chain, no hit */
    int32_t second_first[4] = { 5, 6, 7, 8 };
    cr_assert_eq(cached_prefix(c, second_first, 4), 0);
    /* same second block after a different first block: no hit at all */
    int32_t other_prefix[8] = { 9, 9, 9, 9, 5, 6, 7, 8 };
    cr_assert_eq(cached_prefix(c, other_prefix, 8), 0);
    /* same first block, different second: only the first hits */
    int32_t other_second[8] = { 1, 2, 3, 4, 5, 6, 7, 9 };
    cr_assert_eq(cached_prefix(c, other_second, 8), 4);

    /* the hash itself chains */
    uint64_t h1 = td_kv_block_hash(0, toks, 4);
    cr_assert_neq(td_kv_block_hash(0, toks + 4, 4), td_kv_block_hash(h1, toks + 4, 4));
    cr_assert_eq(td_kv_block_hash(h1, toks + 4, 4), td_kv_block_hash(h1, toks + 4, 4));
    td_kv_cache_destroy(c);
}

Test(kv, identical_blocks_register_once)
{
    td_kv_cache_t *c = make_cache(8, 4, true);
    td_kv_seq_t a, b;
    td_kv_seq_init(&a);
    td_kv_seq_init(&b);
    int32_t toks[4] = { 3, 1, 4, 1 };
    append(c, &a, toks, 4);
    append(c, &b, toks, 4); /* computed independently: a second copy */
    cr_assert_neq(a.blocks[0], b.blocks[0]);
    cr_assert_eq(b.n_hashed, 1);
    int32_t kept = a.blocks[0];
    td_kv_seq_free(c, &b);
    td_kv_stats_t s = stats_of(c);
    cr_assert(s.cached == 0 && s.free == 7); /* the duplicate was never registered */
    td_kv_seq_free(c, &a);
    s = stats_of(c);
    cr_assert(s.cached == 1 && s.free == 7);
    int32_t n_cached;
    cr_assert_eq(td_kv_seq_match_prefix(c, &a, toks, 4, 4, &n_cached), TD_OK);
    cr_assert(n_cached == 4 && a.blocks[0] == kept);
    td_kv_seq_free(c, &a);
    td_kv_cache_destroy(c);
}

/* One sequence holding one full block of `tok` repeated, then ended. */
static int32_t cache_one_block(td_kv_cache_t *c, int32_t tok)
{
    td_kv_seq_t s;
    td_kv_seq_init(&s);
    int32_t toks[2] = { tok, tok };
    append(c, &s, toks, 2);
    int32_t id = s.blocks[0];
    td_kv_seq_free(c, &s);
    return id;
}

static int32_t match_len(td_kv_cache_t *c, int32_t tok)
{
    int32_t toks[2] = { tok, tok };
    return cached_prefix(c, toks, 2);
}

Test(kv, lru_eviction_order)
{
    td_kv_cache_t *c = make_cache(4, 2, true);
    int32_t b1 = cache_one_block(c, 1);
    int32_t b2 = cache_one_block(c, 2);
    int32_t b3 = cache_one_block(c, 3);
    cr_assert(b1 != b2 && b2 != b3 && b1 != b3);
    td_kv_stats_t s = stats_of(c);
    cr_assert(s.cached == 3 && s.free == 1);
    /* a hit on 1 revives it; released again it becomes the most recent */
    cr_assert_eq(match_len(c, 1), 2);
    /* LRU order now: 2, 3, 1 */
    int32_t ids[3];
    cr_assert_eq(td_kv_alloc_blocks(c, 1, ids), TD_OK); /* the free block first */
    cr_assert_eq(stats_of(c).evictions, 0);
    cr_assert_eq(td_kv_alloc_blocks(c, 1, ids + 1), TD_OK);
    cr_assert_eq(ids[1], b2);
    s = stats_of(c);
    cr_assert(s.evictions == 1 && s.cached == 2);
    /* eviction removed 2 from the hash table; 3 and 1 are still found */
    cr_assert_eq(match_len(c, 2), 0);
    cr_assert_eq(match_len(c, 3), 2);
    /* LRU order now: 1, 3 */
    cr_assert_eq(td_kv_alloc_blocks(c, 1, ids + 2), TD_OK);
    cr_assert_eq(ids[2], b1);
    cr_assert_eq(match_len(c, 1), 0);
    cr_assert_eq(match_len(c, 3), 2);
    s = stats_of(c);
    cr_assert(s.evictions == 2 && s.cached == 1 && s.used == 3);
    cr_assert_eq(td_kv_available(c), 1);
    td_kv_cache_destroy(c);
}

Test(kv, truncate)
{
    td_kv_cache_t *c = make_cache(8, 4, true);
    td_kv_seq_t a;
    td_kv_seq_init(&a);
    int32_t toks[10] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 };
    append(c, &a, toks, 10);
    cr_assert_eq(stats_of(c).used, 3);
    td_kv_seq_truncate(c, &a, 5);
    cr_assert(a.n_tokens == 5 && a.n_blocks == 2 && a.n_hashed == 1);
    cr_assert_eq(a.last_hash, td_kv_block_hash(0, toks, 4));
    cr_assert_eq(stats_of(c).used, 2);
    /* the cut block leaves the prefix cache: it is about to be overwritten */
    int32_t alt[3] = { 60, 70, 80 };
    append(c, &a, alt, 3);
    cr_assert_eq(a.n_hashed, 2);
    cr_assert_eq(a.tokens[4], 5);
    cr_assert_eq(a.tokens[5], 60);
    td_kv_seq_truncate(c, &a, 100); /* keeping more than held changes nothing */
    cr_assert_eq(a.n_tokens, 8);
    td_kv_seq_free(c, &a);

    cr_assert_eq(cached_prefix(c, toks, 10), 4); /* the old second block is gone */
    int32_t n_cached;
    int32_t now[8] = { 1, 2, 3, 4, 5, 60, 70, 80 };
    cr_assert_eq(td_kv_seq_match_prefix(c, &a, now, 8, 8, &n_cached), TD_OK);
    cr_assert_eq(n_cached, 8);
    td_kv_seq_truncate(c, &a, 0);
    cr_assert(a.n_tokens == 0 && a.n_blocks == 0 && a.n_hashed == 0 && a.last_hash == 0);
    td_kv_seq_free(c, &a);
    td_kv_cache_destroy(c);
}

Test(kv, truncate_into_shared_block_then_copy)
{
    td_kv_cache_t *c = make_cache(8, 4, true);
    td_kv_seq_t a, b;
    td_kv_seq_init(&a);
    td_kv_seq_init(&b);
    int32_t toks[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
    append(c, &a, toks, 8);
    cr_assert_eq(td_kv_seq_fork(c, &a, &b), TD_OK);
    td_kv_seq_truncate(c, &b, 6);
    cr_assert_eq(td_kv_block_refs(c, a.blocks[1]), 2);
    td_kv_cow_t cow;
    cr_assert_eq(td_kv_seq_reserve(c, &b, 7, &cow), TD_OK);
    cr_assert(cow.n == 1 && cow.src[0] == a.blocks[1] && cow.dst[0] == b.blocks[1]);
    int32_t t = 42;
    cr_assert_eq(td_kv_seq_commit(c, &b, &t, 1), TD_OK);
    td_kv_seq_free(c, &b);
    td_kv_seq_free(c, &a);
    cr_assert_eq(cached_prefix(c, toks, 8), 8); /* a's registered block survived b's edit */
    td_kv_cache_destroy(c);
}

Test(kv, adopt)
{
    td_kv_cache_t *c = make_cache(8, 4, true);
    int32_t ids[3];
    cr_assert_eq(td_kv_alloc_blocks(c, 3, ids), TD_OK); /* e.g. a lease */
    int32_t toks[9] = { 1, 2, 3, 4, 5, 6, 7, 8, 9 };
    td_kv_seq_t a;
    td_kv_seq_init(&a);
    cr_assert_eq(td_kv_seq_adopt(c, &a, ids, 3, toks, 20), TD_ERR_INVALID); /* too many tokens */
    cr_assert_eq(td_kv_seq_adopt(c, &a, ids, 3, toks, 9), TD_OK);
    cr_assert(a.n_blocks == 3 && a.n_tokens == 9 && a.n_hashed == 2);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(a.blocks[i], ids[i]);
        cr_assert_eq(td_kv_block_refs(c, ids[i]), 1); /* the reference moved, none added */
    }
    int32_t more[3] = { 10, 11, 12 };
    append(c, &a, more, 3);
    td_kv_seq_free(c, &a);
    td_kv_stats_t s = stats_of(c);
    cr_assert(s.cached == 3 && s.used == 0);
    int32_t n_cached;
    cr_assert_eq(td_kv_seq_match_prefix(c, &a, toks, 9, 9, &n_cached), TD_OK);
    cr_assert_eq(n_cached, 8);
    td_kv_seq_t b;
    td_kv_seq_init(&b);
    /* a block with a second reference cannot be adopted: one would stay behind */
    int32_t two;
    cr_assert_eq(td_kv_alloc_blocks(c, 1, &two), TD_OK);
    td_kv_ref_block(c, two);
    cr_assert_eq(td_kv_seq_adopt(c, &b, &two, 1, toks, 4), TD_ERR_INVALID);
    cr_assert(b.n_blocks == 0 && td_kv_block_refs(c, two) == 2, "a refused adoption changes nothing");
    td_kv_unref_block(c, two);
    td_kv_unref_block(c, two);
    td_kv_seq_free(c, &a);
    cr_assert_eq(td_kv_cache_check(c), TD_OK, "%s", td_last_error());
    td_kv_cache_destroy(c);
}

/* A transfer's blocks through their owners: a lease's (LEASE), handed to the ready callback
 * (LANDED), adopted by a sequence (SEQ), back to nobody when it ends; td_kv_cache_check sees
 * the holders agree with the states at every point. */
Test(kv, holders_follow_a_transfer)
{
    td_kv_cache_t *c = make_cache(8, 4, true);
    int32_t ids[2], toks[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    cr_assert_eq(td_kv_alloc_blocks_for(c, TD_KV_HOLDER_LEASE, 2, ids), TD_OK);
    cr_assert(td_kv_block_holder(c, ids[0]) == TD_KV_HOLDER_LEASE && td_kv_block_holder(c, ids[1]) == TD_KV_HOLDER_LEASE);
    cr_assert_eq(td_kv_cache_check(c), TD_OK, "%s", td_last_error());
    td_kv_pass_blocks(c, ids, 2, TD_KV_HOLDER_LEASE, TD_KV_HOLDER_LANDED);
    cr_assert_eq(td_kv_block_holder(c, ids[1]), TD_KV_HOLDER_LANDED);
    td_kv_seq_t a;
    td_kv_seq_init(&a);
    cr_assert_eq(td_kv_seq_adopt(c, &a, ids, 2, toks, 8), TD_OK);
    cr_assert(td_kv_block_holder(c, ids[0]) == TD_KV_HOLDER_SEQ && td_kv_block_refs(c, ids[0]) == 1);
    td_kv_seq_t b; /* a prefix hit shares them, still the sequences' */
    td_kv_seq_init(&b);
    int32_t hit;
    cr_assert_eq(td_kv_seq_match_prefix(c, &b, toks, 8, 8, &hit), TD_OK);
    cr_assert(hit == 8 && td_kv_block_refs(c, ids[0]) == 2);
    td_kv_seq_free(c, &a);
    td_kv_seq_free(c, &b);
    cr_assert_eq(td_kv_block_holder(c, ids[0]), TD_KV_HOLDER_NONE, "cached: nobody's");
    cr_assert_eq(td_kv_cache_check(c), TD_OK, "%s", td_last_error());
    /* a cached block evicted into a lease is the lease's */
    int32_t all[8];
    cr_assert_eq(td_kv_alloc_blocks_for(c, TD_KV_HOLDER_LEASE, 8, all), TD_OK);
    for (int i = 0; i < 8; i++)
        cr_assert_eq(td_kv_block_holder(c, all[i]), TD_KV_HOLDER_LEASE);
    td_kv_unref_blocks_for(c, TD_KV_HOLDER_LEASE, all, 8);
    cr_assert_eq(td_kv_cache_check(c), TD_OK, "%s", td_last_error());
    td_kv_cache_destroy(c);
}

/* The decode node's double free: a lease releasing blocks it already handed over. Caught at
 * that call, whatever the adopter did since (here nothing: one reference, no free yet). */
Test(kv, lease_release_after_handover_aborts, .signal = SIGABRT)
{
    td_kv_cache_t *c = make_cache(4, 4, false);
    int32_t id;
    cr_assert_eq(td_kv_alloc_blocks_for(c, TD_KV_HOLDER_LEASE, 1, &id), TD_OK);
    td_kv_pass_blocks(c, &id, 1, TD_KV_HOLDER_LEASE, TD_KV_HOLDER_LANDED);
    td_kv_unref_blocks_for(c, TD_KV_HOLDER_LEASE, &id, 1);
}

/* Another holder releasing a lease's block: aborts at that (first) wrong call, before the
 * lease's own release could find the block freed, or worse, someone else's. */
Test(kv, release_of_a_lease_block_by_another_holder_aborts, .signal = SIGABRT)
{
    td_kv_cache_t *c = make_cache(4, 4, false);
    int32_t id;
    cr_assert_eq(td_kv_alloc_blocks_for(c, TD_KV_HOLDER_LEASE, 1, &id), TD_OK);
    td_kv_unref_blocks_for(c, TD_KV_HOLDER_LANDED, &id, 1);
}

/* A sequence adopting a live lease's blocks (before td_xfer handed them over) aborts. */
Test(kv, adopt_of_a_live_lease_aborts, .signal = SIGABRT)
{
    td_kv_cache_t *c = make_cache(4, 4, false);
    int32_t id, toks[4] = {1, 2, 3, 4};
    cr_assert_eq(td_kv_alloc_blocks_for(c, TD_KV_HOLDER_LEASE, 1, &id), TD_OK);
    td_kv_seq_t a;
    td_kv_seq_init(&a);
    td_kv_seq_adopt(c, &a, &id, 1, toks, 4);
}

/* A caller's release of a block its sequence holds (the references are the table's). */
Test(kv, caller_release_of_a_sequence_block_aborts, .signal = SIGABRT)
{
    td_kv_cache_t *c = make_cache(4, 4, false);
    td_kv_seq_t a;
    td_kv_seq_init(&a);
    td_kv_cow_t cow;
    cr_assert_eq(td_kv_seq_reserve(c, &a, 4, &cow), TD_OK);
    td_kv_unref_block(c, a.blocks[0]);
}

static int cmp_u64(const void *x, const void *y)
{
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return (a > b) - (a < b);
}

Test(kv, hash_quality)
{
    /* 200k distinct blocks differing in one token or in the chain: no 64-bit collisions,
     * and the low bits used for table slots are spread evenly */
    enum { N = 200000, BUCKETS = 1024 };
    uint64_t *h = malloc(N * sizeof *h);
    int32_t counts[BUCKETS] = { 0 };
    int32_t toks[16] = { 0 };
    for (int i = 0; i < N; i++) {
        toks[i % 16] = i;
        h[i] = td_kv_block_hash((uint64_t)(i / 16), toks, 16);
        counts[h[i] & (BUCKETS - 1)]++;
    }
    for (int b = 0; b < BUCKETS; b++)
        cr_assert(counts[b] > N / BUCKETS / 2 && counts[b] < N / BUCKETS * 2, "bucket %d: %d", b,
                  counts[b]);
    qsort(h, N, sizeof *h, cmp_u64);
    for (int i = 1; i < N; i++)
        cr_assert_neq(h[i], h[i - 1]);
    free(h);
    /* odd block sizes hash every token */
    int32_t t3[3] = { 1, 2, 3 }, u3[3] = { 1, 2, 4 };
    cr_assert_neq(td_kv_block_hash(0, t3, 3), td_kv_block_hash(0, u3, 3));
}

Test(kv, block_hashes_are_the_same_on_every_node_and_in_every_version)
{
    /* Block hashes travel between nodes (prefix hits at the router, adopted blocks), so
     * they are XXH64 of the tokens as little-endian 32-bit words, seeded with the
     * predecessor's hash, and never change. These values were computed by tandem's own
     * XXH64 before it moved to libxxhash, and block size 16 (seed 0), 3 and 9 were checked
     * against a Python transcription of the xxHash specification. */
    static const struct {
        int32_t block_size;
        uint64_t unseeded, seeded; /* seed 0, seed 0x0123456789abcdef */
    } want[] = {
        {1, 0x822e51211bf08373ull, 0x3457bc8d234b02e4ull},  {2, 0x7d08468841736f4aull, 0x46187738d5a6e3e4ull},
        {3, 0x7edead6417065472ull, 0xc413e9b803b1c6d6ull},  {4, 0xb408a1e04438acfaull, 0x032a65730a28c488ull},
        {7, 0x9e97d0a80349d7d4ull, 0xa0271cbd14caf4c4ull},  {8, 0x73a8d89301867224ull, 0xdc9561698006bd63ull},
        {9, 0xd9b6821a288149eeull, 0x5c4af23d4ec8a131ull},  {15, 0x035fe28403915ceaull, 0xfc951b75c1e94998ull},
        {16, 0xb7e0e8d2663ecafaull, 0x37888226c064c412ull}, {17, 0x0ffe9f4b5d957061ull, 0x4490d8b687655df3ull},
        {32, 0x6e4e9101f2e90b06ull, 0x2be25932b9c3f7c0ull}, {33, 0x95b85e950e773219ull, 0x031388db452f388full},
    };
    int32_t t[40];
    for (int i = 0; i < 40; i++) /* every bit pattern of a word: high bits, sign bit */
        t[i] = (int32_t)((uint32_t)i * 2654435761u ^ (i % 3 == 0 ? 0x80000000u : 0));
    for (size_t k = 0; k < TD_ARRAY_LEN(want); k++) {
        cr_assert_eq(td_kv_block_hash(0, t, want[k].block_size), want[k].unseeded, "block size %d",
                     want[k].block_size);
        cr_assert_eq(td_kv_block_hash(0x0123456789abcdefull, t, want[k].block_size), want[k].seeded,
                     "block size %d, seeded", want[k].block_size);
    }
    uint64_t chain[2];
    cr_assert_eq(td_kv_chain_hashes(0, t, 32, 16, chain), 2);
    cr_assert_eq(chain[0], 0xb7e0e8d2663ecafaull);
    cr_assert_eq(chain[1], 0x6efd72359320ae0dull);
    /* a salt is the first block's seed (the router's and the nodes' salted hashes agree) */
    cr_assert_eq(td_kv_chain_hashes(0x0123456789abcdefull, t, 32, 16, chain), 2);
    cr_assert_eq(chain[0], 0x37888226c064c412ull);
    cr_assert_eq(chain[1], td_kv_block_hash(0x37888226c064c412ull, t + 16, 16));
}

/* A tenant's salt seeds the chain: no hash of a salted chain equals the unsalted one's or
 * another salt's at any block, however long the prompt (docs/security.md "Tenants"). */
Test(kv, salt_changes_every_hash_of_the_chain)
{
    enum { BS = 4, NB = 64 };
    int32_t t[BS * NB + BS - 1];
    for (int i = 0; i < BS * NB + BS - 1; i++)
        t[i] = (int32_t)((uint32_t)i * 2654435761u % 50000u);
    static const uint64_t salts[] = {0, 1, 2, 0x8000000000000000ull, 0x0123456789abcdefull, UINT64_MAX};
    uint64_t h[TD_ARRAY_LEN(salts)][NB];
    for (size_t k = 0; k < TD_ARRAY_LEN(salts); k++)
        cr_assert_eq(td_kv_chain_hashes(salts[k], t, BS * NB + BS - 1, BS, h[k]), NB, "whole blocks only");
    for (size_t k = 0; k < TD_ARRAY_LEN(salts); k++)
        for (size_t j = k + 1; j < TD_ARRAY_LEN(salts); j++)
            for (int b = 0; b < NB; b++)
                cr_assert_neq(h[k][b], h[j][b], "salts %#llx and %#llx agree at block %d",
                              (unsigned long long)salts[k], (unsigned long long)salts[j], b);
    cr_assert_eq(td_kv_chain_hashes(7, t, 3, BS, h[0]), 0, "no full block, no hash");
}

/* Sequences with different salts never share a cached block, whichever way it was cached
 * (commit, adopt), and equal salts do; the salt survives td_kv_seq_free (a preempted
 * sequence that starts again), is copied by fork and reseeds a truncate's rehash. */
Test(kv, salted_sequences_hit_only_their_own_salt)
{
    td_kv_cache_t *c = make_cache(32, 4, true);
    int32_t toks[12] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    const uint64_t sa = 0x1111, sb = 0x2222;
    uint64_t ha[3];
    td_kv_chain_hashes(sa, toks, 12, 4, ha);

    td_kv_seq_t a;
    td_kv_seq_init(&a);
    a.salt = sa;
    append(c, &a, toks, 10);
    cr_assert(a.n_hashed == 2 && a.last_hash == ha[1], "commit registers the salted chain");
    td_kv_seq_free(c, &a);
    cr_assert_eq(a.salt, sa, "free keeps the salt");
    cr_assert(a.n_tokens == 0 && a.n_blocks == 0 && a.n_hashed == 0);

    struct { uint64_t salt; int32_t want; } probe[] = {{sb, 0}, {0, 0}, {sa, 8}};
    for (size_t k = 0; k < TD_ARRAY_LEN(probe); k++) {
        td_kv_seq_t s;
        td_kv_seq_init(&s);
        s.salt = probe[k].salt;
        int32_t n = -1;
        cr_assert_eq(td_kv_seq_match_prefix(c, &s, toks, 12, 12, &n), TD_OK);
        cr_assert_eq(n, probe[k].want, "salt %#llx: %d tokens hit, want %d", (unsigned long long)probe[k].salt, n,
                     probe[k].want);
        td_kv_seq_free(c, &s);
    }
    /* the freed sequence starts again under its salt: it hits what it cached */
    int32_t n = -1;
    cr_assert_eq(td_kv_seq_match_prefix(c, &a, toks, 12, 12, &n), TD_OK);
    cr_assert_eq(n, 8);
    cr_assert_eq(a.last_hash, ha[1]);
    /* fork copies the salt; the fork's third block registers under it */
    td_kv_seq_t f;
    td_kv_seq_init(&f);
    cr_assert_eq(td_kv_seq_fork(c, &a, &f), TD_OK);
    cr_assert_eq(f.salt, sa);
    append(c, &f, toks + 8, 4);
    cr_assert_eq(f.last_hash, ha[2]);
    /* a truncate rehashes from the salt */
    td_kv_seq_truncate(c, &f, 6);
    cr_assert(f.n_hashed == 1 && f.last_hash == ha[0], "rehashed from the salt");
    td_kv_seq_free(c, &f);
    td_kv_seq_free(c, &a);

    /* adopted blocks (KV from a prefill node) register under the adopter's salt */
    int32_t ids[2];
    cr_assert_eq(td_kv_alloc_blocks(c, 2, ids), TD_OK);
    int32_t other[8] = {40, 41, 42, 43, 44, 45, 46, 47};
    td_kv_seq_t d;
    td_kv_seq_init(&d);
    d.salt = sb;
    cr_assert_eq(td_kv_seq_adopt(c, &d, ids, 2, other, 8), TD_OK);
    uint64_t hb[2];
    td_kv_chain_hashes(sb, other, 8, 4, hb);
    cr_assert(d.n_hashed == 2 && d.last_hash == hb[1]);
    td_kv_seq_free(c, &d);
    td_kv_seq_t e;
    td_kv_seq_init(&e);
    e.salt = sa;
    cr_assert_eq(td_kv_seq_match_prefix(c, &e, other, 8, 8, &n), TD_OK);
    cr_assert_eq(n, 0, "another salt's adopted blocks are no hit");
    td_kv_seq_free(c, &e);
    e.salt = sb;
    cr_assert_eq(td_kv_seq_match_prefix(c, &e, other, 8, 8, &n), TD_OK);
    cr_assert_eq(n, 8);
    td_kv_seq_free(c, &e);
    td_kv_seq_init(&e);
    cr_assert_eq(e.salt, 0, "init clears the salt");
    cr_assert_eq(td_kv_cache_check(c), TD_OK, "%s", td_last_error());
    td_kv_cache_destroy(c);
}

/* Sliding window: leading blocks go back early under the usual reference rules, their
   entries read TD_KV_RELEASED, later blocks keep their places, and nothing is dropped twice. */
Test(kv, release_before_window)
{
    td_kv_cache_t *c = make_cache(8, 4, true);
    int32_t toks[14] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
    td_kv_seq_t a, b, f;
    td_kv_seq_init(&a);
    td_kv_seq_init(&b);
    td_kv_seq_init(&f);
    append(c, &a, toks, 10); /* blocks 0, 1 full and registered, block 2 holds 2 tokens */
    int32_t a1 = a.blocks[1], a2 = a.blocks[2];

    /* b shares a's first block through the prefix cache */
    int32_t n_cached = -1;
    cr_assert_eq(td_kv_seq_match_prefix(c, &b, toks, 6, 6, &n_cached), TD_OK);
    cr_assert_eq(n_cached, 4);
    int32_t shared = b.blocks[0];
    cr_assert_eq(td_kv_block_refs(c, shared), 2);

    /* nothing before position 3 is a whole block; position 9 frees blocks 0 and 1 only */
    cr_assert_eq(td_kv_seq_release_before(c, &a, 3), 0);
    cr_assert_eq(td_kv_seq_release_before(c, &a, 9), 2);
    cr_assert(a.n_released == 2 && a.blocks[0] == TD_KV_RELEASED && a.blocks[1] == TD_KV_RELEASED);
    cr_assert(a.blocks[2] == a2 && a.n_blocks == 3 && a.n_tokens == 10);
    cr_assert_eq(td_kv_block_refs(c, shared), 1); /* b keeps it */
    cr_assert_eq(td_kv_block_refs(c, a1), 0);
    td_kv_stats_t s = stats_of(c);
    cr_assert(s.used == 2 && s.cached == 1 && s.window_released == 2, "used %d cached %d", s.used, s.cached);
    /* again, or past the committed tokens: nothing more (block 2 is still being written) */
    cr_assert_eq(td_kv_seq_release_before(c, &a, 9), 0);
    cr_assert_eq(td_kv_seq_release_before(c, &a, 100), 0);

    /* the sequence goes on growing at the same positions; its new full block registers */
    append(c, &a, toks + 10, 4);
    cr_assert_eq(a.n_hashed, 3);
    /* a fork shares only what a still holds */
    cr_assert_eq(td_kv_seq_fork(c, &a, &f), TD_OK);
    cr_assert(f.n_released == 2 && f.blocks[0] == TD_KV_RELEASED && td_kv_block_refs(c, a2) == 2);
    td_kv_seq_free(c, &f);
    td_kv_seq_free(c, &a);
    td_kv_seq_free(c, &b);
    s = stats_of(c);
    cr_assert_eq(s.used, 0);
    /* the whole prompt is still in the prefix cache, chain intact */
    cr_assert_eq(cached_prefix(c, toks, 14), 12);
    td_kv_cache_destroy(c);
}

Test(kv, truncate_into_released_blocks_aborts, .signal = SIGABRT)
{
    td_kv_cache_t *c = make_cache(8, 4, false);
    int32_t toks[10] = {0};
    td_kv_seq_t a;
    td_kv_seq_init(&a);
    append(c, &a, toks, 10);
    td_kv_seq_release_before(c, &a, 8);
    td_kv_seq_truncate(c, &a, 5);
}

/* ---- randomized stress ------------------------------------------------------------ */

enum { S_BLOCKS = 48, S_BS = 4, S_SEQS = 12, S_OPS = 20000 };

typedef struct stress {
    td_kv_cache_t *c;
    td_kv_seq_t seq[S_SEQS];
    int32_t pool[S_BLOCKS][S_BS]; /* simulated KV rows: the token each row holds */
    uint64_t rng;
} stress_t;

static uint32_t rnd(stress_t *st, uint32_t n)
{
    st->rng ^= st->rng << 13;
    st->rng ^= st->rng >> 7;
    st->rng ^= st->rng << 17;
    return (uint32_t)(st->rng % n);
}

/* Tokens from a tiny alphabet so that prefixes repeat and the cache gets hits. */
static void random_tokens(stress_t *st, int32_t *t, int32_t n)
{
    for (int32_t i = 0; i < n; i++)
        t[i] = (int32_t)rnd(st, 3);
}

static void apply_cow(stress_t *st, const td_kv_cow_t *cow)
{
    for (int32_t i = 0; i < cow->n; i++)
        memcpy(st->pool[cow->dst[i]], st->pool[cow->src[i]], sizeof st->pool[0]);
}

/* The engine's part: write K/V rows for the tokens, then commit. */
static void write_and_commit(stress_t *st, td_kv_seq_t *s, const int32_t *t, int32_t n)
{
    for (int32_t i = 0; i < n; i++) {
        int32_t p = s->n_tokens + i;
        st->pool[s->blocks[p / S_BS]][p % S_BS] = t[i];
    }
    cr_assert_eq(td_kv_seq_commit(st->c, s, t, n), TD_OK, "%s", td_last_error());
}

static void check_all(stress_t *st, int op)
{
    int32_t holders[S_BLOCKS] = { 0 };
    int32_t n_held = 0;
    for (int i = 0; i < S_SEQS; i++) {
        td_kv_seq_t *s = &st->seq[i];
        cr_assert_leq(s->n_tokens, s->n_blocks * S_BS);
        cr_assert_leq(s->n_released * S_BS, s->n_tokens);
        for (int32_t b = 0; b < s->n_released; b++)
            cr_assert_eq(s->blocks[b], TD_KV_RELEASED, "op %d seq %d block %d", op, i, b);
        for (int32_t b = s->n_released; b < s->n_blocks; b++)
            if (holders[s->blocks[b]]++ == 0)
                n_held++;
        /* every committed token's row holds that token: nothing shared wrongly */
        for (int32_t p = s->n_released * S_BS; p < s->n_tokens; p++)
            cr_assert_eq(st->pool[s->blocks[p / S_BS]][p % S_BS], s->tokens[p],
                         "op %d seq %d pos %d", op, i, p);
    }
    for (int32_t b = 0; b < S_BLOCKS; b++)
        cr_assert_eq(td_kv_block_refs(st->c, b), holders[b], "op %d block %d", op, b);
    td_kv_stats_t s;
    td_kv_get_stats(st->c, &s);
    cr_assert_eq(s.free + s.cached + s.used, S_BLOCKS, "op %d", op);
    cr_assert_eq(s.used, n_held, "op %d", op);
    cr_assert_eq(td_kv_cache_check(st->c), TD_OK, "op %d: %s", op, td_last_error());
}

Test(kv, randomized_stress, .timeout = 120)
{
    stress_t *st = calloc(1, sizeof *st);
    st->c = make_cache(S_BLOCKS, S_BS, true);
    st->rng = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < S_SEQS; i++)
        td_kv_seq_init(&st->seq[i]);
    int32_t toks[64];
    int n_exhausted = 0, n_hit_tokens = 0, n_cow = 0, n_released = 0;
    for (int op = 0; op < S_OPS; op++) {
        td_kv_seq_t *s = &st->seq[rnd(st, S_SEQS)];
        uint32_t what = rnd(st, 100);
        if (s->n_tokens == 0 && s->n_blocks == 0 && what < 40) {
            /* a new prompt: attach the cached prefix, compute the rest */
            int32_t n = 1 + (int32_t)rnd(st, 24);
            random_tokens(st, toks, n);
            int32_t got = -1;
            cr_assert_eq(td_kv_seq_match_prefix(st->c, s, toks, n, n - 1, &got), TD_OK);
            n_hit_tokens += got;
            td_kv_cow_t cow;
            td_status_t rc = td_kv_seq_reserve(st->c, s, n, &cow);
            if (rc == TD_ERR_EXHAUSTED) {
                n_exhausted++;
            } else {
                cr_assert_eq(rc, TD_OK);
                apply_cow(st, &cow);
                write_and_commit(st, s, toks + got, n - got);
            }
        } else if (s->n_tokens == 0 && s->n_blocks == 0 && what < 60) {
            /* KV computed elsewhere arrives into leased blocks */
            int32_t n = 1 + (int32_t)rnd(st, 16), nb = TD_DIV_CEIL(n, S_BS) + (int32_t)rnd(st, 2);
            int32_t ids[8];
            td_status_t rc = td_kv_alloc_blocks(st->c, nb, ids);
            if (rc == TD_ERR_EXHAUSTED) {
                n_exhausted++;
                continue;
            }
            random_tokens(st, toks, n);
            for (int32_t p = 0; p < n; p++)
                st->pool[ids[p / S_BS]][p % S_BS] = toks[p];
            cr_assert_eq(td_kv_seq_adopt(st->c, s, ids, nb, toks, n), TD_OK);
        } else if (what < 60) {
            /* decode steps (sometimes reserving ahead) */
            int32_t n = 1 + (int32_t)rnd(st, 6), ahead = (int32_t)rnd(st, 2) * S_BS;
            td_kv_seq_t before = *s;
            td_kv_stats_t sb;
            td_kv_get_stats(st->c, &sb);
            td_kv_cow_t cow;
            td_status_t rc = td_kv_seq_reserve(st->c, s, s->n_tokens + n + ahead, &cow);
            if (rc == TD_ERR_EXHAUSTED) {
                n_exhausted++;
                td_kv_stats_t sa;
                td_kv_get_stats(st->c, &sa);
                cr_assert(s->n_blocks == before.n_blocks && s->blocks == before.blocks &&
                          sa.free == sb.free && sa.cached == sb.cached);
            } else {
                cr_assert_eq(rc, TD_OK);
                n_cow += cow.n;
                apply_cow(st, &cow);
                random_tokens(st, toks, n);
                write_and_commit(st, s, toks, n);
                if (rnd(st, 3) == 0) /* a sliding window of 0..7 tokens moved past blocks */
                    n_released += td_kv_seq_release_before(st->c, s, s->n_tokens - (int32_t)rnd(st, 8));
            }
        } else if (what < 72) {
            int32_t lo = s->n_released * S_BS; /* released blocks cannot come back */
            td_kv_seq_truncate(st->c, s, lo + (int32_t)rnd(st, (uint32_t)(s->n_tokens - lo) + 1));
        } else if (what < 85) {
            td_kv_seq_t *d = &st->seq[rnd(st, S_SEQS)];
            if (d != s && d->n_tokens == 0 && d->n_blocks == 0)
                cr_assert_eq(td_kv_seq_fork(st->c, s, d), TD_OK);
        } else {
            td_kv_seq_free(st->c, s);
        }
        check_all(st, op);
    }
    /* the run must have exercised the interesting paths */
    td_kv_stats_t s;
    td_kv_get_stats(st->c, &s);
    cr_assert_gt(n_exhausted, 0);
    cr_assert_gt(n_hit_tokens, 0);
    cr_assert_gt(n_cow, 0);
    cr_assert_gt(s.evictions, 0);
    cr_assert_gt(n_released, 0);
    cr_assert_eq(s.window_released, (uint64_t)n_released);
    for (int i = 0; i < S_SEQS; i++)
        td_kv_seq_free(st->c, &st->seq[i]);
    td_kv_get_stats(st->c, &s);
    cr_assert_eq(s.used, 0);
    td_kv_cache_destroy(st->c);
    free(st);
}
