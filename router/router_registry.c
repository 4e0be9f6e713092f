/*
 * router_registry: node table, heartbeat liveness and the per-node bounded set of recent
 * prefix block hashes (a ring buffer for age plus a td_hash index into it).
 */
#include "router_registry.h"

#include <stdlib.h>
#include <string.h>

#include "td_hash.h"
#include "td_util.h"

/* ---- bounded set of hashes ---------------------------------------------------------- */

/* ring[] holds the hashes in arrival order; index maps each hash held to its ring slot (a
 * td_hash made with room for the whole ring, so it never grows). */
typedef struct router_prefix_set {
    uint64_t *ring;    /* [cap] */
    bool *live;        /* [cap] slot holds a hash present in index */
    int32_t cap, head; /* head: next slot to overwrite (the oldest) */
    td_hash_t index;   /* hash -> ring slot */
} router_prefix_set_t;

static void pset_destroy(router_prefix_set_t *s)
{
    if (!s)
        return;
    td_hash_free(&s->index);
    free(s->ring), free(s->live), free(s);
}

static router_prefix_set_t *pset_create(int32_t cap)
{
    router_prefix_set_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->cap = cap;
    s->ring = calloc((size_t)cap, sizeof *s->ring);
    s->live = calloc((size_t)cap, sizeof *s->live);
    if (!s->ring || !s->live || td_hash_init(&s->index, (size_t)cap) != TD_OK) {
        pset_destroy(s);
        return NULL;
    }
    return s;
}

static void pset_add(router_prefix_set_t *s, uint64_t h)
{
    td_hash_slot_t *e = td_hash_find(&s->index, h);
    if (e) { /* refresh: forget the old slot, add at the young end */
        s->live[e->value] = false;
        td_hash_remove_slot(&s->index, e);
    }
    int32_t slot = s->head;
    if (s->live[slot]) {
        td_hash_slot_t *old = td_hash_find(&s->index, s->ring[slot]);
        TD_ASSERT(old);
        td_hash_remove_slot(&s->index, old);
    }
    s->ring[slot] = h;
    s->live[slot] = true;
    s->head = (slot + 1) % s->cap;
    td_status_t st = td_hash_put(&s->index, h, (uint64_t)slot);
    TD_ASSERT(st == TD_OK); /* at most cap entries: the table does not grow */
}

/* ---- registry ----------------------------------------------------------------------- */

struct router_registry {
    router_registry_config_t cfg;
    router_node_t *nodes; /* [max_nodes]; used[] says which slots hold a node */
    bool *used;
    int32_t n_slots;      /* highest used slot + 1 */
    uint64_t generation;
};

router_registry_config_t router_registry_config_default(void)
{
    return (router_registry_config_t){
        .max_nodes = 1024,
        .heartbeat_timeout_ns = 3000000000ll,
        .prefix_hashes = 8192,
    };
}

td_status_t router_registry_create(const router_registry_config_t *cfg, router_registry_t **reg_p)
{
    if (cfg->max_nodes <= 0 || cfg->heartbeat_timeout_ns <= 0 || cfg->prefix_hashes <= 0)
        return td_errorf(TD_ERR_INVALID,
                         "router registry: max_nodes %d, heartbeat_timeout_ns %lld and "
                         "prefix_hashes %d must all be > 0",
                         cfg->max_nodes, (long long)cfg->heartbeat_timeout_ns, cfg->prefix_hashes);
    router_registry_t *reg = calloc(1, sizeof *reg);
    if (!reg)
        goto err_nomem;
    reg->cfg = *cfg;
    reg->nodes = calloc((size_t)cfg->max_nodes, sizeof *reg->nodes);
    reg->used = calloc((size_t)cfg->max_nodes, sizeof *reg->used);
    if (!reg->nodes || !reg->used)
        goto err_reg;
    *reg_p = reg;
    return TD_OK;
err_reg:
    free(reg->nodes);
    free(reg->used);
    free(reg);
err_nomem:
    return td_errorf(TD_ERR_NOMEM, "router registry: out of memory for %d nodes", cfg->max_nodes);
}

void router_registry_destroy(router_registry_t *reg)
{
    if (!reg)
        return;
    for (int32_t i = 0; i < reg->n_slots; i++)
        if (reg->used[i])
            pset_destroy(reg->nodes[i].prefix);
    free(reg->nodes);
    free(reg->used);
    free(reg);
}

int32_t router_registry_find(const router_registry_t *reg, const char *id)
{
    for (int32_t i = 0; i < reg->n_slots; i++)
        if (reg->used[i] && !strcmp(reg->nodes[i].info.id, id))
            return i;
    return -1;
}

/* A name that is logged and shown in ClusterStatus: printable ASCII, no spaces. Returns the
 * offset of the first bad byte, or -1. */
