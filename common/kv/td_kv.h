/*
 * td_kv: the paged KV-cache block manager. It does the accounting only (which block
 * belongs to whom); the bytes live in a pool a backend allocated (td_kv_layout.h gives
 * their shape). Used by the engine, the decode node's lease manager and the prefill
 * node's prefix cache.
 *
 * Blocks: ids 0..n_blocks-1, each with a reference count. A block is in exactly one of
 * three states: free (on the free list, ref 0), in use (ref > 0), or cached (ref 0 but
 * holding a full block registered in the prefix cache, on an LRU list; allocation evicts
 * the least recently used cached block only when the free list is empty).
 *
 * Prefix caching: a full block is keyed by a chained hash of its tokens and the hash of
 * the block before it (so equal keys mean equal whole prefixes). A new sequence attaches
 * the longest chain of cached blocks matching its prompt and computes only the rest. The
 * chain starts from the sequence's salt (its tenant's, docs/security.md "Tenants"): blocks
 * cached under one salt are never another salt's hits.
 *
 * Copy-on-write: a block shared by several sequences (fork) is copied before one of them
 * writes into it; td_kv_seq_reserve() reports the copies the caller must perform on the
 * pool bytes before the write.
 *
 * Threads: every operation on a cache is serialized by a mutex inside it, so one cache
 * may be shared between threads (the decode node leases blocks for incoming KV on its
 * loop thread while its engine runs on the compute thread). A td_kv_seq_t is used by one
 * thread at a time.
 */
#ifndef TD_KV_H
#define TD_KV_H

#include <stdbool.h>
#include <stdint.h>

#include "td_status.h"

typedef struct td_kv_cache td_kv_cache_t;

typedef struct td_kv_config {
    int32_t n_blocks;     /* blocks in the pool */
    int32_t block_size;   /* tokens per block */
    bool prefix_cache;    /* keep full blocks for reuse after their sequences end */
} td_kv_config_t;

/* A sequence's view of the cache. Caller-allocated; td_kv_seq_init / td_kv_seq_free. */
typedef struct td_kv_seq {
    int32_t *blocks;      /* [n_blocks] block table, in position order */
    int32_t n_blocks;
    int32_t cap_blocks;
    int32_t n_tokens;     /* tokens whose K/V are in the cache (committed) */
    int32_t *tokens;      /* [n_tokens] the committed tokens (for prefix hashes) */
    int32_t cap_tokens;
    int32_t n_hashed;     /* full blocks already registered in the prefix cache */
    uint64_t last_hash;   /* chained hash of block n_hashed - 1 (unused while n_hashed is 0) */
    uint64_t salt;        /* seeds the chain (0: none, one cache for all). The owner sets it
                             after td_kv_seq_init, before the sequence holds a token;
                             td_kv_seq_free keeps it (a preempted sequence that starts again is
                             still its tenant's), td_kv_seq_fork copies it */
    int32_t n_released;   /* leading blocks given back (sliding window): blocks[0..n_released)
                             are TD_KV_RELEASED; block i still holds positions [i*bs, (i+1)*bs) */
} td_kv_seq_t;

/* A block-table entry whose block was given back (td_kv_seq_release_before). */
#define TD_KV_RELEASED (-1)

/* Pending copy-on-write copies: the caller copies block src[i] to dst[i] in the pool. */
#define TD_KV_MAX_COW 4
typedef struct td_kv_cow {
    int32_t n;
    int32_t src[TD_KV_MAX_COW];
    int32_t dst[TD_KV_MAX_COW];
} td_kv_cow_t;

typedef struct td_kv_stats {
    int32_t n_blocks;
    int32_t free;          /* on the free list */
    int32_t cached;        /* unreferenced but holding a reusable prefix block */
    int32_t used;          /* referenced */
    int32_t held;          /* not usable yet (td_kv_hold): neither free nor used */
    uint64_t prefix_lookups;   /* full blocks looked up by td_kv_seq_match_prefix */
    uint64_t prefix_hits;      /* of those, found */
    uint64_t evictions;
    uint64_t window_released;  /* blocks sequences gave back early (td_kv_seq_release_before) */
} td_kv_stats_t;

/*
 * Who holds a block's references (docs/kv-cache.md "Owners"). All the references of a block
 * have one holder, recorded per block (one byte); every operation that takes, drops or
 * passes a reference names its holder, and a block held by someone else stops the process
 * at that call (TD_ASSERT: a bug in the caller, never input), not at the double free the
 * wrong call would cause later. A block with no reference is held by NONE.
 */
