/*
 * test_plan_sim: the capacity planner's simulator (common/plan/td_plan.h) on cases whose
 * answer is known without it: an unloaded cluster's TTFT is one prefill step and its TPOT one
 * decode step; a prefill node of one prompt per step under Poisson arrivals is an M/D/1 queue
 * (Pollaczek-Khinchine: mean wait rho S / (2 (1 - rho))); a rate beyond capacity is not
 * sustained and the highest sustained one lies below capacity; the same seed gives the same
 * run; least squares recovers the coefficients it was made from; a decode step read from
 * streams timed through a cluster is the step while all of them generate, whatever the ramp
 * before it and however the tokens were packed into messages; a profile's speed factors slow
 * every step they are drawn for, per window, as a fixed sequence; conditional disaggregation
 * prefills a short prompt behind a long prefill queue on its decode node when its objective
 * allows, and changes nothing when it does not; under follow a plan with one decode node never
 * places on a peer (and with a prefill node is conditional's run exactly), and a peer whose steps
 * have room takes a short prompt whose own node's steps are past the objective.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

#include "td_plan.h"
#include "td_util.h"

/* a profile whose prefill step is 10 ms + 0.1 ms a token and decode step 5 ms + 1 ms a
 * sequence, no context term, no transfer, no overhead */
static td_plan_profile_t affine(void)
{
    return (td_plan_profile_t){.prefill_a_s = 0.010, .prefill_b_s = 0.0001, .decode_a_s = 0.005,
                               .decode_b_s = 0.001};
}

static int32_t in_len[1] = {100}, out_len[1] = {20};
static const td_plan_lengths_t L100x20 = {in_len, out_len, 1};

Test(plan_sim, unloaded_ttft_is_one_prefill_step_and_tpot_one_decode_step)
{
    td_plan_profile_t p = affine();
    p.xfer_a_s = 0.002;
    p.overhead_s = 0.001;
    td_plan_cluster_t c = td_plan_cluster_default();
    td_plan_request_t reqs[5];
    for (int i = 0; i < 5; i++) /* 10 s apart: never two at once */
        reqs[i] = (td_plan_request_t){.arrival_s = 10.0 * i, .input_len = 100, .output_len = 20};
    td_plan_slo_t slo = {.ttft_s = 0.0215, .tpot_s = 0.0062};
    td_plan_result_t r;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 5, &slo, &r), TD_OK);
    cr_assert_float_eq(r.ttft_p90_s, 0.010 + 0.0001 * 100 + 0.001, 1e-12, "%g", r.ttft_p90_s);
    /* the transfer is a gap between the first and the second token: spread over the 19 */
    cr_assert_float_eq(r.tpot_p90_s, (0.002 + 19 * 0.006) / 19, 1e-12, "%g", r.tpot_p90_s);
    cr_assert_eq(r.good, 5);
    cr_assert_float_eq(r.attainment, 1.0, 1e-12);
    /* duration: first arrival to the last end (its prefill, transfer, 19 decode steps, hop) */
    cr_assert_float_eq(r.duration_s, 40.0 + 0.020 + 0.002 + 19 * 0.006 + 0.001, 1e-9, "%g", r.duration_s);

    slo.ttft_s = 0.0205; /* just below: nobody meets it */
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 5, &slo, &r), TD_OK);
    cr_assert_eq(r.good, 0);
    cr_assert_eq(r.goodput, 0);
}

Test(plan_sim, a_unified_node_unloaded_is_the_same_two_steps)
{
    td_plan_profile_t p = affine();
    td_plan_cluster_t c = td_plan_cluster_default();
    c.n_prefill = c.n_decode = 0;
    c.n_unified = 1;
    td_plan_request_t reqs[1] = {{.arrival_s = 0, .input_len = 100, .output_len = 20}};
    td_plan_slo_t slo = {0};
    td_plan_result_t r;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 1, &slo, &r), TD_OK);
    cr_assert_float_eq(r.ttft_p50_s, 0.020, 1e-12);
    cr_assert_float_eq(r.tpot_p50_s, 0.006, 1e-12);
}

