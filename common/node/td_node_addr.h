/*
 * td_node_addr: socket addresses as a node compares them (who may call it, whether a peer is
 * on this host). IPv4 addresses are read as their v4-mapped IPv6 form, so 127.0.0.1 and
 * ::ffff:127.0.0.1 compare equal.
 */
#ifndef TD_NODE_ADDR_H
#define TD_NODE_ADDR_H

#include <netinet/in.h>
#include <stdbool.h>
#include <sys/socket.h>

/* The address of a v4, v6 or v4-mapped v6 socket address as an IPv6 address in *ip; false
 * (and *ip untouched) for another family. */
bool td_node_ip_of(const struct sockaddr *a, struct in6_addr *ip);

/* True when ip is a loopback address or one of this host's interfaces (getifaddrs; false
 * when that fails). */
bool td_node_ip_is_local(const struct in6_addr *ip);

#endif /* TD_NODE_ADDR_H */
