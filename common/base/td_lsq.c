/*
 * td_lsq: least squares by the normal equations (see td_lsq.h).
 */
#include "td_lsq.h"

#include <math.h>

bool td_lsq_fit(const double *x, const double *y, size_t n, int k, double *coef)
{
    if (k < 1 || k > TD_LSQ_MAX_K || n < (size_t)k)
        return false;
    double scale[TD_LSQ_MAX_K] = {0};
    for (size_t r = 0; r < n; r++)
        for (int i = 0; i < k; i++)
            scale[i] += x[r * k + i] * x[r * k + i];
    for (int i = 0; i < k; i++) {
        if (!(scale[i] > 0) || !isfinite(scale[i]))
            return false;
        scale[i] = 1 / sqrt(scale[i]);
    }
    double a[TD_LSQ_MAX_K][TD_LSQ_MAX_K + 1] = {{0}};
    for (size_t r = 0; r < n; r++)
        for (int i = 0; i < k; i++) {
            double xi = x[r * k + i] * scale[i];
            for (int j = 0; j < k; j++)
                a[i][j] += xi * x[r * k + j] * scale[j];
            a[i][k] += xi * y[r];
        }
    for (int i = 0; i < k; i++) { /* Gauss-Jordan with partial pivoting; the diagonal starts at 1 */
        int piv = i;
        for (int j = i + 1; j < k; j++)
            if (fabs(a[j][i]) > fabs(a[piv][i]))
                piv = j;
        if (fabs(a[piv][i]) < 1e-9)
            return false;
        for (int j = 0; j <= k; j++) {
            double t = a[i][j];
            a[i][j] = a[piv][j];
            a[piv][j] = t;
        }
        for (int r = 0; r < k; r++) {
            if (r == i)
                continue;
            double f = a[r][i] / a[i][i];
            for (int j = i; j <= k; j++)
                a[r][j] -= f * a[i][j];
        }
    }
    double c[TD_LSQ_MAX_K];
    for (int i = 0; i < k; i++) {
        c[i] = a[i][k] / a[i][i] * scale[i];
        if (!isfinite(c[i]))
            return false;
    }
    for (int i = 0; i < k; i++)
        coef[i] = c[i];
    return true;
}
