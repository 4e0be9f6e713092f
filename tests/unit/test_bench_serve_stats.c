/*
 * test_bench_serve_stats: the pure parts of `tandem bench serve` (common/loadgen/loadgen.h).
 * Percentiles equal numpy.percentile's (linear interpolation) and std numpy's population
 * one; goodput counts only completed requests meeting every given objective, attainment
 * divides by every request; arrivals with a fixed seed repeat, have the mean gap 1/rate
 * and the spread of a gamma of shape `burstiness` within statistical bounds; the random
 * dataset's lengths stay in their range; traces (CSV with a header, JSON Lines with each
 * key alias) parse, start at 0, and bad rows are refused naming the line; ShareGPT takes
 * the first human turn and the gpt turn's length; --goodput and --sweep parse and refuse
 * what they should.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "loadgen.h"
#include "td_status.h"
#include "td_test_models.h"

/* the percentile itself is td_stats_percentile (test_stats) */
Test(bench_serve, percentiles_are_numpys)
{
    double w[] = {9, 2, 5, 4, 4, 7, 4, 5}; /* unsorted: loadgen_stat_of sorts */
    loadgen_stat_t st;
    loadgen_stat_of(w, 8, &st);
    cr_assert_float_eq(st.mean, 5, 1e-12);
    cr_assert_float_eq(st.std, 2, 1e-12);
    cr_assert_float_eq(st.median, 4.5, 1e-12);
    cr_assert_float_eq(st.p90, 7.6, 1e-12); /* numpy.percentile([2,4,4,4,5,5,7,9], 90) */
    cr_assert_float_eq(st.p99, 8.86, 1e-12);
    loadgen_stat_of(w, 0, &st);
    cr_assert(isnan(st.mean) && isnan(st.p99));
}

Test(bench_serve, goodput_is_completed_requests_meeting_every_objective)
{
    loadgen_outcome_t o[] = {
        {.ok = true, .input_tokens = 10, .output_tokens = 5, .ttft_ms = 100, .tpot_ms = 10, .e2el_ms = 140}, /* good */
        {.ok = true, .input_tokens = 10, .output_tokens = 5, .ttft_ms = 300, .tpot_ms = 10, .e2el_ms = 340}, /* ttft */
        {.ok = true, .input_tokens = 10, .output_tokens = 5, .ttft_ms = 100, .tpot_ms = 60, .e2el_ms = 340}, /* tpot */
        {.ok = true, .input_tokens = 10, .output_tokens = 1, .ttft_ms = 200, .tpot_ms = 0, .e2el_ms = 200},  /* good, at the bound */
        {.ok = false, .input_tokens = 0, .output_tokens = 0},                                                /* failed */
    };
    loadgen_slo_t slo = {0};
    cr_assert_eq(loadgen_slo_parse("ttft:200, tpot:50", &slo), TD_OK);
    cr_assert_float_eq(slo.ttft_ms, 200, 1e-12);
    cr_assert_float_eq(slo.tpot_ms, 50, 1e-12);
    cr_assert(slo.e2el_ms <= 0);
    loadgen_summary_t s;
    loadgen_summarize(o, 5, 2.0, &slo, &s);
    cr_assert_eq(s.completed, 4);
    cr_assert_eq(s.failed, 1);
    cr_assert_eq(s.good, 2);
    cr_assert_eq(s.total_input, 40);
    cr_assert_eq(s.total_output, 16);
    cr_assert_float_eq(s.request_throughput, 2.0, 1e-12);
    cr_assert_float_eq(s.request_goodput, 1.0, 1e-12);
    cr_assert_float_eq(s.output_throughput, 8.0, 1e-12);
    cr_assert_float_eq(s.total_token_throughput, 28.0, 1e-12);
    cr_assert_float_eq(s.slo_attainment, 0.4, 1e-12);
    /* an added e2el objective takes the 200 ms request out too; none at all: every completed one */
    cr_assert_eq(loadgen_slo_parse("e2el:150", &slo), TD_OK);
    loadgen_summarize(o, 5, 2.0, &slo, &s);
    cr_assert_eq(s.good, 1);
    loadgen_slo_t none = {0};
    cr_assert(!loadgen_slo_any(&none));
    loadgen_summarize(o, 5, 2.0, &none, &s);
    cr_assert_eq(s.good, 4);
}