Test(plan_sim, the_default_prefill_step_batches_as_a_prefill_node_does)
{
    /* A prefill node packs up to 2048 prompt tokens in a step (prefill_sched's default). Six
     * 250-token prompts arrive at once: the first starts a step alone (as a node's compute
     * thread takes the first as soon as it comes), the other five wait and are one step of
     * 1250 tokens, their first tokens all at its end. A planner with a smaller budget (it had
     * 512) spreads them over three steps, and then predicts neither their wait nor five
     * sequences joining a decode batch at once. */
    td_plan_profile_t p = affine();
    td_plan_cluster_t c = td_plan_cluster_default();
    td_plan_request_t reqs[6];
    for (int i = 0; i < 6; i++)
        reqs[i] = (td_plan_request_t){.arrival_s = 0, .input_len = 250, .output_len = 2};
    td_plan_slo_t slo = {0};
    td_plan_result_t r;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 6, &slo, &r), TD_OK);
    const double ttft = (0.010 + 0.0001 * 250) + (0.010 + 0.0001 * 1250);
    cr_assert_float_eq(r.ttft_p50_s, ttft, 1e-12, "TTFT p50 %g s; one step of 250 tokens, then one of 1250: %g s",
                       r.ttft_p50_s, ttft);
    cr_assert_float_eq(r.ttft_p90_s, ttft, 1e-12, "TTFT p90 %g s", r.ttft_p90_s);
    /* the five reach the decode node together: the first starts a step alone (6 ms), the
     * other four wait for it and step together (9 ms) */
    cr_assert_float_eq(r.tpot_p50_s, 0.006 + 0.009, 1e-12, "TPOT p50 %g s", r.tpot_p50_s);
}

/* Five lone requests of 100 prompt and 20 output tokens, 10 s apart. */
static void lone_requests(td_plan_request_t reqs[5])
{
    for (int i = 0; i < 5; i++)
        reqs[i] = (td_plan_request_t){.arrival_s = 10.0 * i, .input_len = 100, .output_len = 20};
}

Test(plan_sim, a_speed_factor_scales_every_step_of_every_node_not_the_transfer)
{
    td_plan_profile_t p = affine();
    p.xfer_a_s = 0.002;
    p.speed_f[0] = 2, p.n_speed = 1, p.speed_window_s = 0.5;
    td_plan_cluster_t c = td_plan_cluster_default();
    td_plan_request_t reqs[5];
    lone_requests(reqs);
    td_plan_slo_t slo = {0};
    td_plan_result_t r;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 5, &slo, &r), TD_OK);
    cr_assert_float_eq(r.ttft_p90_s, 2 * 0.020, 1e-12, "TTFT p90 %g s: the prefill step at half speed", r.ttft_p90_s);
    cr_assert_float_eq(r.tpot_p90_s, (0.002 + 19 * 2 * 0.006) / 19, 1e-12, "TPOT p90 %g s", r.tpot_p90_s);
    /* pooled over the replicas that make ~TD_PLAN_SPEED_REQUESTS requests */
    cr_assert_eq(r.n, 5 * (size_t)TD_PLAN_SPEED_REPLICAS, "%zu requests pooled", r.n);
    cr_assert_float_eq(r.throughput, 5 / (40 + 0.040 + 0.002 + 19 * 0.012), 1e-9, "%g req/s", r.throughput);

    c.n_prefill = c.n_decode = 0;
    c.n_unified = 1;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 5, &slo, &r), TD_OK);
    cr_assert_float_eq(r.ttft_p50_s, 2 * 0.020, 1e-12, "unified TTFT p50 %g s", r.ttft_p50_s);
    cr_assert_float_eq(r.tpot_p50_s, 2 * 0.006, 1e-12, "unified TPOT p50 %g s", r.tpot_p50_s);
}

Test(plan_sim, speed_factors_are_drawn_per_window_so_latencies_spread_as_they_do)
{
    /* factors 1 and 3, windows far longer than a request: a request runs at one speed or the
     * other, and about half the draws are each */
    td_plan_profile_t p = affine();
    p.speed_f[0] = 1, p.speed_f[1] = 3, p.n_speed = 2, p.speed_window_s = 1000;
    td_plan_cluster_t c = td_plan_cluster_default();
    td_plan_request_t reqs[5];
    lone_requests(reqs);
    td_plan_slo_t slo = {.ttft_s = 0.030}; /* met at speed 1 (20 ms), missed at 3 (60 ms) */
    td_plan_result_t r, again;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 5, &slo, &r), TD_OK);
    cr_assert(r.attainment > 0.25 && r.attainment < 0.75, "attainment %g: half the windows are slow", r.attainment);
    cr_assert_float_eq(r.ttft_p90_s, 3 * 0.020, 1e-12, "TTFT p90 %g s", r.ttft_p90_s);
    cr_assert_float_eq(r.tpot_p90_s, 3 * 0.006, 1e-12, "TPOT p90 %g s", r.tpot_p90_s);
    /* the draws are a fixed sequence: the same inputs, the same result */
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 5, &slo, &again), TD_OK);
    cr_assert_eq(again.good, r.good);
    cr_assert_eq(again.ttft_p50_s, r.ttft_p50_s);

    /* windows shorter than a step: a request's 19 steps mix both speeds, so its TPOT lies
     * between, and no longer at either end */
    p.speed_window_s = 0.001;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 5, &slo, &r), TD_OK);
    cr_assert(r.tpot_p50_s > 0.0065 && r.tpot_p50_s < 0.0175, "TPOT p50 %g s", r.tpot_p50_s);
    cr_assert(r.tpot_p90_s < 3 * 0.006 - 1e-6, "TPOT p90 %g s", r.tpot_p90_s);

    /* without factors every step is the fit: p90 = p50 */
    p.n_speed = 0;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 5, &slo, &r), TD_OK);
    cr_assert_eq(r.n, 5);
    cr_assert_float_eq(r.tpot_p90_s, r.tpot_p50_s, 1e-15);
}

