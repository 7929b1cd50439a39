"""Writes the "Serving experiments" section of bench/RESULTS.md from the JSON
reports of run_serving_experiments.sh (other sections are kept)."""
import json
import os
import platform
import subprocess
import sys

out_dir, results = sys.argv[1], sys.argv[2]
r = {n[len("serving-"):-5]: json.load(open(os.path.join(out_dir, n)))
     for n in os.listdir(out_dir) if n.startswith("serving-") and n.endswith(".json")}

def ms(x):
    return f"{1000 * x:.0f} ms"

def ratio(a, b):
    return f"{a / b:.2f}x" if b else "n/a"

cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/Model name: *//p'"], capture_output=True, text=True).stdout.strip()
lines = ["<!-- serving-experiments:begin -->", "## Serving experiments", "",
         f"Machine: {cpu or platform.processor()}, {os.cpu_count()} cores (shared, noisy), small preset "
         "(8 layers, hidden 512, fp32 weights), fp32 KV. Command: `bench/experiments/run_serving_experiments.sh`.",
         "Each ratio compares two runs made back to back in one invocation.", ""]
d, c = r.get("disagg-mixed"), r.get("coloc-mixed")
if d and c:
    lines += ["### 1. Disaggregated (1 prefill + 1 decode, one core each) vs colocated (1 worker, both cores), `mixed`", "",
              "| setup | ITL p50 | ITL p99 | TTFT p50 | TTFT p99 | goodput (req/s) |", "|---|---|---|---|---|---|"]
    for name, x in (("disaggregated", d), ("colocated", c)):
        lines.append(f"| {name} | {ms(x['itl_s']['p50'])} | {ms(x['itl_s']['p99'])} | {ms(x['ttft_s']['p50'])} | "
                     f"{ms(x['ttft_s']['p99'])} | {x['goodput_rate']:.2f} |")
    lines += ["", f"ITL p99 colocated / disaggregated: {ratio(c['itl_s']['p99'], d['itl_s']['p99'])}; "
              f"goodput disaggregated / colocated: {ratio(d['goodput_rate'], c['goodput_rate'])}.", ""]
on, off = r.get("prefix-on"), r.get("prefix-off")
if on and off:
    lines += ["### 2. Prefix cache on vs off, `chat`", "", "| prefix cache | hit rate | TTFT p50 | TTFT p99 | e2e p50 |",
              "|---|---|---|---|---|"]
    for name, x in (("on", on), ("off", off)):
        lines.append(f"| {name} | {100 * x['prefix_hit_rate']:.0f}% | {ms(x['ttft_s']['p50'])} | "
                     f"{ms(x['ttft_s']['p99'])} | {ms(x['e2e_s']['p50'])} |")
    lines += ["", f"TTFT p50 off / on: {ratio(off['ttft_s']['p50'], on['ttft_s']['p50'])}; "
              f"TTFT p99 off / on: {ratio(off['ttft_s']['p99'], on['ttft_s']['p99'])}.", ""]
ca, rr = r.get("routing-cache_aware"), r.get("routing-round_robin")
if ca and rr:
    lines += ["### 3. Cache-aware vs round-robin routing, 2 prefill workers, `chat`", "",
              "| policy | hit rate | TTFT p50 | TTFT p99 |", "|---|---|---|---|"]
    for name, x in (("cache_aware", ca), ("round_robin", rr)):
        lines.append(f"| {name} | {100 * x['prefix_hit_rate']:.0f}% | {ms(x['ttft_s']['p50'])} | {ms(x['ttft_s']['p99'])} |")
    lines += ["", f"TTFT p50 round-robin / cache-aware: {ratio(rr['ttft_s']['p50'], ca['ttft_s']['p50'])}.", ""]
lines.append("<!-- serving-experiments:end -->")
section = "\n".join(lines) + "\n"
text = open(results).read() if os.path.exists(results) else "# pdserve benchmark results\n\n"
begin, end = "<!-- serving-experiments:begin -->", "<!-- serving-experiments:end -->"
if begin in text and end in text:
    text = text[:text.index(begin)] + section + text[text.index(end) + len(end) + 1:]
else:
    text = text.rstrip("\n") + "\n\n" + section
open(results, "w").write(text)
print(section)
