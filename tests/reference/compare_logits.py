#!/usr/bin/python3
"""Compare `pdserve model logits` against the float64 PyTorch reference.

    /usr/bin/python3 tests/reference/compare_logits.py --pdserve build/pdserve \
        --model DIR --tokens 1,2,3 [--all-positions] [--rtol 1e-4]

Runs `PDSERVE model logits --model DIR --tokens ... [--all-positions]`, parses
the JSON {"logits": ...} it prints on stdout, and computes the same logits with
llama_ref.py (in-process).

Pass criteria (both must hold):
  * relative error  max|a - b| / max(max|b|, 1e-6) <= rtol, where a = pdserve
    logits, b = reference logits, and both maxima are taken over the whole
    logits vector (or all positions' vectors with --all-positions);
  * identical argmax at every compared position.

Exit 0 with a one-line summary on success; exit 1 printing max abs diff, max
relative diff and the worst index (and argmax mismatches) on failure, or if
pdserve fails / prints output of the wrong shape.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402


def fail(msg: str) -> int:
    print(f"compare_logits: FAIL: {msg}", file=sys.stderr)
    return 1


def parse_pdserve_json(stdout: str):
    """Parse the whole stdout as JSON; failing that, the last line starting with '{'."""
    try:
        return json.loads(stdout)
    except json.JSONDecodeError:
        pass
    for line in reversed(stdout.splitlines()):
        if line.lstrip().startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise ValueError("no JSON object found in pdserve stdout")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pdserve", required=True, help="path to the pdserve binary")
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--all-positions", action="store_true")
    ap.add_argument("--rtol", type=float, default=1e-4,
                    help="max allowed max|a-b| / max(max|b|, 1e-6) (default 1e-4)")
    ap.add_argument("--timeout", type=float, default=600, help="pdserve timeout in seconds")
    ap.add_argument("--weight-dtype", default=None,
                    help="run pdserve with --weight-dtype D and round the reference's "
                         "matrices the same way (bf16, fp16, int8)")
    ap.add_argument("--reference-weight-dtype", default=None,
                    help="round the reference's matrices as this dtype instead "
                         "(fp32: compare compact weights with the unrounded model)")
    ap.add_argument("--allow-argmax-mismatch", action="store_true",
                    help="report argmax mismatches without failing (rounded weights "
                         "against the unrounded model can flip near-ties)")
    args = ap.parse_args(argv)

    try:
        tokens = llama_ref.parse_tokens(args.tokens)
    except llama_ref.RefError as e:
        return fail(str(e))
    tok_arg = ",".join(map(str, tokens))

    cmd = [args.pdserve, "model", "logits", "--model", args.model, "--tokens", tok_arg]
    if args.all_positions:
        cmd.append("--all-positions")
    if args.weight_dtype:
        cmd += ["--weight-dtype", args.weight_dtype]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return fail(f"could not run {' '.join(cmd)}: {e}")
    if proc.returncode != 0:
        return fail(f"pdserve exited with status {proc.returncode}\n"
                    f"command: {' '.join(cmd)}\nstderr:\n{proc.stderr[-4000:]}")
    try:
        got = np.asarray(parse_pdserve_json(proc.stdout)["logits"], dtype=np.float64)
    except (ValueError, KeyError, TypeError) as e:
        return fail(f"cannot parse pdserve output ({e}); stdout starts with: {proc.stdout[:300]!r}")

    try:
        ref_dtype = args.reference_weight_dtype or args.weight_dtype
        ref = np.asarray(llama_ref.reference_logits(args.model, tokens, args.all_positions,
                                                    ref_dtype),
                         dtype=np.float64)
    except llama_ref.RefError as e:
        return fail(f"reference: {e}")

    if got.shape != ref.shape:
        return fail(f"shape mismatch: pdserve {list(got.shape)} vs reference {list(ref.shape)}")
    if not np.all(np.isfinite(got)):
        bad = np.unravel_index(np.argmax(~np.isfinite(got)), got.shape)
        return fail(f"pdserve logits contain non-finite values (first at index {tuple(map(int, bad))})")

    # Work on [positions, vocab] uniformly.
    got2, ref2 = got.reshape(-1, ref.shape[-1]), ref.reshape(-1, ref.shape[-1])
    # Position numbers as seen by the model (last-position mode compares position T-1).
    pos_ids = list(range(len(tokens))) if args.all_positions else [len(tokens) - 1]

    diff = np.abs(got2 - ref2)
    max_abs = float(diff.max())
    scale = max(float(np.abs(ref2).max()), 1e-6)
    rel = max_abs / scale
    wr, wc = np.unravel_index(int(np.argmax(diff)), diff.shape)
    worst = f"position {pos_ids[wr]}, vocab index {wc}: pdserve {got2[wr, wc]!r} vs reference {ref2[wr, wc]!r}"

    argmax_bad = []
    for r in range(ref2.shape[0]):
        ga, ra = int(np.argmax(got2[r])), int(np.argmax(ref2[r]))
        if ga != ra:
            gap = ref2[r, ra] - ref2[r, ga]
            argmax_bad.append(f"position {pos_ids[r]}: pdserve argmax {ga}, reference argmax {ra} "
                              f"(reference logit gap {gap:.3e})")

    summary = (f"max abs diff {max_abs:.3e}, max relative diff {rel:.3e} (rtol {args.rtol:g}, "
               f"scale max|ref| {scale:.4g}), worst at {worst}")
    if args.allow_argmax_mismatch and argmax_bad and rel <= args.rtol:
        print(f"compare_logits: OK: {summary}; argmax differs at {len(argmax_bad)} of "
              f"{len(pos_ids)} position(s) (allowed)")
        return 0
    if rel > args.rtol or argmax_bad:
        msg = summary
        if rel > args.rtol:
            msg = "relative error above tolerance: " + msg
        if argmax_bad:
            msg += "\nargmax mismatch:\n  " + "\n  ".join(argmax_bad)
        return fail(msg)

    print(f"compare_logits: OK: {len(pos_ids)} position(s) x {ref2.shape[1]} logits, "
          f"max abs diff {max_abs:.3e}, max relative diff {rel:.3e} <= {args.rtol:g}, argmax identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
