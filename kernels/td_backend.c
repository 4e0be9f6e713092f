/*
 * td_backend: backend-independent entry points (destroy, what is compiled in).
 */
#include "td_backend.h"

void td_backend_destroy(td_backend_t *be)
{
    if (be)
        be->ops->destroy(be);
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
    return td_errorf(TD_ERR_UNSUPPORTED,
                     "this tandem was built without CUDA: install the CUDA toolkit and rebuild");
}
#endif
