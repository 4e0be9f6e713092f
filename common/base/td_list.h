/*
 * td_list: the one intrusive doubly linked list (the Linux kernel's list_head, libuv's
 * queue). A td_list_t node lives inside the owning struct; the list head is a td_list_t of
 * its own whose prev/next close the circle, so insertion and removal never branch on
 * "first" or "last" and never allocate. TD_CONTAINER_OF gets the owner back from a node.
 *
 *     typedef struct job { int id; td_list_t link; } job_t;
 *     td_list_t jobs;                      td_list_init(&jobs);
 *     td_list_push_back(&jobs, &j->link);
 *     TD_LIST_FOREACH(n, &jobs) { job_t *j = TD_CONTAINER_OF(n, job_t, link); ... }
 *     td_list_remove(&j->link);            (j->link is a list of its own again)
 *
 * A node that td_list_init or td_list_remove left alone is "unlinked" (td_list_linked()
 * is false), so an owner can ask whether it is in a list without a flag beside the node.
 * A list is not thread-safe: its owner's thread (or lock) guards it.
 */
#ifndef TD_LIST_H
#define TD_LIST_H

#include <stdbool.h>
#include <stddef.h>

typedef struct td_list {
    struct td_list *prev, *next;
} td_list_t;

/* The struct of type `type` whose member `member` is at `ptr`. */
#define TD_CONTAINER_OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

/* An empty list head (or an unlinked node). */
static inline void td_list_init(td_list_t *h)
{
    h->prev = h->next = h;
}

static inline bool td_list_empty(const td_list_t *h)
{
    return h->next == h;
}

/* Whether node n is in a list (false after td_list_init or td_list_remove). */
static inline bool td_list_linked(const td_list_t *n)
{
    return n->next != n;
}

/* Links the unlinked node n right after pos (pos: a node in the list or its head). */
static inline void td_list_insert_after(td_list_t *pos, td_list_t *n)
{
    n->prev = pos;
    n->next = pos->next;
    pos->next->prev = n;
    pos->next = n;
}

/* Links the unlinked node n right before pos (pos: a node in the list or its head). */
static inline void td_list_insert_before(td_list_t *pos, td_list_t *n)
{
    td_list_insert_after(pos->prev, n);
}

static inline void td_list_push_front(td_list_t *h, td_list_t *n)
{
    td_list_insert_after(h, n);
}

static inline void td_list_push_back(td_list_t *h, td_list_t *n)
{
    td_list_insert_before(h, n);
}

/* Unlinks n from its list and leaves it unlinked; removing an unlinked node is a no-op. */
static inline void td_list_remove(td_list_t *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    td_list_init(n);
}

/* The first / last node of list h, NULL when it is empty. */
static inline td_list_t *td_list_first(const td_list_t *h)
{
    return h->next == h ? NULL : h->next;
}

static inline td_list_t *td_list_last(const td_list_t *h)
{
    return h->prev == h ? NULL : h->prev;
}

/* The node after / before n in list h, NULL at the end. */
static inline td_list_t *td_list_next(const td_list_t *h, const td_list_t *n)
{
    return n->next == h ? NULL : n->next;
}

static inline td_list_t *td_list_prev(const td_list_t *h, const td_list_t *n)
{
    return n->prev == h ? NULL : n->prev;
}

/* Nodes in list h, counted by walking it (O(n): keep a counter where it is read often). */
static inline size_t td_list_count(const td_list_t *h)
{
    size_t n = 0;
    for (const td_list_t *p = h->next; p != h; p = p->next)
        n++;
    return n;
}

/* Walks list h front to back with td_list_t *n; the body must not remove n. */
#define TD_LIST_FOREACH(n, h) for (td_list_t *n = (h)->next; n != (h); n = n->next)

/* Walks list h back to front with td_list_t *n; the body must not remove n. */
#define TD_LIST_FOREACH_REVERSE(n, h) for (td_list_t *n = (h)->prev; n != (h); n = n->prev)

/* Walks list h front to back; the body may remove (or free the owner of) n, not others. */
#define TD_LIST_FOREACH_SAFE(n, h)                                                       \
    for (td_list_t *n = (h)->next, *n##_next_ = n->next; n != (h); n = n##_next_, n##_next_ = n->next)

#endif /* TD_LIST_H */
