// Validates rendered Kubernetes manifests (kubectl kustomize output), offline.
//
//   node validate_k8s.mjs NODE_MODULES_DIR SOURCE_DIR (RENDERED.yaml | DIR)...
//
// 1. Schema: every object against the Kubernetes OpenAPI schemas bundled in
//    the npm package kubernetes-models (and @kubernetes-models/prometheus-operator
//    for PodMonitor / ServiceMonitor / PrometheusRule). An object of a kind
//    with no bundled schema is an error (SKIP_KINDS lists deliberate
//    exceptions; it is empty).
// 2. Strict fields: a field the schema does not define (a typo such as
//    `readinesProbe`) is an error. The compiled validators are run on a Proxy
//    that records which properties they read; an object whose properties the
//    validator inspected one by one must hold no others. (Maps such as labels
//    are enumerated by the validator and free-form objects are never read.)
// 3. Wiring: the references between objects and the pdserve conventions
//    (see checkWiring below).
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { pathToFileURL } from "node:url";

const [nodeModules, sourceDir, ...inputs] = process.argv.slice(2);
// A directory stands for the *.yaml files in it.
const files = inputs.flatMap((p) =>
  fs.statSync(p).isDirectory()
    ? fs.readdirSync(p).filter((f) => f.endsWith(".yaml")).sort().map((f) => path.join(p, f))
    : [p]);
if (!nodeModules || !sourceDir || files.length === 0) {
  console.error("usage: node validate_k8s.mjs NODE_MODULES_DIR SOURCE_DIR (RENDERED.yaml | DIR)...");
  process.exit(2);
}
const require = createRequire(path.join(path.resolve(nodeModules), "noop.js"));
const YAML = require("yaml");

// Kinds validated without a schema, with the reason. Keep empty unless a
// kind truly has no published schema.
const SKIP_KINDS = {};

let failures = 0;
const fail = (where, msg) => {
  failures++;
  console.log(`FAIL ${where}: ${msg}`);
};

// ---------------------------------------------------------------- schemas
function modelFile(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "monitoring.coreos.com") {
    return path.join(nodeModules, "@kubernetes-models/prometheus-operator", group, version, `${kind}.js`);
  }
  return path.join(nodeModules, "kubernetes-models", group || "", version, `${kind}.js`);
}

const modelCache = new Map();
async function modelClass(apiVersion, kind) {
  const file = modelFile(apiVersion, kind);
  if (!modelCache.has(file)) {
    modelCache.set(file, fs.existsSync(file) ? (await import(pathToFileURL(file).href))[kind] : null);
  }
  return modelCache.get(file);
}

// Runs the validator on a Proxy of `obj` and returns the paths of fields it
// never looked at in objects whose fields it checked one by one.
function unknownFields(validate, obj) {
  const read = new Map();
  const enumerated = new Set();
  const proxies = new WeakMap();
  const wrap = (o) => {
    if (o === null || typeof o !== "object") return o;
    if (proxies.has(o)) return proxies.get(o);
    const note = (t, k) => {
      if (typeof k !== "string") return;
      if (!read.has(t)) read.set(t, new Set());
      read.get(t).add(k);
    };
    const p = new Proxy(o, {
      get(t, k, r) { note(t, k); return wrap(Reflect.get(t, k, r)); },
      has(t, k) { note(t, k); return Reflect.has(t, k); },
      ownKeys(t) { enumerated.add(t); return Reflect.ownKeys(t); },
    });
    proxies.set(o, p);
    return p;
  };
  try {
    validate(wrap(obj));
  } catch {
    // schema errors are reported by the plain validation
  }
  const unknown = [];
  const walk = (o, where) => {
    if (Array.isArray(o)) return o.forEach((v, i) => walk(v, `${where}/${i}`));
    if (o === null || typeof o !== "object") return;
    const seen = read.get(o);
    if (!seen && !enumerated.has(o)) return; // free-form: the schema does not describe it
    for (const k of Object.keys(o)) {
      if (!enumerated.has(o) && !seen.has(k)) unknown.push(`${where}/${k}`);
      else walk(o[k], `${where}/${k}`);
    }
  };
  walk(obj, "");
  return unknown;
}

