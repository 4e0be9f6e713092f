/*
 * td_progress: the progress line of long work (bench serve's requests, perplexity's chunks,
 * a model's load), one way for every command. It goes to stderr, so that stdout stays what
 * scripts parse. On a terminal it is one line rewritten in place (\r) at most once a second;
 * elsewhere (a log, a pipe) a line every `log_every_s` (0: every update), so that a log grows
 * by a bounded amount. Work that ends within `quiet_s` prints nothing (a quick load says
 * nothing about its phases).
 *
 * A td_progress_t is a plain value owned by the caller; one thread uses it. No errors: a
 * line that cannot be written is dropped.
 */
#ifndef TD_PROGRESS_H
#define TD_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>

typedef struct td_progress {
    const char *prog;         /* prefixes every line: "bench serve" */
    bool tty;                 /* stderr is a terminal */
    double log_every_s;       /* not a terminal: a line at most this often (0: every update) */
    double quiet_s;           /* nothing before this much time has passed since init */
    uint64_t t0, t_last;      /* td_now_ns() of init and of the last line (0: none yet) */
    bool open;                /* a terminal line is waiting for its newline */
} td_progress_t;

/* Starts the clock; tty from isatty(stderr). */
void td_progress_init(td_progress_t *p, const char *prog, double log_every_s, double quiet_s);

/* Seconds since init. */
double td_progress_elapsed(const td_progress_t *p);

/*
 * One update "prog: TEXT": printed when due (a terminal: a second after the last; else
 * log_every_s; never within quiet_s), always when `last` (the work's final state, then the
 * terminal line ends) unless within quiet_s.
 */
void td_progress_update(td_progress_t *p, bool last, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/*
 * Phase k of n (1-based) has ended: past quiet_s, a line "prog: PHASE (k/n) in X s"
 * elsewhere, or on a terminal the line "prog: loading NN% (PHASE)" rewritten.
 */
void td_progress_phase(td_progress_t *p, int k, int n, const char *phase);

/* Ends a terminal line left open (an interrupted run); a no-op otherwise. */
void td_progress_end(td_progress_t *p);

/* Erases a terminal line left open, so that other output to stderr (a result line of the
 * work) takes its place; the next update draws it again below. A no-op otherwise. */
void td_progress_clear(td_progress_t *p);

#endif /* TD_PROGRESS_H */
