/*
 * Tests of td_gen_params_validate, the one check of a generation request that the CLI and the
 * gateway share: every field at each end of its range is accepted, one step past either end,
 * NaN and both infinities are refused with the exact message (field, value, range), and the
 * message is also this thread's last error.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "td_gen_params.h"

static const char *stops_ok[TD_STOP_MAX_STRINGS] = {"a", "\n\n", "the end"};

/* A valid request with every field away from its default. */
static td_gen_params_t valid(void)
{
    td_gen_params_t p = td_gen_params_default();
    p.max_tokens = 64;
    p.sampling.temperature = 0.7f;
    p.sampling.top_k = 40;
    p.sampling.top_p = 0.9f;
    p.sampling.min_p = 0.05f;
    p.sampling.repetition_penalty = 1.1f;
    p.sampling.presence_penalty = 0.5f;
    p.sampling.frequency_penalty = -0.5f;
    p.sampling.seed = UINT64_MAX;
    p.prompt_len = 12;
    p.prompt_is_text = true;
    p.n_stop_ids = 2;
    p.n_stop_strings = 3;
    p.stop_strings = stops_ok;
    p.logprobs = (td_logprobs_want_t){.on = true, .top = 5};
    return p;
}

static void expect_ok(const td_gen_params_t *p, const char *what)
{
    char why[256] = "";
    cr_expect_eq(td_gen_params_validate(p, why, sizeof why), TD_OK, "%s refused: %s", what, why);
    cr_expect_eq(td_gen_params_check(p, NULL, 0), TD_GEN_FIELD_NONE, "%s: check found a field", what);
}

/* Every field has its request name; the front doors' names where they have the field */
Test(gen_params, field_names_table)
{
    for (int f = 1; f < TD_GEN_FIELD_COUNT; f++) {
        td_gen_field_names_t n = td_gen_field_names((td_gen_field_t)f);
        cr_expect(n.request[0], "field %d has no request name", f);
        cr_expect(f == TD_GEN_FIELD_PENALTY_WINDOW || (n.flag[0] == '-' && n.openai[0] && n.openai_chat[0]),
                  "field %s lacks a flag or an OpenAI name", n.request);
    }
    cr_expect_str_eq(td_gen_field_names(TD_GEN_FIELD_PROMPT).openai_chat, "messages");
    cr_expect_str_eq(td_gen_field_names(TD_GEN_FIELD_TOP_LOGPROBS).openai, "logprobs");
    cr_expect_str_eq(td_gen_field_names((td_gen_field_t)999).request, "");
}

/* ... and td_gen_params_check names the field the message begins with (TD_GEN_FIELDS' request
 * name; "stop string N" is STOP_STRINGS), the field the front doors translate */
static void expect_refused(const td_gen_params_t *p, const char *want)
{
    char why[256] = "", why2[256] = "";
    cr_assert_eq(td_gen_params_validate(p, why, sizeof why), TD_ERR_INVALID, "accepted, want '%s'", want);
    cr_expect_str_eq(why, want);
    cr_expect_str_eq(td_last_error(), want);
    cr_expect_eq(td_gen_params_validate(p, NULL, 0), TD_ERR_INVALID, "without why: '%s'", want);
    td_gen_field_t f = td_gen_params_check(p, why2, sizeof why2);
    cr_assert_neq(f, TD_GEN_FIELD_NONE, "check passed '%s'", want);
    cr_expect_str_eq(why2, want);
    const char *req = td_gen_field_names(f).request;
    size_t n = strlen(req);
    bool named = n && !strncmp(want, req, n) && want[n] == ' ';
    if (f == TD_GEN_FIELD_STOP_STRINGS && !strncmp(want, "stop string ", 12))
        named = true;
    cr_expect(named, "field %d (%s) for '%s'", (int)f, req, want);
}

Test(gen_params, defaults_and_a_full_request_are_valid)
{
    td_gen_params_t d = td_gen_params_default();
    cr_assert(d.max_tokens == 0 && d.prompt_len == 0 && d.n_stop_ids == 0 && d.n_stop_strings == 0);
    cr_assert(d.sampling.top_p == 1.0f && d.sampling.repetition_penalty == 1.0f);
    expect_ok(&d, "the defaults");
    td_gen_params_t p = valid();
    expect_ok(&p, "a full request");
}

