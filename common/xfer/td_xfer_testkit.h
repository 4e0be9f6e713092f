/*
 * td_xfer_testkit: what every two-process td_xfer harness needs (tests/unit/test_xfer.c,
 * tests/unit/test_decode_sched.c, bench/bench_kvxfer.c): the UCX environment that pins a
 * transport on loopback the way docs/xfer.md describes, and whole-buffer reads and writes
 * on the pipes over which a forked receiver hands its description and leases to the
 * sender. Not used by the serving processes.
 *
 * Threads: any; td_xfer_testkit_env changes the process environment, so call it before
 * UCX is initialised (before td_xfer_create) and before starting threads.
 */
#ifndef TD_XFER_TESTKIT_H
#define TD_XFER_TESTKIT_H

#include <stdbool.h>
#include <stddef.h>

/*
 * Sets UCX_TLS to `tls` ("tcp", "sm,tcp", ...; shared memory needs tcp beside it for the
 * listener) and the rest of the loopback environment: UCX_NET_DEVICES=lo, TCP address
 * reuse, shared memory with peer error handling, sockaddr over tcp, no warnings about
 * unused variables, no UCX signal handlers.
 */
void td_xfer_testkit_env(const char *tls);

/* The UCX_TLS value for a bench/test transport name: "tcp" -> "tcp", "sm" -> "sm,tcp";
 * NULL for anything else. */
const char *td_xfer_testkit_tls(const char *transport);

/* Writes / reads exactly n bytes (retrying on EINTR and short counts). False on EOF or
 * an error (errno set). */
bool td_xfer_testkit_write_all(int fd, const void *p, size_t n);
bool td_xfer_testkit_read_all(int fd, void *p, size_t n);

#endif /* TD_XFER_TESTKIT_H */
