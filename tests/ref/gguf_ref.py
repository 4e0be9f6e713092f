#!/usr/bin/env python3
# The exact result of a Llama-architecture GGUF model: every tensor dequantized with gguf-py's
# reference dequantizers (gguf.quants.dequantize), then a forward pass in float64 numpy. It is
# the yardstick for tandem's greedy tokens and perplexity (tests/unit/test_ref_smollm2.sh,
# docs/correctness.md). Needs Python with the packages gguf and numpy. Token ids in, ids and
# figures out: tokenization is not its job (tandem's tokenizer is checked against llama.cpp's).
#
#   gguf_ref.py greedy MODEL.gguf --ids "1 2 3" [--n 64]
#       greedy continuation, one line per token: "id margin" (margin: the top logit minus the
#       runner-up, so a near-tie, where any rounding may flip the choice, shows); it stops after
#       the end-of-generation token (tokenizer.ggml.eos_token_id), as tandem and llama.cpp do
#   gguf_ref.py perplexity MODEL.gguf --ids-file IDS.txt --ctx 128
#       llama-perplexity's method on a token list (the text tokenized as llama.cpp does, BOS
#       included when the model adds one): chunks of ctx tokens, each a fresh context, the first
#       token of each chunk replaced by BOS when tokenizer.ggml.add_bos_token says so, the
#       second half of each chunk scored; prints "PPL = X" with 6 decimals
#
# The model math follows llama.cpp's llama graph: RMSNorm (x / sqrt(mean(x^2) + eps) * w),
# RoPE in ggml's "normal" mode on adjacent pairs (x[2i], x[2i+1]) (the GGUF converter permuted
# q/k for it) with theta = pos * base^(-2i/n_rot), divided by rope_freqs when the file has them,
# grouped-query attention scaled by 1/sqrt(head_dim), SwiGLU (silu(gate) * up), and the output
# matrix tied to token_embd when the file has no output.weight.
import argparse
import sys

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("gguf_ref.py: needs the Python package gguf (pip install gguf numpy)")


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            sys.exit(f"gguf_ref.py: the file has no metadata key {key}")
        return default
    return f.contents()


