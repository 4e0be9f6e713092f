/*
 * td_gguf: a validating reader of GGUF files (versions 2 and 3), the container llama.cpp
 * and most people who run models on CPUs hold weights in.
 *
 * A GGUF file, all little-endian:
 *   "GGUF" | u32 version | u64 tensor_count | u64 kv_count
 *   kv_count x { string key | u32 value_type | value }
 *   tensor_count x { string name | u32 n_dims | n_dims x u64 ne | u32 ggml_type | u64 offset }
 *   padding to general.alignment (default 32) | the data section
 * where a string is u64 length + bytes (no NUL), and an array value is u32 element type +
 * u64 count + the elements. ne[0] is the fastest-varying dimension (a row), the reverse of
 * the safetensors/PyTorch shape; offsets are relative to the data section and aligned.
 *
 * The reader maps the file and checks every claim against the file before handing out a
 * pointer: every read stays inside the file, counts and lengths are bounded by what is
 * left of it (so no allocation follows a hostile count), keys and tensor names are
 * unique, n_dims <= 4, dimension products do not overflow, every tensor of a type whose
 * block layout we know (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, Q8_K) has
 * a row length that is a whole number of blocks and lies inside the data section without
 * overlapping another. A tensor of another ggml type is listed (known = false, its offset
 * checked) and refused only when asked for by td_gguf_tensor(). Errors name the file, the
 * field and its byte offset. Nested arrays are refused (llama.cpp refuses them too).
 *
 * Strings in metadata are not NUL-terminated in the file: values are handed out as
 * (pointer into the map, length). Keys and tensor names are NUL-terminated copies.
 * Everything borrowed is valid until td_gguf_close(). A td_gguf_t is immutable after
 * td_gguf_open(): any thread may read it.
 */
#ifndef TD_GGUF_H
#define TD_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "td_quant.h"
#include "td_status.h"
#include "td_util.h"

#define TD_GGUF_MAX_DIMS 4
#define TD_GGUF_DEFAULT_ALIGNMENT 32

/* Value types, numbered as in the file. */
typedef enum td_gguf_type {
    TD_GGUF_U8 = 0,
    TD_GGUF_I8 = 1,
    TD_GGUF_U16 = 2,
    TD_GGUF_I16 = 3,
    TD_GGUF_U32 = 4,
    TD_GGUF_I32 = 5,
    TD_GGUF_F32 = 6,
    TD_GGUF_BOOL = 7,
    TD_GGUF_STRING = 8,
    TD_GGUF_ARRAY = 9,
    TD_GGUF_U64 = 10,
    TD_GGUF_I64 = 11,
    TD_GGUF_F64 = 12,
} td_gguf_type_t;


/* A string inside the map: len bytes at data, not NUL-terminated. */
typedef struct td_gguf_str {
    const char *data;
    size_t len;
} td_gguf_str_t;

/* One metadata entry. */
typedef struct td_gguf_kv {
    char *key;              /* NUL-terminated copy */
    td_gguf_type_t type;    /* TD_GGUF_ARRAY for an array */
    size_t offset;          /* byte offset of the entry in the file (for messages) */
    /* a scalar, widened: integers and bool in u64 (signed ones sign-extended, read
     * through i64), floats in f64, a string in str */
    union {
        uint64_t u64;
        int64_t i64;
        double f64;
        td_gguf_str_t str;
    } v;
    /* an array (type == TD_GGUF_ARRAY) */
    td_gguf_type_t arr_type;   /* element type: any scalar type (never an array) */
    size_t arr_len;
    const void *arr_data;      /* numeric elements in the map: little-endian, unaligned */
    td_gguf_str_t *arr_strs;   /* [arr_len] for an array of strings, else NULL */
} td_gguf_kv_t;

/* One tensor described by the file. */
typedef struct td_gguf_tensor {
    char *name;                       /* NUL-terminated copy */
    uint32_t type;                    /* ggml type id */
    bool known;                       /* type's block layout known: nbytes and data valid */
    int32_t n_dims;                   /* 1..4 (0 is read as a scalar: ne all 1) */
    int64_t ne[TD_GGUF_MAX_DIMS];     /* ne[0] fastest-varying; unused dims are 1 */
    uint64_t offset;                  /* from the start of the data section */
    size_t file_offset;               /* from the start of the file */
    size_t nbytes;                    /* 0 when !known */
    const void *data;                 /* into the map; NULL when !known */
} td_gguf_tensor_t;

typedef struct td_gguf td_gguf_t;