/* The work a node does from t0 to t1: each window's time in the span over its factor. */
static double work_done(const td_plan_profile_t *p, double t0, double t1)
{
    double w = p->speed_window_s, done = 0;
    for (double t = t0; t < t1;) {
        double end = fmin((floor(t / w) + 1) * w, t1);
        done += (end - t) / td_plan_speed(p, 0, 0, t);
        t = end;
    }
    return done;
}

Test(plan_sim, a_step_spanning_windows_runs_each_at_its_speed)
{
    td_plan_profile_t p = affine();
    p.speed_f[0] = 1, p.speed_f[1] = 3, p.n_speed = 2, p.speed_window_s = 1;
    /* inside one window: the step times that window's factor */
    double f = td_plan_speed(&p, 0, 0, 0.25);
    cr_assert_float_eq(td_plan_step_elapsed(&p, 0, 0, 0.25, 0.1), 0.1 * f, 1e-12);
    /* across windows: it ends when the work of each window at its speed adds up to the step */
    for (double dt = 0.5; dt < 20; dt *= 1.7) {
        double el = td_plan_step_elapsed(&p, 0, 0, 0.5, dt);
        cr_assert(el >= dt - 1e-9 && el <= 3 * dt + 1e-9, "%g s of work took %g s", dt, el);
        cr_assert_float_eq(work_done(&p, 0.5, 0.5 + el), dt, 1e-9, "%g s of work took %g s", dt, el);
    }
    /* far past 64 windows: the rest at the factors' mean, 2 */
    double el = td_plan_step_elapsed(&p, 0, 0, 0, 10000);
    cr_assert(el > 19000 && el < 20100, "%g s", el);
    p.n_speed = 0;
    cr_assert_eq(td_plan_step_elapsed(&p, 0, 0, 3.0, 0.7), 0.7);
}

Test(plan_sim, one_prompt_per_step_is_an_md1_queue)
{
    /* service S = 20 ms, rho = 0.5: mean TTFT = S + rho S / (2 (1 - rho)) = 1.5 S */
    td_plan_profile_t p = affine();
    td_plan_cluster_t c = td_plan_cluster_default();
    c.prefill_max_batch = 1;
    int32_t in[1] = {100}, out[1] = {1};
    td_plan_lengths_t L = {in, out, 1};
    td_plan_search_t s = td_plan_search_default();
    s.n_requests = 40000;
    td_plan_result_t r;
    cr_assert_eq(td_plan_at_rate(&p, &c, &L, &s, 0.5 / 0.020, &r), TD_OK);
    cr_assert(fabs(r.ttft_mean_s - 0.030) < 0.030 * 0.05, "mean TTFT %g s, M/D/1 says 0.030 s", r.ttft_mean_s);
    cr_assert(fabs(r.prefill_busy - 0.5) < 0.03, "prefill busy %g, rho 0.5", r.prefill_busy);
    /* at low load the wait vanishes: TTFT is the service time */
    cr_assert_eq(td_plan_at_rate(&p, &c, &L, &s, 0.01 / 0.020, &r), TD_OK);
    cr_assert(fabs(r.ttft_mean_s - 0.020) < 0.020 * 0.02, "mean TTFT %g s at rho 0.01", r.ttft_mean_s);
}

