/*
 * td_progress: the progress line of long work on stderr (see td_progress.h).
 */
#include "td_progress.h"

#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>

#include "td_util.h"

void td_progress_init(td_progress_t *p, const char *prog, double log_every_s, double quiet_s)
{
    *p = (td_progress_t){.prog = prog, .tty = isatty(STDERR_FILENO) == 1, .log_every_s = log_every_s,
                         .quiet_s = quiet_s, .t0 = td_now_ns()};
}

double td_progress_elapsed(const td_progress_t *p)
{
    return (double)(td_now_ns() - p->t0) * 1e-9;
}

/* The line itself: rewritten in place on a terminal (\033[K clears what a longer one left). */
static void progress_vprint(td_progress_t *p, bool last, const char *fmt, va_list ap)
{
    fprintf(stderr, "%s%s: ", p->tty ? "\r" : "", p->prog);
    vfprintf(stderr, fmt, ap);
    if (p->tty && !last) {
        fputs("\033[K", stderr);
        p->open = true;
    } else {
        fputs(p->tty ? "\033[K\n" : "\n", stderr);
        p->open = false;
    }
    fflush(stderr);
    p->t_last = td_now_ns();
}

void td_progress_update(td_progress_t *p, bool last, const char *fmt, ...)
{
    uint64_t now = td_now_ns();
    if ((double)(now - p->t0) * 1e-9 < p->quiet_s)
        return;
    double every = p->tty ? 1.0 : p->log_every_s;
    if (!last && p->t_last && (double)(now - p->t_last) * 1e-9 < every)
        return;
    if (!last && !p->t_last && (double)(now - p->t0) * 1e-9 < TD_MIN(every, 1.0))
        return; /* the first line after a second at the earliest */
    va_list ap;
    va_start(ap, fmt);
    progress_vprint(p, last, fmt, ap);
    va_end(ap);
}

static void progress_print(td_progress_t *p, bool last, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void progress_print(td_progress_t *p, bool last, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    progress_vprint(p, last, fmt, ap);
    va_end(ap);
}

void td_progress_phase(td_progress_t *p, int k, int n, const char *phase)
{
    double t = td_progress_elapsed(p);
    if (t < p->quiet_s)
        return;
    if (p->tty)
        progress_print(p, k >= n, "loading %d%% (%s)", n > 0 ? 100 * k / n : 100, phase);
    else
        progress_print(p, true, "%s (%d/%d) at %.2f s", phase, k, n, t);
}

void td_progress_end(td_progress_t *p)
{
    if (p->open) {
        fputc('\n', stderr);
        fflush(stderr);
        p->open = false;
    }
}

void td_progress_clear(td_progress_t *p)
{
    if (p->open) {
        fputs("\r\033[K", stderr);
        fflush(stderr);
        p->open = false;
    }
}
