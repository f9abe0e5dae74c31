#!/usr/bin/env bash
# One GPU call for the megakernel schedule: its tests and both schedules
# timed side by side.
#
# Built here (no GPU) and carried in .device-carry/:
#   bin/*.xz    cuda_megakernel, megakernel_gpu, cuda_serve (test binaries,
#               `cargo test --release --no-run`, the cuda feature) and kiln
#   plans.txz   plans/<model>-graph.kiln and plans/<model>-mk.kiln: one
#               shaped model (scripts/make-shaped-model.py) compiled with the
#               graph schedule and with `--schedule megakernel`, same keys
# On the GPU machine it runs:
#   1. cuda_megakernel (the hand-built two-layer tape) and megakernel_gpu
#      (every task kind against the CPU reference, KILN_MK_GPU=1);
#   2. cuda_serve's megakernel tests (every key of the tiny families and the
#      Gemma-3-270M shape: megakernel vs graph schedule, replay vs eager;
#      KILN_MK_SERVE_TIMEOUT seconds, default 300);
#   3. the dependency mutation (one tape wait dropped, `--ignored`): it must
#      FAIL to match, i.e. the test above catches it;
#   4. `kiln bench <model>-graph.kiln --also <model>-mk.kiln` per model
#      (KILN_MK_MODELS, KILN_MK_KEYS, KILN_MK_STEPS), JSON per model; with
#      KILN_MK_AB_WSTAGE=1 the megakernel plan once more without the GEMV
#      weight stage (KILN_MK_WSTAGE=0).
# Results: $OUT/summary.txt (the tables) and $OUT/logs.tgz.
#
# Usage there: bash scripts/gpu-megakernel.sh
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# KILN_MK_CARRY: the carry folder (default .device-carry; a subfolder such
# as .device-carry/mk keeps this experiment's binaries apart from
# gpu-final.sh's).
C="${KILN_MK_CARRY:-$root/.device-carry}"
OUT="${OUT:-/tmp/kiln-mk-out}"
L=/tmp/kiln-mk-logs
mkdir -p "$OUT" "$L"
S="$OUT/summary.txt"
: > "$S"
libdirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia,os;[print(os.path.join(p,"cu13","lib")) for p in nvidia.__path__]' 2>/dev/null); do
  [[ -d "$d" ]] && libdirs="$libdirs:$d"
done
export LD_LIBRARY_PATH="${libdirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KILN_CACHE=/tmp/kiln-cache KILN_REQUIRE_CUDA=1
# A carried kernel-image cache (scripts/pack-device-carry.sh --kernel-cache,
# or a KILN_CACHE folder packed the same way) spares the tests' compiles
# NVRTC: entries are keyed by source, options, compiler and arch, so a
# stale one is only missed.
if [[ -f "$C/kernel-cache.tar.xz" ]]; then
  mkdir -p "$KILN_CACHE" && tar xJf "$C/kernel-cache.tar.xz" -C "$KILN_CACHE"
