#!/usr/bin/env python3
# Rewrites a GGUF with every tensor dequantized to F32 by gguf-py's reference dequantizers,
# metadata unchanged. docs/correctness.md uses it to check tests/ref/gguf_ref.py itself:
# llama.cpp on the F32 file (F32 KV cache, no activation quantization) must agree with the
# float64 reference to float32 rounding, which a wrong RoPE, norm or attention would not.
#   gguf_to_f32.py IN.gguf OUT.gguf
import sys

import gguf

src, dst = sys.argv[1:3]
r = gguf.GGUFReader(src)
w = gguf.GGUFWriter(dst, arch=r.fields["general.architecture"].contents())
for key, f in r.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
        continue
    vtype = f.types[0]
    sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    if key == "general.file_type":
        w.add_key_value(key, int(gguf.LlamaFileType.ALL_F32), vtype)
        continue
    w.add_key_value(key, f.contents(), vtype, sub)
for t in r.tensors:
    w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
