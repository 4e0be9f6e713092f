/*
 * test_opts: the one option table parser (td_opts): every type from --key VALUE and
 * --key=VALUE, defaults kept when a flag is absent, a config file that flags override
 * whatever their order, positional arguments, --help, and errors that name the flag.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_opts.h"
#include "td_status.h"

typedef struct vals {
    int64_t n;
    float f;
    const char *s;
    bool b;
    int fn_calls;
} vals_t;

static td_status_t parse_even(const td_opt_t *opt, const char *v)
{
    vals_t *x = opt->ptr;
    if (strlen(v) % 2)
        return td_errorf(TD_ERR_INVALID, "--%s: '%s' has an odd length", opt->name, v);
    x->fn_calls++;
    return TD_OK;
}

/* Parses argv (NULL-terminated, argv[0] "tandem") into x; `args` takes positionals. */
static td_status_t parse(vals_t *x, bool config, char **args, int max_args, td_opts_result_t *r,
                         const char *const *argv)
{
    int argc = 0;
    while (argv[argc])
        argc++;
    static td_opt_t opts[5];
    td_opt_t t[] = {
        TD_OPT_INT("count", &x->n, 1, 100, "a count"),
        {.name = "ratio", .type = TD_OPT_F32, .ptr = &x->f, .fmin = 0.5f, .fmax = 2.0f, .help = "a ratio"},
        TD_OPT_STRING("name", &x->s, "a name"),
        {.name = "json", .type = TD_OPT_BOOL, .ptr = &x->b, .help = "a switch"},
        {.name = "even", .type = TD_OPT_FN, .ptr = x, .parse = parse_even, .help = "even text"},
    };
    memcpy(opts, t, sizeof t);
    td_opts_t spec = {.prog = "test", .opts = opts, .n_opts = 5, .config_file = config, .max_args = max_args};
    r->args = args;
    return td_opts_parse(&spec, argc, (char **)argv, r);
}

Test(td_opts, every_type_both_spellings_and_defaults)
{
    vals_t x = {.n = 7, .f = 1.0f, .s = "dflt"};
    td_opts_result_t r = {0};
    const char *argv[] = {"tandem", "--count", "42", "--ratio=1.5", "--json", "--even", "ab", NULL};
    cr_assert_eq(parse(&x, false, NULL, 0, &r, argv), TD_OK, "%s", td_last_error());
    cr_assert_eq(x.n, 42);
    cr_assert_float_eq(x.f, 1.5f, 0);
    cr_assert_str_eq(x.s, "dflt", "a flag not given keeps its default");
    cr_assert(x.b);
    cr_assert_eq(x.fn_calls, 1);
    cr_assert(!r.help);
    td_opts_result_free(&r);
}

