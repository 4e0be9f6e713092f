/*
 * td_test_models: where the Criterion tests find ../shared/models (the real tiny model and
 * the reference tokenizers) and the engine setup the tests on stories260K share
 * (test_engine, test_engine_cuda, test_decode_sched, test_prefill_sched), and the matmuls check
 * of the kernel tests (test_kernels_cpu, test_cpu_bgemm). The folder is
 * $TANDEM_TEST_MODELS (ctest sets it to ../shared/models), else that folder next to the
 * source tree; a test without what it needs is skipped, saying so, never passed.
 *
 * Part of the td_test_support library every tests/unit/test_*.c links. Threads: the
 * test's own.
 */
#ifndef TD_TEST_MODELS_H
#define TD_TEST_MODELS_H

#include <stdbool.h>
#include <stddef.h>

#include "td_backend.h"
#include "td_dtype.h"
#include "td_engine.h"
#include "td_model.h"

/* The shared models folder: $TANDEM_TEST_MODELS when set and not empty, else
 * ../shared/models beside the source tree. */
const char *td_test_models_dir(void);

/* Writes td_test_models_dir()/rel to path[cap] and skips the running test, naming the path
 * and the variable, when it cannot be read (a file or a folder). */
void td_test_model_file(const char *rel, char *path, size_t cap);

/* The whole of tests/fixtures/<rel> (committed with the source, never skipped), at most
 * max_bytes, NUL-terminated; the caller frees. The running test fails naming the path and
 * the error when it cannot be read. *len_p may be NULL. */
char *td_test_fixture_read(const char *rel, size_t max_bytes, size_t *len_p);

/* Writes data[0..n) to path (created or truncated); the running test fails naming the path
 * when it cannot. */
void td_test_write_file(const char *path, const void *data, size_t n);

/* The stories260K checkpoint's path (a static buffer: the same string every call). */
const char *td_test_stories_path(void);

/* Skips the running test when the stories260K checkpoint is absent. */
void td_test_skip_without_stories(void);

/* The model, a backend and (td_test_engine_open*) an engine on them. */
typedef struct td_test_engine {
    td_model_t *model;
    td_backend_t *be;
    td_engine_t *eng; /* NULL after td_test_model_open alone */
    int vocab;
} td_test_engine_t;

/* Loads stories260K and a CPU backend of `threads` threads into *fx (zeroed first); asserts. */
void td_test_model_open(td_test_engine_t *fx, int threads);

/* td_test_model_open, then an engine built with *ec; asserts. */
void td_test_engine_open(td_test_engine_t *fx, int threads, const td_engine_config_t *ec);

/* td_test_engine_open with the default engine config but for n_blocks KV blocks and the
 * prefix cache on or off: the fixture of the engine and scheduler tests. */
void td_test_engine_open_cpu(td_test_engine_t *fx, int threads, int n_blocks, bool prefix_cache);

/* stories260K on `be` (taken over by *fx), weights and KV cache in `dtype`, n_blocks KV
 * blocks; asserts. */
void td_test_engine_open_on(td_test_engine_t *fx, td_backend_t *be, td_dtype_t dtype, int n_blocks);

/* Frees what the open functions made (NULL members are skipped). */
void td_test_engine_close(td_test_engine_t *fx);

/* The index of the largest of v[0..n) (the first on ties): a greedy token. */
int td_test_argmax(const float *v, int n);

/* The next number (24 bits) of the tests' LCG, whose state is *s. */
unsigned td_test_rng_next(unsigned *s);

/* A prompt of n tokens (BOS, then ids 3..511 from td_test_rng_next); the caller frees it. */
int *td_test_random_prompt(unsigned *s, int n);

/*
 * Runs n sequences through fx's engine together: prompts prefilled in chunks of at most
 * `chunk` tokens (all sequences in the same steps), then greedy decode until each holds
 * total[i] tokens. out[i] gets the generated ids; lhash (when not NULL) lhash[i] a hash of
 * the bits of each generated token's logits row. After every step each sequence gives back
 * the blocks behind a sliding window (td_engine_seq_release_window). Asserts every step.
 */
void td_test_engine_greedy(td_test_engine_t *fx, int n, int **prompts, const int *n_prompt,
                           const int *total, int chunk, int **out, uint64_t **lhash);

/*
 * The bits ops->matmuls must give: runs each of ps[0..n) alone through be->ops->matmul into
 * want[i], then all n in one be->ops->matmuls into y[i] (ps[i].y is set to y[i]). y[i] and
 * want[i] start equal when a matrix accumulates. Asserts both calls succeed; the caller
 * compares y against want (test_kernels_cpu, test_cpu_bgemm).
 */
void td_test_matmuls_and_calls(td_backend_t *be, td_matmul_params_t *ps, int n, float *const *y,
                               float *const *want);

/* Frees the n weight matrices of such a check: each packed copy (packed[i], NULL when that
 * matrix was left as stored) through be->ops->free, each stored one (stored[i]) with free(). */
void td_test_matmuls_free(td_backend_t *be, void *const *stored, void *const *packed, int n);

#endif /* TD_TEST_MODELS_H */
