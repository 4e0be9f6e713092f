/*
 * td_sched_defaults: the nodes' default batch limits, in one place for the schedulers that
 * apply them (prefill_sched: prefill nodes; decode_sched: decode and unified nodes) and the
 * capacity planner that models them (td_plan_cluster_default, `tandem plan`), so that a plan
 * simulates the nodes as they run unless it is told other limits. docs/scheduling.md.
 */
#ifndef TD_SCHED_DEFAULTS_H
#define TD_SCHED_DEFAULTS_H

#define TD_PREFILL_MAX_BATCH_TOKENS 2048 /* prompt tokens in one prefill step */
#define TD_PREFILL_MAX_BATCH 64          /* prompts in one prefill step */
#define TD_DECODE_MAX_BATCH 64           /* running sequences of a decode or unified node */
#define TD_DECODE_MAX_BATCH_TOKENS 512   /* tokens one decode or unified step feeds */
#define TD_DECODE_PREFILL_CHUNK 256      /* prompt tokens one sequence feeds in a unified step */
#define TD_DECODE_PROBE_CHUNK 16         /* prompt tokens a step under a TPOT objective feeds
                                            while the node's step-cost fit has too few steps with
                                            prompt tokens (one KV block of the default size): the
                                            probe that starts the fit */
#define TD_DECODE_PAST_OBJECTIVE_CHUNK 1 /* prompt tokens a step under a TPOT objective feeds where
                                            the objective leaves room for none (the decodes alone
                                            pass it): a prompt admitted there still moves on, and
                                            the router prices a local prefill there at this rate */

#endif /* TD_SCHED_DEFAULTS_H */
