/*
 * td_test_models: the model-finding and engine setup the Criterion tests on the real tiny
 * model share (test_engine, test_decode_sched, test_prefill_sched). The model folder is
 * $TANDEM_TEST_MODELS (ctest sets it to ../shared/models), else that folder next to the
 * source tree; a test without the model is skipped, saying so, never passed.
 *
 * Header-only (static inline): every tests/test_*.c is its own executable (CMakeLists.txt),
 * so there is no library of test helpers to link. Threads: the test's own.
 */
#ifndef TD_TEST_MODELS_H
#define TD_TEST_MODELS_H

#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "td_backend.h"
#include "td_engine.h"
#include "td_model.h"
#include "td_status.h"

/* The stories260K checkpoint's path (a static buffer: the same string every call). */
static inline const char *td_test_stories_path(void)
{
    static char path[4096];
    const char *d = getenv("TANDEM_TEST_MODELS");
    snprintf(path, sizeof path, "%s/stories260K/stories260K.bin", d ? d : TD_SOURCE_DIR "/../shared/models");
    return path;
}

/* Skips the running test, naming the path and the variable, when the checkpoint is absent. */
static inline void td_test_skip_without_stories(void)
{
    FILE *f = fopen(td_test_stories_path(), "rb");
    if (!f)
        cr_skip_test("skipped: %s not found (set TANDEM_TEST_MODELS to the shared models folder)",
                     td_test_stories_path());
    fclose(f);
}

/* The model, a CPU backend and (td_test_engine_open) an engine on them. */
typedef struct td_test_engine {
    td_model_t *model;
    td_backend_t *be;
    td_engine_t *eng; /* NULL after td_test_model_open alone */
    int vocab;
} td_test_engine_t;

/* Loads stories260K and a CPU backend of `threads` threads into *fx (zeroed first); asserts. */
static inline void td_test_model_open(td_test_engine_t *fx, int threads)
{
    *fx = (td_test_engine_t){0};
    cr_assert_eq(td_model_load(td_test_stories_path(), &fx->model), TD_OK, "%s", td_last_error());
    fx->vocab = fx->model->config.vocab_size;
    td_cpu_config_t cc = {.n_threads = threads};
    cr_assert_eq(td_backend_cpu_create(&cc, &fx->be), TD_OK, "%s", td_last_error());
}

/* td_test_model_open, then an engine built with *ec; asserts. */
static inline void td_test_engine_open(td_test_engine_t *fx, int threads, const td_engine_config_t *ec)
{
    td_test_model_open(fx, threads);
    cr_assert_eq(td_engine_create(fx->model, fx->be, ec, &fx->eng), TD_OK, "%s", td_last_error());
}

/* Frees what the open functions made (NULL members are skipped). */
static inline void td_test_engine_close(td_test_engine_t *fx)
{
    td_engine_destroy(fx->eng);
    td_backend_destroy(fx->be);
    td_model_destroy(fx->model);
    *fx = (td_test_engine_t){0};
}

/* The index of the largest of v[0..n) (the first on ties): a greedy token. */
static inline int td_test_argmax(const float *v, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b])
            b = i;
    return b;
}

#endif /* TD_TEST_MODELS_H */
