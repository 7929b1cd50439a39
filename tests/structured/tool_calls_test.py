#!/usr/bin/env python3
"""OpenAI tool calling end to end, with random weights: `tools` with a named
function and with tool_choice "required" answered as message.tool_calls whose
arguments validate (Debian's python3-jsonschema) against each tool's
parameters, greedy and seeded, "auto" parsing the model's native tool-call
text, streamed equal to unstreamed, disaggregated
equal to colocated; bad tools are 400s naming the field; the documented tools
example is POSTed as written.

usage: tool_calls_test.py PDSERVE_BIN DOC_FILE WORK_DIR [unittest args]

The clusters are structured_output_test.py's (disagg: 1 prefill + 1 decode
worker with remote prefill for every prompt; coloc: 1 `worker --role both`),
each behind a router with --http-port.
"""
import json
import os
import re
import sys
import unittest
import urllib.request

import jsonschema

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import structured_output_test as cluster  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "unit", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book_table", "strict": True,
        "parameters": {
            "$defs": {"time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}},
            "type": "object",
            "properties": {
                "guests": {"type": "integer", "minimum": 1, "maximum": 12},
                "at": {"$ref": "#/$defs/time"},
                "names": {"type": "array", "items": {"type": "string", "maxLength": 6},
                          "minItems": 1, "maxItems": 2}},
            "required": ["guests", "at", "names"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},
]
PARAMS = {t["function"]["name"]: t["function"].get(
    "parameters", {"type": "object", "properties": {}, "additionalProperties": False})
    for t in TOOLS}
MESSAGES = [{"role": "system", "content": "You book tables and know the weather."},
            {"role": "user", "content": "Table for two at 19:30, and the weather in Oslo?"}]
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "seed": 11}}


def setUpModule():
    cluster.BIN, cluster.DOC, cluster.WORK = BIN, DOC, WORK
    cluster.setUpModule()


def tearDownModule():
    cluster.tearDownModule()


def chat(where, **body):
    return cluster.post(where, "/v1/chat/completions",
                        {"model": cluster.MODEL_NAME, "messages": MESSAGES, **body})


