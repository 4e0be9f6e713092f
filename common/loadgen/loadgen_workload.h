/*
 * loadgen_workload: the requests `tandem plan` simulates, from the load generator's datasets
 * (`--workload random:IN:OUT[:RANGE]`: bench serve's random dataset, its lengths drawn with the
 * same seed; `trace:FILE`: bench serve's trace format and parser) or from a live router's
 * /metrics (`--metrics URL`: the arrival rate from two scrapes window_s apart, the lengths
 * spread over its prompt and output token histograms). Blocking (a file read, two scrapes
 * bounded by 5 s each); errors said once, naming the flag and what to give instead.
 */
#ifndef TD_LOADGEN_WORKLOAD_H
#define TD_LOADGEN_WORKLOAD_H

#include <stddef.h>
#include <stdint.h>

#include "loadgen.h"
#include "td_plan.h"
#include "td_status.h"

typedef struct loadgen_workload {
    int32_t *in, *out;        /* [n] prompt and output tokens of each request */
    size_t n;
    double rate;              /* the trace's or the live router's requests/s; 0: none */
    td_plan_request_t *timed; /* a trace's own arrivals [n], or NULL */
    char desc[256];           /* what it is, for the plan's header */
} loadgen_workload_t;

/* `spec` (random:IN:OUT[:RANGE] or trace:FILE; n requests, lengths drawn from seed) into *w.
 * TD_ERR_INVALID naming --workload; the caller frees *w (loadgen_workload_free) either way. */
td_status_t loadgen_workload_parse(const char *spec, size_t n, uint64_t seed, loadgen_workload_t *w);

/* n requests and the arrival rate of the router whose /metrics is at url, scraped twice
 * window_s apart. TD_ERR_INVALID naming --metrics (not a router's, or no request ended yet). */
td_status_t loadgen_workload_metrics(const char *url, double window_s, size_t n, loadgen_workload_t *w);

void loadgen_workload_free(loadgen_workload_t *w);

#endif /* TD_LOADGEN_WORKLOAD_H */
