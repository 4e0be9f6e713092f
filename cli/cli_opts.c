/*
 * cli_opts: the td_opts parse fns of flags several commands share (see td_cli.h).
 */
#include "td_cli.h"

#include "td_backend.h"
#include "td_dtype.h"
#include "td_spec.h"

td_status_t cli_opt_device(const td_opt_t *opt, const char *value)
{
    return td_device_parse(value, opt->ptr);
}

td_status_t cli_opt_dtype(const td_opt_t *opt, const char *value)
{
    return td_dtype_parse_flag(value, opt->ptr);
}

td_status_t cli_opt_quant(const td_opt_t *opt, const char *value)
{
    td_dtype_t t;
    td_status_t st = td_dtype_parse_quant_flag(value, &t);
    if (st == TD_OK)
        *(int *)opt->ptr = (int)t;
    return st;
}

td_status_t cli_opt_kv_dtype(const td_opt_t *opt, const char *value)
{
    td_dtype_t t;
    td_status_t st = td_dtype_parse_kv_flag(value, &t);
    if (st == TD_OK)
        *(int *)opt->ptr = (int)t;
    return st;
}

td_status_t cli_opt_spec(const td_opt_t *opt, const char *value)
{
    td_spec_mode_t m;
    if (td_spec_parse_mode(value, &m) != TD_OK)
        return td_errorf(TD_ERR_INVALID, "%s", td_last_error());
    *(td_spec_mode_t *)opt->ptr = m;
    return TD_OK;
}
