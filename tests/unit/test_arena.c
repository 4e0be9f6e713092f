/*
 * test_arena: td_arena, the one bump allocator. Allocations are 16-byte aligned and
 * rounded to 16, the second right after the first (what td_grpc_wire's header relies on);
 * what was written stays across chunk changes; chunks have the size asked for, or the
 * allocation's when larger; the bound is kept to the byte, a chunk shrinking to the request
 * near it, and a refusal says it was the bound; free
 * returns everything, even when the arena lives in its own first chunk (the sanitizer
 * build checks nothing is read after it is freed).
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "td_arena.h"

Test(arena, aligned_rounded_and_consecutive)
{
    td_arena_t a;
    td_arena_init(&a, 0, 0);
    uint8_t *p = td_arena_alloc(&a, 40), *q = td_arena_alloc(&a, 1), *r = td_arena_alloc(&a, 0);
    cr_assert(p && q && r);
    cr_assert_eq((uintptr_t)p % 16, 0);
    cr_assert_eq(q, p + 48, "40 bytes take 48");
    cr_assert_eq(r, q + 16, "1 byte takes 16, and 0 bytes a distinct 16");
    cr_assert_eq(a.total, TD_ARENA_CHUNK_DEFAULT, "one chunk of the default size");
    td_arena_free(&a);
    cr_assert_eq(a.total, 0);
    cr_assert_null(a.head);
    td_arena_free(&a); /* empty: a no-op */
    td_arena_free(NULL);
}

Test(arena, chunks_keep_what_was_written)
{
    td_arena_t a;
    td_arena_init(&a, 1024, 0);
    uint32_t *v[200];
    for (uint32_t i = 0; i < 200; i++) {
        v[i] = td_arena_alloc(&a, 100 * sizeof *v[i]);
        cr_assert_not_null(v[i]);
        cr_assert_eq((uintptr_t)v[i] % 16, 0);
        for (uint32_t k = 0; k < 100; k++)
            v[i][k] = i * 1000 + k;
    }
    for (uint32_t i = 0; i < 200; i++)
        for (uint32_t k = 0; k < 100; k++)
            cr_assert_eq(v[i][k], i * 1000 + k);
    /* 400 bytes take 416: two in a chunk of 1 KiB, 100 chunks */
    cr_assert_eq(a.total, (size_t)100 << 10, "total %zu", a.total);
    uint8_t *big = td_arena_alloc(&a, (size_t)1 << 20); /* larger than a chunk: a chunk of its own */
    cr_assert_not_null(big);
    memset(big, 7, (size_t)1 << 20);
    cr_assert_eq(a.total, ((size_t)100 << 10) + ((size_t)1 << 20));
    td_arena_free(&a);
}

Test(arena, the_bound_is_kept_and_named)
{
    td_arena_t a;
    td_arena_init(&a, 4096, 10000);
    cr_assert_not_null(td_arena_alloc(&a, 4096));
    cr_assert_eq(a.total, 4096);
    cr_assert_not_null(td_arena_alloc(&a, 5000)); /* larger than a chunk: 5008 */
    cr_assert_eq(a.total, 4096 + 5008);
    cr_assert_null(td_arena_alloc(&a, 1000), "896 bytes are left");
    cr_assert(a.over_limit, "refused by the bound, not by malloc");
    /* a chunk of 4096 would pass the bound: it shrinks to the 896 asked */
    cr_assert_not_null(td_arena_alloc(&a, 896), "exactly what is left");
    cr_assert_not(a.over_limit);
    cr_assert_eq(a.total, 10000);
    cr_assert_null(td_arena_alloc(&a, SIZE_MAX - 8), "a size no chunk can hold");
    td_arena_free(&a);
    cr_assert_eq(a.limit, 10000, "free keeps the bound");
    cr_assert_not_null(td_arena_alloc(&a, 9000), "and the arena serves again");
    td_arena_free(&a);
}

typedef struct self_hosted {
    td_arena_t arena;
    int tag;
} self_hosted_t;

Test(arena, lives_in_its_own_first_chunk)
{
    td_arena_t tmp;
    td_arena_init(&tmp, 256, 0);
    self_hosted_t *h = td_arena_alloc(&tmp, sizeof *h);
    cr_assert_not_null(h);
    h->arena = tmp;
    h->tag = 42;
    for (int i = 0; i < 64; i++) /* several more chunks, the first one last in the list */
        cr_assert_not_null(td_arena_alloc(&h->arena, 100));
    cr_assert_eq(h->tag, 42);
    td_arena_free(&h->arena);
}
