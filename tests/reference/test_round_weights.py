"""llama_ref.round_weights: the reference's copy of pdserve's weight storage."""
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402


class RoundWeightsTest(unittest.TestCase):
    def test_bf16_rounds_to_nearest_even(self):
        w = np.array([[1.0, 1.00390625, 1.01171875, 1.0 + 2 ** -9]], dtype=np.float32)
        got = llama_ref.round_weights(w, "bf16")
        # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even mantissa (1) wins.
        self.assertEqual(got.tolist(), [[1.0, 1.0, 1.015625, 1.0]])

    def test_fp16_matches_numpy_half(self):
        w = np.array([[0.1, -3.14159, 65504.0, 1e-8]], dtype=np.float32)
        got = llama_ref.round_weights(w, "fp16")
        self.assertEqual(got.tolist(), w.astype(np.float16).astype(np.float64).tolist())

    def test_int8_is_per_row_within_half_a_step(self):
        rng = np.random.default_rng(1)
        w = rng.normal(0, 0.02, size=(7, 33)).astype(np.float32)
        w[3] = 0
        got = llama_ref.round_weights(w, "int8")
        step = np.abs(w).max(axis=1) / 127
        self.assertTrue(np.all(np.abs(got - w) <= step[:, None] / 2 * (1 + 1e-5)))
        self.assertTrue(np.all(got[3] == 0))
        # Every row has at most 255 distinct levels, multiples of its step.
        q = got[0] / step[0]
        self.assertTrue(np.allclose(q, np.rint(q), atol=1e-3))

    def test_int8_b32_scales_round_up_to_fp16_per_block(self):
        rng = np.random.default_rng(2)
        w = rng.normal(0, 0.02, size=(5, 70)).astype(np.float32)  # 3 blocks, last 6 wide
        w[1, 32:64] = 0  # an all-zero block
        w[2, 5] = 1.5  # an outlier coarsens only its block
        got = llama_ref.round_weights(w, "int8-b32")
        self.assertTrue(np.all(got[1, 32:64] == 0))
        for r in range(5):
            for b0 in range(0, 70, 32):
                blk, out = w[r, b0:b0 + 32], got[r, b0:b0 + 32]
                amax = np.float32(np.abs(blk).max())
                if amax == 0:
                    continue
                want = np.float32(amax / np.float32(127))
                # The scale is the smallest fp16 >= max/127: the levels' step.
                steps = out / np.float64(np.abs(out).max()) * 127
                scale = np.float64(np.abs(out).max()) / np.abs(np.rint(steps)).max()
                self.assertTrue(np.allclose(out / scale, np.rint(out / scale), atol=1e-6))
                self.assertGreaterEqual(scale, want)
                self.assertEqual(np.float16(scale).astype(np.float64), scale)
                self.assertLessEqual(scale, float(want) * (1 + 2 ** -10) + 6e-8)
                self.assertTrue(np.all(np.abs(out - blk) <= scale / 2 * (1 + 1e-6)))
        # Other rows keep fine steps although row 2 has an outlier.
        self.assertLess(np.abs(got[2, 32:] - w[2, 32:]).max(), 0.02 / 127 * 4)

    def test_unknown_dtype_is_an_error(self):
        with self.assertRaises(llama_ref.RefError):
            llama_ref.round_weights(np.zeros((1, 1), np.float32), "fp8")


if __name__ == "__main__":
    unittest.main()