def stream(where, **body):
    """The SSE chunks of a streamed chat completion, [DONE] checked."""
    data = json.dumps({"model": cluster.MODEL_NAME, "messages": MESSAGES,
                       "stream": True, **body}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{cluster.CLUSTERS[where]['http']}/v1/chat/completions",
        data=data, headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [line[len("data: "):] for line in r.read().decode().split("\n")
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-1]
    for e in events[:-1]:
        chunks.append(json.loads(e))
    return chunks


def reassemble(test, chunks):
    """The calls, content and finish reason the deltas add up to, with the
    OpenAI delta shape checked on the way."""
    calls, content, finish = [], "", None
    for c in chunks:
        choice = c["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for part in delta.get("tool_calls", []):
            i = part["index"]
            if "id" in part:
                test.assertEqual(i, len(calls))
                test.assertEqual(part["type"], "function")
                test.assertEqual(part["function"]["arguments"], "")
                test.assertTrue(part["id"].startswith("call_"))
                calls.append({"name": part["function"]["name"], "arguments": ""})
            else:
                test.assertNotIn("name", part["function"])
                calls[i]["arguments"] += part["function"]["arguments"]
        if choice["finish_reason"] is not None:
            finish = choice["finish_reason"]
    return calls, content, finish


class ToolCallsTest(unittest.TestCase):
    def answer(self, where, **body):
        status, out = chat(where, tools=TOOLS, **{"max_tokens": 400, **body})
        self.assertEqual(status, 200, out)
        choice = out["choices"][0]
        self.assertEqual(choice["finish_reason"], "tool_calls", choice)
        message = choice["message"]
        self.assertIsNone(message["content"])
        calls = []
        for call in message["tool_calls"]:
            self.assertTrue(call["id"].startswith("call_"), call)
            self.assertEqual(call["type"], "function")
            name, args = call["function"]["name"], call["function"]["arguments"]
            jsonschema.validate(json.loads(args), PARAMS[name])
            calls.append({"name": name, "arguments": args})
        return calls

    def check_everywhere(self, **body):
        """Same calls on both clusters and streamed; returns them."""
        want = self.answer("coloc", **body)
        self.assertEqual(self.answer("disagg", **body), want)
        for where in cluster.CLUSTERS:
            calls, content, finish = reassemble(
                self, stream(where, tools=TOOLS, **{"max_tokens": 400, **body}))
            self.assertEqual((calls, content, finish), (want, "", "tool_calls"), where)
        return want

    def test_named_function_arguments_validate_on_every_path(self):
        for name in ("get_weather", "book_table", "ping"):
            for mode, sampling in SAMPLINGS.items():
                with self.subTest(tool=name, sampling=mode):
                    calls = self.check_everywhere(
                        tool_choice={"type": "function", "function": {"name": name}},
                        **sampling)
                    self.assertEqual([c["name"] for c in calls], [name])

    def test_required_calls_validate_on_every_path(self):
        for parallel in (False, True):
            for mode, sampling in SAMPLINGS.items():
                with self.subTest(parallel=parallel, sampling=mode):
                    # Random weights rarely close the array early: room for
                    # all 8 calls the schema allows.
                    calls = self.check_everywhere(tool_choice="required",
                                                  parallel_tool_calls=parallel,
                                                  max_tokens=1500, **sampling)
                    self.assertGreaterEqual(len(calls), 1)
                    self.assertLessEqual(len(calls), 1 if not parallel else 8)

    def test_cut_short_is_length_without_tool_calls(self):
        for where in cluster.CLUSTERS:
            status, out = chat(where, tools=TOOLS, max_tokens=4, temperature=0,
                               tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}})
            self.assertEqual(status, 200, out)
            choice = out["choices"][0]
            self.assertEqual(choice["finish_reason"], "length")
            self.assertNotIn("tool_calls", choice["message"])
            self.assertTrue(choice["message"]["content"].startswith("{"))

    def test_auto_and_none_answer_and_tool_turns_render(self):
        history = MESSAGES + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_abcdefghijklmnopqrstuvwx", "type": "function",
                 "function": {"name": "get_weather",
                              "arguments": "{\"city\": \"Oslo\", \"unit\": \"celsius\", "
                                           "\"days\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_abcdefghijklmnopqrstuvwx",
             "content": "{\"temp\": 3}"}]
        for choice_mode in ("auto", "none"):
            for where in cluster.CLUSTERS:
                status, out = cluster.post(where, "/v1/chat/completions", {
                    "model": cluster.MODEL_NAME, "messages": history, "tools": TOOLS,
                    "tool_choice": choice_mode, "max_tokens": 30, "temperature": 0})
                self.assertEqual(status, 200, out)
                choice = out["choices"][0]
                if choice["finish_reason"] == "tool_calls":
                    # Random weights rarely write a call; if they do it must be valid.
                    self.assertEqual(choice_mode, "auto")
                    for call in choice["message"]["tool_calls"]:
                        json.loads(call["function"]["arguments"])
                else:
                    self.assertIsInstance(choice["message"]["content"], str)
                    self.assertNotIn("tool_calls", choice["message"])

    def test_auto_parses_the_native_format_on_every_path(self):
        # Random weights never write a call by themselves: a regex makes them
        # write one in the ChatML/Hermes format (the presets' template family),
        # which tool_choice "auto" must then answer as tool_calls.
        regex = (r'Sure\.<tool_call>\{"name": "get_weather", "arguments": '
                 r'\{"city": "[a-z]{1,8}", "unit": "(celsius|fahrenheit)", '
                 r'"days": [1-7]\}\}</tool_call>')
        body = {"tool_choice": "auto", "guided_regex": regex, "max_tokens": 200,
                "temperature": 0.9, "seed": 5}
        answers = []
        for where in cluster.CLUSTERS:
            status, out = chat(where, tools=TOOLS, **body)
            self.assertEqual(status, 200, out)
            choice = out["choices"][0]
            self.assertEqual(choice["finish_reason"], "tool_calls", choice)
            message = choice["message"]
            self.assertEqual(message["content"], "Sure.")
            [call] = message["tool_calls"]
            self.assertEqual(call["function"]["name"], "get_weather")
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                PARAMS["get_weather"])
            answers.append(call["function"])
            calls, content, finish = reassemble(self, stream(where, tools=TOOLS, **body))
            self.assertEqual((calls, content, finish),
                             ([call["function"]], "Sure.", "tool_calls"), where)
        self.assertEqual(answers[0], answers[1])
        # Cut short inside the call: plain content, finish_reason length.
        status, out = chat("coloc", tools=TOOLS, **{**body, "max_tokens": 30})
        choice = out["choices"][0]
        self.assertEqual(choice["finish_reason"], "length")
        self.assertTrue(choice["message"]["content"].startswith("Sure.<tool_call>"))
        self.assertNotIn("tool_calls", choice["message"])

    def test_bad_tools_are_400_naming_the_field(self):
        cases = [({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools"),
                 ({"tools": [{"type": "function", "function": {
                     "name": "f", "parameters": {"type": "object", "oneOf": []}}}]}, "tools"),
                 ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                   "function": {"name": "nope"}}},
                  "tool_choice"),
                 ({"tool_choice": "required"}, "tool_choice"),
                 ({"tools": TOOLS, "tool_choice": "required",
                   "response_format": {"type": "json_object"}}, "tool_choice")]
        for extra, param in cases:
            for where in cluster.CLUSTERS:
                status, out = chat(where, **extra)
                self.assertEqual(status, 400, out)
                self.assertEqual(out["error"]["param"], param, out)

    def test_the_documented_tools_example(self):
        with open(DOC, encoding="utf-8") as f:
            doc = f.read()
        blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", doc, re.S)]
        body = next(b for b in blocks if "tools" in b)
        body["model"] = cluster.MODEL_NAME
        params = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
        answers = []
        for where in cluster.CLUSTERS:
            status, out = cluster.post(where, "/v1/chat/completions", body)
            self.assertEqual(status, 200, out)
            choice = out["choices"][0]
            self.assertEqual(choice["finish_reason"], "tool_calls")
            for call in choice["message"]["tool_calls"]:
                fn = call["function"]
                jsonschema.validate(json.loads(fn["arguments"]), params[fn["name"]])
            answers.append([c["function"] for c in choice["message"]["tool_calls"]])
        self.assertEqual(answers[0], answers[1])


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    BIN, DOC, WORK = (os.path.abspath(a) for a in sys.argv[1:4])
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:], verbosity=2)
