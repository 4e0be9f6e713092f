/*
 * td_place: conditional disaggregation's estimates and choice (see td_place.h). The router's
 * rule 5 (router_policy.h) states them in words; this is the one place they are computed.
 */
#include "td_place.h"

#include <math.h>

#include "td_util.h"

double td_place_local_rate(double measured_tok_s, double partner_tok_s, double assumed_tok_s)
{
    double rate = measured_tok_s > 0 ? measured_tok_s : 0.5 * (partner_tok_s > 0 ? partner_tok_s : assumed_tok_s);
    return TD_MAX(rate, 1e-3);
}

td_place_fit_t td_place_local_estimate(const td_place_local_t *l, td_place_estimate_t *e_p)
{
    int64_t work = TD_MAX(l->queued_tokens, 0) + TD_MAX(l->new_tokens, 1);
    int64_t chunk = l->max_step_tokens > 0 ? TD_MIN(work, l->max_step_tokens - l->running) : work;
    if (chunk <= 0)
        return TD_PLACE_NO_STEP_ROOM;
    double rate = TD_MAX(l->prefill_tok_s, 1e-3);
    if (l->tpot_objective_s > 0) { /* the time a step may add to the streams' pace */
        double fit = floor((l->tpot_objective_s - TD_MAX(l->spread_s, 0.0) - l->step_s) * rate);
        if (fit < 1) {
            if (l->floor_tokens <= 0)
                return TD_PLACE_NO_TPOT_ROOM;
            fit = (double)l->floor_tokens;
        }
        chunk = fit < (double)chunk ? (int64_t)fit : chunk;
    }
    double step_s = l->step_s + (double)chunk / rate;
    *e_p = (td_place_estimate_t){.chunk = chunk, .step_s = step_s,
                                 .local_s = (double)TD_DIV_CEIL(work, chunk) * step_s};
    return TD_PLACE_FITS;
}

bool td_place_local_wins(double local_s, double remote_s, double ttft_objective_s)
{
    return local_s < remote_s && (ttft_objective_s <= 0 || remote_s > ttft_objective_s);
}

bool td_place_peer_wins(double peer_s, double chosen_s, bool chosen_remote, double ttft_objective_s)
{
    if (peer_s < 0)
        return false;
    if (chosen_s < 0)
        return true;
    if (chosen_remote && ttft_objective_s > 0 && chosen_s <= ttft_objective_s)
        return false;
    return peer_s < chosen_s;
}

double td_place_remote_estimate(double wait_s, double kv_bytes, double xfer_fixed_s, double xfer_bytes_per_s)
{
    return wait_s + xfer_fixed_s + kv_bytes / TD_MAX(xfer_bytes_per_s, 1.0);
}

double td_place_peer_estimate(const td_place_local_t *l, double kv_bytes, double xfer_fixed_s, double xfer_bytes_per_s,
                              double *wait_s_p)
{
    td_place_estimate_t e;
    if (td_place_local_estimate(l, &e) != TD_PLACE_FITS)
        return -1;
    *wait_s_p = e.local_s;
    return td_place_remote_estimate(e.local_s, kv_bytes, xfer_fixed_s, xfer_bytes_per_s);
}
