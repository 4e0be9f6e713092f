/*
 * td_stats: sorting samples, percentiles and the median (td_stats.h).
 */
#include "td_stats.h"

#include <math.h>
#include <stdlib.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void td_stats_sort(double *v, size_t n)
{
    if (n)
        qsort(v, n, sizeof *v, cmp_double);
}

double td_stats_percentile(const double *sorted, size_t n, double q)
{
    if (n == 0)
        return NAN;
    double pos = q / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(pos), hi = lo + 1 < n ? lo + 1 : lo;
    return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - (double)lo);
}

double td_stats_median(const double *sorted, size_t n)
{
    if (n == 0)
        return NAN;
    return n % 2 ? sorted[n / 2] : 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]);
}
