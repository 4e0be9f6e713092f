/*
 * td_threadpool: a fork-join worker pool for compute kernels.
 *
 * td_pool_run() splits `n_tasks` indices over the pool's threads (the caller's thread is
 * one of them) and returns when all are done. Workers spin briefly and then sleep on a
 * condition variable, so a pool costs nothing between steps. One td_pool_run at a time per
 * pool (the pool belongs to one backend context, used by one thread).
 */
#ifndef TD_THREADPOOL_H
#define TD_THREADPOOL_H

#include "td_status.h"

typedef struct td_pool td_pool_t;

/* fn(arg, task, thread): runs task `task` (0 <= task < n_tasks) on worker `thread`
   (0 <= thread < td_pool_size). */
typedef void (*td_pool_fn)(void *arg, int task, int thread);

/* Creates a pool of n_threads (including the caller; <= 0 means all online CPUs). */
td_status_t td_pool_create(int n_threads, td_pool_t **pool_p);
void td_pool_destroy(td_pool_t *pool);
int td_pool_size(const td_pool_t *pool);

/* Runs fn for every task index in [0, n_tasks); tasks are handed out dynamically. */
void td_pool_run(td_pool_t *pool, int n_tasks, td_pool_fn fn, void *arg);

#endif /* TD_THREADPOOL_H */
