/*
 * td_node_addr: socket addresses as a node compares them (td_node_addr.h).
 */
#include "td_node_addr.h"

#include <ifaddrs.h>
#include <stdint.h>
#include <string.h>

bool td_node_ip_of(const struct sockaddr *a, struct in6_addr *ip)
{
    if (a->sa_family == AF_INET6) {
        *ip = ((const struct sockaddr_in6 *)a)->sin6_addr;
        return true;
    }
    if (a->sa_family != AF_INET)
        return false;
    memset(ip, 0, sizeof *ip);
    ip->s6_addr[10] = ip->s6_addr[11] = 0xff;
    memcpy(&ip->s6_addr[12], &((const struct sockaddr_in *)a)->sin_addr, 4);
    return true;
}

bool td_node_ip_is_local(const struct in6_addr *ip)
{
    static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (IN6_IS_ADDR_LOOPBACK(ip) || (!memcmp(ip->s6_addr, v4mapped, 12) && ip->s6_addr[12] == 127))
        return true;
    struct ifaddrs *ifs, *i;
    if (getifaddrs(&ifs) != 0)
        return false;
    bool local = false;
    struct in6_addr a;
    for (i = ifs; i && !local; i = i->ifa_next)
        local = i->ifa_addr && td_node_ip_of(i->ifa_addr, &a) && !memcmp(&a, ip, sizeof a);
    freeifaddrs(ifs);
    return local;
}
