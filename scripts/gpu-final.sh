#!/usr/bin/env bash
# One GPU call for the numbers the README and the closing note quote.
#
# Built on a machine without a GPU (`scripts/gpu-final.sh prepare`), carried in
# .device-carry/, run there with `bash scripts/gpu-final.sh`:
#   1. device facts;
#   2. the GPU test binaries on the one GpuBackend (CUDA driver): the shared
#      contract bodies on the real driver (contract_cuda, KILN_REQUIRE_CUDA=1),
#      kernels vs the CPU reference (cuda_backend), the engine on CUDA vs the
#      CPU engine (cuda_serve) -- each bounded in time;
#   3. `kiln bench` before/after on random-weight plans of five real model
#      shapes (b1, b8, b32 at context 512), the baseline binary and its plans
#      (.device-carry/base/) interleaved with the current ones per model, so
#      both see the same machine state.
# Everything lands in $OUT: summary.txt plus one tarball with every log/JSON.
#
# KILN_FINAL_STAGES selects stages (default "tests bench").
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
C="$root/.device-carry"

if [[ "${1:-}" == "prepare" ]]; then
  set -e
  echo "see the closing note of the session for the prepare commands (release build, strip, plans)"
  exit 0
fi

OUT="${OUT:-/tmp/kiln-gpu-out}"
mkdir -p "$OUT/logs"
S="$OUT/summary.txt"
: > "$S"
libdirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia,os;[print(os.path.join(p,"cu13","lib")) for p in nvidia.__path__]' 2>/dev/null); do
  [[ -d "$d" ]] && libdirs="$libdirs:$d"
done
export LD_LIBRARY_PATH="${libdirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KILN_CACHE=/tmp/kiln-cache
stages="${KILN_FINAL_STAGES:-tests bench}"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; } >> "$S" 2>&1

if [[ " $stages " == *" tests "* ]]; then
  for t in contract_cuda cuda_backend cuda_serve; do
    [[ -x "$C/bin/$t" ]] || { echo "test $t: binary missing" >> "$S"; continue; }
    start=$(date +%s)
    KILN_REQUIRE_CUDA=1 KILN_CUBIN_DIR="$C/cubins" timeout 240 "$C/bin/$t" --test-threads=1 \
      > "$OUT/logs/test-$t.txt" 2>&1
    rc=$?
    echo "test $t: rc=$rc $(grep -E '^test result' "$OUT/logs/test-$t.txt" | tail -1) ($(( $(date +%s) - start )) s)" >> "$S"
    grep -E "FAILED|panicked" "$OUT/logs/test-$t.txt" | head -20 >> "$S"
  done
fi

if [[ " $stages " == *" bench "* ]]; then
  mkdir -p /tmp/plans-new /tmp/plans-old
  tar xzf "$C/plans-new.tgz" -C /tmp/plans-new
  tar xzf "$C/base/plans-old.tgz" -C /tmp/plans-old
  for m in smollm2-135m qwen3-0.6b qwen3-1.7b qwen3-4b llama-3-8b; do
    for which in old new; do
      if [[ $which == old ]]; then bin="$C/base/kiln"; plan=/tmp/plans-old/$m.kiln
      else bin="$C/bin/kiln"; plan=/tmp/plans-new/$m.kiln; fi
      timeout 150 "$bin" bench "$plan" --device cuda --steps 200 --context 512 \
        --json "$OUT/logs/bench-$which-$m.json" > "$OUT/logs/bench-$which-$m.txt" 2>&1
      echo "bench $which $m: rc=$?" >> "$S"
    done
  done
  python3 - "$OUT/logs" >> "$S" 2>&1 <<'PY'
import json, sys, os
d = sys.argv[1]
def rows(p):
    try:
        j = json.load(open(p))
    except Exception as e:
        return {}
    ks = j["keys"] if isinstance(j, dict) and "keys" in j else j
    out = {}
    for k in ks:
        out[k["key"]] = k
    return out
print(f"{'model':14} {'key':8} {'old replay':>10} {'new replay':>10} {'new/old':>8} {'old eager':>9} {'new eager':>9} {'launch old':>10} {'launch new':>10}")
for m in ["smollm2-135m", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "llama-3-8b"]:
    o = rows(os.path.join(d, f"bench-old-{m}.json")); n = rows(os.path.join(d, f"bench-new-{m}.json"))
    for key in sorted(set(o) | set(n)):
        a, b = o.get(key, {}), n.get(key, {})
        ra, rb = a.get("replay_ms"), b.get("replay_ms")
        ratio = f"{rb / ra:.3f}" if ra and rb else "-"
        f = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "-"
        print(f"{m:14} {key:8} {f(ra):>10} {f(rb):>10} {ratio:>8} {f(a.get('eager_ms')):>9} {f(b.get('eager_ms')):>9} {str(a.get('launches','-')):>10} {str(b.get('launches','-')):>10}")
PY
fi
tar czf "$OUT/00-all.tgz" -C "$OUT" logs
cat "$S"
