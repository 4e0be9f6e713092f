/*
 * td_hash: linear probing at load <= 1/2 with backward-shift deletion, Fibonacci hashing
 * for the home slot, and FNV-1a (see td_hash.h for the contract and why).
 */
#include "td_hash.h"

#include <stdlib.h>

#include "td_util.h"

#define PHI64 0x9E3779B97F4A7C15ull /* 2^64 / golden ratio */
#define MIN_CAP 16

static size_t home(const td_hash_t *t, uint64_t hash)
{
    return (size_t)((hash * PHI64) >> t->shift);
}

/* A fresh, empty slot array of `cap` (a power of two) slots. */
static td_status_t alloc_slots(size_t cap, td_hash_slot_t **slots_p)
{
    td_hash_slot_t *slots = malloc(cap * sizeof *slots);
    if (!slots)
        return td_errorf_quiet(TD_ERR_NOMEM, "hash table: out of memory for %zu slots", cap);
    for (size_t i = 0; i < cap; i++)
        slots[i] = (td_hash_slot_t){.hash = 0, .value = TD_HASH_EMPTY};
    *slots_p = slots;
    return TD_OK;
}

static unsigned log2_size(size_t cap)
{
    unsigned b = 0;
    while (((size_t)1 << b) < cap)
        b++;
    return b;
}

/* Smallest capacity that holds n entries at load <= 1/2. */
static size_t cap_for(size_t n)
{
    size_t cap = MIN_CAP;
    while (cap / 2 < n)
        cap *= 2;
    return cap;
}

/* Puts (hash, value) into a table known to have room. */
static void place(td_hash_t *t, uint64_t hash, uint64_t value)
{
    size_t i = home(t, hash);
    while (t->slots[i].value != TD_HASH_EMPTY)
        i = (i + 1) & t->mask;
    t->slots[i] = (td_hash_slot_t){.hash = hash, .value = value};
    t->n++;
}

td_status_t td_hash_init(td_hash_t *t, size_t n)
{
    *t = (td_hash_t){0};
    if (n > SIZE_MAX / 4 / sizeof(td_hash_slot_t))
        return td_errorf_quiet(TD_ERR_NOMEM, "hash table: %zu entries is too many", n);
    size_t cap = cap_for(n);
    td_status_t st = alloc_slots(cap, &t->slots);
    if (st)
        return st;
    t->mask = cap - 1;
    t->shift = 64 - log2_size(cap);
    return TD_OK;
}

void td_hash_free(td_hash_t *t)
{
    if (!t)
        return;
    free(t->slots);
    *t = (td_hash_t){0};
}

static td_status_t grow(td_hash_t *t)
{
    size_t old_cap = t->mask + 1;
    if (old_cap > SIZE_MAX / 2 / sizeof(td_hash_slot_t))
        return td_errorf_quiet(TD_ERR_NOMEM, "hash table: cannot grow past %zu slots", old_cap);
    td_hash_slot_t *old = t->slots, *slots = NULL;
    td_status_t st = alloc_slots(old_cap * 2, &slots);
    if (st)
        return st;
    t->slots = slots;
    t->mask = old_cap * 2 - 1;
    t->shift--;
    t->n = 0;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i].value != TD_HASH_EMPTY)
            place(t, old[i].hash, old[i].value);
    free(old);
    return TD_OK;
}

td_status_t td_hash_put(td_hash_t *t, uint64_t hash, uint64_t value)
{
    TD_ASSERT(t->slots && value != TD_HASH_EMPTY);
    if (t->n + 1 > (t->mask + 1) / 2) {
        td_status_t st = grow(t);
        if (st)
            return st;
    }
    place(t, hash, value);
    return TD_OK;
}

/* The first entry with `hash` at or after slot i of its probe run, or NULL. */
static td_hash_slot_t *scan(const td_hash_t *t, uint64_t hash, size_t i)
{
    for (;; i = (i + 1) & t->mask) {
        td_hash_slot_t *s = &t->slots[i];
        if (s->value == TD_HASH_EMPTY)
            return NULL;
        if (s->hash == hash)
            return s;
    }
}

td_hash_slot_t *td_hash_find(const td_hash_t *t, uint64_t hash)
{
    if (!t->slots)
        return NULL;
    return scan(t, hash, home(t, hash));
}

td_hash_slot_t *td_hash_find_next(const td_hash_t *t, const td_hash_slot_t *s)
{
    return scan(t, s->hash, ((size_t)(s - t->slots) + 1) & t->mask);
}

td_hash_slot_t *td_hash_find_value(const td_hash_t *t, uint64_t hash, uint64_t value)
{
    td_hash_slot_t *s = td_hash_find(t, hash);
    while (s && s->value != value)
        s = td_hash_find_next(t, s);
    return s;
}

void td_hash_remove_slot(td_hash_t *t, td_hash_slot_t *s)
{
    TD_ASSERT(s->value != TD_HASH_EMPTY);
    size_t hole = (size_t)(s - t->slots);
    for (size_t j = (hole + 1) & t->mask; t->slots[j].value != TD_HASH_EMPTY; j = (j + 1) & t->mask) {
        size_t h = home(t, t->slots[j].hash);
        /* The entry at j may fill the hole when the hole lies cyclically in [h, j): a
         * lookup from h still passes the hole before it would reach j. */
        if (((j - h) & t->mask) >= ((j - hole) & t->mask)) {
            t->slots[hole] = t->slots[j];
            hole = j;
        }
    }
    t->slots[hole] = (td_hash_slot_t){.hash = 0, .value = TD_HASH_EMPTY};
    t->n--;
}

bool td_hash_remove(td_hash_t *t, uint64_t hash, uint64_t value)
{
    td_hash_slot_t *s = td_hash_find_value(t, hash, value);
    if (!s)
        return false;
    td_hash_remove_slot(t, s);
    return true;
}

uint64_t td_fnv1a64(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}