Test(bench_serve, goodput_flags_refused_by_name)
{
    loadgen_slo_t slo = {0};
    cr_assert_eq(loadgen_slo_parse("ttft", &slo), TD_ERR_INVALID);
    cr_assert_eq(loadgen_slo_parse("ttft:", &slo), TD_ERR_INVALID);
    cr_assert_eq(loadgen_slo_parse("ttft:-1", &slo), TD_ERR_INVALID);
    cr_assert_eq(loadgen_slo_parse("ttft:5ms", &slo), TD_ERR_INVALID);
    cr_assert_eq(loadgen_slo_parse("latency:5", &slo), TD_ERR_INVALID);
    cr_assert_eq(loadgen_slo_parse(" , ", &slo), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), "--goodput"));
    cr_assert_eq(loadgen_slo_parse("tpot:0.5 e2el:1e3", &slo), TD_OK);
    cr_assert_float_eq(slo.e2el_ms, 1000, 1e-9);
}

/* Mean gap 1/rate, coefficient of variation 1/sqrt(burstiness), within 5 standard errors. */
static void check_arrivals(double rate, double burstiness)
{
    enum { N = 20000 };
    double *t = malloc(N * sizeof *t), *u = malloc(N * sizeof *u);
    loadgen_rng_t r, r2;
    loadgen_rng_seed(&r, 42);
    loadgen_rng_seed(&r2, 42);
    loadgen_arrivals(&r, rate, burstiness, N, t);
    loadgen_arrivals(&r2, rate, burstiness, N, u);
    cr_assert(!memcmp(t, u, N * sizeof *t), "the same seed gives the same arrivals");
    cr_assert_eq(t[0], 0);
    double sum = 0, sq = 0;
    for (int i = 1; i < N; i++) {
        double g = t[i] - t[i - 1];
        cr_assert(g >= 0);
        sum += g;
        sq += g * g;
    }
    double n = N - 1, mean = sum / n, sd = sqrt(sq / n - mean * mean);
    double want_mean = 1 / rate, want_sd = want_mean / sqrt(burstiness);
    cr_assert(fabs(mean - want_mean) < 5 * want_sd / sqrt(n), "rate %g burstiness %g: mean gap %g, want %g", rate,
              burstiness, mean, want_mean);
    cr_assert(fabs(sd / want_sd - 1) < 0.08, "rate %g burstiness %g: gap sd %g, want %g", rate, burstiness, sd,
              want_sd);
    free(t);
    free(u);
}

Test(bench_serve, arrivals_poisson_and_gamma)
{
    check_arrivals(10, 1);   /* Poisson: exponential gaps */
    check_arrivals(1000, 1);
    check_arrivals(50, 0.5); /* burstier */
    check_arrivals(50, 4);   /* more even */
    double t[5];
    loadgen_rng_t r;
    loadgen_rng_seed(&r, 1);
    loadgen_arrivals(&r, INFINITY, 1, 5, t);
    for (int i = 0; i < 5; i++)
        cr_assert_eq(t[i], 0, "rate inf: every request at once");
}

Test(bench_serve, random_dataset_lengths_in_range)
{
    loadgen_rng_t r;
    loadgen_rng_seed(&r, 7);
    loadgen_dataset_t d;
    cr_assert_eq(loadgen_dataset_random(&r, 1000, 100, 20, 0.5, &d), TD_OK);
    cr_assert_eq(d.n, 1000);
    uint32_t lo = UINT32_MAX, hi = 0;
    for (size_t i = 0; i < d.n; i++) {
        lo = d.items[i].input_len < lo ? d.items[i].input_len : lo;
        hi = d.items[i].input_len > hi ? d.items[i].input_len : hi;
        cr_assert(d.items[i].output_len >= 10 && d.items[i].output_len <= 30);
        cr_assert(!d.items[i].text && d.items[i].arrival_s < 0);
    }
    cr_assert(lo >= 50 && hi <= 150 && lo < 60 && hi > 140, "lo %u hi %u", lo, hi);
    /* ids in [1, vocab), repeatable, and no two prompts alike */
    for (uint32_t i = 0; i < 1000; i++) {
        uint32_t id = loadgen_prompt_id(&d.items[0], i, 512);
        cr_assert(id >= 1 && id < 512);
        cr_assert_eq(id, loadgen_prompt_id(&d.items[0], i, 512));
    }
    int same = 0;
    for (uint32_t i = 0; i < 64; i++)
        same += loadgen_prompt_id(&d.items[0], i, 512) == loadgen_prompt_id(&d.items[1], i, 512);
    cr_assert(same < 8, "%d of 64 ids equal", same);
    loadgen_dataset_free(&d);
    cr_assert_eq(loadgen_dataset_random(&r, 10, 100, 20, 0, &d), TD_OK);
    for (size_t i = 0; i < d.n; i++)
        cr_assert(d.items[i].input_len == 100 && d.items[i].output_len == 20);
    loadgen_dataset_free(&d);
}

