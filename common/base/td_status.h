/*
 * td_status: the one status type of tandem.
 *
 * Every fallible function returns td_status_t: TD_OK (0) or a negative code from the
 * X-macro table below, which also gives td_strerror(). Codes of other libraries (CUDA,
 * UCX, nghttp2, protobuf-c) are translated where they enter tandem.
 *
 * The function that decides an error describes it once with td_errorf(), which logs the
 * message and keeps it as this thread's last error (td_last_error()) so a CLI or RPC edge
 * can show it to a user without logging twice. Messages say what is wrong and what to do.
 */
#ifndef TD_STATUS_H
#define TD_STATUS_H

#include <stdarg.h>

#define TD_STATUS_MAP(X)                                                         \
    X(OK, 0, "ok")                                                               \
    X(ERR_INVALID, -1, "invalid argument")                                       \
    X(ERR_NOMEM, -2, "out of memory")                                            \
    X(ERR_IO, -3, "i/o error")                                                   \
    X(ERR_FORMAT, -4, "malformed input")                                         \
    X(ERR_UNSUPPORTED, -5, "unsupported")                                        \
    X(ERR_NOT_FOUND, -6, "not found")                                            \
    X(ERR_EXHAUSTED, -7, "resource exhausted")                                   \
    X(ERR_TIMEOUT, -8, "deadline exceeded")                                      \
    X(ERR_CANCELLED, -9, "cancelled")                                            \
    X(ERR_UNAVAILABLE, -10, "peer unavailable")                                  \
    X(ERR_MISMATCH, -11, "incompatible peer or layout")                          \
    X(ERR_RANGE, -12, "value out of range")                                      \
    X(ERR_PROTOCOL, -13, "protocol error")                                       \
    X(ERR_BUSY, -14, "busy")                                                     \
    X(ERR_CLOSED, -15, "closed")                                                 \
    X(ERR_CUDA, -16, "cuda error")                                               \
    X(ERR_UCX, -17, "ucx error")                                                 \
    X(ERR_STALE, -18, "stale lease or handle")                                   \
    X(ERR_INTERNAL, -19, "internal error")

typedef enum td_status {
#define TD_STATUS_ENUM(name, code, msg) TD_##name = code,
    TD_STATUS_MAP(TD_STATUS_ENUM)
#undef TD_STATUS_ENUM
} td_status_t;

/* Short, static description of a status code ("out of memory"). Never NULL. */
const char *td_strerror(td_status_t st);

/* Symbolic name of a status code ("ERR_NOMEM"). Never NULL. */
const char *td_status_name(td_status_t st);

/*
 * Records `st` with a formatted message as this thread's last error, logs it at error
 * level and returns `st`, so a deciding function can `return td_errorf(TD_ERR_FORMAT,
 * "%s: ...", path)`. Thread-safe (the record is thread-local).
 */
td_status_t td_errorf(td_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Same as td_errorf but does not log: for errors a caller is expected to handle
 * (an exhausted pool the scheduler will retry, a peer probe that may fail). */
td_status_t td_errorf_quiet(td_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The message of this thread's last td_errorf(), or "" when there was none. */
const char *td_last_error(void);

/* Forgets this thread's last error. */
void td_clear_error(void);

#endif /* TD_STATUS_H */
