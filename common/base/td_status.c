/*
 * td_status: the status table, td_strerror() and the thread-local last-error record.
 */
#include "td_status.h"

#include <stdio.h>
#include <string.h>

#include "td_log.h"

static _Thread_local char last_error[1024];

const char *td_strerror(td_status_t st)
{
    switch (st) {
#define TD_STATUS_STR(name, code, msg) \
    case TD_##name:                    \
        return msg;
        TD_STATUS_MAP(TD_STATUS_STR)
#undef TD_STATUS_STR
    }
    return "unknown status";
}

const char *td_status_name(td_status_t st)
{
    switch (st) {
#define TD_STATUS_NAME(name, code, msg) \
    case TD_##name:                     \
        return #name;
        TD_STATUS_MAP(TD_STATUS_NAME)
#undef TD_STATUS_NAME
    }
    return "UNKNOWN";
}

/* Formatted aside first: callers pass td_last_error() itself as an argument ("...: %s",
 * the cause), and vsnprintf into the buffer it reads from is undefined (it printed the new
 * prefix twice and lost the cause). */
static void record(const char *fmt, va_list ap)
{
    char buf[sizeof last_error];
    vsnprintf(buf, sizeof buf, fmt, ap);
    memcpy(last_error, buf, sizeof buf);
}

td_status_t td_errorf(td_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    record(fmt, ap);
    va_end(ap);
    td_log(TD_LOG_ERROR, "%s", last_error);
    return st;
}

td_status_t td_errorf_quiet(td_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    record(fmt, ap);
    va_end(ap);
    return st;
}

const char *td_last_error(void)
{
    return last_error;
}

void td_clear_error(void)
{
    last_error[0] = '\0';
}