Test(bench_serve, trace_csv_and_jsonl)
{
    loadgen_rng_t r;
    loadgen_rng_seed(&r, 1);
    loadgen_dataset_t d;
    const char csv[] = "arrival_s,input_len,output_len\n# comment\n\n10.5,100,20\n10.5,8,1\n12,50,5\n";
    cr_assert_eq(loadgen_dataset_trace_parse(csv, strlen(csv), "t.csv", 0, &r, &d), TD_OK);
    cr_assert_eq(d.n, 3);
    cr_assert(d.timed);
    cr_assert_float_eq(d.items[0].arrival_s, 0, 1e-12);
    cr_assert_float_eq(d.items[1].arrival_s, 0, 1e-12);
    cr_assert_float_eq(d.items[2].arrival_s, 1.5, 1e-12);
    cr_assert(d.items[0].input_len == 100 && d.items[0].output_len == 20 && d.items[2].input_len == 50);
    loadgen_dataset_free(&d);
    const char jl[] = "{\"timestamp\": 1, \"input_length\": 3, \"output_length\": 4}\n"
                      "{\"arrival_s\": 2, \"input_tokens\": 5, \"output_tokens\": 6}\n"
                      "{\"time\": 2.5, \"input_len\": 7, \"output_len\": 8}";
    cr_assert_eq(loadgen_dataset_trace_parse(jl, strlen(jl), "t.jsonl", 2, &r, &d), TD_OK);
    cr_assert_eq(d.n, 2, "max_n keeps the first rows");
    cr_assert(d.items[1].input_len == 5 && d.items[1].output_len == 6);
    cr_assert_float_eq(d.items[1].arrival_s, 1, 1e-12);
    loadgen_dataset_free(&d);
    const char *bad[] = {"0,1,1\n2,1,1\n1,1,1\n", /* time goes back */
                         "0,1\n",                 /* no output length */
                         "0,1,0\n",               /* output 0 */
                         "0,1.5,2\n",             /* not whole */
                         "{\"timestamp\": 1}\n",  /* lengths missing */
                         "{not json\n",
                         "x,y,z\nfoo,1,1\n",      /* a second non-numeric line */
                         "# only a comment\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(loadgen_dataset_trace_parse(bad[i], strlen(bad[i]), "bad.csv", 0, &r, &d), TD_ERR_FORMAT, "%s", bad[i]);
        cr_assert(strstr(td_last_error(), "bad.csv"), "%s", td_last_error());
    }
    cr_assert_eq(loadgen_dataset_trace_parse(bad[0], strlen(bad[0]), "bad.csv", 0, &r, &d), TD_ERR_FORMAT);
    cr_assert(strstr(td_last_error(), "bad.csv:3"), "names the line: %s", td_last_error());
}

