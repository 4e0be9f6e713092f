/*
 * decode_node: the `tandem decode` process. Registers with the router, serves the
 * DecodeNode control API (Admit / Release / Steps) and /metrics, receives KV over td_xfer
 * and runs continuous batching (decode_sched) on a compute thread; or, as `tandem unified`,
 * the colocated baseline: the same process with prefill at home. docs/cluster.md.
 */
#ifndef DECODE_NODE_H
#define DECODE_NODE_H

/* The process's main: argv[0] is "decode". Returns the exit status (0, 1, 2 usage). */
int decode_main(int argc, char **argv);

/* `tandem unified`: the same process in the unified role (docs/cluster.md "Unified node"):
 * no KV transfer, Prefill served here, prompts prefilled in chunks inside the decode steps.
 * argv[0] is "unified". Returns the exit status (0, 1, 2 usage). */
int unified_main(int argc, char **argv);

#endif /* DECODE_NODE_H */
