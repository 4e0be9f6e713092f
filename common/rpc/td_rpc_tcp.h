/*
 * td_rpc_tcp: the TCP steps every server and channel of the RPC layer takes alike: an
 * address from an IP literal and a port (names are not resolved: the cluster passes
 * addresses), and a listener bound, listening and asked which port it got. td_http,
 * td_grpc_server and td_grpc_client use them, so an address means the same to each.
 */
#ifndef TD_RPC_TCP_H
#define TD_RPC_TCP_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "td_status.h"

/* An IPv4 or IPv6 literal and a port into *addr_p. False when host is neither; nothing is
 * logged (the caller says what the address was for). Any thread. */
bool td_rpc_tcp_addr(const char *host, uint16_t port, struct sockaddr_storage *addr_p);

/*
 * Binds the initialised handle `listener` to host:port, listens (backlog 128) with `cb`,
 * and sets *port_p to the port bound (the kernel's choice for port 0). Loop thread.
 * Errors, logged as "<who>: listen on HOST:PORT: <cause>": TD_ERR_INVALID (host is not an
 * IP literal), TD_ERR_IO (bind or listen failed). The handle stays the caller's to close
 * either way; *port_p is set only on success.
 */
td_status_t td_rpc_tcp_listen(uv_tcp_t *listener, const char *who, const char *host, uint16_t port,
                              uv_connection_cb cb, uint16_t *port_p);

#endif /* TD_RPC_TCP_H */
