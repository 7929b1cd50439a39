#!/usr/bin/env node
// An independent gRPC client for pdserve. It ships no .proto file and reads
// none from the repository: everything it knows about pdserve.v1.Router comes
// from the server's reflection service at run time, the way grpcurl or Postman
// would discover it.
//
//   npm ci --prefix tests/grpc_client          # pinned deps (package-lock.json)
//   node tests/grpc_client/reflection_client.mjs --addr 127.0.0.1:50051 \
//        --prompt "Hello" --max-tokens 16 --ignore-eos
//
// Dependencies resolve from this file's folder upward, or from NODE_PATH
// (e.g. NODE_PATH=/somewhere/node_modules when they were installed elsewhere).
//
// Steps (each failure exits non-zero with a message on stderr):
//   1. ServerReflectionInfo list_services (reflection v1, falling back to
//      v1alpha); the list must include pdserve.v1.Router and grpc.health.v1.Health.
//   2. file_containing_symbol pdserve.v1.Router (+ its dependencies) -> a
//      grpc-js client built from the reflected FileDescriptorProtos.
//   3. grpc.health.v1.Health/Check must return SERVING. Its descriptor also
//      comes from reflection when the server can describe it; gRPC C++'s
//      built-in health service often cannot ("Symbol not found"), and then the
//      standard grpc.health.v1 schema that every health client carries is used
//      (reported as health.descriptor = "builtin-standard").
//   4. Router/Generate as a server stream; the streamed messages are merged.
//   5. Optionally (--check-invalid-argument) Generate with max_tokens 0 must
//      fail with gRPC status 3 INVALID_ARGUMENT.
// stdout: one JSON object {services, token_ids, text, finish_reason, usage, ...}.

import { createRequire } from 'node:module';

const require = createRequire(import.meta.url);

function die(msg) {
  process.stderr.write(`reflection_client: ${msg}\n`);
  process.exit(1);
}

let grpc, GrpcReflection, protoLoader;
try {
  grpc = require('@grpc/grpc-js');
  ({ GrpcReflection } = require('grpc-js-reflection-client'));
  protoLoader = require('@grpc/proto-loader');
} catch (e) {
  die(`cannot load the npm dependencies (${e.message.split('\n')[0]}).\n` +
      `  install them with: npm ci --prefix tests/grpc_client\n` +
      `  or point NODE_PATH at a node_modules folder that has them`);
}

const ROUTER = 'pdserve.v1.Router';
const HEALTH = 'grpc.health.v1.Health';

// ---------------------------------------------------------------- arguments
function usage() {
  return `usage: reflection_client.mjs --addr HOST:PORT [--prompt TEXT] [--max-tokens N]
         [--ignore-eos] [--temperature T] [--top-p P] [--top-k K] [--seed S]
         [--stop STR]... [--check-invalid-argument] [--wait-ready-ms MS]
         [--timeout-ms MS] [--pretty]`;
}

function parseArgs(argv) {
  const o = {
    addr: process.env.ADDR || '', prompt: 'Hello', maxTokens: 16, ignoreEos: false,
    temperature: undefined, topP: undefined, topK: undefined, seed: undefined, stop: [],
    checkInvalid: false, waitReadyMs: 0, timeoutMs: 60000, pretty: false,
  };
  const num = (flag, v) => {
    if (v === undefined || v === '' || !Number.isFinite(Number(v))) die(`${flag} needs a number\n${usage()}`);
    return Number(v);
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const next = () => {
      if (i + 1 >= argv.length) die(`${a} needs a value\n${usage()}`);
      return argv[++i];
    };
    switch (a) {
      case '--addr': o.addr = next(); break;
      case '--prompt': o.prompt = next(); break;
      case '--max-tokens': o.maxTokens = num(a, next()); break;
      case '--ignore-eos': o.ignoreEos = true; break;
      case '--temperature': o.temperature = num(a, next()); break;
      case '--top-p': o.topP = num(a, next()); break;
      case '--top-k': o.topK = num(a, next()); break;
      case '--seed': o.seed = next(); break;
      case '--stop': o.stop.push(next()); break;
      case '--check-invalid-argument': o.checkInvalid = true; break;
      case '--wait-ready-ms': o.waitReadyMs = num(a, next()); break;
      case '--timeout-ms': o.timeoutMs = num(a, next()); break;
      case '--pretty': o.pretty = true; break;
      case '-h': case '--help': process.stdout.write(usage() + '\n'); process.exit(0);
      default: die(`unknown argument ${a}\n${usage()}`);
    }
  }
  if (!o.addr) die(`--addr is required (or set ADDR)\n${usage()}`);
  return o;
}

const opts = parseArgs(process.argv.slice(2));
const creds = grpc.credentials.createInsecure();
const rpcMs = Math.min(10000, opts.timeoutMs);
const callOpts = () => ({ deadline: Date.now() + rpcMs });

