/*
 * td_metrics: the registry behind td_metrics.h.
 *
 * Families live in a singly linked list in registration order under the registry lock;
 * each family's series live in a list in creation order under the family lock. Counter
 * and gauge values are doubles stored as bit patterns in 64-bit atomics (add is a CAS
 * loop), so compute threads never take a lock to count. A histogram series holds its
 * bucket counts and sum under its own mutex so a render sees a consistent snapshot of
 * one series. Rendering formats numbers with the shortest round-tripping %g precision.
 */
#include "td_metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_list.h"
#include "td_util.h"

const double td_metrics_latency_buckets[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                             0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                             1,      2.5,     5,      10,    30,     60};
const size_t td_metrics_latency_n_buckets = TD_ARRAY_LEN(td_metrics_latency_buckets);

struct td_metric {
    td_list_t link;                      /* in fam->series */
    td_metric_family_t *fam;
    char **label_values;                 /* [fam->n_labels] */
    _Atomic uint64_t bits;               /* counter/gauge value as a double's bits */
    pthread_mutex_t lock;                /* histogram only */
    unsigned long long *bucket_counts;   /* [fam->n_buckets + 1], not cumulative; last = +Inf */
    unsigned long long count;
    double sum;
};

struct td_metric_family {
    td_list_t link;                      /* in the registry's families */
    td_metric_type_t type;
    char *name;
    char *help;
    size_t n_labels;
    char *label_names[TD_METRICS_MAX_LABELS];
    size_t n_buckets;
    double buckets[TD_METRICS_MAX_BUCKETS];
    pthread_mutex_t lock;                /* guards the series list */
    td_list_t series;                    /* td_metric_t, in creation order */
    size_t n_series;                     /* at most TD_METRICS_MAX_SERIES */
    bool capped;                         /* the cap was hit once (said once) */
};

typedef struct metrics_collector {
    td_metrics_collect_cb fn;
    void *arg;
} metrics_collector_t;

struct td_metrics {
    pthread_mutex_t lock;                /* guards the family list and the collectors */
    td_list_t families;                  /* td_metric_family_t, in registration order */
    metrics_collector_t collectors[TD_METRICS_MAX_COLLECTORS];
    int n_collectors;
};

static uint64_t dbits(double v)
{
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}

static double bitsd(uint64_t b)
{
    double v;
    memcpy(&v, &b, sizeof v);
    return v;
}

td_status_t td_metrics_create(td_metrics_t **reg_p)
{
    td_metrics_t *reg = calloc(1, sizeof *reg);
    if (!reg)
        return td_errorf(TD_ERR_NOMEM, "metrics: out of memory creating the registry");
    pthread_mutex_init(&reg->lock, NULL);
    td_list_init(&reg->families);
    *reg_p = reg;
    return TD_OK;
}

static void metric_free(td_metric_t *m, size_t n_labels)
{
    if (!m)
        return;
    if (m->label_values)
        for (size_t i = 0; i < n_labels; i++)
            free(m->label_values[i]);
    free(m->label_values);
    free(m->bucket_counts);
    pthread_mutex_destroy(&m->lock);
    free(m);
}

static void family_free(td_metric_family_t *f)
{
    if (!f)
        return;
    TD_LIST_FOREACH_SAFE(n, &f->series)
        metric_free(TD_CONTAINER_OF(n, td_metric_t, link), f->n_labels);
    for (size_t i = 0; i < f->n_labels; i++)
        free(f->label_names[i]);
    free(f->name);
    free(f->help);
    pthread_mutex_destroy(&f->lock);
    free(f);
}

void td_metrics_destroy(td_metrics_t *reg)
{
    if (!reg)
        return;
    TD_LIST_FOREACH_SAFE(n, &reg->families)
        family_free(TD_CONTAINER_OF(n, td_metric_family_t, link));
    pthread_mutex_destroy(&reg->lock);
    free(reg);
}

static bool valid_name(const char *s, bool colon_ok)
{
    if (!s || !*s)
        return false;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                  (colon_ok && c == ':') || (i > 0 && c >= '0' && c <= '9');
        if (!ok)
            return false;
    }
    return true;
}

static bool same_shape(const td_metric_family_t *f, td_metric_type_t type,
                       const char *const *label_names, size_t n_labels, const double *buckets,
                       size_t n_buckets)
{
    if (f->type != type || f->n_labels != n_labels || f->n_buckets != n_buckets)
        return false;
    for (size_t i = 0; i < n_labels; i++)
        if (strcmp(f->label_names[i], label_names[i]) != 0)
            return false;
    for (size_t i = 0; i < n_buckets; i++)
        if (f->buckets[i] != buckets[i])
            return false;
    return true;
}