typedef enum td_kv_holder {
    TD_KV_HOLDER_NONE = 0, /* free, cached or held back */
    TD_KV_HOLDER_SEQ,      /* sequences' block tables (td_kv_seq_*; shared by fork and prefix hits) */
    TD_KV_HOLDER_CALLER,   /* td_kv_alloc_blocks / td_kv_ref_block's caller (tests, tools) */
    TD_KV_HOLDER_LEASE,    /* a td_xfer lease: KV may still land in it; only td_xfer releases it */
    TD_KV_HOLDER_LANDED,   /* a landed lease's blocks on their way to a sequence (ready callback,
                              the decode node's command ring): adopted or released, once */
} td_kv_holder_t;

/* Errors: TD_ERR_INVALID for n_blocks <= 0 or block_size <= 0, TD_ERR_NOMEM. */
td_status_t td_kv_cache_create(const td_kv_config_t *cfg, td_kv_cache_t **cache_p);
void td_kv_cache_destroy(td_kv_cache_t *cache);

int32_t td_kv_block_size(const td_kv_cache_t *cache);

/* Blocks an allocation could get right now (free + cached). */
int32_t td_kv_available(const td_kv_cache_t *cache);

void td_kv_get_stats(const td_kv_cache_t *cache, td_kv_stats_t *stats);

/*
 * Allocates n blocks (ref 1 each, held by `holder`: CALLER, LEASE or LANDED) into ids[0..n).
 * All or nothing: TD_ERR_EXHAUSTED (not logged; the caller decides) when fewer than n are
 * available, nothing changed. td_kv_alloc_blocks: for TD_KV_HOLDER_CALLER.
 */
td_status_t td_kv_alloc_blocks_for(td_kv_cache_t *cache, td_kv_holder_t holder, int32_t n, int32_t *ids);
td_status_t td_kv_alloc_blocks(td_kv_cache_t *cache, int32_t n, int32_t *ids);

/* Reference counting of blocks. Unref of the last reference frees the block (or parks it
 * on the LRU list if it holds a registered prefix block). td_kv_ref_block and
 * td_kv_unref_block are the CALLER's, one block; td_kv_unref_blocks_for drops one of
 * `holder`'s references to each of ids[0..n), under one lock. A block not held by `holder`
 * (or free: a double free) aborts. */
void td_kv_ref_block(td_kv_cache_t *cache, int32_t id);
void td_kv_unref_block(td_kv_cache_t *cache, int32_t id);
void td_kv_unref_blocks_for(td_kv_cache_t *cache, td_kv_holder_t holder, const int32_t *ids, int32_t n);
int32_t td_kv_block_refs(const td_kv_cache_t *cache, int32_t id);

/* Hands blocks ids[0..n) over from `from` to `to` (CALLER, LEASE or LANDED): each must be
 * held by `from` with exactly one reference (the one that moves), else the process aborts.
 * td_xfer passes a lease's blocks LEASE -> LANDED when it hands them to its ready callback. */
void td_kv_pass_blocks(td_kv_cache_t *cache, const int32_t *ids, int32_t n, td_kv_holder_t from, td_kv_holder_t to);

/* Who holds block id now (tests, diagnostics). */
td_kv_holder_t td_kv_block_holder(const td_kv_cache_t *cache, int32_t id);

void td_kv_seq_init(td_kv_seq_t *seq);
/* Drops every block reference of seq and frees its arrays; seq is empty again, its salt
 * kept (td_kv_seq_init clears that too). */
void td_kv_seq_free(td_kv_cache_t *cache, td_kv_seq_t *seq);

/*
 * For an empty sequence: attaches the longest run of cached full blocks matching
 * tokens[0..n) (at most max_tokens tokens, rounded down to whole blocks), taking a
 * reference on each, and commits those tokens. *n_cached_p = tokens attached.
 */
td_status_t td_kv_seq_match_prefix(td_kv_cache_t *cache, td_kv_seq_t *seq, const int32_t *tokens,
                                   int32_t n, int32_t max_tokens, int32_t *n_cached_p);

