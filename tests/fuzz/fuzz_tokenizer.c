/*
 * fuzz_tokenizer: the tokenizer files tandem reads besides GGUF metadata. The first byte
 * picks the file: even, a tokenizer.json (with a fixed tokenizer_config.json beside it);
 * odd, a llama2.c tokenizer.bin. The rest is the file; td_tokenizer_load decides the
 * format by content, as it does for a model. Whatever loads is used (fuzz_tok.h).
 * Seeds: tests/fuzz/corpus/tokenizer (the byte-level fixture's tokenizer.json and a
 * small tokenizer.bin, each behind its selector byte).
 */
#include "fuzz_tok.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    char path[256];
    static const uint8_t cfg[] = "{\"add_bos_token\": true, \"chat_template\": \"{{ messages }}\"}";
    char cfg_path[256];
    fuzz_file("tokenizer_config.json", cfg, sizeof cfg - 1, cfg_path, sizeof cfg_path);
    fuzz_file(data[0] % 2 ? "tokenizer.bin" : "tokenizer.json", data + 1, size - 1, path, sizeof path);
    td_tokenizer_t *tok = NULL;
    if (td_tokenizer_load(path, &tok) == TD_OK) {
        fuzz_tokenizer_use(tok, data + 1, size - 1);
        td_tokenizer_destroy(tok);
    }
    return 0;
}
