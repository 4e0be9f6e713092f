/*
 * Tests of td_threadpool: every task runs exactly once, on a valid thread index, over many
 * rounds with varying task counts (including fewer tasks than threads, and rounds spaced
 * apart so workers fall asleep between them).
 */
#include <criterion/criterion.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "td_threadpool.h"

typedef struct round_ctx {
    atomic_int *hits; /* [n_tasks] */
    atomic_int bad_thread;
    int n_threads;
} round_ctx_t;

static void count_task(void *arg, int task, int thread)
{
    round_ctx_t *c = arg;
    atomic_fetch_add(&c->hits[task], 1);
    if (thread < 0 || thread >= c->n_threads)
        atomic_fetch_add(&c->bad_thread, 1);
}

static void run_rounds(int n_threads, int rounds, bool pause_between)
{
    td_pool_t *pool = NULL;
    cr_assert_eq(td_pool_create(n_threads, &pool), TD_OK);
    int size = td_pool_size(pool);
    cr_assert(size >= 1);
    if (n_threads > 0)
        cr_assert_eq(size, n_threads);

    enum { MAX_TASKS = 1000 };
    atomic_int *hits = calloc(MAX_TASKS, sizeof(*hits));
    srand(1234);
    for (int r = 0; r < rounds; r++) {
        int n_tasks = (r % 7 == 0) ? 1 + r % 3 : rand() % MAX_TASKS;
        for (int i = 0; i < n_tasks; i++)
            atomic_store(&hits[i], 0);
        round_ctx_t c = {.hits = hits, .n_threads = size};
        atomic_init(&c.bad_thread, 0);
        td_pool_run(pool, n_tasks, count_task, &c);
        for (int i = 0; i < n_tasks; i++)
            cr_assert_eq(atomic_load(&hits[i]), 1, "round %d task %d ran %d times", r, i,
                         atomic_load(&hits[i]));
        cr_assert_eq(atomic_load(&c.bad_thread), 0);
        if (pause_between && r % 10 == 0) {
            struct timespec ts = {0, 3 * 1000 * 1000}; /* long enough for workers to sleep */
            nanosleep(&ts, NULL);
        }
    }
    free(hits);
    td_pool_destroy(pool);
}

Test(threadpool, single_thread, .timeout = 30) { run_rounds(1, 200, false); }
Test(threadpool, four_threads_many_rounds, .timeout = 60) { run_rounds(4, 3000, false); }
Test(threadpool, four_threads_sleeping_workers, .timeout = 60) { run_rounds(4, 200, true); }
Test(threadpool, all_cpus, .timeout = 60) { run_rounds(0, 500, true); }

Test(threadpool, zero_tasks_and_destroy_null, .timeout = 10)
{
    td_pool_t *pool = NULL;
    cr_assert_eq(td_pool_create(3, &pool), TD_OK);
    round_ctx_t c = {.hits = NULL, .n_threads = 3};
    atomic_init(&c.bad_thread, 0);
    td_pool_run(pool, 0, count_task, &c); /* must not call fn */
    td_pool_destroy(pool);
    td_pool_destroy(NULL);
}

/* A pool that never ran a job must still shut down promptly. */
Test(threadpool, create_destroy_idle, .timeout = 10)
{
    for (int i = 0; i < 20; i++) {
        td_pool_t *pool = NULL;
        cr_assert_eq(td_pool_create(4, &pool), TD_OK);
        td_pool_destroy(pool);
    }
}