/*
 * Makes room for the sequence to hold n_total tokens: allocates missing blocks and, if
 * the block that the next token goes into is shared (refs > 1), replaces it by a private
 * copy recorded in *cow (the caller copies the bytes before writing). All or nothing:
 * TD_ERR_EXHAUSTED (not logged) leaves seq and cache unchanged.
 */
td_status_t td_kv_seq_reserve(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t n_total,
                              td_kv_cow_t *cow);

/*
 * Records that tokens[0..n) now follow the committed ones (their K/V were written) and
 * registers every newly full block in the prefix cache. Requires reserve first.
 */
td_status_t td_kv_seq_commit(td_kv_cache_t *cache, td_kv_seq_t *seq, const int32_t *tokens,
                             int32_t n);

/* Drops the last n committed tokens (blocks no longer needed are released). n_keep must not
 * reach into blocks given back by td_kv_seq_release_before (asserted: they are gone). */
void td_kv_seq_truncate(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t n_keep);

/*
 * Sliding window: gives back the sequence's leading blocks that hold only positions before
 * `pos` (blocks [n_released, pos / block_size), and never past the committed tokens), which
 * the caller knows no query will read again. Their table entries become TD_KV_RELEASED;
 * every other block keeps its index, so positions and slots do not move. References drop
 * as in td_kv_seq_free: a block another sequence shares stays with it, a registered prefix
 * block whose last reference goes is parked on the LRU list (still matchable, evictable).
 * The prefix hashes (n_hashed, last_hash) are kept, so later blocks still register. Returns
 * the number of blocks given back.
 */
int32_t td_kv_seq_release_before(td_kv_cache_t *cache, td_kv_seq_t *seq, int32_t pos);

/* dst (empty) shares every block of src (refs taken) and copies its tokens; blocks src gave
 * back are given back in dst too. */
td_status_t td_kv_seq_fork(td_kv_cache_t *cache, const td_kv_seq_t *src, td_kv_seq_t *dst);

/*
 * Makes an empty sequence own already-allocated blocks (the one reference of each is
 * transferred from the caller) holding tokens[0..n) computed elsewhere (KV transfer). The
 * blocks must be held by CALLER or LANDED (a live lease's are not the caller's to give:
 * aborts); TD_ERR_INVALID, nothing changed, for a block with more than one reference or a
 * registered one that would be written.
 */
td_status_t td_kv_seq_adopt(td_kv_cache_t *cache, td_kv_seq_t *seq, const int32_t *blocks,
                            int32_t n_blocks, const int32_t *tokens, int32_t n);

/* The chained hash of one full block given its predecessor's hash (the salt, 0 without one,
 * for the first). */
uint64_t td_kv_block_hash(uint64_t prev, const int32_t *tokens, int32_t block_size);

/* ---- additions (td_kv.c owner) ---- */

/*
 * The chained hashes of the full blocks of tokens[0..n), the chain seeded with salt (0: none)
 * as a sequence with that salt registers them (what the router compares with what it sent a
 * node). Writes n / block_size values into hashes and returns that count.
 */
int32_t td_kv_chain_hashes(uint64_t salt, const int32_t *tokens, int32_t n, int32_t block_size, uint64_t *hashes);

/*
 * Blocks td_kv_seq_reserve(cache, seq, n_total, ...) would take from the pool right now
 * (new blocks plus private copies of shared ones), for admission decisions.
 */
int32_t td_kv_seq_blocks_needed(const td_kv_cache_t *cache, const td_kv_seq_t *seq, int32_t n_total);

/*
 * Holds back blocks [n_usable, n_blocks) of a pool no one uses yet (every block free): no
 * allocation gets them until td_kv_unhold. A decode node holds back the part of its pool
 * not yet made resident, so neither its engine nor a sender's transfer ever faults a page
 * of it. TD_ERR_INVALID (n_usable outside 1 .. n_blocks, or a block in use).
 */
td_status_t td_kv_hold(td_kv_cache_t *cache, int32_t n_usable);

/* Makes blocks up to n_usable (at most n_blocks) free; returns the blocks usable now. */
int32_t td_kv_unhold(td_kv_cache_t *cache, int32_t n_usable);

/*
 * Walks every internal structure (free list, LRU list, hash table, counters) and checks
 * they agree. TD_OK, or TD_ERR_INTERNAL with a message naming the first inconsistency.
 * O(n_blocks): for tests and debugging, not the hot path.
 */
td_status_t td_kv_cache_check(const td_kv_cache_t *cache);

#endif /* TD_KV_H */
