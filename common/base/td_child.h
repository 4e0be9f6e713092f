/*
 * td_child: a program started as a child process, the one way tandem starts one
 * (`tandem local`'s router and nodes, `tandem bench router`'s router, the router of
 * test_router_relay): fork + execv, its stdout optionally a pipe to us, its lines read
 * with a deadline, and its end: SIGTERM, a bounded wait, then SIGKILL, always reaped.
 *
 * Why fork/execv and not libuv's uv_spawn: uv_spawn resets every signal to its default in
 * the child (a router started by a process that ignores SIGPIPE must keep ignoring it, as
 * an exec'd process does), cannot ask the kernel to end the child with its parent
 * (PR_SET_PDEATHSIG: a failed test or a killed bench must not leave a router that holds
 * ctest's output pipe open) and cannot pin it to a CPU before it runs.
 *
 * Everything here blocks the calling thread (spawn and stop run before or after a loop,
 * never inside one). Errors are described with td_errorf (logged) where the spawn
 * decides them; td_child_read_line's end-of-wait statuses are quiet, the caller says what
 * the missing line means.
 */
#ifndef TD_CHILD_H
#define TD_CHILD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "td_status.h"

/* Where the child's stdout goes (stdin and stderr are always ours). */
typedef enum td_child_out {
    TD_CHILD_OUT_INHERIT, /* our stdout */
    TD_CHILD_OUT_PIPE,    /* a pipe: read it with td_child_read_line or take out_fd */
    TD_CHILD_OUT_STDERR,  /* our stderr: a child's banners kept off our own stdout */
} td_child_out_t;

typedef struct td_child_config {
    const char *file;  /* the program's path (no PATH search) */
    char *const *argv; /* argv[0] included, NULL-terminated */
    td_child_out_t out;
    bool die_with_parent; /* SIGTERM to the child when this process ends, however it ends */
    int cpu;              /* >= 0: the child runs only on this CPU (it exits 126 if that
                             fails); -1: our affinity */
} td_child_config_t;

/* out INHERIT, die_with_parent false, cpu -1; file and argv to fill. */
td_child_config_t td_child_config_default(void);

/* A started child. pid 0: none (never started, or reaped). */
typedef struct td_child {
    pid_t pid;
    int out_fd;     /* the read end of its stdout pipe (TD_CHILD_OUT_PIPE), else -1;
                       the owner closes it (td_child_close) or takes it */
    char buf[1024]; /* what td_child_read_line read past the last line */
    size_t len;
} td_child_t;

/*
 * Starts c->file with c->argv into *child_p. In the child SIGINT and SIGTERM are reset to
 * their defaults (handlers are reset by exec anyway; an ignored one would not be); other
 * ignored signals stay ignored, as across any exec. A program that cannot be executed
 * exits 127. Errors: TD_ERR_IO (pipe or fork failed; nothing left open).
 */
td_status_t td_child_spawn(const td_child_config_t *c, td_child_t *child_p);

/*
 * The next line of a piped child's stdout (without its newline, cut to cap - 1 bytes)
 * within timeout_ms. A line longer than the buffer comes in pieces. Statuses (quiet):
 * TD_ERR_TIMEOUT at the deadline, TD_ERR_CANCELLED when a signal interrupted the wait (the
 * caller looks at its flags and calls again), TD_ERR_CLOSED at end of file or a read error.
 */
td_status_t td_child_read_line(td_child_t *c, int timeout_ms, char *line, size_t cap);

/* True once the child has exited (reaped now or before: pid becomes 0); *status_p (may be
 * NULL) gets its waitpid status when it was reaped by this call. Never blocks. */
bool td_child_exited(td_child_t *c, int *status_p);

/*
 * Stops children[0..n) together: signum to each (the last first; SIGTERM, or SIGINT for a
 * cluster node that must stop at once rather than drain), up to grace_ms for all of them to
 * exit, then SIGKILL to the rest; every one is reaped (pid 0). status[i] (when status is not
 * NULL) gets child i's waitpid status, 0 for one that was not running.
 */
void td_child_stop_all(td_child_t *children, int n, int signum, uint32_t grace_ms, int *status);

/* Closes out_fd if open (after the child was stopped, or to drop its output). */
void td_child_close(td_child_t *c);

#endif /* TD_CHILD_H */
