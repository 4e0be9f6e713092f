/*
 * The GGUF writer and loader against the engine: a model synthesized twice from one seed,
 * as a Hugging Face directory (safetensors) and as a GGUF file (llama.cpp's names, q/k
 * rows permuted as its converter does for llama), computes the same logits: the loader's
 * TD_ROPE_PAIRS on permuted rows is rotate_half RoPE on the original ones. For llama
 * (permuted, f32 and Q8_0), qwen2 (biases) and qwen3 (q/k norms, not permuted); prompt
 * logits and a few decode steps, so the KV cache written in the permuted order is read
 * back right too.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "td_backend.h"
#include "td_engine.h"
#include "td_kv.h"
#include "td_model.h"
#include "td_test_models.h"
#include "td_util.h"

#define N_PROMPT 12
#define N_DECODE 4

static char dir[64], gguf[80];

static void tmp_setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/td_test_gguf_engine_XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(gguf, sizeof gguf, "%s/model.gguf", dir);
}

static void tmp_teardown(void)
{
    static const char *const files[] = {"model.gguf", "config.json", "model.safetensors", "tokenizer.json",
                                        "tokenizer_config.json"};
    for (size_t i = 0; i < TD_ARRAY_LEN(files); i++) {
        char p[160];
        snprintf(p, sizeof p, "%s/%s", dir, files[i]);
        unlink(p);
    }
    rmdir(dir);
}

TestSuite(model_gguf_engine, .init = tmp_setup, .fini = tmp_teardown);

typedef struct run {
    td_model_t *model;
    td_backend_t *be;
    td_engine_t *eng;
    td_kv_seq_t seq;
} run_t;

static void run_open(run_t *r, const char *path, int quant)
{
    *r = (run_t){0};
    cr_assert_eq(td_model_load(path, &r->model), TD_OK, "%s", td_last_error());
    td_cpu_config_t cc = {.n_threads = 1};
    cr_assert_eq(td_backend_cpu_create(&cc, &r->be), TD_OK, "%s", td_last_error());
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 8;
    ec.kv_dtype = TD_F32;
    ec.weight_quant = quant;
    cr_assert_eq(td_engine_create(r->model, r->be, &ec, &r->eng), TD_OK, "%s", td_last_error());
    td_kv_seq_init(&r->seq);
}

static void run_close(run_t *r)
{
    td_engine_seq_end(r->eng, &r->seq);
    td_engine_destroy(r->eng);
    td_backend_destroy(r->be);
    td_model_destroy(r->model);
}

/* Runs tokens through r; logits of every new token into out. */
static void run_step(run_t *r, const int32_t *tokens, int n, float *out)
{
    td_engine_item_t it = {.seq = &r->seq, .tokens = tokens, .n_tokens = n, .n_logits = n};
    cr_assert_eq(td_engine_step(r->eng, &it, 1, out), TD_OK, "%s", td_last_error());
}

static void expect_close(const float *a, const float *b, size_t n, const char *what)
{
    double max_diff = 0, max_abs = 0;
    for (size_t i = 0; i < n; i++) {
        max_diff = fmax(max_diff, fabs((double)a[i] - b[i]));
        max_abs = fmax(max_abs, fabs((double)a[i]));
    }
    /* the same products summed in another order: float rounding only */
    cr_assert(max_abs > 0 && max_diff <= 1e-4 * max_abs + 1e-6, "%s: logits differ by %g (largest %g)", what,
              max_diff, max_abs);
}

/* Llama 3's rope scaling, strong enough at these few positions to move the logits: the
 * safetensors model has it as config (the engine scales the frequencies), the GGUF one as a
 * rope_freqs tensor (the engine divides by it). */
static void set_llama3_rope(td_model_config_t *c)
{
    c->rope_theta = 500000.0f;
    c->rope_llama3 = true;
    c->rope_factor = 32.0f;
    c->rope_low_freq_factor = 1.0f;
    c->rope_high_freq_factor = 4.0f;
    c->rope_original_max_pos = 16;
}

/* Synthesizes `arch` both ways (matrices in `dt`; the safetensors model in f32, quantized
 * by the engine when dt is a block type) and compares the engine's logits. */
