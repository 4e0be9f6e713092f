/*
 * td_grpc_wire: pieces shared by the gRPC server and client (internal to td_rpc): the
 * message prefix, grpc-timeout and grpc-message encodings, bounded protobuf unpacking and
 * the HTTP/2 output pump. Not for use outside common/rpc/td_grpc*.c.
 */
#ifndef TD_GRPC_WIRE_H
#define TD_GRPC_WIRE_H

#include <nghttp2/nghttp2.h>
#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "td_grpc.h"

#define TD_GRPC_PREFIX_BYTES 5
/* Batches written to the socket at once, and the socket queue above which we stop asking
 * nghttp2 for more output (and stop reading the peer). */
#define TD_GRPC_WRITE_CHUNK (64 * 1024)
#define TD_GRPC_WRITE_HIGH (1024 * 1024)

/* A growable byte buffer with a consumed offset. */
typedef struct td_grpc_buf {
    uint8_t *data;
    size_t off, len, cap; /* live bytes are data[off, len) */
} td_grpc_buf_t;

static inline size_t td_grpc_buf_size(const td_grpc_buf_t *b)
{
    return b->len - b->off;
}

/* Makes room for `more` bytes at data + len (compacting first). False on out of memory. */
bool td_grpc_buf_reserve(td_grpc_buf_t *b, size_t more);
bool td_grpc_buf_append(td_grpc_buf_t *b, const void *p, size_t n);
void td_grpc_buf_consume(td_grpc_buf_t *b, size_t n);
void td_grpc_buf_free(td_grpc_buf_t *b);
/* Empties the buffer for reuse, keeping its memory unless it grew past 4 KiB. */
void td_grpc_buf_recycle(td_grpc_buf_t *b);

/* Ended calls kept (per channel / server) for the next call, their buffers with them:
 * a call then costs no calloc and no buffer mallocs. */
#define TD_GRPC_SPARE_CALLS 64

/* Packs `msg` with its 5-byte prefix onto the end of `b`. TD_ERR_RANGE over max_bytes,
 * TD_ERR_NOMEM. */
td_status_t td_grpc_buf_put_message(td_grpc_buf_t *b, const ProtobufCMessage *msg, size_t max_bytes);
td_status_t td_grpc_buf_put_raw(td_grpc_buf_t *b, const void *p, size_t n, size_t max_bytes);

/* Reads the prefix at the front of `b`: returns false when fewer than 5 bytes are there. */
bool td_grpc_peek_prefix(const td_grpc_buf_t *b, uint8_t *compressed, uint32_t *len);

/* Unpacks into one arena (a few mallocs per message, not one per field) bounded at 16
 * bytes per wire byte + 64 KiB. NULL when it does not parse or needs more; then *over_p
 * (optional) says whether the bound refused it (a message of many tiny sub-messages: 2M
 * empty chat messages in 4 MiB) rather than the bytes being malformed or malloc failing.
 * Free with td_grpc_free_unpacked. */
ProtobufCMessage *td_grpc_unpack(const ProtobufCMessageDescriptor *desc, const uint8_t *p, size_t n, bool *over_p);
void td_grpc_free_unpacked(ProtobufCMessage *msg);

/* The longest grpc-timeout taken (100 days): longer ones are clamped to it, so a deadline
 * in nanoseconds (int64) never overflows ("99999999H" once ended a request at once). */
#define TD_GRPC_MAX_TIMEOUT_MS 8640000000LL

/* grpc-timeout "123m" → milliseconds (rounded up, at least 1, at most
 * TD_GRPC_MAX_TIMEOUT_MS). False when malformed. */
bool td_grpc_parse_timeout(const char *v, size_t n, uint64_t *ms);

/* Writes a grpc-timeout value for `ms` into out[TD_GRPC_TIMEOUT_CHARS]: at most 8 digits
 * as the spec wants (milliseconds, else seconds, minutes or hours, rounded up). No printf:
 * this runs once per call. */
#define TD_GRPC_TIMEOUT_CHARS 12
void td_grpc_format_timeout(uint32_t ms, char *out);

/* Decimal digits of v into out (at least 11 bytes), NUL-terminated; returns the length. */
size_t td_grpc_format_u32(uint32_t v, char *out);

/* Percent-encodes a grpc-message into a malloc'ed string (NULL on out of memory). */
char *td_grpc_percent_encode(const char *s);
/* Decodes in place-free fashion into a malloc'ed string; invalid escapes are kept as is. */
char *td_grpc_percent_decode(const uint8_t *s, size_t n);

/* The gRPC code for an HTTP status when a response carries no grpc-status. */
td_grpc_code_t td_grpc_code_from_http(int http_status);

/*
 * Moves nghttp2's pending output to the socket in TD_GRPC_WRITE_CHUNK batches until there
 * is none or the socket queue is above TD_GRPC_WRITE_HIGH, writing at once what the socket
 * takes (uv_try_write) and queueing only the rest. `*writes_in_flight` counts queued
 * uv_write requests (write_cb receives req->data = owner and must call
 * td_grpc_write_done). Returns 0, or a negative nghttp2/libuv error: close the connection.
 */
int td_grpc_pump(nghttp2_session *s, uv_stream_t *stream, void *owner, uv_write_cb write_cb,
                 int *writes_in_flight);
/* Frees a write request finished in a write_cb. */
void td_grpc_write_done(uv_write_t *req);

/* An nghttp2_nv from two C strings. */
static inline nghttp2_nv td_grpc_nv(const char *name, const char *value)
{
    size_t nl = 0, vl = 0;
    while (name[nl])
        nl++;
    while (value[vl])
        vl++;
    return (nghttp2_nv){(uint8_t *)name, (uint8_t *)value, nl, vl, NGHTTP2_NV_FLAG_NONE};
}

#endif /* TD_GRPC_WIRE_H */