Test(plan_sim, a_rate_beyond_capacity_is_not_sustained)
{
    /* prefill one prompt per step, 20 ms: at most 50 requests/s whatever the objectives */
    td_plan_profile_t p = affine();
    td_plan_cluster_t c = td_plan_cluster_default();
    c.prefill_max_batch = 1;
    td_plan_search_t s = td_plan_search_default();
    s.slo = (td_plan_slo_t){.ttft_s = 0.2, .tpot_s = 0.1};
    td_plan_result_t r;
    cr_assert_eq(td_plan_at_rate(&p, &c, &L100x20, &s, 100, &r), TD_OK);
    cr_assert(r.attainment < 0.5, "attainment %g at twice the capacity", r.attainment);
    cr_assert(r.throughput < 51, "throughput %g above capacity", r.throughput);
    double best;
    cr_assert_eq(td_plan_max_rate(&p, &c, &L100x20, &s, &best, &r), TD_OK);
    /* a finite run (1000 requests) absorbs a rate a little past capacity in its queue */
    cr_assert(best > 20 && best < 51, "highest sustained rate %g, capacity 50", best);
    cr_assert(r.attainment >= 0.9);
    /* a second prefill node raises it (with a decode node that is no bound: 20 output tokens at
     * 5 ms + 1 ms a sequence a step would cap it near 52/s) */
    c.n_prefill = 2;
    p.decode_b_s = 0.0001;
    double best2;
    cr_assert_eq(td_plan_max_rate(&p, &c, &L100x20, &s, &best2, NULL), TD_OK);
    cr_assert(best2 > 1.5 * best, "2 prefill nodes: %g, 1: %g", best2, best);
    /* objectives no request can meet: nothing is sustained */
    s.slo.ttft_s = 0.001;
    cr_assert_eq(td_plan_max_rate(&p, &c, &L100x20, &s, &best, NULL), TD_OK);
    cr_assert_eq(best, 0);
}

Test(plan_sim, the_same_seed_gives_the_same_run)
{
    td_plan_profile_t p = affine();
    p.decode_c_s = 1e-6;
    p.prefill_c_s = 1e-8;
    td_plan_cluster_t c = td_plan_cluster_default();
    c.n_decode = 2;
    int32_t in[3] = {50, 300, 700}, out[3] = {5, 40, 10};
    td_plan_lengths_t L = {in, out, 3};
    td_plan_search_t s = td_plan_search_default();
    s.slo = (td_plan_slo_t){.ttft_s = 0.3, .tpot_s = 0.05};
    td_plan_result_t a, b, d;
    cr_assert_eq(td_plan_at_rate(&p, &c, &L, &s, 15, &a), TD_OK);
    cr_assert_eq(td_plan_at_rate(&p, &c, &L, &s, 15, &b), TD_OK);
    cr_assert(a.ttft_p90_s == b.ttft_p90_s && a.tpot_p90_s == b.tpot_p90_s && a.good == b.good &&
              a.duration_s == b.duration_s);
    s.seed = 2;
    cr_assert_eq(td_plan_at_rate(&p, &c, &L, &s, 15, &d), TD_OK);
    cr_assert(d.duration_s != a.duration_s);
}

Test(plan_sim, kv_room_makes_the_router_wait_but_everyone_ends)
{
    td_plan_profile_t p = affine();
    td_plan_cluster_t c = td_plan_cluster_default();
    c.decode_kv_tokens = 240; /* two 100+20 requests at once */
    td_plan_request_t reqs[6];
    for (int i = 0; i < 6; i++)
        reqs[i] = (td_plan_request_t){.arrival_s = 0, .input_len = 100, .output_len = 20};
    td_plan_slo_t slo = {0};
    td_plan_result_t r, free_r;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 6, &slo, &r), TD_OK);
    c.decode_kv_tokens = 0;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 6, &slo, &free_r), TD_OK);
    cr_assert_eq(r.n, 6);
    cr_assert(r.duration_s > free_r.duration_s, "%g vs %g", r.duration_s, free_r.duration_s);
}

Test(plan_sim, least_squares_recovers_its_coefficients)
{
    double x[6 * 3], y[6], coef[3];
    for (int i = 0; i < 6; i++) {
        double t = 16.0 * (1 << i);
        x[i * 3] = 1, x[i * 3 + 1] = t, x[i * 3 + 2] = t * t;
        y[i] = 0.002 + 3e-5 * t + 4e-9 * t * t;
    }
    cr_assert_eq(td_plan_fit(x, y, 6, 3, coef), TD_OK);
    cr_assert_float_eq(coef[0], 0.002, 1e-9);
    cr_assert_float_eq(coef[1], 3e-5, 1e-11);
    cr_assert_float_eq(coef[2], 4e-9, 1e-13);
    double same[4] = {1, 2, 1, 2}, yy[2] = {1, 1};
    cr_assert_eq(td_plan_fit(same, yy, 2, 2, coef), TD_ERR_INVALID);
}

