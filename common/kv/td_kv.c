/*
 * td_kv: block accounting for the paged KV cache (see td_kv.h for the contract and
 * docs/kv-cache.md for the design).
 *
 * Per block we keep a reference count, a state (free / used / cached) and, when the block
 * is registered in the prefix cache, its key: the chained hash, the hash of the block
 * before it and a copy of its tokens. Lookups compare the predecessor hash and the tokens,
 * not just the 64-bit hash, so a hash collision cannot make two different blocks share.
 *
 * Structures, all sized at creation so that steady-state operations never allocate in
 * the cache (sequences grow their own tables):
 *   free stack   ids of free blocks; popping gives ascending ids from a fresh pool so
 *                that first allocations are contiguous (transfers coalesce them)
 *   LRU list     a td_list of cached blocks (one node per block), front = least recent
 *   hash table   a td_hash from a block's chained hash to its id, sized for every block at
 *                creation so it never grows; at most one registered block per hash value
 */
#include "td_kv.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "td_hash.h"
#include "td_list.h"
#include "td_util.h"

enum { BLOCK_FREE = 0, BLOCK_USED = 1, BLOCK_CACHED = 2, BLOCK_HELD = 3 /* not usable yet: td_kv_hold */ };

struct td_kv_cache {
    int32_t n_blocks;
    int32_t block_size;
    bool prefix_cache;

    int32_t *refs;        /* [n_blocks] reference count */
    uint8_t *state;       /* [n_blocks] BLOCK_* */
    uint8_t *holder;      /* [n_blocks] td_kv_holder_t of every reference (NONE at 0 refs) */
    bool *registered;     /* [n_blocks] in the hash table */
    uint64_t *hash;       /* [n_blocks] chained hash (valid when registered) */
    uint64_t *prev_hash;  /* [n_blocks] predecessor's chained hash (valid when registered) */
    int32_t *key_tokens;  /* [n_blocks][block_size] tokens (valid when registered); NULL
                             without prefix caching */

    int32_t *free_stack;  /* [n_blocks] free ids; top at free_stack[n_free - 1] */
    int32_t n_free;
    int32_t n_usable;     /* blocks [n_usable, n_blocks) are held back (td_kv_hold) */

    td_list_t *lru_node;  /* [n_blocks] a cached block's place in lru */
    td_list_t lru;        /* cached blocks, least recently used first */
    int32_t n_cached;

    td_hash_t table;      /* registered blocks: chained hash -> block id */

    uint64_t prefix_lookups;
    uint64_t prefix_hits;
    uint64_t evictions;
    uint64_t window_released;

    /* Serializes every public operation (the kv_* functions below assume it is held):
     * the decode node leases blocks on its loop thread while its engine runs on the
     * compute thread. Uncontended it costs ~20 ns per call, a few calls per sequence per
     * step. Not part of the logical state, so const readers lock it too. */
    pthread_mutex_t mu;
};

static void kv_lock(const td_kv_cache_t *c)
{
    pthread_mutex_lock((pthread_mutex_t *)&c->mu);
}

static void kv_unlock(const td_kv_cache_t *c)
{
    pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
}

/* ---- hashing ---------------------------------------------------------------------- */

/* XXH64 (libxxhash) over the tokens as little-endian 32-bit words, seeded with the
 * predecessor's hash: fast, well distributed, and the same value on every node for the
 * same prefix (test_kv pins known answers). The words are hashed where they lie, so the
 * host must be little-endian. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
               "block hashes are defined over little-endian token words: convert them first");

uint64_t td_kv_block_hash(uint64_t prev, const int32_t *tokens, int32_t block_size)
{
    return XXH64(tokens, (size_t)block_size * sizeof(int32_t), prev);
}

/* ---- hash table ------------------------------------------------------------------- */

static int32_t table_find(const td_kv_cache_t *c, uint64_t h)
{
    const td_hash_slot_t *sl = td_hash_find(&c->table, h);
    return sl ? (int32_t)sl->value : -1;
}

static void table_insert(td_kv_cache_t *c, int32_t id)
{
    td_status_t st = td_hash_put(&c->table, c->hash[id], (uint64_t)id);
    TD_ASSERT(st == TD_OK); /* sized for every block at creation: it never grows */
}

static void table_remove(td_kv_cache_t *c, int32_t id)
{
    bool found = td_hash_remove(&c->table, c->hash[id], (uint64_t)id);
    TD_ASSERT(found);
}

static void unregister_block(td_kv_cache_t *c, int32_t id)
{
    TD_ASSERT(c->registered[id]);
    table_remove(c, id);
    c->registered[id] = false;
}

/* ---- block lists ------------------------------------------------------------------ */

static void lru_push_tail(td_kv_cache_t *c, int32_t id)
{
    td_list_push_back(&c->lru, &c->lru_node[id]);
    c->n_cached++;
}

static void lru_remove(td_kv_cache_t *c, int32_t id)
{
    td_list_remove(&c->lru_node[id]);
    c->n_cached--;
}

