/*
 * td_test_net: raw TCP clients of the tests (td_test_net.h).
 */
#include "td_test_net.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

int td_test_connect(uint16_t port)
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

bool td_test_raise_nofile(rlim_t want)
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

void td_test_half_open(uint16_t port, int *fds, int n, const char *half, size_t n_half)
{
    for (int i = 0; i < n; i++) {
        fds[i] = td_test_connect(port);
        send(fds[i], half, n_half, MSG_NOSIGNAL);
    }
}

static void *td_test_trickle_main(void *arg)
{
    td_test_trickle_t *t = arg;
    for (size_t k = 0; t->msg[k] && !t->stop; k++) {
        for (int i = 0; i < t->n; i++)
            send(t->fds[i], t->msg + k, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
        usleep(100000);
    }
    return NULL;
}

void td_test_trickle_start(td_test_trickle_t *t, uint16_t port, int n, const char *msg)
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

void td_test_trickle_stop(td_test_trickle_t *t)
{
    t->stop = true;
    pthread_join(t->thread, NULL);
    for (int i = 0; i < t->n; i++)
        close(t->fds[i]);
    free(t->fds);
}