Test(plan_sim, bad_clusters_are_refused)
{
    td_plan_profile_t p = affine();
    td_plan_cluster_t c = td_plan_cluster_default();
    td_plan_request_t reqs[1] = {{.arrival_s = 0, .input_len = 0, .output_len = 1}};
    td_plan_slo_t slo = {0};
    td_plan_result_t r;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 1, &slo, &r), TD_ERR_INVALID);
    reqs[0].input_len = 1;
    c.n_decode = 0;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 1, &slo, &r), TD_ERR_INVALID);
    c.n_decode = 1;
    c.n_unified = 1;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 1, &slo, &r), TD_ERR_INVALID);
    c.n_unified = 0;
    c.conditional = true;
    c.unified_max_batch_tokens = c.decode_max_batch; /* a decode node's chunks need room beside its batch */
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 1, &slo, &r), TD_ERR_INVALID);
}

/* ---- conditional disaggregation (the router's td_place, simulated) ---- */

/* A 100-token warm-up at 0 s (the prefill node measures its rate, ~900 tokens/s) whose stream then
 * decodes for ~55 s at ~11 ms a step; seven 2000-token prompts at 1 s fill the prefill node for
 * ~14 s (1 ms a token, 2048 a step); a 16-token prompt at 3 s. */
static void queue_then_short(td_plan_request_t *reqs)
{
    reqs[0] = (td_plan_request_t){.arrival_s = 0, .input_len = 100, .output_len = 5000};
    for (int i = 1; i < 8; i++)
        reqs[i] = (td_plan_request_t){.arrival_s = 1.0, .input_len = 2000, .output_len = 10};
    reqs[8] = (td_plan_request_t){.arrival_s = 3.0, .input_len = 16, .output_len = 10};
}

Test(plan_sim, conditional_prefills_locally_in_chunks_the_tpot_objective_allows)
{
    td_plan_profile_t p = {.prefill_a_s = 0.010, .prefill_b_s = 0.001, .decode_a_s = 0.010, .decode_b_s = 0.001};
    td_plan_request_t reqs[9];
    queue_then_short(reqs);
    td_plan_slo_t slo = {0};
    td_plan_cluster_t c = td_plan_cluster_default();
    td_plan_result_t dis, tight, loose;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 9, &slo, &dis), TD_OK);
    cr_assert_gt(dis.ttft_p99_s, 10.0, "the last long prompt waits behind the others: %g s", dis.ttft_p99_s);

    c.conditional = true;
    c.tpot_objective_s = 0.005; /* below the decode node's own pace: no chunk fits, all remote */
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 9, &slo, &tight), TD_OK, "%s", td_last_error());
    cr_assert_float_eq(tight.ttft_mean_s, dis.ttft_mean_s, 1e-12, "%g vs %g", tight.ttft_mean_s, dis.ttft_mean_s);
    cr_assert_float_eq(tight.tpot_p99_s, dis.tpot_p99_s, 1e-12);

    /* room for ~22 prompt tokens a step beside the stream (at half the prefill node's rate, the
       decode node having measured none): the short prompt in one step instead of ~12 s in the
       queue, some long ones in chunks of TD_DECODE_PROBE_CHUNK until the node's step-cost fit
       has seen a few, then of what the fit allows (49: 11 ms of decode, 1 ms a token); every
       step within the objective (a 256-token chunk, the node's own, would take ~0.27 s) */
    c.tpot_objective_s = 0.060;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 9, &slo, &loose), TD_OK);
    cr_assert_lt(loose.ttft_mean_s, dis.ttft_mean_s - 1.0, "conditional %g s, disaggregated %g s",
                 loose.ttft_mean_s, dis.ttft_mean_s);
    /* (the node sizes its chunks by its step-cost fit, which finds this profile's steps exactly,
       so steps end at the objective: a 10-token stream whose KV lands during one waits for the
       rest of it, up to a step more over its 9 gaps: 10/9 of the objective at most) */
    cr_assert_leq(loose.tpot_p99_s, 10.0 / 9 * c.tpot_objective_s + 1e-9, "TPOT p99 %g s", loose.tpot_p99_s);
    /* with a TTFT objective the prefill node meets (its ~14 s queue within 60 s), the router
       keeps every prompt there: disaggregated again */
    c.ttft_objective_s = 60;
    td_plan_result_t ttft;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 9, &slo, &ttft), TD_OK);
    cr_assert_float_eq(ttft.ttft_mean_s, dis.ttft_mean_s, 1e-12, "%g vs %g", ttft.ttft_mean_s, dis.ttft_mean_s);
    c.ttft_objective_s = 5; /* one it passes (~12 s for the short prompt): local again */
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 9, &slo, &ttft), TD_OK);
    cr_assert_lt(ttft.ttft_mean_s, dis.ttft_mean_s - 1.0, "%g vs %g", ttft.ttft_mean_s, dis.ttft_mean_s);
}