static int32_t lru_id(const td_kv_cache_t *c, const td_list_t *n)
{
    return (int32_t)(n - c->lru_node);
}

/* Takes one block: the free list first, else evicts the least recently used cached block.
 * The caller has checked availability. */
static int32_t take_block(td_kv_cache_t *c, td_kv_holder_t holder)
{
    int32_t id;
    if (c->n_free > 0) {
        id = c->free_stack[--c->n_free];
    } else {
        TD_ASSERT(!td_list_empty(&c->lru));
        id = lru_id(c, td_list_first(&c->lru));
        lru_remove(c, id);
        unregister_block(c, id);
        c->evictions++;
    }
    TD_ASSERT(c->refs[id] == 0 && c->holder[id] == TD_KV_HOLDER_NONE);
    c->refs[id] = 1;
    c->state[id] = BLOCK_USED;
    c->holder[id] = (uint8_t)holder;
    return id;
}

static void check_id(const td_kv_cache_t *c, int32_t id)
{
    TD_ASSERT(id >= 0 && id < c->n_blocks);
}

static const char *holder_name(int h)
{
    static const char *const name[] = {"nobody", "sequences", "the caller", "a transfer lease",
                                       "a landed transfer"};
    return h >= 0 && h < (int)TD_ARRAY_LEN(name) ? name[h] : "an unknown holder";
}

/* Every reference operation names who performs it; a block whose references are someone
 * else's is a bug in the caller (an over-release, a second owner), stopped here at the first
 * wrong call rather than at the double free it would cause later. One byte compared: free. */
static void holder_assert(const td_kv_cache_t *c, int32_t id, td_kv_holder_t who, const char *what)
{
    if (c->holder[id] == (uint8_t)who && c->state[id] == BLOCK_USED && c->refs[id] > 0)
        return;
    fprintf(stderr, "tandem: kv block %d: %s by %s, but its %d references are held by %s (state %d)\n", id, what,
            holder_name((int)who), c->refs[id], holder_name(c->holder[id]), c->state[id]);
    td_assert_fail("a block's references are released and passed only by their holder", __FILE__, __LINE__);
}

/* ---- cache ------------------------------------------------------------------------ */

td_status_t td_kv_cache_create(const td_kv_config_t *cfg, td_kv_cache_t **cache_p)
{
    if (cfg->n_blocks <= 0 || cfg->block_size <= 0)
        return td_errorf(TD_ERR_INVALID, "kv cache: n_blocks %d and block_size %d must be positive",
                         cfg->n_blocks, cfg->block_size);
    if (cfg->n_blocks > (1 << 28) || cfg->block_size > (1 << 16))
        return td_errorf(TD_ERR_INVALID,
                         "kv cache: n_blocks %d or block_size %d too large (limits 2^28, 2^16)",
                         cfg->n_blocks, cfg->block_size);
    td_kv_cache_t *c = calloc(1, sizeof *c);
    if (!c)
        return td_errorf(TD_ERR_NOMEM, "kv cache: out of memory");
    pthread_mutex_init(&c->mu, NULL);
    size_t n = (size_t)cfg->n_blocks;
    c->n_blocks = cfg->n_blocks;
    c->block_size = cfg->block_size;
    c->prefix_cache = cfg->prefix_cache;
    c->refs = calloc(n, sizeof *c->refs);
    c->state = calloc(n, sizeof *c->state);
    c->holder = calloc(n, sizeof *c->holder);
    c->registered = calloc(n, sizeof *c->registered);
    c->hash = calloc(n, sizeof *c->hash);
    c->prev_hash = calloc(n, sizeof *c->prev_hash);
    c->free_stack = malloc(n * sizeof *c->free_stack);
    c->lru_node = malloc(n * sizeof *c->lru_node);
    if (cfg->prefix_cache)
        c->key_tokens = malloc(n * (size_t)cfg->block_size * sizeof *c->key_tokens);
    if (!c->refs || !c->state || !c->holder || !c->registered || !c->hash || !c->prev_hash || !c->free_stack ||
        !c->lru_node || (cfg->prefix_cache && !c->key_tokens) || td_hash_init(&c->table, n)) {
        td_kv_cache_destroy(c);
        return td_errorf(TD_ERR_NOMEM, "kv cache: out of memory for %d blocks", cfg->n_blocks);
    }
    for (int32_t i = 0; i < c->n_blocks; i++) {
        c->free_stack[i] = c->n_blocks - 1 - i; /* pops 0, 1, 2, ... */
        td_list_init(&c->lru_node[i]);
    }
    c->n_free = c->n_blocks;
    c->n_usable = c->n_blocks;
    td_list_init(&c->lru);
    *cache_p = c;
    return TD_OK;
}

void td_kv_cache_destroy(td_kv_cache_t *cache)
{
    if (!cache)
        return;
    free(cache->refs);
    free(cache->state);
    free(cache->holder);
    free(cache->registered);
    free(cache->hash);
    free(cache->prev_hash);
    free(cache->key_tokens);
    free(cache->free_stack);
    free(cache->lru_node);
    td_hash_free(&cache->table);
    pthread_mutex_destroy(&cache->mu);
    free(cache);
}