async function validateSchema(where, obj) {
  const { apiVersion, kind } = obj;
  if (SKIP_KINDS[kind]) {
    console.log(`skip ${where}: ${SKIP_KINDS[kind]}`);
    return;
  }
  const Model = await modelClass(apiVersion, kind);
  if (!Model) return fail(where, `no bundled schema for ${apiVersion} ${kind}`);
  try {
    new Model(obj).validate();
  } catch (e) {
    return fail(where, `schema: ${e.message}`);
  }
  for (const f of unknownFields((data) => Model.prototype.validate.call(data), obj)) {
    fail(where, `unknown field ${f} (not in the ${apiVersion} ${kind} schema)`);
  }
}

// ----------------------------------------------------------------- wiring
const WORKLOAD_KINDS = new Set(["Deployment", "StatefulSet", "DaemonSet", "Job"]);
const podSpecOf = (o) => o.spec?.template?.spec;
const podLabelsOf = (o) => o.spec?.template?.metadata?.labels ?? {};
const matches = (selector, labels) => {
  if (!selector) return false;
  for (const [k, v] of Object.entries(selector.matchLabels ?? {})) if (labels[k] !== v) return false;
  for (const e of selector.matchExpressions ?? []) {
    const has = Object.hasOwn(labels, e.key);
    if (e.operator === "In" && !(has && e.values.includes(labels[e.key]))) return false;
    if (e.operator === "NotIn" && has && e.values.includes(labels[e.key])) return false;
    if (e.operator === "Exists" && !has) return false;
    if (e.operator === "DoesNotExist" && has) return false;
  }
  return true;
};
const quantityBytes = (q) => {
  const m = String(q).match(/^([0-9.]+)\s*([KMGTPE]i?B?|[kMGTPE])?$/);
  if (!m) return NaN;
  const unit = (m[2] ?? "").replace(/B$/, "");
  const pow = { "": 0, k: 1, K: 1, M: 2, G: 3, T: 4, P: 5, E: 6 }[unit[0] ?? ""] ?? 0;
  return parseFloat(m[1]) * (unit.endsWith("i") ? 1024 : 1000) ** pow;
};
const flagValue = (args, flag) => {
  for (const a of args ?? []) if (a.startsWith(`${flag}=`)) return a.slice(flag.length + 1);
  const i = (args ?? []).indexOf(flag);
  return i >= 0 ? args[i + 1] : undefined;
};