/* ---- a decode step read from streams timed through a cluster (td_plan_decode_window) ---- */

/* A stream of `tokens` tokens whose k-th token (k = 0..tokens-1) arrives at t[k], sent `per`
 * tokens to a message (the message leaves with its last token): its first time and gaps. */
static td_plan_stream_t stream_of(const double *t, uint32_t tokens, uint32_t per, double *gaps)
{
    uint32_t n_msg = (tokens + per - 1) / per;
    double prev = t[per - 1];
    for (uint32_t m = 1; m < n_msg; m++) {
        double at = t[TD_MIN((m + 1) * per, tokens) - 1];
        gaps[m - 1] = at - prev;
        prev = at;
    }
    return (td_plan_stream_t){.first_s = t[per - 1], .gaps_s = gaps, .n_gaps = n_msg - 1, .tokens = tokens};
}

Test(plan_window, the_steps_while_every_stream_generates_not_the_ramp)
{
    /* A starts at 0 alone (1 ms steps), B joins at 10 ms; from then on a step of both is 3 ms */
    double ta[30], tb[30], ga[30], gb[30];
    for (int k = 0; k < 30; k++) {
        ta[k] = k <= 10 ? 0.001 * k : 0.010 + 0.003 * (k - 10);
        tb[k] = 0.010 + 0.003 * k;
    }
    td_plan_stream_t s[2] = {stream_of(ta, 30, 1, ga), stream_of(tb, 30, 1, gb)};
    td_plan_decode_point_t pt;
    cr_assert_eq(td_plan_decode_window(s, 2, 100, &pt), TD_OK);
    cr_assert_float_eq(pt.step_s, 0.003, 1e-12, "%g", pt.step_s);
    cr_assert_float_eq(pt.tokens_per_message, 1.0, 1e-12);
    /* window [10 ms, A's last at 67 ms]: A's tokens 10..29, B's 0..19: middles 19.5 and 9.5 */
    cr_assert_float_eq(pt.context, 100 + 0.5 * (19.5 + 9.5) + 1, 1e-9, "%g", pt.context);
    cr_assert_float_eq(pt.gaps_per_stream, 19.0, 1e-12, "%g", pt.gaps_per_stream);
}

Test(plan_window, merged_messages_and_messages_read_together_count_their_tokens)
{
    /* both streams step every 2 ms; A's router sends two tokens a message, B's client reads two
     * messages at once (a gap of 0, then 4 ms) */
    double ta[40], tb[40], ga[40], gb[40];
    for (int k = 0; k < 40; k++)
        ta[k] = 0.002 * k, tb[k] = 0.002 * k + 0.0005;
    double rb[40]; /* B: message k read when message k | 1 arrived */
    for (int k = 0; k < 40; k++)
        rb[k] = tb[k | 1];
    td_plan_stream_t s[2] = {stream_of(ta, 40, 2, ga), stream_of(rb, 40, 1, gb)};
    td_plan_decode_point_t pt;
    cr_assert_eq(td_plan_decode_window(s, 2, 16, &pt), TD_OK);
    /* exact for A; B's first message in the window was read with the next one: a token of 37 */
    cr_assert_float_eq(pt.step_s, 0.002, 0.002 * 0.05, "%g", pt.step_s);
    cr_assert_float_eq(pt.tokens_per_message, (2.0 + 1.0) / 2, 1e-12, "%g", pt.tokens_per_message);
}

Test(plan_window, streams_that_never_generate_together_give_no_step)
{
    double ta[10], tb[10], ga[10], gb[10];
    for (int k = 0; k < 10; k++)
        ta[k] = 0.001 * k, tb[k] = 0.100 + 0.001 * k; /* B's first token after A's last */
    td_plan_stream_t s[2] = {stream_of(ta, 10, 1, ga), stream_of(tb, 10, 1, gb)};
    td_plan_decode_point_t pt;
    cr_assert_eq(td_plan_decode_window(s, 2, 16, &pt), TD_OK);
    cr_assert(isnan(pt.step_s) && isnan(pt.context));
    cr_assert_float_eq(pt.gaps_per_stream, 0.0, 1e-12);
}

