/*
 * td_test_main: the main() of every Criterion test executable (tests/unit/test_*.c), in
 * place of Criterion's own. It runs the tests exactly as Criterion's main does, and when
 * every test of the executable was skipped (no CUDA device, no ../shared/models, no
 * TANDEM_BIN) it exits 77, which ctest (SKIP_RETURN_CODE 77) lists as skipped instead of
 * passed. An executable with one test that ran passes or fails as before.
 *
 * Linked into each test as an object (CMakeLists.txt, td_test_main), not from the
 * td_test_support archive: nothing in a test refers to it, and a main or a report hook
 * left in an archive would not be linked.
 */
#include <criterion/criterion.h>
#include <criterion/hooks.h>
#include <stdbool.h>
#include <stdio.h>

#define TD_TEST_EXIT_SKIPPED 77

/* Set by the runner (this process) once all tests ended; Criterion gives no other way to
 * read its totals. */
static bool td_test_all_skipped;

ReportHook(POST_ALL)(struct criterion_global_stats *stats)
{
    td_test_all_skipped = stats->nb_tests > 0 && stats->tests_skipped == stats->nb_tests;
}

int main(int argc, char *argv[])
{
    struct criterion_test_set *tests = criterion_initialize();
    int rc = 0;
    if (criterion_handle_args(argc, argv, true))
        rc = !criterion_run_all_tests(tests);
    criterion_finalize(tests);
    if (rc == 0 && td_test_all_skipped) {
        printf("every test skipped: exit %d (ctest: skipped)\n", TD_TEST_EXIT_SKIPPED);
        return TD_TEST_EXIT_SKIPPED;
    }
    return rc;
}
