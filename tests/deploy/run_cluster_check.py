#!/usr/bin/python3
"""Runs pdserve the way deploy/k8s runs it and checks that every metric the
Grafana dashboard, the alerting rules and the prometheus-adapter rules use is
really exported.

    run_cluster_check.py SOURCE_DIR PDSERVE_BIN RENDERED_DIR WORK_DIR [PROMTOOL]

1. Takes the router, prefill and decode container args from the rendered CPU
   overlay (RENDERED_DIR/overlay-cpu.yaml), expands $(VAR) from the rendered
   ConfigMap and the pod's env, and changes only what a laptop needs: a tiny
   model, loopback, port 0, a small KV budget, one thread, static worker
   addresses instead of dns:. Every other flag is passed as deployed, so a
   flag the binary does not know fails here rather than in a pod.
2. Starts prefill + decode + router, sends one request through the router
   (long enough to be prefilled remotely), checks /healthz, scrapes each
   process's /metrics (and runs `promtool check metrics` on it).
3. Every pdserve_* name in deploy/grafana/pdserve-dashboard.json,
   deploy/prometheus/pdserve-rules.yml and
   deploy/prometheus/prometheus-adapter-values.yaml must be a sample name in
   some exposition (so histograms are referenced as _bucket/_sum/_count and
   never bare); every label="value" matcher on a pdserve_* selector must match
   an exported label value; every `by (...)` label must exist.
4. The same with the components/tls rendering (combo-cpu-tls.yaml): mTLS
   between the processes with a CA made here by openssl; a client with the CA
   gets an answer, a plaintext one does not.
5. SIGTERM stops every process promptly (no work in flight).
"""
import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request

import yaml

SRC = pathlib.Path(sys.argv[1]).resolve()
PDSERVE = sys.argv[2]
RENDERED = pathlib.Path(sys.argv[3]).resolve()
WORK = pathlib.Path(sys.argv[4]).resolve()
PROMTOOL = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else None

# Labels that come from the scrape (target labels), not from pdserve.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "component", "node", "container", "service", "endpoint"}

failures = []
procs = []


def fail(msg):
    failures.append(msg)
    print(f"FAIL {msg}", flush=True)


# ------------------------------------------------------------ 1. manifests
def load_overlay(rendering="overlay-cpu.yaml"):
    objs = [o for o in yaml.safe_load_all((RENDERED / rendering).read_text()) if o]
    config = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("pdserve-config"))
    deployments = {o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: o
                   for o in objs if o["kind"] == "Deployment"}
    return config["data"], deployments


def local_args(container, config, overrides):
    env = dict(config)
    env.update({"POD_IP": "127.0.0.1", "POD_NAMESPACE": "pdserve", "PDSERVE_THREADS": "1"})
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
    args = []
    for a in container["args"]:
        a = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a)
        if "$(" in a:
            fail(f"{container['name']}: unexpanded variable in {a}")
        flag = a.split("=", 1)[0]
        if flag in overrides:
            a = f"{flag}={overrides[flag]}"
        args.append(a)
    return args


def start(name, args):
    log = open(WORK / f"{name}.log", "w")
    p = subprocess.Popen([PDSERVE, *args], stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
    procs.append((name, p))
    deadline = time.time() + 30
    buf = ""
    while time.time() < deadline:
        r, _, _ = select.select([p.stdout], [], [], 0.5)
        if r:
            line = p.stdout.readline()
            if not line:
                break
            buf += line
            m = re.search(r"listening on (\S+) metrics (\d+)", line)
            if m:
                print(f"{name}: {line.strip()}", flush=True)
                return m.group(1), int(m.group(2))
        if p.poll() is not None:
            break
    log.flush()
    raise RuntimeError(f"{name} did not start (exit {p.poll()}); args {args}\nstdout: {buf}\n"
                       f"stderr: {(WORK / f'{name}.log').read_text()[-2000:]}")


def http_get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.status, r.read().decode()


# ------------------------------------------------------------ 3. metric use
def parse_exposition(text):
    samples = {}  # sample name -> {label: {values}}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s", line)
        if not m:
            continue
        labels = samples.setdefault(m.group(1), {})
        for k, v in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""):
            labels.setdefault(k, set()).add(v)
    return samples


def referenced_queries():
    """(where, PromQL text) pairs from the dashboard, rules and adapter config."""
    out = []
    dash = json.loads((SRC / "deploy/grafana/pdserve-dashboard.json").read_text())
    panels = []
    for p in dash["panels"]:
        panels.append(p)
        panels.extend(p.get("panels", []))
    for p in panels:
        for t in p.get("targets", []):
            out.append((f"dashboard panel {p['title']!r}", t.get("expr", "")))
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        out.append((f"dashboard variable {v['name']}", q.get("query", "") if isinstance(q, dict) else str(q or "")))
    rules = yaml.safe_load((SRC / "deploy/prometheus/pdserve-rules.yml").read_text())
    for g in rules["groups"]:
        for r in g["rules"]:
            name = r.get("alert") or r.get("record")
            out.append((f"rule {name}", r["expr"]))
            for text in r.get("annotations", {}).values():
                out.append((f"rule {name} annotation", text))
    adapter = yaml.safe_load((SRC / "deploy/prometheus/prometheus-adapter-values.yaml").read_text())
    for r in adapter["rules"]["custom"]:
        out.append(("prometheus-adapter seriesQuery", r["seriesQuery"]))
        out.append(("prometheus-adapter metricsQuery", r["metricsQuery"]))
    return out


