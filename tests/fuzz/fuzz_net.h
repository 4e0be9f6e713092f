/*
 * fuzz_net.h: feeding one input to a server on this process's loop, as a client would: a
 * TCP connection to it, the bytes written, the write side shut (a client that sent its
 * request and waits), then the loop run until the server has closed the connection. A
 * server that keeps a half-closed connection open past FUZZ_NET_BOUND_MS, or lets the
 * loop stop, is a finding (abort): every connection with nothing more to come must end.
 */
#ifndef FUZZ_NET_H
#define FUZZ_NET_H

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <uv.h>

#include "fuzz_util.h"
#include "td_util.h"

#define FUZZ_NET_BOUND_MS 3000

static inline void fuzz_net_feed(uv_loop_t *loop, uint16_t port, const uint8_t *data, size_t size)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(0x7f000001)};
    /* non-blocking: libFuzzer's timers interrupt a blocking connect (EINTR) */
    if (fd < 0 || (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno != EINPROGRESS)) {
        perror("fuzz_net: connect");
        abort();
    }
    struct linger lg = {.l_onoff = 1, .l_linger = 0}; /* no TIME_WAIT pile-up over millions of runs */
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    uint64_t end = td_now_ns() + (uint64_t)FUZZ_NET_BOUND_MS * 1000000u;
    for (;;) { /* connected: writable, with no error pending */
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        if (poll(&p, 1, 0) == 1) {
            int err = 0;
            socklen_t len = sizeof err;
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
            if (err) {
                fprintf(stderr, "fuzz_net: connect: %s\n", strerror(err));
                abort();
            }
            break;
        }
        uv_run(loop, UV_RUN_NOWAIT);
        if (td_now_ns() > end) {
            fprintf(stderr, "fuzz_net: the server did not accept in %d ms\n", FUZZ_NET_BOUND_MS);
            abort();
        }
    }
    size_t off = 0;
    bool shut = false, closed = false;
    end = td_now_ns() + (uint64_t)FUZZ_NET_BOUND_MS * 1000000u;
    char sink[65536];
    while (!closed) {
        if (off < size) {
            ssize_t w = send(fd, data + off, size - off, MSG_NOSIGNAL);
            if (w > 0)
                off += (size_t)w;
            else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
                off = size; /* the server already closed: what is left cannot go */
        }
        if (off == size && !shut) {
            shutdown(fd, SHUT_WR);
            shut = true;
        }
        uv_run(loop, UV_RUN_NOWAIT);
        for (;;) {
            ssize_t r = recv(fd, sink, sizeof sink, 0);
            if (r > 0)
                continue;
            if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
                closed = true;
            break;
        }
        if (!closed && td_now_ns() > end) {
            fprintf(stderr, "fuzz_net: the server kept a half-closed connection open for %d ms\n", FUZZ_NET_BOUND_MS);
            abort();
        }
    }
    close(fd);
    /* the server's side of the close */
    for (int i = 0; i < 8; i++)
        uv_run(loop, UV_RUN_NOWAIT);
}

#endif /* FUZZ_NET_H */
