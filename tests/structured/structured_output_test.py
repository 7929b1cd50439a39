#!/usr/bin/env python3
"""Structured output end to end, with random weights: outputs of real pdserve
processes validated by an independent validator (Debian's python3-jsonschema)
and by Python's re, greedy and seeded, disaggregated, colocated and the local
`pdserve generate`, with equal outputs across paths.

usage: structured_output_test.py PDSERVE_BIN DOC_FILE WORK_DIR [unittest args]

Clusters (plaintext on 127.0.0.1): disagg (1 prefill + 1 decode worker,
remote prefill for every prompt) and coloc (1 `worker --role both`), each
behind a router with --http-port.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import unittest
import urllib.error
import urllib.request

import jsonschema

BIN = DOC = WORK = MODEL = None
PROCS, LOGS, CLUSTERS = [], [], {}
MODEL_NAME = "model"

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "age", "address"], "additionalProperties": False},
    "arrays_enums": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", 7, None]},
                     "minItems": 1, "maxItems": 3},
            "kind": {"const": "event"},
            "ok": {"type": "boolean"},
            "score": {"type": ["number", "null"]}},
        "required": ["tags", "kind", "ok", "score"], "additionalProperties": False},
    "ref_anyof": {
        "$defs": {"node": {
            "type": "object",
            "properties": {"v": {"type": "integer", "minimum": -9, "maximum": 99},
                           "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                    "maxItems": 2}},
            "required": ["v", "kids"], "additionalProperties": False}},
        "anyOf": [{"$ref": "#/$defs/node"},
                  {"type": "string", "format": "date"}]},
}
REGEXES = [r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])", r"[A-Z][a-z]{2,6}( [A-Z][a-z]{2,6}){0,2}\.",
           r"(yes|no|maybe)!?"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(name, args, timeout=60):
    log = open(os.path.join(WORK, name + ".log"), "w")
    LOGS.append(log)
    proc = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, stderr=log, text=True)
    PROCS.append(proc)
    found, event = {}, threading.Event()

    def read():
        for line in proc.stdout:
            m = re.search(r"listening on (\S+) metrics (\d+)(?: http (\d+))?", line)
            if m and not event.is_set():
                found.update(addr=m.group(1), metrics=int(m.group(2)),
                             http=int(m.group(3) or 0))
                event.set()

    threading.Thread(target=read, daemon=True).start()
    if not event.wait(timeout):
        raise RuntimeError(f"{name} did not start (see {name}.log)")
    return found


def setUpModule():
    try:
        start()
    except BaseException:
        tearDownModule()
        raise


def start():
    global MODEL
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    MODEL = os.path.join(WORK, MODEL_NAME)
    subprocess.run([BIN, "model", "init", "--preset", "tiny", "--out", MODEL],
                   check=True, capture_output=True)
    worker = ["--model=" + MODEL, "--insecure", "--port=0", "--metrics-port=0", "--threads=1"]
    pre = spawn("prefill", ["worker", "--role=prefill"] + worker)["addr"]
    dec = spawn("decode", ["worker", "--role=decode"] + worker)["addr"]
    both = spawn("both", ["worker", "--role=both"] + worker)["addr"]
    router = ["router", "--model=" + MODEL, "--insecure", "--port=0", "--metrics-port=0",
              "--served-model-name=" + MODEL_NAME]
    CLUSTERS["disagg"] = spawn("router_disagg", router + [
        "--http-port=%d" % free_port(), "--prefill-workers=" + pre,
        "--decode-workers=" + dec, "--local-prefill-threshold=0"])
    CLUSTERS["coloc"] = spawn("router_coloc", router + [
        "--http-port=%d" % free_port(), "--both-workers=" + both])
    for c in CLUSTERS.values():
        wait_healthy(c["http"])


def wait_healthy(port, timeout=30):
    import time
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.HTTPError, OSError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"router on {port} never became healthy")


def tearDownModule():
    for p in PROCS:
        p.terminate()
    for p in PROCS:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
        p.stdout.close()
    for log in LOGS:
        log.close()


def post(cluster, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{CLUSTERS[cluster]['http']}{path}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def completion(cluster, **body):
    status, out = post(cluster, "/v1/completions", {"model": MODEL_NAME, **body})
    assert status == 200, out
    return out["choices"][0]


def local(prompt, max_tokens, *flags):
    out = subprocess.run([BIN, "generate", "--model", MODEL, "--prompt", prompt,
                          "--max-tokens", str(max_tokens), "--json", "--threads=1"] + list(flags),
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def metric(port, name, labels):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r"^%s\{%s\} (\S+)$" % (re.escape(name), re.escape(labels)), text, re.M)
    return float(m.group(1)) if m else 0.0


SAMPLINGS = {"greedy": ({"temperature": 0}, ["--temperature=0"]),
             "seeded": ({"temperature": 0.9, "seed": 42}, ["--temperature=0.9", "--seed=42"])}


class StructuredOutputTest(unittest.TestCase):
    def test_json_schemas_validate_and_agree_on_every_path(self):
        for name, schema in SCHEMAS.items():
            path = os.path.join(WORK, name + ".schema.json")
            with open(path, "w") as f:
                json.dump(schema, f)
            for mode, (body, flags) in SAMPLINGS.items():
                with self.subTest(schema=name, sampling=mode):
                    want = local("A record: ", 300, "--json-schema=" + path, *flags)
                    value = json.loads(want["text"])
                    jsonschema.validate(value, schema)
                    for cluster in CLUSTERS:
                        choice = completion(cluster, prompt="A record: ", max_tokens=300,
                                            response_format={"type": "json_schema", "json_schema": {
                                                "name": name, "schema": schema, "strict": True}},
                                            **body)
                        self.assertEqual(choice["text"], want["text"], cluster)
                        self.assertEqual(choice["finish_reason"], "stop", cluster)

    def test_regex_and_choice_match_on_every_path(self):
        for regex in REGEXES:
            for mode, (body, flags) in SAMPLINGS.items():
                with self.subTest(regex=regex, sampling=mode):
                    want = local("Answer: ", 60, "--regex=" + regex, *flags)["text"]
                    self.assertRegex(want, "^(?:%s)$" % regex)
                    for cluster in CLUSTERS:
                        got = completion(cluster, prompt="Answer: ", max_tokens=60,
                                         guided_regex=regex, **body)
                        self.assertEqual(got["text"], want, cluster)
        choices = ["left", "right", "straight on"]
        texts = set()
        for seed in range(4):
            per_path = {completion(c, prompt="Go ", max_tokens=20, guided_choice=choices,
                                   temperature=1.0, seed=seed)["text"] for c in CLUSTERS}
            self.assertEqual(len(per_path), 1, per_path)
            texts |= per_path
        self.assertTrue(texts <= set(choices), texts)

    def test_cli_client_through_the_router_equals_local(self):
        schema_path = os.path.join(WORK, "cli.schema.json")
        with open(schema_path, "w") as f:
            json.dump(SCHEMAS["nested"], f)
        for flag in ("--regex=" + REGEXES[0], "--json-schema=" + schema_path):
            want = local("Q: ", 200, flag, "--temperature=0.9", "--seed=3")
            for cluster in CLUSTERS:
                out = subprocess.run(
                    [BIN, "generate", "--router", CLUSTERS[cluster]["addr"],
                     "--prompt", "Q: ", "--max-tokens", "200", "--json", "--temperature=0.9",
                     "--seed=3", flag], check=True, capture_output=True, text=True).stdout
                self.assertEqual(json.loads(out)["text"], want["text"], (cluster, flag))
        bad = subprocess.run([BIN, "generate", "--router", CLUSTERS["coloc"]["addr"],
                              "--prompt", "Q", "--regex", "a(?=b)"],
                             capture_output=True, text=True)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("lookaround", bad.stderr)

    def test_json_object_mode_is_an_object(self):
        for cluster in CLUSTERS:
            choice = completion(cluster, prompt="{", max_tokens=400, temperature=0,
                                response_format={"type": "json_object"})
            if choice["finish_reason"] == "stop":
                self.assertIsInstance(json.loads(choice["text"]), dict)
            else:
                self.assertEqual(choice["finish_reason"], "length")
                self.assertTrue(choice["text"].startswith("{"))

    def test_unsatisfiable_within_max_tokens_ends_with_length(self):
        for cluster in CLUSTERS:
            choice = completion(cluster, prompt="x", max_tokens=5, temperature=0,
                                guided_regex="z{30}")
            self.assertEqual(choice["finish_reason"], "length")
            self.assertEqual(choice["text"], "zzzzz")

    def test_bad_constraints_are_400_naming_the_problem(self):
        cases = [({"guided_regex": "(a"}, "missing ')'"),
                 ({"response_format": {"type": "json_schema", "json_schema": {
                     "name": "x", "schema": {"type": "object", "oneOf": []}}}},
                  "unsupported keyword 'oneOf'"),
                 ({"guided_regex": "(a|b)*a(a|b){20}"}, "DFA states"),
                 ({"guided_grammar": "root ::= \"a\""}, "guided_grammar")]
        for extra, message in cases:
            for cluster in CLUSTERS:
                status, out = post(cluster, "/v1/completions",
                                   {"model": MODEL_NAME, "prompt": "x", **extra})
                self.assertEqual(status, 400, out)
                self.assertIn(message, out["error"]["message"])

    def test_unknown_fields_are_ignored_and_counted(self):
        c = CLUSTERS["coloc"]
        before = metric(c["metrics"], "pdserve_openai_unknown_fields_total",
                        'endpoint="/v1/completions"')
        completion("coloc", prompt="x", max_tokens=2, made_up_field=1, another={"a": 1})
        after = metric(c["metrics"], "pdserve_openai_unknown_fields_total",
                       'endpoint="/v1/completions"')
        self.assertEqual(after - before, 2)

    def test_the_documented_response_format_example(self):
        with open(DOC, encoding="utf-8") as f:
            doc = f.read()
        body = json.loads(re.search(r"```json\n(.*?)```", doc, re.S).group(1))
        body["model"] = MODEL_NAME
        schema = body["response_format"]["json_schema"]["schema"]
        for cluster in CLUSTERS:
            status, out = post(cluster, "/v1/chat/completions", body)
            self.assertEqual(status, 200, out)
            choice = out["choices"][0]
            self.assertEqual(choice["finish_reason"], "stop")
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    BIN, DOC, WORK = (os.path.abspath(a) for a in sys.argv[1:4])
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:], verbosity=2)