int32_t td_kv_block_size(const td_kv_cache_t *cache)
{
    return cache->block_size;
}

static int32_t kv_available(const td_kv_cache_t *cache)
{
    return cache->n_free + cache->n_cached;
}

static void kv_get_stats(const td_kv_cache_t *cache, td_kv_stats_t *stats)
{
    stats->n_blocks = cache->n_blocks;
    stats->free = cache->n_free;
    stats->cached = cache->n_cached;
    stats->held = cache->n_blocks - cache->n_usable;
    stats->used = cache->n_usable - cache->n_free - cache->n_cached;
    stats->prefix_lookups = cache->prefix_lookups;
    stats->prefix_hits = cache->prefix_hits;
    stats->evictions = cache->evictions;
    stats->window_released = cache->window_released;
}

static td_status_t kv_alloc_blocks(td_kv_cache_t *cache, td_kv_holder_t holder, int32_t n, int32_t *ids)
{
    /* sequences take blocks through reserve; NONE holds nothing */
    TD_ASSERT(holder == TD_KV_HOLDER_CALLER || holder == TD_KV_HOLDER_LEASE || holder == TD_KV_HOLDER_LANDED);
    if (n < 0)
        return td_errorf(TD_ERR_INVALID, "kv cache: cannot allocate %d blocks", n);
    if (n > kv_available(cache))
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "kv cache: %d blocks requested, %d available", n,
                               kv_available(cache));
    for (int32_t i = 0; i < n; i++)
        ids[i] = take_block(cache, holder);
    return TD_OK;
}

static void kv_ref_block(td_kv_cache_t *cache, int32_t id, td_kv_holder_t holder)
{
    check_id(cache, id);
    TD_ASSERT(cache->state[id] != BLOCK_FREE); /* a reference to a free block is a bug */
    if (cache->state[id] == BLOCK_CACHED) {
        lru_remove(cache, id);
        cache->state[id] = BLOCK_USED;
        cache->holder[id] = (uint8_t)holder;
    } else {
        holder_assert(cache, id, holder, "referenced");
    }
    cache->refs[id]++;
}

static void kv_unref_block(td_kv_cache_t *cache, int32_t id, td_kv_holder_t holder)
{
    check_id(cache, id);
    holder_assert(cache, id, holder, "released"); /* a double free too: its holder is nobody */
    if (--cache->refs[id] > 0)
        return;
    cache->holder[id] = TD_KV_HOLDER_NONE;
    if (cache->registered[id]) {
        cache->state[id] = BLOCK_CACHED;
        lru_push_tail(cache, id);
    } else {
        cache->state[id] = BLOCK_FREE;
        cache->free_stack[cache->n_free++] = id;
    }
}

static int32_t kv_block_refs(const td_kv_cache_t *cache, int32_t id)
{
    check_id(cache, id);
    return cache->refs[id];
}

/* ---- sequences -------------------------------------------------------------------- */

void td_kv_seq_init(td_kv_seq_t *seq)
{
    memset(seq, 0, sizeof *seq);
}

/* Drops references from the end so that a sequence's later blocks reach the LRU list
 * first and are evicted before the blocks their chain depends on. */
static void release_blocks_from(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t first)
{
    for (int32_t i = seq->n_blocks - 1; i >= TD_MAX(first, seq->n_released); i--)
        kv_unref_block(cache, seq->blocks[i], TD_KV_HOLDER_SEQ);
    if (seq->n_blocks > first)
        seq->n_blocks = first;
    if (seq->n_released > first)
        seq->n_released = first;
}

/* Leading blocks go first to last: the LRU list then holds them in chain order. */
static int32_t kv_seq_release_before(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t pos)
{
    const int32_t end = TD_MIN(TD_MIN(pos, seq->n_tokens) / cache->block_size, seq->n_blocks);
    int32_t n = 0;
    for (int32_t i = seq->n_released; i < end; i++, n++) {
        kv_unref_block(cache, seq->blocks[i], TD_KV_HOLDER_SEQ);
        seq->blocks[i] = TD_KV_RELEASED;
    }
    seq->n_released = TD_MAX(seq->n_released, end);
    cache->window_released += (uint64_t)n;
    return n;
}

static void kv_seq_free(td_kv_cache_t *cache, td_kv_seq_t *seq)
{
    if (!seq)
        return;
    release_blocks_from(cache, seq, 0);
    free(seq->blocks);
    free(seq->tokens);
    uint64_t salt = seq->salt;
    td_kv_seq_init(seq);
    seq->salt = salt;
}

static td_status_t grow_i32(int32_t **arr, int32_t *cap, int32_t need, const char *what)
{
    if (need <= *cap)
        return TD_OK;
    int64_t ncap = *cap > 0 ? *cap : 16;
    while (ncap < need)
        ncap *= 2;
    if (ncap > INT32_MAX)
        ncap = INT32_MAX;
    int32_t *na = realloc(*arr, (size_t)ncap * sizeof *na);
    if (!na)
        return td_errorf(TD_ERR_NOMEM, "kv sequence: out of memory growing %s to %lld entries",
                         what, (long long)ncap);
    *arr = na;
    *cap = (int32_t)ncap;
    return TD_OK;
}

