/*
 * td_hash: the one hash table, and FNV-1a, the one byte-string hash.
 *
 * The table maps a 64-bit hash to 64-bit values (an index, an id, or a pointer cast to
 * uintptr_t). Where the key is an integer of at most 64 bits (a block hash, a lease id, a
 * packed id pair) the hash is the key itself and a match needs no further check; where the
 * key is longer (a string) the caller hashes it (td_fnv1a64) and compares the key that the
 * value leads to, walking td_hash_find / td_hash_find_next over the entries that share the
 * hash. The table does not refuse a second entry with the same hash: a site that wants one
 * value per key looks before it puts.
 *
 * Design (the properties of the tables it replaced):
 *   - open addressing with linear probing over a power-of-two array of {hash, value} slots;
 *     the home slot is Fibonacci hashing of the hash (its top bits after a multiply by
 *     2^64/phi), so sequential keys such as lease ids spread as well as random ones;
 *   - the load stays at or below 1/2, so probe runs stay short (about 1.5 slots for a hit,
 *     2.5 for a miss) and every probe loop ends at an empty slot;
 *   - deletion shifts the rest of the probe run back (no tombstones: lookups never slow
 *     down with churn, and there is nothing to clean up);
 *   - it grows (doubling) only inside td_hash_put, and only when the entry would push the
 *     load over 1/2: a table created with room for n entries (td_hash_init) never
 *     allocates while it holds at most n, so a site sized at creation stays allocation-free.
 * Slot pointers are valid until the next put or remove. Not thread-safe: the owner's
 * thread or lock guards it.
 */
#ifndef TD_HASH_H
#define TD_HASH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

/* The value that marks an empty slot: the one value an entry may not hold. */
#define TD_HASH_EMPTY UINT64_MAX

typedef struct td_hash_slot {
    uint64_t hash;  /* read-only for the caller */
    uint64_t value; /* TD_HASH_EMPTY: the slot is free; the caller may rewrite a found
                       entry's value (not to TD_HASH_EMPTY) in place */
} td_hash_slot_t;

typedef struct td_hash {
    td_hash_slot_t *slots; /* [mask + 1]; NULL before td_hash_init and after td_hash_free */
    size_t mask;           /* capacity - 1; capacity a power of two >= 16 */
    unsigned shift;        /* 64 - log2(capacity): home slot = (hash * phi) >> shift */
    size_t n;              /* entries held */
} td_hash_t;

/*
 * Makes an empty table with room for n entries before it first grows (n = 0: the smallest
 * table). Errors: TD_ERR_NOMEM (not logged: the caller says what the table was for; *t left
 * as a table that holds nothing and can be freed). Release with td_hash_free.
 */
td_status_t td_hash_init(td_hash_t *t, size_t n);

/* Releases the slots; the table is left empty and may be freed again. NULL-safe. */
void td_hash_free(td_hash_t *t);

/*
 * Adds the entry (hash, value); value != TD_HASH_EMPTY. Allocates only when the table must
 * grow to keep its load at or below 1/2. Errors: TD_ERR_NOMEM (not logged, as for
 * td_hash_init; table unchanged).
 */
td_status_t td_hash_put(td_hash_t *t, uint64_t hash, uint64_t value);

/* The first entry with this hash, or NULL. */
td_hash_slot_t *td_hash_find(const td_hash_t *t, uint64_t hash);

/* The next entry with the same hash as `s` (an entry td_hash_find or td_hash_find_next
 * returned), or NULL. */
td_hash_slot_t *td_hash_find_next(const td_hash_t *t, const td_hash_slot_t *s);

/* The first entry with this hash and value, or NULL. */
td_hash_slot_t *td_hash_find_value(const td_hash_t *t, uint64_t hash, uint64_t value);

/* Removes the entry at s (found by one of the finds), moving later entries of its probe
 * run back. */
void td_hash_remove_slot(td_hash_t *t, td_hash_slot_t *s);

/* Removes the entry (hash, value); false when there is none. */
bool td_hash_remove(td_hash_t *t, uint64_t hash, uint64_t value);

/* Walks every entry with td_hash_slot_t *s (in no particular order); the body must not put
 * or remove. */
#define TD_HASH_FOREACH(s, t)                                                  \
    for (td_hash_slot_t *s = (t)->slots; (t)->slots && s <= (t)->slots + (t)->mask; s++) \
        if (s->value != TD_HASH_EMPTY)

/* FNV-1a, 64-bit, over p[0..n) continuing from h: start from TD_FNV1A64_INIT, and feed
 * pieces in order to hash their concatenation. Small and stable: its values are part of
 * what nodes compare (the model fingerprint), so they never change. */
#define TD_FNV1A64_INIT 0xcbf29ce484222325ull
uint64_t td_fnv1a64(uint64_t h, const void *p, size_t n);

#endif /* TD_HASH_H */
