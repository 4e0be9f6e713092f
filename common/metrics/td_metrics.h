/*
 * td_metrics: a registry of Prometheus counters, gauges and histograms with label sets,
 * rendered as text exposition format 0.0.4 (what `GET /metrics` serves, see td_http.h).
 *
 * A metric *family* has a name, help text, a type and a fixed list of label names; each
 * distinct tuple of label values is a *series* (td_metric_t) created on first use and kept
 * until the registry is destroyed, so hot paths look a series up once and keep the pointer.
 * Updates are lock-free atomics for counters and gauges and take a per-series mutex for
 * histograms: any thread may update. Registration and rendering take the registry lock.
 * Naming conventions are in docs/metrics.md.
 */
#ifndef TD_METRICS_H
#define TD_METRICS_H

#include <stddef.h>

#include "td_status.h"

typedef struct td_metrics td_metrics_t;
typedef struct td_metric_family td_metric_family_t;
typedef struct td_metric td_metric_t;

typedef enum td_metric_type {
    TD_METRIC_COUNTER = 0,
    TD_METRIC_GAUGE = 1,
    TD_METRIC_HISTOGRAM = 2,
} td_metric_type_t;

#define TD_METRICS_MAX_LABELS 8
#define TD_METRICS_MAX_BUCKETS 32
/* Series per family: a label whose values a client or a peer chooses cannot grow /metrics
 * (and the router's memory) without bound. */
#define TD_METRICS_MAX_SERIES 4096

/* Creates an empty registry (*reg_p). Errors: TD_ERR_NOMEM. */
td_status_t td_metrics_create(td_metrics_t **reg_p);

/* Frees the registry and every family and series in it; pointers to them die with it.
 * NULL is a no-op. No other thread may use the registry any more. */
void td_metrics_destroy(td_metrics_t *reg);

/*
 * Registers a family. `label_names` has n_labels entries (0..TD_METRICS_MAX_LABELS), each
 * [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__", and not "le" for histograms. `name` is
 * [a-zA-Z_:][a-zA-Z0-9_:]*. For TD_METRIC_HISTOGRAM, `buckets` holds n_buckets strictly
 * increasing finite upper bounds (+Inf is implicit); other types pass NULL, 0. Strings are
 * copied. Registering the same name again with the same type and labels returns the
 * existing family. Errors: TD_ERR_INVALID (bad name, labels, buckets, or a name already
 * registered differently), TD_ERR_NOMEM. Thread-safe.
 */
td_status_t td_metrics_register(td_metrics_t *reg, td_metric_type_t type, const char *name,
                                const char *help, const char *const *label_names,
                                size_t n_labels, const double *buckets, size_t n_buckets,
                                td_metric_family_t **fam_p);

/*
 * The series of `fam` for these label values (n_labels strings, in the family's label
 * order, any UTF-8), created on first use. The pointer stays valid until the registry is
 * destroyed (or td_metric_family_remove removes the series). Errors: TD_ERR_INVALID (NULL
 * value), TD_ERR_EXHAUSTED (the family has TD_METRICS_MAX_SERIES series already; said once
 * per family), TD_ERR_NOMEM. Thread-safe.
 */
td_status_t td_metric_family_get(td_metric_family_t *fam, const char *const *label_values,
                                 td_metric_t **m_p);

/*
 * Removes the series of `fam` with these label values, if there is one (a node that left
 * the cluster: its gauges go with it). Only for series nobody keeps a pointer to (looked
 * up with td_metric_family_get at each use). Thread-safe.
 */
void td_metric_family_remove(td_metric_family_t *fam, const char *const *label_values);

/* One unlabelled family to register and where its one series goes: an entry of the table
 * td_metrics_register_all takes (spelled with the TD_METRIC_DEF_* macros below). */
typedef struct td_metric_def {
    td_metric_type_t type;
    const char *name;
    const char *help;
    const double *buckets;     /* histograms: n_buckets upper bounds (td_metrics_register) */
    size_t n_buckets;
    td_metric_t **m_p;         /* receives the series */
} td_metric_def_t;

