#!/usr/bin/python3
"""Writes (or with --check, verifies) the PrometheusRule in
deploy/k8s/components/monitoring from deploy/prometheus/pdserve-rules.yml,
the single source of the alerting rules."""
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/pdserve-rules.yml"
TARGET = ROOT / "deploy/k8s/components/monitoring/prometheusrule.yaml"

HEADER = """\
# Generated from deploy/prometheus/pdserve-rules.yml, the source of truth:
# edit that file, then run /usr/bin/python3 tests/deploy/sync_prometheusrule.py
# (tests/deploy checks that spec.groups here equals the groups there).
"""


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render() -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    obj = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "pdserve",
            "labels": {"app.kubernetes.io/name": "pdserve", "release": "kube-prometheus-stack"},
        },
        "spec": {"groups": groups},
    }
    return HEADER + yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=120)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        have = yaml.safe_load(TARGET.read_text()) if TARGET.exists() else None
        want = yaml.safe_load(text)
        if have != want:
            print(f"FAIL: {TARGET.relative_to(ROOT)} differs from {RULES.relative_to(ROOT)}; "
                  "run /usr/bin/python3 tests/deploy/sync_prometheusrule.py")
            return 1
        print(f"ok: {TARGET.relative_to(ROOT)} matches {RULES.relative_to(ROOT)}")
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