static td_status_t seq_grow(td_kv_seq_t *seq, int32_t need_blocks, int32_t need_tokens)
{
    td_status_t st = grow_i32(&seq->blocks, &seq->cap_blocks, need_blocks, "block table");
    if (st == TD_OK)
        st = grow_i32(&seq->tokens, &seq->cap_tokens, need_tokens, "token list");
    return st;
}

static int32_t find_registered(td_kv_cache_t *c, uint64_t h, uint64_t prev, const int32_t *tokens)
{
    int32_t id = table_find(c, h);
    if (id < 0 || c->prev_hash[id] != prev ||
        memcmp(c->key_tokens + (size_t)id * c->block_size, tokens,
               (size_t)c->block_size * sizeof *tokens) != 0)
        return -1;
    return id;
}

/* Hashes every newly full block of seq and registers it unless its hash is already taken
 * (an identical block cached by another sequence stays the registered one; a different
 * block with a colliding hash is simply not cached). */
static void register_full_blocks(td_kv_cache_t *c, td_kv_seq_t *seq)
{
    if (!c->prefix_cache)
        return;
    const int32_t bs = c->block_size;
    int32_t full = TD_MIN(seq->n_tokens / bs, seq->n_blocks);
    for (int32_t i = seq->n_hashed; i < full; i++) {
        const int32_t *toks = seq->tokens + (size_t)i * bs;
        uint64_t prev = i ? seq->last_hash : seq->salt;
        uint64_t h = td_kv_block_hash(prev, toks, bs);
        int32_t id = seq->blocks[i];
        if (!c->registered[id] && table_find(c, h) < 0) {
            c->hash[id] = h;
            c->prev_hash[id] = prev;
            memcpy(c->key_tokens + (size_t)id * bs, toks, (size_t)bs * sizeof *toks);
            c->registered[id] = true;
            table_insert(c, id);
        }
        seq->last_hash = h;
        seq->n_hashed = i + 1;
    }
}

static td_status_t kv_seq_match_prefix(td_kv_cache_t *cache, td_kv_seq_t *seq, const int32_t *tokens,
                                       int32_t n, int32_t max_tokens, int32_t *n_cached_p)
{
    if (seq->n_tokens != 0 || seq->n_blocks != 0)
        return td_errorf(TD_ERR_INVALID, "kv prefix match: the sequence is not empty (%d tokens, %d blocks)",
                         seq->n_tokens, seq->n_blocks);
    if (n < 0)
        return td_errorf(TD_ERR_INVALID, "kv prefix match: negative token count %d", n);
    const int32_t bs = cache->block_size;
    int32_t limit = TD_MIN(n, TD_MAX(max_tokens, 0));
    int32_t max_blocks = cache->prefix_cache ? limit / bs : 0;
    if (max_blocks == 0) {
        *n_cached_p = 0;
        return TD_OK;
    }
    /* Find the chain first so that a failed table growth leaves everything unchanged. */
    td_status_t st = seq_grow(seq, max_blocks, max_blocks * bs);
    if (st != TD_OK)
        return st;
    uint64_t prev = seq->salt;
    int32_t matched = 0;
    for (; matched < max_blocks; matched++) {
        const int32_t *toks = tokens + (size_t)matched * bs;
        uint64_t h = td_kv_block_hash(prev, toks, bs);
        cache->prefix_lookups++;
        int32_t id = find_registered(cache, h, prev, toks);
        if (id < 0)
            break;
        cache->prefix_hits++;
        kv_ref_block(cache, id, TD_KV_HOLDER_SEQ);
        seq->blocks[matched] = id;
        prev = h;
    }
    seq->n_blocks = matched;
    seq->n_tokens = matched * bs;
    memcpy(seq->tokens, tokens, (size_t)seq->n_tokens * sizeof *tokens);
    seq->n_hashed = matched;
    seq->last_hash = prev;
    *n_cached_p = seq->n_tokens;
    return TD_OK;
}

