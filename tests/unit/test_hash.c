/*
 * test_hash: td_hash against a plain reference, a sorted array of (hash, value) entries,
 * through random puts and removes over few distinct hashes (so entries share hashes and
 * probe runs), deletion in insertion, reverse and random order, probe runs that wrap
 * around the end of the slot array, growth from the smallest table, and the promise that a
 * table made with room for n entries keeps its slots while it holds n. FNV-1a against its
 * published test vectors.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "td_hash.h"

typedef struct entry {
    uint64_t hash, value;
} entry_t;

/* The reference: a multiset of entries kept sorted by (hash, value). */
typedef struct ref {
    entry_t *e;
    size_t n, cap;
} ref_t;

static int cmp_entry(const void *pa, const void *pb)
{
    const entry_t *a = pa, *b = pb;
    if (a->hash != b->hash)
        return a->hash < b->hash ? -1 : 1;
    return a->value < b->value ? -1 : a->value > b->value;
}

static void ref_add(ref_t *r, uint64_t hash, uint64_t value)
{
    if (r->n == r->cap) {
        r->cap = r->cap ? r->cap * 2 : 64;
        r->e = realloc(r->e, r->cap * sizeof *r->e);
        cr_assert(r->e);
    }
    r->e[r->n++] = (entry_t){hash, value};
    qsort(r->e, r->n, sizeof *r->e, cmp_entry);
}