static void same_logits_rope(td_arch_t arch, td_dtype_t dt, bool llama3_rope)
{
    td_synth_params_t p = {.seed = 14};
    cr_assert_eq(td_model_preset("tiny", &p.config), TD_OK);
    td_model_config_set_arch(&p.config, arch);
    p.config.hidden_dim = 192; /* rows of whole 32-weight blocks, for Q8_0 */
    if (llama3_rope)
        set_llama3_rope(&p.config);
    p.dtype = TD_F32;
    cr_assert_eq(td_model_synth(&p, dir, NULL), TD_OK, "%s", td_last_error());
    p.dtype = dt;
    cr_assert_eq(td_model_synth_gguf(&p, gguf), TD_OK, "%s", td_last_error());

    run_t hf, gg;
    run_open(&hf, dir, td_dtype_is_block(dt) ? (int)dt : -1);
    run_open(&gg, gguf, -1);
    cr_assert_eq(gg.model->config.rope_style, arch == TD_ARCH_LLAMA ? TD_ROPE_PAIRS : TD_ROPE_HALVES);
    cr_assert_eq(hf.model->config.rope_style, TD_ROPE_HALVES);
    int V = hf.model->config.vocab_size;
    cr_assert_eq(gg.model->config.vocab_size, V);

    int32_t prompt[N_PROMPT] = {256};
    for (int i = 1; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % 256);
    float *a = malloc((size_t)N_PROMPT * V * sizeof *a), *b = malloc((size_t)N_PROMPT * V * sizeof *b);
    run_step(&hf, prompt, N_PROMPT, a);
    run_step(&gg, prompt, N_PROMPT, b);
    expect_close(a, b, (size_t)N_PROMPT * V, "prompt");
    for (int s = 0; s < N_DECODE; s++) {
        int32_t next = td_test_argmax(a, V);
        run_step(&hf, &next, 1, a);
        run_step(&gg, &next, 1, b);
        expect_close(a, b, (size_t)V, "decode");
    }
    free(a);
    free(b);
    run_close(&hf);
    run_close(&gg);
}

static void same_logits(td_arch_t arch, td_dtype_t dt)
{
    same_logits_rope(arch, dt, false);
}

Test(model_gguf_engine, llama_f32) { same_logits(TD_ARCH_LLAMA, TD_F32); }
Test(model_gguf_engine, llama3_rope_freqs_f32) { same_logits_rope(TD_ARCH_LLAMA, TD_F32, true); }

/* The scaling above changes the logits (so the rope_freqs comparison can fail): the same
 * weights without it give other logits after position 0. */
Test(model_gguf_engine, llama3_rope_scaling_matters)
{
    td_synth_params_t p = {.seed = 14, .dtype = TD_F32};
    cr_assert_eq(td_model_preset("tiny", &p.config), TD_OK);
    p.config.hidden_dim = 192;
    set_llama3_rope(&p.config);
    cr_assert_eq(td_model_synth_gguf(&p, gguf), TD_OK, "%s", td_last_error());
    run_t with, without;
    run_open(&with, gguf, -1);
    run_open(&without, gguf, -1);
    cr_assert_not_null(without.model->weights.rope_freqs.data, "the GGUF carries rope_freqs");
    td_engine_destroy(without.eng);
    without.model->weights.rope_freqs.data = NULL;
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 8;
    ec.kv_dtype = TD_F32;
    cr_assert_eq(td_engine_create(without.model, without.be, &ec, &without.eng), TD_OK);
    int V = with.model->config.vocab_size;
    int32_t prompt[N_PROMPT] = {256};
    for (int i = 1; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % 256);
    float *a = malloc((size_t)N_PROMPT * V * sizeof *a), *b = malloc((size_t)N_PROMPT * V * sizeof *b);
    run_step(&with, prompt, N_PROMPT, a);
    run_step(&without, prompt, N_PROMPT, b);
    double d = 0;
    for (size_t i = (size_t)V; i < (size_t)N_PROMPT * V; i++)
        d = fmax(d, fabs((double)a[i] - b[i]));
    cr_assert_gt(d, 1e-3, "rope_freqs should matter after position 0 (largest difference %g)", d);
    free(a);
    free(b);
    run_close(&with);
    run_close(&without);
}
Test(model_gguf_engine, llama_q8_0) { same_logits(TD_ARCH_LLAMA, TD_Q8_0); }
Test(model_gguf_engine, qwen2_f32) { same_logits(TD_ARCH_QWEN2, TD_F32); }
Test(model_gguf_engine, qwen3_f32) { same_logits(TD_ARCH_QWEN3, TD_F32); }

