/*
 * td_safetensors: reading and writing the safetensors format.
 *
 * A safetensors file is an 8-byte little-endian header length N, N bytes of JSON mapping
 * each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative
 * to the byte after the header) plus an optional "__metadata__" object of strings, then
 * the tensor bytes. The reader maps the file and checks every claim of the header against
 * the file before anyone touches a byte: the header fits, every tensor's range lies inside
 * the data, its size matches dtype x shape, and no two tensors overlap. Tensors of dtypes
 * other than F32/F16/BF16 are listed (so a loader can name them) with supported = false.
 *
 * The writer streams: the caller declares every tensor up front (the header must be
 * written first), then appends each tensor's bytes in declaration order, in pieces of any
 * size, so a 16 GB file never has to exist in memory.
 */
#ifndef TD_SAFETENSORS_H
#define TD_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_dtype.h"
#include "td_status.h"
#include "td_util.h"

#define TD_ST_MAX_DIMS 8

/* One tensor described by a safetensors header. */
typedef struct td_st_tensor {
    char *name;
    char dtype_name[16];          /* as in the header: "F32", "BF16", "I64", ... */
    bool supported;               /* dtype is one of F32, F16, BF16 */
    td_dtype_t dtype;             /* valid when supported */
    int32_t n_dims;
    int64_t shape[TD_ST_MAX_DIMS];
    size_t offset;                /* bytes from the start of the file */
    size_t nbytes;
    const void *data;             /* into the map */
} td_st_tensor_t;

typedef struct td_safetensors td_safetensors_t;

/*
 * Maps and validates `path`. Errors (logged, naming the path): TD_ERR_IO (cannot open or
 * map), TD_ERR_FORMAT (truncated, header length beyond the file, bad JSON, bad entry,
 * range out of the file, size not matching dtype and shape, overlapping tensors),
 * TD_ERR_UNSUPPORTED (a dtype name we do not know at all), TD_ERR_NOMEM.
 * On success the caller owns *st_p and releases it with td_safetensors_close().
 */
td_status_t td_safetensors_open(const char *path, td_safetensors_t **st_p);
void td_safetensors_close(td_safetensors_t *st);

/* The tensor named `name`, or NULL. Borrowed: valid until td_safetensors_close(). */
const td_st_tensor_t *td_safetensors_find(const td_safetensors_t *st, const char *name);

/* Number of tensors and the i-th (in file order). */
size_t td_safetensors_count(const td_safetensors_t *st);
const td_st_tensor_t *td_safetensors_at(const td_safetensors_t *st, size_t i);

/* The path the file was opened with. */
const char *td_safetensors_path(const td_safetensors_t *st);

/* The file's read-only mapping (header and data), valid until td_safetensors_close. */
const td_mmap_t *td_safetensors_map(const td_safetensors_t *st);

/* ---- writer ------------------------------------------------------------------------ */

typedef struct td_st_writer td_st_writer_t;

/*
 * Starts a file at `path` (truncated). Declare tensors with td_st_writer_add(), then call
 * td_st_writer_begin() once (writes the header), then td_st_writer_write() the bytes of
 * each tensor in declaration order, then td_st_writer_finish(). Any error leaves the
 * writer unusable except for td_st_writer_destroy(), which also removes an unfinished
 * file. Errors: TD_ERR_IO (with the path and errno text), TD_ERR_NOMEM, TD_ERR_INVALID
 * (calls out of order, more bytes than declared).
 */
td_status_t td_st_writer_create(const char *path, td_st_writer_t **w_p);
td_status_t td_st_writer_add(td_st_writer_t *w, const char *name, td_dtype_t dtype, int32_t n_dims,
                             const int64_t *shape);
/* Adds {"key": "value"} to __metadata__; before begin. */
td_status_t td_st_writer_meta(td_st_writer_t *w, const char *key, const char *value);
td_status_t td_st_writer_begin(td_st_writer_t *w);
td_status_t td_st_writer_write(td_st_writer_t *w, const void *bytes, size_t n);
td_status_t td_st_writer_finish(td_st_writer_t *w);
void td_st_writer_destroy(td_st_writer_t *w);

/* Bytes of data declared so far (the sum of every tensor's size). */
size_t td_st_writer_data_bytes(const td_st_writer_t *w);

/* "F32", "F16", "BF16". */
const char *td_st_dtype_name(td_dtype_t t);

#endif /* TD_SAFETENSORS_H */
