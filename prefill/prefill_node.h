/*
 * prefill_node: the `tandem prefill` process. Registers with the router, serves
 * PrefillNode.Prefill (server streaming) and /metrics: batches waiting prompts into engine
 * steps under a token budget (chunked prefill, prefix cache), pushes each layer's KV
 * through td_xfer into the decode node's leased blocks as soon as the layer is computed,
 * streams FIRST_TOKEN as soon as the first token is sampled and KV_DELIVERED once the
 * decode node adopted the KV. docs/cluster.md has the threads, queues and keys.
 */
#ifndef PREFILL_NODE_H
#define PREFILL_NODE_H

/* The process's main: argv[0] is "prefill". Returns the exit status (0, 1, 2 usage). */
int prefill_main(int argc, char **argv);

#endif /* PREFILL_NODE_H */
