/*
 * td_grpc_wire: the shared gRPC wire helpers of td_grpc_wire.h.
 */
#include "td_grpc_wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "td_arena.h"
#include "td_util.h"

const char *td_grpc_code_name(td_grpc_code_t code)
{
    switch (code) {
#define TD_GRPC_CODE_STR(name, c) \
    case TD_GRPC_##name:          \
        return #name;
        TD_GRPC_CODE_MAP(TD_GRPC_CODE_STR)
#undef TD_GRPC_CODE_STR
    }
    return "UNKNOWN";
}

td_grpc_code_t td_grpc_code_from_status(td_status_t st)
{
    switch (st) {
    case TD_OK: return TD_GRPC_OK;
    case TD_ERR_INVALID:
    case TD_ERR_FORMAT:
    case TD_ERR_RANGE: return TD_GRPC_INVALID_ARGUMENT;
    case TD_ERR_NOT_FOUND: return TD_GRPC_NOT_FOUND;
    case TD_ERR_NOMEM:
    case TD_ERR_EXHAUSTED:
    case TD_ERR_BUSY: return TD_GRPC_RESOURCE_EXHAUSTED;
    case TD_ERR_TIMEOUT: return TD_GRPC_DEADLINE_EXCEEDED;
    case TD_ERR_CANCELLED: return TD_GRPC_CANCELLED;
    case TD_ERR_UNAVAILABLE:
    case TD_ERR_CLOSED: return TD_GRPC_UNAVAILABLE;
    case TD_ERR_MISMATCH:
    case TD_ERR_STALE: return TD_GRPC_FAILED_PRECONDITION;
    case TD_ERR_UNSUPPORTED: return TD_GRPC_UNIMPLEMENTED;
    default: return TD_GRPC_INTERNAL;
    }
}

td_grpc_code_t td_grpc_code_from_http(int s)
{
    switch (s) {
    case 400: return TD_GRPC_INTERNAL;
    case 401: return TD_GRPC_UNAUTHENTICATED;
    case 403: return TD_GRPC_PERMISSION_DENIED;
    case 404: return TD_GRPC_UNIMPLEMENTED;
    case 429:
    case 502:
    case 503:
    case 504: return TD_GRPC_UNAVAILABLE;
    default: return TD_GRPC_UNKNOWN;
    }
}

bool td_grpc_buf_reserve(td_grpc_buf_t *b, size_t more)
{
    if (b->off && b->cap - b->len < more) {
        memmove(b->data, b->data + b->off, b->len - b->off);
        b->len -= b->off;
        b->off = 0;
    }
    if (b->cap - b->len >= more)
        return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len < more) {
        if (cap > SIZE_MAX / 2)
            return false;
        cap *= 2;
    }
    uint8_t *d = realloc(b->data, cap);
    if (!d)
        return false;
    b->data = d;
    b->cap = cap;
    return true;
}

bool td_grpc_buf_append(td_grpc_buf_t *b, const void *p, size_t n)
{
    if (!td_grpc_buf_reserve(b, n))
        return false;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return true;
}

void td_grpc_buf_consume(td_grpc_buf_t *b, size_t n)
{
    TD_ASSERT(n <= b->len - b->off);
    b->off += n;
    if (b->off == b->len)
        b->off = b->len = 0;
}

void td_grpc_buf_free(td_grpc_buf_t *b)
{
    free(b->data);
    *b = (td_grpc_buf_t){0};
}

void td_grpc_buf_recycle(td_grpc_buf_t *b)
{
    if (b->cap > 4096) /* spare calls keep small buffers only: 64 of them stay under 1 MiB */
        td_grpc_buf_free(b);
    b->off = b->len = 0;
}

static void put_prefix(uint8_t *p, size_t n)
{
    p[0] = 0;
    p[1] = (uint8_t)(n >> 24);
    p[2] = (uint8_t)(n >> 16);
    p[3] = (uint8_t)(n >> 8);
    p[4] = (uint8_t)n;
}

td_status_t td_grpc_buf_put_message(td_grpc_buf_t *b, const ProtobufCMessage *msg, size_t max_bytes)
{
    size_t n = protobuf_c_message_get_packed_size(msg);
    if (n > max_bytes || n > UINT32_MAX)
        return td_errorf_quiet(TD_ERR_RANGE, "grpc: message of %zu bytes exceeds the limit of %zu",
                               n, max_bytes);
    if (!td_grpc_buf_reserve(b, TD_GRPC_PREFIX_BYTES + n))
        return td_errorf(TD_ERR_NOMEM, "grpc: out of memory queueing a %zu byte message", n);
    uint8_t *p = b->data + b->len;
    put_prefix(p, n);
    size_t w = protobuf_c_message_pack(msg, p + TD_GRPC_PREFIX_BYTES);
    TD_ASSERT(w == n);
    b->len += TD_GRPC_PREFIX_BYTES + n;
    return TD_OK;
}

