/*
 * fuzz_chat_template: a GGUF's or tokenizer_config.json's chat template (Jinja, the subset
 * td_chat_template implements) compiled and rendered over a fixed three-turn conversation
 * under tight limits (the router renders every chat request with it). The input up to its
 * first NUL byte is the template; what follows, when present, is the user's message.
 * Seeds: tests/fuzz/corpus/chat_template (the templates of tests/fixtures/chat).
 */
#include "fuzz_util.h"
#include "td_chat_template.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_dir(); /* logging off */
    const uint8_t *nul = memchr(data, 0, size);
    size_t src_len = nul ? (size_t)(nul - data) : size;
    char *user = nul ? fuzz_cstr(nul + 1, size - src_len - 1) : fuzz_cstr((const uint8_t *)"Hi", 2);
    td_chat_template_t *t = NULL;
    char err[256];
    if (td_chat_template_create((const char *)data, src_len, &t, err, sizeof err) == TD_OK) {
        td_chat_message_t msgs[] = {{.role = "system", .content = "Be brief."}, {.role = "user", .content = user}, {.role = "assistant", .content = "Hello."}};
        td_chat_render_t r = td_chat_render_default();
        r.messages = msgs;
        r.n_messages = 3;
        r.bos_token = "<s>";
        r.eos_token = "</s>";
        r.add_generation_prompt = true;
        r.max_output = 64 * 1024;
        r.max_steps = 20000;
        r.max_memory = 4 << 20;
        char *out = NULL;
        size_t len;
        if (td_chat_template_render(t, &r, &out, &len, err, sizeof err) == TD_OK)
            free(out);
        td_chat_template_destroy(t);
    }
    free(user);
    return 0;
}
