#!/usr/bin/python3
"""Self-tests for llama_ref.py, make_test_model.py and compare_logits.py.

llama_ref (batched torch, reading the files) is checked against an independent
naive implementation written here: numpy, one token at a time with a KV cache,
attention as explicit loops over heads and positions, RoPE applied pair by
pair, llama3 frequency scaling computed per frequency with `math`. The naive
side takes its weights straight from make_model() (values as stored), so the
safetensors reader is tested too.

    /usr/bin/python3 -m unittest discover -s tests/reference -p 'test_*.py'
    /usr/bin/python3 tests/reference/test_llama_ref.py
"""

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_logits  # noqa: E402
import llama_ref  # noqa: E402
from make_test_model import make_model, write_safetensors  # noqa: E402

PY = sys.executable or "/usr/bin/python3"


# --------------------------------------------------------------------------
# naive, independent implementation
# --------------------------------------------------------------------------

def naive_inv_freq(cfg):
    d = cfg["head_dim"] if "head_dim" in cfg else cfg["hidden_size"] // cfg["num_attention_heads"]
    theta = cfg.get("rope_theta", 10000.0)
    rs = cfg.get("rope_scaling")
    out = []
    for i in range(d // 2):
        f = 1.0 / theta ** (2 * i / d)
        if rs:
            orig = rs["original_max_position_embeddings"]
            lo, hi, factor = rs["low_freq_factor"], rs["high_freq_factor"], rs["factor"]
            wavelen = 2 * math.pi / f
            if wavelen < orig / hi:
                pass                                   # high frequency: unchanged
            elif wavelen > orig / lo:
                f = f / factor                         # low frequency: scaled
            else:
                s = (orig / wavelen - lo) / (hi - lo)  # in between: interpolate
                f = (1 - s) * f / factor + s * f
        out.append(f)
    return out


def naive_forward(cfg, W, tokens):
    E = cfg["hidden_size"]
    H = cfg["num_attention_heads"]
    KV = cfg.get("num_key_value_heads", H)
    D = cfg.get("head_dim", E // H)
    eps = cfg["rms_norm_eps"]
    L = cfg["num_hidden_layers"]
    bias = "Qwen2ForCausalLM" in cfg.get("architectures", [])
    qk_norm = "Qwen3ForCausalLM" in cfg.get("architectures", [])
    inv_freq = naive_inv_freq(cfg)

    def rmsnorm(x, w):
        ms = sum(v * v for v in x) / len(x)
        return np.array([x[j] / math.sqrt(ms + eps) * w[j] for j in range(len(x))])

    def rope(vec, pos):  # vec: [D], rotate pairs (j, j + D/2)
        out = vec.copy()
        for j in range(D // 2):
            a, b = vec[j], vec[j + D // 2]
            c, s = math.cos(pos * inv_freq[j]), math.sin(pos * inv_freq[j])
            out[j] = a * c - b * s
            out[j + D // 2] = b * c + a * s
        return out

    def silu(v):
        return v / (1.0 + np.exp(-v))

    k_cache = [[] for _ in range(L)]  # per layer: list over positions of [KV, D]
    v_cache = [[] for _ in range(L)]
    lm_head = W["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else W["lm_head.weight"]
    all_logits = []
    for pos, tok in enumerate(tokens):
        x = W["model.embed_tokens.weight"][tok].copy()
        for l in range(L):
            p = f"model.layers.{l}."
            h = rmsnorm(x, W[p + "input_layernorm.weight"])
            q = W[p + "self_attn.q_proj.weight"].dot(h)
            k = W[p + "self_attn.k_proj.weight"].dot(h)
            v = W[p + "self_attn.v_proj.weight"].dot(h)
            if bias:
                q = q + W[p + "self_attn.q_proj.bias"]
                k = k + W[p + "self_attn.k_proj.bias"]
                v = v + W[p + "self_attn.v_proj.bias"]
            q = q.reshape(H, D)
            k = k.reshape(KV, D)
            if qk_norm:  # each head normalised on its own, before RoPE
                q = np.stack([rmsnorm(q[hh], W[p + "self_attn.q_norm.weight"]) for hh in range(H)])
                k = np.stack([rmsnorm(k[g], W[p + "self_attn.k_norm.weight"]) for g in range(KV)])
            k = np.stack([rope(k[g], pos) for g in range(KV)])
            k_cache[l].append(k)
            v_cache[l].append(v.reshape(KV, D))
            attn = np.zeros(H * D)
            for hh in range(H):
                g = hh // (H // KV)
                qh = rope(q[hh], pos)
                scores = []
                for s in range(pos + 1):
                    dot = 0.0
                    for j in range(D):
                        dot += qh[j] * k_cache[l][s][g][j]
                    scores.append(dot / math.sqrt(D))
                m = max(scores)
                e = [math.exp(sc - m) for sc in scores]
                z = sum(e)
                for s in range(pos + 1):
                    attn[hh * D:(hh + 1) * D] += (e[s] / z) * v_cache[l][s][g]
            x = x + W[p + "self_attn.o_proj.weight"].dot(attn)
            h = rmsnorm(x, W[p + "post_attention_layernorm.weight"])
            act = silu(W[p + "mlp.gate_proj.weight"].dot(h)) * W[p + "mlp.up_proj.weight"].dot(h)
            x = x + W[p + "mlp.down_proj.weight"].dot(act)
        all_logits.append(lm_head.dot(rmsnorm(x, W["model.norm.weight"])))
    return np.array(all_logits)


# --------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------

TOKENS = [3, 17, 0, 42, 63, 5, 5, 29, 11, 50, 7, 1]

CASES = {
    "mha_f32": dict(heads=4, kv_heads=4),
    "gqa2_f16": dict(heads=4, kv_heads=2, dtype="F16"),
    "gqa4_bf16_sharded": dict(heads=4, kv_heads=1, dtype="BF16", shards=3),
    "qwen2_qkv_bias_gqa2": dict(heads=4, kv_heads=2, qkv_bias=True),
    "tied_bf16": dict(tied=True, dtype="BF16"),
    "llama3_rope_gqa4_sharded": dict(heads=8, kv_heads=2, hidden=64, rope_llama3=True, shards=2),
    "explicit_head_dim": dict(heads=4, kv_heads=2, head_dim=12, rope_theta=500000.0),
    "qwen3_qk_norm_gqa2": dict(heads=4, kv_heads=2, head_dim=12, qk_norm=True),
    "mistral_gqa4": dict(heads=8, kv_heads=2, hidden=64, mistral=True),
    "all_options": dict(heads=4, kv_heads=2, dtype="BF16", shards=2, qkv_bias=True, tied=True,
                        rope_llama3=True, layers=3),
}


class ReferenceVsNaive(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.tmp.cleanup()

    def check_case(self, name, opts):
        d = os.path.join(self.tmp.name, name)
        cfg, W = make_model(d, seed=sum(map(ord, name)), **opts)
        ref = np.array(llama_ref.reference_logits(d, TOKENS, all_positions=True))
        naive = naive_forward(cfg, W, TOKENS)
        self.assertEqual(ref.shape, (len(TOKENS), cfg["vocab_size"]))
        err = np.abs(ref - naive).max() / np.abs(naive).max()
        self.assertLess(err, 1e-10, f"{name}: relative error {err:.3e}")
        last = np.array(llama_ref.reference_logits(d, TOKENS[:5]))
        self.assertEqual(last.shape, (cfg["vocab_size"],))
        np.testing.assert_allclose(last, naive[4], rtol=0, atol=1e-10 * np.abs(naive).max())

    def test_cases(self):
        for name, opts in CASES.items():
            with self.subTest(name):
                self.check_case(name, opts)

    def test_llama3_inv_freq_covers_all_bands(self):
        d = os.path.join(self.tmp.name, "m")
        cfg, _ = make_model(d, rope_llama3=True)
        inv = llama_ref.rope_inv_freq(llama_ref.load_config(d)).numpy()
        base = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
        np.testing.assert_allclose(inv, naive_inv_freq(cfg), rtol=1e-14)
        # band 0 unchanged, last band divided by factor, something in between interpolated
        self.assertEqual(inv[0], base[0])
        self.assertAlmostEqual(inv[-1], base[-1] / 8.0, delta=1e-18)
        ratios = inv / base
        self.assertTrue(np.any((ratios > 1 / 8 + 1e-6) & (ratios < 1 - 1e-6)), ratios)


class SafetensorsReading(unittest.TestCase):
    def test_exact_values_all_dtypes(self):
        vals = np.array([1.0, -2.5, 3.140625, 0.0, -0.0078125, -1280.0], dtype=np.float32)
        bf16_bits = (vals.view(np.uint32) >> 16).astype("<u2")  # all exactly representable
        with tempfile.TemporaryDirectory() as t:
            path = os.path.join(t, "x.safetensors")
            write_safetensors(path, {
                "f32": (vals.astype("<f4").tobytes(), "F32", [2, 3]),
                "f16": (vals.astype("<f2").tobytes(), "F16", [6]),
                "bf16": (bf16_bits.tobytes(), "BF16", [3, 2]),
            }, {"format": "pt"})
            sf = llama_ref.SafetensorsFile(path)
            np.testing.assert_array_equal(sf.read("f32"), vals.reshape(2, 3))
            np.testing.assert_array_equal(sf.read("f16"), vals)
            np.testing.assert_array_equal(sf.read("bf16"), vals.reshape(3, 2))

    def test_bad_offsets_rejected(self):
        with tempfile.TemporaryDirectory() as t:
            path = os.path.join(t, "x.safetensors")
            write_safetensors(path, {"a": (b"\0" * 8, "F32", [3])})  # 8 bytes for 3 floats
            with self.assertRaisesRegex(llama_ref.RefError, "bad data_offsets"):
                llama_ref.SafetensorsFile(path)


def run_py(*args):
    return subprocess.run([PY, *args], capture_output=True, text=True)


def call_main(main, argv):
    """Run a script's main(argv) in-process; return (rc, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


class ErrorsAndCli(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model = os.path.join(cls.tmp.name, "model")
        cls.cfg, cls.W = make_model(cls.model, heads=4, kv_heads=2, dtype="BF16")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def write_variant(self, name, drop=None, reshape=None):
        d = os.path.join(self.tmp.name, name)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(self.cfg, f)
        tensors = {}
        for n, v in self.W.items():
            if n == drop:
                continue
            if n == reshape:
                v = v[:-1]
            tensors[n] = (v.astype("<f4").tobytes(), "F32", list(v.shape))
        write_safetensors(os.path.join(d, "model.safetensors"), tensors)
        return d

    def test_missing_tensor(self):
        d = self.write_variant("missing", drop="model.layers.1.mlp.up_proj.weight")
        with self.assertRaisesRegex(llama_ref.RefError, "model.layers.1.mlp.up_proj.weight' not found"):
            llama_ref.reference_logits(d, [1, 2])

    def test_wrong_shape(self):
        d = self.write_variant("shape", reshape="model.layers.0.self_attn.k_proj.weight")
        with self.assertRaisesRegex(llama_ref.RefError, r"k_proj.weight' has shape \[15, 32\], expected \[16, 32\]"):
            llama_ref.reference_logits(d, [1, 2])

    def test_missing_files(self):
        with self.assertRaisesRegex(llama_ref.RefError, "model directory not found"):
            llama_ref.load_config(os.path.join(self.tmp.name, "nope"))
        d = os.path.join(self.tmp.name, "noweights")
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(self.cfg, f)
        with self.assertRaisesRegex(llama_ref.RefError, "expected model.safetensors or"):
            llama_ref.reference_logits(d, [1])

    def test_token_out_of_range(self):
        with self.assertRaisesRegex(llama_ref.RefError, "out of range"):
            llama_ref.reference_logits(self.model, [1, 64])

    def test_cli(self):
        script = os.path.join(HERE, "llama_ref.py")
        r = run_py(script, "--model", self.model, "--tokens", "1,2,3")
        self.assertEqual(r.returncode, 0, r.stderr)
        last = json.loads(r.stdout)["logits"]
        self.assertEqual(len(last), 64)
        self.assertIsInstance(last[0], float)
        r = run_py(script, "--model", self.model, "--tokens", "1, 2,3", "--all-positions")
        self.assertEqual(r.returncode, 0, r.stderr)
        allpos = json.loads(r.stdout)["logits"]
        self.assertEqual([len(x) for x in allpos], [64, 64, 64])
        self.assertEqual(allpos[-1], last)
        # error path, in-process (same main() the CLI runs)
        rc, out, err = call_main(llama_ref.main, ["--model", os.path.join(self.tmp.name, "nope"),
                                                  "--tokens", "1"])
        self.assertEqual(rc, 1)
        self.assertIn("llama_ref: error: model directory not found", err)
        self.assertEqual(out, "")

    def test_compare_logits(self):
        # A fake pdserve binary (plain python, no torch, so it starts fast): prints
        # precomputed reference logits, optionally perturbed at vocab index 7.
        tokens = [4, 8, 15, 16, 23, 42]
        for mode in ("last", "all"):
            with open(os.path.join(self.tmp.name, f"logits_{mode}.json"), "w") as f:
                json.dump(llama_ref.reference_logits(self.model, tokens, mode == "all"), f)
        fake = os.path.join(self.tmp.name, "fake_pdserve")
        with open(fake, "w") as f:
            f.write(f"""#!{PY}
import json, os, sys
a = sys.argv[1:]
assert a[:2] == ["model", "logits"] and a[a.index("--tokens") + 1] == "4,8,15,16,23,42", a
mode = "all" if "--all-positions" in a and not os.environ.get("FAKE_FORCE_LAST") else "last"
logits = json.load(open(os.path.join({self.tmp.name!r}, "logits_" + mode + ".json")))
eps = float(os.environ.get("FAKE_PERTURB", "0"))
(logits[-1] if mode == "all" else logits)[7] += eps
print("loading model...")  # a log line before the JSON must be tolerated
print(json.dumps({{"logits": logits}}))
""")
        os.chmod(fake, 0o755)
        base = ["--pdserve", fake, "--model", self.model, "--tokens", "4,8,15,16,23,42"]
        old = os.environ.get("FAKE_PERTURB")
        try:
            os.environ["FAKE_PERTURB"] = "1e-6"
            rc, out, err = call_main(compare_logits.main, base + ["--all-positions"])
            self.assertEqual(rc, 0, err)
            self.assertIn("compare_logits: OK: 6 position(s) x 64 logits", out)

            os.environ["FAKE_PERTURB"] = "0.5"
            rc, out, err = call_main(compare_logits.main, base)
            self.assertEqual(rc, 1)
            self.assertIn("max abs diff 5.000e-01", err)
            self.assertIn("worst at position 5, vocab index 7", err)

            os.environ["FAKE_PERTURB"] = "100"  # within a huge rtol, but changes the argmax
            rc, out, err = call_main(compare_logits.main, base + ["--all-positions", "--rtol", "100"])
            self.assertEqual(rc, 1)
            self.assertIn("argmax mismatch", err)
            self.assertIn("pdserve argmax 7", err)

            # shape mismatch: pdserve ignores --all-positions
            os.environ["FAKE_PERTURB"] = "0"
            os.environ["FAKE_FORCE_LAST"] = "1"
            rc, out, err = call_main(compare_logits.main, base + ["--all-positions"])
            self.assertEqual(rc, 1)
            self.assertIn("shape mismatch: pdserve [64] vs reference [6, 64]", err)

            # the reference's own errors are reported too
            rc, out, err = call_main(compare_logits.main,
                                     ["--pdserve", fake, "--model", os.path.join(self.tmp.name, "other"),
                                      "--tokens", "4,8,15,16,23,42"])
            self.assertEqual(rc, 1)
            self.assertIn("reference: model directory not found", err)
        finally:
            os.environ.pop("FAKE_FORCE_LAST", None)
            if old is None:
                os.environ.pop("FAKE_PERTURB", None)
            else:
                os.environ["FAKE_PERTURB"] = old


if __name__ == "__main__":
    unittest.main()