td_status_t td_grpc_buf_put_raw(td_grpc_buf_t *b, const void *data, size_t n, size_t max_bytes)
{
    if (n > max_bytes || n > UINT32_MAX)
        return td_errorf_quiet(TD_ERR_RANGE, "grpc: message of %zu bytes exceeds the limit of %zu",
                               n, max_bytes);
    if (!td_grpc_buf_reserve(b, TD_GRPC_PREFIX_BYTES + n))
        return td_errorf(TD_ERR_NOMEM, "grpc: out of memory queueing a %zu byte message", n);
    put_prefix(b->data + b->len, n);
    if (n)
        memcpy(b->data + b->len + TD_GRPC_PREFIX_BYTES, data, n);
    b->len += TD_GRPC_PREFIX_BYTES + n;
    return TD_OK;
}

bool td_grpc_peek_prefix(const td_grpc_buf_t *b, uint8_t *compressed, uint32_t *len)
{
    if (td_grpc_buf_size(b) < TD_GRPC_PREFIX_BYTES)
        return false;
    const uint8_t *p = b->data + b->off;
    *compressed = p[0];
    *len = (uint32_t)p[1] << 24 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 8 | p[4];
    return true;
}

/* ---- bounded unpacking -------------------------------------------------------------- */

/*
 * One arena per unpacked message: protobuf-c makes one allocation per sub-message, string
 * and repeated array (a StepBatch of 64 entries is 66), so it bumps through chunks and
 * frees them all at once. The arena and protobuf-c's allocator are the first allocation
 * of the first chunk and the top-level message (protobuf-c allocates it first) the next,
 * at a fixed offset, which is how td_grpc_free_unpacked finds the arena. Chunks after the
 * first count against the budget (16 bytes per wire byte + 64 KiB), so a hostile message
 * still costs a bounded amount of memory.
 */
typedef struct wire_arena {
    td_arena_t arena;
    ProtobufCAllocator alloc;
} wire_arena_t;

#define WIRE_ARENA_HDR TD_DIV_CEIL(sizeof(wire_arena_t), 16) * 16

static void *wire_arena_alloc(void *data, size_t size)
{
    return td_arena_alloc(&((wire_arena_t *)data)->arena, size);
}

static void wire_arena_free(void *data, void *ptr)
{
    /* everything goes with the arena */
}

ProtobufCMessage *td_grpc_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *p, size_t n, bool *over_p)
{
    if (over_p)
        *over_p = false;
    size_t bound = n > (SIZE_MAX - 65536) / 16 ? SIZE_MAX : n * 16 + 65536;
    /* room for the arena, the top-level message and what the wire bytes usually unpack to */
    size_t first = WIRE_ARENA_HDR + TD_DIV_CEIL(desc->sizeof_message, 16) * 16 + TD_MIN(4 * n + 256, bound / 2);
    td_arena_t arena;
    td_arena_init(&arena, first, bound > SIZE_MAX - first ? SIZE_MAX : bound + first); /* the first chunk is free */
    wire_arena_t *w = td_arena_alloc(&arena, sizeof *w);
    if (!w)
        return NULL;
    w->arena = arena; /* the arena now lives in its first chunk */
    w->alloc = (ProtobufCAllocator){wire_arena_alloc, wire_arena_free, w};
    ProtobufCMessage *m = protobuf_c_message_unpack(desc, &w->alloc, n, p);
    if (!m) {
        if (over_p)
            *over_p = w->arena.over_limit;
        td_arena_free(&w->arena);
        return NULL;
    }
    TD_ASSERT((uint8_t *)m == (uint8_t *)w + WIRE_ARENA_HDR); /* the top-level message came first */
    return m;
}

void td_grpc_free_unpacked(ProtobufCMessage *m)
{
    if (!m)
        return;
    td_arena_free(&((wire_arena_t *)((uint8_t *)m - WIRE_ARENA_HDR))->arena);
}

/* ---- header encodings --------------------------------------------------------------- */

bool td_grpc_parse_timeout(const char *v, size_t n, uint64_t *ms)
{
    if (n < 2 || n > 9)
        return false;
    uint64_t x = 0;
    for (size_t i = 0; i + 1 < n; i++) {
        if (v[i] < '0' || v[i] > '9')
            return false;
        x = x * 10 + (uint64_t)(v[i] - '0');
    }
    uint64_t out;
    switch (v[n - 1]) {
    case 'H': out = x * 3600000u; break;
    case 'M': out = x * 60000u; break;
    case 'S': out = x * 1000u; break;
    case 'm': out = x; break;
    case 'u': out = (x + 999) / 1000; break;
    case 'n': out = (x + 999999) / 1000000; break;
    default: return false;
    }
    /* 8 digits of hours are 11,000 years: clamped, so a deadline in ns stays in int64 */
    *ms = out ? TD_MIN(out, (uint64_t)TD_GRPC_MAX_TIMEOUT_MS) : 1;
    return true;
}

