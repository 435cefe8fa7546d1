#!/usr/bin/env python3
"""Independent numpy reference of Qwen3-MoE and Mixtral, written from the Hugging Face
modeling definitions (modeling_qwen3_moe.py, modeling_mixtral.py), in float64.

It reads the model directory itself (its own safetensors parser, not the C one), runs the
whole prompt at once with a causal mask (the C runtime uses a KV cache and batches), and
writes the float32 logits of every prompt position, row-major [positions x vocab], then
optionally greedy-decodes by re-running the full sequence each step (no cache at all).

  ref_moe.py --model DIR --prompt 1,2,3 --logits OUT.f32 [--greedy N]
"""

import argparse
import json
import os
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        b, e = d["data_offsets"]
        raw = data[base + b:base + e]
        if d["dtype"] == "F32":
            a = np.frombuffer(raw, dtype="<f4")
        elif d["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif d["dtype"] == "F16":
            a = np.frombuffer(raw, dtype="<f2")
        elif d["dtype"] == "F8_E4M3":
            a = E4M3[np.frombuffer(raw, dtype="u1")]
        else:
            raise SystemExit("unsupported dtype " + d["dtype"])
        out[name] = a.astype(np.float64).reshape(d["shape"])
    return out


def e4m3_table():
    # float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
    # 0x7f / 0xff NaN; subnormals m * 2^-9
    t = np.zeros(256, dtype=np.float32)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        v = m * 2.0 ** -9 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
        if b & 0x7f == 0x7f:
            v = float("nan")
        t[b] = -v if b & 0x80 else v
    return t


E4M3 = e4m3_table()


def dequant_fp8(cfg, w):
    # Hugging Face / DeepSeek block FP8: weight (F8_E4M3) times weight_scale_inv (F32, one
    # per 128x128 block), in float32 as the runtime does it, then float64
    q = cfg.get("quantization_config")
    if not q:
        return w
    if q.get("quant_method") != "fp8" or list(q.get("weight_block_size", [])) != [128, 128]:
        raise SystemExit("unsupported quantization_config")
    for name in [n for n in w if n.endswith("_scale_inv")]:
        wn = name[: -len("_scale_inv")]
        s = w.pop(name).astype(np.float32)
        full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)
        full = full[: w[wn].shape[0], : w[wn].shape[1]]
        w[wn] = (w[wn].astype(np.float32) * full).astype(np.float64)
    return w