Test(gen_params, every_range_boundary_is_accepted)
{
    td_gen_params_t p;
#define OK_WITH(stmt)                                                                              \
    do {                                                                                           \
        p = valid();                                                                               \
        stmt;                                                                                      \
        expect_ok(&p, #stmt);                                                                      \
    } while (0)
    OK_WITH(p.max_tokens = 0);
    OK_WITH(p.max_tokens = TD_GEN_MAX_TOKENS);
    OK_WITH(p.prompt_len = 0);
    OK_WITH(p.prompt_len = TD_GEN_MAX_PROMPT);
    OK_WITH((p.prompt_len = TD_GEN_MAX_PROMPT, p.prompt_is_text = false));
    OK_WITH(p.sampling.temperature = 0.0f);
    OK_WITH(p.sampling.temperature = TD_SAMPLING_MAX_TEMPERATURE);
    OK_WITH(p.sampling.top_k = 0);
    OK_WITH(p.sampling.top_k = INT32_MAX);
    OK_WITH(p.sampling.top_p = 1.0f);
    OK_WITH(p.sampling.top_p = 1e-30f);
    OK_WITH(p.sampling.min_p = 0.0f);
    OK_WITH(p.sampling.min_p = nextafterf(1.0f, 0.0f));
    OK_WITH(p.sampling.repetition_penalty = 1e-30f);
    OK_WITH(p.sampling.repetition_penalty = TD_SAMPLING_MAX_PENALTY);
    OK_WITH(p.sampling.presence_penalty = -TD_SAMPLING_MAX_OPENAI_PENALTY);
    OK_WITH(p.sampling.presence_penalty = TD_SAMPLING_MAX_OPENAI_PENALTY);
    OK_WITH(p.sampling.frequency_penalty = -TD_SAMPLING_MAX_OPENAI_PENALTY);
    OK_WITH(p.sampling.frequency_penalty = TD_SAMPLING_MAX_OPENAI_PENALTY);
    OK_WITH(p.logprobs.top = 0);
    OK_WITH(p.logprobs.top = TD_LOGPROBS_MAX_TOP);
    OK_WITH((p.prompt_len = TD_LOGPROBS_MAX_PROMPT, p.prompt_is_text = false, p.logprobs.prompt = true));
    /* a text prompt's length in tokens is checked once it is encoded */
    OK_WITH((p.prompt_len = TD_LOGPROBS_MAX_PROMPT + 1, p.prompt_is_text = true, p.logprobs.prompt = true));
    OK_WITH((p.logprobs.top = 99, p.logprobs.on = false)); /* not asked: not read */
    OK_WITH(p.sampling.seed = 0);
    OK_WITH(p.n_stop_ids = 0);
    OK_WITH(p.n_stop_ids = TD_GEN_MAX_STOP_IDS);
    OK_WITH(p.tpot_objective_ms = 0);
    OK_WITH(p.tpot_objective_ms = TD_GEN_MAX_TPOT_MS);
    OK_WITH((p.n_stop_strings = 0, p.stop_strings = NULL));
    /* every slot holds a string of the longest length allowed; "" is allowed (ignored) */
    static char longest[TD_STOP_MAX_LEN + 1];
    memset(longest, 'x', TD_STOP_MAX_LEN);
    static const char *full[TD_STOP_MAX_STRINGS];
    for (int i = 0; i < TD_STOP_MAX_STRINGS; i++)
        full[i] = i == 3 ? "" : longest;
    OK_WITH((p.n_stop_strings = TD_STOP_MAX_STRINGS, p.stop_strings = full));
#undef OK_WITH
}

Test(gen_params, each_fault_is_refused_by_name_value_and_range)
{
    static char s300[301], s257[TD_STOP_MAX_LEN + 2];
    memset(s300, 's', 300);
    memset(s257, 's', TD_STOP_MAX_LEN + 1);
    static const char *stops300[] = {s300};
    static const char *stops257[] = {"ok", "fine", s257};
    td_gen_params_t p;
#define REFUSED(stmt, want)                                                                        \
    do {                                                                                           \
        p = valid();                                                                               \
        stmt;                                                                                      \
        expect_refused(&p, want);                                                                  \
    } while (0)
    REFUSED(p.max_tokens = -1, "max_tokens -1 is out of range [0, 2147483647]");
    REFUSED(p.max_tokens = (int64_t)TD_GEN_MAX_TOKENS + 1, "max_tokens 2147483648 is out of range [0, 2147483647]");
    REFUSED(p.max_tokens = UINT32_MAX, "max_tokens 4294967295 is out of range [0, 2147483647]");
    REFUSED(p.prompt_len = TD_GEN_MAX_PROMPT + 1, "prompt is 4194305 bytes long, at most 4194304 allowed");
    REFUSED((p.prompt_len = TD_GEN_MAX_PROMPT + 1, p.prompt_is_text = false),
            "prompt is 4194305 ids long, at most 4194304 allowed");

    REFUSED(p.sampling.temperature = -0.5f, "temperature -0.5 is out of range [0, 100] (0 = greedy)");
    REFUSED(p.sampling.temperature = 100.5f, "temperature 100.5 is out of range [0, 100] (0 = greedy)");
    REFUSED(p.sampling.temperature = NAN, "temperature nan is out of range [0, 100] (0 = greedy)");
    REFUSED(p.sampling.temperature = INFINITY, "temperature inf is out of range [0, 100] (0 = greedy)");
    REFUSED(p.sampling.temperature = -INFINITY, "temperature -inf is out of range [0, 100] (0 = greedy)");

    REFUSED(p.sampling.top_k = -1, "top_k -1 is out of range [0, 2147483647] (0 = off)");
    REFUSED(p.sampling.top_k = INT32_MIN, "top_k -2147483648 is out of range [0, 2147483647] (0 = off)");

    REFUSED(p.sampling.top_p = -0.5f, "top_p -0.5 is out of range (0, 1] (1 = off)");
    REFUSED(p.sampling.top_p = 0.0f, "top_p 0 is out of range (0, 1] (1 = off)");
    REFUSED(p.sampling.top_p = 1.5f, "top_p 1.5 is out of range (0, 1] (1 = off)");
    REFUSED(p.sampling.top_p = NAN, "top_p nan is out of range (0, 1] (1 = off)");
    REFUSED(p.sampling.top_p = INFINITY, "top_p inf is out of range (0, 1] (1 = off)");
    REFUSED(p.sampling.top_p = -INFINITY, "top_p -inf is out of range (0, 1] (1 = off)");

    REFUSED(p.sampling.min_p = -0.1f, "min_p -0.1 is out of range [0, 1) (0 = off)");
    REFUSED(p.sampling.min_p = 1.0f, "min_p 1 is out of range [0, 1) (0 = off)");
    REFUSED(p.sampling.min_p = NAN, "min_p nan is out of range [0, 1) (0 = off)");
    REFUSED(p.sampling.min_p = INFINITY, "min_p inf is out of range [0, 1) (0 = off)");
    REFUSED(p.sampling.min_p = -INFINITY, "min_p -inf is out of range [0, 1) (0 = off)");

    REFUSED(p.sampling.repetition_penalty = -2.0f, "repetition_penalty -2 is out of range (0, 100] (1 = off)");
    REFUSED(p.sampling.repetition_penalty = 0.0f, "repetition_penalty 0 is out of range (0, 100] (1 = off)");
    REFUSED(p.sampling.repetition_penalty = 100.5f, "repetition_penalty 100.5 is out of range (0, 100] (1 = off)");
    REFUSED(p.sampling.repetition_penalty = NAN, "repetition_penalty nan is out of range (0, 100] (1 = off)");
    REFUSED(p.sampling.repetition_penalty = INFINITY, "repetition_penalty inf is out of range (0, 100] (1 = off)");
    REFUSED(p.sampling.repetition_penalty = -INFINITY,
            "repetition_penalty -inf is out of range (0, 100] (1 = off)");

    REFUSED(p.sampling.penalty_window = -1, "penalty_window -1 is out of range [0, 8192]");
    REFUSED(p.sampling.penalty_window = TD_SAMPLING_MAX_WINDOW + 1, "penalty_window 8193 is out of range [0, 8192]");

    REFUSED(p.sampling.presence_penalty = 2.5f, "presence_penalty 2.5 is out of range [-2, 2] (0 = off)");
    REFUSED(p.sampling.presence_penalty = NAN, "presence_penalty nan is out of range [-2, 2] (0 = off)");
    REFUSED(p.sampling.frequency_penalty = -3.0f, "frequency_penalty -3 is out of range [-2, 2] (0 = off)");
    REFUSED(p.sampling.frequency_penalty = INFINITY, "frequency_penalty inf is out of range [-2, 2] (0 = off)");
    REFUSED(p.logprobs.top = 21, "top_logprobs 21 is out of range [0, 20]");
    REFUSED(p.logprobs.top = -1, "top_logprobs -1 is out of range [0, 20]");
    REFUSED((p.prompt_len = TD_LOGPROBS_MAX_PROMPT + 1, p.prompt_is_text = false, p.logprobs.prompt = true),
            "prompt_logprobs asked for a prompt of 4097 ids, at most 4096 allowed");

    REFUSED(p.n_stop_ids = TD_GEN_MAX_STOP_IDS + 1, "stop_ids has 33 ids, at most 32 allowed");
    REFUSED(p.tpot_objective_ms = -1, "tpot_objective_ms -1 is out of range [0, 3600000] (0: the router's objective)");
    REFUSED(p.tpot_objective_ms = TD_GEN_MAX_TPOT_MS + 1,
            "tpot_objective_ms 3600001 is out of range [0, 3600000] (0: the router's objective)");
    /* a count past the bound is refused before any string is read (the CLI keeps only 16) */
    REFUSED((p.n_stop_strings = TD_STOP_MAX_STRINGS + 1, p.stop_strings = NULL), "stop_strings has 17 strings, at most 16 allowed");
    REFUSED((p.n_stop_strings = 1, p.stop_strings = stops300), "stop string 0 is 300 bytes long, at most 256 allowed");
    REFUSED((p.n_stop_strings = 3, p.stop_strings = stops257), "stop string 2 is 257 bytes long, at most 256 allowed");
#undef REFUSED
}

Test(gen_params, one_float_step_past_each_bound_is_refused)
{
    td_gen_params_t p[6] = {valid(), valid(), valid(), valid(), valid(), valid()};
    struct {
        const char *field;
        float *v;
        float past;
    } cases[6] = {
        {"temperature", &p[0].sampling.temperature, nextafterf(TD_SAMPLING_MAX_TEMPERATURE, INFINITY)},
        {"top_p", &p[1].sampling.top_p, nextafterf(1.0f, 2.0f)},
        {"min_p", &p[2].sampling.min_p, nextafterf(0.0f, -1.0f)},
        {"repetition_penalty", &p[3].sampling.repetition_penalty, nextafterf(TD_SAMPLING_MAX_PENALTY, INFINITY)},
        {"presence_penalty", &p[4].sampling.presence_penalty, nextafterf(TD_SAMPLING_MAX_OPENAI_PENALTY, INFINITY)},
        {"frequency_penalty", &p[5].sampling.frequency_penalty, nextafterf(-TD_SAMPLING_MAX_OPENAI_PENALTY, -INFINITY)},
    };
    for (int i = 0; i < 6; i++) {
        *cases[i].v = cases[i].past;
        char why[256] = "";
        cr_expect_eq(td_gen_params_validate(&p[i], why, sizeof why), TD_ERR_INVALID, "%s %.9g accepted",
                     cases[i].field, (double)cases[i].past);
        cr_expect(strncmp(why, cases[i].field, strlen(cases[i].field)) == 0, "'%s' does not name %s", why,
                  cases[i].field);
    }
}

Test(gen_params, the_first_fault_is_the_one_reported)
{
    td_gen_params_t p = valid();
    p.sampling.top_p = NAN;
    p.sampling.repetition_penalty = -2.0f;
    p.n_stop_ids = 1000;
    expect_refused(&p, "top_p nan is out of range (0, 1] (1 = off)");
}

Test(gen_params, a_short_why_buffer_is_truncated_not_overrun)
{
    td_gen_params_t p = valid();
    p.sampling.top_p = -0.5f;
    char why[8];
    memset(why, 'z', sizeof why);
    cr_assert_eq(td_gen_params_validate(&p, why, 6), TD_ERR_INVALID);
    cr_assert_str_eq(why, "top_p");
    cr_assert_eq(why[6], 'z');
}
