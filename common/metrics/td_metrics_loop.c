/*
 * td_metrics_loop: loop lag and the longest run of callbacks of a libuv loop (see
 * td_metrics_loop.h).
 */
#include "td_metrics_loop.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "td_util.h"

struct td_metrics_loop {
    uv_loop_t *loop;
    uv_timer_t timer;
    uv_prepare_t prepare;
    uv_check_t check;
    int closes;            /* close callbacks still to come after stop */
    uint64_t last_fire_ns; /* the lag timer's previous callback (0: none yet) */
    uint64_t prepare_ns;   /* this iteration's prepare (0: none yet) */
    uint64_t idle_at_prepare_ns;
    uint64_t check_ns;     /* the previous iteration's check (0: none yet) */
    uint64_t longest_ns;
    td_metric_t *lag;      /* histogram, seconds */
    td_metric_t *longest;  /* gauge, seconds */
};

/* 0.5 ms .. 5 s: a heartbeat bound is 1.5 s, a healthy loop stays under a few ms, and
 * timer granularity is 1 ms. */
static const double lag_buckets[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                     0.1,    0.25,  0.5,    1.0,   2.5,  5.0};

static void note_run(td_metrics_loop_t *w, uint64_t ns)
{
    if (ns <= w->longest_ns)
        return;
    w->longest_ns = ns;
    td_metric_set(w->longest, (double)ns * 1e-9);
}

static void on_timer(uv_timer_t *h)
{
    td_metrics_loop_t *w = h->data;
    uint64_t now = uv_hrtime();
    if (w->last_fire_ns) {
        /* libuv re-arms a repeating timer from the iteration's start, so the interval
           between two callbacks is the period plus how late the second one ran */
        uint64_t interval = now - w->last_fire_ns, period = (uint64_t)TD_METRICS_LOOP_PERIOD_MS * 1000000u;
        td_metric_observe(w->lag, interval > period ? (double)(interval - period) * 1e-9 : 0.0);
    }
    w->last_fire_ns = now;
}

/* Just before the loop waits for I/O: the stretch since the previous check (timers,
 * pending and idle callbacks, closes, other prepare handles) ends here. */
static void on_prepare(uv_prepare_t *h)
{
    td_metrics_loop_t *w = h->data;
    uint64_t now = uv_hrtime();
    if (w->check_ns)
        note_run(w, now - w->check_ns);
    w->prepare_ns = now;
    w->idle_at_prepare_ns = uv_metrics_idle_time(w->loop);
}

/* Just after the I/O callbacks: prepare -> check minus the time asleep in the wait is the
 * stretch of I/O callbacks (and of prepare handles that ran after ours). */
static void on_check(uv_check_t *h)
{
    td_metrics_loop_t *w = h->data;
    uint64_t now = uv_hrtime();
    if (w->prepare_ns) {
        uint64_t slept = uv_metrics_idle_time(w->loop) - w->idle_at_prepare_ns;
        uint64_t span = now - w->prepare_ns;
        note_run(w, span > slept ? span - slept : 0);
    }
    w->check_ns = now;
}

td_status_t td_metrics_loop_start(uv_loop_t *loop, td_metrics_t *metrics, td_metrics_loop_t **w_p)
{
    td_metrics_loop_t *w = calloc(1, sizeof *w);
    if (!w)
        return td_errorf(TD_ERR_NOMEM, "loop metrics: out of memory");
    const td_metric_def_t defs[] = {
        TD_METRIC_DEF_HISTOGRAM("tandem_event_loop_lag_seconds",
                                "How late a timer asking to fire every 10 ms fires on the event loop", lag_buckets,
                                TD_ARRAY_LEN(lag_buckets), &w->lag),
        TD_METRIC_DEF_GAUGE("tandem_event_loop_longest_run_seconds",
                            "Longest run of event-loop callbacks between two waits for I/O since start "
                            "(bounds the longest callback)",
                            &w->longest),
    };
    td_status_t st = td_metrics_register_all(metrics, defs, TD_ARRAY_LEN(defs));
    if (st != TD_OK) {
        free(w);
        return st;
    }
    w->loop = loop;
    /* without it uv_metrics_idle_time stays 0 and every wait would count as work */
    uv_loop_configure(loop, UV_METRICS_IDLE_TIME);
    uv_timer_init(loop, &w->timer);
    uv_prepare_init(loop, &w->prepare);
    uv_check_init(loop, &w->check);
    w->timer.data = w->prepare.data = w->check.data = w;
    uv_timer_start(&w->timer, on_timer, TD_METRICS_LOOP_PERIOD_MS, TD_METRICS_LOOP_PERIOD_MS);
    uv_prepare_start(&w->prepare, on_prepare);
    uv_check_start(&w->check, on_check);
    /* a watcher never keeps a loop alive */
    uv_unref((uv_handle_t *)&w->timer);
    uv_unref((uv_handle_t *)&w->prepare);
    uv_unref((uv_handle_t *)&w->check);
    *w_p = w;
    return TD_OK;
}

static void on_closed(uv_handle_t *h)
{
    td_metrics_loop_t *w = h->data;
    if (--w->closes == 0)
        free(w);
}

void td_metrics_loop_stop(td_metrics_loop_t *w)
{
    if (!w)
        return;
    w->closes = 3;
    uv_close((uv_handle_t *)&w->timer, on_closed);
    uv_close((uv_handle_t *)&w->prepare, on_closed);
    uv_close((uv_handle_t *)&w->check, on_closed);
}
