/*
 * router_queue: a bounded, intrusive, priority-then-FIFO list (see router_queue.h).
 *
 * A sorted doubly linked list: priorities are few in practice and arrivals come in
 * sequence order, so an insertion that scans back from the tail stops at once for the
 * common case (same priority, newest); a put-back entry scans further, bounded by len.
 */
#include "router_queue.h"

#include <stddef.h>

#include "td_util.h"

void router_queue_init(router_queue_t *q, int32_t cap)
{
    *q = (router_queue_t){.cap = cap > 0 ? cap : 0};
}

void router_queue_entry_init(router_queue_entry_t *e)
{
    *e = (router_queue_entry_t){0};
}

/* True when a is served before b. */
static bool before(const router_queue_entry_t *a, const router_queue_entry_t *b)
{
    if (a->priority != b->priority)
        return a->priority > b->priority;
    return a->seq < b->seq;
}

td_status_t router_queue_push(router_queue_t *q, router_queue_entry_t *e, int32_t priority,
                              int64_t deadline_ns, int64_t now_ns)
{
    TD_ASSERT(!e->queued);
    if (q->len >= q->cap)
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "admission queue full (%d)", q->cap);
    if (!e->has_seq) {
        e->seq = q->next_seq++;
        e->enqueued_ns = now_ns;
        e->has_seq = true;
    }
    e->priority = priority;
    e->deadline_ns = deadline_ns;
    router_queue_entry_t *after = q->tail; /* e goes right after `after` (NULL: at the head) */
    while (after && before(e, after))
        after = after->prev;
    e->prev = after;
    e->next = after ? after->next : q->head;
    if (e->next)
        e->next->prev = e;
    else
        q->tail = e;
    if (after)
        after->next = e;
    else
        q->head = e;
    e->queued = true;
    q->len++;
    return TD_OK;
}

router_queue_entry_t *router_queue_peek(const router_queue_t *q)
{
    return q->head;
}

void router_queue_remove(router_queue_t *q, router_queue_entry_t *e)
{
    if (!e->queued)
        return;
    if (e->prev)
        e->prev->next = e->next;
    else
        q->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        q->tail = e->prev;
    e->prev = e->next = NULL;
    e->queued = false;
    q->len--;
}

router_queue_entry_t *router_queue_pop(router_queue_t *q)
{
    router_queue_entry_t *e = q->head;
    if (e)
        router_queue_remove(q, e);
    return e;
}

router_queue_entry_t *router_queue_pop_expired(router_queue_t *q, int64_t now_ns)
{
    for (router_queue_entry_t *e = q->head; e; e = e->next)
        if (e->deadline_ns && e->deadline_ns <= now_ns) {
            router_queue_remove(q, e);
            return e;
        }
    return NULL;
}