// A hard stop so that a wedged server can never hang the caller.
const watchdog = setTimeout(() => die(`timed out after ${opts.timeoutMs} ms`), opts.timeoutMs);
watchdog.unref();

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const errText = (e) => (e && (e.details || e.message)) || String(e);

// ---------------------------------------------------------------- reflection
// Ask with the standard v1 reflection API first, as grpcurl does, and fall
// back to v1alpha for servers (such as older gRPC C++) that only serve that.
async function connectReflection() {
  const failures = [];
  for (const version of ['v1', 'v1alpha']) {
    const r = new GrpcReflection(opts.addr, creds, {}, version);
    try {
      const services = await r.listServices('*', new grpc.Metadata(), callOpts());
      return { reflection: r, version, services };
    } catch (e) {
      failures.push(`${version}: ${errText(e)}`);
      if (!/UNIMPLEMENTED/.test(String(e.message))) break;  // only fall back when the API is missing
    }
  }
  throw new Error(`server reflection failed on ${opts.addr}: ${failures.join('; ')}`);
}

// Walks "a.b.C" through a grpc-js package object.
function lookup(pkg, fullName) {
  let node = pkg;
  for (const part of fullName.split('.')) {
    if (!node || !(part in node)) return undefined;
    node = node[part];
  }
  return node;
}

const LOADER_OPTS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };

async function reflectService(reflection, fullName) {
  const descriptor = await reflection.getDescriptorBySymbol(fullName, new grpc.Metadata(), callOpts());
  const ctor = lookup(descriptor.getPackageObject(LOADER_OPTS), fullName);
  if (typeof ctor !== 'function' || !ctor.service) {
    throw new Error(`reflection returned descriptors without a service ${fullName}`);
  }
  return ctor;
}

// The standard grpc.health.v1 schema (grpc/health/v1/health.proto), used only
// when the server lists the Health service but cannot describe it.
const STANDARD_HEALTH_JSON = {
  nested: { grpc: { nested: { health: { nested: { v1: { nested: {
    HealthCheckRequest: { fields: { service: { type: 'string', id: 1 } } },
    HealthCheckResponse: {
      fields: { status: { type: 'ServingStatus', id: 1 } },
      nested: { ServingStatus: { values: { UNKNOWN: 0, SERVING: 1, NOT_SERVING: 2, SERVICE_UNKNOWN: 3 } } },
    },
    Health: { methods: {
      Check: { requestType: 'HealthCheckRequest', responseType: 'HealthCheckResponse' },
      Watch: { requestType: 'HealthCheckRequest', responseType: 'HealthCheckResponse', responseStream: true },
    } },
  } } } } } } },
};

async function healthClient(reflection) {
  try {
    return { ctor: await reflectService(reflection, HEALTH), source: 'reflection' };
  } catch (e) {
    process.stderr.write(`reflection_client: note: ${HEALTH} is listed but reflection cannot describe it ` +
                         `(${errText(e)}); using the standard grpc.health.v1 schema\n`);
    const pkg = grpc.loadPackageDefinition(protoLoader.fromJSON(STANDARD_HEALTH_JSON, LOADER_OPTS));
    return { ctor: lookup(pkg, HEALTH), source: 'builtin-standard', reflectionError: errText(e) };
  }
}

const unary = (client, method, req) => new Promise((resolve, reject) => {
  client[method](req, callOpts(), (err, res) => (err ? reject(err) : resolve(res)));
});

// ---------------------------------------------------------------- Generate
function generateRequest(maxTokens) {
  const sampling = { max_tokens: maxTokens, ignore_eos: opts.ignoreEos };
  if (opts.temperature !== undefined) sampling.temperature = opts.temperature;
  if (opts.topP !== undefined) sampling.top_p = opts.topP;
  if (opts.topK !== undefined) sampling.top_k = opts.topK;
  if (opts.seed !== undefined) sampling.seed = String(opts.seed);
  if (opts.stop.length) sampling.stop = opts.stop;
  return { prompt: opts.prompt, sampling };
}

function streamGenerate(router, req) {
  return new Promise((resolve, reject) => {
    const out = { request_id: '', token_ids: [], text: '', finish_reason: '', usage: null,
                  prefill_worker: '', decode_worker: '', messages: 0 };
    const call = router.Generate(req, { deadline: Date.now() + opts.timeoutMs });
    call.on('data', (m) => {
      out.messages++;
      if (m.request_id) out.request_id = m.request_id;
      for (const id of m.token_ids || []) out.token_ids.push(Number(id));
      out.text += m.text || '';
      if (m.finish_reason) out.finish_reason = m.finish_reason;
      if (m.usage) out.usage = m.usage;
      if (m.prefill_worker) out.prefill_worker = m.prefill_worker;
      if (m.decode_worker) out.decode_worker = m.decode_worker;
    });
    call.on('error', (e) => { e.partial = out; reject(e); });
    call.on('end', () => resolve(out));
  });
}

