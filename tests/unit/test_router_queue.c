/*
 * test_router_queue: the router's admission queue — FIFO within a priority, higher
 * priority first, a put-back entry returns to its place, the bound, deadline removal,
 * cancel removal from the head, middle and tail, and an empty queue after draining (the
 * queue is intrusive, so "no leaks" means every entry comes back out exactly once).
 */
#include <criterion/criterion.h>

#include "router_queue.h"

typedef struct item {
    router_queue_entry_t qe;
    int id;
} item_t;

#define ITEM(e) ((item_t *)((char *)(e) - offsetof(item_t, qe)))

static void mk(item_t *it, int n)
{
    for (int i = 0; i < n; i++) {
        router_queue_entry_init(&it[i].qe);
        it[i].id = i;
    }
}

static int pop_id(router_queue_t *q)
{
    router_queue_entry_t *e = router_queue_pop(q);
    return e ? ITEM(e)->id : -1;
}

/* A queue of bound `cap` holding it[0..n) in order: priority 0, no deadline, it[i]
 * enqueued at 10 * (i + 1) ns. */
static void fill_fifo(router_queue_t *q, int cap, item_t *it, int n)
{
    mk(it, n);
    router_queue_init(q, cap);
    for (int i = 0; i < n; i++)
        cr_assert_eq(router_queue_push(q, &it[i].qe, 0, 0, 10 * (i + 1)), TD_OK, "push %d", i);
}

Test(router_queue, fifo_within_priority)
{
    router_queue_t q;
    item_t it[5];
    fill_fifo(&q, 8, it, 5);
    cr_assert_eq(router_queue_len(&q), 5);
    cr_assert_eq(ITEM(router_queue_peek(&q))->id, 0);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(pop_id(&q), i);
    cr_assert_eq(pop_id(&q), -1);
    cr_assert_eq(router_queue_len(&q), 0);
    cr_assert(td_list_empty(&q.entries));
}

Test(router_queue, higher_priority_first_then_fifo)
{
    router_queue_t q;
    item_t it[6];
    mk(it, 6);
    router_queue_init(&q, 8);
    int prio[6] = {0, 5, 0, 5, -1, 9};
    for (int i = 0; i < 6; i++)
        cr_assert_eq(router_queue_push(&q, &it[i].qe, prio[i], 0, 0), TD_OK);
    int want[6] = {5, 1, 3, 0, 2, 4};
    for (int i = 0; i < 6; i++)
        cr_assert_eq(pop_id(&q), want[i], "position %d", i);
}

Test(router_queue, put_back_keeps_place_and_enqueue_time)
{
    router_queue_t q;
    item_t it[3];
    fill_fifo(&q, 3, it, 3);
    router_queue_entry_t *e = router_queue_pop(&q);
    cr_assert_eq(ITEM(e)->id, 0);
    cr_assert_eq(router_queue_push(&q, e, 0, 0, 999), TD_OK); /* Admit refused: back in */
    cr_assert_eq(e->enqueued_ns, 10);
    cr_assert_eq(pop_id(&q), 0);
    cr_assert_eq(pop_id(&q), 1);
    cr_assert_eq(pop_id(&q), 2);
}

Test(router_queue, bound_refuses_and_leaves_entry_untouched)
{
    router_queue_t q;
    item_t it[3];
    mk(it, 3);
    router_queue_init(&q, 2);
    cr_assert_eq(router_queue_push(&q, &it[0].qe, 0, 0, 0), TD_OK);
    cr_assert_eq(router_queue_push(&q, &it[1].qe, 0, 0, 0), TD_OK);
    cr_assert_eq(router_queue_push(&q, &it[2].qe, 7, 0, 0), TD_ERR_EXHAUSTED);
    cr_assert_not(router_queue_entry_queued(&it[2].qe));
    cr_assert_eq(router_queue_len(&q), 2);
    cr_assert_eq(pop_id(&q), 0);
    cr_assert_eq(router_queue_push(&q, &it[2].qe, 7, 0, 0), TD_OK); /* room again */
    cr_assert_eq(pop_id(&q), 2);
    cr_assert_eq(pop_id(&q), 1);

    router_queue_t z;
    router_queue_init(&z, 0);
    cr_assert_eq(router_queue_push(&z, &it[0].qe, 0, 0, 0), TD_ERR_EXHAUSTED);
}

Test(router_queue, deadline_removal)
{
    router_queue_t q;
    item_t it[5];
    mk(it, 5);
    router_queue_init(&q, 8);
    int64_t dl[5] = {0, 500, 100, 0, 300}; /* 0 = none */
    for (int i = 0; i < 5; i++)
        cr_assert_eq(router_queue_push(&q, &it[i].qe, 0, dl[i], 0), TD_OK);
    cr_assert_null(router_queue_pop_expired(&q, 99));
    router_queue_entry_t *e = router_queue_pop_expired(&q, 300);
    cr_assert_eq(ITEM(e)->id, 2);
    cr_assert_not(router_queue_entry_queued(e));
    e = router_queue_pop_expired(&q, 300);
    cr_assert_eq(ITEM(e)->id, 4);
    cr_assert_null(router_queue_pop_expired(&q, 300));
    cr_assert_eq(router_queue_len(&q), 3);
    cr_assert_eq(pop_id(&q), 0);
    cr_assert_eq(pop_id(&q), 1);
    cr_assert_eq(pop_id(&q), 3);
    cr_assert_null(router_queue_pop_expired(&q, INT64_MAX));
}

Test(router_queue, cancel_removal_anywhere)
{
    router_queue_t q;
    item_t it[5];
    fill_fifo(&q, 8, it, 5);
    router_queue_remove(&q, &it[2].qe); /* middle */
    router_queue_remove(&q, &it[0].qe); /* head */
    router_queue_remove(&q, &it[4].qe); /* tail */
    router_queue_remove(&q, &it[4].qe); /* not queued: no-op */
    cr_assert_eq(router_queue_len(&q), 2);
    cr_assert_eq(ITEM(TD_CONTAINER_OF(td_list_last(&q.entries), router_queue_entry_t, link))->id, 3);
    cr_assert_eq(pop_id(&q), 1);
    cr_assert_eq(pop_id(&q), 3);
    cr_assert_eq(router_queue_len(&q), 0);
    cr_assert(td_list_empty(&q.entries));
    for (int i = 0; i < 5; i++)
        cr_assert_not(router_queue_entry_queued(&it[i].qe));
}

Test(router_queue, drain_many_each_out_once)
{
    enum { N = 1000 };
    static item_t it[N];
    static int seen[N];
    router_queue_t q;
    mk(it, N);
    router_queue_init(&q, N);
    for (int i = 0; i < N; i++)
        cr_assert_eq(router_queue_push(&q, &it[i].qe, (i * 7919) % 5, 0, 0), TD_OK);
    int last_prio = 1 << 30, last_id = -1;
    for (int i = 0; i < N; i++) {
        router_queue_entry_t *e = router_queue_pop(&q);
        cr_assert_not_null(e);
        int id = ITEM(e)->id;
        cr_assert_eq(seen[id]++, 0);
        cr_assert(e->priority < last_prio || (e->priority == last_prio && id > last_id));
        last_prio = e->priority;
        last_id = id;
    }
    cr_assert_null(router_queue_pop(&q));
}