def check_references(samples):
    names_checked = set()
    for where, q in referenced_queries():
        q_names = set(re.findall(r"\bpdserve_[a-zA-Z0-9_]+", q))
        for n in sorted(q_names):
            names_checked.add(n)
            if n not in samples:
                family = re.sub(r"_(bucket|sum|count)$", "", n)
                hint = ""
                if n + "_bucket" in samples:
                    hint = " (a histogram: use _bucket, _sum or _count)"
                elif family != n and family + "_bucket" not in samples:
                    hint = f" ({family} is not a histogram)"
                fail(f"{where}: {n} is not exported by pdserve{hint}")
                continue
        # label="value" matchers on pdserve selectors.
        for n, body in re.findall(r"\b(pdserve_[a-zA-Z0-9_]+)\{([^}]*)\}", q):
            for label, op, value in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*"([^"]*)"', body):
                if label in TARGET_LABELS or n not in samples or label.startswith("<<"):
                    continue
                have = samples[n].get(label)
                if have is None:
                    fail(f"{where}: {n} has no label {label} (it has {sorted(samples[n])})")
                elif op == "=" and value not in have:
                    fail(f"{where}: {n}{{{label}=\"{value}\"}} matches nothing; exported values: {sorted(have)}")
                elif op == "=~" and not any(re.fullmatch(value, v) for v in have):
                    fail(f"{where}: {n}{{{label}=~\"{value}\"}} matches nothing; exported values: {sorted(have)}")
        # Grouping labels must exist on the metrics of the expression.
        labels_here = TARGET_LABELS | {"le"}
        for n in q_names & samples.keys():
            labels_here |= set(samples[n])
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", q):
            for label in [x.strip() for x in group.split(",") if x.strip()]:
                if label not in labels_here and not label.startswith("<<"):
                    fail(f"{where}: grouping label {label} is on none of {sorted(q_names)}")
    return names_checked


def check_tls(model, common):
    """The components/tls rendering: the same cluster with the manifests'
    certificate flags pointed at a throwaway CA made here with openssl."""
    config, deployments = load_overlay("combo-cpu-tls.yaml")
    tls = WORK / "tls"
    tls.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (["openssl", "req", "-x509", *ec, "-days", "2", "-subj", "/CN=pdserve-deploy-check-ca",
                 "-keyout", tls / "ca.key", "-out", tls / "ca.crt"],
                ["openssl", "req", "-new", *ec, "-subj", "/CN=pdserve", "-addext",
                 "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", tls / "tls.key", "-out", tls / "tls.csr"],
                ["openssl", "x509", "-req", "-days", "2", "-in", tls / "tls.csr", "-CA", tls / "ca.crt",
                 "-CAkey", tls / "ca.key", "-CAcreateserial", "-copy_extensions", "copy", "-out", tls / "tls.crt"]):
        subprocess.run([str(c) for c in cmd], check=True, capture_output=True)
    files = {"--tls-cert": str(tls / "tls.crt"), "--tls-key": str(tls / "tls.key"), "--tls-ca": str(tls / "ca.crt")}
    over = dict(common, **files)
    ends = {}
    for role in ("prefill", "decode"):
        c = deployments[role]["spec"]["template"]["spec"]["containers"][0]
        if "--insecure" in c["args"]:
            fail(f"components/tls: {role} still runs with --insecure")
        ends[role] = start(f"tls-{role}", local_args(c, config, over))
    c = deployments["router"]["spec"]["template"]["spec"]["containers"][0]
    ends["router"] = start("tls-router", local_args(c, config, dict(over, **{
        "--prefill-workers": ends["prefill"][0], "--decode-workers": ends["decode"][0]})))
    deadline = time.time() + 20
    while True:
        _, text = http_get(ends["router"][1], "/metrics")
        up = {(m[0], m[1]) for m in re.findall(r'pdserve_workers\{role="(\w+)",state="up"\} (\d+)', text)}
        if {("prefill", "1"), ("decode", "1")} <= up:
            break
        if time.time() > deadline:
            fail(f"components/tls: the router never reached both workers over mTLS:\n{text}")
            return
        time.sleep(0.2)
    prompt = "pdserve deploy check over mutual TLS: long enough to be prefilled remotely " * 2
    for extra, want in ((["--tls-ca", files["--tls-ca"]], 0), ([], 1)):
        r = subprocess.run([PDSERVE, "generate", "--router", ends["router"][0], "--prompt", prompt,
                            "--max-tokens", "4", "--timeout-ms", "30000", *extra],
                           capture_output=True, text=True, timeout=60)
        if (r.returncode == 0) != (want == 0):
            fail(f"components/tls: generate {'with' if extra else 'without'} --tls-ca exited "
                 f"{r.returncode}: {r.stderr.strip()[-300:]}")
    _, text = http_get(ends["router"][1], "/metrics")
    if not re.search(r'pdserve_prefill_decisions_total\{mode="remote"\} [1-9]', text):
        fail("components/tls: the request was not prefilled remotely over mTLS")
    print("components/tls: router, prefill and decode served a request over mTLS", flush=True)


