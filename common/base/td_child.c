/*
 * td_child: fork + execv, a stdout pipe read by lines with a deadline, and a bounded stop
 * (td_child.h).
 */
#include "td_child.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "td_util.h"

td_child_config_t td_child_config_default(void)
{
    return (td_child_config_t){.out = TD_CHILD_OUT_INHERIT, .cpu = -1};
}

/* The child between fork and exec: only async-signal-safe calls. */
static _Noreturn void td_child_exec(const td_child_config_t *c, const int p[2])
{
    if (c->die_with_parent)
        prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (c->out == TD_CHILD_OUT_PIPE) {
        dup2(p[1], STDOUT_FILENO);
        close(p[0]);
        close(p[1]);
    } else if (c->out == TD_CHILD_OUT_STDERR) {
        dup2(STDERR_FILENO, STDOUT_FILENO);
    }
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    if (c->cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(c->cpu, &set);
        if (sched_setaffinity(0, sizeof set, &set) != 0)
            _exit(126);
    }
    execv(c->file, c->argv);
    _exit(127);
}

td_status_t td_child_spawn(const td_child_config_t *c, td_child_t *child_p)
{
    int p[2] = {-1, -1};
    if (c->out == TD_CHILD_OUT_PIPE && pipe2(p, O_CLOEXEC) != 0)
        return td_errorf(TD_ERR_IO, "%s: pipe: %s", c->file, strerror(errno));
    fflush(NULL); /* what our stdio buffers hold is ours to write, once */
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        if (p[0] >= 0) {
            close(p[0]);
            close(p[1]);
        }
        return td_errorf(TD_ERR_IO, "%s: fork: %s", c->file, strerror(e));
    }
    if (pid == 0)
        td_child_exec(c, p);
    if (p[1] >= 0)
        close(p[1]);
    *child_p = (td_child_t){.pid = pid, .out_fd = p[0]};
    return TD_OK;
}

td_status_t td_child_read_line(td_child_t *c, int timeout_ms, char *line, size_t cap)
{
    uint64_t end = td_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        char *nl = memchr(c->buf, '\n', c->len);
        if (nl || c->len == sizeof c->buf) { /* a full buffer without a newline: one piece */
            size_t n = nl ? (size_t)(nl - c->buf) : c->len;
            snprintf(line, cap, "%.*s", (int)n, c->buf);
            size_t used = nl ? n + 1 : n;
            memmove(c->buf, c->buf + used, c->len - used);
            c->len -= used;
            return TD_OK;
        }
        if (c->out_fd < 0)
            return td_errorf_quiet(TD_ERR_CLOSED, "child %d: no stdout pipe", (int)c->pid);
        uint64_t now = td_now_ns();
        if (now >= end)
            return td_errorf_quiet(TD_ERR_TIMEOUT, "child %d: no line within %d ms", (int)c->pid,
                                   timeout_ms);
        struct pollfd pf = {.fd = c->out_fd, .events = POLLIN};
        int r = poll(&pf, 1, (int)((end - now) / 1000000ull) + 1);
        if (r < 0 && errno == EINTR)
            return td_errorf_quiet(TD_ERR_CANCELLED, "child %d: interrupted", (int)c->pid);
        if (r <= 0)
            continue;
        ssize_t got = read(c->out_fd, c->buf + c->len, sizeof c->buf - c->len);
        if (got < 0 && errno == EINTR)
            return td_errorf_quiet(TD_ERR_CANCELLED, "child %d: interrupted", (int)c->pid);
        if (got <= 0)
            return td_errorf_quiet(TD_ERR_CLOSED, "child %d: stdout closed", (int)c->pid);
        c->len += (size_t)got;
    }
}

bool td_child_exited(td_child_t *c, int *status_p)
{
    if (c->pid <= 0)
        return true;
    int status = 0;
    pid_t r = waitpid(c->pid, &status, WNOHANG);
    if (r == 0 || (r < 0 && errno == EINTR))
        return false;
    c->pid = 0; /* reaped, or not our child any more (ECHILD) */
    if (status_p)
        *status_p = status;
    return true;
}

void td_child_stop_all(td_child_t *children, int n, int signum, uint32_t grace_ms, int *status)
{
    for (int i = n - 1; i >= 0; i--) {
        if (status)
            status[i] = 0;
        if (children[i].pid > 0)
            kill(children[i].pid, signum);
    }
    uint64_t end = td_now_ns() + (uint64_t)grace_ms * 1000000ull;
    for (;;) {
        int left = 0;
        for (int i = 0; i < n; i++)
            if (!td_child_exited(&children[i], status ? &status[i] : NULL))
                left++;
        if (!left)
            return;
        if (td_now_ns() > end)
            break;
        usleep(10000);
    }
    for (int i = 0; i < n; i++) {
        if (children[i].pid <= 0)
            continue;
        kill(children[i].pid, SIGKILL);
        int st = 0;
        while (waitpid(children[i].pid, &st, 0) < 0 && errno == EINTR)
            ;
        if (status)
            status[i] = st;
        children[i].pid = 0;
    }
}

void td_child_close(td_child_t *c)
{
    if (c->out_fd >= 0)
        close(c->out_fd);
    c->out_fd = -1;
    c->len = 0;
}