def load_model(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    w = {}
    if os.path.exists(idx):
        with open(idx) as f:
            for shard in sorted(set(json.load(f)["weight_map"].values())):
                w.update(load_safetensors(os.path.join(d, shard)))
    else:
        w = load_safetensors(os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    return cfg, dequant_fp8(cfg, w)


def rms_norm(x, weight, eps):
    # Qwen3MoeRMSNorm / MixtralRMSNorm: x * rsqrt(mean(x^2) + eps) * weight
    var = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(var + eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rope(x, pos, theta):
    # x: [heads, T, hd]; default rope: inv_freq = 1 / theta^(2i/d), emb = cat(freqs, freqs)
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    freqs = np.outer(pos.astype(np.float64), inv)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return x * np.cos(emb)[None] + rotate_half(x) * np.sin(emb)[None]


def silu(x):
    return x / (1.0 + np.exp(-x))


def forward(cfg, w, ids):
    arch = cfg["architectures"][0]
    q3 = arch == "Qwen3MoeForCausalLM"
    H = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    # the config classes' defaults: absent is 4 (Qwen3MoeConfig) or 8 (MixtralConfig), null
    # is num_attention_heads
    nkv = cfg.get("num_key_value_heads", 4 if q3 else 8) or nh
    hd = cfg.get("head_dim") or H // nh
    eps = cfg.get("rms_norm_eps", 1e-6 if q3 else 1e-5)
    bias = q3 and cfg.get("attention_bias", False)
    # masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window (Mixtral; Qwen3
    # only with use_sliding_window)
    window = cfg.get("sliding_window") if (not q3 or cfg.get("use_sliding_window")) else None
    theta = cfg.get("rope_theta", 10000.0 if q3 else 1e6)
    k_top = cfg["num_experts_per_tok"]
    E = cfg["num_experts"] if q3 else cfg["num_local_experts"]
    norm_topk = cfg.get("norm_topk_prob", False) if q3 else True
    mlp_only = set(cfg.get("mlp_only_layers") or []) if q3 else set()
    step = cfg.get("decoder_sparse_step", 1) if q3 else 1
    T = len(ids)
    pos = np.arange(T)
    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    if window:
        qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
        mask[ki <= qi - window] = -np.inf
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        def lin(name, inp):  # nn.Linear(bias=attention_bias)
            y = inp @ w[p + name + ".weight"].T
            return y + w[p + name + ".bias"] if bias else y
        q = lin("self_attn.q_proj", h).reshape(T, nh, hd).transpose(1, 0, 2)
        k = lin("self_attn.k_proj", h).reshape(T, nkv, hd).transpose(1, 0, 2)
        v = lin("self_attn.v_proj", h).reshape(T, nkv, hd).transpose(1, 0, 2)
        if q3:  # Qwen3: RMSNorm over head_dim of q and k, before RoPE
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = rope(q, pos, theta)
        k = rope(k, pos, theta)
        rep = nh // nkv  # repeat_kv
        k = np.repeat(k, rep, axis=0)
        v = np.repeat(v, rep, axis=0)
        s = q @ k.transpose(0, 2, 1) * (hd ** -0.5) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(T, nh * hd)
        x = x + lin("self_attn.o_proj", a)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        dense = q3 and (l in mlp_only or not (E > 0 and (l + 1) % step == 0))
        if dense:
            m = p + "mlp."
            y = (silu(h @ w[m + "gate_proj.weight"].T) * (h @ w[m + "up_proj.weight"].T)) \
                @ w[m + "down_proj.weight"].T
        else:
            m = p + ("mlp." if q3 else "block_sparse_moe.")
            logits = h @ w[m + "gate.weight"].T
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs = probs / probs.sum(-1, keepdims=True)
            y = np.zeros_like(h)
            for t in range(T):
                top = np.argsort(-probs[t], kind="stable")[:k_top]
                wts = probs[t][top]
                if norm_topk:
                    wts = wts / wts.sum()
                for e, wt in sorted(zip(top, wts)):
                    g = "gate_proj" if q3 else "w1"
                    u = "up_proj" if q3 else "w3"
                    dn = "down_proj" if q3 else "w2"
                    ep = m + "experts.%d." % e
                    out = (silu(h[t] @ w[ep + g + ".weight"].T) * (h[t] @ w[ep + u + ".weight"].T)) \
                        @ w[ep + dn + ".weight"].T
                    y[t] += wt * out
        x = x + y
    x = rms_norm(x, w["model.norm.weight"], eps)
    # tie_word_embeddings: the head is the embedding (PreTrainedModel.tie_weights)
    head = w.get("lm_head.weight")
    if head is None or cfg.get("tie_word_embeddings", False):
        head = w["model.embed_tokens.weight"]
    return x @ head.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--logits", required=True)
    ap.add_argument("--greedy", type=int, default=0)
    a = ap.parse_args()
    cfg, w = load_model(a.model)
    ids = [int(t) for t in a.prompt.split(",")]
    logits = forward(cfg, w, np.array(ids))
    logits.astype("<f4").tofile(a.logits)
    gen = []
    seq = list(ids)
    for _ in range(a.greedy):
        nxt = int(np.argmax(forward(cfg, w, np.array(seq))[-1]))
        gen.append(nxt)
        seq.append(nxt)
    print(json.dumps({"greedy": gen}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
