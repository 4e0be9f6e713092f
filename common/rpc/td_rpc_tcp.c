/*
 * td_rpc_tcp: address parsing and listening shared by the RPC layer's servers and
 * channels (see td_rpc_tcp.h).
 */
#include "td_rpc_tcp.h"

#include <netinet/in.h>

bool td_rpc_tcp_addr(const char *host, uint16_t port, struct sockaddr_storage *addr_p)
{
    return uv_ip4_addr(host, port, (struct sockaddr_in *)addr_p) == 0 ||
           uv_ip6_addr(host, port, (struct sockaddr_in6 *)addr_p) == 0;
}

td_status_t td_rpc_tcp_listen(uv_tcp_t *listener, const char *who, const char *host, uint16_t port,
                              uv_connection_cb cb, uint16_t *port_p)
{
    struct sockaddr_storage addr;
    if (!td_rpc_tcp_addr(host, port, &addr))
        return td_errorf(TD_ERR_INVALID, "%s: listen on %s:%u: not an IPv4 or IPv6 address", who, host, port);
    int rc = uv_tcp_bind(listener, (struct sockaddr *)&addr, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)listener, 128, cb);
    if (rc < 0)
        return td_errorf(TD_ERR_IO, "%s: listen on %s:%u: %s", who, host, port, uv_strerror(rc));
    struct sockaddr_storage bound;
    int blen = sizeof bound;
    uv_tcp_getsockname(listener, (struct sockaddr *)&bound, &blen);
    *port_p = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                : ((struct sockaddr_in *)&bound)->sin_port);
    return TD_OK;
}