static td_status_t kv_seq_reserve(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t n_total,
                                  td_kv_cow_t *cow)
{
    const int32_t bs = cache->block_size;
    if (n_total < seq->n_tokens)
        return td_errorf(TD_ERR_INVALID, "kv reserve: %d tokens is fewer than the %d committed",
                         n_total, seq->n_tokens);
    if (n_total > INT32_MAX - bs)
        return td_errorf(TD_ERR_INVALID, "kv reserve: %d tokens is too many", n_total);
    int32_t need_blocks = TD_DIV_CEIL(n_total, bs);
    int32_t n_new = TD_MAX(need_blocks - seq->n_blocks, 0);

    /* Blocks already in the table that the tokens [n_tokens, n_total) will be written into:
     * a shared one is replaced by a private block (a copy when it holds committed rows);
     * a private but registered one (possible after truncate) leaves the prefix cache. */
    int32_t first_w = seq->n_tokens / bs;
    int32_t end_w = TD_MIN(need_blocks, seq->n_blocks);
    if (n_total == seq->n_tokens)
        end_w = first_w; /* nothing will be written */
    int32_t n_replace = 0, n_copy = 0;
    for (int32_t i = first_w; i < end_w; i++) {
        if (cache->refs[seq->blocks[i]] > 1) {
            n_replace++;
            if (i * bs < seq->n_tokens)
                n_copy++;
        }
    }
    TD_ASSERT(n_copy <= 1); /* only the block at n_tokens can hold committed rows */
    if (n_copy > 0 && !cow)
        return td_errorf(TD_ERR_INVALID, "kv reserve: a copy-on-write is needed but cow is NULL");
    if (n_new + n_replace > kv_available(cache))
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "kv reserve: %d blocks needed, %d available",
                               n_new + n_replace, kv_available(cache));
    td_status_t st = seq_grow(seq, need_blocks, 0);
    if (st != TD_OK)
        return st;

    td_kv_cow_t out = { 0 };
    for (int32_t i = first_w; i < end_w; i++) {
        int32_t old = seq->blocks[i];
        if (cache->refs[old] > 1) {
            int32_t fresh = take_block(cache, TD_KV_HOLDER_SEQ);
            if (i * bs < seq->n_tokens) {
                out.src[out.n] = old;
                out.dst[out.n] = fresh;
                out.n++;
            }
            kv_unref_block(cache, old, TD_KV_HOLDER_SEQ);
            seq->blocks[i] = fresh;
        } else if (cache->registered[old]) {
            unregister_block(cache, old);
        }
    }
    for (int32_t i = seq->n_blocks; i < need_blocks; i++)
        seq->blocks[i] = take_block(cache, TD_KV_HOLDER_SEQ);
    seq->n_blocks = TD_MAX(seq->n_blocks, need_blocks);
    if (cow)
        *cow = out;
    return TD_OK;
}

static td_status_t kv_seq_commit(td_kv_cache_t *cache, td_kv_seq_t *seq, const int32_t *tokens,
                                 int32_t n)
{
    const int32_t bs = cache->block_size;
    if (n < 0)
        return td_errorf(TD_ERR_INVALID, "kv commit: negative token count %d", n);
    if (n == 0)
        return TD_OK;
    if ((int64_t)seq->n_tokens + n > (int64_t)seq->n_blocks * bs)
        return td_errorf(TD_ERR_INVALID,
                         "kv commit: %d + %d tokens do not fit in %d reserved blocks; call td_kv_seq_reserve first",
                         seq->n_tokens, n, seq->n_blocks);
    for (int32_t i = seq->n_tokens / bs; i <= (seq->n_tokens + n - 1) / bs; i++) {
        int32_t id = seq->blocks[i];
        if (cache->refs[id] != 1 || cache->registered[id])
            return td_errorf(TD_ERR_INVALID,
                             "kv commit: block %d (position %d) is shared or cached; call td_kv_seq_reserve first",
                             id, i);
    }
    td_status_t st = seq_grow(seq, 0, seq->n_tokens + n);
    if (st != TD_OK)
        return st;
    memcpy(seq->tokens + seq->n_tokens, tokens, (size_t)n * sizeof *tokens);
    seq->n_tokens += n;
    register_full_blocks(cache, seq);
    return TD_OK;
}

static void kv_seq_truncate(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t n_keep)
{
    const int32_t bs = cache->block_size;
    if (n_keep < 0)
        n_keep = 0;
    if (n_keep >= seq->n_tokens)
        return;
    TD_ASSERT(n_keep >= seq->n_released * bs); /* the caller's contract: those blocks are gone */
    seq->n_tokens = n_keep;
    release_blocks_from(cache, seq, TD_DIV_CEIL(n_keep, bs));
    /* A registered block cut in the middle will be overwritten: if only we hold it, it
     * leaves the prefix cache now; if it is shared, reserve will copy it first. */
    if (n_keep % bs != 0) {
        int32_t id = seq->blocks[n_keep / bs];
        if (cache->refs[id] == 1 && cache->registered[id])
            unregister_block(cache, id);
    }
    if (seq->n_hashed > n_keep / bs) {
        seq->n_hashed = n_keep / bs;
        uint64_t h = seq->salt;
        for (int32_t i = 0; i < seq->n_hashed; i++)
            h = td_kv_block_hash(h, seq->tokens + (size_t)i * bs, bs);
        seq->last_hash = h;
    }
}

