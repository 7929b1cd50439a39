#!/usr/bin/python3
"""Write a small random Llama-family model in Hugging Face layout.

Produces config.json + model.safetensors (or, with --sharded, N files
model-0000X-of-0000N.safetensors + model.safetensors.index.json), using only
numpy and a self-contained safetensors writer. Meant for testing
llama_ref.py and the pdserve C++ engine on tiny models, e.g.

    /usr/bin/python3 tests/reference/make_test_model.py /tmp/tiny \
        --dtype BF16 --kv-heads 2 --rope-llama3 --sharded 2

Options: --dtype F32|F16|BF16, --sharded [N], --qkv-bias (written as a
Qwen2ForCausalLM config), --qk-norm (per-head q/k RMSNorm weights, written as
a Qwen3ForCausalLM config), --mistral (a MistralForCausalLM config with a
sliding window), --tied (tie_word_embeddings, no lm_head.weight),
--rope-llama3 (llama3 rope_scaling chosen so all three frequency bands occur),
--kv-heads, plus the sizes (--hidden, --heads, --head-dim, --layers, ...);
--deepseek 2|3 writes a DeepSeek-V2/V3 checkpoint (MLA + DeepSeek MoE, see
make_deepseek_model: --q-lora-rank, --kv-lora-rank, --qk-nope, --qk-rope,
--v-head, --topk-method, --n-group, --topk-group, --shared, --first-dense,
--yarn FACTOR MSCALE MSCALE_ALL_DIM, ...).

make_model() is importable; it also returns the weights exactly as stored
(rounded to the storage dtype, as float64 numpy arrays).
"""

import argparse
import json
import os
import struct
import sys

import numpy as np


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 -> bfloat16 (round to nearest even), returned as uint16 bits."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def encode(x: np.ndarray, dtype: str):
    """Return (raw little-endian bytes, values as float64 after rounding to dtype)."""
    if dtype == "F32":
        a = x.astype("<f4")
        return a.tobytes(), a.astype(np.float64)
    if dtype == "F16":
        a = x.astype("<f2")
        return a.tobytes(), a.astype(np.float64)
    if dtype == "BF16":
        bits = float32_to_bf16_bits(x).astype("<u2")
        back = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return bits.tobytes(), back.astype(np.float64)
    raise ValueError(f"unsupported dtype {dtype}")


