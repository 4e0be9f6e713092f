/*
 * prefill_node: the `tandem prefill` process. Registers with the router, serves
 * PrefillNode.Prefill and /metrics: runs the prompt on a compute thread, pushes its KV
 * through td_xfer into the decode node's leased blocks, answers with the first token.
 */
#ifndef PREFILL_NODE_H
#define PREFILL_NODE_H

/* The process's main: argv[0] is "prefill". Returns the exit status (0, 1, 2 usage). */
int prefill_main(int argc, char **argv);

#endif /* PREFILL_NODE_H */