Test(td_opts, errors_name_the_flag_and_what_is_allowed)
{
    static const struct {
        const char *const argv[4];
        const char *says;
    } cases[] = {
        {{"tandem", "--count", "0"}, "--count: 0 is out of range [1, 100]"},
        {{"tandem", "--count", "12abc"}, "--count: '12abc' is not an integer"},
        {{"tandem", "--ratio", "3"}, "--ratio: 3 is out of range [0.5, 2]"},
        {{"tandem", "--ratio", "nan"}, "--ratio: 'nan' is not a number"},
        {{"tandem", "--json=1"}, "--json takes no value"},
        {{"tandem", "--count"}, "--count needs a value"},
        {{"tandem", "--bogus", "1"}, "unknown option '--bogus'"},
        {{"tandem", "--coun", "1"}, "unknown option '--coun'"},
        {{"tandem", "-x"}, "unknown option '-x'"},
        {{"tandem", "stray"}, "unexpected argument 'stray'"},
        {{"tandem", "--even", "abc"}, "--even: 'abc' has an odd length"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        vals_t x = {0};
        td_opts_result_t r = {0};
        cr_assert_eq(parse(&x, false, NULL, 0, &r, cases[i].argv), TD_ERR_INVALID, "%s", cases[i].says);
        cr_assert(strstr(td_last_error(), cases[i].says), "'%s' does not say '%s'", td_last_error(), cases[i].says);
        td_opts_result_free(&r);
    }
}

Test(td_opts, help_and_positionals_and_given)
{
    vals_t x = {0};
    td_opts_result_t r = {0};
    const char *help[] = {"tandem", "--count", "bad", "-h", NULL};
    cr_assert_eq(parse(&x, false, NULL, 0, &r, help), TD_OK, "--help wins over everything else");
    cr_assert(r.help);

    char *args[2];
    int given[5] = {0};
    r = (td_opts_result_t){.given = given};
    const char *pos[] = {"tandem", "one", "--count", "3", "two", NULL};
    cr_assert_eq(parse(&x, false, args, 2, &r, pos), TD_OK, "%s", td_last_error());
    cr_assert_eq(r.n_args, 2);
    cr_assert_str_eq(args[0], "one");
    cr_assert_str_eq(args[1], "two");
    cr_assert_eq(given[0], 2, "--count was argv[2]");
    cr_assert_eq(given[2], 0, "--name was not given");
}

/* argparse's nargs='+' (vLLM's --goodput ttft:500 tpot:50): each following argument up to the
 * next flag goes to parse; --name=VALUE takes one. */
Test(td_opts, multi_takes_each_following_value)
{
    vals_t x = {0};
    const td_opt_t opts[] = {
        {.name = "even", .type = TD_OPT_FN, .ptr = &x, .parse = parse_even, .multi = true, .help = "even text"},
        TD_OPT_INT("count", &x.n, 1, 100, "a count"),
    };
    td_opts_t spec = {.prog = "test", .opts = opts, .n_opts = 2};
    td_opts_result_t r = {0};
    char *argv[] = {"tandem", "--even", "ab", "cdef", "gh", "--count", "3", "--even=ij", NULL};
    cr_assert_eq(td_opts_parse(&spec, 8, argv, &r), TD_OK, "%s", td_last_error());
    cr_assert_eq(x.fn_calls, 4, "ab, cdef, gh, ij");
    cr_assert_eq(x.n, 3);
    char *bad[] = {"tandem", "--even", "ab", "cde", NULL};
    cr_assert_eq(td_opts_parse(&spec, 4, bad, &r), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), "--even: 'cde' has an odd length"), "%s", td_last_error());
}

Test(td_opts, config_file_then_flags_win)
{
    char path[] = "/tmp/test_opts_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fprintf(f, "# a comment\n\ncount = 5\nname = from-file  \njson = true\nratio=0.75\n");
    fclose(f);
    vals_t x = {0};
    td_opts_result_t r = {0};
    const char *argv[] = {"tandem", "--count", "9", "--config", path, NULL};
    cr_assert_eq(parse(&x, true, NULL, 0, &r, argv), TD_OK, "%s", td_last_error());
    cr_assert_eq(x.n, 9, "the flag wins over the file although it came first");
    cr_assert_str_eq(x.s, "from-file");
    cr_assert(x.b);
    cr_assert_float_eq(x.f, 0.75f, 0);
    td_opts_result_free(&r);

    f = fopen(path, "w");
    fprintf(f, "count = 5\nnope = 1\n");
    fclose(f);
    cr_assert_eq(parse(&x, true, NULL, 0, &r, argv), TD_ERR_INVALID);
    cr_assert(strstr(td_last_error(), ":2: unknown key 'nope'"), "%s", td_last_error());
    td_opts_result_free(&r);
    const char *no_file[] = {"tandem", "--config", path, NULL};
    cr_assert_eq(parse(&x, false, NULL, 0, &r, no_file), TD_ERR_INVALID, "--config only where the spec takes it");
    td_opts_result_free(&r);
    remove(path);
}

Test(td_opts, usage_lists_every_flag_with_defaults)
{
    vals_t x = {.n = 7, .s = "dflt"};
    td_opts_result_t r = {0};
    const char *argv[] = {"tandem", NULL};
    cr_assert_eq(parse(&x, false, NULL, 0, &r, argv), TD_OK);
    td_opt_t opts[] = {TD_OPT_INT("count", &x.n, 1, 100, "a count\nsecond line"),
                       {.name = "name", .type = TD_OPT_STR, .ptr = &x.s, .arg = "TEXT", .help = "a name"}};
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    td_opts_usage(f, opts, 2, true);
    fclose(f);
    cr_assert(strstr(buf, "  --count      a count\n               second line (default 7)\n"), "%s", buf);
    cr_assert(strstr(buf, "  --name TEXT  a name (default dflt)\n"), "%s", buf);
    free(buf);
}
