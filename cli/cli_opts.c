/*
 * cli_opts: the td_opts parse fns of flags several commands share (see td_cli.h).
 */
#include "td_cli.h"

#include "td_backend.h"
#include "td_dtype.h"

td_status_t cli_opt_device(const td_opt_t *opt, const char *value)
{
    return td_device_parse(value, opt->ptr);
}

td_status_t cli_opt_dtype(const td_opt_t *opt, const char *value)
{
    return td_dtype_parse_flag(value, opt->ptr);
}
