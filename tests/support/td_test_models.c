/*
 * td_test_models: the shared models folder and the stories260K engine fixture of the
 * Criterion tests (td_test_models.h).
 */
#include "td_test_models.h"

#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "td_status.h"
#include "td_util.h"

const char *td_test_models_dir(void)
{
    const char *d = getenv("TANDEM_TEST_MODELS");
    return d && *d ? d : TD_SOURCE_DIR "/../shared/models";
}

void td_test_model_file(const char *rel, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s", td_test_models_dir(), rel);
    if (access(path, R_OK) != 0)
        cr_skip_test("skipped: %s not found (set TANDEM_TEST_MODELS to the shared models folder)",
                     path);
}

char *td_test_fixture_read(const char *rel, size_t max_bytes, size_t *len_p)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/tests/fixtures/%s", TD_SOURCE_DIR, rel);
    char *data;
    size_t len;
    cr_assert_eq(td_file_read_all(path, max_bytes, &data, &len), TD_OK, "fixture %s: %s", path, td_last_error());
    if (len_p)
        *len_p = len;
    return data;
}

void td_test_write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(data, 1, n, f), n, "cannot write %s", path);
    cr_assert_eq(fclose(f), 0, "cannot write %s", path);
}

const char *td_test_stories_path(void)
{
    static char path[4096];
    snprintf(path, sizeof path, "%s/stories260K/stories260K.bin", td_test_models_dir());
    return path;
}

void td_test_skip_without_stories(void)
{
    char path[4096];
    td_test_model_file("stories260K/stories260K.bin", path, sizeof path);
}

void td_test_model_open(td_test_engine_t *fx, int threads)
{
    *fx = (td_test_engine_t){0};
    cr_assert_eq(td_model_load(td_test_stories_path(), &fx->model), TD_OK, "%s", td_last_error());
    fx->vocab = fx->model->config.vocab_size;
    td_cpu_config_t cc = {.n_threads = threads};
    cr_assert_eq(td_backend_cpu_create(&cc, &fx->be), TD_OK, "%s", td_last_error());
}

void td_test_engine_open(td_test_engine_t *fx, int threads, const td_engine_config_t *ec)
{
    td_test_model_open(fx, threads);
    cr_assert_eq(td_engine_create(fx->model, fx->be, ec, &fx->eng), TD_OK, "%s", td_last_error());
}

void td_test_engine_open_cpu(td_test_engine_t *fx, int threads, int n_blocks, bool prefix_cache)
{
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = n_blocks;
    ec.prefix_cache = prefix_cache;
    td_test_engine_open(fx, threads, &ec);
}

void td_test_engine_open_on(td_test_engine_t *fx, td_backend_t *be, td_dtype_t dtype, int n_blocks)
{
    *fx = (td_test_engine_t){0};
    fx->be = be;
    cr_assert_eq(td_model_load(td_test_stories_path(), &fx->model), TD_OK, "%s", td_last_error());
    fx->vocab = fx->model->config.vocab_size;
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = n_blocks;
    ec.weight_dtype = dtype;
    ec.kv_dtype = dtype;
    cr_assert_eq(td_engine_create(fx->model, be, &ec, &fx->eng), TD_OK, "%s", td_last_error());
}

void td_test_engine_close(td_test_engine_t *fx)
{
    td_engine_destroy(fx->eng);
    td_backend_destroy(fx->be);
    td_model_destroy(fx->model);
    *fx = (td_test_engine_t){0};
}

int td_test_argmax(const float *v, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[b])
            b = i;
    return b;
}

unsigned td_test_rng_next(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return (*s >> 8) & 0xffffff;
}

int *td_test_random_prompt(unsigned *s, int n)
{
    int *p = malloc((size_t)n * sizeof(int));
    cr_assert(p);
    p[0] = 1; /* BOS */
    for (int i = 1; i < n; i++)
        p[i] = 3 + (int)(td_test_rng_next(s) % 509);
    return p;
}

