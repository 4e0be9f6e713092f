/*
 * td_metrics_loop: how well a libuv loop keeps up, as Prometheus series. Every process
 * runs its control plane (gRPC, heartbeats, transfers, /metrics) on one loop, and the rule
 * is that no callback on it does work proportional to a model, a pool or a prompt; these
 * series are how that rule is measured (docs/metrics.md):
 *
 *   tandem_event_loop_lag_seconds (histogram): how late a timer that asks to fire every
 *     TD_METRICS_LOOP_PERIOD_MS fires. A heartbeat timer is late by as much.
 *   tandem_event_loop_longest_run_seconds (gauge): the longest stretch the loop has spent
 *     running callbacks without going back to wait for I/O, since the process started.
 *     It bounds the longest single callback from above (a stretch may hold several).
 *
 * Measured with a repeating uv_timer (lag), and uv_prepare + uv_check handles with libuv's
 * idle-time accounting (UV_METRICS_IDLE_TIME): the time from a prepare to the next check
 * minus the time the loop slept in between is the I/O callbacks' stretch; from a check to
 * the next prepare, the timers', closes' and other handles' stretch.
 *
 * Threads: the loop's thread for everything here; the series are read by /metrics
 * rendering from any thread (td_metrics atomics).
 */
#ifndef TD_METRICS_LOOP_H
#define TD_METRICS_LOOP_H

#include <uv.h>

#include "td_metrics.h"
#include "td_status.h"

/* The lag timer's period: short enough to see a stall of a few ms, cheap (100 wakes/s). */
#define TD_METRICS_LOOP_PERIOD_MS 10

typedef struct td_metrics_loop td_metrics_loop_t;

/*
 * Starts watching `loop` (not owned) and registers the series in `metrics` (which must
 * outlive the watcher). Errors: TD_ERR_NOMEM, those of td_metrics_register (nothing is
 * started then). Loop thread, before or while the loop runs.
 */
td_status_t td_metrics_loop_start(uv_loop_t *loop, td_metrics_t *metrics, td_metrics_loop_t **w_p);

/* Stops watching: closes the handles; the memory goes from their close callbacks, so run
 * the loop until they closed (as for every handle). NULL is a no-op. Loop thread. */
void td_metrics_loop_stop(td_metrics_loop_t *w);

#endif /* TD_METRICS_LOOP_H */
