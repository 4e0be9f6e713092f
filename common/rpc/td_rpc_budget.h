/*
 * td_rpc_budget: one byte budget that several servers on a loop share, for the request
 * bodies they hold in flight across all their connections (the router's HTTP API and gRPC
 * gateway). A per-connection bound times a connection cap is gigabytes; this bounds the
 * sum. A server takes bytes before it buffers them and gives them back when the body is
 * freed; a take past the limit is refused (the server answers 503 / RESOURCE_EXHAUSTED),
 * never waited for, so the loop never blocks on it.
 *
 * Loop thread only (the servers sharing one must run on the same loop). Caller-allocated,
 * no init beyond setting limit: {.limit = N}.
 */
#ifndef TD_RPC_BUDGET_H
#define TD_RPC_BUDGET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct td_rpc_budget {
    size_t limit;      /* bytes in flight at most; 0 = no bound */
    size_t used;       /* bytes taken, not yet given back */
    uint64_t refused;  /* takes refused (for tests and logs) */
} td_rpc_budget_t;

/* Takes n bytes: true when they fit (or b is NULL: no budget), false (nothing taken,
 * counted in refused) when used + n would pass the limit. */
static inline bool td_rpc_budget_take(td_rpc_budget_t *b, size_t n)
{
    if (!b)
        return true;
    if (b->limit && (n > b->limit || b->used > b->limit - n)) {
        b->refused++;
        return false;
    }
    b->used += n;
    return true;
}

/* Gives back n bytes taken before (NULL b: nothing). */
static inline void td_rpc_budget_give(td_rpc_budget_t *b, size_t n)
{
    if (b)
        b->used -= n < b->used ? n : b->used;
}

#endif /* TD_RPC_BUDGET_H */
