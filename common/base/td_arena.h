/*
 * td_arena: the one bump allocator, for many small allocations that all end together (a
 * compiled chat template, one render's values, one unpacked protobuf message).
 *
 * Allocations come from chunks taken from malloc, each of `chunk` bytes or of the allocation
 * when that is larger, and are never freed one by one: td_arena_free returns them all. A
 * bound on the bytes taken from malloc keeps what a hostile input can make it allocate
 * bounded: when the next chunk would pass it, the chunk shrinks to the allocation asked for,
 * and an allocation that still does not fit is refused with over_limit set, so the caller
 * can tell the bound (a status the user can act on) from malloc failing (out of memory).
 *
 * Every allocation is aligned to 16 bytes (max_align_t on x86-64 and arm64) and rounded up
 * to a multiple of 16, so the first allocation of an arena sits at the start of its first
 * chunk and the next one 16-byte rounded bytes after it: a user may keep the arena itself
 * in its first allocation and find it again from the second (td_grpc_wire does).
 *
 * The caller owns the td_arena_t; not thread-safe: one thread at a time.
 */
#ifndef TD_ARENA_H
#define TD_ARENA_H

#include <stdbool.h>
#include <stddef.h>

#define TD_ARENA_CHUNK_DEFAULT ((size_t)64 << 10) /* the chunk size when none is given */

typedef struct td_arena_chunk td_arena_chunk_t;

typedef struct td_arena {
    td_arena_chunk_t *head; /* the newest chunk, where allocations come from */
    size_t chunk;           /* bytes of a chunk at least */
    size_t limit;           /* most bytes taken from malloc; 0: no bound */
    size_t total;           /* bytes taken from malloc */
    bool over_limit;        /* the last refusal was the bound, not malloc */
} td_arena_t;

/* An empty arena whose chunks have at least `chunk` bytes (0: TD_ARENA_CHUNK_DEFAULT) and that
 * takes at most `limit` bytes from malloc (0: no bound). Allocates nothing. */
void td_arena_init(td_arena_t *a, size_t chunk, size_t limit);

/* n bytes (n rounded up to 16; n == 0 is 16), 16-byte aligned, uninitialised, valid until
 * td_arena_free. NULL when the bound or malloc refuses; a->over_limit says which. */
void *td_arena_alloc(td_arena_t *a, size_t n);

/* Returns every chunk to malloc; the arena is then empty, with its bound and nothing taken.
 * It reads nothing of the chunks after freeing the first, so the td_arena_t may live inside
 * one of them (then it is gone afterwards). NULL-safe. */
void td_arena_free(td_arena_t *a);

#endif /* TD_ARENA_H */
