/*
 * td_node_xfer_metrics: a node's KV-transfer statistics (td_xfer_stats_t) on its /metrics
 * under the tandem_kvxfer_* names of docs/xfer.md. td_xfer counts in its own struct on the
 * loop thread; a td_metrics collector copies the counts into the registry each time it is
 * rendered, which the node's /metrics server does on that same loop thread.
 *
 * Threads: the loop thread that owns the td_xfer (render /metrics there).
 */
#ifndef TD_NODE_XFER_METRICS_H
#define TD_NODE_XFER_METRICS_H

#include "td_metrics.h"
#include "td_status.h"
#include "td_xfer.h"

#define TD_NODE_XFER_METRICS_MAX 32

typedef struct td_node_xfer_metrics {
    td_xfer_t *x;
    td_metric_t *series[TD_NODE_XFER_METRICS_MAX]; /* one per row of the export table */
} td_node_xfer_metrics_t;

/*
 * Registers the tandem_kvxfer_* families in reg and a collector that fills them from x's
 * statistics at every render. m, x and reg must outlive the registry's rendering (m is
 * the collector's argument: keep it in the node's state). Errors: those of td_metrics.
 */
td_status_t td_node_xfer_metrics_init(td_node_xfer_metrics_t *m, td_metrics_t *reg, td_xfer_t *x);

#endif /* TD_NODE_XFER_METRICS_H */
