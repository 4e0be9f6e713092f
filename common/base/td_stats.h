/*
 * td_stats: the one sort of samples and the one percentile of the tree (the planner's
 * simulator, `tandem plan`, the benchmarks).
 *
 * Percentiles interpolate linearly between the two nearest ranks, as numpy.percentile's
 * default does, so a figure printed here can be checked against numpy on the same samples;
 * the median is the middle sample, or the mean of the middle two. A benchmark that reports
 * another rule (a nearest rank) says so where it reads the sorted samples.
 *
 * Pure functions over caller-owned arrays: no allocation, no errors, any thread.
 */
#ifndef TD_STATS_H
#define TD_STATS_H

#include <stddef.h>

/* Sorts v[0..n) ascending in place. */
void td_stats_sort(double *v, size_t n);

/* numpy's linear-interpolation percentile of sorted[0..n), q in [0, 100]; NAN when n == 0. */
double td_stats_percentile(const double *sorted, size_t n, double q);

/* The median of sorted[0..n): the middle value, or the mean of the two middle ones; NAN
 * when n == 0. */
double td_stats_median(const double *sorted, size_t n);

#endif /* TD_STATS_H */