# ------------------------------------------------------------------- main
def main():
    WORK.mkdir(parents=True, exist_ok=True)
    config, deployments = load_overlay()
    model = WORK / "model"
    if not (model / "config.json").exists():
        subprocess.run([PDSERVE, "model", "init", "--preset", "tiny", "--out", str(model)], check=True,
                       stdout=subprocess.DEVNULL)
    common = {"--model": str(model), "--host": "127.0.0.1", "--port": "0", "--metrics-port": "0",
              "--kv-cache-memory": "64MiB", "--threads": "1"}
    endpoints = {}
    try:
        for role in ("prefill", "decode"):
            c = deployments[role]["spec"]["template"]["spec"]["containers"][0]
            endpoints[role] = start(role, local_args(c, config, common))
        c = deployments["router"]["spec"]["template"]["spec"]["containers"][0]
        router_over = dict(common, **{"--prefill-workers": endpoints["prefill"][0],
                                      "--decode-workers": endpoints["decode"][0]})
        endpoints["router"] = start("router", local_args(c, config, router_over))

        # Wait for the router to see both workers up.
        deadline = time.time() + 20
        while True:
            _, text = http_get(endpoints["router"][1], "/metrics")
            up = {(m[0], m[1]) for m in re.findall(r'pdserve_workers\{role="(\w+)",state="up"\} (\d+)', text)}
            if {("prefill", "1"), ("decode", "1")} <= up:
                break
            if time.time() > deadline:
                raise RuntimeError(f"router never saw both workers up:\n{text}")
            time.sleep(0.2)

        prompt = "pdserve deploy check: a prompt long enough to be prefilled on the prefill worker " * 2
        r = subprocess.run([PDSERVE, "generate", "--router", endpoints["router"][0], "--prompt", prompt,
                            "--max-tokens", "4", "--json", "--timeout-ms", "30000"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            fail(f"generate through the router failed ({r.returncode}): {r.stderr.strip()}")
        else:
            print(f"generate: {r.stdout.strip()}", flush=True)

        samples = {}
        for name, (_, mport) in endpoints.items():
            status, body = http_get(mport, "/healthz")
            if status != 200:
                fail(f"{name}: /healthz answered {status}")
            status, text = http_get(mport, "/metrics")
            (WORK / f"{name}.metrics").write_text(text)
            if PROMTOOL:
                pr = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True)
                if pr.returncode != 0:
                    fail(f"{name}: promtool check metrics: {pr.stdout}{pr.stderr}")
            for n, labels in parse_exposition(text).items():
                merged = samples.setdefault(n, {})
                for k, v in labels.items():
                    merged.setdefault(k, set()).update(v)

        # The deployed configuration really disaggregates.
        remote = samples.get("pdserve_prefill_decisions_total", {})
        router_text = (WORK / "router.metrics").read_text()
        if not re.search(r'pdserve_prefill_decisions_total\{mode="remote"\} [1-9]', router_text):
            fail("the request was not prefilled remotely (pdserve_prefill_decisions_total{mode=\"remote\"} is 0)")
        prefill_text = (WORK / "prefill.metrics").read_text()
        if not re.search(r'pdserve_kv_transfer_bytes_total\{direction="sent"\} [1-9]', prefill_text):
            fail("the prefill worker sent no KV bytes")
        del remote

        check_tls(model, common)

        checked = check_references(samples)
        print(f"checked {len(checked)} metric names used by the dashboard, rules and adapter "
              f"against {len([n for n in samples if n.startswith('pdserve_')])} exported sample names", flush=True)
    finally:
        stop_all()

    if failures:
        print(f"run_cluster_check: {len(failures)} problem(s); logs in {WORK}")
        return 1
    print("run_cluster_check: all checks passed")
    return 0


def stop_all():
    for name, p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + 30
    for name, p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
            if p.returncode != 0:
                fail(f"{name} exited with {p.returncode} after SIGTERM")
        except subprocess.TimeoutExpired:
            fail(f"{name} did not exit within 30 s of SIGTERM with no work in flight")
            p.kill()
            p.wait()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # a failed start: report, clean up, fail
        print(f"FAIL {e}")
        stop_all()
        sys.exit(1)