td_status_t td_metrics_register(td_metrics_t *reg, td_metric_type_t type, const char *name,
                                const char *help, const char *const *label_names,
                                size_t n_labels, const double *buckets, size_t n_buckets,
                                td_metric_family_t **fam_p)
{
    if (!valid_name(name, true))
        return td_errorf(TD_ERR_INVALID, "metrics: invalid metric name \"%s\"", name ? name : "(null)");
    if (type != TD_METRIC_COUNTER && type != TD_METRIC_GAUGE && type != TD_METRIC_HISTOGRAM)
        return td_errorf(TD_ERR_INVALID, "metrics: %s: unknown metric type %d", name, (int)type);
    if (n_labels > TD_METRICS_MAX_LABELS || (n_labels && !label_names))
        return td_errorf(TD_ERR_INVALID, "metrics: %s: at most %d labels", name, TD_METRICS_MAX_LABELS);
    for (size_t i = 0; i < n_labels; i++) {
        const char *l = label_names[i];
        if (!valid_name(l, false) || strncmp(l, "__", 2) == 0 ||
            (type == TD_METRIC_HISTOGRAM && strcmp(l, "le") == 0))
            return td_errorf(TD_ERR_INVALID, "metrics: %s: invalid label name \"%s\"", name,
                             l ? l : "(null)");
        for (size_t j = 0; j < i; j++)
            if (strcmp(label_names[j], l) == 0)
                return td_errorf(TD_ERR_INVALID, "metrics: %s: label \"%s\" given twice", name, l);
    }
    if (type == TD_METRIC_HISTOGRAM) {
        if (n_buckets == 0 || n_buckets > TD_METRICS_MAX_BUCKETS || !buckets)
            return td_errorf(TD_ERR_INVALID, "metrics: %s: a histogram needs 1..%d buckets", name,
                             TD_METRICS_MAX_BUCKETS);
        for (size_t i = 0; i < n_buckets; i++)
            if (!isfinite(buckets[i]) || (i > 0 && buckets[i] <= buckets[i - 1]))
                return td_errorf(TD_ERR_INVALID,
                                 "metrics: %s: bucket bounds must be finite and strictly increasing",
                                 name);
    } else if (n_buckets) {
        return td_errorf(TD_ERR_INVALID, "metrics: %s: only histograms have buckets", name);
    }

    td_status_t st = TD_OK;
    pthread_mutex_lock(&reg->lock);
    TD_LIST_FOREACH(n, &reg->families) {
        td_metric_family_t *f = TD_CONTAINER_OF(n, td_metric_family_t, link);
        if (strcmp(f->name, name) != 0)
            continue;
        if (same_shape(f, type, label_names, n_labels, buckets, n_buckets))
            *fam_p = f;
        else
            st = td_errorf(TD_ERR_INVALID,
                           "metrics: %s already registered with another type, labels or buckets", name);
        goto out_unlock;
    }
    td_metric_family_t *f = calloc(1, sizeof *f);
    if (!f)
        goto err_nomem;
    pthread_mutex_init(&f->lock, NULL);
    td_list_init(&f->link);
    td_list_init(&f->series);
    f->type = type;
    f->name = strdup(name);
    f->help = strdup(help ? help : "");
    if (!f->name || !f->help)
        goto err_family;
    for (size_t i = 0; i < n_labels; i++) {
        if (!(f->label_names[i] = strdup(label_names[i])))
            goto err_family;
        f->n_labels = i + 1;
    }
    f->n_labels = n_labels;
    f->n_buckets = n_buckets;
    for (size_t i = 0; i < n_buckets; i++)
        f->buckets[i] = buckets[i];
    td_list_push_back(&reg->families, &f->link);
    *fam_p = f;
    goto out_unlock;

err_family:
    family_free(f);
err_nomem:
    st = td_errorf(TD_ERR_NOMEM, "metrics: out of memory registering %s", name);
out_unlock:
    pthread_mutex_unlock(&reg->lock);
    return st;
}

/* The series of fam with these label values, or NULL (fam->lock held). */
static td_metric_t *series_find(td_metric_family_t *fam, const char *const *label_values)
{
    TD_LIST_FOREACH(n, &fam->series) {
        td_metric_t *m = TD_CONTAINER_OF(n, td_metric_t, link);
        size_t i = 0;
        while (i < fam->n_labels && strcmp(m->label_values[i], label_values[i]) == 0)
            i++;
        if (i == fam->n_labels)
            return m;
    }
    return NULL;
}

