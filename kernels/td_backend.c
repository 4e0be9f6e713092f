/*
 * td_backend: backend-independent entry points (destroy, what is compiled in), and the
 * loading of the CUDA backend's module (kernels/cuda/td_cuda_module.h) on first use.
 */
#include "td_backend.h"

#include <string.h>

#include "td_log.h"
#include "td_util.h"

#ifdef TD_HAVE_CUDA
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include "td_cuda_module.h"
#endif

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
    if (s && !strcmp(s, "cpu:q8")) {
        *out = (td_device_spec_t){.cuda = false, .q8 = true, .index = 0};
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
    return td_errorf(TD_ERR_INVALID, "--device '%s' is not cpu, cuda, cuda:N (N a device ordinal), cpu:exact, cpu:q8 "
                     "or cpu:staged",
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
                                                         .exact = dev->exact, .act_one_byte = dev->q8},
                                     be_p);
    td_status_t st = td_backend_cuda_create(&(td_cuda_config_t){.device = dev->index, .act_dtype = act_dtype}, be_p);
    if (st == TD_ERR_UNSUPPORTED)
        td_log(TD_LOG_ERROR, "%s", td_last_error()); /* quiet at its source, for probes */
    return st;
}

#ifdef TD_HAVE_CUDA
bool td_backend_cuda_compiled(void)
{
    return true;
}

static void host_error(td_status_t st, bool log, const char *msg)
{
    if (log)
        td_errorf(st, "%s", msg);
    else
        td_errorf_quiet(st, "%s", msg);
}

static void host_log(td_log_level_t level, const char *msg)
{
    td_log(level, "%s", msg);
}

static const td_cuda_host_t cuda_host = {TD_CUDA_MODULE_ABI, host_error, host_log, td_dtype_name};

/* The module's constructor once loaded; the module stays loaded for the process's life. */
static pthread_mutex_t cuda_mu = PTHREAD_MUTEX_INITIALIZER;
static td_cuda_create_fn cuda_create;

/* Loads the module: beside the executable, else at TD_CUDA_MODULE_RELDIR from its folder.
 * Errors are TD_ERR_UNSUPPORTED, quiet (as a missing GPU: td_backend_open logs them). */
static td_status_t cuda_module_open(void)
{
    char dir[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (n <= 0)
        return td_errorf_quiet(TD_ERR_UNSUPPORTED, "cuda: cannot find this executable's folder (/proc/self/exe: %s) "
                               "to load " TD_CUDA_MODULE_FILE, strerror(errno));
    dir[n] = '\0';
    *strrchr(dir, '/') = '\0'; /* an absolute path: there is a slash */
    char paths[2][PATH_MAX + 64];
    snprintf(paths[0], sizeof paths[0], "%s/%s", dir, TD_CUDA_MODULE_FILE);
    snprintf(paths[1], sizeof paths[1], "%s/%s/%s", dir, TD_CUDA_MODULE_RELDIR, TD_CUDA_MODULE_FILE);
    for (int i = 0; i < 2; i++) {
        if (access(paths[i], F_OK) != 0)
            continue;
        void *h = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
        if (!h)
            return td_errorf_quiet(TD_ERR_UNSUPPORTED, "cuda: cannot load %s (%s): install the CUDA runtime "
                                   "(libcudart, libcublas) it was built with, or use --device cpu", paths[i], dlerror());
        td_cuda_module_entry_fn entry;
        void *sym = dlsym(h, TD_CUDA_MODULE_ENTRY);
        memcpy(&entry, &sym, sizeof entry); /* POSIX: a function's address through void * */
        td_cuda_create_fn create = sym ? entry(&cuda_host) : NULL;
        if (!create) {
            dlclose(h);
            return td_errorf_quiet(TD_ERR_UNSUPPORTED, "cuda: %s is not this tandem's CUDA module (%s): install "
                                   "the two from one build", paths[i], sym ? "another interface version" : "no entry");
        }
        cuda_create = create;
        return TD_OK;
    }
    return td_errorf_quiet(TD_ERR_UNSUPPORTED, "cuda: the CUDA backend module is neither at %s nor at %s: install "
                           "tandem with `cmake --install`, or use --device cpu", paths[0], paths[1]);
}

td_status_t td_backend_cuda_create(const td_cuda_config_t *cfg, td_backend_t **be_p)
{
    pthread_mutex_lock(&cuda_mu);
    td_status_t st = cuda_create ? TD_OK : cuda_module_open();
    td_cuda_create_fn create = cuda_create;
    pthread_mutex_unlock(&cuda_mu);
    return st != TD_OK ? st : create(cfg, be_p);
}
#else
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
