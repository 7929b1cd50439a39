"""Tests of scripts/gpu-check.sh's verdicts, on CPU, with fake binaries.

The GPU check must never read PASS for code that did not run: a binary that
ran no test, one whose every test skipped, a crash, a hang, a missing binary
and a machine without a device all make it FAIL. The fakes are shell
scripts that print what a gtest binary prints (gtest 1.12's summary lines)
and a fake gpu_probe; gpu-check.sh runs them through GPU_CHECK_BIN_DIR.
The list test keeps gpu-check's binaries equal to the gpu-labelled ctest
targets of every CMakeLists.txt.
"""

import os
import pathlib
import re
import subprocess
import tempfile
import textwrap
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"

PROBE_OK = """\
echo "driver CUDA 13.0 (13000), runtime CUDA 13.0 (13000)"
echo "device 0: Fake H200, compute 9.0, 132 SMs, 139.8 GiB"
echo "probe kernel: OK"
"""
PROBE_NO_DEVICE = """\
echo "driver CUDA 12.2 (12020), runtime CUDA 13.0 (13000)"
echo "NO DEVICE: the driver supports CUDA 12.2, older than the bundled runtime 13.0"
exit 1
"""


def gtest_output(passed=(), skipped=(), failed=(), reason="no CUDA device: x"):
    """What a gtest binary prints for these test names (Suite.Name)."""
    names = list(passed) + list(skipped) + list(failed)
    lines = [
        "Running main() from gtest_main.cc",
        f"[==========] Running {len(names)} tests from 1 test suite.",
    ]
    for n in names:
        lines.append(f"[ RUN      ] {n}")
        if n in skipped:
            lines += ["fake_test.cc:10: Skipped", reason, f"[  SKIPPED ] {n} (0 ms)"]
        elif n in failed:
            lines += ["fake_test.cc:20: Failure", "Expected equality",
                      f"[  FAILED  ] {n} (1 ms)"]
        else:
            lines.append(f"[       OK ] {n} (1 ms)")
    lines.append(f"[==========] {len(names)} tests from 1 test suite ran. (5 ms total)")
    lines.append(f"[  PASSED  ] {len(passed)} tests.")
    if skipped:
        lines.append(f"[  SKIPPED ] {len(skipped)} tests, listed below:")
        lines += [f"[  SKIPPED ] {n}" for n in skipped]
    if failed:
        lines.append(f"[  FAILED  ] {len(failed)} tests, listed below:")
        lines += [f"[  FAILED  ] {n}" for n in failed]
    return "\n".join(lines) + "\n"


class GpuCheckRunTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = pathlib.Path(self.tmp.name)
        (self.dir / "bin").mkdir()
        self.probe(PROBE_OK)

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, body):
        p = self.dir / "bin" / name
        p.write_text("#!/bin/sh\n" + body)
        p.chmod(0o755)

    def probe(self, body):
        self.write("gpu_probe", body)

    def fake(self, name, output, exit_code=None, extra=""):
        if exit_code is None:
            exit_code = 1 if "[  FAILED  ]" in output else 0
        self.write(name, extra + "cat <<'GTEST'\n" + output + "GTEST\n"
                   + f"exit {exit_code}\n")

    def run_check(self, only, *args):
        env = dict(os.environ, GPU_CHECK_BIN_DIR=str(self.dir),
                   GPU_CHECK_ONLY=" ".join(only), OUT=str(self.dir / "out"))
        r = subprocess.run(["bash", str(SCRIPT), "run", *args], env=env,
                           capture_output=True, text=True, timeout=120)
        return r.returncode, r.stdout + r.stderr

    def test_a_binary_whose_every_test_skipped_fails_the_check(self):
        self.fake("all_skip_test", gtest_output(skipped=["S.A", "S.B"]))
        rc, out = self.run_check(["all_skip_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("RESULT all_skip_test: FAIL ran 2, skipped 2, failed 0", out)
        self.assertIn("EVERY TEST SKIPPED", out)
        self.assertIn("GPU CHECK: FAIL", out)
        self.assertIn("skip reason:", out)
        self.assertIn("no CUDA device: x", out)

    def test_a_binary_that_ran_no_test_fails_the_check(self):
        self.fake("empty_test", gtest_output())
        rc, out = self.run_check(["empty_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("RESULT empty_test: FAIL ran 0", out)
        self.assertIn("RAN NO TESTS", out)

    def test_tests_that_ran_beside_skips_for_no_device_fail_the_check(self):
        # What a real binary prints on a machine without a usable device:
        # its argument-check tests run and pass, every GPU test skips.
        self.fake("mixed_test", gtest_output(passed=["Args.A"],
                                             skipped=["Gpu.A", "Gpu.B"]))
        rc, out = self.run_check(["mixed_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("RESULT mixed_test: FAIL ran 3, skipped 2, failed 0", out)
        self.assertIn("A TEST SAW NO DEVICE", out)

    def test_a_failed_test_fails_the_check(self):
        self.fake("bad_test", gtest_output(passed=["S.A"], failed=["S.B"]))
        rc, out = self.run_check(["bad_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("RESULT bad_test: FAIL ran 2, skipped 0, failed 1", out)

    def test_a_crash_without_a_summary_fails_the_check(self):
        text = gtest_output(passed=["S.A"]).split("[==========] 1 tests from")[0]
        self.fake("crash_test", text, exit_code=139)
        rc, out = self.run_check(["crash_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("CRASHED (exit 139", out)

    def test_a_nonzero_exit_after_a_clean_summary_fails_the_check(self):
        self.fake("exit_test", gtest_output(passed=["S.A"]), exit_code=3)
        rc, out = self.run_check(["exit_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("RESULT exit_test: FAIL", out)

    def test_a_missing_binary_fails_the_check(self):
        rc, out = self.run_check(["not_built_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("RESULT not_built_test: FAIL MISSING", out)

    def test_a_hang_is_killed_and_fails_the_check(self):
        # A copy of the script with a 1 s limit instead of the 60 s floor.
        self.write("hang_test", "sleep 30\n")
        script = self.dir / "gpu-check.sh"
        text = SCRIPT.read_text().replace('[ "$limit" -lt 60 ] && limit=60', "limit=1")
        text = text.replace('cd "$(dirname "$0")/.."', f'cd "{ROOT}"')
        script.write_text(text)
        env = dict(os.environ, GPU_CHECK_BIN_DIR=str(self.dir),
                   GPU_CHECK_ONLY="hang_test", OUT=str(self.dir / "out"))
        r = subprocess.run(["bash", str(script), "run"], env=env,
                           capture_output=True, text=True, timeout=60)
        out = r.stdout + r.stderr
        self.assertNotEqual(r.returncode, 0, out)
        self.assertIn("RESULT hang_test: FAIL", out)
        self.assertIn("TIMED OUT", out)

    def test_no_device_fails_before_any_binary_runs(self):
        self.probe(PROBE_NO_DEVICE)
        marker = self.dir / "ran"
        self.fake("good_test", gtest_output(passed=["S.A"]),
                  extra=f"touch {marker}\n")
        rc, out = self.run_check(["good_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("GPU CHECK: FAIL (no usable device; nothing ran)", out)
        self.assertIn("runtime CUDA 13.0", out)
        self.assertFalse(marker.exists(), out)

    def test_a_missing_probe_fails_the_check(self):
        (self.dir / "bin" / "gpu_probe").unlink()
        self.fake("good_test", gtest_output(passed=["S.A"]))
        rc, out = self.run_check(["good_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("no device probe", out)

    def test_ran_tests_with_some_skips_pass_and_print_counts_and_versions_first(self):
        self.fake("good_test", gtest_output(passed=["S.A", "S.B"],
                                            skipped=["S.Bench"],
                                            reason="benchmark: set PDSERVE_GPU_BENCH=1"))
        self.fake("other_test", gtest_output(passed=["T.A"]))
        rc, out = self.run_check(["good_test", "other_test"])
        self.assertEqual(rc, 0, out)
        self.assertIn("RESULT good_test: PASS ran 3, skipped 1, failed 0", out)
        self.assertIn("RESULT other_test: PASS ran 1, skipped 0, failed 0", out)
        self.assertIn("S.Bench", out)
        self.assertIn("GPU CHECK: PASS (2 binaries)", out)
        self.assertLess(out.index("runtime CUDA 13.0"), out.index("=== good_test"))
        self.assertLess(out.index("device 0: Fake H200"), out.index("=== good_test"))
        self.assertTrue((self.dir / "out" / "good_test.log").exists())

    def test_one_bad_binary_among_good_ones_fails_the_check(self):
        self.fake("good_test", gtest_output(passed=["S.A"]))
        self.fake("all_skip_test", gtest_output(skipped=["S.A"]))
        rc, out = self.run_check(["good_test", "all_skip_test"])
        self.assertNotEqual(rc, 0, out)
        self.assertIn("GPU CHECK: FAIL (1 failed: all_skip_test; 1 passed)", out)


def gpu_labelled_targets():
    """Test binaries registered with the ctest label gpu in any CMakeLists."""
    found = set()
    for cm in ROOT.rglob("CMakeLists.txt"):
        if any(part.startswith(("build", ".")) for part in cm.relative_to(ROOT).parts):
            continue
        text = cm.read_text()
        for m in re.finditer(r"gtest_discover_tests\(\s*([A-Za-z0-9_]+)([^)]*)\)", text):
            if re.search(r"LABELS\s+[^)]*\bgpu\b", m.group(2)):
                found.add(m.group(1))
        for m in re.finditer(r"add_test\(\s*NAME\s+([A-Za-z0-9_]+)", text):
            props = re.search(rf"set_tests_properties\([^)]*\b{m.group(1)}\b[^)]*"
                              r"LABELS\s+gpu", text)
            if props:
                found.add(m.group(1))
    return found


class GpuCheckListTest(unittest.TestCase):
    def test_every_gpu_labelled_target_is_in_the_check_and_nothing_else(self):
        listed = subprocess.run(["bash", str(SCRIPT), "list"], capture_output=True,
                                text=True, check=True).stdout.split()
        labelled = gpu_labelled_targets()
        self.assertGreaterEqual(len(labelled), 8)
        self.assertEqual(sorted(set(listed)), sorted(labelled),
                         "scripts/gpu-check.sh TESTS must equal the gpu-labelled "
                         "ctest targets")
        self.assertEqual(len(listed), len(set(listed)))

    def test_help_prints_the_playbook_with_each_binary_and_its_time(self):
        out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True,
                             text=True, check=True).stdout
        self.assertIn("FIRST-RUN PLAYBOOK", out)
        listed = subprocess.run(["bash", str(SCRIPT), "list"], capture_output=True,
                                text=True, check=True).stdout.split()
        for t in listed:
            self.assertRegex(out, rf"\n\s+{t}\s+.*~\d+ s")


if __name__ == "__main__":
    unittest.main()