Test(bench_serve, sharegpt_first_human_turn_and_gpt_length)
{
    const char j[] =
        "[{\"id\": \"a\", \"conversations\": [{\"from\": \"human\", \"value\": \"tell me a story about a cat\"},"
        "  {\"from\": \"gpt\", \"value\": \"0123456789012345678901234567890123456789\"},"
        "  {\"from\": \"human\", \"value\": \"more\"}]},"
        " {\"id\": \"b\", \"conversations\": [{\"from\": \"gpt\", \"value\": \"starts with gpt: skipped\"}]},"
        " {\"id\": \"c\", \"conversations\": [{\"from\": \"human\", \"value\": \"hi\"},"
        "  {\"from\": \"gpt\", \"value\": \"a long enough answer here\"}]},"
        " {\"id\": \"d\", \"conversations\": [{\"from\": \"human\", \"value\": \"only a question, no answer\"}]}]";
    loadgen_rng_t r;
    loadgen_rng_seed(&r, 3);
    loadgen_dataset_t d;
    cr_assert_eq(loadgen_dataset_sharegpt_parse(j, strlen(j), "sg.json", NULL, 0, 0, &r, &d), TD_OK);
    cr_assert_eq(d.n, 1, "c's prompt is under 4 tokens, b and d have no human+gpt pair");
    cr_assert_str_eq(d.items[0].text, "tell me a story about a cat");
    cr_assert_eq(d.items[0].output_len, 10, "40 bytes / 4 without a tokenizer");
    cr_assert_eq(d.items[0].input_len, 0, "unknown without a tokenizer: the server's usage tells");
    loadgen_dataset_free(&d);
    cr_assert_eq(loadgen_dataset_sharegpt_parse(j, strlen(j), "sg.json", NULL, 3, 0, &r, &d), TD_OK);
    cr_assert_eq(d.items[0].output_len, 3, "--sharegpt-output-len");
    loadgen_dataset_free(&d);
    cr_assert_eq(loadgen_dataset_sharegpt_parse("{}", 2, "sg.json", NULL, 0, 0, &r, &d), TD_ERR_FORMAT);
    cr_assert_eq(loadgen_dataset_sharegpt_parse("[]", 2, "sg.json", NULL, 0, 0, &r, &d), TD_ERR_FORMAT);
}

/* With a tokenizer (--tokenizer) the lengths are its token counts: Llama 2's. */
Test(bench_serve, sharegpt_lengths_from_the_tokenizer)
{
    char path[1024];
    td_test_model_file("llama2-tokenizer/tokenizer.bin", path, sizeof path);
    td_tokenizer_t *tok;
    cr_assert_eq(td_tokenizer_load(path, &tok), TD_OK);
    const char j[] = "[{\"conversations\": [{\"from\": \"human\", \"value\": \"Once upon a time there was a cat\"},"
                     " {\"from\": \"gpt\", \"value\": \"The cat sat on the mat and was happy all day\"}]}]";
    int32_t *ids;
    size_t n_in, n_out;
    cr_assert_eq(td_tokenizer_encode(tok, "Once upon a time there was a cat", 32, 0, &ids, &n_in), TD_OK);
    free(ids);
    cr_assert_eq(td_tokenizer_encode(tok, "The cat sat on the mat and was happy all day", 44, 0, &ids, &n_out), TD_OK);
    free(ids);
    loadgen_rng_t r;
    loadgen_rng_seed(&r, 1);
    loadgen_dataset_t d;
    cr_assert_eq(loadgen_dataset_sharegpt_parse(j, strlen(j), "sg.json", tok, 0, 0, &r, &d), TD_OK);
    cr_assert_eq(d.n, 1);
    cr_assert_eq(d.items[0].input_len, n_in);
    cr_assert_eq(d.items[0].output_len, n_out);
    cr_assert(n_out >= 8 && n_out <= 14, "%zu tokens", n_out);
    loadgen_dataset_free(&d);
    td_tokenizer_destroy(tok);
}

Test(bench_serve, sweep_rates)
{
    double *rates;
    size_t n;
    cr_assert_eq(loadgen_rates_parse("1,2.5,10", &rates, &n), TD_OK);
    cr_assert(n == 3 && rates[0] == 1 && rates[1] == 2.5 && rates[2] == 10);
    free(rates);
    cr_assert_eq(loadgen_rates_parse("2:10:2", &rates, &n), TD_OK);
    cr_assert(n == 5 && rates[0] == 2 && rates[4] == 10);
    free(rates);
    cr_assert_eq(loadgen_rates_parse("0.1:0.3:0.1", &rates, &n), TD_OK);
    cr_assert_eq(n, 3, "STOP included despite rounding");
    free(rates);
    const char *bad[] = {"", "a", "1,,2", "0", "-1", "5:1:1", "1:5:0", "1:1e9:1", "1:5", "1:5:1x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        cr_assert_eq(loadgen_rates_parse(bad[i], &rates, &n), TD_ERR_INVALID, "'%s'", bad[i]);
    double r[] = {1, 2, 4, 8}, a[] = {1, 0.95, 0.85, 0.91};
    cr_assert_float_eq(loadgen_sweep_best(r, a, 4, 0.9), 8, 1e-12, "the highest rate that meets it, not the first miss");
    cr_assert(isnan(loadgen_sweep_best(r, a, 4, 1.01)));
}
