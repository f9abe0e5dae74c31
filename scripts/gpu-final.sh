#!/usr/bin/env bash
# One GPU call for the numbers quoted in the README and the closing note:
#   1. scripts/gpu-check.sh (CUDA backend tests, the engine on CUDA against the
#      CPU engine and replay against eager, the synthetic step benchmark,
#      `kiln bench` on the carried Qwen3-0.6B-shaped plan);
#   2. `kiln bench` on random-weight plans of five real model shapes
#      (SmolLM2-135M, Qwen3-0.6B/1.7B/4B, Llama-3-8B) at b1, b8, b32 (q1s0),
#      compiled there (NVRTC from the machine's CUDA toolkit).
# Prepare here: scripts/gpu-check.sh prepare; cp scripts/gpu-final.sh scripts/make-shaped-model.py .device-carry/
# Run there:    bash .device-carry/gpu-final.sh   (carry: .device-carry)
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/kiln-gpu-out}"
mkdir -p "$OUT"
status=0
# KILN_SHAPES_ONLY=1: only the five-shape benchmark (short device budgets).
if [[ -z "${KILN_SHAPES_ONLY:-}" ]]; then
  KILN_SKIP_MEMCHECK="${KILN_SKIP_MEMCHECK-1}" bash "$here/gpu-check.sh" || status=1
fi
# gpu-check.sh's library paths, for NVRTC and cuBLASLt.
libdirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia,os;[print(os.path.join(p,"cu13","lib")) for p in nvidia.__path__]' 2>/dev/null); do
  [[ -d "$d" ]] && libdirs="$libdirs:$d"
done
export LD_LIBRARY_PATH="${libdirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "== kiln bench on five model shapes (random weights)" | tee -a "$OUT/shapes.txt"
for m in smollm2-135m qwen3-0.6b qwen3-1.7b qwen3-4b llama-3-8b; do
  dir=/tmp/shapes/$m
  python3 "$here/make-shaped-model.py" "$m" "$dir" >> "$OUT/shapes.txt" 2>&1 || { status=1; continue; }
  start=$(date +%s.%N)
  "$here/kiln" compile "$dir" --target cuda:sm_90 --keys b1q1s0,b8q1s0,b32q1s0 \
      --max-context 1024 --kv-blocks 2200 -q -o "/tmp/shapes/$m.kiln" >> "$OUT/shapes.txt" 2>&1 || { status=1; continue; }
  echo "$m: compile $(python3 -c "import time;print(round(time.time()-$start,2))") s" | tee -a "$OUT/shapes.txt"
  "$here/kiln" bench "/tmp/shapes/$m.kiln" --device cuda --steps 200 --context 512 \
      --json "$OUT/bench-$m.json" 2>&1 | tee -a "$OUT/shapes.txt" || status=1
done
echo "gpu-final status: $status"
# The device tool brings back a limited number of files: everything, packed
# under a name that sorts first.
tar czf "/tmp/00-all.tgz" -C "$OUT" . && mv /tmp/00-all.tgz "$OUT/00-all.tgz"
exit $status
