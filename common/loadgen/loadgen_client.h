/*
 * loadgen_client: the load generator's client of a running cluster, for `tandem bench serve`
 * and the commands that measure a cluster through its front door (`tandem plan profile
 * --gateway / --openai`). One way to talk to a cluster and time it: the target parsing, the
 * OpenAI HTTP/1.1 connections (td_http_client: one request in flight on each) or gRPC
 * channels (tandem.v1.Generation/Generate streams), the per-request clock (send, first token,
 * each gap, end) and a 50 ms tick that fails the requests past the request timeout.
 *
 * A client is a handle: create it once (it opens the loop and, for the gateway, the channels),
 * run batches of requests on it, destroy it. A run sends its requests as they arrive (a
 * Poisson or gamma process of a rate, the items' own times, or all at once), at most
 * max_concurrency in flight (the rest wait in arrival order), and returns when each has its
 * verdict (an answer, a failure, or the request timeout passed): it blocks the calling
 * thread, which owns the client. Prompts are ids (loadgen_prompt_id: no two items share a
 * prefix, so a prefix cache serves none) or an item's text. Errors are td_status_t,
 * described once with td_errorf; a request that fails is a reply with ok false and its
 * error, not an error of the run.
 */
#ifndef TD_LOADGEN_CLIENT_H
#define TD_LOADGEN_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "loadgen.h"
#include "td_progress.h"
#include "td_status.h"

typedef struct loadgen_config {
    const char *openai;       /* the router's OpenAI API, http://HOST:PORT[/v1]; or NULL */
    const char *endpoint;     /* appended to openai's path: the request path ("/v1/completions"
                                 after a bare http://HOST:PORT); NULL: "/completions" or
                                 "/chat/completions" after openai's path (/v1 when none) */
    bool chat;                /* OpenAI: chat completions, the prompt a user message (text
                                 only: items without text fail) */
    const char *gateway;      /* the router's gRPC gateway, HOST:PORT; or NULL (exactly one is set) */
    const char *model;        /* model name sent, or NULL: the served one */
    const char *api_key;      /* sent as Authorization: Bearer KEY, or NULL */
    uint32_t vocab;           /* prompt ids drawn from [1, vocab) */
    bool ignore_eos;          /* every request generates its output_len */
    double request_timeout_s; /* a request not ended within this fails */
    int64_t connections;      /* gRPC channels the streams are spread over */
} loadgen_config_t;

/* The defaults of `bench serve`: vocabulary 256, ignore_eos, 300 s, 4 channels. */
loadgen_config_t loadgen_config_default(void);

typedef struct loadgen_client loadgen_client_t;

/* Where a run stands, for progress_cb. */
typedef struct loadgen_progress {
    size_t n, n_done, n_failed;   /* requests of the run, with a verdict, failed among them */
    double elapsed_s;             /* since the run started */
} loadgen_progress_t;

/*
 * One update of a run's progress line on prog (td_progress.h; the caller's, initialised per
 * run or phase): requests with a verdict of all, their rate since the start, the errors and
 * the time left at that rate, "12/40 requests (30%), 3.10 req/s, 0 errors, ETA 9s"; `last`
 * (the work is over: ETA 0s) always prints and ends a terminal's line. `bench serve` and
 * `plan profile` both show their runs with it.
 */
void loadgen_progress_show(td_progress_t *prog, const loadgen_progress_t *p, bool last);

/* How one run sends its requests. */
typedef struct loadgen_run_opts {
    double rate;              /* requests/s of the arrivals; INFINITY: all at once */
    double burstiness;        /* gamma shape of the gaps between arrivals (1: Poisson) */
    bool timed;               /* the items' own arrival_s instead of rate */
    int64_t max_concurrency;  /* in flight at most, >= 1 (INT64_MAX: no limit) */
    loadgen_slo_t slo;        /* the objectives goodput counts */
    const double *percentiles; /* [n_percentiles] in [0, 100]: loadgen_stat_t.pct of the run */
    size_t n_percentiles;     /* at most LOADGEN_MAX_PERCENTILES */
    /* called on the client's thread every 50 ms tick of the run, and once when it ends
       (p->n_done == p->n): for a progress line; NULL: none */
    void (*progress_cb)(void *arg, const loadgen_progress_t *p);
    void *progress_arg;
} loadgen_run_opts_t;

/* One request's verdict and clock. */
typedef struct loadgen_reply {
    bool ok;
    const char *error;        /* why it failed, or NULL; owned by the run */
    uint32_t input_tokens;    /* the server's usage, or the item's length without one */
    uint32_t output_tokens;   /* the server's usage (token-carrying messages without one) */
    uint32_t requested_tokens; /* the item's output_len (max_tokens) */
    double arrival_s;         /* planned, from the run's start */
    double start_ms;          /* sent, from the run's start; NAN: never sent */
    double end_ms;            /* sent to verdict, failed ones too; NAN: never sent */
    double ttft_ms, tpot_ms, e2el_ms; /* ok ones: sent to first token, per token after it, to end */
    const double *itl_ms;     /* [n_itl] gaps between token-carrying messages, in order */
    uint32_t n_itl;
} loadgen_reply_t;

/* What one run gave: its figures (ok requests only) and every request's reply. */
typedef struct loadgen_run {
    double rate;
    loadgen_summary_t sum;
    loadgen_stat_t ttft, tpot, itl, e2el;
    int64_t max_concurrency_seen;
    double cpu_s;             /* this process's CPU during the run */
    loadgen_reply_t *r;       /* [n], in the order of the items */
    size_t n;
    void *reqs;               /* what the replies point into */
} loadgen_run_t;

/*
 * A client of the cluster at cfg's target (copied; the strings are borrowed for the client's
 * life). TD_ERR_INVALID naming --openai / --gateway (`prog` names the command) for a target
 * that is not one, TD_ERR_NOMEM; nothing is sent yet, so a cluster that is not there shows
 * in the first run's replies.
 */
td_status_t loadgen_client_create(const loadgen_config_t *cfg, const char *prog, loadgen_client_t **c_p);

/*
 * Runs n requests, items d->items[(first + i) % d->n], as o says, and waits for every verdict
 * (each bounded by the request timeout). rng draws the arrivals (untouched when o->timed or the
 * rate is infinite). The run is the caller's (loadgen_run_free). TD_ERR_NOMEM only; failed
 * requests are replies.
 */
td_status_t loadgen_client_run(loadgen_client_t *c, const loadgen_dataset_t *d, size_t first, size_t n,
                               const loadgen_run_opts_t *o, loadgen_rng_t *rng, loadgen_run_t *run_p);

void loadgen_run_free(loadgen_run_t *run);

/* Closes the connections and the loop. NULL is a no-op. */
void loadgen_client_destroy(loadgen_client_t *c);

#endif /* TD_LOADGEN_CLIENT_H */