static td_status_t kv_seq_fork(td_kv_cache_t *cache, const td_kv_seq_t *src, td_kv_seq_t *dst)
{
    if (dst->n_tokens != 0 || dst->n_blocks != 0)
        return td_errorf(TD_ERR_INVALID, "kv fork: the destination sequence is not empty");
    /* Only blocks holding committed tokens are shared; blocks src reserved ahead stay its
     * own (dst reserves for itself). */
    int32_t nb = TD_MIN(TD_DIV_CEIL(src->n_tokens, cache->block_size), src->n_blocks);
    td_status_t st = seq_grow(dst, nb, src->n_tokens);
    if (st != TD_OK)
        return st;
    for (int32_t i = 0; i < nb; i++) {
        if (i >= src->n_released)
            kv_ref_block(cache, src->blocks[i], TD_KV_HOLDER_SEQ);
        dst->blocks[i] = src->blocks[i];
    }
    dst->n_released = TD_MIN(src->n_released, nb);
    if (src->n_tokens > 0)
        memcpy(dst->tokens, src->tokens, (size_t)src->n_tokens * sizeof *src->tokens);
    dst->n_blocks = nb;
    dst->n_tokens = src->n_tokens;
    dst->n_hashed = src->n_hashed;
    dst->last_hash = src->last_hash;
    dst->salt = src->salt;
    return TD_OK;
}

static td_status_t kv_seq_adopt(td_kv_cache_t *cache, td_kv_seq_t *seq, const int32_t *blocks,
                                int32_t n_blocks, const int32_t *tokens, int32_t n)
{
    const int32_t bs = cache->block_size;
    if (seq->n_tokens != 0 || seq->n_blocks != 0)
        return td_errorf(TD_ERR_INVALID, "kv adopt: the sequence is not empty");
    if (n_blocks < 0 || n < 0 || (int64_t)n > (int64_t)n_blocks * bs)
        return td_errorf(TD_ERR_INVALID, "kv adopt: %d tokens do not fit in %d blocks of %d", n,
                         n_blocks, bs);
    for (int32_t i = 0; i < n_blocks; i++) {
        int32_t id = blocks[i];
        if (id < 0 || id >= cache->n_blocks || cache->state[id] != BLOCK_USED)
            return td_errorf(TD_ERR_INVALID, "kv adopt: block %d is not an allocated block", id);
        /* Only a caller's or a landed transfer's reference passes to a sequence; a live
         * lease's blocks are the lease's until td_xfer hands them over (a bug, not input). */
        holder_assert(cache, id, cache->holder[id] == TD_KV_HOLDER_LANDED ? TD_KV_HOLDER_LANDED : TD_KV_HOLDER_CALLER,
                      "adopted");
        /* One reference moves: all of a block's references have one holder, so no other
         * may stay behind (and a block the caller wrote into must be its own). */
        if (cache->refs[id] != 1 || (i * bs < n && cache->registered[id]))
            return td_errorf(TD_ERR_INVALID, "kv adopt: block %d is shared (%d references) or cached", id,
                             cache->refs[id]);
    }
    td_status_t st = seq_grow(seq, n_blocks, n);
    if (st != TD_OK)
        return st;
    for (int32_t i = 0; i < n_blocks; i++)
        cache->holder[blocks[i]] = TD_KV_HOLDER_SEQ;
    if (n_blocks > 0)
        memcpy(seq->blocks, blocks, (size_t)n_blocks * sizeof *blocks);
    if (n > 0)
        memcpy(seq->tokens, tokens, (size_t)n * sizeof *tokens);
    seq->n_blocks = n_blocks;
    seq->n_tokens = n;
    seq->n_hashed = 0;
    seq->last_hash = seq->salt;
    register_full_blocks(cache, seq);
    return TD_OK;
}

/* ---- additions -------------------------------------------------------------------- */

int32_t td_kv_chain_hashes(uint64_t salt, const int32_t *tokens, int32_t n, int32_t block_size, uint64_t *hashes)
{
    int32_t nb = block_size > 0 ? n / block_size : 0;
    uint64_t h = salt;
    for (int32_t i = 0; i < nb; i++) {
        h = td_kv_block_hash(h, tokens + (size_t)i * block_size, block_size);
        hashes[i] = h;
    }
    return nb;
}

