/*
 * router_queue: a bounded, intrusive, priority-then-FIFO list (see router_queue.h).
 *
 * A sorted td_list: priorities are few in practice and arrivals come in
 * sequence order, so an insertion that scans back from the tail stops at once for the
 * common case (same priority, newest); a put-back entry scans further, bounded by len.
 */
#include "router_queue.h"

#include <stddef.h>

#include "td_util.h"

#define ENTRY(n) TD_CONTAINER_OF(n, router_queue_entry_t, link)

void router_queue_init(router_queue_t *q, int32_t cap)
{
    *q = (router_queue_t){.cap = cap > 0 ? cap : 0};
    td_list_init(&q->entries);
}

void router_queue_entry_init(router_queue_entry_t *e)
{
    *e = (router_queue_entry_t){0};
    td_list_init(&e->link);
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
    TD_ASSERT(!router_queue_entry_queued(e));
    if (q->len >= q->cap)
        return td_errorf_quiet(TD_ERR_EXHAUSTED, "admission queue full (%d)", q->cap);
    if (!e->has_seq) {
        e->seq = q->next_seq++;
        e->enqueued_ns = now_ns;
        e->has_seq = true;
    }
    e->priority = priority;
    e->deadline_ns = deadline_ns;
    td_list_t *after = td_list_last(&q->entries); /* e goes right after `after` (NULL: at the head) */
    while (after && before(e, ENTRY(after)))
        after = td_list_prev(&q->entries, after);
    td_list_insert_after(after ? after : &q->entries, &e->link);
    q->len++;
    return TD_OK;
}

router_queue_entry_t *router_queue_peek(const router_queue_t *q)
{
    td_list_t *n = td_list_first(&q->entries);
    return n ? ENTRY(n) : NULL;
}

void router_queue_remove(router_queue_t *q, router_queue_entry_t *e)
{
    if (!router_queue_entry_queued(e))
        return;
    td_list_remove(&e->link);
    q->len--;
}

router_queue_entry_t *router_queue_pop(router_queue_t *q)
{
    router_queue_entry_t *e = router_queue_peek(q);
    if (e)
        router_queue_remove(q, e);
    return e;
}

router_queue_entry_t *router_queue_pop_expired(router_queue_t *q, int64_t now_ns)
{
    TD_LIST_FOREACH(n, &q->entries) {
        router_queue_entry_t *e = ENTRY(n);
        if (e->deadline_ns && e->deadline_ns <= now_ns) {
            router_queue_remove(q, e);
            return e;
        }
    }
    return NULL;
}
