/*
 * td_threadpool: fork-join worker pool for the CPU kernels.
 *
 * One job at a time: td_pool_run publishes (fn, arg, n_tasks), bumps a generation counter
 * and wakes sleepers; every thread (the caller included) then takes task indices from one
 * atomic counter until they run out. The caller returns only when every worker has checked
 * out of the job, so the next run may overwrite the job fields safely.
 *
 * A decode step runs ~10 jobs per layer, so wake-up latency matters more than idle cost:
 * workers spin on the generation counter for TD_POOL_SPIN_NS (1 ms) before they sleep on a
 * condition variable (and the caller as long on the workers' check-out). The bound is time,
 * not a count of pauses: a pause is ~10 ns on Zen 4 and ~40-60 ns on Sapphire Rapids, so
 * 20,000 of them spun 0.2 ms on one and 1 ms on the other. A thread that spins while the
 * one it waits for has no core (more runnable threads than cores) holds that core all that
 * time, so the tests run small models on one thread. The lost-wake-up race
 * is closed by checking the generation under the mutex before sleeping and by publishing
 * the generation before taking the mutex to broadcast.
 */
#include "td_threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "td_util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TD_CPU_RELAX() _mm_pause()
#else
#define TD_CPU_RELAX() ((void)0)
#endif

/* How long a worker polls for a new job, and the caller for the workers, before sleeping. */
#define TD_POOL_SPIN_NS 1000000
/* Polls between clock readings while spinning. */
#define TD_POOL_SPIN_CHECK 64

typedef struct td_pool_worker {
    struct td_pool *pool;
    int id; /* 1..n-1; the caller is thread 0 */
    pthread_t thread;
} td_pool_worker_t;

struct td_pool {
    int n_threads;
    td_pool_worker_t *workers; /* [n_threads - 1] */

    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* workers wait here for a new generation */
    pthread_cond_t done_cv; /* the caller waits here for pending == 0 */
    int sleepers;           /* workers blocked on work_cv (under mu) */

    /* the current job, written by the caller before the generation is bumped */
    td_pool_fn fn;
    void *arg;
    int n_tasks;
    atomic_int next;      /* next task index to hand out */
    atomic_int pending;   /* workers that have not yet checked out of this job */
    atomic_uint generation;
    atomic_bool stop;
};

/* A spin's budget: TD_POOL_SPIN_NS from spin_begin, the clock read every TD_POOL_SPIN_CHECK
 * polls. */
typedef struct spin {
    uint64_t end_ns;
    int polls;
} spin_t;

static spin_t spin_begin(void)
{
    return (spin_t){.end_ns = td_now_ns() + TD_POOL_SPIN_NS};
}

static bool spin_more(spin_t *sp)
{
    if (++sp->polls % TD_POOL_SPIN_CHECK)
        return true;
    return td_now_ns() < sp->end_ns;
}

static void pool_work(td_pool_t *pool, int thread)
{
    int n = pool->n_tasks;
    for (;;) {
        int t = atomic_fetch_add_explicit(&pool->next, 1, memory_order_relaxed);
        if (t >= n)
            break;
        pool->fn(pool->arg, t, thread);
    }
}

static void *pool_main(void *p)
{
    td_pool_worker_t *w = p;
    td_pool_t *pool = w->pool;
    /* generation 0 is "no job yet": reading the counter here instead would miss a job
       published before this thread got to run */
    unsigned seen = 0;

    for (;;) {
        unsigned gen;
        spin_t sp = spin_begin();
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen &&
               !atomic_load_explicit(&pool->stop, memory_order_acquire) && spin_more(&sp))
            TD_CPU_RELAX();
        if (gen == seen) {
            pthread_mutex_lock(&pool->mu);
            pool->sleepers++;
            while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen &&
                   !atomic_load_explicit(&pool->stop, memory_order_acquire))
                pthread_cond_wait(&pool->work_cv, &pool->mu);
            pool->sleepers--;
            pthread_mutex_unlock(&pool->mu);
        }
        if (gen == seen) /* woken for stop with no new job */
            return NULL;
        seen = gen;

        pool_work(pool, w->id);

        if (atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool->mu);
            pthread_cond_signal(&pool->done_cv);
            pthread_mutex_unlock(&pool->mu);
        }
    }
}

