/*
 * td_xfer_testkit: the UCX loopback environment and pipe I/O shared by the td_xfer tests
 * and the kvxfer benchmark (see td_xfer_testkit.h).
 */
#include "td_xfer_testkit.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void td_xfer_testkit_env(const char *tls)
{
    setenv("UCX_TLS", tls, 1);
    setenv("UCX_NET_DEVICES", "lo", 1);
    setenv("UCX_TCP_CM_REUSEADDR", "y", 1);
    setenv("UCX_HANDLE_ERRORS", "none", 1);
    setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
    setenv("UCX_MM_ERROR_HANDLING", "y", 1); /* shared memory with peer error handling */
    setenv("UCX_SOCKADDR_TLS_PRIORITY", "tcp", 1);
}

const char *td_xfer_testkit_tls(const char *transport)
{
    if (!strcmp(transport, "tcp"))
        return "tcp";
    if (!strcmp(transport, "sm"))
        return "sm,tcp";
    return NULL;
}

bool td_xfer_testkit_write_all(int fd, const void *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return false;
        p = (const char *)p + w;
        n -= (size_t)w;
    }
    return true;
}

bool td_xfer_testkit_read_all(int fd, void *p, size_t n)
{
    while (n) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return false;
        p = (char *)p + r;
        n -= (size_t)r;
    }
    return true;
}
