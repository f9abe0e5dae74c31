#!/usr/bin/env bash
# CPU decode speed of real SmolLM2-135M-Instruct, its Q4_1 GGUF imported
# twice (bf16, and --keep-quant), on this machine's cores.
#
#   scripts/cpu-quant-bench.sh OUT_DIR [REPEATS]
#
# Needs a release build (`cargo build --release -p kiln-cli`; KILN_BIN
# overrides the binary). For each import: `kiln bench --device cpu` of the
# b1q1s0 key at contexts 64 and 512 (JSON per run), and `kiln run` of a
# fixed prompt for 128 tokens; each REPEATS times (default 5), because a
# shared machine's memory bandwidth varies from run to run. Writes the raw
# outputs and summary.md (median and best of the repeats) to OUT_DIR.
#
# With LLAMACPP_PYTHON set to a Python that has llama-cpp-python installed
# (`python3 -m venv V && V/bin/pip install llama-cpp-python`, built from
# source for this CPU), each repeat also runs llama.cpp's decode of the
# same file, prompt and token count (bench/llamacpp/decode_speed.py), so the
# comparison is taken in the same minutes on the same machine.
set -euo pipefail
out=${1:?usage: cpu-quant-bench.sh OUT_DIR [REPEATS]}
reps=${2:-5}
kiln=${KILN_BIN:-target/release/kiln}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
gguf=$("$kiln" fetch 2>/dev/null | tail -1)
"$kiln" import "$gguf" -o "$work/bf16" > "$out/import-bf16.txt" 2>&1
"$kiln" import "$gguf" -o "$work/q" --keep-quant > "$out/import-keep-quant.txt" 2>&1
prompt="Write a long story about a dragon who learns to code."
for m in bf16 q; do
  "$kiln" compile "$work/$m" --target cpu --keys b1q1s0,b1q16s0 -o "$work/$m.kiln" -q > /dev/null
done
# The imports leave ~370 MB of dirty pages; their writeback competes with
# the benchmarks for memory bandwidth (measured: 2-3x slower steps).
sync
sleep 2
for r in $(seq 1 "$reps"); do
  for m in bf16 q; do
    for ctx in 64 512; do
      "$kiln" bench "$work/$m.kiln" --weights "$work/$m" --device cpu --keys b1q1s0 \
        --steps 200 --context $ctx --json "$out/bench-$m-ctx$ctx-$r.json" > /dev/null 2>&1
    done
    "$kiln" run "$work/$m.kiln" --weights "$work/$m" --prompt "$prompt" --max-tokens 128 \
      2> "$out/run-$m-$r.txt" > /dev/null
  done
  if [ -n "${LLAMACPP_PYTHON:-}" ]; then
    "$LLAMACPP_PYTHON" "$(dirname "$0")/../bench/llamacpp/decode_speed.py" "$gguf" \
      --threads "$(nproc)" --repeats 1 --max-tokens 128 > "$out/llamacpp-$r.jsonl" 2> /dev/null
  fi
done
python3 - "$out" "$reps" <<'EOF'
import json, re, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
rows = []
for m, name in [("bf16", "bf16 import"), ("q", "Q4_1 kept (--keep-quant)")]:
    for ctx in (64, 512):
        ms = []
        for r in range(1, reps + 1):
            j = json.load(open(f"{out}/bench-{m}-ctx{ctx}-{r}.json"))
            ms.append(j["keys"][0]["replay_ms"])
        rows.append((name, f"bench b1 ctx {ctx} replay ms", statistics.median(ms), min(ms), 1000 / statistics.median(ms)))
    tps = []
    for r in range(1, reps + 1):
        t = open(f"{out}/run-{m}-{r}.txt").read()
        tps.append(float(re.search(r"decode ([0-9.]+) tokens/s", t).group(1)))
    rows.append((name, "kiln run decode tok/s", statistics.median(tps), max(tps), None))
import os
lc = []
for r in range(1, reps + 1):
    f = f"{out}/llamacpp-{r}.jsonl"
    if os.path.exists(f):
        lines = [json.loads(l) for l in open(f) if l.strip()]
        lc += [l["decode_tokens_per_s"] for l in lines if "decode_tokens_per_s" in l]
if lc:
    rows.append(("llama.cpp, same GGUF (Q4_1)", "decode tok/s", statistics.median(lc), max(lc), None))
with open(f"{out}/summary.md", "w") as f:
    f.write(f"| model | measure | median | best | tok/s (median) |\n|---|---|---|---|---|\n")
    for name, what, med, best, tps in rows:
        f.write(f"| {name} | {what} | {med:.3f} | {best:.3f} | {'' if tps is None else f'{tps:.0f}'} |\n")
print(open(f"{out}/summary.md").read())
EOF