def write_safetensors(path: str, tensors: dict, metadata: dict = None):
    """tensors: name -> (raw bytes, dtype tag, shape). Header padded to 8 bytes."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, (raw, dtype, shape) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for raw, _, _ in tensors.values():
            f.write(raw)


def make_model(out_dir, *, hidden=32, intermediate=48, layers=2, heads=4, kv_heads=None,
               head_dim=None, vocab=64, dtype="F32", shards=1, qkv_bias=False, tied=False,
               rope_llama3=False, rope_theta=10000.0, eps=1e-5, seed=0, qk_norm=False,
               mistral=False, moe=None, experts=4, top_k=2, moe_intermediate=16,
               norm_topk_prob=True, sparse_step=1, mlp_only=()):
    """Write a random model to out_dir; return (config dict, {name: float64 array as stored}).

    moe: "mixtral" (every layer sparse, experts of `intermediate`) or "qwen3_moe"
    (q/k norm; experts of `moe_intermediate`; layer i sparse unless in
    `mlp_only` or (i + 1) % sparse_step != 0, as transformers decides)."""
    kv_heads = kv_heads or heads
    if moe == "qwen3_moe":
        qk_norm = True
    if moe == "mixtral":
        moe_intermediate = intermediate

    def sparse(i):
        return moe is not None and i not in mlp_only and (i + 1) % sparse_step == 0
    d = head_dim or hidden // heads
    rng = np.random.default_rng(seed)

    def linear(n_out, n_in):
        return rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)

    def norm_weight():
        return 1.0 + 0.1 * rng.standard_normal(hidden)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden))}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = linear(heads * d, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(kv_heads * d, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(kv_heads * d, hidden)
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = 0.5 * rng.standard_normal(heads * d)
            w[p + "self_attn.k_proj.bias"] = 0.5 * rng.standard_normal(kv_heads * d)
            w[p + "self_attn.v_proj.bias"] = 0.5 * rng.standard_normal(kv_heads * d)
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = 1.0 + 0.3 * rng.standard_normal(d)
            w[p + "self_attn.k_norm.weight"] = 1.0 + 0.3 * rng.standard_normal(d)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * d)
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        if sparse(i):
            moe_p = p + ("block_sparse_moe." if moe == "mixtral" else "mlp.")
            # A wide router spread keeps the top-k choices clear of near-ties.
            w[moe_p + "gate.weight"] = 2.0 * linear(experts, hidden)
            names = ("w1", "w3", "w2") if moe == "mixtral" else ("gate_proj", "up_proj", "down_proj")
            for e in range(experts):
                ep = f"{moe_p}experts.{e}."
                w[ep + names[0] + ".weight"] = linear(moe_intermediate, hidden)
                w[ep + names[1] + ".weight"] = linear(moe_intermediate, hidden)
                w[ep + names[2] + ".weight"] = linear(hidden, moe_intermediate)
            continue
        w[p + "mlp.gate_proj.weight"] = linear(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = linear(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, intermediate)
    w["model.norm.weight"] = norm_weight()
    if not tied:
        w["lm_head.weight"] = linear(vocab, hidden)

    if qk_norm and qkv_bias:
        raise ValueError("--qk-norm (Qwen3) and --qkv-bias (Qwen2) are different families")
    arch, model_type = "LlamaForCausalLM", "llama"
    if qkv_bias:
        arch, model_type = "Qwen2ForCausalLM", "qwen2"
    elif qk_norm:
        arch, model_type = "Qwen3ForCausalLM", "qwen3"
    elif mistral:
        arch, model_type = "MistralForCausalLM", "mistral"
    if moe == "mixtral":
        arch, model_type = "MixtralForCausalLM", "mixtral"
    elif moe == "qwen3_moe":
        arch, model_type = "Qwen3MoeForCausalLM", "qwen3_moe"
    elif moe is not None:
        raise ValueError(f"unknown --moe family {moe}")
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 256,
        "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype],
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    if qk_norm:
        config["attention_bias"] = False
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if mistral:
        config["sliding_window"] = 4096
    if moe == "mixtral":
        config.update(num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None)
    elif moe == "qwen3_moe":
        config.update(num_experts=experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=moe_intermediate, norm_topk_prob=norm_topk_prob,
                      decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only))
    if rope_llama3:
        # With head_dim 8..16 and theta 1e4 the wavelengths span ~6..2e4, so an
        # original context of 64 with factors 1/4 puts frequencies in all three bands.
        config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    stored, encoded = {}, {}
    for name, value in w.items():
        raw, back = encode(value, dtype)
        encoded[name] = (raw, dtype, value.shape)
        stored[name] = back

    meta = {"format": "pt"}
    if shards <= 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), encoded, meta)
    else:
        names = list(encoded)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: encoded[n] for n in names[s::shards]}
            write_safetensors(os.path.join(out_dir, fname), part, meta)
            weight_map.update({n: fname for n in part})
        total = sum(len(raw) for raw, _, _ in encoded.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return config, stored


def make_deepseek_model(out_dir, *, version=2, hidden=32, intermediate=48, layers=3, heads=4,
                        vocab=64, dtype="F32", shards=1, q_lora_rank=0, kv_lora_rank=16,
                        qk_nope=8, qk_rope=4, v_head=6, experts=8, top_k=2, moe_intermediate=12,
                        n_group=4, topk_group=2, topk_method=None, shared=1, first_dense=1,
                        moe_layer_freq=1, norm_topk_prob=None, routed_scale=2.0,
                        yarn=None, rope_theta=10000.0, eps=1e-6, seed=0,
                        rope_interleave=True):
    """A random DeepSeek-V2 (version 2) or V3 (version 3) checkpoint in the
    layout of their Hugging Face releases: MLA projections (q_proj, or with
    q_lora_rank q_a_proj/q_a_layernorm/q_b_proj; kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj), mlp.gate (+ e_score_correction_bias
    for noaux_tc), mlp.experts.E.*, mlp.shared_experts.* and dense mlp.* on
    the first `first_dense` layers and those off moe_layer_freq.
    yarn: None, or (factor, mscale, mscale_all_dim). Returns (config, stored)."""
    v3 = version == 3
    topk_method = topk_method or ("noaux_tc" if v3 else "group_limited_greedy")
    norm_topk_prob = v3 if norm_topk_prob is None else norm_topk_prob
    rng = np.random.default_rng(seed)

    def linear(n_out, n_in):
        return rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)

    def norm_weight(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    qh = qk_nope + qk_rope
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden))}
    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w[p + "input_layernorm.weight"] = norm_weight(hidden)
        if q_lora_rank:
            w[a + "q_a_proj.weight"] = linear(q_lora_rank, hidden)
            w[a + "q_a_layernorm.weight"] = norm_weight(q_lora_rank)
            w[a + "q_b_proj.weight"] = linear(heads * qh, q_lora_rank)
        else:
            w[a + "q_proj.weight"] = linear(heads * qh, hidden)
        w[a + "kv_a_proj_with_mqa.weight"] = linear(kv_lora_rank + qk_rope, hidden)
        w[a + "kv_a_layernorm.weight"] = norm_weight(kv_lora_rank)
        w[a + "kv_b_proj.weight"] = linear(heads * (qk_nope + v_head), kv_lora_rank)
        w[a + "o_proj.weight"] = linear(hidden, heads * v_head)
        w[p + "post_attention_layernorm.weight"] = norm_weight(hidden)
        if experts and i >= first_dense and i % moe_layer_freq == 0:
            m = p + "mlp."
            w[m + "gate.weight"] = 2.0 * linear(experts, hidden)
            if topk_method == "noaux_tc":
                w[m + "gate.e_score_correction_bias"] = 0.05 * rng.standard_normal(experts)
            for e in range(experts):
                ep = f"{m}experts.{e}."
                w[ep + "gate_proj.weight"] = linear(moe_intermediate, hidden)
                w[ep + "up_proj.weight"] = linear(moe_intermediate, hidden)
                w[ep + "down_proj.weight"] = linear(hidden, moe_intermediate)
            if shared:
                sp = m + "shared_experts."
                w[sp + "gate_proj.weight"] = linear(shared * moe_intermediate, hidden)
                w[sp + "up_proj.weight"] = linear(shared * moe_intermediate, hidden)
                w[sp + "down_proj.weight"] = linear(hidden, shared * moe_intermediate)
            continue
        w[p + "mlp.gate_proj.weight"] = linear(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = linear(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, intermediate)
    w["model.norm.weight"] = norm_weight(hidden)
    w["lm_head.weight"] = linear(vocab, hidden)

    config = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_shared_experts": shared or None,
        "n_routed_experts": experts,
        "routed_scaling_factor": routed_scale,
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": q_lora_rank or None,
        "qk_rope_head_dim": qk_rope,
        "v_head_dim": v_head,
        "qk_nope_head_dim": qk_nope,
        "topk_method": topk_method,
        "n_group": n_group,
        "topk_group": topk_group,
        "num_experts_per_tok": top_k,
        "moe_layer_freq": moe_layer_freq,
        "first_k_dense_replace": first_dense,
        "norm_topk_prob": norm_topk_prob,
        "scoring_func": "sigmoid" if topk_method == "noaux_tc" else "softmax",
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype],
    }
    if v3:
        config["head_dim"] = qk_rope  # as transformers' DeepseekV3Config writes it
    if not rope_interleave:
        config["rope_interleave"] = False
    if yarn:
        factor, mscale, mscale_all_dim = yarn
        # original 64: positions of the test prompts cross every yarn band.
        config["rope_scaling"] = {"type": "yarn", "factor": factor,
                                  "original_max_position_embeddings": 64,
                                  "beta_fast": 32, "beta_slow": 1,
                                  "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    return write_model(out_dir, config, w, dtype, shards)


def write_model(out_dir, config, w, dtype, shards):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    stored, encoded = {}, {}
    for name, value in w.items():
        raw, back = encode(value, dtype)
        encoded[name] = (raw, dtype, value.shape)
        stored[name] = back
    meta = {"format": "pt"}
    if shards <= 1:
        write_safetensors(os.path.join(out_dir, "model.safetensors"), encoded, meta)
    else:
        names = list(encoded)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: encoded[n] for n in names[s::shards]}
            write_safetensors(os.path.join(out_dir, fname), part, meta)
            weight_map.update({n: fname for n in part})
        total = sum(len(raw) for raw, _, _ in encoded.values())
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return config, stored


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=["F32", "F16", "BF16"], default="F32")
    ap.add_argument("--sharded", type=int, nargs="?", const=2, default=1, metavar="N",
                    help="write N shards + index (default N=2 when given)")
    ap.add_argument("--qkv-bias", action="store_true", help="q/k/v bias (Qwen2ForCausalLM)")
    ap.add_argument("--qk-norm", action="store_true", help="q/k RMSNorm per head (Qwen3ForCausalLM)")
    ap.add_argument("--mistral", action="store_true", help="MistralForCausalLM config (sliding window)")
    ap.add_argument("--tied", action="store_true", help="tie_word_embeddings, no lm_head.weight")
    ap.add_argument("--rope-llama3", action="store_true", help="llama3 rope_scaling")
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=None, help="explicit head_dim in config")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--intermediate", type=int, default=48)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moe", choices=["mixtral", "qwen3_moe"], default=None,
                    help="Mixture-of-Experts family (MixtralForCausalLM, Qwen3MoeForCausalLM)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=16)
    ap.add_argument("--no-norm-topk-prob", action="store_true", help="Qwen3-MoE norm_topk_prob false")
    ap.add_argument("--sparse-step", type=int, default=1, help="Qwen3-MoE decoder_sparse_step")
    ap.add_argument("--mlp-only", type=int, nargs="*", default=[], help="Qwen3-MoE mlp_only_layers")
    ap.add_argument("--deepseek", type=int, choices=[2, 3], default=None,
                    help="DeepseekV2ForCausalLM / DeepseekV3ForCausalLM (MLA + DeepSeek MoE)")
    ap.add_argument("--q-lora-rank", type=int, default=0, help="DeepSeek q LoRA rank (0: q_proj)")
    ap.add_argument("--kv-lora-rank", type=int, default=16)
    ap.add_argument("--qk-nope", type=int, default=8)
    ap.add_argument("--qk-rope", type=int, default=4)
    ap.add_argument("--v-head", type=int, default=6)
    ap.add_argument("--n-group", type=int, default=4)
    ap.add_argument("--topk-group", type=int, default=2)
    ap.add_argument("--topk-method", default=None,
                    choices=["greedy", "group_limited_greedy", "noaux_tc"])
    ap.add_argument("--shared", type=int, default=1, help="DeepSeek n_shared_experts")
    ap.add_argument("--first-dense", type=int, default=1, help="DeepSeek first_k_dense_replace")
    ap.add_argument("--moe-layer-freq", type=int, default=1)
    ap.add_argument("--routed-scale", type=float, default=2.0)
    ap.add_argument("--no-rope-interleave", action="store_true",
                    help="DeepSeek rope_interleave false (rotate_half pairs)")
    ap.add_argument("--yarn", type=float, nargs=3, default=None,
                    metavar=("FACTOR", "MSCALE", "MSCALE_ALL_DIM"), help="DeepSeek YaRN rope_scaling")
    a = ap.parse_args(argv)
    if a.deepseek:
        make_deepseek_model(
            a.out_dir, version=a.deepseek, hidden=a.hidden, intermediate=a.intermediate,
            layers=a.layers, heads=a.heads, vocab=a.vocab, dtype=a.dtype, shards=a.sharded,
            q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope=a.qk_nope,
            qk_rope=a.qk_rope, v_head=a.v_head, experts=a.experts, top_k=a.top_k,
            moe_intermediate=a.moe_intermediate, n_group=a.n_group, topk_group=a.topk_group,
            topk_method=a.topk_method, shared=a.shared, first_dense=a.first_dense,
            moe_layer_freq=a.moe_layer_freq,
            norm_topk_prob=(False if a.no_norm_topk_prob else None),
            routed_scale=a.routed_scale, yarn=tuple(a.yarn) if a.yarn else None,
            rope_theta=a.rope_theta, eps=a.eps, seed=a.seed,
            rope_interleave=not a.no_rope_interleave)
        print(f"wrote test model to {a.out_dir}")
        return 0
    make_model(a.out_dir, hidden=a.hidden, intermediate=a.intermediate, layers=a.layers,
               heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, vocab=a.vocab,
               dtype=a.dtype, shards=a.sharded, qkv_bias=a.qkv_bias, tied=a.tied,
               rope_llama3=a.rope_llama3, rope_theta=a.rope_theta, eps=a.eps, seed=a.seed,
               qk_norm=a.qk_norm, mistral=a.mistral, moe=a.moe, experts=a.experts,
               top_k=a.top_k, moe_intermediate=a.moe_intermediate,
               norm_topk_prob=not a.no_norm_topk_prob, sparse_step=a.sparse_step,
               mlp_only=tuple(a.mlp_only))
    print(f"wrote test model to {a.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
