/*
 * test_list: td_list against a plain array of ids kept in the same order, through random
 * pushes at both ends, insertions before and after a node, sorted insertion from the back
 * (how deadline and queue lists use it), removals (also while walking), and the unlinked
 * state a removed node is left in.
 */
#include <criterion/criterion.h>
#include <stdint.h>
#include <string.h>

#include "td_list.h"

typedef struct item {
    int id;
    td_list_t link;
} item_t;

#define N_ITEMS 64

static void check_order(const td_list_t *h, const int *want, int n)
{
    int i = 0;
    TD_LIST_FOREACH(p, h)
    {
        cr_assert_lt(i, n, "list longer than %d", n);
        cr_assert_eq(TD_CONTAINER_OF(p, item_t, link)->id, want[i], "position %d", i);
        i++;
    }
    cr_assert_eq(i, n);
    TD_LIST_FOREACH_REVERSE(p, h)
    {
        i--;
        cr_assert_eq(TD_CONTAINER_OF(p, item_t, link)->id, want[i], "reverse position %d", i);
    }
    cr_assert_eq(td_list_count(h), (size_t)n);
    cr_assert_eq(td_list_empty(h), n == 0);
    if (n) {
        cr_assert_eq(TD_CONTAINER_OF(td_list_first(h), item_t, link)->id, want[0]);
        cr_assert_eq(TD_CONTAINER_OF(td_list_last(h), item_t, link)->id, want[n - 1]);
        cr_assert_null(td_list_next(h, td_list_last(h)));
        cr_assert_null(td_list_prev(h, td_list_first(h)));
    } else {
        cr_assert_null(td_list_first(h));
        cr_assert_null(td_list_last(h));
    }
}

Test(list, random_operations_keep_the_order_of_a_reference_array)
{
    item_t items[N_ITEMS];
    int ref[N_ITEMS], n = 0;
    td_list_t h;
    td_list_init(&h);
    for (int i = 0; i < N_ITEMS; i++) {
        items[i].id = i;
        td_list_init(&items[i].link);
    }
    uint32_t s = 1;
    for (int step = 0; step < 20000; step++) {
        s = s * 1103515245u + 12345u;
        int id = (int)((s >> 8) % N_ITEMS);
        item_t *it = &items[id];
        int pos = -1;
        for (int i = 0; i < n; i++)
            if (ref[i] == id)
                pos = i;
        cr_assert_eq(td_list_linked(&it->link), pos >= 0);
        int op = (int)((s >> 20) % 4);
        if (pos >= 0) {
            td_list_remove(&it->link);
            memmove(&ref[pos], &ref[pos + 1], (size_t)(n - pos - 1) * sizeof *ref);
            n--;
            cr_assert_not(td_list_linked(&it->link));
        } else if (op == 0) {
            td_list_push_back(&h, &it->link);
            ref[n++] = id;
        } else if (op == 1) {
            td_list_push_front(&h, &it->link);
            memmove(&ref[1], &ref[0], (size_t)n * sizeof *ref);
            ref[0] = id, n++;
        } else if (n > 0) { /* next to a random member */
            int at = (int)((s >> 12) % (uint32_t)n);
            td_list_t *anchor = &items[ref[at]].link;
            int where = op == 2 ? at : at + 1;
            if (op == 2)
                td_list_insert_before(anchor, &it->link);
            else
                td_list_insert_after(anchor, &it->link);
            memmove(&ref[where + 1], &ref[where], (size_t)(n - where) * sizeof *ref);
            ref[where] = id, n++;
        }
        check_order(&h, ref, n);
    }
}

Test(list, sorted_insertion_from_the_back_and_removal_while_walking)
{
    static const int keys[] = {5, 3, 9, 1, 7, 3, 8, 0, 6, 2};
    item_t items[10];
    td_list_t h;
    td_list_init(&h);
    for (int i = 0; i < 10; i++) {
        items[i].id = keys[i];
        td_list_init(&items[i].link);
        /* after the last node not later than the new one: equal keys keep arrival order */
        td_list_t *p = td_list_last(&h);
        while (p && TD_CONTAINER_OF(p, item_t, link)->id > keys[i])
            p = td_list_prev(&h, p);
        td_list_insert_after(p ? p : &h, &items[i].link);
    }
    static const int sorted[] = {0, 1, 2, 3, 3, 5, 6, 7, 8, 9};
    check_order(&h, sorted, 10);
    cr_assert_eq(td_list_next(&h, &items[1].link), &items[5].link); /* the first 3, then the second */
    TD_LIST_FOREACH_SAFE(p, &h)
    {
        if (TD_CONTAINER_OF(p, item_t, link)->id % 2)
            td_list_remove(p);
    }
    static const int even[] = {0, 2, 6, 8};
    check_order(&h, even, 4);
    TD_LIST_FOREACH_SAFE(p, &h)
    td_list_remove(p);
    check_order(&h, NULL, 0);
    td_list_remove(&items[0].link); /* removing an unlinked node changes nothing */
    cr_assert_not(td_list_linked(&items[0].link));
}