static td_status_t kv_cache_check(const td_kv_cache_t *c)
{
    int32_t n_free = 0, n_cached = 0, n_reg = 0;
    for (int32_t id = 0; id < c->n_blocks; id++) {
        switch (c->state[id]) {
        case BLOCK_FREE:
            n_free++;
            if (c->refs[id] != 0 || c->registered[id])
                return td_errorf(TD_ERR_INTERNAL, "kv check: free block %d has refs %d registered %d",
                                 id, c->refs[id], c->registered[id]);
            break;
        case BLOCK_CACHED:
            n_cached++;
            if (c->refs[id] != 0 || !c->registered[id])
                return td_errorf(TD_ERR_INTERNAL, "kv check: cached block %d has refs %d registered %d",
                                 id, c->refs[id], c->registered[id]);
            break;
        case BLOCK_USED:
            if (c->refs[id] <= 0 || c->holder[id] == TD_KV_HOLDER_NONE)
                return td_errorf(TD_ERR_INTERNAL, "kv check: used block %d has refs %d, holder %s", id, c->refs[id],
                                 holder_name(c->holder[id]));
            break;
        case BLOCK_HELD:
            if (id < c->n_usable || c->refs[id] != 0 || c->registered[id])
                return td_errorf(TD_ERR_INTERNAL, "kv check: held block %d (usable %d) has refs %d registered %d",
                                 id, c->n_usable, c->refs[id], c->registered[id]);
            break;
        default:
            return td_errorf(TD_ERR_INTERNAL, "kv check: block %d in state %d", id, c->state[id]);
        }
        if (c->state[id] != BLOCK_USED && c->holder[id] != TD_KV_HOLDER_NONE)
            return td_errorf(TD_ERR_INTERNAL, "kv check: unreferenced block %d still held by %s", id,
                             holder_name(c->holder[id]));
        if (c->registered[id]) {
            n_reg++;
            if (table_find(c, c->hash[id]) != id)
                return td_errorf(TD_ERR_INTERNAL, "kv check: registered block %d not found by its hash", id);
        }
    }
    if (n_free != c->n_free || n_cached != c->n_cached)
        return td_errorf(TD_ERR_INTERNAL, "kv check: counted %d free %d cached, recorded %d %d", n_free,
                         n_cached, c->n_free, c->n_cached);
    for (int32_t i = 0; i < c->n_free; i++)
        if (c->state[c->free_stack[i]] != BLOCK_FREE)
            return td_errorf(TD_ERR_INTERNAL, "kv check: free list holds non-free block %d", c->free_stack[i]);
    int32_t walked = 0;
    TD_LIST_FOREACH(n, &c->lru) {
        int32_t id = lru_id(c, n);
        if (id < 0 || id >= c->n_blocks || c->state[id] != BLOCK_CACHED || n->next->prev != n ||
            ++walked > c->n_cached)
            return td_errorf(TD_ERR_INTERNAL, "kv check: lru list broken at block %d", id);
    }
    if (walked != c->n_cached)
        return td_errorf(TD_ERR_INTERNAL, "kv check: lru list has %d blocks, %d cached", walked, c->n_cached);
    int32_t in_table = 0;
    TD_HASH_FOREACH(sl, &c->table)
        in_table++;
    if (in_table != n_reg)
        return td_errorf(TD_ERR_INTERNAL, "kv check: table has %d entries, %d blocks registered", in_table,
                         n_reg);
    return TD_OK;
}

static int32_t kv_seq_blocks_needed(const td_kv_cache_t *cache, const td_kv_seq_t *seq, int32_t n_total)
{
    const int32_t bs = cache->block_size;
    if (n_total <= seq->n_tokens)
        return 0;
    int32_t need_blocks = TD_DIV_CEIL(n_total, bs);
    int32_t n = TD_MAX(need_blocks - seq->n_blocks, 0);
    for (int32_t i = seq->n_tokens / bs; i < TD_MIN(need_blocks, seq->n_blocks); i++)
        if (cache->refs[seq->blocks[i]] > 1)
            n++;
    return n;
}

/* ---- locked entry points ------------------------------------------------------------ */

int32_t td_kv_available(const td_kv_cache_t *cache)
{
    kv_lock(cache);
    int32_t n = kv_available(cache);
    kv_unlock(cache);
    return n;
}

void td_kv_get_stats(const td_kv_cache_t *cache, td_kv_stats_t *stats)
{
    kv_lock(cache);
    kv_get_stats(cache, stats);
    kv_unlock(cache);
}

td_status_t td_kv_alloc_blocks_for(td_kv_cache_t *cache, td_kv_holder_t holder, int32_t n, int32_t *ids)
{
    kv_lock(cache);
    td_status_t st = kv_alloc_blocks(cache, holder, n, ids);
    kv_unlock(cache);
    return st;
}

td_status_t td_kv_alloc_blocks(td_kv_cache_t *cache, int32_t n, int32_t *ids)
{
    return td_kv_alloc_blocks_for(cache, TD_KV_HOLDER_CALLER, n, ids);
}

void td_kv_ref_block(td_kv_cache_t *cache, int32_t id)
{
    kv_lock(cache);
    kv_ref_block(cache, id, TD_KV_HOLDER_CALLER);
    kv_unlock(cache);
}

void td_kv_unref_blocks_for(td_kv_cache_t *cache, td_kv_holder_t holder, const int32_t *ids, int32_t n)
{
    kv_lock(cache);
    for (int32_t i = 0; i < n; i++)
        kv_unref_block(cache, ids[i], holder);
    kv_unlock(cache);
}

void td_kv_unref_block(td_kv_cache_t *cache, int32_t id)
{
    td_kv_unref_blocks_for(cache, TD_KV_HOLDER_CALLER, &id, 1);
}

void td_kv_pass_blocks(td_kv_cache_t *cache, const int32_t *ids, int32_t n, td_kv_holder_t from, td_kv_holder_t to)
{
    TD_ASSERT(to == TD_KV_HOLDER_CALLER || to == TD_KV_HOLDER_LEASE || to == TD_KV_HOLDER_LANDED);
    kv_lock(cache);
    for (int32_t i = 0; i < n; i++) {
        check_id(cache, ids[i]);
        holder_assert(cache, ids[i], from, "passed on");
        TD_ASSERT(cache->refs[ids[i]] == 1); /* the one reference moves; nobody shares a handed-over block */
    }
    for (int32_t i = 0; i < n; i++)
        cache->holder[ids[i]] = (uint8_t)to;
    kv_unlock(cache);
}

