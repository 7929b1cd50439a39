#!/usr/bin/python3
"""Self-tests for llama_ref.py's Mixture-of-Experts path (Mixtral, Qwen3-MoE).

The MoE block is checked against a naive numpy evaluation written here, one
token at a time: softmax in Python floats, top-k by sorting (probability
descending, then expert id), each chosen expert's SwiGLU as explicit sums.
A Mixtral checkpoint whose experts are all copies of one dense MLP must give
the dense model's logits (renormalised top-k weights sum to 1).

    /usr/bin/python3 -m unittest discover -s tests/reference -p 'test_*.py'
"""

import json
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
from make_test_model import encode, make_model, write_safetensors  # noqa: E402


def to_moe(out_dir, config, weights, family, experts=4, top_k=2, moe_inter=16,
           copies=False, seed=7, norm_topk_prob=True, sparse_step=1, mlp_only=()):
    """Rewrite a dense make_model() directory as a MoE checkpoint in place.
    Returns (config, {name: float64 array})."""
    rng = np.random.default_rng(seed)
    E = config["hidden_size"]
    w = dict(weights)
    config = dict(config)
    if family == "mixtral":
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                      num_local_experts=experts, num_experts_per_tok=top_k)
        moe_inter = config["intermediate_size"]
    else:
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_experts=experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=moe_inter, norm_topk_prob=norm_topk_prob,
                      decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only))
    cfg = llama_ref.load_config_dict(config)
    for i in range(config["num_hidden_layers"]):
        if not cfg.is_moe_layer(i):
            continue
        p = f"model.layers.{i}."
        dense = [w.pop(p + "mlp." + n + ".weight") for n in ("gate_proj", "up_proj", "down_proj")]
        router = p + ("block_sparse_moe.gate" if family == "mixtral" else "mlp.gate") + ".weight"
        w[router] = 2.0 * rng.standard_normal((experts, E)) / math.sqrt(E)
        for e in range(experts):
            if family == "mixtral":
                names = [p + f"block_sparse_moe.experts.{e}.{n}.weight" for n in ("w1", "w3", "w2")]
            else:
                names = [p + f"mlp.experts.{e}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
            if copies:
                mats = dense
            else:
                mats = [rng.standard_normal((moe_inter, E)) / math.sqrt(E),
                        rng.standard_normal((moe_inter, E)) / math.sqrt(E),
                        rng.standard_normal((E, moe_inter)) / math.sqrt(moe_inter)]
            for n, m in zip(names, mats):
                w[n] = m
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    encoded, stored = {}, {}
    for n, v in w.items():
        raw, stored[n] = encode(v, "F32")  # the naive side uses the stored values
        encoded[n] = (raw, "F32", v.shape)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), encoded)
    return config, stored


def naive_moe(config, w, i, x, family):
    """x: [T, E] numpy -> [T, E], token by token."""
    N = config.get("num_local_experts") or config.get("num_experts")
    K = config["num_experts_per_tok"]
    renorm = family == "mixtral" or config.get("norm_topk_prob", False)
    p = f"model.layers.{i}."
    router = w[p + ("block_sparse_moe.gate" if family == "mixtral" else "mlp.gate") + ".weight"]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        z = [float(np.dot(router[e], x[t])) for e in range(N)]
        m = max(z)
        ex = [math.exp(v - m) for v in z]
        prob = [v / sum(ex) for v in ex]
        chosen = sorted(range(N), key=lambda e: (-prob[e], e))[:K]
        total = sum(prob[e] for e in chosen)
        for e in chosen:
            if family == "mixtral":
                g, u, d = (w[p + f"block_sparse_moe.experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2"))
            else:
                g, u, d = (w[p + f"mlp.experts.{e}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))
            gx, ux = g @ x[t], u @ x[t]
            act = np.array([a / (1 + math.exp(-a)) * b for a, b in zip(gx, ux)])
            weight = prob[e] / total if renorm else prob[e]
            out[t] += weight * (d @ act)
    return out


class MoeReferenceTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def check_block(self, family, **kw):
        config, w = make_model(self.dir, layers=3, heads=4, kv_heads=2, qk_norm=family != "mixtral")
        config, w = to_moe(self.dir, config, w, family, **kw)
        cfg = llama_ref.load_config(self.dir)
        ckpt = llama_ref.Checkpoint(self.dir)
        x = np.random.default_rng(3).standard_normal((9, config["hidden_size"]))
        checked = 0
        for i in range(config["num_hidden_layers"]):
            if not cfg.is_moe_layer(i):
                self.assertIn(f"model.layers.{i}.mlp.gate_proj.weight", w)
                continue
            got = llama_ref.moe_mlp(cfg, ckpt, i, torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(got, naive_moe(config, w, i, x, family), rtol=1e-9, atol=1e-12)
            checked += 1
        return cfg, checked

    def test_mixtral_block_matches_naive(self):
        cfg, checked = self.check_block("mixtral", experts=4, top_k=2)
        self.assertEqual(checked, 3)

    def test_qwen3_moe_block_without_norm_topk_prob(self):
        cfg, checked = self.check_block("qwen3_moe", experts=6, top_k=3, norm_topk_prob=False)
        self.assertEqual(checked, 3)
        self.assertTrue(cfg.qk_norm)

    def test_qwen3_moe_dense_layers(self):
        # mlp_only_layers [0, 2] -> only layer 1 sparse; so does decoder_sparse_step 2.
        cfg, checked = self.check_block("qwen3_moe", experts=4, top_k=2, mlp_only=(0, 2))
        self.assertEqual(checked, 1)
        cfg, checked = self.check_block("qwen3_moe", experts=4, top_k=2, sparse_step=2)
        self.assertEqual([cfg.is_moe_layer(i) for i in range(3)], [False, True, False])
        self.assertEqual(checked, 1)

    def test_mixtral_of_identical_experts_is_the_dense_model(self):
        config, w = make_model(self.dir, layers=2, heads=4, kv_heads=2)
        tokens = [1, 5, 9, 33, 2, 7, 60, 12]
        dense = llama_ref.reference_logits(self.dir, tokens, all_positions=True)
        to_moe(self.dir, config, w, "mixtral", experts=4, top_k=2, copies=True)
        self.assertEqual(llama_ref.load_config(self.dir).moe, "mixtral")
        moe = llama_ref.reference_logits(self.dir, tokens, all_positions=True)
        np.testing.assert_allclose(np.array(moe), np.array(dense), rtol=1e-9, atol=1e-9)


if __name__ == "__main__":
    unittest.main()