static void ref_remove_at(ref_t *r, size_t i)
{
    memmove(&r->e[i], &r->e[i + 1], (r->n - i - 1) * sizeof *r->e);
    r->n--;
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* The values the table holds under `hash`, sorted. */
static size_t table_values(const td_hash_t *t, uint64_t hash, uint64_t *out, size_t cap)
{
    size_t n = 0;
    for (td_hash_slot_t *s = td_hash_find(t, hash); s; s = td_hash_find_next(t, s)) {
        cr_assert(s->hash == hash);
        cr_assert(n < cap, "more entries under hash %llu than the reference holds", (unsigned long long)hash);
        out[n++] = s->value;
    }
    for (size_t i = 1; i < n; i++)
        for (size_t j = i; j > 0 && out[j - 1] > out[j]; j--) {
            uint64_t x = out[j];
            out[j] = out[j - 1];
            out[j - 1] = x;
        }
    return n;
}

/* The table holds exactly the reference's entries: per hash the same values, the same
 * count in all, and a walk over every slot that finds each entry once. */
static void check_equal(const td_hash_t *t, const ref_t *r, uint64_t n_hashes, uint64_t hash_base)
{
    cr_assert_eq(t->n, r->n);
    uint64_t got[512];
    size_t i = 0;
    for (uint64_t k = 0; k < n_hashes; k++) {
        uint64_t hash = hash_base + k;
        size_t n = table_values(t, hash, got, 512);
        size_t j = 0;
        while (i < r->n && r->e[i].hash < hash)
            i++;
        for (; i < r->n && r->e[i].hash == hash; i++, j++) {
            cr_assert(j < n, "hash %llu: table has %zu values, reference more", (unsigned long long)hash, n);
            cr_assert_eq(got[j], r->e[i].value, "hash %llu value %zu", (unsigned long long)hash, j);
        }
        cr_assert_eq(j, n, "hash %llu: table has %zu values, reference %zu", (unsigned long long)hash, n, j);
    }
    size_t walked = 0;
    TD_HASH_FOREACH(s, t)
    {
        cr_assert(td_hash_find_value(t, s->hash, s->value) != NULL);
        walked++;
    }
    cr_assert_eq(walked, r->n);
    cr_assert_leq(t->n, (t->mask + 1) / 2, "load above 1/2");
}

static void random_ops(size_t reserve, uint64_t n_hashes, uint64_t hash_base, int n_ops, uint64_t seed)
{
    td_hash_t t;
    cr_assert_eq(td_hash_init(&t, reserve), TD_OK);
    ref_t r = {0};
    uint64_t s = seed, next_value = 1;
    for (int op = 0; op < n_ops; op++) {
        uint64_t x = rng_next(&s);
        if (x % 100 < 55 || r.n == 0) { /* put, a little more often than remove: the table grows */
            uint64_t hash = hash_base + (rng_next(&s) % n_hashes);
            uint64_t value = (x >> 20) % 4 == 0 && r.n ? r.e[rng_next(&s) % r.n].value : next_value++;
            cr_assert_eq(td_hash_put(&t, hash, value), TD_OK);
            ref_add(&r, hash, value);
        } else if (x % 100 < 90) { /* remove an entry that is there */
            size_t i = rng_next(&s) % r.n;
            cr_assert(td_hash_remove(&t, r.e[i].hash, r.e[i].value));
            ref_remove_at(&r, i);
        } else { /* remove one that is not */
            uint64_t hash = hash_base + (rng_next(&s) % n_hashes);
            cr_assert_not(td_hash_remove(&t, hash, next_value + 1000));
        }
        if (op % 97 == 0 || op == n_ops - 1)
            check_equal(&t, &r, n_hashes, hash_base);
    }
    /* empty it in random order */
    while (r.n) {
        size_t i = rng_next(&s) % r.n;
        cr_assert(td_hash_remove(&t, r.e[i].hash, r.e[i].value));
        ref_remove_at(&r, i);
        if (r.n % 53 == 0)
            check_equal(&t, &r, n_hashes, hash_base);
    }
    cr_assert_eq(t.n, 0);
    TD_HASH_FOREACH(sl, &t)
    cr_assert_fail("an emptied table still has an entry");
    td_hash_free(&t);
    free(r.e);
}

Test(hash, random_ops_with_shared_hashes_match_the_reference)
{
    random_ops(0, 40, 0, 20000, 0x9e3779b97f4a7c15ull);
}

Test(hash, random_ops_with_mostly_distinct_hashes_match_the_reference)
{
    random_ops(0, 100000, 0, 20000, 12345);
    random_ops(64, 2000, 0xfffffffffffff000ull, 20000, 777); /* hashes near 2^64 */
}

Test(hash, probe_runs_that_wrap_around_the_array_survive_removal_in_every_order)
{
    /* Hashes whose home is the last slot of a 16-slot table (shift 60): the run wraps. */
    uint64_t last_home[8], n = 0;
    for (uint64_t h = 0; n < 8; h++)
        if (((h * 0x9E3779B97F4A7C15ull) >> 60) == 15)
            last_home[n++] = h;
    for (int order = 0; order < 3; order++) {
        td_hash_t t;
        cr_assert_eq(td_hash_init(&t, 8), TD_OK);
        cr_assert_eq(t.mask, 15);
        for (uint64_t i = 0; i < 8; i++)
            cr_assert_eq(td_hash_put(&t, last_home[i], i), TD_OK);
        for (uint64_t k = 0; k < 8; k++) {
            uint64_t i = order == 0 ? k : order == 1 ? 7 - k : (k * 3) % 8;
            cr_assert(td_hash_remove(&t, last_home[i], i));
            cr_assert_null(td_hash_find(&t, last_home[i]));
            for (uint64_t m = 0; m < 8; m++) {
                bool gone = false;
                for (uint64_t kk = 0; kk <= k; kk++)
                    gone |= m == (order == 0 ? kk : order == 1 ? 7 - kk : (kk * 3) % 8);
                td_hash_slot_t *s = td_hash_find(&t, last_home[m]);
                cr_assert(gone ? s == NULL : s != NULL && s->value == m, "order %d step %llu entry %llu", order,
                          (unsigned long long)k, (unsigned long long)m);
            }
        }
        cr_assert_eq(t.n, 0);
        td_hash_free(&t);
    }
}

Test(hash, grows_from_the_smallest_table_and_keeps_every_entry)
{
    td_hash_t t;
    cr_assert_eq(td_hash_init(&t, 0), TD_OK);
    cr_assert_eq(t.mask, 15);
    for (uint64_t i = 0; i < 100000; i++) {
        cr_assert_eq(td_hash_put(&t, i * 7919, i), TD_OK);
        cr_assert_leq(t.n, (t.mask + 1) / 2);
    }
    cr_assert_eq(t.mask + 1, 262144); /* the smallest power of two at load <= 1/2 */
    for (uint64_t i = 0; i < 100000; i++) {
        td_hash_slot_t *s = td_hash_find(&t, i * 7919);
        cr_assert(s && s->value == i && !td_hash_find_next(&t, s));
    }
    cr_assert_null(td_hash_find(&t, 7));
    td_hash_free(&t);
    td_hash_free(&t); /* freeing twice is a no-op */
    cr_assert_null(td_hash_find(&t, 0));
}

Test(hash, a_table_sized_at_creation_never_moves_its_slots)
{
    td_hash_t t;
    cr_assert_eq(td_hash_init(&t, 1000), TD_OK);
    td_hash_slot_t *slots = t.slots;
    uint64_t s = 99;
    for (int round = 0; round < 50; round++) {
        for (uint64_t i = 0; i < 1000; i++)
            cr_assert_eq(td_hash_put(&t, rng_next(&s), i), TD_OK);
        cr_assert_eq(t.slots, slots, "round %d: the table moved while holding what it was sized for", round);
        while (t.n) {
            td_hash_slot_t *first = NULL;
            TD_HASH_FOREACH(sl, &t)
            if (!first)
                first = sl;
            td_hash_remove_slot(&t, first);
        }
    }
    td_hash_free(&t);
}

Test(hash, values_can_be_rewritten_in_place)
{
    td_hash_t t;
    cr_assert_eq(td_hash_init(&t, 4), TD_OK);
    cr_assert_eq(td_hash_put(&t, 42, 1), TD_OK);
    td_hash_find(&t, 42)->value = 2;
    cr_assert_eq(td_hash_find(&t, 42)->value, 2);
    cr_assert_not(td_hash_remove(&t, 42, 1));
    cr_assert(td_hash_remove(&t, 42, 2));
    td_hash_free(&t);
}

Test(hash, fnv1a64_matches_the_published_vectors)
{
    /* from the FNV reference test suite (isthe.com/chongo/tech/comp/fnv) */
    cr_assert_eq(td_fnv1a64(TD_FNV1A64_INIT, "", 0), 0xcbf29ce484222325ull);
    cr_assert_eq(td_fnv1a64(TD_FNV1A64_INIT, "a", 1), 0xaf63dc4c8601ec8cull);
    cr_assert_eq(td_fnv1a64(TD_FNV1A64_INIT, "foobar", 6), 0x85944171f73967e8ull);
    /* pieces fed in order hash their concatenation */
    cr_assert_eq(td_fnv1a64(td_fnv1a64(TD_FNV1A64_INIT, "foo", 3), "bar", 3), 0x85944171f73967e8ull);
}
