#!/usr/bin/env python3
# The exact result of a Hugging Face model directory (config.json + model.safetensors, one
# file): a forward pass in float64 numpy, written from the transformers modelling code of each
# architecture, not from tandem's. It is the yardstick for tandem's dense and mixture-of-experts
# models (tests/unit/test_moe_ref.sh). Needs only numpy: the safetensors file is read here.
#
#   hf_ref.py MODEL_DIR --ids "256 72 101" [--n 16] [--logprobs K]
#       greedy continuation of the prompt ids, printed as `tandem generate --print-ids
#       --logprobs K --prompt-logprobs` prints it: the ids on one line, then one line per prompt
#       and generated token, "logprob prompt|gen I ID LOGPROB ID:LOGPROB ..." with the K most
#       likely alternatives; it stops after an eos id as tandem does (unprinted in the ids line)
#
# Architectures: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v biases),
# Qwen3ForCausalLM (q/k RMS norms per head), MixtralForCausalLM and Qwen3MoeForCausalLM. The
# model math: RMSNorm (x / sqrt(mean(x^2) + eps) * w), rotate_half RoPE on the two halves of
# each head, grouped-query attention scaled by 1/sqrt(head_dim), SwiGLU. A mixture of experts
# (transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock): router logits h @ gate.T,
# softmax over all experts, the top k (equal logits: the lower id), renormalised to sum 1
# when Mixtral or norm_topk_prob, each token's output the weighted sum of its k experts'.
import argparse
import json
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        buf = raw[base + a:base + b]
        if t["dtype"] == "F32":
            v = np.frombuffer(buf, dtype="<f4")
        elif t["dtype"] == "F16":
            v = np.frombuffer(buf, dtype="<f2")
        elif t["dtype"] == "BF16":
            v = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            sys.exit(f"hf_ref.py: {name}: dtype {t['dtype']} is not read here")
        out[name] = v.astype(np.float64).reshape(t["shape"])
    return out