/* Without the permutation (rows as Hugging Face stores them, read as pairs) the logits
 * differ: the comparison above can fail. */
Test(model_gguf_engine, pairs_on_unpermuted_rows_differ)
{
    td_synth_params_t p = {.seed = 14, .dtype = TD_F32};
    cr_assert_eq(td_model_preset("tiny", &p.config), TD_OK);
    cr_assert_eq(td_model_synth(&p, dir, NULL), TD_OK, "%s", td_last_error());
    run_t hf, pairs;
    run_open(&hf, dir, -1);
    run_open(&pairs, dir, -1);
    td_engine_destroy(pairs.eng);
    pairs.model->config.rope_style = TD_ROPE_PAIRS;
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 8;
    ec.kv_dtype = TD_F32;
    cr_assert_eq(td_engine_create(pairs.model, pairs.be, &ec, &pairs.eng), TD_OK);
    int V = hf.model->config.vocab_size;
    int32_t prompt[4] = {256, 72, 105, 33};
    float *a = malloc(4 * (size_t)V * sizeof *a), *b = malloc(4 * (size_t)V * sizeof *b);
    run_step(&hf, prompt, 4, a);
    run_step(&pairs, prompt, 4, b);
    double d = 0;
    for (size_t i = (size_t)V; i < 4 * (size_t)V; i++) /* position 0 has no rotation */
        d = fmax(d, fabs((double)a[i] - b[i]));
    cr_assert_gt(d, 1e-3, "rope style should matter for the last tokens");
    free(a);
    free(b);
    run_close(&hf);
    run_close(&pairs);
}

/* A backend without kernels for a block type (CUDA today) gets the weights dequantized at
 * load (the engine's weight_want): here the CPU backend with its block-type bits cleared.
 * The engine then holds f32 matrices, and its logits agree with the block kernels' on the
 * same file within what quantizing activations to 8 bits costs. */
Test(model_gguf_engine, block_weights_dequantized_where_the_backend_has_no_kernels)
{
    td_synth_params_t p = {.seed = 14, .dtype = TD_Q8_0};
    cr_assert_eq(td_model_preset("tiny", &p.config), TD_OK);
    p.config.hidden_dim = 192;
    cr_assert_eq(td_model_synth_gguf(&p, gguf), TD_OK, "%s", td_last_error());
    run_t q, deq;
    run_open(&q, gguf, -1);
    deq = (run_t){0};
    cr_assert_eq(td_model_load(gguf, &deq.model), TD_OK);
    td_cpu_config_t cc = {.n_threads = 1};
    cr_assert_eq(td_backend_cpu_create(&cc, &deq.be), TD_OK);
    for (int t = TD_DTYPE_FLOAT_COUNT; t < TD_DTYPE_COUNT; t++)
        deq.be->weight_dtypes &= ~(1u << t);
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 8;
    ec.kv_dtype = TD_F32;
    cr_assert_eq(td_engine_create(deq.model, deq.be, &ec, &deq.eng), TD_OK, "%s", td_last_error());
    td_kv_seq_init(&deq.seq);
    /* the matrices as f32 (4 bytes a weight) instead of Q8_0 (34 bytes per 32) */
    size_t qb = td_engine_weight_bytes(q.eng), db = td_engine_weight_bytes(deq.eng);
    cr_assert(db > qb * 3, "dequantized weights %zu bytes vs %zu as Q8_0", db, qb);
    int V = q.model->config.vocab_size;
    int32_t prompt[N_PROMPT] = {256};
    for (int i = 1; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % 256);
    float *a = malloc((size_t)N_PROMPT * V * sizeof *a), *b = malloc((size_t)N_PROMPT * V * sizeof *b);
    run_step(&q, prompt, N_PROMPT, a);
    run_step(&deq, prompt, N_PROMPT, b);
    double max_diff = 0, max_abs = 0;
    for (size_t i = 0; i < (size_t)N_PROMPT * V; i++) {
        max_diff = fmax(max_diff, fabs((double)a[i] - b[i]));
        max_abs = fmax(max_abs, fabs((double)a[i]));
    }
    cr_assert(max_abs > 0 && max_diff <= 0.05 * max_abs, "logits differ by %g (largest %g)", max_diff, max_abs);
    free(a);
    free(b);
    run_close(&q);
    run_close(&deq);
}