fi
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; } >> "$S" 2>&1
B=/tmp/kiln-mk-bin
mkdir -p "$B"
for f in "$C"/bin/*.xz; do
  n=$(basename "$f" .xz)
  xz -dc "$f" > "$B/$n" && chmod +x "$B/$n"
done
P=/tmp/kiln-mk-plans
rm -rf "$P" && mkdir -p "$P" && tar xJf "$C/plans.txz" -C "$P"

# name, timeout (s), command...: its log in $L/name.txt, one summary line.
run() {
  local name=$1 limit=$2
  shift 2
  local start
  start=$(date +%s)
  timeout "$limit" "$@" > "$L/$name.txt" 2>&1
  local rc=$?
  echo "$name: rc=$rc $(grep -E '^test result' "$L/$name.txt" | tail -1) ($(( $(date +%s) - start )) s)" >> "$S"
  grep -E "FAILED|panicked|megakernel on|dropped" "$L/$name.txt" | head -20 >> "$S"
}
if [[ " ${KILN_MK_STAGES:-tests bench} " == *" tests "* ]]; then
  run cuda_megakernel 60 "$B/cuda_megakernel" --test-threads=1
  KILN_MK_GPU=1 run megakernel_gpu 120 "$B/megakernel_gpu" --test-threads=1 --nocapture
  run cuda_serve_megakernel "${KILN_MK_SERVE_TIMEOUT:-300}" "$B/cuda_serve" megakernel --test-threads=1 --nocapture
  if [[ "${KILN_MK_MUTATION:-1}" == 1 ]]; then
    run mutation_dropped_wait 120 "$B/cuda_serve" a_dropped_tape_wait --ignored --test-threads=1 --nocapture
  fi
fi
if [[ " ${KILN_MK_STAGES:-tests bench} " == *" bench "* ]]; then
  for m in ${KILN_MK_MODELS:-smollm2-135m qwen3-0.6b llama-3.2-1b}; do
    mk="$P/plans/$m-mk.kiln"
    [[ -f "$mk" ]] || mk="$P/plans/$m-mkf.kiln"
    # KILN_MK_PROFILE_ONLY=1: only the traced megakernel run below.
    if [[ "${KILN_MK_PROFILE_ONLY:-0}" != 1 ]]; then
      timeout 200 "$B/kiln" bench "$P/plans/$m-graph.kiln" --also "$mk" \
        --keys "${KILN_MK_KEYS:-b1q1s0,b8q1s0}" --steps "${KILN_MK_STEPS:-200}" --context 512 \
        --json "$OUT/bench-$m.json" > "$L/bench-$m.txt" 2>&1
      echo "bench $m: rc=$?" >> "$S"
      cat "$L/bench-$m.txt" >> "$S"
      # KILN_MK_AB_WSTAGE=1: the megakernel plan again without the GEMV
      # weight stage (KILN_MK_WSTAGE=0), in the same call, for its A/B.
      if [[ "${KILN_MK_AB_WSTAGE:-0}" == 1 ]]; then
        KILN_MK_WSTAGE=0 timeout 200 "$B/kiln" bench "$mk" \
          --keys "${KILN_MK_KEYS:-b1q1s0,b8q1s0}" --steps "${KILN_MK_STEPS:-200}" --context 512 \
          --json "$OUT/bench-$m-nostage.json" > "$L/bench-$m-nostage.txt" 2>&1
        echo "bench $m megakernel without the weight stage: rc=$?" >> "$S"
        cat "$L/bench-$m-nostage.txt" >> "$S"
      fi
    fi
    # The megakernel plan with the interpreter's fused GEMV tiles
    # (`--fused-gemv`), timed and then traced (time per task class).
    if [[ -f "$P/plans/$m-mkf.kiln" ]]; then
      if [[ "$mk" != "$P/plans/$m-mkf.kiln" ]]; then
        timeout 200 "$B/kiln" bench "$P/plans/$m-mkf.kiln" \
          --keys "${KILN_MK_KEYS:-b1q1s0,b8q1s0}" --steps "${KILN_MK_STEPS:-200}" --context 512 \
          --json "$OUT/bench-$m-mkf.json" > "$L/bench-$m-mkf.txt" 2>&1
        echo "bench $m fused megakernel: rc=$?" >> "$S"
        cat "$L/bench-$m-mkf.txt" >> "$S"
      fi
      timeout 200 "$B/kiln" bench "$P/plans/$m-mkf.kiln" --profile \
        --keys "${KILN_MK_KEYS:-b1q1s0,b8q1s0}" --steps 50 --context 512 \
        --json "$OUT/profile-$m-mkf.json" > "$L/profile-$m-mkf.txt" 2>&1
      echo "profile $m fused megakernel: rc=$?" >> "$S"
      grep -E "^(task|wait|idle|profile|key|b[0-9]|critical)" "$L/profile-$m-mkf.txt" >> "$S"
    fi
  done
fi
tar czf "$OUT/logs.tgz" -C "$L" .
cat "$S"
