/*
 * bench_serve_client: `tandem bench serve`'s load generator (bench/bench_serve.c) as a library,
 * for the commands that measure a running cluster through its front door (`tandem plan profile
 * --gateway / --openai`). The same target parsing, the same OpenAI HTTP/1.1 connections
 * (bench_http_client) and gRPC channels, the same per-request clock (send, first token, each
 * gap, end) and the same deadline tick: one way to talk to a cluster and time it.
 *
 * A client is a handle: create it once (it opens the loop and, for the gateway, the channels),
 * run batches of requests on it, destroy it. A run sends every item at once, at most
 * `max_concurrency` in flight, and returns when each has its verdict (an answer, a failure,
 * or --request-timeout-s passed): it blocks the calling thread, which owns the client.
 * Prompts are ids (bs_prompt_id: no two items share a prefix, so a prefix cache serves none).
 * Errors are td_status_t, described once with td_errorf; a request that fails is a reply with
 * ok false and its error, not an error of the run.
 */
#ifndef TD_BENCH_SERVE_CLIENT_H
#define TD_BENCH_SERVE_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bench_serve.h"
#include "td_status.h"

typedef struct bs_client_config {
    const char *openai;       /* the router's OpenAI API, http://HOST:PORT[/v1]; or NULL */
    const char *gateway;      /* the router's gRPC gateway, HOST:PORT; or NULL (exactly one is set) */
    const char *model;        /* model name sent, or NULL: the served one */
    const char *api_key;      /* sent as Authorization: Bearer KEY, or NULL */
    uint32_t vocab;           /* prompt ids drawn from [1, vocab) */
    bool ignore_eos;          /* every request generates its output_len */
    double request_timeout_s; /* a request not ended within this fails */
    int64_t connections;      /* gRPC channels the streams are spread over */
} bs_client_config_t;

/* The defaults of `bench serve`: vocabulary 256, ignore_eos, 300 s, 4 channels. */
bs_client_config_t bs_client_config_default(void);

typedef struct bs_client bs_client_t;

/* One request's verdict and clock. */
typedef struct bs_reply {
    bool ok;
    const char *error;        /* why it failed, or NULL; owned by the replies */
    uint32_t output_tokens;   /* the server's usage (token-carrying messages without one) */
    double start_ms;          /* sent, from the run's start */
    double ttft_ms, e2el_ms;  /* sent to first token / to end (ok ones) */
    const double *itl_ms;     /* [n_itl] gaps between token-carrying messages, in order */
    uint32_t n_itl;
} bs_reply_t;

typedef struct bs_replies {
    bs_reply_t *r;            /* [n], in the order of the items */
    size_t n;
    void *run;                /* what they point into */
} bs_replies_t;

/*
 * A client of the cluster at cfg's target (copied; the strings are borrowed for the client's
 * life). TD_ERR_INVALID naming --openai / --gateway (`prog` names the command) for a target
 * that is not one, TD_ERR_NOMEM; nothing is sent yet, so a cluster that is not there shows
 * in the first run's replies.
 */
td_status_t bs_client_create(const bs_client_config_t *cfg, const char *prog, bs_client_t **c_p);

/*
 * Sends items[0..n) at once, at most max_concurrency (>= 1) in flight, and waits for every
 * verdict (each bounded by the request timeout). The replies are the caller's
 * (bs_replies_free). TD_ERR_NOMEM only; failed requests are replies.
 */
td_status_t bs_client_run(bs_client_t *c, const bs_item_t *items, size_t n, int64_t max_concurrency,
                          bs_replies_t *out_p);

void bs_replies_free(bs_replies_t *r);

/* Closes the connections and the loop. NULL is a no-op. */
void bs_client_destroy(bs_client_t *c);

#endif /* TD_BENCH_SERVE_CLIENT_H */