td_status_t td_metric_family_get(td_metric_family_t *fam, const char *const *label_values,
                                 td_metric_t **m_p)
{
    for (size_t i = 0; i < fam->n_labels; i++)
        if (!label_values || !label_values[i])
            return td_errorf(TD_ERR_INVALID, "metrics: %s: label value %zu is NULL", fam->name, i);

    td_status_t st = TD_OK;
    pthread_mutex_lock(&fam->lock);
    if ((*m_p = series_find(fam, label_values)))
        goto out_unlock;
    if (fam->n_series >= TD_METRICS_MAX_SERIES) {
        st = fam->capped ? td_errorf_quiet(TD_ERR_EXHAUSTED, "metrics: %s has %d series", fam->name,
                                           TD_METRICS_MAX_SERIES)
                         : td_errorf(TD_ERR_EXHAUSTED, "metrics: %s has %d series, its cap: no more are made (a "
                                     "label takes unbounded values?)", fam->name, TD_METRICS_MAX_SERIES);
        fam->capped = true;
        goto out_unlock;
    }
    td_metric_t *m = calloc(1, sizeof *m);
    if (!m)
        goto err_nomem;
    pthread_mutex_init(&m->lock, NULL);
    m->fam = fam;
    atomic_init(&m->bits, dbits(0.0));
    m->label_values = calloc(fam->n_labels ? fam->n_labels : 1, sizeof *m->label_values);
    if (!m->label_values)
        goto err_metric;
    for (size_t i = 0; i < fam->n_labels; i++)
        if (!(m->label_values[i] = strdup(label_values[i])))
            goto err_metric;
    if (fam->type == TD_METRIC_HISTOGRAM &&
        !(m->bucket_counts = calloc(fam->n_buckets + 1, sizeof *m->bucket_counts)))
        goto err_metric;
    td_list_push_back(&fam->series, &m->link);
    fam->n_series++;
    *m_p = m;
    goto out_unlock;

err_metric:
    metric_free(m, fam->n_labels);
err_nomem:
    st = td_errorf(TD_ERR_NOMEM, "metrics: out of memory adding a series to %s", fam->name);
out_unlock:
    pthread_mutex_unlock(&fam->lock);
    return st;
}

void td_metric_family_remove(td_metric_family_t *fam, const char *const *label_values)
{
    for (size_t i = 0; i < fam->n_labels; i++)
        if (!label_values || !label_values[i])
            return;
    pthread_mutex_lock(&fam->lock);
    td_metric_t *m = series_find(fam, label_values);
    if (m) {
        td_list_remove(&m->link);
        fam->n_series--;
        metric_free(m, fam->n_labels);
    }
    pthread_mutex_unlock(&fam->lock);
}

td_status_t td_metrics_register_all(td_metrics_t *reg, const td_metric_def_t *defs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const td_metric_def_t *d = &defs[i];
        td_metric_family_t *fam;
        td_status_t st = td_metrics_register(reg, d->type, d->name, d->help, NULL, 0, d->buckets, d->n_buckets, &fam);
        if (st == TD_OK)
            st = td_metric_family_get(fam, NULL, d->m_p);
        if (st != TD_OK)
            return st;
    }
    return TD_OK;
}

td_status_t td_metrics_counter_each(td_metrics_t *reg, const char *name, const char *help, const char *label,
                                    const char *const *values, size_t n, td_metric_t **series)
{
    td_metric_family_t *fam;
    td_status_t st = td_metrics_register(reg, TD_METRIC_COUNTER, name, help, &label, 1, NULL, 0, &fam);
    for (size_t i = 0; st == TD_OK && i < n; i++)
        st = td_metric_family_get(fam, &values[i], &series[i]);
    return st;
}

void td_metric_add(td_metric_t *m, double v)
{
    TD_ASSERT(m->fam->type != TD_METRIC_HISTOGRAM);
    if (m->fam->type == TD_METRIC_COUNTER && !(v >= 0))
        return;
    uint64_t old = atomic_load_explicit(&m->bits, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(&m->bits, &old, dbits(bitsd(old) + v),
                                                  memory_order_relaxed, memory_order_relaxed))
        ;
}

void td_metric_inc(td_metric_t *m)
{
    td_metric_add(m, 1.0);
}

void td_metric_set(td_metric_t *m, double v)
{
    TD_ASSERT(m->fam->type == TD_METRIC_GAUGE);
    atomic_store_explicit(&m->bits, dbits(v), memory_order_relaxed);
}

double td_metric_value(const td_metric_t *m)
{
    return bitsd(atomic_load_explicit(&((td_metric_t *)m)->bits, memory_order_relaxed));
}

