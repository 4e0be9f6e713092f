/*
 * loadgen: the load generator of `tandem bench serve` and `tandem plan profile --gateway /
 * --openai` (the client that drives a cluster is loadgen_client.h), and here its pure parts,
 * apart so that tests/unit/test_bench_serve_stats.c checks them without a cluster: a seeded
 * PRNG and the arrival times it draws (Poisson, or gamma with vLLM's burstiness), the three datasets
 * (vLLM's random lengths, a ShareGPT JSON file, a trace of arrival time / input length /
 * output length), the statistics of a run (mean, std, median, p90, p99 as numpy computes
 * them), the service-level objectives and goodput (DistServe's: completed requests per
 * second that met every given objective), and the --sweep list of rates.
 *
 * No I/O besides what the caller hands in (file text), no global state; any thread. Errors
 * are td_status_t, described once with td_errorf naming the file, line or flag.
 */
#ifndef TD_LOADGEN_H
#define TD_LOADGEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"
#include "td_tokenizer.h"

/* ---- PRNG (xoshiro256**, seeded by splitmix64): equal seeds give equal runs ---------- */
typedef struct loadgen_rng {
    uint64_t s[4];
} loadgen_rng_t;

void loadgen_rng_seed(loadgen_rng_t *r, uint64_t seed);
uint64_t loadgen_rng_next(loadgen_rng_t *r);
double loadgen_rng_uniform(loadgen_rng_t *r);                     /* (0, 1) */
int64_t loadgen_rng_int(loadgen_rng_t *r, int64_t lo, int64_t hi); /* [lo, hi] */
double loadgen_rng_gamma(loadgen_rng_t *r, double shape, double scale); /* Marsaglia-Tsang; mean shape*scale */

/*
 * Arrival times of n requests into t[0..n) (seconds from the start, non-decreasing):
 * t[0] = 0 and gaps drawn from a gamma distribution of shape `burstiness` and mean
 * 1/rate (vLLM's: burstiness 1 is a Poisson process, < 1 burstier, > 1 more even). A rate
 * that is infinite puts every arrival at 0. rate > 0, burstiness > 0 (checked by the caller).
 */
void loadgen_arrivals(loadgen_rng_t *r, double rate, double burstiness, size_t n, double *t);

/* ---- datasets ------------------------------------------------------------------------- */
typedef struct loadgen_item {
    double arrival_s;         /* trace: when to send it (from the trace's first row); else -1 */
    uint32_t input_len;       /* prompt tokens (sent as ids) or, with text, the count known here (0: unknown) */
    uint32_t output_len;      /* max_tokens */
    uint64_t id_seed;         /* its prompt ids: loadgen_prompt_id(item, i, vocab) (ids prompts) */
    char *text;               /* ShareGPT: the prompt's text (sent as text); NULL: ids */
} loadgen_item_t;

typedef struct loadgen_dataset {
    loadgen_item_t *items;         /* [n] */
    size_t n;
    bool timed;               /* a trace: items carry arrival_s */
} loadgen_dataset_t;

/*
 * vLLM's random dataset: n requests, input lengths uniform in [in*(1-rr), in*(1+rr)],
 * output lengths likewise (each at least 1), prompt ids starting at a random offset.
 * Returns TD_ERR_NOMEM or TD_OK.
 */
/*
 * Prompt id i of an ids-prompt item: uniform in [1, vocab) and drawn from the item's own
 * seed, so that two prompts share no prefix (a run of the vocabulary from an offset, vLLM's
 * old way, repeats whole prompts once offsets collide, and a prefix cache serves them).
 */
uint32_t loadgen_prompt_id(const loadgen_item_t *it, uint32_t i, uint32_t vocab);

td_status_t loadgen_dataset_random(loadgen_rng_t *r, size_t n, uint32_t input_len, uint32_t output_len, double range_ratio,
                              loadgen_dataset_t *d);

/*
 * A trace (`name` for messages): JSON Lines of objects with an arrival time in seconds
 * ("arrival_s", "timestamp" or "time"), an input length ("input_len", "input_length" or
 * "input_tokens") and an output length ("output_len", "output_length" or "output_tokens"),
 * or CSV lines "arrival_s,input_len,output_len" (a first line that is not numbers is a
 * header); blank lines and '#' lines skipped. Times are made relative to the earliest and
 * must not decrease. At most max_n rows are kept (0: all). Errors name the line.
 */