/* ---- follow: decode nodes that prefill for each other (the router's rule 6, simulated) ---- */

/* A profile of this machine's SmolLM2 (docs/goodput.md section J's gateway profile). */
static td_plan_profile_t smollm2(void)
{
    return (td_plan_profile_t){.prefill_a_s = 0.0039, .prefill_b_s = 0.00144, .prefill_c_s = 7.4e-7,
                               .decode_a_s = 0.003, .decode_b_s = 0.00155, .decode_c_s = 6.8e-6,
                               .xfer_a_s = 0.0029};
}

Test(plan_sim, follow_with_one_decode_node_never_places_on_a_peer)
{
    td_plan_profile_t p = smollm2();
    int32_t in[8] = {192, 320, 256, 200, 300, 250, 220, 280}, out[8] = {48, 48, 48, 48, 48, 48, 48, 48};
    td_plan_lengths_t L = {in, out, 8}; /* 256 +- 25% in, 48 out: the goodput sweep's mix */
    td_plan_search_t s = td_plan_search_default();
    s.n_requests = 400;
    s.slo = (td_plan_slo_t){.ttft_s = 3, .tpot_s = 0.025};
    td_plan_cluster_t c = td_plan_cluster_default();
    c.follow = true;
    c.tpot_objective_s = 0.025;
    td_plan_result_t r;
    c.n_prefill = 0; /* one decode node alone: every prompt its own */
    cr_assert_eq(td_plan_at_rate(&p, &c, &L, &s, 1.0, &r), TD_OK, "%s", td_last_error());
    cr_assert_eq(r.placed_peer, 0);
    cr_assert_eq(r.placed_local, r.n, "%zu of %zu local", r.placed_local, r.n);
    cr_assert_eq(r.prefill_busy, 0);
    /* with a prefill node, one decode node: conditional's run exactly */
    c.n_prefill = 1;
    cr_assert_eq(td_plan_at_rate(&p, &c, &L, &s, 2.0, &r), TD_OK);
    cr_assert_eq(r.placed_peer, 0);
    td_plan_result_t cond;
    c.follow = false;
    c.conditional = true;
    cr_assert_eq(td_plan_at_rate(&p, &c, &L, &s, 2.0, &cond), TD_OK);
    cr_assert_eq(r.placed_local, cond.placed_local);
    cr_assert_float_eq(r.ttft_mean_s, cond.ttft_mean_s, 1e-12);
    cr_assert_float_eq(r.tpot_p90_s, cond.tpot_p90_s, 1e-12);
    /* two decode nodes at a load where the own node is often mid-prompt: some go to the other */
    c.conditional = false, c.follow = true;
    c.n_prefill = 0, c.n_decode = 2;
    cr_assert_eq(td_plan_at_rate(&p, &c, &L, &s, 3.0, &r), TD_OK);
    cr_assert_eq(r.placed_local + r.placed_peer, r.n);
    cr_assert_gt(r.placed_peer, 0, "%zu of %zu on a peer", r.placed_peer, r.n);
}

/* Two streams, then six more that only node 0 has KV room for: node 0 ends up with seven, its
 * steps (~33 ms) past the 30 ms objective; node 1 with one holding 9100 of its 10000 KV tokens
 * and steps of ~9 ms (the later prompts of node 0's streams go there or stay, as the estimates
 * say). At 5 s a 30-token prompt of 1000 output tokens: no room for its stream on node 1, room
 * for its prompt. */
static size_t busy_and_roomy(td_plan_request_t *reqs, bool with_last)
{
    size_t n = 0;
    reqs[n++] = (td_plan_request_t){.arrival_s = 0, .input_len = 100, .output_len = 1000};
    reqs[n++] = (td_plan_request_t){.arrival_s = 0.001, .input_len = 100, .output_len = 9000};
    for (int i = 0; i < 6; i++)
        reqs[n++] = (td_plan_request_t){.arrival_s = 1.0 + 0.5 * i, .input_len = 40, .output_len = 1000};
    if (with_last)
        reqs[n++] = (td_plan_request_t){.arrival_s = 5.0, .input_len = 30, .output_len = 1000};
    return n;
}