void td_metric_observe(td_metric_t *m, double v)
{
    td_metric_family_t *f = m->fam;
    TD_ASSERT(f->type == TD_METRIC_HISTOGRAM);
    if (isnan(v))
        return;
    size_t b = 0;
    while (b < f->n_buckets && v > f->buckets[b])
        b++;
    pthread_mutex_lock(&m->lock);
    m->bucket_counts[b]++;
    m->count++;
    m->sum += v;
    pthread_mutex_unlock(&m->lock);
}

void td_metric_histogram_read(td_metric_t *m, unsigned long long *count_p, double *sum_p)
{
    TD_ASSERT(m->fam->type == TD_METRIC_HISTOGRAM);
    pthread_mutex_lock(&m->lock);
    *count_p = m->count;
    *sum_p = m->sum;
    pthread_mutex_unlock(&m->lock);
}

/* ---- rendering ---------------------------------------------------------------------- */

typedef struct out {
    char *buf;
    size_t len, cap;
    bool failed;
} out_t;

static void out_reserve(out_t *o, size_t more)
{
    if (o->failed || o->len + more + 1 <= o->cap)
        return;
    size_t cap = o->cap ? o->cap : 4096;
    while (cap < o->len + more + 1)
        cap *= 2;
    char *b = realloc(o->buf, cap);
    if (!b) {
        o->failed = true;
        return;
    }
    o->buf = b;
    o->cap = cap;
}

static void out_mem(out_t *o, const char *s, size_t n)
{
    out_reserve(o, n);
    if (o->failed)
        return;
    memcpy(o->buf + o->len, s, n);
    o->len += n;
    o->buf[o->len] = '\0';
}

static void out_str(out_t *o, const char *s)
{
    out_mem(o, s, strlen(s));
}

/* HELP text escapes \ and newline; label values also escape the double quote. */
static void out_escaped(out_t *o, const char *s, bool quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            out_str(o, "\\\\");
        else if (*s == '\n')
            out_str(o, "\\n");
        else if (quote && *s == '"')
            out_str(o, "\\\"");
        else
            out_mem(o, s, 1);
    }
}

static void out_num(out_t *o, double v)
{
    char tmp[40];
    if (isnan(v)) {
        out_str(o, "NaN");
        return;
    }
    if (isinf(v)) {
        out_str(o, v > 0 ? "+Inf" : "-Inf");
        return;
    }
    snprintf(tmp, sizeof tmp, "%.15g", v);
    if (strtod(tmp, NULL) != v)
        snprintf(tmp, sizeof tmp, "%.17g", v);
    out_str(o, tmp);
}

static void out_ull(out_t *o, unsigned long long v)
{
    char tmp[24];
    snprintf(tmp, sizeof tmp, "%llu", v);
    out_str(o, tmp);
}

/* name{a="x",b="y"[,le="..."]} */
static void out_series_name(out_t *o, const td_metric_family_t *f, const td_metric_t *m,
                            const char *suffix, const char *le)
{
    out_str(o, f->name);
    out_str(o, suffix);
    if (f->n_labels == 0 && !le)
        return;
    out_str(o, "{");
    for (size_t i = 0; i < f->n_labels; i++) {
        if (i)
            out_str(o, ",");
        out_str(o, f->label_names[i]);
        out_str(o, "=\"");
        out_escaped(o, m->label_values[i], true);
        out_str(o, "\"");
    }
    if (le) {
        if (f->n_labels)
            out_str(o, ",");
        out_str(o, "le=\"");
        out_str(o, le);
        out_str(o, "\"");
    }
    out_str(o, "}");
}

static void render_histogram(out_t *o, const td_metric_family_t *f, td_metric_t *m)
{
    unsigned long long counts[TD_METRICS_MAX_BUCKETS + 1], count;
    double sum;
    pthread_mutex_lock(&m->lock);
    memcpy(counts, m->bucket_counts, (f->n_buckets + 1) * sizeof counts[0]);
    count = m->count;
    sum = m->sum;
    pthread_mutex_unlock(&m->lock);

    unsigned long long cum = 0;
    for (size_t b = 0; b <= f->n_buckets; b++) {
        char le[40];
        cum += counts[b];
        if (b < f->n_buckets) {
            out_t tmp = {0};
            out_num(&tmp, f->buckets[b]);
            snprintf(le, sizeof le, "%s", tmp.failed || !tmp.buf ? "0" : tmp.buf);
            free(tmp.buf);
        } else {
            snprintf(le, sizeof le, "+Inf");
        }
        out_series_name(o, f, m, "_bucket", le);
        out_str(o, " ");
        out_ull(o, cum);
        out_str(o, "\n");
    }
    out_series_name(o, f, m, "_sum", NULL);
    out_str(o, " ");
    out_num(o, sum);
    out_str(o, "\n");
    out_series_name(o, f, m, "_count", NULL);
    out_str(o, " ");
    out_ull(o, count);
    out_str(o, "\n");
}

