#!/usr/bin/python3
"""promtool checks of deploy/prometheus and the PromQL in deploy/grafana.

    check_prometheus.py SOURCE_DIR PROMTOOL WORK_DIR

1. `promtool check config deploy/prometheus/prometheus.yml` (which also checks
   the rule files it loads). Debian's prometheus package is built without
   Kubernetes service discovery, so its promtool rejects the
   kubernetes_sd_configs key. When (and only when) promtool says exactly that,
   the config is checked with each kubernetes_sd_configs block replaced by a
   placeholder static target, and the blocks themselves are checked here
   (role, keys, and the __meta_kubernetes_* labels the relabelling reads).
2. `promtool check rules deploy/prometheus/pdserve-rules.yml`.
3. `promtool test rules tests/deploy/rules_test.yml`: every alert fires on a
   bad series and stays silent on a good one.
4. The PrometheusRule in deploy/k8s/components/monitoring equals the rules.
5. Grafana dashboard: well-formed (unique panel ids, grid inside 24 columns,
   a datasource and PromQL on every target) and every query parses: each is
   turned into a recording rule, with Grafana's variables substituted, and
   `promtool check rules` parses it. The prometheus-adapter queries likewise.
"""
import json
import pathlib
import re
import shutil
import subprocess
import sys

import yaml

SRC = pathlib.Path(sys.argv[1]).resolve()
PROMTOOL = sys.argv[2]
WORK = pathlib.Path(sys.argv[3]).resolve()
PROM_DIR = SRC / "deploy/prometheus"
DASHBOARD = SRC / "deploy/grafana/pdserve-dashboard.json"

failures = []


def fail(msg):
    failures.append(msg)
    print(f"FAIL {msg}")


def promtool(*args):
    r = subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True)
    return r.returncode, (r.stdout + r.stderr).strip()


# ---------------------------------------------------------------- 1. config
# Meta labels Prometheus' Kubernetes SD sets for each role (the ones a
# relabel rule may read), from the Prometheus documentation.
K8S_SD_KEYS = {"role", "namespaces", "selectors", "api_server", "kubeconfig_file", "attach_metadata",
               "basic_auth", "authorization", "oauth2", "tls_config", "proxy_url", "follow_redirects",
               "enable_http2", "bearer_token", "bearer_token_file", "no_proxy", "proxy_from_environment",
               "proxy_connect_header"}
K8S_SD_META = {
    "pod": ["__meta_kubernetes_namespace", "__meta_kubernetes_pod_name", "__meta_kubernetes_pod_ip",
            "__meta_kubernetes_pod_label_", "__meta_kubernetes_pod_labelpresent_",
            "__meta_kubernetes_pod_annotation_", "__meta_kubernetes_pod_annotationpresent_",
            "__meta_kubernetes_pod_container_init", "__meta_kubernetes_pod_container_name",
            "__meta_kubernetes_pod_container_id", "__meta_kubernetes_pod_container_image",
            "__meta_kubernetes_pod_container_port_name", "__meta_kubernetes_pod_container_port_number",
            "__meta_kubernetes_pod_container_port_protocol", "__meta_kubernetes_pod_ready",
            "__meta_kubernetes_pod_phase", "__meta_kubernetes_pod_node_name", "__meta_kubernetes_pod_host_ip",
            "__meta_kubernetes_pod_uid", "__meta_kubernetes_pod_controller_kind",
            "__meta_kubernetes_pod_controller_name"],
}


def check_k8s_sd(job, sd_configs, relabels):
    roles = set()
    for sd in sd_configs:
        unknown = set(sd) - K8S_SD_KEYS
        if unknown:
            fail(f"prometheus.yml job {job}: unknown kubernetes_sd_configs keys {sorted(unknown)}")
        role = sd.get("role")
        if role not in {"pod", "service", "endpoints", "endpointslice", "node", "ingress"}:
            fail(f"prometheus.yml job {job}: kubernetes_sd_configs role {role!r} is not a Kubernetes SD role")
        roles.add(role)
        ns = sd.get("namespaces", {})
        if ns and not (isinstance(ns.get("names", []), list) and set(ns) <= {"names", "own_namespace"}):
            fail(f"prometheus.yml job {job}: namespaces must be {{names: [...], own_namespace: bool}}")
    for rc in relabels or []:
        for label in rc.get("source_labels", []):
            if not label.startswith("__meta_kubernetes_"):
                continue
            allowed = [p for r in roles for p in K8S_SD_META.get(r, [])]
            if not any(label == p or (p.endswith("_") and label.startswith(p)) for p in allowed):
                fail(f"prometheus.yml job {job}: {label} is not set by Kubernetes SD role(s) {sorted(roles)}")