Test(plan_sim, follow_a_peer_with_room_takes_a_prompt_when_its_own_node_is_busy_past_the_objective)
{
    td_plan_profile_t p = {.prefill_a_s = 0.002, .prefill_b_s = 0.0005, .decode_a_s = 0.005, .decode_b_s = 0.004,
                           .xfer_a_s = 0.001};
    td_plan_request_t reqs[9];
    td_plan_slo_t slo = {0};
    td_plan_cluster_t c = td_plan_cluster_default();
    c.n_prefill = 0, c.n_decode = 2;
    c.follow = true;
    c.tpot_objective_s = 0.030;
    c.decode_kv_tokens = 10000;
    td_plan_result_t before, with;
    size_t n = busy_and_roomy(reqs, false);
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, n, &slo, &before), TD_OK, "%s", td_last_error());
    n = busy_and_roomy(reqs, true); /* the run before it is the same: it arrives last */
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, n, &slo, &with), TD_OK);
    cr_assert_eq(with.placed_peer, before.placed_peer + 1, "the last prompt on the peer: %zu after %zu",
                 with.placed_peer, before.placed_peer);
    cr_assert_eq(with.placed_local, before.placed_local);
    /* (node 0 alone would prefill it in one step after its ~33 ms of streams, the router pricing
       it at ~42 ms; node 1 in one step of ~18 ms and a 1 ms transfer) */
}

/* ---- a step with prompt chunks beside decoding rows; nodes that start warm (issue 37) ---- */

Test(plan_sim, a_step_with_prompt_tokens_and_decoding_rows_costs_a_prefill_step_and_a_decode_step)
{
    td_plan_profile_t p = {.prefill_a_s = 0.004, .prefill_b_s = 0.001, .prefill_c_s = 1e-6, .decode_a_s = 0.003,
                           .decode_b_s = 0.002, .decode_c_s = 1e-5};
    cr_assert_float_eq(td_plan_mixed_step_s(&p, 10, 100, 0, 0), td_plan_prefill_step_s(&p, 10, 100), 1e-15);
    double dt1 = td_plan_prefill_step_s(&p, 1, 1);
    double dt2 = td_plan_prefill_step_s(&p, 10, 100) + td_plan_decode_step_s(&p, 1, 2);
    cr_assert_float_eq(td_plan_mixed_step_s(&p, 10, 100, 1, 2), dt2, 1e-15);
    /* one unified node: A's 1-token prompt alone, then A's first decode (context 2) beside B's
       10-token prompt, which arrived during the first step: B's first token after both steps */
    td_plan_request_t reqs[2] = {{.arrival_s = 0, .input_len = 1, .output_len = 3},
                                 {.arrival_s = dt1 / 2, .input_len = 10, .output_len = 1}};
    td_plan_cluster_t c = td_plan_cluster_default();
    c.n_prefill = c.n_decode = 0;
    c.n_unified = 1;
    td_plan_slo_t slo = {0};
    td_plan_result_t r;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 2, &slo, &r), TD_OK, "%s", td_last_error());
    double want = (dt1 + (dt1 + dt2 - dt1 / 2)) / 2;
    cr_assert_float_eq(r.ttft_mean_s, want, 1e-12, "mean TTFT %g s, want %g s (A %g s, B's step %g s)", r.ttft_mean_s,
                       want, dt1, dt2);
}

/* Follow, two decode nodes: A's stream on node 0 from 0 s (its prompt and decodes give node 0 a
 * step-cost fit), then at 1 s a 256-token prompt, which the router ranks onto node 1 (no stream)
 * and which node 1, idle, prefills sooner than node 0 beside A's stream and a transfer. */
Test(plan_sim, follow_a_node_that_has_not_prefilled_yet_is_priced_by_its_fit_not_the_stand_in)
{
    td_plan_profile_t p = smollm2();
    td_plan_request_t reqs[2] = {{.arrival_s = 0, .input_len = 100, .output_len = 1000},
                                 {.arrival_s = 1.0, .input_len = 256, .output_len = 48}};
    td_plan_cluster_t c = td_plan_cluster_default();
    c.n_prefill = 0, c.n_decode = 2;
    c.follow = true;
    c.tpot_objective_s = 0.025;
    td_plan_slo_t slo = {0};
    td_plan_result_t r;
    cr_assert_eq(td_plan_simulate(&p, &c, reqs, 2, &slo, &r), TD_OK, "%s", td_last_error());
    /* a cold node 1 (no fit: the stand-in rate, 25 tokens/s, ~10 s for the prompt) lost it to node 0,
       which prefilled it in its chunks beside A and sent it: a peer placement */
    cr_assert_eq(r.placed_peer, 0, "%zu of %zu on a peer", r.placed_peer, r.n);
    cr_assert_eq(r.placed_local, r.n);
}