static const char *type_name(td_metric_type_t t)
{
    switch (t) {
    case TD_METRIC_COUNTER:
        return "counter";
    case TD_METRIC_GAUGE:
        return "gauge";
    case TD_METRIC_HISTOGRAM:
        return "histogram";
    }
    return "untyped";
}

td_status_t td_metrics_add_collector(td_metrics_t *reg, td_metrics_collect_cb fn, void *arg)
{
    if (!fn)
        return td_errorf(TD_ERR_INVALID, "metrics: a collector needs a function");
    pthread_mutex_lock(&reg->lock);
    td_status_t st = TD_OK;
    if (reg->n_collectors == TD_METRICS_MAX_COLLECTORS)
        st = td_errorf(TD_ERR_RANGE, "metrics: at most %d collectors", TD_METRICS_MAX_COLLECTORS);
    else
        reg->collectors[reg->n_collectors++] = (metrics_collector_t){.fn = fn, .arg = arg};
    pthread_mutex_unlock(&reg->lock);
    return st;
}

td_status_t td_metrics_render(td_metrics_t *reg, char **text_p, size_t *len_p)
{
    pthread_mutex_lock(&reg->lock);
    int n = reg->n_collectors;
    metrics_collector_t cs[TD_METRICS_MAX_COLLECTORS];
    memcpy(cs, reg->collectors, sizeof cs);
    pthread_mutex_unlock(&reg->lock);
    for (int i = 0; i < n; i++) /* outside the lock: a collector updates series */
        cs[i].fn(cs[i].arg);
    out_t o = {0};
    out_reserve(&o, 0);
    pthread_mutex_lock(&reg->lock);
    TD_LIST_FOREACH(fn, &reg->families) {
        td_metric_family_t *f = TD_CONTAINER_OF(fn, td_metric_family_t, link);
        out_str(&o, "# HELP ");
        out_str(&o, f->name);
        out_str(&o, " ");
        out_escaped(&o, f->help, false);
        out_str(&o, "\n# TYPE ");
        out_str(&o, f->name);
        out_str(&o, " ");
        out_str(&o, type_name(f->type));
        out_str(&o, "\n");
        pthread_mutex_lock(&f->lock);
        TD_LIST_FOREACH(mn, &f->series) {
            td_metric_t *m = TD_CONTAINER_OF(mn, td_metric_t, link);
            if (f->type == TD_METRIC_HISTOGRAM) {
                render_histogram(&o, f, m);
                continue;
            }
            out_series_name(&o, f, m, "", NULL);
            out_str(&o, " ");
            out_num(&o, td_metric_value(m));
            out_str(&o, "\n");
        }
        pthread_mutex_unlock(&f->lock);
    }
    pthread_mutex_unlock(&reg->lock);
    if (o.failed) {
        free(o.buf);
        return td_errorf(TD_ERR_NOMEM, "metrics: out of memory rendering the registry");
    }
    *text_p = o.buf;
    *len_p = o.len;
    return TD_OK;
}

/* ---- reading the text back ---------------------------------------------------------- */

/* The line after p, or NULL at the end. */
static const char *next_line(const char *p)
{
    const char *nl = strchr(p, '\n');
    return nl ? nl + 1 : NULL;
}

double td_metrics_text_value(const char *text, const char *name)
{
    size_t nl = strlen(name);
    for (const char *p = text; p && *p; p = next_line(p))
        if (!strncmp(p, name, nl) && p[nl] == ' ')
            return strtod(p + nl + 1, NULL);
    return NAN;
}

int td_metrics_text_buckets(const char *text, const char *name, double *le, double *cum, int cap)
{
    char pre[160];
    int n = 0, pl = snprintf(pre, sizeof pre, "%s_bucket{le=\"", name);
    if (pl <= 0 || (size_t)pl >= sizeof pre)
        return 0;
    for (const char *p = text; p && *p && n < cap; p = next_line(p)) {
        if (strncmp(p, pre, (size_t)pl))
            continue;
        le[n] = !strncmp(p + pl, "+Inf", 4) ? INFINITY : strtod(p + pl, NULL);
        const char *v = strstr(p, "} ");
        cum[n++] = v ? strtod(v + 2, NULL) : 0;
    }
    return n;
}
