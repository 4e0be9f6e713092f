/*
 * td_test_net: the raw-socket side of the tests that talk to our servers byte by byte
 * (test_grpc's bad connections, test_metrics' HTTP/1.1 requests): a blocking TCP
 * connection to 127.0.0.1 whose reads give up after 5 s, so a server that never answers
 * fails the test instead of hanging it.
 *
 * Also the hostile clients of the connection-limit tests: half-open floods and tricklers.
 *
 * Part of the td_test_support library every tests/unit/test_*.c links. Threads: the
 * test's own (a trickler runs one of its own).
 */
#ifndef TD_TEST_NET_H
#define TD_TEST_NET_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/resource.h>

/* A connected socket to 127.0.0.1:port (asserts the connect); the caller closes it. */
int td_test_connect(uint16_t port);

/* Raises RLIMIT_NOFILE's soft limit to at least `want` (within the hard limit); false
 * when the hard limit is lower, so a flood test can skip saying why. */
bool td_test_raise_nofile(rlim_t want);

/* n connections that each sent `half` (n_half bytes) and then nothing: the half-open
 * flood. Connects may stall while the server's accept queue is full; that is the point. */
void td_test_half_open(uint16_t port, int *fds, int n, const char *half, size_t n_half);

/* Slow clients: each of n connections sends `msg` one byte per round, a round every
 * 100 ms, until msg ends or `stop` is set; a send to a closed connection fails quietly. */
typedef struct td_test_trickle {
    uint16_t port;
    int n;
    int *fds; /* [n], connected by td_test_trickle_start */
    const char *msg;
    _Atomic bool stop;
    pthread_t thread;
} td_test_trickle_t;

/* Connects the n clients and starts their thread; asserts. */
void td_test_trickle_start(td_test_trickle_t *t, uint16_t port, int n, const char *msg);

/* Stops the thread and closes the connections. */
void td_test_trickle_stop(td_test_trickle_t *t);

#endif /* TD_TEST_NET_H */