td_status_t loadgen_dataset_trace_parse(const char *text, size_t len, const char *name, size_t max_n, loadgen_rng_t *r,
                                   loadgen_dataset_t *d);

/*
 * A ShareGPT file: a JSON array of {"conversations": [{"from": "human", "value": ...},
 * {"from": "gpt", "value": ...}, ...]}; the first human turn followed by a gpt turn is a
 * request, its output length the gpt turn's tokens (`tok`, or bytes/4 without one),
 * `fixed_output_len` instead when > 0. As vLLM: entries shuffled with r, entries whose
 * prompt or output is under 4 tokens or whose prompt is over 1024 or sum over 2048
 * skipped (input_len 0 when there is no tokenizer: the server's usage tells). At most
 * max_n requests (0: all).
 */
td_status_t loadgen_dataset_sharegpt_parse(const char *text, size_t len, const char *name, const td_tokenizer_t *tok,
                                      uint32_t fixed_output_len, size_t max_n, loadgen_rng_t *r, loadgen_dataset_t *d);

void loadgen_dataset_free(loadgen_dataset_t *d);

/* ---- statistics ---------------------------------------------------------------------- */
#define LOADGEN_MAX_PERCENTILES 16

typedef struct loadgen_stat {
    double mean, std, median, p90, p99; /* NAN with no samples; std is the population's (numpy's) */
    double pct[LOADGEN_MAX_PERCENTILES]; /* the run's --metric-percentiles, in their order (loadgen_run_opts_t) */
} loadgen_stat_t;

/* Sorts v[0..n) in place and summarises it (percentiles: td_stats_percentile, numpy's). */
void loadgen_stat_of(double *v, size_t n, loadgen_stat_t *out);

/* ---- objectives and goodput ---------------------------------------------------------- */
typedef struct loadgen_slo {
    double ttft_ms, tpot_ms, e2el_ms; /* <= 0: not given */
} loadgen_slo_t;

/*
 * Adds the objectives of `text` to *slo: "ttft:MS", "tpot:MS", "e2el:MS", separated by
 * spaces or commas (vLLM's --goodput KEY:VALUE pairs). TD_ERR_INVALID naming the pair.
 */
td_status_t loadgen_slo_parse(const char *text, loadgen_slo_t *slo);
bool loadgen_slo_any(const loadgen_slo_t *slo);

/* One finished request, as the summary reads it. */
typedef struct loadgen_outcome {
    bool ok;
    uint32_t input_tokens, output_tokens;
    double ttft_ms, tpot_ms, e2el_ms; /* tpot 0 with one output token (vLLM's) */
} loadgen_outcome_t;

/* Whether an ok request met every given objective. */
bool loadgen_slo_met(const loadgen_slo_t *slo, const loadgen_outcome_t *o);

/* The figures of a run (vLLM's names in its JSON). */
typedef struct loadgen_summary {
    uint64_t completed, failed, good;
    uint64_t total_input, total_output;
    double duration_s;
    double request_throughput, output_throughput, total_token_throughput;
    double request_goodput;   /* good / duration (with no objectives: every completed one is good) */
    double slo_attainment;    /* good / (completed + failed) */
} loadgen_summary_t;

void loadgen_summarize(const loadgen_outcome_t *o, size_t n, double duration_s, const loadgen_slo_t *slo, loadgen_summary_t *s);

/* ---- --sweep -------------------------------------------------------------------------- */
/*
 * Rates of "R1,R2,..." or "START:STOP:STEP" (STOP included) into a malloc'd *rates_p of
 * *n_p (at most 1000, each > 0, "inf" allowed in a list). TD_ERR_INVALID naming --sweep.
 */
td_status_t loadgen_rates_parse(const char *text, double **rates_p, size_t *n_p);

/* The highest rate whose attainment is >= min_attainment, or NAN when none. */
double loadgen_sweep_best(const double *rates, const double *attainment, size_t n, double min_attainment);

#endif /* TD_LOADGEN_H */
