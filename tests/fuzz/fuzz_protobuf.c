/*
 * fuzz_protobuf: every protobuf message of proto/ (the gateway's, the control plane's and
 * grpc.health's) unpacked from the input by protobuf-c; the first byte picks the message.
 * A message that unpacks is packed again (the packed size must be what
 * get_packed_size said) and the packing unpacked once more. Packing is not required to be
 * stable: protobuf-c keeps unknown fields (nested ones too) and writes them back as they
 * came, an overlong tag 0 included, which it then refuses; tandem never forwards a message
 * it did not build.
 * Seeds: tests/fuzz/corpus/protobuf (a typical message of each kind).
 */
#include <protobuf-c/protobuf-c.h>

#include "control.pb-c.h"
#include "fuzz_util.h"
#include "health.pb-c.h"
#include "tandem.pb-c.h"

static const ProtobufCMessageDescriptor *const descs[] = {
#include "fuzz_proto_list.h"
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const ProtobufCMessageDescriptor *d = descs[data[0] % (sizeof descs / sizeof descs[0])];
    ProtobufCMessage *m = protobuf_c_message_unpack(d, NULL, size - 1, data + 1);
    if (!m)
        return 0;
    size_t n = protobuf_c_message_get_packed_size(m);
    uint8_t *a = malloc(n ? n : 1);
    if (!a || protobuf_c_message_pack(m, a) != n) {
        fprintf(stderr, "fuzz_protobuf: %s: packed size differs from get_packed_size\n", d->name);
        abort();
    }
    ProtobufCMessage *m2 = protobuf_c_message_unpack(d, NULL, n, a);
    if (m2)
        protobuf_c_message_free_unpacked(m2, NULL);
    free(a);
    protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}
