/*
 * test_stats: td_stats, the one sort and percentile of samples. Percentiles equal
 * numpy.percentile's (linear interpolation) at the ends, between ranks and on one sample,
 * and are NAN on none; the median is the middle sample or the mean of the middle two; the
 * sort is ascending and keeps every sample.
 */
#include <criterion/criterion.h>
#include <math.h>

#include "td_stats.h"

Test(stats, percentiles_are_numpys)
{
    double v[] = {1, 2, 3, 4};
    cr_assert_float_eq(td_stats_percentile(v, 4, 50), 2.5, 1e-12);
    cr_assert_float_eq(td_stats_percentile(v, 4, 90), 3.7, 1e-12);
    cr_assert_float_eq(td_stats_percentile(v, 4, 99), 3.97, 1e-12);
    cr_assert_float_eq(td_stats_percentile(v, 4, 0), 1, 1e-12);
    cr_assert_float_eq(td_stats_percentile(v, 4, 100), 4, 1e-12);
    cr_assert_float_eq(td_stats_percentile(v, 1, 99), 1, 1e-12);
    cr_assert(isnan(td_stats_percentile(v, 0, 50)));
    double w[] = {2, 4, 4, 4, 5, 5, 7, 9};
    cr_assert_float_eq(td_stats_percentile(w, 8, 90), 7.6, 1e-12); /* numpy.percentile(w, 90) */
    cr_assert_float_eq(td_stats_percentile(w, 8, 25), 4, 1e-12);
}

Test(stats, median_is_the_middle_or_the_mean_of_the_middle_two)
{
    double odd[] = {1, 3, 10}, even[] = {1, 3, 10, 20};
    cr_assert_eq(td_stats_median(odd, 3), 3);
    cr_assert_eq(td_stats_median(even, 4), 6.5);
    cr_assert_eq(td_stats_median(odd, 1), 1);
    cr_assert(isnan(td_stats_median(odd, 0)));
}

Test(stats, sort_is_ascending_and_keeps_every_sample)
{
    double v[] = {3, -1, 2.5, 3, -7, 0, 1e9, -0.5};
    double want[] = {-7, -1, -0.5, 0, 2.5, 3, 3, 1e9};
    td_stats_sort(v, 8);
    for (int i = 0; i < 8; i++)
        cr_assert_eq(v[i], want[i], "v[%d] = %g, want %g", i, v[i], want[i]);
    td_stats_sort(v, 0); /* nothing to sort: a no-op */
    cr_assert_eq(v[0], -7);
}