/* --quant on a model whose FFN rows are not whole blocks (tiny: 176 weights): those matrices
 * stay as stored, the rest are quantized, and the model runs (it once hit an assertion). */
Test(model_gguf_engine, quant_keeps_matrices_whose_rows_are_not_whole_blocks)
{
    td_synth_params_t p = {.seed = 14, .dtype = TD_F32};
    cr_assert_eq(td_model_preset("tiny", &p.config), TD_OK);
    cr_assert_eq(p.config.hidden_dim % 32 != 0, 1, "the preset's FFN width is not whole blocks");
    cr_assert_eq(td_model_synth(&p, dir, NULL), TD_OK, "%s", td_last_error());
    run_t f, q;
    run_open(&f, dir, -1);
    run_open(&q, dir, TD_Q8_0);
    size_t fb = td_engine_weight_bytes(f.eng), qb = td_engine_weight_bytes(q.eng);
    cr_assert(qb < fb * 3 / 4 && qb > fb / 4, "q8_0 %zu bytes vs f32 %zu: some matrices quantized, not all", qb, fb);
    int V = f.model->config.vocab_size;
    int32_t prompt[4] = {256, 72, 105, 33};
    float *a = malloc(4 * (size_t)V * sizeof *a), *b = malloc(4 * (size_t)V * sizeof *b);
    run_step(&f, prompt, 4, a);
    run_step(&q, prompt, 4, b);
    double max_diff = 0, max_abs = 0;
    for (size_t i = 0; i < 4 * (size_t)V; i++) {
        max_diff = fmax(max_diff, fabs((double)a[i] - b[i]));
        max_abs = fmax(max_abs, fabs((double)a[i]));
    }
    cr_assert(max_diff > 0 && max_diff <= 0.05 * max_abs, "logits differ by %g (largest %g)", max_diff, max_abs);
    free(a);
    free(b);
    run_close(&f);
    run_close(&q);
}

/* An f16 GGUF through cpu:q8 (one-byte activations; at level avx512bf16 the float matrices
 * repacked to bf16 and met by bf16 activations, td_cpu_bgemm): its logits follow cpu:exact's
 * within what bf16 rounding costs along the exact path's greedy tokens (teacher-forced),
 * they are not the default backend's (the bf16 path ran), and a sequence's decode logits
 * are the same bits alone and in a batch of 2 and of 9 decode rows (a prefill tile and its
 * tail): batch invariance holds within the mode. */
static void run_open_cfg(run_t *r, const char *path, const td_cpu_config_t *cc, int n_blocks)
{
    *r = (run_t){0};
    cr_assert_eq(td_model_load(path, &r->model), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_backend_cpu_create(cc, &r->be), TD_OK, "%s", td_last_error());
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = n_blocks;
    ec.kv_dtype = TD_F32;
    cr_assert_eq(td_engine_create(r->model, r->be, &ec, &r->eng), TD_OK, "%s", td_last_error());
    td_kv_seq_init(&r->seq);
}

