/*
 * td_test_net: the raw-socket side of the tests that talk to our servers byte by byte
 * (test_grpc's bad connections, test_metrics' HTTP/1.1 requests): a blocking TCP
 * connection to 127.0.0.1 whose reads give up after 5 s, so a server that never answers
 * fails the test instead of hanging it.
 *
 * Also the hostile clients of the connection-limit tests: half-open floods and tricklers.
 *
 * Header-only (static inline), like td_test_models.h: every tests/test_*.c is its own
 * executable. Threads: the test's own.
 */
#ifndef TD_TEST_NET_H
#define TD_TEST_NET_H

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

/* A connected socket to 127.0.0.1:port (asserts the connect); the caller closes it. */
static inline int td_test_connect(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0, "socket");
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

/* Raises RLIMIT_NOFILE's soft limit to at least `want` (within the hard limit); false
 * when the hard limit is lower, so a flood test can skip saying why. */
static inline bool td_test_raise_nofile(rlim_t want)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return false;
    if (rl.rlim_cur >= want)
        return true;
    if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < want)
        return false;
    rl.rlim_cur = want;
    return setrlimit(RLIMIT_NOFILE, &rl) == 0;
}

/* n connections that each sent `half` (n_half bytes) and then nothing: the half-open
 * flood. Connects may stall while the server's accept queue is full; that is the point. */
static inline void td_test_half_open(uint16_t port, int *fds, int n, const char *half, size_t n_half)
{
    for (int i = 0; i < n; i++) {
        fds[i] = td_test_connect(port);
        send(fds[i], half, n_half, MSG_NOSIGNAL);
    }
}

/* Slow clients: each of n connections sends `msg` one byte per round, a round every
 * 100 ms, until msg ends or `stop` is set; a send to a closed connection fails quietly. */
typedef struct td_test_trickle {
    uint16_t port;
    int n;
    int *fds;                   /* [n], connected by td_test_trickle_start */
    const char *msg;
    _Atomic bool stop;
    pthread_t thread;
} td_test_trickle_t;

static inline void *td_test_trickle_main(void *arg)
{
    td_test_trickle_t *t = arg;
    for (size_t k = 0; t->msg[k] && !t->stop; k++) {
        for (int i = 0; i < t->n; i++)
            send(t->fds[i], t->msg + k, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        usleep(100000);
    }
    return NULL;
}

static inline void td_test_trickle_start(td_test_trickle_t *t, uint16_t port, int n, const char *msg)
{
    t->port = port;
    t->n = n;
    t->msg = msg;
    t->stop = false;
    t->fds = calloc((size_t)n, sizeof *t->fds);
    cr_assert(t->fds);
    for (int i = 0; i < n; i++)
        t->fds[i] = td_test_connect(port);
    cr_assert_eq(pthread_create(&t->thread, NULL, td_test_trickle_main, t), 0);
}

static inline void td_test_trickle_stop(td_test_trickle_t *t)
{
    t->stop = true;
    pthread_join(t->thread, NULL);
    for (int i = 0; i < t->n; i++)
        close(t->fds[i]);
    free(t->fds);
}

#endif /* TD_TEST_NET_H */
