/*
 * td_backend: backend-independent entry points (destroy, what is compiled in).
 */
#include "td_backend.h"

#include <string.h>

#include "td_log.h"
#include "td_util.h"

void td_backend_destroy(td_backend_t *be)
{
    if (be)
        be->ops->destroy(be);
}

td_status_t td_device_parse(const char *s, td_device_spec_t *out)
{
    if (s && !strcmp(s, "cpu")) {
        *out = (td_device_spec_t){.cuda = false, .index = 0};
        return TD_OK;
    }
    if (s && !strcmp(s, "cpu:staged")) {
        *out = (td_device_spec_t){.cuda = false, .staged = true, .index = 0};
        return TD_OK;
    }
    if (s && !strcmp(s, "cpu:exact")) {
        *out = (td_device_spec_t){.cuda = false, .exact = true, .index = 0};
        return TD_OK;
    }
    if (s && !strcmp(s, "cuda")) {
        *out = (td_device_spec_t){.cuda = true, .index = 0};
        return TD_OK;
    }
    int64_t n;
    if (s && !strncmp(s, "cuda:", 5) && s[5] >= '0' && s[5] <= '9' &&
        td_parse_i64(s + 5, 0, 1023, "--device cuda:N", &n) == TD_OK) {
        *out = (td_device_spec_t){.cuda = true, .index = (int32_t)n};
        return TD_OK;
    }
    return td_errorf(TD_ERR_INVALID, "--device '%s' is not cpu, cuda, cuda:N (N a device ordinal), cpu:exact or cpu:staged",
                     s ? s : "");
}

int td_device_default_dtype(const td_device_spec_t *dev, td_dtype_t model_dtype)
{
    return dev->cuda ? (int)model_dtype : -1;
}

td_status_t td_backend_open(const td_device_spec_t *dev, int32_t n_threads, td_dtype_t act_dtype,
                            td_backend_t **be_p)
{
    if (!dev->cuda)
        return td_backend_cpu_create(&(td_cpu_config_t){.n_threads = n_threads, .device_memory = dev->staged,
                                                         .exact = dev->exact},
                                     be_p);
    td_status_t st = td_backend_cuda_create(&(td_cuda_config_t){.device = dev->index, .act_dtype = act_dtype}, be_p);
    if (st == TD_ERR_UNSUPPORTED)
        td_log(TD_LOG_ERROR, "%s", td_last_error()); /* quiet at its source, for probes */
    return st;
}

#ifndef TD_HAVE_CUDA
bool td_backend_cuda_compiled(void)
{
    return false;
}

td_status_t td_backend_cuda_create(const td_cuda_config_t *cfg, td_backend_t **be_p)
{
    (void)cfg;
    (void)be_p;
    return td_errorf_quiet(TD_ERR_UNSUPPORTED,
                           "this tandem was built without CUDA: install the CUDA toolkit and rebuild");
}
#endif
