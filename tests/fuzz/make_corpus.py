#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target into tests/fuzz/corpus/<target>/.

Seeds are small valid inputs (plus a few near-misses) that take each target
past its first checks, so libFuzzer starts from real structure. Deterministic:
rerunning rewrites the same files. Protobuf messages are encoded by hand (the
wire format is simple), so nothing beyond python3 is needed.
usage: make_corpus.py [CORPUS_DIR]
"""
import json
import os
import struct
import sys

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
SEP = b"\n\x01\x02\n"  # tests/fuzz/fuzz_util.h kPartSeparator


def write(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# --- protobuf wire format -------------------------------------------------
def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field_varint(num, n):
    return varint(num << 3) + varint(n)


def field_bytes(num, b):
    b = b.encode() if isinstance(b, str) else b
    return varint((num << 3) | 2) + varint(len(b)) + b


# --- safetensors ----------------------------------------------------------
def safetensors(tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


f32 = lambda *v: struct.pack("<%df" % len(v), *v)
write("safetensors_fuzz", "two_tensors", safetensors(
    [("a.weight", "F32", [2, 2], f32(1, 2, 3, 4)), ("b.bias", "F16", [3], b"\x00\x3c\x00\x40\x00\xc0")],
    {"format": "pt"}))
write("safetensors_fuzz", "bf16_scalar", safetensors([("s", "BF16", [], b"\x80\x3f")]))
write("safetensors_fuzz", "empty_tensor", safetensors([("e", "F32", [0, 4], b"")]))
write("safetensors_fuzz", "empty_header", struct.pack("<Q", 2) + b"{}")
write("safetensors_fuzz", "bad_dtype", safetensors([("x", "I64", [1], b"\0" * 8)]))

# --- config.json ----------------------------------------------------------
llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 258, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "bos_token_id": 256, "eos_token_id": 257, "tie_word_embeddings": False}
write("model_config_fuzz", "llama", json.dumps(llama, indent=1))
llama3 = dict(llama, eos_token_id=[257, 255], rope_scaling={
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192})
write("model_config_fuzz", "llama3_rope", json.dumps(llama3).encode() + SEP + b'{"eos_token_id": [1, 2], "bos_token_id": 0}')
write("model_config_fuzz", "qwen2", json.dumps(dict(llama, architectures=["Qwen2ForCausalLM"], sliding_window=4096,
                                                   use_sliding_window=False)))
write("model_config_fuzz", "qwen3", json.dumps(dict(llama, architectures=["Qwen3ForCausalLM"], head_dim=32,
                                                   attention_bias=False)))
write("model_config_fuzz", "mistral", json.dumps(dict(llama, architectures=["MistralForCausalLM"], sliding_window=256)))

# --- tokenizer.json -------------------------------------------------------
def gpt2_byte_char(b):
    direct = (ord("!") <= b <= ord("~")) or (0xA1 <= b <= 0xAC) or (0xAE <= b <= 0xFF)
    if direct:
        return chr(b)
    n = sum(1 for k in range(b) if not ((ord("!") <= k <= ord("~")) or (0xA1 <= k <= 0xAC) or (0xAE <= k <= 0xFF)))
    return chr(256 + n)


SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
vocab = {gpt2_byte_char(b): b for b in range(256)}
merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), (gpt2_byte_char(32), "w"), ("o", "r")]
for a, b in merges:
    vocab[a + b] = len(vocab)
byte_level = {
    "version": "1.0",
    "added_tokens": [{"id": len(vocab), "content": "<|bos|>", "special": True},
                     {"id": len(vocab) + 1, "content": "<|eos|>", "special": True},
                     {"id": len(vocab) + 2, "content": "<tool>", "special": False}],
    "normalizer": {"type": "NFC"},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
    "post_processor": {"type": "TemplateProcessing",
                       "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                       "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [len(vocab)], "tokens": ["<|bos|>"]}}},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "ignore_merges": True, "vocab": vocab, "merges": [[a, b] for a, b in merges]},
}
config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "tokenizer_class": "PreTrainedTokenizerFast"}
write("tokenizer_fuzz", "byte_level", json.dumps(byte_level).encode() + SEP + json.dumps(config).encode() + SEP +
      b'{"eos_token_id": 263}' + SEP + "hello world <tool> héllo 12345\n".encode())

sp_vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
for b in range(256):
    sp_vocab["<0x%02X>" % b] = len(sp_vocab)
for t in ["▁", "a", "b", "h", "i", "▁a", "ab", "▁ab", "▁h", "▁hi"]:
    sp_vocab[t] = len(sp_vocab)
sentencepiece = {
    "version": "1.0",
    "added_tokens": [{"id": 0, "content": "<unk>", "special": True}, {"id": 1, "content": "<s>", "special": True},
                     {"id": 2, "content": "</s>", "special": True}],
    "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                       {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": None,
    "post_processor": None,
    "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                                                 {"type": "ByteFallback"}, {"type": "Fuse"},
                                                 {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": True, "fuse_unk": True, "vocab": sp_vocab,
              "merges": ["▁ a", "a b", "▁a b", "▁ h", "▁h i"]},
}
sp_config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "tokenizer_class": "LlamaTokenizer"}
write("tokenizer_fuzz", "sentencepiece", json.dumps(sentencepiece).encode() + SEP + json.dumps(sp_config).encode() +
      SEP + SEP + "ab hi zé 🙂".encode())
write("tokenizer_fuzz", "metaspace", json.dumps(dict(sentencepiece, normalizer=None, pre_tokenizer={
    "type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False})).encode())

# --- KV chunks (kv_chunk_fuzz.cc: frames of [u16 length][u8 slice size][KvChunk];
# pool of 2 layers x 2 kv_heads x head_dim 4
# x block_size 4; reservation "r1"/1 for logical blocks 0..2, block 0 present)
DTYPES = [("fp32", 4), ("bf16", 2), ("int8", 1)]


def kv_stream(dtype_index, frames, sender_ok=True):
    out = bytes([dtype_index | (0 if sender_ok else 0x80)])
    for k, f in enumerate(frames):
        # Alternate one slice per message with small slices that split spans.
        out += struct.pack("<HB", len(f), 0 if k % 2 == 0 else 7) + f
    return out


def header(dtype, reservation=1, request="r1", layers=2, fingerprint="00ff"):
    layout = (field_bytes(1, fingerprint) + field_varint(2, layers) + field_varint(3, 2) + field_varint(4, 4) +
              field_varint(5, 4) + field_bytes(6, dtype))
    return field_bytes(1, field_bytes(1, request) + field_varint(2, reservation) + field_bytes(3, layout) +
                       field_bytes(4, "prefill-0"))


def span(layer, block, nbytes, scales=b""):
    body = field_varint(1, layer) + field_varint(2, block) + field_bytes(3, bytes([layer * 16 + block]) * nbytes)
    if scales:
        body += field_bytes(4, scales)
    return field_bytes(2, body)


for i, (dtype, size) in enumerate(DTYPES):
    n = 2 * 2 * 4 * 4 * size
    scales = f32(0.5, 0.25, 1.0, 2.0) if dtype == "int8" else b""
    spans = [span(l, b, n, scales) for l in range(2) for b in (1, 2)]
    write("kv_chunk_fuzz", "complete_" + dtype, kv_stream(i, [header(dtype) + b"".join(spans[:2]), b"".join(spans[2:])]))
    write("kv_chunk_fuzz", "incomplete_" + dtype, kv_stream(i, [header(dtype) + spans[0]]))
write("kv_chunk_fuzz", "aborted", kv_stream(0, [header("fp32") + span(0, 1, 256)], sender_ok=False))
write("kv_chunk_fuzz", "skipped_block", kv_stream(0, [header("fp32") + span(0, 0, 256)]))
write("kv_chunk_fuzz", "out_of_range", kv_stream(0, [header("fp32") + span(5, 3, 256)]))
write("kv_chunk_fuzz", "short_span", kv_stream(0, [header("fp32") + span(1, 2, 255)]))
write("kv_chunk_fuzz", "layout_mismatch", kv_stream(0, [header("fp32", layers=3) + span(0, 1, 256)]))
write("kv_chunk_fuzz", "wrong_reservation", kv_stream(0, [header("fp32", reservation=2) + span(0, 1, 256)]))


# --- KV events (kv_event_fuzz.cc: frames of [worker][u16 length][KvEventBatch])
def h(n):
    return struct.pack(">QQ", n * 0x9E3779B97F4A7C15 % 2**64, n)


def event(seq, typ, hashes, parent=0):
    return field_bytes(3, field_varint(1, seq) + field_varint(2, typ) + field_bytes(3, h(parent)) +
                       b"".join(field_bytes(4, h(x)) for x in hashes))


def batch(events, snapshot=False, worker="w0"):
    return field_bytes(1, worker) + (field_varint(2, 1) if snapshot else b"") + b"".join(events)


def ev_stream(frames):
    return b"".join(bytes([w]) + struct.pack("<H", len(f)) + f for w, f in frames)


write("kv_event_fuzz", "snapshot_then_events", ev_stream([
    (0, batch([event(5, 0, [1, 2, 3])], snapshot=True)),
    (0, batch([event(6, 0, [4, 5], parent=3), event(7, 1, [2, 99])])),
    (1, batch([event(0, 0, [])], snapshot=True, worker="w1")),
    (1, batch([event(1, 0, [1, 2], parent=0)], worker="w1")),
    (0, batch([event(8, 2, [])])),
]))
write("kv_event_fuzz", "gap_then_resync", ev_stream([
    (0, batch([event(1, 0, [7, 8])], snapshot=True)),
    (0, batch([event(3, 0, [9])])),
    (0, batch([event(9, 0, [7, 10])], snapshot=True)),
    (0, batch([event(10, 1, [7])])),
]))
write("kv_event_fuzz", "malformed_hash", ev_stream([
    (1, batch([event(1, 0, [1])], snapshot=True)),
    (1, batch([field_bytes(3, field_varint(1, 2) + field_bytes(4, b"short"))])),
    (1, batch([field_bytes(3, field_varint(1, 3) + field_varint(2, 7))])),
]))
# --- OpenAI front headers (openai_header_fuzz.cc: [endpoint][Authorization
# value]); the last three are the values gRPC aborts on, kept as regressions.
write("openai_header_fuzz", "completions_bearer", b"\x00Bearer tok-alpha")
write("openai_header_fuzz", "chat_bearer", b"\x01Bearer tok-alpha")
write("openai_header_fuzz", "models_bearer", b"\x02Bearer tok-alpha")
write("openai_header_fuzz", "extra_header_line", b"\x00Bearer t\r\nX-Request-Id: 7")
write("openai_header_fuzz", "tab", b"\x00Bearer a\tb")
write("openai_header_fuzz", "del", b"\x01Bearer a\x7f")
write("openai_header_fuzz", "latin1", b"\x02Bearer caf\xe9")
# --- structured_constraint_fuzz: a kind byte (0 regex, 1 JSON schema, 2 choice
# list as JSON, 3 json_object, 4 GBNF grammar text, 5 bytes that drive a
# random-grammar generator), then the constraint's text ------------------------
write("structured_constraint_fuzz", "regex", b"\x00" + r"[a-z]{2,5}(\.\d+)?|é+|(?:x|y)*z".encode())
write("structured_constraint_fuzz", "regex_bad", b"\x00(a|b{3,2}")
write("structured_constraint_fuzz", "schema", b"\x01" + json.dumps({
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": -5, "maximum": 300},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 3},
        "when": {"type": "string", "format": "date"},
        "id": {"type": "string", "pattern": "^[0-9a-f]{4}$"}},
    "required": ["name", "n"], "additionalProperties": False}).encode())
write("structured_constraint_fuzz", "schema_ref", b"\x01" + json.dumps({
    "$defs": {"t": {"type": "object", "properties": {"kid": {"$ref": "#/$defs/t"},
                                                      "v": {"type": ["number", "null"]}}}},
    "anyOf": [{"$ref": "#/$defs/t"}, {"const": [1, {"a": None}]}]}).encode())
write("structured_constraint_fuzz", "choice", b"\x02" + json.dumps(["yes", "no", "n\u00e9"]).encode())
write("structured_constraint_fuzz", "json_object", b"\x03")
write("structured_constraint_fuzz", "grammar_arith", b"\x04" + b"""# arithmetic
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")" | "-" factor
""")
write("structured_constraint_fuzz", "grammar_json", b"\x04" + br"""root ::= value
value ::= object | array | string | "null"
object ::= "{" (string ":" value ("," string ":" value)*)? "}"
array ::= "[" (value ("," value){0,3})? "]"
string ::= "\"" [^"\\\x00-\x1f]{0,4} "\""
""")
write("structured_constraint_fuzz", "grammar_left", b"\x04" +
      "root ::= list\nlist ::= list \",\" item | item\nitem ::= [a-cé\\u00e8]{1,2} .?\n".encode())
write("structured_constraint_fuzz", "grammar_bad", b"\x04root ::= a\na ::= \"(\" a")
write("structured_constraint_fuzz", "grammar_gen", bytes([5]) + bytes(range(7, 250, 3)))
print("wrote seeds under", OUT)