class Model:
    def __init__(self, d):
        with open(f"{d}/config.json") as f:
            c = json.load(f)
        self.arch = c["architectures"][0]
        known = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MixtralForCausalLM", "Qwen3MoeForCausalLM")
        if self.arch not in known:
            sys.exit(f"hf_ref.py: architecture {self.arch} is not implemented here")
        self.w = load_safetensors(f"{d}/model.safetensors")
        self.n_layer = c["num_hidden_layers"]
        self.dim = c["hidden_size"]
        self.n_head = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads", self.n_head)
        self.hd = c.get("head_dim") or self.dim // self.n_head
        self.eps = c.get("rms_norm_eps", 1e-6)
        theta = c.get("rope_theta", 10000.0)
        self.inv_freq = 1.0 / theta ** (np.arange(0, self.hd, 2, dtype=np.float64) / self.hd)
        self.qk_norm = self.arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        self.mixtral = self.arch == "MixtralForCausalLM"
        self.n_expert = c.get("num_local_experts" if self.mixtral else "num_experts", 0)
        if self.arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
            self.n_expert = 0
        self.top_k = c.get("num_experts_per_tok", 0)
        self.norm_topk = self.mixtral or bool(c.get("norm_topk_prob", False))
        eos = c.get("eos_token_id")
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.emb = self.w["model.embed_tokens.weight"]
        self.out = self.w.get("lm_head.weight", self.emb) if not c.get("tie_word_embeddings") else self.emb

    def rms(self, x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * g

    def rope(self, x, pos):  # x [T, H, hd]: rotate_half on the halves of each head
        ang = pos[:, None] * self.inv_freq[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        h = self.hd // 2
        x0, x1 = x[..., :h], x[..., h:]
        return np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)

    def ffn(self, p, h):
        w = self.w
        if self.n_expert == 0:
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            return ((g / (1.0 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
        pre = p + ("block_sparse_moe." if self.mixtral else "mlp.")
        names = ("w1", "w3", "w2") if self.mixtral else ("gate_proj", "up_proj", "down_proj")
        logits = h @ w[pre + "gate.weight"].T  # [T, n_expert]
        prob = np.exp(logits - logits.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            top = sorted(range(self.n_expert), key=lambda e: (-logits[t, e], e))[:self.top_k]
            wt = prob[t, top]
            if self.norm_topk:
                wt = wt / wt.sum()
            for e, g_e in zip(top, wt):
                q = f"{pre}experts.{e}."
                g = h[t] @ w[q + names[0] + ".weight"].T
                u = h[t] @ w[q + names[1] + ".weight"].T
                out[t] += g_e * (((g / (1.0 + np.exp(-g))) * u) @ w[q + names[2] + ".weight"].T)
        return out

    def forward(self, toks, cache, pos0):
        """Logits [T, vocab] of toks at positions pos0.., extending cache (list of (K, V))."""
        T, hd, w = len(toks), self.hd, self.w
        x = self.emb[np.asarray(toks)]
        pos = np.arange(pos0, pos0 + T, dtype=np.float64)
        mask = np.triu(np.full((T, pos0 + T), -np.inf), pos0 + 1)
        group = self.n_head // self.n_kv
        for l in range(self.n_layer):
            p = f"model.layers.{l}."
            h = self.rms(x, w[p + "input_layernorm.weight"])

            def proj(name, heads):
                y = h @ w[p + f"self_attn.{name}_proj.weight"].T
                if p + f"self_attn.{name}_proj.bias" in w:
                    y = y + w[p + f"self_attn.{name}_proj.bias"]
                return y.reshape(T, heads, hd)
            q, k, v = proj("q", self.n_head), proj("k", self.n_kv), proj("v", self.n_kv)
            if self.qk_norm:
                q = self.rms(q, w[p + "self_attn.q_norm.weight"])
                k = self.rms(k, w[p + "self_attn.k_norm.weight"])
            q, k = self.rope(q, pos), self.rope(k, pos)
            if len(cache) <= l:
                cache.append((k, v))
            else:
                cache[l] = (np.concatenate([cache[l][0], k]), np.concatenate([cache[l][1], v]))
            K = np.repeat(cache[l][0], group, axis=1)
            V = np.repeat(cache[l][1], group, axis=1)
            att = np.einsum("thd,shd->hts", q, K) / np.sqrt(hd) + mask[None]
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            x = x + np.einsum("hts,shd->thd", att, V).reshape(T, self.n_head * hd) @ w[p + "self_attn.o_proj.weight"].T
            x = x + self.ffn(p, self.rms(x, w[p + "post_attention_layernorm.weight"]))
        return self.rms(x, w["model.norm.weight"]) @ self.out.T


def logprob_line(kind, i, tok, lg, k):
    lp = lg - lg.max() - np.log(np.exp(lg - lg.max()).sum())
    alts = sorted(range(len(lp)), key=lambda v: (-lp[v], v))[:k]
    return f"logprob {kind} {i} {tok} {lp[tok]:.6f}" + "".join(f" {a}:{lp[a]:.6f}" for a in alts)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--ids", required=True, help="prompt token ids, space-separated")
    ap.add_argument("--n", type=int, default=16, help="tokens to generate")
    ap.add_argument("--logprobs", type=int, default=3, help="alternatives per line")
    a = ap.parse_args()
    m = Model(a.model)
    ids = [int(t) for t in a.ids.split()]
    cache = []
    lg = m.forward(ids, cache, 0)
    lines = [f"logprob prompt 0 {ids[0]} 0.000000"]  # the first token has no context: tandem's 0
    lines += [logprob_line("prompt", i, ids[i], lg[i - 1], a.logprobs) for i in range(1, len(ids))]
    row, pos, gen = lg[-1], len(ids), []
    for i in range(a.n):
        tok = int(np.argmax(row))
        lines.append(logprob_line("gen", i, tok, row, a.logprobs))
        if tok in m.eos:
            break
        gen.append(tok)
        row = m.forward([tok], cache, pos)[-1]
        pos += 1
    print(" ".join(map(str, gen)))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