static int32_t bad_name_byte(const char *name)
{
    for (int32_t i = 0; name[i]; i++)
        if ((unsigned char)name[i] <= ' ' || (unsigned char)name[i] >= 0x7f)
            return i;
    return -1;
}

td_status_t router_registry_validate(const td_node_info_t *info)
{
    int32_t at;
    if (!memchr(info->id, 0, sizeof info->id) || !memchr(info->model, 0, sizeof info->model) ||
        !memchr(info->address, 0, sizeof info->address))
        return td_errorf_quiet(TD_ERR_INVALID, "register: node_id, model and control_address must be "
                                               "shorter than %d, %d and %d bytes",
                               TD_NODE_ID_MAX, TD_NODE_MODEL_MAX, TD_NODE_ADDRESS_MAX);
    if (!info->id[0])
        return td_errorf_quiet(TD_ERR_INVALID, "register: node_id is empty");
    if ((at = bad_name_byte(info->id)) >= 0)
        return td_errorf_quiet(TD_ERR_INVALID, "register: node_id has byte 0x%02x at offset %d: "
                                               "printable ASCII without spaces only",
                               (unsigned char)info->id[at], at);
    if (info->role != TD_NODE_ROLE_PREFILL && info->role != TD_NODE_ROLE_DECODE && info->role != TD_NODE_ROLE_UNIFIED)
        return td_errorf_quiet(TD_ERR_INVALID, "register: node %s: role %d is not PREFILL (1), DECODE (2) or UNIFIED (3)",
                               info->id, (int)info->role);
    if (!info->model[0])
        return td_errorf_quiet(TD_ERR_INVALID, "register: node %s: model is empty", info->id);
    if ((at = bad_name_byte(info->model)) >= 0)
        return td_errorf_quiet(TD_ERR_INVALID, "register: node %s: model has byte 0x%02x at offset %d: "
                                               "printable ASCII without spaces only",
                               info->id, (unsigned char)info->model[at], at);
    if (!info->address[0])
        return td_errorf_quiet(TD_ERR_INVALID, "register: node %s: control_address is empty", info->id);
    if (td_kv_layout_validate(&info->layout) != TD_OK)
        return td_errorf_quiet(TD_ERR_INVALID, "register: node %s: layout: %s", info->id, td_last_error());
    if (info->capacity_blocks <= 0)
        return td_errorf_quiet(TD_ERR_INVALID, "register: node %s: capacity.total_kv_blocks %d, at least 1",
                               info->id, info->capacity_blocks);
    if (info->max_batch <= 0 || info->max_batch > ROUTER_MAX_BATCH)
        return td_errorf_quiet(TD_ERR_INVALID, "register: node %s: capacity.max_batch %d, allowed 1 .. %d",
                               info->id, info->max_batch, ROUTER_MAX_BATCH);
    if (info->vocab_size < 0 || info->vocab_size > ROUTER_MAX_VOCAB)
        return td_errorf_quiet(TD_ERR_INVALID,
                               "register: node %s: capacity.vocab_size %d, allowed 0 (unknown) .. %d",
                               info->id, info->vocab_size, ROUTER_MAX_VOCAB);
    if (info->max_seq_len < 0 || info->max_seq_len > ROUTER_MAX_SEQ_LEN)
        return td_errorf_quiet(TD_ERR_INVALID,
                               "register: node %s: capacity.max_seq_len %d, allowed 0 (unknown) .. %d",
                               info->id, info->max_seq_len, ROUTER_MAX_SEQ_LEN);
    return TD_OK;
}