/*
 * Maps and validates `path`. Errors (logged, naming the path, the field and its byte
 * offset): TD_ERR_IO (cannot open or map), TD_ERR_FORMAT (not GGUF, truncated, a count or
 * length beyond the file, bad value type, nested array, duplicate key or tensor name,
 * n_dims > 4, dimension overflow, bad alignment, misaligned or out-of-file tensor data,
 * overlapping tensors), TD_ERR_UNSUPPORTED (GGUF version other than 2 and 3, or a
 * big-endian file), TD_ERR_NOMEM. On success the caller owns *g_p and releases it with
 * td_gguf_close().
 */
td_status_t td_gguf_open(const char *path, td_gguf_t **g_p);
void td_gguf_close(td_gguf_t *g);

/* True when `path` is a readable file starting with the GGUF magic. Never logs. */
bool td_gguf_is_gguf(const char *path);

/* Header facts. */
const char *td_gguf_path(const td_gguf_t *g);
uint32_t td_gguf_version(const td_gguf_t *g);
size_t td_gguf_alignment(const td_gguf_t *g);
size_t td_gguf_data_offset(const td_gguf_t *g);   /* file offset of the data section */
const td_mmap_t *td_gguf_map(const td_gguf_t *g);

/* ---- metadata ---------------------------------------------------------------------- */

size_t td_gguf_kv_count(const td_gguf_t *g);
/* The i-th entry in file order (i < count), or NULL. */
const td_gguf_kv_t *td_gguf_kv_at(const td_gguf_t *g, size_t i);
/* The entry with this key, or NULL. Never logs: for optional keys. */
const td_gguf_kv_t *td_gguf_find(const td_gguf_t *g, const char *key);

/*
 * Typed getters. Errors (logged, naming the file and the key): TD_ERR_NOT_FOUND (no such
 * key), TD_ERR_FORMAT (the value has another type, saying which, or does not fit).
 * get_uint accepts any integer type holding a value >= 0; get_int any integer type whose
 * value fits an int64; get_float f32 or f64; get_bool bool only; get_str string only (the
 * string is borrowed, not NUL-terminated); get_array an array whose elements have type
 * `elem` (TD_GGUF_ARRAY: any element type).
 */
td_status_t td_gguf_get_uint(const td_gguf_t *g, const char *key, uint64_t *out);
td_status_t td_gguf_get_int(const td_gguf_t *g, const char *key, int64_t *out);
td_status_t td_gguf_get_float(const td_gguf_t *g, const char *key, double *out);
td_status_t td_gguf_get_bool(const td_gguf_t *g, const char *key, bool *out);
td_status_t td_gguf_get_str(const td_gguf_t *g, const char *key, td_gguf_str_t *out);
td_status_t td_gguf_get_array(const td_gguf_t *g, const char *key, td_gguf_type_t elem,
                              const td_gguf_kv_t **kv_p);

/* Element i (< arr_len) of an array entry, as its scalar getter would give it. The
 * element type must match (an integer type for _int, f32/f64 for _float, bool for _bool,
 * string for _str): a mismatch or an index out of range is a programming error (asserted),
 * since the caller checked the type with td_gguf_get_array. */
int64_t td_gguf_arr_int(const td_gguf_kv_t *kv, size_t i);
double td_gguf_arr_float(const td_gguf_kv_t *kv, size_t i);
bool td_gguf_arr_bool(const td_gguf_kv_t *kv, size_t i);
td_gguf_str_t td_gguf_arr_str(const td_gguf_kv_t *kv, size_t i);

/* "u8", "i32", "f32", "bool", "string", "array", ...; "?" for a number outside the enum. */
const char *td_gguf_type_name(td_gguf_type_t t);

/* ---- tensors ----------------------------------------------------------------------- */

size_t td_gguf_tensor_count(const td_gguf_t *g);
/* The i-th tensor in file order, or NULL. */
const td_gguf_tensor_t *td_gguf_tensor_at(const td_gguf_t *g, size_t i);
/* The tensor named `name`, or NULL; never logs. */
const td_gguf_tensor_t *td_gguf_find_tensor(const td_gguf_t *g, const char *name);
/* The tensor named `name`, ready to read: TD_ERR_NOT_FOUND (no such tensor) or
 * TD_ERR_UNSUPPORTED (a ggml type whose layout we do not know, named), logged. */
td_status_t td_gguf_tensor(const td_gguf_t *g, const char *name, const td_gguf_tensor_t **t_p);


#endif /* TD_GGUF_H */
