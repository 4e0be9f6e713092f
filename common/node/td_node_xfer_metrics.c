/*
 * td_node_xfer_metrics: td_xfer's statistics as Prometheus series (td_node_xfer_metrics.h).
 * One table maps each td_xfer_stats_t field to a family (and label, where a family has
 * one series per cause or outcome); the collector sets gauges and advances counters by
 * the difference to what they show, so a counter never goes down.
 */
#include "td_node_xfer_metrics.h"

#include <stddef.h>
#include <stdint.h>

typedef struct xm_row {
    const char *name;
    const char *help;
    const char *label;        /* NULL: unlabelled */
    const char *label_value;
    td_metric_type_t type;
    size_t offset;            /* in td_xfer_stats_t */
    bool wide;                /* uint64_t (else uint32_t) */
} xm_row_t;

#define XM_U64(field) offsetof(td_xfer_stats_t, field), true
#define XM_U32(field) offsetof(td_xfer_stats_t, field), false

static const xm_row_t XM_ROWS[] = {
    {"tandem_kvxfer_sent_bytes_total", "KV payload bytes receivers took from this node", NULL, NULL,
     TD_METRIC_COUNTER, XM_U64(bytes_sent)},
    {"tandem_kvxfer_received_bytes_total", "KV payload bytes placed into this node's pool", NULL, NULL,
     TD_METRIC_COUNTER, XM_U64(bytes_received)},
    {"tandem_kvxfer_transfers_total", "transfers from this node the receiver adopted", NULL, NULL,
     TD_METRIC_COUNTER, XM_U64(transfers_ok)},
    {"tandem_kvxfer_transfers_inflight", "transfers begun here and not yet decided", NULL, NULL, TD_METRIC_GAUGE,
     XM_U32(transfers_inflight)},
    {"tandem_kvxfer_failures_total", "failed transfers and messages, by cause", "cause", "peer_lost",
     TD_METRIC_COUNTER, XM_U64(fail_peer)},
    {"tandem_kvxfer_failures_total", NULL, "cause", "timeout", TD_METRIC_COUNTER, XM_U64(fail_timeout)},
    {"tandem_kvxfer_failures_total", NULL, "cause", "stale_lease", TD_METRIC_COUNTER, XM_U64(fail_stale)},
    {"tandem_kvxfer_failures_total", NULL, "cause", "mismatch", TD_METRIC_COUNTER, XM_U64(fail_mismatch)},
    {"tandem_kvxfer_failures_total", NULL, "cause", "protocol", TD_METRIC_COUNTER, XM_U64(fail_protocol)},
    {"tandem_kvxfer_leases_live", "leases holding blocks for a transfer", NULL, NULL, TD_METRIC_GAUGE,
     XM_U32(leases_live)},
    {"tandem_kvxfer_leases_total", "leases by how they ended (created counts every lease)", "outcome", "created",
     TD_METRIC_COUNTER, XM_U64(leases_created)},
    {"tandem_kvxfer_leases_total", NULL, "outcome", "adopted", TD_METRIC_COUNTER, XM_U64(leases_adopted)},
    {"tandem_kvxfer_leases_total", NULL, "outcome", "expired", TD_METRIC_COUNTER, XM_U64(leases_expired)},
    {"tandem_kvxfer_leases_total", NULL, "outcome", "cancelled", TD_METRIC_COUNTER, XM_U64(leases_cancelled)},
    {"tandem_kvxfer_leases_total", NULL, "outcome", "sender_lost", TD_METRIC_COUNTER, XM_U64(leases_sender_lost)},
    {"tandem_kvxfer_discarded_total", "messages for a dead or unknown lease, dropped", "what", "data",
     TD_METRIC_COUNTER, XM_U64(discarded_data)},
    {"tandem_kvxfer_discarded_total", NULL, "what", "ready", TD_METRIC_COUNTER, XM_U64(discarded_ready)},
    {"tandem_kvxfer_operations_total", "data operations posted, by primitive", "primitive", "put",
     TD_METRIC_COUNTER, XM_U64(ops_put)},
    {"tandem_kvxfer_operations_total", NULL, "primitive", "am", TD_METRIC_COUNTER, XM_U64(ops_am)},
    {"tandem_kvxfer_leases_quarantined_total", "leases that died while a put writer was bound", NULL, NULL,
     TD_METRIC_COUNTER, XM_U64(leases_quarantined)},
    {"tandem_kvxfer_quarantine_timeouts_total", "quarantined leases released by the timeout, not an abort-ack",
     NULL, NULL, TD_METRIC_COUNTER, XM_U64(quarantine_timeouts)},
    {"tandem_kvxfer_landing_blocks_free", "device pool: landing blocks not held by a lease", NULL, NULL,
     TD_METRIC_GAUGE, XM_U32(landing_free)},
    {"tandem_kvxfer_h2d_bytes_total", "device pool: landed bytes copied into the pool", NULL, NULL,
     TD_METRIC_COUNTER, XM_U64(bytes_copied_h2d)},
    {"tandem_kvxfer_rejected_total", "data-plane messages for a live lease dropped without touching it, by reason "
     "(docs/security.md)", "reason", "token", TD_METRIC_COUNTER, XM_U64(rejected_token)},
    {"tandem_kvxfer_rejected_total", NULL, "reason", "endpoint", TD_METRIC_COUNTER, XM_U64(rejected_endpoint)},
    {"tandem_kvxfer_rejected_total", NULL, "reason", "malformed", TD_METRIC_COUNTER, XM_U64(rejected_malformed)},
};

_Static_assert(sizeof XM_ROWS / sizeof XM_ROWS[0] <= TD_NODE_XFER_METRICS_MAX, "td_node_xfer_metrics_t too small");

static double xm_field(const td_xfer_stats_t *st, const xm_row_t *r)
{
    const char *p = (const char *)st + r->offset;
    return r->wide ? (double)*(const uint64_t *)(const void *)p : (double)*(const uint32_t *)(const void *)p;
}

static void xm_collect(void *arg)
{
    td_node_xfer_metrics_t *m = arg;
    td_xfer_stats_t st;
    td_xfer_get_stats(m->x, &st);
    for (size_t i = 0; i < sizeof XM_ROWS / sizeof XM_ROWS[0]; i++) {
        double v = xm_field(&st, &XM_ROWS[i]);
        if (XM_ROWS[i].type == TD_METRIC_GAUGE)
            td_metric_set(m->series[i], v);
        else if (v > td_metric_value(m->series[i]))
            td_metric_add(m->series[i], v - td_metric_value(m->series[i]));
    }
}

td_status_t td_node_xfer_metrics_init(td_node_xfer_metrics_t *m, td_metrics_t *reg, td_xfer_t *x)
{
    *m = (td_node_xfer_metrics_t){.x = x};
    const char *help = NULL;
    for (size_t i = 0; i < sizeof XM_ROWS / sizeof XM_ROWS[0]; i++) {
        const xm_row_t *r = &XM_ROWS[i];
        if (r->help)
            help = r->help; /* a labelled family's later rows share its first row's help */
        td_metric_family_t *fam;
        td_status_t st = td_metrics_register(reg, r->type, r->name, help, r->label ? &r->label : NULL,
                                             r->label ? 1 : 0, NULL, 0, &fam);
        if (st == TD_OK)
            st = td_metric_family_get(fam, r->label ? &r->label_value : NULL, &m->series[i]);
        if (st != TD_OK)
            return st;
    }
    return td_metrics_add_collector(reg, xm_collect, m);
}