class Model:
    def __init__(self, path):
        r = gguf.GGUFReader(path)
        arch = field(r, "general.architecture")
        if arch not in ("llama", "mistral"):
            sys.exit(f"gguf_ref.py: architecture {arch} is not a Llama-architecture model")
        scaling = field(r, f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", ""):
            sys.exit(f"gguf_ref.py: rope scaling {scaling} is not implemented here")
        self.n_layer = int(field(r, f"{arch}.block_count"))
        self.dim = int(field(r, f"{arch}.embedding_length"))
        self.n_head = int(field(r, f"{arch}.attention.head_count"))
        self.n_kv = int(field(r, f"{arch}.attention.head_count_kv", self.n_head))
        self.head_dim = self.dim // self.n_head
        self.n_rot = int(field(r, f"{arch}.rope.dimension_count", self.head_dim))
        self.theta = float(field(r, f"{arch}.rope.freq_base", 10000.0))
        self.eps = float(field(r, f"{arch}.attention.layer_norm_rms_epsilon"))
        self.add_bos = bool(field(r, "tokenizer.ggml.add_bos_token", True))
        self.bos = int(field(r, "tokenizer.ggml.bos_token_id"))
        self.eos = int(field(r, "tokenizer.ggml.eos_token_id"))
        w = {}
        for t in r.tensors:
            # gguf-py gives rows of ne0 values: [ne1, ne0] for a matrix, as y = W @ x needs
            w[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        self.w = w
        self.emb = w["token_embd.weight"]
        self.out = w.get("output.weight", self.emb)
        self.vocab = self.emb.shape[0]
        i = np.arange(0, self.n_rot, 2, dtype=np.float64)
        self.freqs = self.theta ** (-i / self.n_rot)
        if "rope_freqs.weight" in w:
            self.freqs = self.freqs / w["rope_freqs.weight"]

    def rms(self, x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * g

    def rope(self, x, pos):  # x [T, H, head_dim]: adjacent pairs within the first n_rot dims
        ang = pos[:, None] * self.freqs[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x = x.copy()
        x0, x1 = x[..., 0:self.n_rot:2].copy(), x[..., 1:self.n_rot:2].copy()
        x[..., 0:self.n_rot:2] = x0 * c - x1 * s
        x[..., 1:self.n_rot:2] = x0 * s + x1 * c
        return x

    def forward(self, toks, cache, pos0):
        """Logits [T, vocab] of toks at positions pos0.., extending cache (list of (K, V))."""
        T, hd, w = len(toks), self.head_dim, self.w
        x = self.emb[np.asarray(toks)]
        pos = np.arange(pos0, pos0 + T, dtype=np.float64)
        mask = np.triu(np.full((T, pos0 + T), -np.inf), pos0 + 1)
        group = self.n_head // self.n_kv
        for l in range(self.n_layer):
            p = f"blk.{l}."
            h = self.rms(x, w[p + "attn_norm.weight"])
            q = self.rope((h @ w[p + "attn_q.weight"].T).reshape(T, self.n_head, hd), pos)
            k = self.rope((h @ w[p + "attn_k.weight"].T).reshape(T, self.n_kv, hd), pos)
            v = (h @ w[p + "attn_v.weight"].T).reshape(T, self.n_kv, hd)
            if len(cache) <= l:
                cache.append((k, v))
            else:
                cache[l] = (np.concatenate([cache[l][0], k]), np.concatenate([cache[l][1], v]))
            K = np.repeat(cache[l][0], group, axis=1)
            V = np.repeat(cache[l][1], group, axis=1)
            att = np.einsum("thd,shd->hts", q, K) / np.sqrt(hd) + mask[None]
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            x = x + np.einsum("hts,shd->thd", att, V).reshape(T, self.dim) @ w[p + "attn_output.weight"].T
            h = self.rms(x, w[p + "ffn_norm.weight"])
            g = h @ w[p + "ffn_gate.weight"].T
            u = h @ w[p + "ffn_up.weight"].T
            x = x + ((g / (1.0 + np.exp(-g))) * u) @ w[p + "ffn_down.weight"].T
        return self.rms(x, w["output_norm.weight"]) @ self.out.T


def greedy(m, ids, n):
    cache = []
    logits = m.forward(ids, cache, 0)[-1]
    pos = len(ids)
    for _ in range(n):
        top2 = np.argsort(logits)[-2:]
        tok = int(top2[1])
        print(tok, f"{logits[top2[1]] - logits[top2[0]]:.6f}", flush=True)
        if tok == m.eos:
            break
        logits = m.forward([tok], cache, pos)[-1]
        pos += 1


def perplexity(m, toks, n_ctx):
    if len(toks) < 2 * n_ctx:
        sys.exit(f"gguf_ref.py: {len(toks)} tokens, need at least {2 * n_ctx} for --ctx {n_ctx}")
    first = n_ctx // 2
    nll, count = 0.0, 0
    for c in range(len(toks) // n_ctx):
        chunk = list(toks[c * n_ctx:(c + 1) * n_ctx])
        if m.add_bos:
            chunk[0] = m.bos
        lg = m.forward(chunk, [], 0)[first:n_ctx - 1]
        mx = lg.max(-1, keepdims=True)
        logp = lg - mx - np.log(np.exp(lg - mx).sum(-1, keepdims=True))
        tgt = np.asarray(chunk[first + 1:n_ctx])
        nll -= logp[np.arange(len(tgt)), tgt].sum()
        count += len(tgt)
        print(f"[{c + 1}] {np.exp(nll / count):.6f}", file=sys.stderr, flush=True)
    print(f"PPL = {np.exp(nll / count):.6f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mode", choices=["greedy", "perplexity"])
    ap.add_argument("model")
    ap.add_argument("--ids", help="prompt token ids, space-separated (greedy)")
    ap.add_argument("--ids-file", help="file of token ids, whitespace-separated (perplexity)")
    ap.add_argument("--n", type=int, default=64, help="tokens to generate (greedy)")
    ap.add_argument("--ctx", type=int, default=128, help="chunk length (perplexity)")
    a = ap.parse_args()
    m = Model(a.model)
    if a.mode == "greedy":
        if not a.ids:
            sys.exit("gguf_ref.py: greedy needs --ids")
        greedy(m, [int(t) for t in a.ids.split()], a.n)
    else:
        if not a.ids_file:
            sys.exit("gguf_ref.py: perplexity needs --ids-file")
        with open(a.ids_file) as f:
            perplexity(m, [int(t) for t in f.read().split()], a.ctx)


if __name__ == "__main__":
    main()
