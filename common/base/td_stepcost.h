/*
 * td_stepcost: a node's step time as a function of what the step carries, fitted from the
 * steps it ran (conditional disaggregation, docs/scheduling.md): a decode or unified node
 * prefilling a prompt itself feeds it in chunks beside its running streams, and the chunk a
 * step may carry is the one that keeps the step within the streams' TPOT objective. The node
 * sizes it every step from this fit, and reports the fit's prefill rate to the router, which
 * prices a local prefill with it (td_place).
 *
 *     step_s = fixed + per_seq * B + per_context * C + per_prefill * P
 *
 * B: the step's one-row items (its decoding sequences), C: the context tokens the step's
 * sequences held before it (what their attention reads), P: prompt tokens the step fed in
 * chunks. Least squares (td_lsq) over the last TD_STEPCOST_WINDOW steps with prompt tokens and
 * the last TD_STEPCOST_WINDOW without, kept apart so that a long run of decode-only steps
 * does not push the steps that measured P out of the window. It replaced a ratio of two
 * moving means (chunk tokens over the step less the decode-only pace), whose small difference
 * of two noisy figures sized chunks several times too large after a quiet minute
 * (docs/goodput.md, issue 37).
 *
 * Pure: time is passed in, no allocation, no I/O; one thread at a time per td_stepcost_t.
 */
#ifndef TD_STEPCOST_H
#define TD_STEPCOST_H

#include <stdbool.h>
#include <stdint.h>

#define TD_STEPCOST_WINDOW 64     /* steps of each kind (with, without prompt tokens) fitted */
#define TD_STEPCOST_MIN_PREFILL 4 /* steps with prompt tokens before a fit is made */

typedef struct td_stepcost_sample {
    double seqs, context, prefill, s;
} td_stepcost_sample_t;

typedef struct td_stepcost {
    td_stepcost_sample_t ring[2][TD_STEPCOST_WINDOW]; /* [0] without prompt tokens, [1] with */
    int32_t n[2], next[2];
} td_stepcost_t;

typedef struct td_stepcost_fit {
    bool valid;          /* false: fewer than TD_STEPCOST_MIN_PREFILL steps with prompt tokens,
                            or their times do not determine a positive per_prefill_s */
    double fixed_s, per_seq_s, per_context_s, per_prefill_s; /* the model above */
    double spread_s;     /* the residuals' root mean square over the steps with prompt tokens:
                            how far such a step's time strays from the model */
} td_stepcost_fit_t;

void td_stepcost_init(td_stepcost_t *c);

/* One step's figures (seconds > 0; others >= 0; anything else is ignored). */
void td_stepcost_note(td_stepcost_t *c, int32_t seqs, int64_t context, int32_t prefill_tokens, double s);

/*
 * The fit over the window: the four coefficients, or, where the steps leave some undetermined
 * (every step the same batch, or the same context), the fewer that are (B and C dropped in
 * turn: fixed + per_seq B + per_prefill P, then fixed + per_prefill P). Valid only with
 * per_prefill_s > 0.
 */
td_stepcost_fit_t td_stepcost_fit(const td_stepcost_t *c);

/* A step's predicted seconds (never below 0). */
double td_stepcost_predict(const td_stepcost_fit_t *f, int32_t seqs, int64_t context, int64_t prefill_tokens);

/* The prompt tokens a step under a TPOT objective feeds while there is no valid fit: `probe`
 * (TD_DECODE_PROBE_CHUNK), and where TD_STEPCOST_MIN_PREFILL steps with prompt tokens gave none
 * (every one the same probe and no decode-only step: the intercept and the prompt column
 * collinear, a node that met a queue before its first decode-only step), half of it every
 * other step, so that the prompt column varies and the next steps fit. */
int64_t td_stepcost_probe(const td_stepcost_t *c, int64_t probe);

/* The most prompt tokens a step of `seqs` decoding sequences holding `context` tokens may
 * carry within objective_s (seconds > 0), less the fit's spread: a step sized to the objective
 * itself passes it about half the time, and a stream's TPOT with it (the first sweep of this fit
 * measured TPOT p90 at the objective: docs/goodput.md). 0 when the decodes alone reach that;
 * -1 when the fit is not valid. */
int64_t td_stepcost_chunk(const td_stepcost_fit_t *f, int32_t seqs, int64_t context, double objective_s);

#endif /* TD_STEPCOST_H */