Test(model_gguf_engine, f16_in_cpu_q8_follows_exact_and_is_batch_invariant, .timeout = 120)
{
    td_synth_params_t p = {.seed = 32, .dtype = TD_F16};
    cr_assert_eq(td_model_preset("tiny", &p.config), TD_OK);
    cr_assert_eq(td_model_synth_gguf(&p, gguf), TD_OK, "%s", td_last_error());
    run_t ex, q8, def;
    run_open_cfg(&ex, gguf, &(td_cpu_config_t){.n_threads = 1, .exact = true}, 8);
    run_open_cfg(&q8, gguf, &(td_cpu_config_t){.n_threads = 2, .act_one_byte = true}, 64);
    run_open_cfg(&def, gguf, &(td_cpu_config_t){.n_threads = 1}, 8);
    bool bf16 = !strcmp(td_backend_cpu_isa(q8.be), "avx512bf16") || !strcmp(td_backend_cpu_isa(q8.be), "amx");
    int V = ex.model->config.vocab_size;
    enum { STEPS = 16, SEQS = 9 };
    int32_t prompt[N_PROMPT] = {256};
    for (int i = 1; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % 256);
    float *a = malloc((size_t)N_PROMPT * V * sizeof *a), *b = malloc((size_t)N_PROMPT * V * sizeof *b);
    float *c = malloc((size_t)N_PROMPT * V * sizeof *c);
    int32_t toks[STEPS];
    double worst = 0, def_diff = 0;
    int agree = 0;
    for (int s = 0; s <= STEPS; s++) {
        const int32_t *in = s ? &toks[s - 1] : prompt;
        int n = s ? 1 : N_PROMPT;
        run_step(&ex, in, n, a);
        run_step(&q8, in, n, b);
        run_step(&def, in, n, c);
        double max_diff = 0, max_abs = 0;
        for (size_t i = 0; i < (size_t)n * V; i++) {
            max_diff = fmax(max_diff, fabs((double)a[i] - b[i]));
            max_abs = fmax(max_abs, fabs((double)a[i]));
            def_diff = fmax(def_diff, fabs((double)c[i] - b[i]));
        }
        worst = fmax(worst, max_diff / max_abs);
        const float *last_a = a + (size_t)(n - 1) * V, *last_b = b + (size_t)(n - 1) * V;
        agree += td_test_argmax(last_a, V) == td_test_argmax(last_b, V);
        if (s < STEPS)
            toks[s] = td_test_argmax(last_a, V);
    }
    cr_log_info("cpu:q8 (%s) against cpu:exact: largest logit difference %g of the largest logit, %d of %d tokens agree",
                td_backend_cpu_isa(q8.be), worst, agree, STEPS + 1);
    cr_assert(worst <= 0.03, "cpu:q8 logits differ from cpu:exact's by %g of the largest", worst);
    cr_assert_geq(agree, STEPS - 1, "cpu:q8 picks the exact token at %d of %d steps", agree, STEPS + 1);
    if (bf16)
        cr_assert_gt(def_diff, 0, "at avx512bf16 cpu:q8's float matmul is bf16, not the default's f32 sums");

    /* sequence 0 of a batch: alone (the run above, step by step), then with 1 and 8 others */
    float *alone = malloc((size_t)STEPS * V * sizeof *alone), *batch = malloc((size_t)SEQS * V * sizeof *batch);
    td_engine_seq_end(q8.eng, &q8.seq);
    td_kv_seq_init(&q8.seq);
    run_step(&q8, prompt, N_PROMPT, b);
    for (int s = 0; s < 4; s++)
        run_step(&q8, &toks[s], 1, alone + (size_t)s * V);
    for (int width = 2; width <= SEQS; width += SEQS - 2) {
        td_kv_seq_t seqs[SEQS];
        td_engine_item_t items[SEQS];
        for (int q = 0; q < width; q++) {
            td_kv_seq_init(&seqs[q]);
            int32_t pr[N_PROMPT];
            memcpy(pr, prompt, sizeof pr);
            pr[N_PROMPT - 1] = (int32_t)(q ? 40 + q : prompt[N_PROMPT - 1]); /* others differ */
            td_engine_item_t it = {.seq = &seqs[q], .tokens = pr, .n_tokens = N_PROMPT, .n_logits = 1};
            cr_assert_eq(td_engine_step(q8.eng, &it, 1, b), TD_OK, "%s", td_last_error());
        }
        for (int s = 0; s < 4; s++) {
            for (int q = 0; q < width; q++)
                items[q] = (td_engine_item_t){.seq = &seqs[q], .tokens = &toks[s], .n_tokens = 1, .n_logits = 1};
            cr_assert_eq(td_engine_step(q8.eng, items, width, batch), TD_OK, "%s", td_last_error());
            cr_assert_eq(memcmp(batch, alone + (size_t)s * V, (size_t)V * sizeof *batch), 0,
                         "decode step %d in a batch of %d: sequence 0's logits differ from its own", s, width);
        }
        for (int q = 0; q < width; q++)
            td_engine_seq_end(q8.eng, &seqs[q]);
    }
    free(a), free(b), free(c), free(alone), free(batch);
    run_close(&ex);
    run_close(&q8);
    run_close(&def);
}