#define TD_METRIC_DEF_COUNTER(n, h, p) {.type = TD_METRIC_COUNTER, .name = (n), .help = (h), .m_p = (p)}
#define TD_METRIC_DEF_GAUGE(n, h, p) {.type = TD_METRIC_GAUGE, .name = (n), .help = (h), .m_p = (p)}
#define TD_METRIC_DEF_HISTOGRAM(n, h, b, nb, p) \
    {.type = TD_METRIC_HISTOGRAM, .name = (n), .help = (h), .buckets = (b), .n_buckets = (nb), .m_p = (p)}

/* Registers every family of defs[0..n) in order and stores each one's series in *m_p;
 * stops at the first error (the errors of td_metrics_register and td_metric_family_get,
 * logged naming the metric). Thread-safe. */
td_status_t td_metrics_register_all(td_metrics_t *reg, const td_metric_def_t *defs, size_t n);

/* Shorthand: registers a counter family with one label and returns the series of each of
 * values[0..n) in series[0..n) (a closed set, such as reasons). Same errors. */
td_status_t td_metrics_counter_each(td_metrics_t *reg, const char *name, const char *help, const char *label,
                                    const char *const *values, size_t n, td_metric_t **series);

/* Updates; any thread. Counters only go up: td_metric_add with v < 0 (or NaN) on a
 * counter is ignored. td_metric_set is for gauges; td_metric_observe for histograms.
 * Calling an update of the wrong type is a programming error (TD_ASSERT). */
void td_metric_inc(td_metric_t *m);
void td_metric_add(td_metric_t *m, double v);
void td_metric_set(td_metric_t *m, double v);
void td_metric_observe(td_metric_t *m, double v);

/* Current value of a counter or gauge (for tests and for status RPCs). */
double td_metric_value(const td_metric_t *m);

/* Observations and sum of a histogram. */
void td_metric_histogram_read(td_metric_t *m, unsigned long long *count_p, double *sum_p);

/* A collector brings values kept elsewhere (a component's own statistics) into the
 * registry's series just before they are rendered. */
typedef void (*td_metrics_collect_cb)(void *arg);

#define TD_METRICS_MAX_COLLECTORS 8

/*
 * Adds a collector: td_metrics_render calls fn(arg) first, on the rendering thread, in the
 * order they were added, before any family is read (so fn may update series, and must be
 * safe on that thread). fn and arg must stay valid as long as the registry renders.
 * Errors: TD_ERR_RANGE (TD_METRICS_MAX_COLLECTORS already), TD_ERR_INVALID (fn NULL).
 * Thread-safe.
 */
td_status_t td_metrics_add_collector(td_metrics_t *reg, td_metrics_collect_cb fn, void *arg);

/*
 * Runs the collectors, then renders every family (in registration order; series in creation order) as Prometheus
 * text format 0.0.4 into a malloc'ed NUL-terminated buffer (*text_p, caller frees; *len_p
 * its length without the NUL). Families without series still get HELP/TYPE lines.
 * Errors: TD_ERR_NOMEM. Thread-safe.
 */
td_status_t td_metrics_render(td_metrics_t *reg, char **text_p, size_t *len_p);

/*
 * Reading Prometheus text back (what td_metrics_render writes; a live router's /metrics for
 * `tandem plan`): the value of the series `name` with no labels, NAN when the text has none;
 * and the buckets of histogram `name`, their upper bounds in le[] (+Inf as INFINITY) and
 * cumulative counts in cum[], at most cap of them, in the text's order; returns how many.
 */
double td_metrics_text_value(const char *text, const char *name);
int td_metrics_text_buckets(const char *text, const char *name, double *le, double *cum, int cap);

/* The Content-Type of td_metrics_render's output. */
#define TD_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* Buckets for latencies in seconds, 100 µs .. 60 s (for TTFT, TPOT, RPC latency). */
extern const double td_metrics_latency_buckets[];
extern const size_t td_metrics_latency_n_buckets;

#endif /* TD_METRICS_H */
