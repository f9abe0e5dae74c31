#!/usr/bin/env bash
# GPU checks and timings for kiln's CUDA backend, in ONE device call.
#
# Built on a machine without a GPU and carried over (the GPU machine has no
# Rust): see `prepare` below. On the GPU machine it runs, in order:
#   1. the device facts (nvidia-smi, driver, library paths);
#   2. the shared backend contract on the real CUDA driver
#      (runtime/tests/contract_cuda.rs, with KILN_REQUIRE_CUDA=1 so a missing
#      device fails), every CUDA backend test (runtime/tests/cuda_backend.rs:
#      kernels, lowered as `kiln compile` lowers them, vs the host/CPU
#      reference on random inputs at awkward sizes with poisoned outputs,
#      cuBLASLt GEMMs, the capture contract, replay == eager with changing
#      inputs, a whole synthetic step vs the host reference), then the engine
#      on CUDA (tests/tests/cuda_serve.rs: compiled tiny models vs the CPU
#      engine, replay vs eager);
#   3. compute-sanitizer memcheck over the kernel tests (bounded);
#   4. the synthetic Qwen3-0.6B step benchmark (eager vs replay, HBM floor);
#   5. `kiln bench` on a real plan when one is carried (.device-carry/plan);
#   6. with KILN_ATTN_SWEEP="1024 256 64 1": the attention tests at the
#      largest partitions and `kiln bench` per attention block target.
# Results land in $OUT (log.txt, bench.jsonl) and a summary table is printed
# last.
#
# Usage here:   scripts/gpu-check.sh prepare [/work/main/.device-carry]
# Usage there:  bash .device-carry/gpu-check.sh
#   (KILN_MEMCHECK_FILTER=<test name filter> narrows the memcheck pass)
set -uo pipefail

if [[ "${1:-}" == "prepare" ]]; then
  set -e
  dest="${2:-/work/main/.device-carry}"
  root="$(cd "$(dirname "$0")/.." && pwd)"
  target="${CARGO_TARGET_DIR:-$root/target}"
  mkdir -p "$dest/cubins"
  (cd "$root" && KILN_DUMP_CUBINS="$dest/cubins" cargo test -q -p kiln-kernels every_module_compiles)
  # The GPU test binaries: name, package. Each is built in release with the
  # cuda feature and copied (stripped) next to this script.
  for spec in cuda_backend:kiln-runtime contract_cuda:kiln-runtime cuda_serve:kiln-tests; do
    name="${spec%%:*}"; pkg="${spec#*:}"
    bin=$(cd "$root" && cargo test --release -p "$pkg" --features cuda --test "$name" --no-run --message-format=json 2>/dev/null \
          | python3 -c 'import json,sys
name=sys.argv[1]
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]==name and m.get("executable"): print(m["executable"])' "$name")
    [[ -n "$bin" ]] || { echo "building test binary $name ($pkg) failed" >&2; exit 1; }
    cp "$bin" "$dest/$name"
    strip "$dest/$name"
  done
  rm -f "$dest/cuda_backend_mutant"
  cp "$0" "$dest/gpu-check.sh"
  (cd "$root" && cargo build -q --release -p kiln-cli --features cuda --bin kiln)
  cp "$target/release/kiln" "$dest/kiln"
  strip "$dest/kiln"
  # A real compiled plan for `kiln bench`: Qwen3-0.6B-shaped (the compiler's
  # bench-compile model: real header, no weight data, so the benchmark uses
  # random weights). Put a real model directory at $dest/plan/weights to
  # time with real weights instead.
  rm -rf "$dest/plan" && mkdir -p "$dest/plan"
  tmp=$(mktemp -d)
  "$dest/kiln" bench-compile --dir "$tmp/model" --repeat 1 > /dev/null
  "$dest/kiln" compile "$tmp/model" --target cuda:sm_90 --keys b1q1s0,b8q1s0,b32q1s0 \
    --max-context 1024 --kv-blocks 1100 -q -o "$dest/plan/model.kiln"
  rm -rf "$tmp"
  du -sh "$dest"
  exit 0