def check_config():
    config = PROM_DIR / "prometheus.yml"
    rc, out = promtool("check", "config", config)
    if rc == 0:
        print(f"ok: promtool check config {config.name}\n{out}")
        return
    if "field kubernetes_sd_configs not found" not in out:
        fail(f"promtool check config {config.name}:\n{out}")
        return
    print("note: this promtool has no Kubernetes service discovery (Debian builds it without);"
          " checking the config with kubernetes_sd_configs replaced by static targets, and the SD blocks here")
    cfg = yaml.safe_load(config.read_text())
    for job in cfg.get("scrape_configs", []):
        if "kubernetes_sd_configs" in job:
            check_k8s_sd(job["job_name"], job.pop("kubernetes_sd_configs"), job.get("relabel_configs"))
            job["static_configs"] = [{"targets": ["k8s-sd-placeholder:9400"]}]
    tmp = WORK / "prometheus-config"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for rule_file in cfg.get("rule_files", []):
        shutil.copy(PROM_DIR / rule_file, tmp / rule_file)
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    rc, out = promtool("check", "config", tmp / "prometheus.yml")
    if rc != 0:
        fail(f"promtool check config (without kubernetes_sd_configs):\n{out}")
    else:
        print(f"ok: promtool check config (kubernetes_sd_configs checked separately)\n{out}")


# ----------------------------------------------------------------- 2-4. rules
def check_rules():
    rc, out = promtool("check", "rules", PROM_DIR / "pdserve-rules.yml")
    (print if rc == 0 else fail)(f"promtool check rules pdserve-rules.yml:\n{out}" if rc else f"ok: {out}")
    rc, out = promtool("test", "rules", SRC / "tests/deploy/rules_test.yml")
    (print if rc == 0 else fail)(f"promtool test rules:\n{out}" if rc else f"ok: promtool test rules: {out}")
    rc = subprocess.run([sys.executable, SRC / "tests/deploy/sync_prometheusrule.py", "--check"]).returncode
    if rc != 0:
        fail("PrometheusRule out of sync with pdserve-rules.yml")


# --------------------------------------------------------------- 5. dashboard
GRAFANA_VARS = {
    "$__rate_interval": "5m", "${__rate_interval}": "5m", "$__interval": "1m", "${__interval}": "1m",
    "$__range": "1h", "${__range}": "1h",
}


def substitute(expr):
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    # Template variables used inside label matchers, e.g. namespace=~"$namespace".
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*(:[a-z]+)?\}?", ".*", expr)


def check_dashboard():
    try:
        dash = json.loads(DASHBOARD.read_text())
    except json.JSONDecodeError as e:
        fail(f"{DASHBOARD.name}: not JSON: {e}")
        return
    for key in ("uid", "title", "panels", "schemaVersion", "templating"):
        if key not in dash:
            fail(f"{DASHBOARD.name}: no {key}")
    variables = {v["name"] for v in dash.get("templating", {}).get("list", [])}
    panels = []
    for p in dash.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []))
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)) or None in ids:
        fail(f"{DASHBOARD.name}: panel ids must be present and unique: {ids}")
    rules = []
    for p in panels:
        g = p.get("gridPos", {})
        if not ({"x", "y", "w", "h"} <= set(g)) or g["x"] + g["w"] > 24:
            fail(f"panel {p.get('title')!r}: gridPos {g} must lie within 24 columns")
        if p.get("type") == "row":
            continue
        if not p.get("targets"):
            fail(f"panel {p.get('title')!r}: no queries")
        for t in p.get("targets", []):
            expr = t.get("expr", "")
            if not expr:
                fail(f"panel {p.get('title')!r}: target {t.get('refId')} has no expr")
                continue
            if t.get("datasource", p.get("datasource", {})).get("uid") != "${datasource}":
                fail(f"panel {p.get('title')!r}: use the $datasource variable")
            for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expr):
                if not var.startswith("__") and var not in variables:
                    fail(f"panel {p.get('title')!r}: ${var} is not a dashboard variable")
            rules.append({"record": f"dashboard:panel{p['id']}:{t.get('refId', 'A')}", "expr": substitute(expr)})
    adapter = yaml.safe_load((PROM_DIR / "prometheus-adapter-values.yaml").read_text())
    for i, r in enumerate(adapter["rules"]["custom"]):
        series = r["seriesQuery"]
        query = (r["metricsQuery"].replace("<<.Series>>", re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", series).group(0))
                 .replace("<<.LabelMatchers>>", 'namespace="pdserve",pod=~"x|y"').replace("<<.GroupBy>>", "pod"))
        rules.append({"record": f"adapter:rule{i}:series", "expr": series})
        rules.append({"record": f"adapter:rule{i}:metrics", "expr": query})
    out_file = WORK / "dashboard-queries.rules.yml"
    WORK.mkdir(parents=True, exist_ok=True)
    out_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False))
    rc, out = promtool("check", "rules", out_file)
    if rc != 0:
        fail(f"dashboard / adapter PromQL does not parse:\n{out}")
    else:
        print(f"ok: {len(rules)} dashboard and adapter queries parse ({out.splitlines()[-1].strip()})")


def main():
    check_config()
    check_rules()
    check_dashboard()
    if failures:
        print(f"check_prometheus: {len(failures)} problem(s)")
        return 1
    print("check_prometheus: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
