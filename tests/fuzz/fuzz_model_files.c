/*
 * fuzz_model_files: a Hugging Face model folder as td_model_load reads it. The first byte
 * picks which file the rest is: even, config.json (beside a fixed valid model.safetensors
 * of a 2-layer model); odd, model.safetensors (beside a fixed valid config.json). Also the
 * safetensors header alone (td_safetensors_open) and the config alone
 * (td_model_config_from_json).
 * Seeds: tests/fuzz/corpus/model_files (the valid pair, each behind its selector byte).
 */
#include <sys/stat.h>

#include "fuzz_util.h"
#include "td_model.h"
#include "td_safetensors.h"

/* The fixed partner files: written by tests/fuzz/make_seeds.py beside the harness's seeds
 * (FUZZ_MODEL_DIR, a folder with config.json and model.safetensors), copied once. */
static const uint8_t *slurp(const char *path, size_t *n_p)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fuzz_model_files: %s: cannot open (set FUZZ_MODEL_DIR to tests/fuzz/model)\n", path);
        abort();
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n + 1);
    if (!b || fread(b, 1, (size_t)n, f) != (size_t)n)
        abort();
    fclose(f);
    *n_p = (size_t)n;
    return b;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const uint8_t *cfg, *st;
    static size_t n_cfg, n_st;
    if (!cfg) {
        const char *dir = getenv("FUZZ_MODEL_DIR");
        char p[1024];
        snprintf(p, sizeof p, "%s/config.json", dir ? dir : "tests/fuzz/model");
        cfg = slurp(p, &n_cfg);
        snprintf(p, sizeof p, "%s/model.safetensors", dir ? dir : "tests/fuzz/model");
        st = slurp(p, &n_st);
    }
    if (size < 1)
        return 0;
    bool is_st = data[0] % 2;
    char path[256], cfg_path[256], st_path[256];
    fuzz_file("config.json", is_st ? cfg : data + 1, is_st ? n_cfg : size - 1, cfg_path, sizeof cfg_path);
    fuzz_file("model.safetensors", is_st ? data + 1 : st, is_st ? size - 1 : n_st, st_path, sizeof st_path);
    snprintf(path, sizeof path, "%s", fuzz_dir());
    td_model_t *m = NULL;
    if (td_model_load(path, &m) == TD_OK)
        td_model_destroy(m);
    if (is_st) {
        td_safetensors_t *s = NULL;
        if (td_safetensors_open(st_path, &s) == TD_OK)
            td_safetensors_close(s);
    } else {
        char *json = fuzz_cstr(data + 1, size - 1);
        td_model_config_t c;
        (void)td_model_config_from_json(json, "config.json", &c);
        free(json);
    }
    return 0;
}
