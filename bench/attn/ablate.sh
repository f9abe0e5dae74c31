#!/usr/bin/env bash
# One device call: where the decode attention kernel's time goes. Builds the
# harness (bench/attn/attn_bench.cu) against copies of kernels/gpu/attention.cu
# that stop early at one point each (ABL=1: right after the dependency wait;
# 2: after the key loop, before any merge; 3: after the warps' merge and the
# push of the cluster's reduce-scatter, before the wait for the slices; 0:
# the kernel unchanged), times each at context 512, and
# runs Nsight Compute (SASS-level source counters) on the unchanged kernel.
# The differences between the stops are each stage's share of a launch.
# The stops are text anchors in the kernel (asserted to exist once); session
# 27's call 1 ran them on the kernel before the reduce-scatter, whose ABL=3
# anchor was the start of the cluster step. ABL=1 and 2 exit every thread
# mid-kernel and failed ("unspecified launch failure") on cluster shapes
# past the first model in that call; read only the rows printed.
# Usage (device): OUT=$OUT bash bench/attn/ablate.sh
set -uo pipefail
OUT=${OUT:-/tmp/attn-abl}
mkdir -p "$OUT" /tmp/abl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/ablate.txt"
src=kernels/gpu/attention.cu
abls="0 1 2 3 ${ABL_EXTRA:-}"
for abl in $abls; do
  d=/tmp/abl/a$abl
  mkdir -p "$d"
  python3 - "$src" "$d/attention.cu" "$abl" <<'PY'
import sys
src, dst, abl = sys.argv[1], sys.argv[2], int(sys.argv[3])
t = open(src).read()
def before(anchor, text):
    global t
    assert t.count(anchor) == 1, anchor
    t = t.replace(anchor, text + anchor)
if abl == 1:
    before("  // rope_attention: this partition's new positions", '  asm volatile("exit;");\n')
if abl == 2:
    before("  // Lane groups of a warp: each rescales its state",
           '  if (acc[0][0] == 1234.5f && l[0] == 3.0f) part_ml[0] = m[0];\n  asm volatile("exit;");\n')
if abl == 3:
    before("    mbar_wait_cluster(&cbar, 0);", '    asm volatile("exit;");\n')
open(dst, "w").write(t)
PY
  cp kernels/gpu/kiln_port.h "$d/"
  # The builds run side by side (one nvcc each).
  ( nvcc -O3 -arch=sm_90 -lineinfo -I "$d" bench/attn/attn_bench.cu -o "$d/attn_bench" > "$d/build.txt" 2>&1
    echo $? > "$d/build.rc" ) &
done
wait
for abl in $abls; do
  d=/tmp/abl/a$abl
  echo "build abl=$abl rc=$(cat "$d/build.rc")" >> "$OUT/ablate.txt"
  [[ "$(cat "$d/build.rc")" == 0 ]] || tail -20 "$d/build.txt" >> "$OUT/ablate.txt"
  echo "== ABL=$abl" >> "$OUT/ablate.txt"
  ATTN_BATCHES=${ABL_BATCHES:-1,8} timeout 200 "$d/attn_bench" >> "$OUT/ablate.txt" 2>&1
  echo "rc=$?" >> "$OUT/ablate.txt"
done
b=/tmp/abl/a0/attn_bench
for mb in ${ABL_NCU:-"qwen3-0.6b:1" "llama-3-8b:1"}; do
  IFS=: read -r m bt <<< "$mb"
  timeout 150 ncu --set full --import-source yes -k regex:paged_attn --launch-skip 2 --launch-count 1 \
    -o /tmp/abl/rep-$m-b$bt "$b" once "$m" "$bt" 256 16 > "$OUT/ncu-$m-b$bt.txt" 2>&1
  ncu -i /tmp/abl/rep-$m-b$bt.ncu-rep --page details >> "$OUT/ncu-$m-b$bt.txt" 2>&1
  ncu -i /tmp/abl/rep-$m-b$bt.ncu-rep --page source --csv --print-source sass > /tmp/abl/src-$m-b$bt.csv 2>> "$OUT/ncu-$m-b$bt.txt"
  python3 - /tmp/abl/src-$m-b$bt.csv >> "$OUT/ncu-$m-b$bt.txt" 2>&1 <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
hdr = None
for i, r in enumerate(rows):
    if any("Address" in c for c in r) and any("Source" in c for c in r):
        hdr = i
        break
if hdr is None:
    print("no source table; first lines:", rows[:3])
    sys.exit(0)
h = rows[hdr]
print("columns:", h)
def col(name):
    for j, c in enumerate(h):
        if c.strip() == name:
            return j
    for j, c in enumerate(h):
        if name.lower() in c.lower():
            return j
    return None
js = col("Warp Stall Sampling (All Samples)")
jsrc = col("Source")
data = [r for r in rows[hdr + 1:] if len(r) == len(h)]
def num(x):
    try:
        return float(x.replace(",", ""))
    except Exception:
        return 0.0
tot = sum(num(r[js]) for r in data) or 1
print(f"instructions {len(data)}, stall samples {tot:.0f}")
for k, r in enumerate(data):
    r.append(k)
for r in sorted(data, key=lambda r: -num(r[js]))[:45]:
    print(f"{r[-1]:5d} {100*num(r[js])/tot:5.1f}%  {r[jsrc][:110]}")
# Samples by stretch of 100 instructions (program order).
print("by stretch of 100 instructions:")
for a in range(0, len(data), 100):
    s = sum(num(r[js]) for r in data[a:a + 100])
    print(f"  {a:5d}-{a+99:5d} {100*s/tot:5.1f}%  first: {data[a][jsrc][:60]}")
PY
done
ls -la "$OUT"
