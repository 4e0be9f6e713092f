/*
 * loadgen_profile: the planner's step-time profile measured through a running cluster's front
 * door (`tandem plan profile --gateway HOST:PORT | --openai URL [--prefill-metrics URL]`;
 * docs/goodput.md "Capacity planning"), with the load generator's client (loadgen_client.h)
 * and the profile's method and file (td_plan_profile.h). Blocks the calling thread for the
 * whole measurement; every request is bounded by cfg.request_timeout_s, every scrape of the
 * prefill node's /metrics by 5 s.
 */
#ifndef TD_LOADGEN_PROFILE_H
#define TD_LOADGEN_PROFILE_H

#include <stdbool.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "loadgen_client.h"
#include "td_plan_profile.h"
#include "td_status.h"

typedef struct loadgen_profile_opts {
    loadgen_config_t cfg;     /* the cluster's target and the requests' settings */
    const char *target;       /* cfg's target, for messages and the profile */
    const char *prefill_metrics; /* its (only) prefill node's /metrics URL, or NULL */
    int64_t max_tokens;       /* largest prompt measured */
    int64_t max_batch;        /* largest decode batch measured */
    int64_t max_context;      /* longest prompt + output a decode stream may have */
    int64_t decode_tokens;    /* output tokens of a speed run and (at first) of a decode stream */
    int64_t reps;             /* lone requests per prompt length, rounds per decode point */
    int64_t speed_runs;       /* lone requests of the speed section (0: none) */
    bool progress;            /* each phase's progress on stderr (td_progress: a terminal, a line
                                 rewritten each second; elsewhere one every 10 s and one when the
                                 phase ends): "plan profile: decode: 40/96 requests (42%),
                                 5.10 req/s, 0 errors, ETA 11s" (loadgen_progress_show) */
} loadgen_profile_opts_t;

/* The fits found: prefill (a, b, c), decode (a, b, c), KV transfer (a, b), fixed overhead. */
typedef struct loadgen_profile_fits {
    double prefill[3], decode[3], kv[2], overhead_s;
} loadgen_profile_fits_t;

/*
 * Measures the profile: the JSON document is the caller's in *j_p (td_plan_profile_write),
 * its fits in *fits_p. Errors are said once (the first request that failed, naming the target
 * and what was sent; a /metrics that is not a prefill node's); *usage_p true when the flags
 * can fix it (a bad target, too few decode points, a prefill node that is not alone).
 */
td_status_t loadgen_profile_cluster(const loadgen_profile_opts_t *o, cJSON **j_p, loadgen_profile_fits_t *fits_p,
                                   bool *usage_p);

#endif /* TD_LOADGEN_PROFILE_H */