fi

here="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/kiln-gpu-out}"
mkdir -p "$OUT"
log="$OUT/log.txt"
exec > >(tee -a "$log") 2>&1

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
libdirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia,os;[print(os.path.join(p,"cu13","lib")) for p in nvidia.__path__]' 2>/dev/null); do
  [[ -d "$d" ]] && libdirs="$libdirs:$d"
done
export LD_LIBRARY_PATH="${libdirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ls -1 $(echo "$LD_LIBRARY_PATH" | tr ':' ' ') 2>/dev/null | grep -E '^lib(cublasLt|nvrtc)\.so' | sort -u
export KILN_CUBIN_DIR="$here/cubins"
export RUST_BACKTRACE=1

status=0
echo "== backend contract on CUDA (KILN_REQUIRE_CUDA=1)"
KILN_REQUIRE_CUDA=1 "$here/contract_cuda" --test-threads=1 2>&1 | tee "$OUT/contract.txt" || status=1

echo "== tests"
start=$(date +%s)
"$here/cuda_backend" --test-threads=1 2>&1 | tee "$OUT/tests.txt" || status=1
echo "tests took $(( $(date +%s) - start )) s"

echo "== engine on CUDA (compiled tiny models vs the CPU engine, replay vs eager)"
if [[ -x "$here/cuda_serve" ]]; then
  "$here/cuda_serve" --test-threads=1 --nocapture 2>&1 | tee "$OUT/serve.txt" || status=1
fi

echo "== compute-sanitizer memcheck (kernel tests)"
if [[ -n "${KILN_SKIP_MEMCHECK:-}" ]]; then
  echo "skipped (KILN_SKIP_MEMCHECK set)"
elif command -v compute-sanitizer >/dev/null; then
  KILN_GEMM_AUTOTUNE=0 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$here/cuda_backend" --test-threads=1 --skip bench --skip whole --skip dropping --skip allocation --skip kernel_images ${KILN_MEMCHECK_FILTER:-} \
    > "$OUT/memcheck.txt" 2>&1
  rc=$?
  grep -E "ERROR SUMMARY|test result|Invalid|out of bounds" "$OUT/memcheck.txt" | head -20
  echo "memcheck exit: $rc"
  [[ $rc == 9 ]] && status=1
else
  echo "compute-sanitizer not found"
fi

echo "== synthetic Qwen3-0.6B step benchmark"
KILN_BENCH_OUT="$OUT/bench.jsonl" "$here/cuda_backend" --ignored --exact \
  bench_synthetic_qwen3_0_6b_step_replay_vs_eager --nocapture --test-threads=1 || status=1

if [[ -x "$here/kiln" && -f "$here/plan/model.kiln" ]]; then
  echo "== kiln bench"
  weights=()
  [[ -d "$here/plan/weights" ]] && weights=(--weights "$here/plan/weights")
  "$here/kiln" bench "$here/plan/model.kiln" "${weights[@]}" --device cuda \
    --steps 200 --context "${KILN_BENCH_CONTEXT:-512}" --json "$OUT/kiln-bench.json" || status=1
fi