/* kB of this process's resident pages in the mapping that holds p (/proc/self/smaps), -1 if none */
static long mapping_rss_kb(const void *p)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    cr_assert_not_null(f);
    char line[512];
    bool in = false;
    long kb = -1;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
            continue;
        }
        if (in && sscanf(line, "Rss: %ld kB", &kb) == 1)
            break;
    }
    fclose(f);
    return kb;
}

/* A matrix the backend packs at load leaves the file's pages: the process does not hold a
 * packed copy and the stored one both (a 1B f16 model in cpu:q8 held 4.9 GB for 2.5 GB of
 * weights). Its view stays valid: a step reads the embedding's rows from the file again
 * (llama_q8_0 compares such a model's logits with the float path's). */
Test(model_gguf_engine, packed_weights_give_back_their_file_pages, .timeout = 60)
{
    td_synth_params_t p = {.seed = 15};
    cr_assert_eq(td_model_preset("tiny", &p.config), TD_OK);
    p.config.dim = 256, p.config.hidden_dim = 768, p.config.n_layers = 2;
    p.config.head_dim = p.config.dim / p.config.n_heads;
    p.dtype = TD_Q8_0;
    cr_assert_eq(td_model_synth_gguf(&p, gguf), TD_OK, "%s", td_last_error());
    run_t r = {0};
    cr_assert_eq(td_model_load(gguf, &r.model), TD_OK, "%s", td_last_error());
    cr_assert_eq(td_model_populate(r.model, 1), TD_OK, "%s", td_last_error());
    const td_layer_weights_t *L = r.model->weights.layers;
    long before = mapping_rss_kb(L[0].wq.data);
    size_t packed = 0;
    for (int l = 0; l < p.config.n_layers; l++) {
        const td_tensor_t *ts[] = {&L[l].wq, &L[l].wk, &L[l].wv, &L[l].wo, &L[l].w_gate, &L[l].w_up, &L[l].w_down};
        for (size_t i = 0; i < TD_ARRAY_LEN(ts); i++) {
            cr_assert_eq(ts[i]->dtype, TD_Q8_0);
            packed += td_dtype_bytes(ts[i]->dtype, (size_t)(ts[i]->shape[0] * ts[i]->shape[1]));
        }
    }
    td_cpu_config_t cc = {.n_threads = 1};
    cr_assert_eq(td_backend_cpu_create(&cc, &r.be), TD_OK, "%s", td_last_error());
    td_engine_config_t ec = td_engine_config_default();
    ec.n_blocks = 8;
    cr_assert_eq(td_engine_create(r.model, r.be, &ec, &r.eng), TD_OK, "%s", td_last_error());
    td_kv_seq_init(&r.seq);
    long after = mapping_rss_kb(L[0].wq.data);
    /* every matrix's whole pages go: at most two partial pages a matrix stay */
    long page_kb = sysconf(_SC_PAGESIZE) / 1024, want = (long)(packed / 1024) - 14 * 2 * page_kb;
    cr_assert(before > 0 && before - after >= want, "file pages resident %ld kB before the engine, %ld after: "
              "%ld kB of packed matrices should have gone", before, after, (long)(packed / 1024));
    int32_t prompt[N_PROMPT] = {256};
    for (int i = 1; i < N_PROMPT; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % 256);
    float *a = malloc((size_t)N_PROMPT * p.config.vocab_size * sizeof *a);
    run_step(&r, prompt, N_PROMPT, a); /* the embedding's rows fault in from the file again */
    for (size_t i = 0; i < (size_t)N_PROMPT * p.config.vocab_size; i++)
        cr_assert(isfinite(a[i]));
    free(a);
    run_close(&r);
}
