#!/usr/bin/python3
"""Self-tests for llama_ref.py's DeepSeek-V2/V3 path (MLA attention, DeepSeek MoE).

- The expanded MLA attention (K and V from the latent, as modeling_deepseek.py)
  equals the weight-absorbed form over the latents (what pdserve's engine
  computes) in float64.
- DeepSeek's RoPE (de-interleave, then rotate_half) is the rotation of the
  interleaved pairs (x[2i], x[2i+1]) written out de-interleaved.
- YaRN's mscale and the softmax scale follow yarn_get_mscale.
- The MoE gate (group_limited_greedy, noaux_tc) matches a per-token Python
  loop written here.

    /usr/bin/python3 -m unittest discover -s tests/reference -p 'test_*.py'
"""

import math
import os
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama_ref  # noqa: E402
from make_test_model import make_deepseek_model  # noqa: E402


def load(version, **kw):
    d = tempfile.mkdtemp(prefix=f"mla_ref_v{version}_")
    config, _ = make_deepseek_model(d, version=version, **kw)
    return llama_ref.load_config(d), llama_ref.Checkpoint(d), config


class MlaReferenceTest(unittest.TestCase):
    def test_expanded_attention_equals_the_absorbed_form(self):
        for q_lora in (0, 12):
            cfg, ckpt, _ = load(3 if q_lora else 2, q_lora_rank=q_lora, experts=8,
                                yarn=(8.0, 0.9, 1.1))
            ds = cfg.deepseek
            T, E, H = 9, cfg.hidden_size, cfg.num_attention_heads
            nope, rope, vd, R = (ds["qk_nope_head_dim"], ds["qk_rope_head_dim"],
                                 ds["v_head_dim"], ds["kv_lora_rank"])
            x = torch.from_numpy(np.random.default_rng(3).standard_normal((T, E)))
            cos, sin = llama_ref.deepseek_rope(cfg, T)
            want = llama_ref.mla_attention(cfg, ckpt, 1, x, cos, sin)
            # Absorbed: scores from q_lat = W_UK^T q_nope against the latents.
            p = "model.layers.1.self_attn."
            if q_lora:
                qa = x @ ckpt.get(p + "q_a_proj.weight", [q_lora, E]).T
                qa = llama_ref.rms_norm(qa, ckpt.get(p + "q_a_layernorm.weight", [q_lora]),
                                        cfg.rms_norm_eps)
                q = qa @ ckpt.get(p + "q_b_proj.weight", [H * (nope + rope), q_lora]).T
            else:
                q = x @ ckpt.get(p + "q_proj.weight", [H * (nope + rope), E]).T
            q = q.view(T, H, nope + rope)
            ckv = x @ ckpt.get(p + "kv_a_proj_with_mqa.weight", [R + rope, E]).T
            c = llama_ref.rms_norm(ckv[:, :R], ckpt.get(p + "kv_a_layernorm.weight", [R]),
                                   cfg.rms_norm_eps)
            k_pe = llama_ref.deepseek_apply_rope(ckv[:, R:].view(1, T, rope), cos, sin)[0]
            wkv = ckpt.get(p + "kv_b_proj.weight", [H * (nope + vd), R]).view(H, nope + vd, R)
            scale = llama_ref.mla_softmax_scale(cfg)
            out = torch.zeros(T, H, vd, dtype=torch.float64)
            for h in range(H):
                q_pe = llama_ref.deepseek_apply_rope(q[:, h, nope:].reshape(1, T, rope), cos, sin)[0]
                q_lat = q[:, h, :nope] @ wkv[h, :nope]  # [T, R]
                s = (q_lat @ c.T + q_pe @ k_pe.T) * scale
                s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
                lat = torch.softmax(s, dim=-1) @ c  # [T, R]
                out[:, h] = lat @ wkv[h, nope:].T
            got = out.reshape(T, H * vd) @ ckpt.get(p + "o_proj.weight", [E, H * vd]).T
            self.assertLess(float((got - want).abs().max()), 1e-10, f"q_lora={q_lora}")

    def test_rope_rotates_interleaved_pairs(self):
        cfg, _, _ = load(2)
        T, d = 5, cfg.deepseek["qk_rope_head_dim"]
        cos, sin = llama_ref.deepseek_rope(cfg, T)
        x = torch.from_numpy(np.random.default_rng(1).standard_normal((1, T, d)))
        got = llama_ref.deepseek_apply_rope(x, cos, sin)[0]
        base = cfg.rope_theta
        for t in range(T):
            for i in range(d // 2):
                a = t / base ** (2 * i / d)
                x0, x1 = float(x[0, t, 2 * i]), float(x[0, t, 2 * i + 1])
                self.assertAlmostEqual(float(got[t, i]), x0 * math.cos(a) - x1 * math.sin(a))
                self.assertAlmostEqual(float(got[t, i + d // 2]),
                                       x1 * math.cos(a) + x0 * math.sin(a))

    def test_yarn_mscale_scales_softmax_and_rope(self):
        self.assertAlmostEqual(llama_ref.yarn_get_mscale(40, 0.707), 0.1 * 0.707 * math.log(40) + 1)
        self.assertEqual(llama_ref.yarn_get_mscale(1.0, 5.0), 1.0)
        cfg, _, _ = load(2, yarn=(8.0, 0.9, 1.1))
        m = llama_ref.yarn_get_mscale(8.0, 1.1)
        qh = cfg.deepseek["qk_nope_head_dim"] + cfg.deepseek["qk_rope_head_dim"]
        self.assertAlmostEqual(llama_ref.mla_softmax_scale(cfg), qh ** -0.5 * m * m)
        cos, sin = llama_ref.deepseek_rope(cfg, 2)
        ratio = llama_ref.yarn_get_mscale(8.0, 0.9) / m
        self.assertAlmostEqual(float(cos[0, 0]), ratio)  # position 0: cos = 1 x ratio

    def test_gate_matches_a_per_token_loop(self):
        for version in (2, 3):
            cfg, ckpt, config = load(version, experts=8, top_k=3 if version == 2 else 2)
            ds = cfg.deepseek
            E, N, K = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
            G, TG = ds["n_group"], ds["topk_group"]
            x = torch.from_numpy(np.random.default_rng(5).standard_normal((6, E)))
            p = "model.layers.1.mlp."
            W = ckpt.get(p + "gate.weight", [N, E])
            bias = ckpt.get(p + "gate.e_score_correction_bias", [N]) if version == 3 else None
            got = llama_ref.deepseek_moe(cfg, ckpt, 1, x)
            for t in range(x.shape[0]):
                z = [float(v) for v in W @ x[t]]
                if version == 2:
                    ex = [math.exp(v - max(z)) for v in z]
                    s = [v / sum(ex) for v in ex]
                    choice = s[:]
                    gs = [max(choice[g * N // G:(g + 1) * N // G]) for g in range(G)]
                else:
                    s = [1 / (1 + math.exp(-v)) for v in z]
                    choice = [s[e] + float(bias[e]) for e in range(N)]
                    gs = [sum(sorted(choice[g * N // G:(g + 1) * N // G])[-2:]) for g in range(G)]
                kept = sorted(range(G), key=lambda g: (-gs[g], g))[:TG]
                masked = [choice[e] if e // (N // G) in kept else 0.0 for e in range(N)]
                top = sorted(range(N), key=lambda e: (-masked[e], e))[:K]
                w = [s[e] if version == 3 else masked[e] for e in top]
                if ds["norm_topk_prob"]:
                    w = [v / (sum(w) + 1e-20) for v in w]
                    if version == 3:
                        w = [v * ds["routed_scaling_factor"] for v in w]
                else:
                    w = [v * ds["routed_scaling_factor"] for v in w]
                want = torch.zeros(E, dtype=torch.float64)
                for e, we in zip(top, w):
                    ep = f"{p}experts.{e}."
                    want += we * llama_ref.swiglu(ckpt, x[t:t + 1], ep + "gate_proj", ep + "up_proj",
                                                  ep + "down_proj", E, cfg.moe_intermediate_size)[0]
                sp = p + "shared_experts."
                want += llama_ref.swiglu(ckpt, x[t:t + 1], sp + "gate_proj", sp + "up_proj",
                                         sp + "down_proj", E,
                                         cfg.moe_intermediate_size * ds["n_shared_experts"])[0]
                self.assertLess(float((got[t] - want).abs().max()), 1e-10, f"v{version} token {t}")

    def test_dense_and_sparse_layers(self):
        cfg, _, _ = load(3, experts=8, layers=5, first_dense=1, moe_layer_freq=2)
        self.assertEqual([cfg.is_moe_layer(i) for i in range(5)], [False, False, True, False, True])


if __name__ == "__main__":
    unittest.main()