// ---------------------------------------------------------------- main
async function main() {
  // 1. Discover (retrying while the server is still coming up).
  const readyBy = Date.now() + opts.waitReadyMs;
  let conn;
  for (;;) {
    try { conn = await connectReflection(); break; } catch (e) {
      if (Date.now() >= readyBy) throw e;
      await sleep(200);
    }
  }
  const { reflection, version, services } = conn;
  for (const want of [ROUTER, HEALTH]) {
    if (!services.includes(want)) throw new Error(`reflection does not list ${want}; it lists: ${services.join(', ')}`);
  }

  // 2. pdserve.v1.Router, from the reflected descriptors only.
  const RouterCtor = await reflectService(reflection, ROUTER);
  const methods = RouterCtor.service;
  if (!methods.Generate) throw new Error(`${ROUTER} has no Generate method; it has: ${Object.keys(methods).join(', ')}`);
  if (methods.Generate.requestStream || !methods.Generate.responseStream) {
    throw new Error(`${ROUTER}/Generate is not a server-streaming method`);
  }
  const router = new RouterCtor(opts.addr, creds);

  // 3. Health (and, with --wait-ready-ms, at least one worker up).
  const health = await healthClient(reflection);
  const healthStub = new health.ctor(opts.addr, creds);
  let status;
  let workersUp = null;
  for (;;) {
    try {
      status = (await unary(healthStub, 'Check', { service: '' })).status;
      if (status === 'SERVING' && opts.waitReadyMs > 0 && methods.ListWorkers) {
        const workers = (await unary(router, 'ListWorkers', {})).workers || [];
        workersUp = workers.filter((w) => w.state === 'up').length;
        if (workersUp === 0) status = 'SERVING (no worker up yet)';
      }
    } catch (e) {
      status = `error: ${errText(e)}`;
    }
    if (status === 'SERVING' || Date.now() >= readyBy) break;
    await sleep(200);
  }
  if (status !== 'SERVING') throw new Error(`${HEALTH}/Check: ${status}`);

  // 4. Generate, streamed.
  let gen;
  try {
    gen = await streamGenerate(router, generateRequest(opts.maxTokens));
  } catch (e) {
    throw new Error(`${ROUTER}/Generate failed: code ${e.code} (${grpc.status[e.code]}): ${errText(e)}`);
  }
  if (!gen.finish_reason) throw new Error('Generate stream ended without a finish_reason');
  if (!gen.usage) throw new Error('Generate stream ended without usage');
  if (Number(gen.usage.completion_tokens) !== gen.token_ids.length) {
    throw new Error(`usage.completion_tokens ${gen.usage.completion_tokens} != ${gen.token_ids.length} streamed tokens`);
  }
  if (opts.ignoreEos && opts.stop.length === 0 &&
      (gen.token_ids.length !== opts.maxTokens || gen.finish_reason !== 'length')) {
    throw new Error(`with ignore_eos expected ${opts.maxTokens} tokens and finish_reason "length", ` +
                    `got ${gen.token_ids.length} and "${gen.finish_reason}"`);
  }

  // 5. The INVALID_ARGUMENT path.
  let invalid;
  if (opts.checkInvalid) {
    try {
      const got = await streamGenerate(router, generateRequest(0));
      throw new Error(`Generate with max_tokens 0 succeeded (${got.token_ids.length} tokens); expected INVALID_ARGUMENT`);
    } catch (e) {
      if (e.code === undefined) throw e;
      if (e.code !== grpc.status.INVALID_ARGUMENT) {
        throw new Error(`Generate with max_tokens 0: expected code 3 INVALID_ARGUMENT, got ${e.code} (${grpc.status[e.code]}): ${errText(e)}`);
      }
      invalid = { max_tokens: 0, code: e.code, code_name: grpc.status[e.code], details: e.details || '' };
    }
  }

  router.close();
  healthStub.close();

  const result = {
    address: opts.addr,
    reflection_api: `grpc.reflection.${version}.ServerReflection`,
    services,
    router_methods: Object.keys(methods),
    health: { status, descriptor: health.source, ...(workersUp !== null ? { workers_up: workersUp } : {}) },
    request_id: gen.request_id,
    token_ids: gen.token_ids,
    text: gen.text,
    finish_reason: gen.finish_reason,
    usage: gen.usage,
    prefill_worker: gen.prefill_worker,
    decode_worker: gen.decode_worker,
    stream_messages: gen.messages,
    ...(invalid ? { invalid_argument_check: invalid } : {}),
  };
  process.stdout.write(JSON.stringify(result, null, opts.pretty ? 2 : undefined) + '\n');
}

main().then(
  () => process.exit(0),
  (e) => die(e && e.message ? e.message : String(e)),
);
