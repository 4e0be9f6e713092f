/*
 * fuzz_gguf: a GGUF file through everything that reads one: td_gguf_open (header, typed
 * metadata with arrays, tensor infos, alignment), td_model_load (architecture,
 * hyperparameters and every tensor's shape and type against them) and td_tokenizer_load
 * (the tokenizer.ggml.* metadata), then a few tokens through a tokenizer that loaded.
 * Seeds: tests/fuzz/corpus/gguf (vocab-only GGUF files and a tiny synthetic model).
 */
#include "fuzz_util.h"
#include "td_gguf.h"
#include "td_model.h"
#include "fuzz_tok.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[256];
    fuzz_file("in.gguf", data, size, path, sizeof path);
    td_gguf_t *g = NULL;
    if (td_gguf_open(path, &g) == TD_OK) {
        td_gguf_str_t s;
        uint64_t u;
        (void)td_gguf_get_str(g, "general.architecture", &s);
        (void)td_gguf_get_uint(g, "general.alignment", &u);
        td_gguf_close(g);
    }
    td_model_t *m = NULL;
    if (td_model_load(path, &m) == TD_OK)
        td_model_destroy(m);
    td_tokenizer_t *tok = NULL;
    if (td_tokenizer_load(path, &tok) == TD_OK) {
        fuzz_tokenizer_use(tok, data, size);
        td_tokenizer_destroy(tok);
    }
    return 0;
}
