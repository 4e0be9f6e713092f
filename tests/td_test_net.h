/*
 * td_test_net: the raw-socket side of the tests that talk to our servers byte by byte
 * (test_grpc's bad connections, test_metrics' HTTP/1.1 requests): a blocking TCP
 * connection to 127.0.0.1 whose reads give up after 5 s, so a server that never answers
 * fails the test instead of hanging it.
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
#include <sys/time.h>

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

#endif /* TD_TEST_NET_H */