function checkWiring(name, objs, ctx) {
  const byKind = (k) => objs.filter((o) => o.kind === k);
  const find = (k, n) => objs.find((o) => o.kind === k && o.metadata?.name === n);
  const workloads = objs.filter((o) => WORKLOAD_KINDS.has(o.kind));
  const deployments = byKind("Deployment");
  const component = (o) => podLabelsOf(o)["app.kubernetes.io/component"];
  const w = (o, what) => `${name}: ${o.kind}/${o.metadata.name}${what ? " " + what : ""}`;
  const isOverlay = ctx.overlay;

  // Namespaces.
  if (isOverlay) {
    for (const o of objs) {
      if (["Namespace"].includes(o.kind)) continue;
      if (o.metadata?.namespace !== "pdserve") fail(w(o), `namespace is ${o.metadata?.namespace}, want pdserve`);
    }
    if (!find("Namespace", "pdserve")) fail(name, "no Namespace pdserve");
  }

  // The three serving pools exist.
  for (const c of ["router", "prefill", "decode"]) {
    if (!deployments.some((d) => component(d) === c)) fail(name, `no Deployment for component ${c}`);
  }

  const configMapData = (cmName) => find("ConfigMap", cmName)?.data;
  for (const o of workloads) {
    const spec = podSpecOf(o);
    const sc = spec.securityContext ?? {};
    if (sc.runAsNonRoot !== true) fail(w(o), "pod securityContext.runAsNonRoot must be true");
    // Volumes point at existing claims and config maps.
    for (const v of spec.volumes ?? []) {
      if (v.persistentVolumeClaim && !find("PersistentVolumeClaim", v.persistentVolumeClaim.claimName)) {
        fail(w(o), `volume ${v.name}: no PersistentVolumeClaim ${v.persistentVolumeClaim.claimName}`);
      }
      if (v.configMap && !find("ConfigMap", v.configMap.name)) fail(w(o), `volume ${v.name}: no ConfigMap ${v.configMap.name}`);
    }
    const all = [...(spec.initContainers ?? []), ...spec.containers];
    for (const c of all) {
      const cw = w(o, `container ${c.name}`);
      if (!/^pdserve(:|$)/.test(c.image ?? "")) fail(cw, `image ${c.image} is not pdserve`);
      if (ctx.imageTag && c.image !== `pdserve:${ctx.imageTag}`) fail(cw, `image ${c.image}, want pdserve:${ctx.imageTag}`);
      for (const k of ["cpu", "memory"]) {
        if (!c.resources?.requests?.[k]) fail(cw, `no resources.requests.${k}`);
        if (!c.resources?.limits?.[k]) fail(cw, `no resources.limits.${k}`);
      }
      if (c.securityContext?.allowPrivilegeEscalation !== false) fail(cw, "allowPrivilegeEscalation must be false");
      // $(VAR) in command/args/env must name a variable the container defines:
      // Kubernetes leaves an undefined reference as literal text.
      const defined = new Set((c.env ?? []).map((e) => e.name));
      for (const ef of c.envFrom ?? []) {
        if (ef.configMapRef) {
          const data = configMapData(ef.configMapRef.name);
          if (!data) fail(cw, `envFrom: no ConfigMap ${ef.configMapRef.name}`);
          for (const k of Object.keys(data ?? {})) defined.add((ef.prefix ?? "") + k);
        }
      }
      const text = [...(c.command ?? []), ...(c.args ?? []), ...(c.env ?? []).map((e) => e.value ?? "")].join("\n");
      for (const m of text.replace(/\$\$/g, "").matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
        if (!defined.has(m[1])) fail(cw, `$(${m[1]}) is not defined by env or envFrom`);
      }
      for (const e of c.env ?? []) {
        const ref = e.valueFrom?.configMapKeyRef;
        if (ref && !configMapData(ref.name)?.[ref.key]) fail(cw, `env ${e.name}: no key ${ref.key} in ConfigMap ${ref.name}`);
      }
      c._defined = defined;
    }
  }

  // Serving pods: gRPC probes on their gRPC port, drain settings.
  const cm = objs.find((o) => o.kind === "ConfigMap" && /^pdserve-config(-[a-z0-9]+)?$/.test(o.metadata.name))?.data;
  if (!cm) return fail(name, "no pdserve-config ConfigMap");
  for (const d of deployments) {
    const comp = component(d);
    const spec = podSpecOf(d);
    const c = spec.containers[0];
    const cw = w(d, `container ${c.name}`);
    if (c.args?.[0] !== comp) fail(cw, `first argument ${c.args?.[0]}, want the subcommand ${comp}`);
    const ports = new Map((c.ports ?? []).map((p) => [p.name, p.containerPort]));
    if (!ports.has("grpc") || !ports.has("metrics")) fail(cw, "needs container ports named grpc and metrics");
    if (String(ports.get("grpc")) !== flagValue(c.args, "--port")) fail(cw, `--port ${flagValue(c.args, "--port")} differs from the grpc port ${ports.get("grpc")}`);
    if (String(ports.get("metrics")) !== flagValue(c.args, "--metrics-port")) fail(cw, "--metrics-port differs from the metrics port");
    if (flagValue(c.args, "--host") !== "0.0.0.0") fail(cw, "--host must be 0.0.0.0 in a pod");
    // Transport security: --insecure, or all three certificate flags, with
    // the files on a mounted Secret. Native gRPC probes cannot speak TLS, so
    // with certificates the probes go to /healthz on the metrics port.
    const tlsFlags = ["--tls-cert", "--tls-key", "--tls-ca"].map((f) => flagValue(c.args, f));
    const tls = tlsFlags.some((v) => v !== undefined);
    if (tls === c.args.includes("--insecure")) fail(cw, "needs either --insecure or --tls-cert/--tls-key/--tls-ca");
    if (tls) {
      if (tlsFlags.some((v) => v === undefined)) fail(cw, "--tls-cert, --tls-key and --tls-ca go together");
      const secretVolumes = new Set((spec.volumes ?? []).filter((v) => v.secret).map((v) => v.name));
      for (const file of tlsFlags.filter((v) => v !== undefined)) {
        const m = (c.volumeMounts ?? []).find((vm) => file.startsWith(vm.mountPath + "/"));
        if (!m || !secretVolumes.has(m.name)) fail(cw, `${file} is not on a mounted Secret`);
      }
    }
    for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      const p = c[probe];
      if (tls) {
        if (p?.httpGet?.path !== "/healthz" || p.httpGet.port !== "metrics") fail(cw, `${probe} must GET /healthz on the metrics port (TLS)`);
      } else if (!p?.grpc) fail(cw, `${probe} must be a native grpc probe`);
      else if (p.grpc.port !== ports.get("grpc")) fail(cw, `${probe}.grpc.port ${p.grpc.port} is not the grpc port ${ports.get("grpc")}`);
    }
    const ann = d.spec.template.metadata?.annotations ?? {};
    if (ann["prometheus.io/scrape"] !== "true" || Number(ann["prometheus.io/port"]) !== ports.get("metrics")) {
      fail(w(d), "pod template needs prometheus.io/scrape=true and prometheus.io/port = the metrics port");
    }
    if (!(d.spec.template.spec.terminationGracePeriodSeconds >= 30)) fail(w(d), "terminationGracePeriodSeconds below 30");
    if (comp === "prefill" || comp === "decode") {
      if (c.lifecycle?.preStop) fail(cw, "workers drain on SIGTERM: no preStop hook");
      const drainVar = flagValue(c.args, "--drain-timeout-ms")?.match(/^\$\((\w+)\)$/)?.[1];
      const drainMs = Number(drainVar ? cm[drainVar] : flagValue(c.args, "--drain-timeout-ms"));
      if (!Number.isFinite(drainMs)) fail(cw, "--drain-timeout-ms is not set to a number");
      else if (spec.terminationGracePeriodSeconds < drainMs / 1000 + 10) {
        fail(w(d), `terminationGracePeriodSeconds ${spec.terminationGracePeriodSeconds} leaves no margin over the ${drainMs} ms drain`);
      }
      if (!/^\$\(POD_IP\)$/.test(flagValue(c.args, "--advertise") ?? "")) fail(cw, "--advertise must be $(POD_IP)");
      const podIp = (c.env ?? []).find((e) => e.name === "POD_IP");
      if (podIp?.valueFrom?.fieldRef?.fieldPath !== "status.podIP") fail(cw, "POD_IP must come from status.podIP");
      const kvVar = flagValue(c.args, "--kv-cache-memory")?.match(/^\$\((\w+)\)$/)?.[1];
      const kvBytes = quantityBytes(kvVar ? cm[kvVar] : flagValue(c.args, "--kv-cache-memory"));
      const gpus = Number(c.resources?.limits?.["nvidia.com/gpu"] ?? 0);
      if (gpus === 0 && !(kvBytes < quantityBytes(c.resources?.limits?.memory ?? "0"))) {
        fail(cw, `KV cache (${kvVar ? cm[kvVar] : "?"}) must fit in the memory limit ${c.resources?.limits?.memory}`);
      }
      if (!ctx.gpu && flagValue(c.args, "--device") === "cuda") fail(cw, "--device=cuda outside the GPU overlay");
      if (ctx.gpu) {
        if (gpus < 1) fail(cw, "GPU overlay: limits nvidia.com/gpu missing");
        if (String(c.resources?.requests?.["nvidia.com/gpu"] ?? gpus) !== String(gpus)) fail(cw, "nvidia.com/gpu requests must equal limits");
        const transport = cm[flagValue(c.args, "--kv-transport")?.match(/^\$\((\w+)\)$/)?.[1]];
        if (transport !== "nccl") fail(cw, `GPU overlay: --kv-transport resolves to ${transport}, want nccl`);
        // Without it a GPU pod runs the CPU engine and a host KV pool.
        if (flagValue(c.args, "--device") !== "cuda") fail(cw, "GPU overlay: workers need --device=cuda");
        const util = cm[flagValue(c.args, "--gpu-memory-utilization")?.match(/^\$\((\w+)\)$/)?.[1]];
        if (!(Number(util) > 0 && Number(util) <= 1)) fail(cw, `GPU overlay: --gpu-memory-utilization resolves to ${util}, want (0, 1]`);
        if (!c._defined.has("NCCL_SOCKET_IFNAME")) fail(cw, "GPU overlay: NCCL_SOCKET_IFNAME not set");
        if (!(c.volumeMounts ?? []).some((m) => m.mountPath === "/dev/shm")) fail(cw, "GPU overlay: no /dev/shm volume for NCCL");
      }
    }
    if (comp === "decode") {
      const terms = spec.affinity?.podAntiAffinity?.preferredDuringSchedulingIgnoredDuringExecution?.map((t) => t.podAffinityTerm) ??
        spec.affinity?.podAntiAffinity?.requiredDuringSchedulingIgnoredDuringExecution ?? [];
      if (!terms.some((t) => t.topologyKey === "kubernetes.io/hostname" && matches(t.labelSelector, podLabelsOf(d)))) {
        fail(w(d), "decode pods need podAntiAffinity on kubernetes.io/hostname against each other");
      }
    }
    if (comp === "router") {
      for (const role of ["prefill", "decode"]) {
        const v = flagValue(c.args, `--${role}-workers`) ?? "";
        const m = v.match(/^dns:([a-z0-9-]+)\.\$\(POD_NAMESPACE\)\.svc\.[^:]+:(\d+)$/);
        if (!m) { fail(cw, `--${role}-workers=${v} is not dns:SERVICE.$(POD_NAMESPACE).svc.DOMAIN:PORT`); continue; }
        const svc = find("Service", m[1]);
        if (!svc) { fail(cw, `--${role}-workers names Service ${m[1]}, which does not exist`); continue; }
        if (svc.spec.clusterIP !== "None") fail(w(svc), "worker discovery needs a headless Service (clusterIP: None)");
        if (!(svc.spec.ports ?? []).some((p) => String(p.port) === m[2])) fail(w(svc), `has no port ${m[2]}`);
        const pool = deployments.find((d) => matches({ matchLabels: svc.spec.selector }, podLabelsOf(d)));
        if (!pool || component(pool) !== role) fail(w(svc), `must select the ${role} pods`);
        else {
          const gp = pool.spec.template.spec.containers[0].ports.find((p) => p.name === "grpc")?.containerPort;
          if (String(gp) !== m[2]) fail(cw, `--${role}-workers port ${m[2]} is not the ${role} grpc port ${gp}`);
        }
      }
      if (!(c.env ?? []).some((e) => e.name === "POD_NAMESPACE" && e.valueFrom?.fieldRef?.fieldPath === "metadata.namespace")) {
        fail(cw, "POD_NAMESPACE must come from metadata.namespace");
      }
    }
  }

  // Services select pods and name their ports.
  for (const s of byKind("Service")) {
    const pods = workloads.filter((o) => matches({ matchLabels: s.spec.selector }, podLabelsOf(o)));
    if (pods.length === 0) { fail(w(s), "selects no pods"); continue; }
    for (const p of s.spec.ports ?? []) {
      if (typeof p.targetPort === "string" && !pods.every((o) => podSpecOf(o).containers.some((c) => (c.ports ?? []).some((cp) => cp.name === p.targetPort)))) {
        fail(w(s), `targetPort ${p.targetPort} is not a container port of the selected pods`);
      }
    }
  }

  // One PodDisruptionBudget per serving pool.
  for (const d of deployments) {
    const pdbs = byKind("PodDisruptionBudget").filter((p) => matches(p.spec.selector, podLabelsOf(d)));
    if (pdbs.length !== 1) fail(w(d), `${pdbs.length} PodDisruptionBudgets select it, want 1`);
  }
  for (const p of byKind("PodDisruptionBudget")) {
    if (!workloads.some((o) => matches(p.spec.selector, podLabelsOf(o)))) fail(w(p), "selects no pods");
  }

  // Prometheus Operator monitors.
  for (const pm of byKind("PodMonitor")) {
    const pods = deployments.filter((d) => matches(pm.spec.selector, podLabelsOf(d)));
    const comps = pods.map(component).sort().join(",");
    if (comps !== "decode,prefill") fail(w(pm), `selects ${comps || "nothing"}, want the prefill and decode pods`);
    for (const ep of pm.spec.podMetricsEndpoints ?? []) {
      if (!pods.every((d) => podSpecOf(d).containers[0].ports.some((p) => p.name === ep.port))) fail(w(pm), `port ${ep.port} not on the pods`);
      checkRelabel(w(pm), ep.relabelings);
    }
  }
  for (const sm of byKind("ServiceMonitor")) {
    const svcs = byKind("Service").filter((s) => matches(sm.spec.selector, s.metadata.labels ?? {}));
    if (svcs.length !== 1 || svcs[0].metadata.name !== "pdserve-router") fail(w(sm), "must select exactly the pdserve-router Service");
    for (const ep of sm.spec.endpoints ?? []) {
      if (!svcs.every((s) => s.spec.ports.some((p) => p.name === ep.port))) fail(w(sm), `port ${ep.port} not on the Service`);
      checkRelabel(w(sm), ep.relabelings);
    }
  }
  if (ctx.overlay && byKind("PodMonitor").length + byKind("ServiceMonitor").length === 0) fail(name, "no PodMonitor/ServiceMonitor");

  // Autoscalers.
  for (const h of byKind("HorizontalPodAutoscaler")) {
    const t = h.spec.scaleTargetRef;
    const target = find(t.kind, t.name);
    if (!target) { fail(w(h), `scaleTargetRef ${t.kind}/${t.name} does not exist`); continue; }
    if (target.spec.replicas !== undefined) fail(w(target), "has spec.replicas although an HPA scales it");
    if (h.spec.minReplicas > h.spec.maxReplicas) fail(w(h), "minReplicas > maxReplicas");
    for (const m of h.spec.metrics ?? []) {
      const metric = m.pods?.metric?.name ?? m.object?.metric?.name ?? m.external?.metric?.name;
      if (metric && !ctx.adapterMetrics.has(metric)) fail(w(h), `metric ${metric} is not served by the prometheus-adapter rules`);
    }
  }
}