/* Contract: see td_threadpool.h. Errors: TD_ERR_NOMEM, TD_ERR_INTERNAL (thread creation). */
td_status_t td_pool_create(int n_threads, td_pool_t **pool_p)
{
    td_status_t st;
    if (n_threads <= 0)
        n_threads = td_cpu_count();
    td_pool_t *pool = calloc(1, sizeof(*pool));
    if (!pool)
        return td_errorf(TD_ERR_NOMEM, "thread pool: out of memory");
    pool->n_threads = n_threads;
    atomic_init(&pool->next, 0);
    atomic_init(&pool->pending, 0);
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->stop, false);
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->work_cv, NULL);
    pthread_cond_init(&pool->done_cv, NULL);

    int started = 0;
    if (n_threads > 1) {
        pool->workers = calloc((size_t)n_threads - 1, sizeof(*pool->workers));
        if (!pool->workers) {
            st = td_errorf(TD_ERR_NOMEM, "thread pool: out of memory for %d workers", n_threads);
            goto err_pool;
        }
        for (; started < n_threads - 1; started++) {
            td_pool_worker_t *w = &pool->workers[started];
            w->pool = pool;
            w->id = started + 1;
            int rc = pthread_create(&w->thread, NULL, pool_main, w);
            if (rc != 0) {
                st = td_errorf(TD_ERR_INTERNAL, "thread pool: cannot start worker %d of %d (error %d)",
                               started + 1, n_threads, rc);
                goto err_threads;
            }
        }
    }
    *pool_p = pool;
    return TD_OK;

err_threads:
    pool->n_threads = started + 1;
    td_pool_destroy(pool);
    return st;
err_pool:
    pthread_cond_destroy(&pool->done_cv);
    pthread_cond_destroy(&pool->work_cv);
    pthread_mutex_destroy(&pool->mu);
    free(pool);
    return st;
}

/* Contract: joins every worker; NULL is a no-op. Must not race a td_pool_run. */
void td_pool_destroy(td_pool_t *pool)
{
    if (!pool)
        return;
    pthread_mutex_lock(&pool->mu);
    atomic_store_explicit(&pool->stop, true, memory_order_release);
    pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->n_threads - 1; i++)
        pthread_join(pool->workers[i].thread, NULL);
    free(pool->workers);
    pthread_cond_destroy(&pool->done_cv);
    pthread_cond_destroy(&pool->work_cv);
    pthread_mutex_destroy(&pool->mu);
    free(pool);
}

/* Contract: threads including the caller, >= 1. */
int td_pool_size(const td_pool_t *pool)
{
    return pool->n_threads;
}

/* Contract: see td_threadpool.h; caller thread is thread 0; not reentrant. */
void td_pool_run(td_pool_t *pool, int n_tasks, td_pool_fn fn, void *arg)
{
    if (n_tasks <= 0)
        return;
    if (pool->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(arg, t, 0);
        return;
    }
    pool->fn = fn;
    pool->arg = arg;
    pool->n_tasks = n_tasks;
    atomic_store_explicit(&pool->next, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->pending, pool->n_threads - 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_acq_rel);

    pthread_mutex_lock(&pool->mu);
    if (pool->sleepers > 0)
        pthread_cond_broadcast(&pool->work_cv);
    pthread_mutex_unlock(&pool->mu);

    pool_work(pool, 0);

    spin_t sp = spin_begin();
    while (atomic_load_explicit(&pool->pending, memory_order_acquire) != 0 && spin_more(&sp))
        TD_CPU_RELAX();
    if (atomic_load_explicit(&pool->pending, memory_order_acquire) != 0) {
        pthread_mutex_lock(&pool->mu);
        while (atomic_load_explicit(&pool->pending, memory_order_acquire) != 0)
            pthread_cond_wait(&pool->done_cv, &pool->mu);
        pthread_mutex_unlock(&pool->mu);
    }
}