if [[ -n "${KILN_ATTN_SWEEP:-}" && -x "$here/kiln" && -f "$here/plan/model.kiln" ]]; then
  # Attention partition size: the block target the geometry aims for
  # (KILN_ATTN_TARGET_BLOCKS, read when launches are lowered). Correctness of
  # the largest partitions first (the single-partition direct write), then
  # the step time per target.
  echo "== attention kernel tests with KILN_ATTN_TARGET_BLOCKS=1 (largest partitions)"
  KILN_ATTN_TARGET_BLOCKS=1 "$here/cuda_backend" --test-threads=1 paged_attention whole 2>&1 \
    | tee "$OUT/tests-attn-target1.txt" | grep -E "^test |test result" || status=1
  grep -q "test result: ok" "$OUT/tests-attn-target1.txt" || status=1
  for t in $KILN_ATTN_SWEEP; do
    echo "== kiln bench, KILN_ATTN_TARGET_BLOCKS=$t"
    KILN_ATTN_TARGET_BLOCKS=$t "$here/kiln" bench "$here/plan/model.kiln" --device cuda \
      --keys "${KILN_SWEEP_KEYS:-b1q1s0,b32q1s0}" --steps 200 --context "${KILN_BENCH_CONTEXT:-512}" \
      --json "$OUT/kiln-bench-attn$t.json" || status=1
  done
fi

if [[ -n "${KILN_NCU:-}" && -x "$here/kiln" && -f "$here/plan/model.kiln" ]]; then
  # Nsight Compute on the steady-state kernels of `kiln bench` (b1 and b32):
  # duration, DRAM throughput, occupancy and warp stall reasons per kernel.
  ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [[ -n "$ncu_bin" ]]; then
    for key in b1q1s0 b32q1s0; do
      echo "== ncu, $key (kernels matching ${KILN_NCU_KERNELS:-paged_attn|gemv_t|add_rms_norm|qkv_rope})"
      timeout 240 "$ncu_bin" --kernel-name regex:"${KILN_NCU_KERNELS:-paged_attn|gemv_t|add_rms_norm|qkv_rope}" \
        --launch-skip 300 --launch-count 12 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        --csv --page details "$here/kiln" bench "$here/plan/model.kiln" --device cuda --keys "$key" \
        --steps 20 --context "${KILN_BENCH_CONTEXT:-512}" > "$OUT/ncu-$key.csv" 2> "$OUT/ncu-$key.err"
      echo "ncu exit $? ($(wc -l < "$OUT/ncu-$key.csv") lines)"
      python3 - "$OUT/ncu-$key.csv" <<'PY'
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
if not rows: sys.exit()
h = rows[0]; ix = {k: i for i, k in enumerate(h)}
want = ("Duration", "DRAM Throughput", "Memory Throughput", "Achieved Occupancy", "Registers Per Thread",
        "Grid Size", "Block Size", "Warp Cycles Per Issued Instruction")
seen = collections.OrderedDict()
for r in rows[1:]:
    k = (r[ix["ID"]], r[ix["Kernel Name"]][:40])
    if r[ix["Metric Name"]] in want:
        seen.setdefault(k, {})[r[ix["Metric Name"]]] = r[ix["Metric Value"]] + " " + r[ix["Metric Unit"]]
for (i, n), m in seen.items():
    print(i, n, "; ".join(f"{a}={m.get(a, '?')}" for a in want))
PY
    done
  else
    echo "ncu not found"
  fi
fi

echo "== summary"
grep -E "^test result|FAILED|panicked" "$OUT/contract.txt" "$OUT/tests.txt" "$OUT/serve.txt" 2>/dev/null | head -20
if [[ -f "$OUT/bench.jsonl" ]]; then
  python3 - "$OUT/bench.jsonl" <<'PY'
import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'batch':>5} {'ctx':>5} {'eager ms':>9} {'replay ms':>9} {'b2b ms':>8} {'x':>6} {'floor ms':>8} {'/floor':>6} {'tok/s':>8} {'capt ms':>7}")
for r in rows:
    print(f"{r['batch']:>5} {r['context']:>5} {r['eager_ms']:>9.3f} {r['replay_ms']:>9.3f} {r['replay_back_to_back_ms']:>8.3f} {r['speedup']:>6.2f} {r['hbm_floor_ms']:>8.3f} {r['replay_over_floor']:>6.2f} {r['tokens_per_s']:>8.0f} {r['capture_ms']:>7.1f}")
PY
fi
echo "gpu-check status: $status"
exit $status