td_status_t router_registry_join(router_registry_t *reg, const td_node_info_t *info,
                                 int64_t now_ns, int32_t *index_p)
{
    td_status_t st = router_registry_validate(info);
    if (st != TD_OK)
        return st;
    int32_t live = router_registry_find(reg, info->id);
    if (live >= 0 && router_registry_is_live(reg, live, now_ns))
        return td_errorf_quiet(TD_ERR_BUSY,
                               "register: node id %s is taken by a live node (at %s, last heard %lld ms "
                               "ago): a restarted node registers once the old one is gone (%lld ms of "
                               "silence), another node needs another id",
                               info->id, reg->nodes[live].info.address,
                               (long long)((now_ns - reg->nodes[live].last_heartbeat_ns) / 1000000),
                               (long long)(reg->cfg.heartbeat_timeout_ns / 1000000));
    for (int32_t i = 0; info->vocab_size > 0 && i < reg->n_slots; i++) {
        const router_node_t *o = &reg->nodes[i];
        if (reg->used[i] && strcmp(o->info.id, info->id) && !strcmp(o->info.model, info->model) &&
            o->info.vocab_size > 0 && o->info.vocab_size != info->vocab_size &&
            router_registry_is_live(reg, i, now_ns))
            return td_errorf_quiet(TD_ERR_INVALID,
                                   "router registry: node %s serves model %s with a vocabulary of %d "
                                   "ids, live node %s serves it with %d: nodes of one model name must "
                                   "load the same model",
                                   info->id, info->model, info->vocab_size, o->info.id,
                                   o->info.vocab_size);
    }
    int32_t idx = router_registry_find(reg, info->id);
    if (idx < 0) {
        for (int32_t i = 0; i < reg->cfg.max_nodes; i++)
            if (!reg->used[i]) {
                idx = i;
                break;
            }
        if (idx < 0)
            return td_errorf_quiet(TD_ERR_EXHAUSTED,
                                   "router registry: node %s refused, %d nodes registered already",
                                   info->id, reg->cfg.max_nodes);
    }
    router_node_t *n = &reg->nodes[idx];
    router_prefix_set_t *prefix = NULL;
    /* every role prefills: a prefill node, a unified node, a decode node asked to (conditional) */
    if (!(prefix = pset_create(reg->cfg.prefix_hashes)))
        return td_errorf(TD_ERR_NOMEM, "router registry: out of memory for node %s", info->id);
    if (reg->used[idx])
        pset_destroy(n->prefix);
    *n = (router_node_t){
        .info = *info,
        .load = {.free_blocks = info->capacity_blocks},
        .last_heartbeat_ns = now_ns,
        .up = true,
        .generation = ++reg->generation,
        .prefix = prefix,
    };
    reg->used[idx] = true;
    reg->n_slots = TD_MAX(reg->n_slots, idx + 1);
    if (index_p)
        *index_p = idx;
    return TD_OK;
}

td_status_t router_registry_leave(router_registry_t *reg, const char *id)
{
    int32_t idx = router_registry_find(reg, id);
    if (idx < 0)
        return td_errorf_quiet(TD_ERR_NOT_FOUND, "router registry: no node %s", id);
    pset_destroy(reg->nodes[idx].prefix);
    memset(&reg->nodes[idx], 0, sizeof reg->nodes[idx]);
    reg->used[idx] = false;
    while (reg->n_slots > 0 && !reg->used[reg->n_slots - 1])
        reg->n_slots--;
    return TD_OK;
}

td_status_t router_registry_heartbeat(router_registry_t *reg, const char *id,
                                      const td_node_load_t *load, int64_t now_ns)
{
    int32_t idx = router_registry_find(reg, id);
    if (idx < 0)
        return td_errorf_quiet(TD_ERR_NOT_FOUND,
                               "router registry: heartbeat from unregistered node %s", id);
    router_node_t *n = &reg->nodes[idx];
    n->load = *load;
    n->last_heartbeat_ns = now_ns;
    n->up = true;
    return TD_OK;
}

bool router_registry_is_live(const router_registry_t *reg, int32_t index, int64_t now_ns)
{
    if (index < 0 || index >= reg->n_slots || !reg->used[index])
        return false;
    const router_node_t *n = &reg->nodes[index];
    return n->up && now_ns - n->last_heartbeat_ns <= reg->cfg.heartbeat_timeout_ns;
}

int32_t router_registry_expire(router_registry_t *reg, int64_t now_ns)
{
    int32_t down = 0;
    for (int32_t i = 0; i < reg->n_slots; i++)
        if (reg->used[i] && reg->nodes[i].up && !router_registry_is_live(reg, i, now_ns)) {
            reg->nodes[i].up = false;
            down++;
        }
    return down;
}

int32_t router_registry_slots(const router_registry_t *reg)
{
    return reg->n_slots;
}

router_node_t *router_registry_node(router_registry_t *reg, int32_t index)
{
    if (index < 0 || index >= reg->n_slots || !reg->used[index])
        return NULL;
    return &reg->nodes[index];
}

const router_node_t *router_registry_node_const(const router_registry_t *reg, int32_t index)
{
    if (index < 0 || index >= reg->n_slots || !reg->used[index])
        return NULL;
    return &reg->nodes[index];
}

void router_registry_note_prefix(router_registry_t *reg, int32_t index, const uint64_t *hashes,
                                 int32_t n)
{
    router_node_t *node = router_registry_node(reg, index);
    if (!node || !node->prefix)
        return;
    for (int32_t i = 0; i < n; i++)
        pset_add(node->prefix, hashes[i]);
}

int32_t router_registry_prefix_match(const router_registry_t *reg, int32_t index,
                                     const uint64_t *hashes, int32_t n)
{
    const router_node_t *node = router_registry_node_const(reg, index);
    if (!node || !node->prefix)
        return 0;
    int32_t m = 0;
    while (m < n && td_hash_find(&node->prefix->index, hashes[m]))
        m++;
    return m;
}

const router_registry_config_t *router_registry_config(const router_registry_t *reg)
{
    return &reg->cfg;
}
