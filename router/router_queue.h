/*
 * router_queue: the router's admission queue. A request that finds no decode node with
 * room (or the router at its max-active bound) waits here until a node has room, its
 * deadline passes, or its client cancels. Order: higher priority first, then arrival
 * order (FIFO) within a priority; a request put back (its Admit was refused) keeps its
 * original place because the order key is (priority, sequence number) fixed at arrival.
 * The queue is bounded: a push into a full queue is refused (the router answers
 * RESOURCE_EXHAUSTED at once).
 *
 * Intrusive (a td_list): the caller embeds a router_queue_entry_t in its request and owns
 * that memory; the queue never allocates, so it cannot leak and push cannot fail for want
 * of memory. Time is passed in (nanoseconds on any monotonic clock).
 *
 * Threads: one thread (the router's loop) uses a queue. No I/O, no clock.
 */
#ifndef ROUTER_QUEUE_H
#define ROUTER_QUEUE_H

#include <stdbool.h>
#include <stdint.h>

#include "td_list.h"
#include "td_status.h"

typedef struct router_queue_entry {
    td_list_t link;      /* private: in a queue's entries while queued */
    int32_t priority;    /* higher is served first */
    uint64_t seq;        /* arrival order, set by the first push */
    int64_t deadline_ns; /* 0 = none */
    int64_t enqueued_ns; /* when the entry was first queued */
    bool has_seq;        /* private: seq assigned */
} router_queue_entry_t;

typedef struct router_queue {
    td_list_t entries;   /* router_queue_entry_t.link, the next to serve first */
    int32_t len;
    int32_t cap;
    uint64_t next_seq;
} router_queue_t;

/* An empty queue holding at most `cap` entries (cap >= 0; 0 refuses every push). The queue
 * holds its own list head: it is not moved (copied) while it holds entries. */
void router_queue_init(router_queue_t *q, int32_t cap);

/* Zeroes an entry before its first push (it has no arrival number yet). */
void router_queue_entry_init(router_queue_entry_t *e);

/*
 * Queues `e` (not queued now) with this priority and deadline. The first push of an entry
 * gives it the next arrival number and enqueued_ns = now_ns; a later push (the entry was
 * popped, then put back) keeps both, so it returns to its place. Errors (quiet, e is
 * untouched): TD_ERR_EXHAUSTED when the queue is full.
 */
td_status_t router_queue_push(router_queue_t *q, router_queue_entry_t *e, int32_t priority,
                              int64_t deadline_ns, int64_t now_ns);

/* The entry to serve next, or NULL when empty; it stays queued. */
router_queue_entry_t *router_queue_peek(const router_queue_t *q);

/* Removes and returns the entry to serve next, or NULL when empty. */
router_queue_entry_t *router_queue_pop(router_queue_t *q);

/* Removes `e` wherever it is (client cancel); a no-op when it is not queued. */
void router_queue_remove(router_queue_t *q, router_queue_entry_t *e);

/* Removes and returns one entry whose deadline is <= now_ns (the one served soonest among
 * them), or NULL when none has expired. Call until NULL. O(len). */
router_queue_entry_t *router_queue_pop_expired(router_queue_t *q, int64_t now_ns);

/* Whether e is in a queue now. */
static inline bool router_queue_entry_queued(const router_queue_entry_t *e) { return td_list_linked(&e->link); }

/* Entries queued now. */
static inline int32_t router_queue_len(const router_queue_t *q) { return q->len; }

#endif /* ROUTER_QUEUE_H */
