/*
 * td_gguf_writer: writes a GGUF v3 file (the layout td_gguf.h describes), streaming the
 * tensor data so that a model larger than memory can be written.
 *
 * Use: create, add metadata (any order) and tensor descriptions (in data order), begin
 * (writes the header, metadata and tensor table), write each tensor's bytes in the order
 * added (in pieces of any size; padding to the alignment is inserted between tensors),
 * finish. A writer destroyed before finish removes its file, so a failed or interrupted
 * write never leaves a file that looks whole.
 *
 * Everything is little-endian; strings are u64 length + bytes. Alignment is 32 (the GGUF
 * default), not written as general.alignment. One thread.
 */
#ifndef TD_GGUF_WRITER_H
#define TD_GGUF_WRITER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_status.h"

typedef struct td_gguf_writer td_gguf_writer_t;

/* Creates (truncates) `path`. Errors: TD_ERR_IO naming the path, TD_ERR_NOMEM. */
td_status_t td_gguf_writer_create(const char *path, td_gguf_writer_t **w_p);
/* Removes the file unless td_gguf_writer_finish succeeded. NULL: no-op. */
void td_gguf_writer_destroy(td_gguf_writer_t *w);

/* Metadata entries, before begin. Errors: TD_ERR_NOMEM; TD_ERR_INVALID after begin. */
td_status_t td_gguf_writer_u32(td_gguf_writer_t *w, const char *key, uint32_t v);
td_status_t td_gguf_writer_i32(td_gguf_writer_t *w, const char *key, int32_t v);
td_status_t td_gguf_writer_f32(td_gguf_writer_t *w, const char *key, float v);
td_status_t td_gguf_writer_bool(td_gguf_writer_t *w, const char *key, bool v);
td_status_t td_gguf_writer_str(td_gguf_writer_t *w, const char *key, const char *v);
/* Arrays: n strings (NUL-terminated), n i32, n f32. */
td_status_t td_gguf_writer_arr_str(td_gguf_writer_t *w, const char *key, const char *const *v, size_t n);
td_status_t td_gguf_writer_arr_i32(td_gguf_writer_t *w, const char *key, const int32_t *v, size_t n);
td_status_t td_gguf_writer_arr_f32(td_gguf_writer_t *w, const char *key, const float *v, size_t n);

/* Describes the next tensor: n_dims (1..4) sizes ne[] fastest-first (GGUF order) of ggml
 * type `ggml_type` (td_quant.h), whose layout must be known (td_ggml_type) and whose row
 * a whole number of blocks. Errors: TD_ERR_INVALID (naming the tensor), TD_ERR_NOMEM. */
td_status_t td_gguf_writer_tensor(td_gguf_writer_t *w, const char *name, int n_dims, const int64_t *ne,
                                  uint32_t ggml_type);

/* Writes the header, metadata and tensor table. Errors: TD_ERR_IO naming the file. */
td_status_t td_gguf_writer_begin(td_gguf_writer_t *w);
/* Appends n bytes of tensor data (the tensors in the order described). Errors: TD_ERR_IO;
 * TD_ERR_INVALID when more bytes come than the tensors hold. */
td_status_t td_gguf_writer_write(td_gguf_writer_t *w, const void *data, size_t n);
/* Checks every tensor got its bytes and closes the file. Errors: TD_ERR_INVALID (short),
 * TD_ERR_IO. */
td_status_t td_gguf_writer_finish(td_gguf_writer_t *w);

#endif /* TD_GGUF_WRITER_H */
