/*
 * loadgen_workload: the workload `tandem plan` simulates (contract in loadgen_workload.h):
 * the load generator's datasets (random lengths drawn with bench serve's seed, a trace in its
 * format) or a live router's /metrics (arrival rate from two scrapes, lengths from its
 * histograms).
 */
#include "loadgen_workload.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "td_http_client.h"
#include "td_metrics.h"
#include "td_plan_profile.h"
#include "td_util.h"

#define LW_METRICS_TIMEOUT_MS 5000 /* a router's /metrics answers within this */
#define MAX_BUCKETS 64

void loadgen_workload_free(loadgen_workload_t *w)
{
    free(w->in), free(w->out), free(w->timed);
}

static td_status_t workload_from_dataset(const loadgen_dataset_t *d, loadgen_workload_t *w)
{
    w->n = d->n;
    w->in = malloc(TD_MAX(d->n, (size_t)1) * sizeof(int32_t));
    w->out = malloc(TD_MAX(d->n, (size_t)1) * sizeof(int32_t));
    if (d->timed)
        w->timed = malloc(TD_MAX(d->n, (size_t)1) * sizeof *w->timed);
    if (!w->in || !w->out || (d->timed && !w->timed))
        return td_errorf(TD_ERR_NOMEM, "plan: out of memory for the workload");
    for (size_t i = 0; i < d->n; i++) {
        w->in[i] = (int32_t)TD_MAX(d->items[i].input_len, 1u);
        w->out[i] = (int32_t)TD_MAX(d->items[i].output_len, 1u);
        if (w->timed)
            w->timed[i] = (td_plan_request_t){d->items[i].arrival_s, w->in[i], w->out[i]};
    }
    if (d->timed && d->n > 1 && d->items[d->n - 1].arrival_s > 0)
        w->rate = (double)(d->n - 1) / d->items[d->n - 1].arrival_s;
    return TD_OK;
}

td_status_t loadgen_workload_parse(const char *spec, size_t n, uint64_t seed, loadgen_workload_t *w)
{
    loadgen_rng_t rng;
    loadgen_rng_seed(&rng, seed);
    loadgen_dataset_t d = {0};
    td_status_t st;
    if (!strncmp(spec, "random:", 7)) {
        char *end;
        long in = strtol(spec + 7, &end, 10), out = *end == ':' ? strtol(end + 1, &end, 10) : 0;
        double rr = 0;
        if (*end == ':')
            rr = strtod(end + 1, &end);
        if (in < 1 || out < 1 || in > 1 << 20 || out > 1 << 20 || *end || rr < 0 || rr >= 1)
            return td_errorf(TD_ERR_INVALID, "--workload: '%s' is not random:IN:OUT[:RANGE] (IN, OUT >= 1, "
                                             "0 <= RANGE < 1)", spec);
        if ((st = loadgen_dataset_random(&rng, n, (uint32_t)in, (uint32_t)out, rr, &d)) != TD_OK)
            return st;
        snprintf(w->desc, sizeof w->desc, "random input %ld output %ld range %.2f", in, out, rr);
    } else if (!strncmp(spec, "trace:", 6)) {
        char *text = NULL;
        size_t len = 0;
        if ((st = td_file_read_all(spec + 6, (size_t)1 << 30, &text, &len)) != TD_OK)
            return st;
        st = loadgen_dataset_trace_parse(text, len, spec + 6, 0, &rng, &d);
        free(text);
        if (st != TD_OK)
            return st;
        if (!d.n) {
            loadgen_dataset_free(&d);
            return td_errorf(TD_ERR_INVALID, "--workload: %s has no requests", spec + 6);
        }
        snprintf(w->desc, sizeof w->desc, "trace %s (%zu requests)", spec + 6, d.n);
    } else {
        return td_errorf(TD_ERR_INVALID, "--workload: '%s' is neither random:IN:OUT[:RANGE] nor trace:FILE", spec);
    }
    st = workload_from_dataset(&d, w);
    loadgen_dataset_free(&d);
    return st;
}

td_status_t loadgen_workload_metrics(const char *url, double window_s, size_t n, loadgen_workload_t *w)
{
    char *a = NULL, *b = NULL;
    td_status_t st = td_http_client_get(url, "--metrics", "/metrics", LW_METRICS_TIMEOUT_MS, &a);
    if (st != TD_OK)
        return st;
    uint64_t t0 = td_now_ns();
    struct timespec ts = {.tv_sec = (time_t)window_s, .tv_nsec = (long)((window_s - floor(window_s)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    if ((st = td_http_client_get(url, "--metrics", "/metrics", LW_METRICS_TIMEOUT_MS, &b)) != TD_OK) {
        free(a);
        return st;
    }
    double dt = (double)(td_now_ns() - t0) * 1e-9;
    double arr0 = td_metrics_text_value(a, "tandem_router_requests_arrived_total"),
           arr1 = td_metrics_text_value(b, "tandem_router_requests_arrived_total");
    double le[MAX_BUCKETS], cum[MAX_BUCKETS], le2[MAX_BUCKETS], cum2[MAX_BUCKETS];
    int ni = td_metrics_text_buckets(b, "tandem_router_prompt_tokens", le, cum, MAX_BUCKETS);
    int no = td_metrics_text_buckets(b, "tandem_router_output_tokens", le2, cum2, MAX_BUCKETS);
    free(a);
    w->in = malloc(n * sizeof(int32_t));
    w->out = malloc(n * sizeof(int32_t));
    if (!w->in || !w->out)
        st = td_errorf(TD_ERR_NOMEM, "plan: out of memory for the workload");
    else if (isnan(arr1) || !ni || !no)
        st = td_errorf(TD_ERR_INVALID, "--metrics: %s has no tandem_router_requests_arrived_total or no prompt/"
                                       "output token histograms: is it a tandem router's /metrics?", url);
    else if (td_plan_lengths_from_hist(le, cum, ni, n, w->in) != TD_OK || td_plan_lengths_from_hist(le2, cum2, no, n, w->out) != TD_OK)
        st = td_errorf(TD_ERR_INVALID, "--metrics: the router at %s has ended no request yet: nothing to plan from",
                       url);
    free(b);
    if (st != TD_OK)
        return st;
    w->n = n;
    w->rate = (arr1 - arr0) / dt;
    snprintf(w->desc, sizeof w->desc, "live router %s (%.2f requests/s over %.1f s; lengths from its histograms)",
             url, w->rate, dt);
    return TD_OK;
}

