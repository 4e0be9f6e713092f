/*
 * td_plan_profile: the planner's step-time profile as a file and as a method (`tandem plan
 * profile`, `tandem plan calibrate`, `tandem plan`; docs/goodput.md "Capacity planning").
 *
 * A profile is a JSON document: the measured points of each phase ("prefill", "decode",
 * "kv_transfer", optional "speed"), their least-squares fits and how each was measured
 * ("method"). td_plan_profile_load reads the fits into a td_plan_profile_t; the rest builds
 * one. The method is here, the measuring is the caller's: td_plan_profile_engine runs the
 * sweeps of an engine in this process through a probe (two callbacks that time steps), and a
 * profile measured through a running cluster (common/loadgen, loadgen_profile.h) uses the
 * fits and the speed section below. Unlike td_plan.h this reads and writes files and times
 * memcpy (td_plan_copy_bandwidth); any thread, no shared state. Errors are td_status_t,
 * described once with td_errorf naming the file or what to change.
 */
#ifndef TD_PLAN_PROFILE_H
#define TD_PLAN_PROFILE_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "td_plan.h"
#include "td_status.h"

/* Timed steps per point of an engine profile (the median is kept), after one warm-up step. */
#define TD_PLAN_PROFILE_REPS 7

/*
 * Least squares on relative error: each row of x [n][k] and y [n] scaled by 1 / its y (in
 * place), so the short steps (the ones a lightly loaded node runs) weigh as much as the long
 * ones; then td_plan_fit.
 */
td_status_t td_plan_fit_relative(double *x, double *y, int n, int k, double *coef);

/*
 * The profile's "speed" section, added to j, from k lone decode runs of `tokens` steps each
 * whose mean steps are means[0..k) (reordered): each run over their median is a run factor,
 * and the factors drawn are the quantiles of a log-normal of median 1 with the run factors'
 * interquartile range. A line to stderr says what was measured; with no run timed, a warning
 * and no section.
 */
void td_plan_profile_speed(cJSON *j, double *means, int k, int tokens, const char *method);

/* Reads the fits (and the speed factors, when there are) of the profile at path. TD_ERR_INVALID
 * naming the file and what is missing: write it again with `tandem plan profile`. */
td_status_t td_plan_profile_load(const char *path, td_plan_profile_t *p);

/* Writes j to path; `what` (the command) names the failure: TD_ERR_IO with the cause. */
td_status_t td_plan_profile_write(const cJSON *j, const char *what, const char *path);

/* memcpy bandwidth of this machine in bytes/s over 64 MiB, best of 5: the same-host KV copy's
 * bound (0 when the buffers cannot be had). */
double td_plan_copy_bandwidth(void);

/* Steps timed by the caller for td_plan_profile_engine; both return a status, said. */
typedef struct td_plan_engine_probe {
    void *ctx;
    /* *s_p: the median seconds of one prefill step of `tokens` tokens (one new sequence) */
    td_status_t (*prefill)(void *ctx, int tokens, double *s_p);
    /* the median (and, mean_p not NULL, the mean) seconds of `reps` decode steps of `batch`
     * sequences holding `context` tokens each */
    td_status_t (*decode)(void *ctx, int batch, int context, int reps, double *median_p, double *mean_p);
} td_plan_engine_probe_t;

/* What td_plan_profile_engine sweeps. */
typedef struct td_plan_engine_sweep {
    int max_prompt;           /* largest prefill (tokens) */
    int max_context;          /* largest decode context: td_plan_profile_engine_context */
    int64_t max_batch;        /* largest decode batch */
    int64_t speed_runs;       /* lone decode runs of the speed section (0: none) */
    int speed_steps;          /* steps of each (the model's context allowing) */
    int max_seq_len;          /* the model's, for the message when no speed run fits */
    double kv_bytes_per_token; /* the KV transfer's model: these bytes / td_plan_copy_bandwidth */
} td_plan_engine_sweep_t;

/* The fits an engine profile found: prefill (a, b, c), decode (a, b, c), KV seconds a token. */
typedef struct td_plan_engine_fits {
    double prefill[3], decode[3], kv_s_per_token;
} td_plan_engine_fits_t;

/* The largest context of the decode grid (16, 128, 384, 1024) that a model of max_seq_len
 * tokens holds with the timed steps after it. */
int td_plan_profile_engine_context(int max_seq_len);

/*
 * An engine's profile into j: prefill steps of T tokens (T doubling from 8 to max_prompt),
 * decode steps over the grid of batch and context, the speed runs, the KV transfer's model;
 * each phase's points, fit and method. A line per point to stderr. The probe's first error,
 * or TD_ERR_INVALID when no speed run fits the model (give --speed-runs 0).
 */
td_status_t td_plan_profile_engine(const td_plan_engine_probe_t *pr, const td_plan_engine_sweep_t *sw, cJSON *j,
                                   td_plan_engine_fits_t *fits_p);

/* n lengths into v spread over a Prometheus histogram's buckets (upper bounds le[0..nb),
 * cumulative counts cum) in proportion to their counts, each the middle of its bucket (the
 * +Inf bucket: its lower bound), in a deterministic order whose every prefix spans the
 * distribution. TD_ERR_NOT_FOUND (not said) when the histogram counted nothing. */
td_status_t td_plan_lengths_from_hist(const double *le, const double *cum, int nb, size_t n, int32_t *v);

#endif /* TD_PLAN_PROFILE_H */