void td_test_engine_greedy(td_test_engine_t *fx, int n, int **prompts, const int *n_prompt,
                           const int *total, int chunk, int **out, uint64_t **lhash)
{
    int vocab = fx->model->config.vocab_size;
    td_kv_seq_t *seqs = calloc((size_t)n, sizeof *seqs);
    int *done = calloc((size_t)n, sizeof(int)); /* prompt tokens consumed */
    int *gen = calloc((size_t)n, sizeof(int));  /* tokens generated */
    int *next = calloc((size_t)n, sizeof(int));
    td_engine_item_t *items = calloc((size_t)n, sizeof *items);
    int *owner = calloc((size_t)n, sizeof(int));
    float *logits = malloc((size_t)n * vocab * sizeof(float));
    for (int i = 0; i < n; i++) {
        td_kv_seq_init(&seqs[i]);
        int cached = 0;
        cr_assert_eq(td_engine_seq_start(fx->eng, &seqs[i], prompts[i], n_prompt[i], &cached),
                     TD_OK);
        done[i] = cached;
    }
    for (;;) {
        int k = 0;
        for (int i = 0; i < n; i++) {
            if (n_prompt[i] + gen[i] >= total[i])
                continue;
            if (done[i] < n_prompt[i]) {
                int len = n_prompt[i] - done[i];
                if (len > chunk)
                    len = chunk;
                items[k] = (td_engine_item_t){.seq = &seqs[i],
                                              .tokens = prompts[i] + done[i],
                                              .n_tokens = len,
                                              .n_logits = done[i] + len == n_prompt[i]};
            } else {
                items[k] = (td_engine_item_t){
                    .seq = &seqs[i], .tokens = &next[i], .n_tokens = 1, .n_logits = 1};
            }
            owner[k++] = i;
        }
        if (k == 0)
            break;
        td_status_t st = td_engine_step(fx->eng, items, k, logits);
        cr_assert_eq(st, TD_OK, "step: %s", td_last_error());
        for (int j = 0; j < k; j++) /* as a decode node does (a no-op without a window) */
            td_engine_seq_release_window(fx->eng, items[j].seq);
        int row = 0;
        for (int j = 0; j < k; j++) {
            int i = owner[j];
            if (done[i] < n_prompt[i])
                done[i] += items[j].n_tokens;
            if (items[j].n_logits) {
                if (lhash) {
                    uint64_t h = 1469598103934665603ull;
                    const unsigned char *b = (const unsigned char *)(logits + (size_t)row * vocab);
                    for (size_t q = 0; q < (size_t)vocab * sizeof(float); q++)
                        h = (h ^ b[q]) * 1099511628211ull;
                    lhash[i][gen[i]] = h;
                }
                next[i] = td_test_argmax(logits + (size_t)row * vocab, vocab);
                out[i][gen[i]++] = next[i];
                row++;
            }
        }
    }
    for (int i = 0; i < n; i++)
        td_engine_seq_end(fx->eng, &seqs[i]);
    free(seqs), free(done), free(gen), free(next), free(items), free(owner), free(logits);
}

void td_test_matmuls_and_calls(td_backend_t *be, td_matmul_params_t *ps, int n, float *const *y,
                               float *const *want)
{
    for (int i = 0; i < n; i++) {
        td_matmul_params_t one = ps[i];
        one.y = want[i];
        cr_assert_eq(be->ops->matmul(be, &one), TD_OK, "matmul of matrix %d of %d failed", i, n);
        ps[i].y = y[i];
    }
    cr_assert_eq(be->ops->matmuls(be, ps, n), TD_OK, "matmuls of %d matrices failed", n);
}

void td_test_matmuls_free(td_backend_t *be, void *const *stored, void *const *packed, int n)
{
    for (int i = 0; i < n; i++) {
        if (packed[i])
            be->ops->free(be, packed[i]);
        free(stored[i]);
    }
}
