/*
 * td_arena: a bump allocator over a list of chunks, with a bound (td_arena.h).
 */
#include "td_arena.h"

#include <stdalign.h>
#include <stdint.h>
#include <stdlib.h>

#define ALIGN 16

struct td_arena_chunk {
    td_arena_chunk_t *next; /* older */
    size_t used, cap;       /* bytes of data[] */
    alignas(ALIGN) unsigned char data[];
};

void td_arena_init(td_arena_t *a, size_t chunk, size_t limit)
{
    *a = (td_arena_t){.chunk = chunk ? chunk : TD_ARENA_CHUNK_DEFAULT, .limit = limit};
}

void *td_arena_alloc(td_arena_t *a, size_t n)
{
    a->over_limit = false;
    if (n > SIZE_MAX / 2)
        return NULL; /* no chunk could hold it: malloc would refuse it too */
    n = n ? (n + ALIGN - 1) & ~(size_t)(ALIGN - 1) : ALIGN;
    td_arena_chunk_t *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t left = a->limit ? a->limit - a->total : SIZE_MAX;
        if (n > left) {
            a->over_limit = true;
            return NULL;
        }
        size_t cap = n > a->chunk ? n : a->chunk;
        if (cap > left)
            cap = n; /* near the bound: only what was asked */
        if (cap > SIZE_MAX - sizeof *c || !(c = malloc(sizeof *c + cap)))
            return NULL;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
        a->total += cap;
    }
    void *p = c->data + c->used;
    c->used += n;
    return p;
}

void td_arena_free(td_arena_t *a)
{
    if (!a)
        return;
    td_arena_chunk_t *c = a->head;
    a->head = NULL;
    a->total = 0;
    a->over_limit = false;
    while (c) {
        td_arena_chunk_t *next = c->next;
        free(c);
        c = next;
    }
}
