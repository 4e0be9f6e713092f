/*
 * td_lsq: small least-squares fits (at most TD_LSQ_MAX_K coefficients), the one solver of the
 * planner's profile fits (td_plan_fit) and of a node's step-cost model (td_stepcost).
 *
 * Pure: no allocation, no I/O, no log; any thread.
 */
#ifndef TD_LSQ_H
#define TD_LSQ_H

#include <stdbool.h>
#include <stddef.h>

#define TD_LSQ_MAX_K 4

/*
 * coef[0..k) minimising |X coef - y| over n rows of X (row-major, n x k, 1 <= k <= TD_LSQ_MAX_K),
 * through the normal equations with each column scaled to unit length (so a column of
 * seconds and one of thousands of tokens pivot alike). false, coef untouched, when n < k or
 * the columns are dependent: a pivot below 1e-9 of its scaled column (a constant column
 * beside the intercept, or one all zero), or a non-finite coefficient.
 */
bool td_lsq_fit(const double *x, const double *y, size_t n, int k, double *coef);

#endif /* TD_LSQ_H */