td_kv_holder_t td_kv_block_holder(const td_kv_cache_t *cache, int32_t id)
{
    kv_lock(cache);
    check_id(cache, id);
    td_kv_holder_t h = (td_kv_holder_t)cache->holder[id];
    kv_unlock(cache);
    return h;
}

int32_t td_kv_block_refs(const td_kv_cache_t *cache, int32_t id)
{
    kv_lock(cache);
    int32_t n = kv_block_refs(cache, id);
    kv_unlock(cache);
    return n;
}

void td_kv_seq_free(td_kv_cache_t *cache, td_kv_seq_t *seq)
{
    kv_lock(cache);
    kv_seq_free(cache, seq);
    kv_unlock(cache);
}

td_status_t td_kv_seq_match_prefix(td_kv_cache_t *cache, td_kv_seq_t *seq, const int32_t *tokens,
                                   int32_t n, int32_t max_tokens, int32_t *n_cached_p)
{
    kv_lock(cache);
    td_status_t st = kv_seq_match_prefix(cache, seq, tokens, n, max_tokens, n_cached_p);
    kv_unlock(cache);
    return st;
}

td_status_t td_kv_seq_reserve(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t n_total,
                              td_kv_cow_t *cow)
{
    kv_lock(cache);
    td_status_t st = kv_seq_reserve(cache, seq, n_total, cow);
    kv_unlock(cache);
    return st;
}

td_status_t td_kv_seq_commit(td_kv_cache_t *cache, td_kv_seq_t *seq, const int32_t *tokens,
                             int32_t n)
{
    kv_lock(cache);
    td_status_t st = kv_seq_commit(cache, seq, tokens, n);
    kv_unlock(cache);
    return st;
}

void td_kv_seq_truncate(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t n_keep)
{
    kv_lock(cache);
    kv_seq_truncate(cache, seq, n_keep);
    kv_unlock(cache);
}

int32_t td_kv_seq_release_before(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t pos)
{
    kv_lock(cache);
    int32_t n = kv_seq_release_before(cache, seq, pos);
    kv_unlock(cache);
    return n;
}

td_status_t td_kv_seq_fork(td_kv_cache_t *cache, const td_kv_seq_t *src, td_kv_seq_t *dst)
{
    kv_lock(cache);
    td_status_t st = kv_seq_fork(cache, src, dst);
    kv_unlock(cache);
    return st;
}

td_status_t td_kv_seq_adopt(td_kv_cache_t *cache, td_kv_seq_t *seq, const int32_t *blocks,
                            int32_t n_blocks, const int32_t *tokens, int32_t n)
{
    kv_lock(cache);
    td_status_t st = kv_seq_adopt(cache, seq, blocks, n_blocks, tokens, n);
    kv_unlock(cache);
    return st;
}

td_status_t td_kv_hold(td_kv_cache_t *c, int32_t n_usable)
{
    kv_lock(c);
    td_status_t st = TD_OK;
    if (n_usable < 1 || n_usable > c->n_blocks)
        st = td_errorf(TD_ERR_INVALID, "kv cache: hold to %d usable blocks of %d: 1 .. %d", n_usable, c->n_blocks,
                       c->n_blocks);
    else if (c->n_free != c->n_blocks)
        st = td_errorf(TD_ERR_INVALID, "kv cache: hold on a pool in use (%d of %d blocks free)", c->n_free,
                       c->n_blocks);
    else {
        for (int32_t i = 0; i < n_usable; i++)
            c->free_stack[i] = n_usable - 1 - i; /* pops 0, 1, 2, ... */
        for (int32_t id = n_usable; id < c->n_blocks; id++)
            c->state[id] = BLOCK_HELD;
        c->n_free = c->n_usable = n_usable;
    }
    kv_unlock(c);
    return st;
}

int32_t td_kv_unhold(td_kv_cache_t *c, int32_t n_usable)
{
    kv_lock(c);
    n_usable = TD_MIN(n_usable, c->n_blocks);
    for (int32_t id = n_usable - 1; id >= c->n_usable; id--) { /* the lowest on top */
        c->state[id] = BLOCK_FREE;
        c->free_stack[c->n_free++] = id;
    }
    c->n_usable = TD_MAX(c->n_usable, n_usable);
    int32_t n = c->n_usable;
    kv_unlock(c);
    return n;
}

td_status_t td_kv_cache_check(const td_kv_cache_t *c)
{
    kv_lock(c);
    td_status_t st = kv_cache_check(c);
    kv_unlock(c);
    return st;
}

int32_t td_kv_seq_blocks_needed(const td_kv_cache_t *cache, const td_kv_seq_t *seq, int32_t n_total)
{
    kv_lock(cache);
    int32_t n = kv_seq_blocks_needed(cache, seq, n_total);
    kv_unlock(cache);
    return n;
}