function checkRelabel(where, relabelings) {
  const sets = (label, value) => (relabelings ?? []).some((r) => r.targetLabel === label && (value === undefined || r.replacement === value));
  if (!sets("job", "pdserve")) fail(where, "relabelings must set job=pdserve (the rules and dashboard select on it)");
  if (!sets("component")) fail(where, "relabelings must set the component label");
}

// ------------------------------------------------------------------- main
const adapter = YAML.parse(fs.readFileSync(path.join(sourceDir, "deploy/prometheus/prometheus-adapter-values.yaml"), "utf8"));
const adapterMetrics = new Set((adapter.rules?.custom ?? []).map((r) => r.name?.as).filter(Boolean));

let objects = 0;
for (const file of files) {
  const name = path.basename(file, ".yaml");
  const docs = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"));
  const objs = [];
  for (const d of docs) {
    if (d.errors.length) { fail(name, `YAML: ${d.errors[0].message}`); continue; }
    const o = d.toJS();
    if (o) objs.push(o);
  }
  if (objs.length === 0) { fail(name, "renders no objects"); continue; }
  for (const o of objs) {
    objects++;
    const where = `${name}: ${o.kind}/${o.metadata?.name}`;
    if (!o.apiVersion || !o.kind || !o.metadata?.name) { fail(where, "apiVersion, kind and metadata.name are required"); continue; }
    await validateSchema(where, o);
  }
  const gpu = /(^|-)gpu(-|$)/.test(name);
  checkWiring(name, objs, {
    overlay: true,
    gpu,
    imageTag: gpu ? "gpu" : "cpu",
    adapterMetrics,
  });
  if (gpu) {
    // The check itself must fail on a GPU rendering whose workers lack
    // --device=cuda (they would run the CPU engine on a GPU node).
    const mutated = structuredClone(objs);
    for (const o of mutated) {
      if (o.kind !== "Deployment" || !/pdserve-(prefill|decode)/.test(o.metadata?.name ?? "")) continue;
      const c = o.spec.template.spec.containers[0];
      c.args = c.args.filter((a) => !a.startsWith("--device"));
    }
    const before = failures;
    const log = console.log;
    let caught = false;
    console.log = (m) => { if (String(m).includes("--device=cuda")) caught = true; };
    try {
      checkWiring(`${name} without --device`, mutated, { overlay: true, gpu, imageTag: "gpu", adapterMetrics });
    } finally {
      console.log = log;
      failures = before;
    }
    if (!caught) fail(name, "the validator accepted GPU workers without --device=cuda");
  }
  console.log(`checked ${name}: ${objs.length} objects (${[...new Set(objs.map((o) => o.kind))].join(", ")})`);
}
if (failures) {
  console.log(`validate_k8s: ${failures} problem(s) in ${objects} objects`);
  process.exit(1);
}
console.log(`validate_k8s: ${objects} objects in ${files.length} renderings valid`);
