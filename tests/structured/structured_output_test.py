#!/usr/bin/env python3
"""Structured output end to end, with random weights: outputs of real pdserve
processes validated by an independent validator (Debian's python3-jsonschema),
by Python's re, and for GBNF grammars by recognisers written here, greedy and
seeded, disaggregated, colocated and the local
`pdserve generate`, with equal outputs across paths.

usage: structured_output_test.py PDSERVE_BIN DOC_FILE WORK_DIR [unittest args]

Clusters (plaintext on 127.0.0.1): disagg (1 prefill + 1 decode worker,
remote prefill for every prompt) and coloc (1 `worker --role both`), each
behind a router with --http-port, and up (`pdserve up`: 1 prefill + 1 decode
worker and a router with its OpenAI front).
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request

import jsonschema

BIN = DOC = WORK = MODEL = None
PROCS, LOGS, CLUSTERS, WORKERS = [], [], {}, {}
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
# GBNF grammars, each with an independent recogniser built from the
# combinators below (recursive descent over Python values, not pdserve code).
GRAMMARS = {
    "arithmetic": """# integer arithmetic
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor ("*" factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
""",
    "jsonish": """root   ::= object | array
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ( pair ( "," pair )* )? "}"
pair   ::= string ":" value
array  ::= "[" ( value ( "," value )* )? "]"
string ::= "\\"" [a-z]{0,6} "\\""
number ::= "-"? ( "0" | [1-9] [0-9]{0,3} )
""",
    "list": """root ::= "[" items "]"
items ::= items ", " item | item   # left recursion, expanded to the bound
item ::= [a-z]{1,5} | "'" [A-Z]{1,3} "'"
""",
    "nest": """root ::= "(" inner ")"
inner ::= root | "x"
""",
}
END = -1  # "the text ended inside a match": a viable prefix
MANY = 10 ** 6  # an open repetition (the texts are far shorter)


def lit(s):
    def f(t, i):
        if t.startswith(s, i):
            return {i + len(s)}
        return {END} if s.startswith(t[i:]) and len(t) - i < len(s) else set()
    return f


def cls(pred):
    return lambda t, i: {END} if i == len(t) else ({i + 1} if pred(t[i]) else set())


def seq(*parts):
    def f(t, i):
        cur = {i}
        for p in parts:
            cur = {k for j in cur for k in ({END} if j == END else p(t, j))}
        return cur
    return f


def alt(*parts):
    return lambda t, i: set().union(*(p(t, i) for p in parts))


def rep(p, lo, hi):
    def f(t, i):
        out, cur, seen = ({i} if lo == 0 else set()), {i}, {i}
        for k in range(1, hi + 1):
            cur = {e for j in cur for e in ({END} if j == END else p(t, j))} - (seen - {END})
            seen |= cur
            if k >= lo:
                out |= cur
            if not cur:
                break
        return out
    return f


def ref(rules, name):
    return lambda t, i: rules[name](t, i)


def digit(c):
    return c.isdigit()


def lower(c):
    return "a" <= c <= "z"


def recognisers():
    a = {}
    a["expr"] = seq(ref(a, "term"), rep(seq(alt(lit("+"), lit("-")), ref(a, "term")), 0, MANY))
    a["term"] = seq(ref(a, "factor"), rep(seq(lit("*"), ref(a, "factor")), 0, MANY))
    a["factor"] = alt(rep(cls(digit), 1, 3), seq(lit("("), ref(a, "expr"), lit(")")))
    j = {}
    string = seq(lit('"'), rep(cls(lower), 0, 6), lit('"'))
    j["value"] = alt(ref(j, "object"), ref(j, "array"), string,
                     seq(rep(lit("-"), 0, 1), alt(lit("0"), seq(cls(lambda c: "1" <= c <= "9"),
                                                                rep(cls(digit), 0, 3)))),
                     lit("true"), lit("false"), lit("null"))
    pair = seq(string, lit(":"), ref(j, "value"))
    j["object"] = seq(lit("{"), rep(seq(pair, rep(seq(lit(","), pair), 0, MANY)), 0, 1), lit("}"))
    j["array"] = seq(lit("["), rep(seq(ref(j, "value"),
                                       rep(seq(lit(","), ref(j, "value")), 0, MANY)), 0, 1), lit("]"))
    item = alt(rep(cls(lower), 1, 5), seq(lit("'"), rep(cls(lambda c: "A" <= c <= "Z"), 1, 3),
                                          lit("'")))
    lst = seq(lit("["), item, rep(seq(lit(", "), item), 0, MANY), lit("]"))
    n = {}
    n["root"] = seq(lit("("), alt(ref(n, "root"), lit("x")), lit(")"))
    return {"arithmetic": a["expr"], "jsonish": alt(ref(j, "object"), ref(j, "array")),
            "list": lst, "nest": n["root"]}


RECOGNISERS = recognisers()


def nesting(text, opens):
    depth = deepest = 0
    for c in text:
        depth += c in opens
        depth -= c in ")]}"
        deepest = max(deepest, depth)
    return deepest


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
    for role in ("prefill", "decode", "both"):
        WORKERS[role] = spawn(role, ["worker", "--role=" + role] + worker)
    pre, dec, both = (WORKERS[r]["addr"] for r in ("prefill", "decode", "both"))
    router = ["router", "--model=" + MODEL, "--insecure", "--port=0", "--metrics-port=0",
              "--served-model-name=" + MODEL_NAME]
    CLUSTERS["disagg"] = spawn("router_disagg", router + [
        "--http-port=%d" % free_port(), "--prefill-workers=" + pre,
        "--decode-workers=" + dec, "--local-prefill-threshold=0"])
    CLUSTERS["coloc"] = spawn("router_coloc", router + [
        "--http-port=%d" % free_port(), "--both-workers=" + both])
    # The same model behind `pdserve up` (1 prefill + 1 decode worker over
    # its default KV transport, and its router's OpenAI front).
    CLUSTERS["up"] = spawn_up(["up", "--model=" + MODEL, "--port=0", "--metrics-port=0",
                               "--http-port=%d" % free_port(), "--threads=1"])
    for c in CLUSTERS.values():
        wait_healthy(c["http"])


def spawn_up(args, timeout=90):
    log = open(os.path.join(WORK, "up.log"), "w")
    LOGS.append(log)
    proc = subprocess.Popen([BIN] + args, stdout=subprocess.PIPE, stderr=log, text=True)
    PROCS.append(proc)
    found, event = {}, threading.Event()

    def read():
        for line in proc.stdout:
            if not log.closed:
                log.write(line)
            m = re.match(r"\s+router\s+grpc (\S+)\s+metrics http://[^:]+:(\d+)/", line)
            if m:
                found.update(addr=m.group(1), metrics=int(m.group(2)))
            m = re.match(r"\s+openai\s+http://[^:]+:(\d+)/v1", line)
            if m and "addr" in found and not event.is_set():
                found["http"] = int(m.group(1))
                event.set()

    threading.Thread(target=read, daemon=True).start()
    if not event.wait(timeout):
        raise RuntimeError("pdserve up did not start (see up.log)")
    return found


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


def plain_metric(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
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

    def check_grammar_output(self, name, choice):
        """A finished text is in the grammar's language; a cut one a prefix."""
        text = choice["text"]
        ends = RECOGNISERS[name](text, 0)
        if choice["finish_reason"] in ("stop", "eos"):  # eos: `generate`'s name
            self.assertIn(len(text), ends, (name, text))
        else:
            self.assertEqual(choice["finish_reason"], "length")
            self.assertTrue(ends & {END, len(text)}, (name, text))
        # Recursion is expanded to 6 levels (the default): at most 7
        # brackets deep for the nesting grammars.
        self.assertLessEqual(nesting(text, "([{"), 7, text)

    def test_grammars_match_on_every_path(self):
        for name, grammar in GRAMMARS.items():
            path = os.path.join(WORK, name + ".gbnf")
            with open(path, "w") as f:
                f.write(grammar)
            for mode, (body, flags) in SAMPLINGS.items():
                with self.subTest(grammar=name, sampling=mode):
                    want = local("Write: ", 300, "--grammar=" + path, *flags)
                    self.check_grammar_output(name, want)
                    for cluster in CLUSTERS:
                        choice = completion(cluster, prompt="Write: ", max_tokens=300,
                                            guided_grammar=grammar, **body)
                        self.assertEqual(choice["text"], want["text"], cluster)
                        self.assertEqual(choice["finish_reason"] == "length",
                                         want["finish_reason"] == "length", cluster)
        # Many seeds: every finished output is in the language.
        finished = 0
        for seed in range(12):
            for name, grammar in GRAMMARS.items():
                choice = completion("coloc", prompt="Go ", max_tokens=200,
                                    guided_grammar=grammar, temperature=1.0, seed=seed)
                self.check_grammar_output(name, choice)
                finished += choice["finish_reason"] == "stop"
        self.assertGreater(finished, 0)

    def test_grammar_through_the_cli_client_equals_local(self):
        path = os.path.join(WORK, "cli.gbnf")
        with open(path, "w") as f:
            f.write(GRAMMARS["jsonish"])
        want = local("Q: ", 200, "--grammar=" + path, "--temperature=0.9", "--seed=5")
        self.check_grammar_output("jsonish", want)
        for cluster in CLUSTERS:
            out = subprocess.run(
                [BIN, "generate", "--router", CLUSTERS[cluster]["addr"], "--prompt", "Q: ",
                 "--max-tokens", "200", "--json", "--temperature=0.9", "--seed=5",
                 "--grammar=" + path], check=True, capture_output=True, text=True).stdout
            self.assertEqual(json.loads(out)["text"], want["text"], cluster)
        bad_path = os.path.join(WORK, "bad.gbnf")
        with open(bad_path, "w") as f:
            f.write('root ::= "a" rest\n')
        bad = subprocess.run([BIN, "generate", "--router", CLUSTERS["coloc"]["addr"],
                              "--prompt", "Q", "--grammar=" + bad_path],
                             capture_output=True, text=True)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("undefined rule 'rest'", bad.stderr)

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
                 ({"guided_grammar": "root ::= item"}, "undefined rule 'item'"),
                 ({"guided_grammar": "root ::= root \"a\""}, "derives no finite string"),
                 ({"guided_grammar": "root ::= \"a\" ; \"b\""}, "unexpected ';' at offset 13")]
        for extra, message in cases:
            for cluster in CLUSTERS:
                status, out = post(cluster, "/v1/completions",
                                   {"model": MODEL_NAME, "prompt": "x", **extra})
                self.assertEqual(status, 400, out)
                self.assertIn(message, out["error"]["message"])

    def test_workers_count_the_rows_they_mask(self):
        # Every worker that samples a constrained token counts its masked
        # rows and the time spent: the prefill worker the first token, the
        # decode worker the rest, the colocated worker all of them.
        name = "pdserve_structured_masked_rows_total"
        secs = "pdserve_structured_mask_seconds_total"
        before = {r: plain_metric(w["metrics"], name) for r, w in WORKERS.items()}
        for cluster in ("disagg", "coloc"):
            out = completion(cluster, prompt="Digits: ", max_tokens=6, temperature=0,
                             guided_regex="[0-9]{6}")
            self.assertRegex(out["text"], r"^[0-9]{6}$")
        # A worker publishes its engine's counts after the step's tokens are
        # sent, so they can trail the answer by a moment.
        want = {"prefill": 1, "decode": 5, "both": 6}
        deadline = time.time() + 10
        while True:
            rows = {r: plain_metric(w["metrics"], name) - before[r]
                    for r, w in WORKERS.items()}
            if rows == want or time.time() > deadline:
                break
            time.sleep(0.02)
        self.assertEqual(rows["prefill"], 1, rows)
        self.assertEqual(rows["decode"], 5, rows)
        self.assertEqual(rows["both"], 6, rows)
        self.assertGreater(plain_metric(WORKERS["both"]["metrics"], secs), 0)

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