size_t td_grpc_format_u32(uint32_t v, char *out)
{
    char tmp[10];
    size_t n = 0;
    do {
        tmp[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (size_t i = 0; i < n; i++)
        out[i] = tmp[n - 1 - i];
    out[n] = '\0';
    return n;
}

void td_grpc_format_timeout(uint32_t ms, char *out)
{
    static const struct {
        uint32_t per;
        char unit;
    } units[] = {{1, 'm'}, {1000, 'S'}, {60000, 'M'}, {3600000, 'H'}};
    uint32_t v = ms;
    size_t u = 0;
    for (; u < TD_ARRAY_LEN(units); u++) {
        v = ms / units[u].per + (ms % units[u].per != 0);
        if (v <= 99999999u)
            break;
    }
    size_t n = td_grpc_format_u32(v, out);
    out[n] = units[u].unit;
    out[n + 1] = '\0';
}

char *td_grpc_percent_encode(const char *s)
{
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        n += (*p < 0x20 || *p > 0x7e || *p == '%') ? 3 : 1;
    char *out = malloc(n + 1), *o = out;
    if (!out)
        return NULL;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p < 0x20 || *p > 0x7e || *p == '%')
            o += sprintf(o, "%%%02X", *p);
        else
            *o++ = (char)*p;
    }
    *o = '\0';
    return out;
}

char *td_grpc_percent_decode(const uint8_t *s, size_t n)
{
    char *out = malloc(n + 1), *o = out;
    if (!out)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        int hi, lo;
        if (s[i] == '%' && i + 2 < n && (hi = td_hex_digit(s[i + 1])) >= 0 &&
            (lo = td_hex_digit(s[i + 2])) >= 0) {
            *o++ = (char)(hi << 4 | lo);
            i += 2;
        } else {
            *o++ = (char)s[i];
        }
    }
    *o = '\0';
    return out;
}

/* ---- output pump -------------------------------------------------------------------- */

typedef struct wreq {
    uv_write_t req;
    int *in_flight;
    uint8_t data[];
} wreq_t;

void td_grpc_write_done(uv_write_t *req)
{
    wreq_t *w = (wreq_t *)req;
    (*w->in_flight)--;
    free(w);
}

/* Writes data[0, len) now as far as the socket takes it; queues the rest with uv_write in
 * `w` (allocated here when NULL: data is then not ours to keep). */
static int pump_write(uv_stream_t *stream, wreq_t *w, const uint8_t *data, size_t len, void *owner,
                      uv_write_cb write_cb, int *writes_in_flight)
{
    uv_buf_t b = uv_buf_init((char *)data, (unsigned)len);
    int n = uv_try_write(stream, &b, 1); /* UV_EAGAIN while earlier writes are queued */
    if (n < 0 && n != UV_EAGAIN && n != UV_ENOSYS) {
        free(w);
        return n;
    }
    size_t done = n > 0 ? (size_t)n : 0;
    if (done == len) {
        free(w);
        return 0;
    }
    size_t off = done;
    if (!w) {
        if (!(w = malloc(sizeof *w + len - done)))
            return NGHTTP2_ERR_NOMEM;
        memcpy(w->data, data + done, len - done);
        off = 0;
    } else {
        off += (size_t)(data - w->data);
    }
    w->req.data = owner;
    w->in_flight = writes_in_flight;
    b = uv_buf_init((char *)w->data + off, (unsigned)(len - done));
    int rc = uv_write(&w->req, stream, &b, 1, write_cb);
    if (rc < 0) {
        free(w);
        return rc;
    }
    (*writes_in_flight)++;
    return 0;
}

/*
 * nghttp2 hands out its output a frame at a time; frames are gathered (in a stack buffer,
 * or a heap one past its size) so one syscall carries many, and written at once with
 * uv_try_write. Only what the socket does not take is copied into a queued write, so the
 * usual small batch costs no allocation and no write callback.
 */
int td_grpc_pump(nghttp2_session *s, uv_stream_t *stream, void *owner, uv_write_cb write_cb,
                 int *writes_in_flight)
{
    uint8_t stack[16384];
    while (uv_stream_get_write_queue_size(stream) < TD_GRPC_WRITE_HIGH &&
           nghttp2_session_want_write(s)) {
        wreq_t *w = NULL;
        uint8_t *buf = stack;
        size_t len = 0, cap = sizeof stack;
        for (;;) {
            const uint8_t *p;
            ssize_t n = nghttp2_session_mem_send(s, &p);
            if (n < 0) {
                free(w);
                return (int)n;
            }
            if (n == 0)
                break;
            if (len + (size_t)n > cap) {
                size_t ncap = TD_MAX(cap, (size_t)TD_GRPC_WRITE_CHUNK);
                while (ncap < len + (size_t)n)
                    ncap *= 2;
                wreq_t *nw = realloc(w, sizeof *w + ncap);
                if (!nw) {
                    free(w);
                    return NGHTTP2_ERR_NOMEM;
                }
                if (!w)
                    memcpy(nw->data, stack, len);
                w = nw;
                buf = w->data;
                cap = ncap;
            }
            memcpy(buf + len, p, (size_t)n);
            len += (size_t)n;
            if (len >= TD_GRPC_WRITE_CHUNK)
                break;
        }
        if (!len)
            break;
        int rc = pump_write(stream, w, buf, len, owner, write_cb, writes_in_flight);
        if (rc < 0)
            return rc;
    }
    return 0;
}
