/*
 * td_cuda_module: the seam between a tandem process and its CUDA backend. The backend is a
 * module of its own, libtandem-cuda.so, that td_backend_cuda_create (kernels/td_backend.c)
 * loads with dlopen the first time a process asks for a GPU. A process that computes on the
 * CPU (a router, a CPU node, every CLI command without --device cuda) never maps the CUDA
 * libraries: linked in, they cost each process about 200 MB resident and 0.1 s a start, and
 * a host without the CUDA runtime could not start tandem at all.
 *
 * The module links the CUDA libraries and nothing of tandem's. The few base functions its
 * code calls (td_errorf, td_errorf_quiet, td_log, td_dtype_name) are defined in the module
 * (td_cuda_module.c) to forward to the host process's own through td_cuda_host_t, so an
 * error the module describes is the process's td_last_error() and its log lines follow the
 * process's --log-level. The module exports one symbol, TD_CUDA_MODULE_ENTRY.
 *
 * Where it is looked for: beside the executable (the build tree), then at
 * TD_CUDA_MODULE_RELDIR from the executable's folder (an installed tree: bin/ and
 * lib/<arch>/tandem/, `cmake --install`). docs/cuda.md.
 */
#ifndef TD_CUDA_MODULE_H
#define TD_CUDA_MODULE_H

#include <stdbool.h>
#include <stdint.h>

#include "td_backend.h"
#include "td_dtype.h"
#include "td_log.h"
#include "td_status.h"

#define TD_CUDA_MODULE_FILE "libtandem-cuda.so"
#define TD_CUDA_MODULE_ENTRY "td_cuda_module_entry"
#define TD_CUDA_MODULE_ABI 1 /* raise when td_cuda_host_t, td_backend_t or td_cuda_config_t change */

/* What the host lends the module. */
typedef struct td_cuda_host {
    int32_t abi;                                            /* TD_CUDA_MODULE_ABI */
    void (*error)(td_status_t st, bool log, const char *msg); /* td_errorf(_quiet)(st, "%s", msg) */
    void (*log)(td_log_level_t level, const char *msg);      /* td_log(level, "%s", msg) */
    const char *(*dtype_name)(td_dtype_t t);
} td_cuda_host_t;

typedef td_status_t (*td_cuda_create_fn)(const td_cuda_config_t *cfg, td_backend_t **be_p);

/* The module's entry: keeps host (it must outlive the module's use: the host's are static)
 * and returns the backend's constructor, or NULL when host->abi is not the module's. */
typedef td_cuda_create_fn (*td_cuda_module_entry_fn)(const td_cuda_host_t *host);

/* Inside the module: the constructor the entry returns (td_cuda_backend.cu), as
 * td_backend_cuda_create documents it. */
td_status_t td_cuda_backend_create(const td_cuda_config_t *cfg, td_backend_t **be_p);

#endif /* TD_CUDA_MODULE_H */
