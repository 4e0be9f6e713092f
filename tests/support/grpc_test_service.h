/*
 * grpc_test_service.h: a tandem.v1.Generation + grpc.health.v1.Health test server that
 * runs on its own thread and loop, for the gRPC tests (test_grpc*.c). Not a real router:
 * Generate streams max_tokens fixed tokens (token i = 1000 + i, text "t<i> ", the last
 * with FINISH_REASON_LENGTH and usage); special prompts drive the edge cases:
 *   "slow"          never answers; records the cancel reason (deadline / reset tests)
 *   "echo:..."      one response whose text is the prompt (message size tests)
 *   "backpressure"  streams 10,000 messages honouring BUSY/writable, recording the
 *                   largest send queue seen
 *   "overflow"      sends until the queue is full (BUSY), records the queued bytes, ends
 *                   RESOURCE_EXHAUSTED (what the router does to a client that stopped reading)
 *   "stats"         one response whose text is "calls C queued B": calls with an open stream
 *                   and their queued bytes (td_grpc_server_stats)
 * Part of the td_test_support library every tests/unit/test_*.c links.
 */
#ifndef GRPC_TEST_SERVICE_H
#define GRPC_TEST_SERVICE_H

#include <stdatomic.h>
#include <stddef.h>
#include <uv.h>

#include "td_grpc.h"
#include "td_test_loop.h"

#define BP_MESSAGES 10000 /* what the "backpressure" prompt streams */

typedef struct test_server {
    td_test_loop_t l;
    td_grpc_server_config_t cfg;
    td_grpc_server_t *srv;
    uint16_t port;
    _Atomic int cancel_reason; /* td_status_t seen by the "slow" handler's cancel cb */
    _Atomic int cancels;
    _Atomic int bp_busy; /* BUSY returns seen by the back-pressure handler */
    _Atomic size_t bp_max_queued;
    _Atomic int bp_sent;
    _Atomic size_t ov_queued; /* queued bytes when the "overflow" handler ended */
    _Atomic int handled;
} test_server_t;

/* Starts the server thread; returns its port (0 on failure). */
uint16_t ts_start(test_server_t *ts, const td_grpc_server_config_t *cfg);

/* Stops the server thread; returns uv_loop_close's result (0 = every handle closed). */
int ts_stop(test_server_t *ts);

#endif /* GRPC_TEST_SERVICE_H */
