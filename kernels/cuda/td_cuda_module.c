/*
 * td_cuda_module: the module side of the seam (td_cuda_module.h): its entry, and the base
 * functions the CUDA backend's code calls, forwarded to the host process's own. Compiled
 * into libtandem-cuda.so only.
 */
#include "td_cuda_module.h"

#include <stdarg.h>
#include <stdio.h>

static const td_cuda_host_t *host; /* set once by the entry, before any other call */

__attribute__((visibility("default"))) td_cuda_create_fn td_cuda_module_entry(const td_cuda_host_t *h)
{
    if (!h || h->abi != TD_CUDA_MODULE_ABI)
        return NULL;
    host = h;
    return td_cuda_backend_create;
}

/* the host's td_last_error holds 1024 bytes, its log lines 2048 */
static void forward_error(td_status_t st, bool log, const char *fmt, va_list ap)
{
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    host->error(st, log, msg);
}

td_status_t td_errorf(td_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    forward_error(st, true, fmt, ap);
    va_end(ap);
    return st;
}

td_status_t td_errorf_quiet(td_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    forward_error(st, false, fmt, ap);
    va_end(ap);
    return st;
}

void td_log(td_log_level_t level, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    host->log(level, msg);
}

const char *td_dtype_name(td_dtype_t t)
{
    return host->dtype_name(t);
}
