#!/usr/bin/env bash
# One GPU call for the numbers the README and the closing notes quote.
#
# Everything is built on a machine without a GPU and carried in .device-carry/
# (the device tool's carry limit is 64 MiB a call, so binaries travel
# xz-compressed):
#   .device-carry/bin/*.xz          test binaries and tools (kiln, oracle_run, ...)
#   .device-carry/tests.txt         test binaries to run, one per line, each
#                                   optionally followed by libtest arguments
#                                   (filters, --skip NAME)
#   .device-carry/cubins/           prebuilt kernel images (sm_80 and sm_90)
#   .device-carry/kernel-cache.tar.xz  kiln's kernel image cache, for kiln compile
#                                   on the device (pack-device-carry.sh --kernel-cache)
#   .device-carry/bench/<variant>/  kiln.xz + plans.txz (or .tgz) per variant to compare
#                                   (e.g. old = a baseline commit, new = HEAD)
# Stages (KILN_FINAL_STAGES, default "tests bench"):
#   tests   every binary in tests.txt with KILN_REQUIRE_CUDA=1, bounded in time
#   bench   `kiln bench` of every variant's plans, variants interleaved per
#           model so all see the same machine state; a comparison table
#           (KILN_BENCH_MODELS, KILN_BENCH_KEYS; KILN_BENCH_ARGS: extra `kiln bench`
#           arguments, e.g. "--profile"; KILN_BENCH_ROUNDS: repeat the pass;
#           KILN_BENCH_VARIANTS: the carried variants to run, default all)
#   oracle  tests/oracle/run_oracle.sh on CUDA with the carried kiln/oracle_run
#           (KILN_ORACLE_MODELS: battery models to run, default all of them;
#           e.g. "gemma-3-270m-window16"; KILN_ORACLE_ARGS: more arguments)
#   serve   `kiln serve --device cuda` on the new Qwen3-0.6B plan driven by
#           scripts/bench-serve.py at concurrency 1, 8, 32
#   tune    `kiln tune` of the first variant's plan of every model in
#           KILN_TUNE_MODELS (default: none): each GEMM shape of the plan timed
#           as gemv, skinny and cuBLASLt; tables in logs/tune-<model>.json, the
#           per-shape medians in the summary
#   ncu     Nsight Compute summary of one step per model (KILN_NCU_MODEL, a
#           list, default qwen3-0.6b), variant and key (see the stage);
#           KILN_NCU_SECTIONS adds whole sections (e.g. WarpStateStats),
#           KILN_NCU_RAW=1 all their metrics (stall reasons in the summary)
#   sanitize (opt-in) compute-sanitizer (KILN_SANITIZE_TOOLS, default memcheck;
#           e.g. "memcheck racecheck") over carried test binaries:
#           KILN_SANITIZE="BINARY[:FILTER] ..." (e.g. "cuda_quant cuda_backend:fused")
#   tp      (opt-in, 2 GPUs) Llama-3-8B-shaped tp=1 vs tp=2 `kiln bench` b1
#           (plans llama-3-8b.kiln / llama-3-8b-tp2.kiln of the last variant,
#           compiled here when not carried) and the cuda_tp test binary on a
#           4-layer Llama-3-8B shape; NVLink multicast off for NCCL
# Real weights too large for one call's carry travel in pieces: a tar of
# kiln-cache-relative paths (e.g. gemma3/gemma-3-270m-q4_k_m.gguf), split
# into .dc-real/c0, c1, ... by earlier calls on the same warm machine (each
# carrying one piece; .dc-real/ is git-ignored), with .dc-real/sums.txt the
# SHA-256 of each file. When all pieces are there, they are joined into
# $KILN_CACHE before any stage, checked, and the real-model tests and the
# oracle use them.
# Results land in $OUT: summary.txt and one tarball with every log and JSON.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
C="$root/.device-carry"
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
# Kernel images compiled here (pack-device-carry.sh --kernel-cache): a kiln
# compile on this machine finds them instead of running NVRTC.
if [[ -f "$C/kernel-cache.tar.xz" ]]; then
  mkdir -p "$KILN_CACHE" && tar xJf "$C/kernel-cache.tar.xz" -C "$KILN_CACHE"
fi
stages="${KILN_FINAL_STAGES:-tests bench}"
# Every name is a scripts/make-shaped-model.py shape; its plan is
# .device-carry/bench/<variant>/<name>.kiln (a model without one is reported
# as "no plan" and skipped).
models="${KILN_BENCH_MODELS:-smollm2-135m qwen3-0.6b llama-3.2-1b qwen3-1.7b qwen3-4b llama-3-8b gemma3-270m}"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; } >> "$S" 2>&1

real_smollm2=/nonexistent real_gemma3=/nonexistent
if [[ -f "$root/.dc-real/sums.txt" ]]; then
  mkdir -p "$KILN_CACHE"
  if cat "$root"/.dc-real/c[0-9]* | tar xf - -C "$KILN_CACHE" 2>> "$S" &&
     (cd "$KILN_CACHE" && sha256sum -c "$root/.dc-real/sums.txt") >> "$S" 2>&1; then
    [[ -f "$KILN_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]] &&
      real_smollm2=$KILN_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    [[ -f "$KILN_CACHE/gemma3/gemma-3-270m-q4_k_m.gguf" ]] &&
      real_gemma3=$KILN_CACHE/gemma3/gemma-3-270m-q4_k_m.gguf
    echo "real weights: smollm2 $real_smollm2, gemma3 $real_gemma3" >> "$S"
  else
    echo "real weights: pieces in .dc-real incomplete or damaged; real-model runs skipped" >> "$S"
  fi
fi
# Pieces joined by earlier calls (into $KILN_CACHE outside the repository,
# which stays while the machine is warm) count too.
[[ -f "$KILN_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]] &&
  real_smollm2=$KILN_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f "$KILN_CACHE/gemma3/gemma-3-270m-q4_k_m.gguf" ]] &&
  real_gemma3=$KILN_CACHE/gemma3/gemma-3-270m-q4_k_m.gguf
echo "real weights: smollm2 $real_smollm2, gemma3 $real_gemma3" >> "$S"
export KILN_SMOLLM2_GGUF=$real_smollm2 KILN_GEMMA3_GGUF=$real_gemma3
# With the real weights here, a real-model test that skips is a failure.
[[ -f "$real_smollm2" ]] && export KILN_REQUIRE_SMOLLM2=1
[[ -f "$real_gemma3" ]] && export KILN_REQUIRE_GEMMA3=1

B=/tmp/kbin
mkdir -p "$B"
for f in "$C"/bin/*.xz; do
  [[ -e "$f" ]] || continue
  n=$(basename "$f" .xz)
  xz -dc "$f" > "$B/$n" && chmod +x "$B/$n"
done

# Kernel images for the tests: .device-carry/cubins/, or packed as
# cubins.tar.xz (they compress ~5x; all of them raw exceed a call's carry).
cubins="$C/cubins"
if [[ -f "$C/cubins.tar.xz" ]]; then
  mkdir -p /tmp/kiln-cubins && tar xJf "$C/cubins.tar.xz" -C /tmp/kiln-cubins && cubins=/tmp/kiln-cubins/cubins
fi

if [[ " $stages " == *" tests "* ]]; then
  # kernels/tests/megakernel_gpu.rs runs only with KILN_MK_GPU=1, and loads
  # the interpreter from KILN_MK_CUBIN when the dump carried one (the
  # interpreter's compile test writes megakernel.sm_<sm>.cubin beside the
  # catalog's), else compiles it with NVRTC here.
  export KILN_MK_GPU=1
  [[ -f "$cubins/megakernel.sm_90.cubin" && -z "${KILN_MK_CUBIN:-}" ]] && export KILN_MK_CUBIN="$cubins/megakernel.sm_90.cubin"
  while read -r t targs; do
    [[ -z "$t" ]] && continue
    [[ -x "$B/$t" ]] || { echo "test $t: binary missing" >> "$S"; continue; }
    start=$(date +%s)
    # One log per line of tests.txt (a binary may appear with several filters).
    log="$OUT/logs/test-$t${targs:+-$(printf '%s' "$targs" | tr -c 'A-Za-z0-9_' '_' | cut -c1-48)}.txt"
    KILN_REQUIRE_CUDA=1 KILN_CUBIN_DIR="$cubins" timeout "${KILN_TEST_TIMEOUT:-200}" "$B/$t" ${targs:-} \
      --test-threads=1 > "$log" 2>&1
    rc=$?
    echo "test $t${targs:+ ($targs)}: rc=$rc $(grep -E '^test result' "$log" | tail -1) ($(( $(date +%s) - start )) s)" >> "$S"
    grep -E "FAILED|panicked" "$log" | head -20 >> "$S"
  done < "$C/tests.txt"
fi

variants=""
for v in "$C"/bench/*/; do
  [[ -d "$v" ]] || continue
  n=$(basename "$v")
  # KILN_BENCH_VARIANTS: only these (space-separated), default every one.
  if [[ -n "${KILN_BENCH_VARIANTS:-}" && " $KILN_BENCH_VARIANTS " != *" $n "* ]]; then continue; fi
  variants="$variants $n"
  mkdir -p "/tmp/plans-$n"
  if [[ -f "$v/plans.txz" ]]; then
    xz -dc "$v/plans.txz" | tar xf - -C "/tmp/plans-$n"
  else
    tar xzf "$v/plans.tgz" -C "/tmp/plans-$n"
  fi
  # A variant without its own kiln.xz runs the carried bin/kiln.
  if [[ -f "$v/kiln.xz" ]]; then
    xz -dc "$v/kiln.xz" > "$B/kiln-$n" && chmod +x "$B/kiln-$n"
  else
    cp "$B/kiln" "$B/kiln-$n"
  fi
done

if [[ " $stages " == *" bench "* ]]; then
  # KILN_BENCH_ROUNDS (default 1): the whole interleaved pass repeated, one
  # table per round (logs bench-<variant>-<model>[-r<round>].*), so a
  # difference between variants can be told from the spread between rounds.
  rounds=${KILN_BENCH_ROUNDS:-1}
  for round in $(seq 1 "$rounds"); do
  sfx=""
  [[ "$rounds" -gt 1 ]] && sfx="-r$round"
  for m in $models; do
    for v in $variants; do
      plan=/tmp/plans-$v/$m.kiln
      [[ -f "$plan" ]] || { echo "bench $v $m: no plan" >> "$S"; continue; }
      timeout 150 "$B/kiln-$v" bench "$plan" --device cuda --steps 200 --context 512 ${KILN_BENCH_KEYS:+--keys $KILN_BENCH_KEYS} ${KILN_BENCH_ARGS:-} \
        --json "$OUT/logs/bench-$v-$m$sfx.json" > "$OUT/logs/bench-$v-$m$sfx.txt" 2>&1
      rc=$?
      echo "bench $v $m$sfx: rc=$rc" >> "$S"
      # A failed bench's reason in the summary (its log may not come back:
      # a call returns at most 8 files), e.g. a plan refused as stale.
      [[ $rc -ne 0 ]] && grep -m2 -E "^Error|error:" "$OUT/logs/bench-$v-$m$sfx.txt" | sed 's/^/  /' >> "$S"
    done
  done
  [[ -n "$sfx" ]] && echo "round $round:" >> "$S"
  python3 - "$OUT/logs" "$models" "$sfx" $variants >> "$S" 2>&1 <<'PY'
import json, sys, os
d, models, sfx, variants = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4:]
def rows(p):
    try:
        j = json.load(open(p))
    except Exception:
        return {}
    ks = j["keys"] if isinstance(j, dict) and "keys" in j else j
    return {k["key"]: k for k in ks}
f = lambda v: f"{v:.3f}" if isinstance(v, (int, float)) else "-"
head = f"{'model':14} {'key':8}" + "".join(f" {v + ' ms':>11} {v + ' L':>7}" for v in variants)
if len(variants) > 1:
    head += "".join(f" {v + '/' + variants[0]:>12}" for v in variants[1:])
head += f" {'floor ms':>9} {'last/floor':>10}"
print(head)
for m in models:
    r = {v: rows(os.path.join(d, f"bench-{v}-{m}{sfx}.json")) for v in variants}
    keys = sorted(set().union(*[set(x) for x in r.values()]))
    for key in keys:
        line = f"{m:14} {key:8}"
        for v in variants:
            k = r[v].get(key, {})
            line += f" {f(k.get('replay_ms')):>11} {str(k.get('launches', '-')):>7}"
        base = r[variants[0]].get(key, {}).get("replay_ms")
        for v in variants[1:]:
            x = r[v].get(key, {}).get("replay_ms")
            line += f" {(f'{x / base:.3f}' if x and base else '-'):>12}"
        last = r[variants[-1]].get(key, {})
        line += f" {f(last.get('hbm_floor_ms')):>9} {f(last.get('replay_over_floor')):>10}"
        print(line)
PY
  done
fi


if [[ " $stages " == *" tune "* ]]; then
  first=""
  for v in $variants; do [[ -z "$first" ]] && first=$v; done
  for m in ${KILN_TUNE_MODELS:-}; do
    plan=/tmp/plans-$first/$m.kiln
    [[ -f "$plan" ]] || { echo "tune $m: no plan" >> "$S"; continue; }
    timeout 200 "$B/kiln-$first" tune "$plan" --device cuda -o "$OUT/logs/tune-$m.json" \
      > "$OUT/logs/tune-$m.txt" 2>&1
    echo "tune $m: rc=$?" >> "$S"
    python3 - "$OUT/logs/tune-$m.json" >> "$S" 2>&1 <<'PY'
import json, sys
for e in json.load(open(sys.argv[1]))["entries"]:
    s = e["shape"]
    med = " ".join(f"{k} {v:.2f}" for k, v in sorted(e["median_us"].items()))
    print(f"  t{s['t']} n{s['n']} k{s['k']} {s['dtype']}->{s['out']}: best {e['best']} ({med} us)")
PY
  done
fi

last=""
for v in $variants; do last=$v; done

if [[ " $stages " == *" oracle "* ]]; then
  mkdir -p "$B/oracle"
  cp "$B/kiln" "$B/oracle_run" "$B/oracle/" 2>/dev/null
  start=$(date +%s)
  oracle_models=()
  [[ -n "${KILN_ORACLE_MODELS:-}" ]] && oracle_models=(--models "$KILN_ORACLE_MODELS")
  OUT="$OUT/logs/oracle" KILN_BIN_DIR="$B/oracle" ORACLE_DEVICES="${KILN_ORACLE_DEVICES:-cuda}" \
    SMOLLM2_GGUF=$real_smollm2 GEMMA3_GGUF=$real_gemma3 \
    timeout "${KILN_ORACLE_TIMEOUT:-300}" bash "$root/tests/oracle/run_oracle.sh" \
    ${oracle_models[@]+"${oracle_models[@]}"} ${KILN_ORACLE_ARGS:-} \
    > "$OUT/logs/oracle-stdout.txt" 2>&1
  echo "oracle: rc=$? ($(( $(date +%s) - start )) s)" >> "$S"
  grep -E "PASS|FAIL" "$OUT/logs/oracle/oracle-report.md" 2>/dev/null | head -30 >> "$S"
fi

if [[ " $stages " == *" serve "* && -n "$last" ]]; then
  plan=/tmp/plans-$last/qwen3-0.6b-serve.kiln
  [[ -f "$plan" ]] || plan=/tmp/plans-$last/qwen3-0.6b.kiln
  # The shaped model (header + sparse zero weights) with a synthetic
  # tokenizer of its vocabulary size: the step's cost, not its text.
  python3 "$root/scripts/make-shaped-model.py" qwen3-0.6b /tmp/shapes/qwen3-0.6b --tokenizer >> "$S" 2>&1
  "$B/kiln" serve "$plan" --weights /tmp/shapes/qwen3-0.6b --device cuda --port 18123 --model-name qwen3-shape \
    > "$OUT/logs/serve.txt" 2>&1 &
  spid=$!
  for _ in $(seq 1 120); do
    curl -sf http://127.0.0.1:18123/health >/dev/null 2>&1 && break
    sleep 1
  done
  for c in 1 8 32; do
    timeout 120 python3 "$root/scripts/bench-serve.py" --url http://127.0.0.1:18123 --concurrency "$c" \
      ${KILN_SERVE_BENCH_ARGS:-} --json "$OUT/logs/bench-serve-c$c.json" \
      > "$OUT/logs/bench-serve-c$c.txt" 2>&1
    echo "bench-serve c=$c: rc=$?" >> "$S"
    tail -12 "$OUT/logs/bench-serve-c$c.txt" >> "$S"
  done
  curl -s http://127.0.0.1:18123/metrics > "$OUT/logs/serve-metrics.txt" 2>&1
  kill "$spid" 2>/dev/null
  wait "$spid" 2>/dev/null
fi

if [[ " $stages " == *" ncu "* && -n "$last" ]]; then
  # Per variant and key (KILN_NCU_VARIANTS, default the last; KILN_NCU_KEYS,
  # default b1q1s0; KILN_NCU_MODEL, default qwen3-0.6b): one profiled step
  # (KILN_NCU_FILTER: only the kernels it names).
  metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_bytes.sum,launch__registers_per_thread,smsp__sass_inst_executed_op_local_ld.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size
  for nm in ${KILN_NCU_MODEL:-qwen3-0.6b}; do
  for v in ${KILN_NCU_VARIANTS:-$last}; do
    for key in ${KILN_NCU_KEYS:-b1q1s0}; do
      plan=/tmp/plans-$v/$nm.kiln
      csv="$OUT/logs/ncu-$nm-$v-$key.csv"
      # KILN_NCU_FILTER: only kernels whose name matches (ncu's
      # --kernel-name, e.g. "regex:paged_attn|qskinny").
      timeout 300 ncu --csv --launch-count "${KILN_NCU_KERNELS:-600}" --metrics "$metrics" \
        ${KILN_NCU_FILTER:+--kernel-name "$KILN_NCU_FILTER"} \
        "$B/kiln-$v" bench "$plan" --device cuda --keys "$key" --steps 1 --context 512 \
        > "$csv" 2> "$OUT/logs/ncu-stderr-$nm-$v-$key.txt"
      echo "ncu $nm $v $key: rc=$?" >> "$S"
      # KILN_NCU_SECTIONS (e.g. "WarpStateStats SchedulerStats"): those
      # Nsight Compute sections too, as text, for the kernels KILN_NCU_FILTER
      # names (the stall reasons of one long kernel such as megakernel_run).
      if [[ -n "${KILN_NCU_SECTIONS:-}" ]]; then
        secs=()
        for sec in $KILN_NCU_SECTIONS; do secs+=(--section "$sec"); done
        txt="$OUT/logs/ncu-sections-$nm-$v-$key.txt"
        # KILN_NCU_RAW=1: every metric the sections collect (`--page raw`),
        # with the stall reasons per issued instruction, largest first, in
        # the summary (the details page prints only the largest one).
        timeout 300 ncu --launch-count "${KILN_NCU_KERNELS:-600}" "${secs[@]}" \
          ${KILN_NCU_RAW:+--page raw} \
          ${KILN_NCU_FILTER:+--kernel-name "$KILN_NCU_FILTER"} \
          "$B/kiln-$v" bench "$plan" --device cuda --keys "$key" --steps 1 --context 512 \
          > "$txt" 2>&1
        echo "ncu sections $nm $v $key: rc=$?" >> "$S"
        grep -E "Stall|Warp Cycles|Issued Warp|No Eligible|Active Warps|Eligible Warps|Duration" "$txt" | head -40 >> "$S"
        grep -E "issue_stalled_[a-z_]+_per_issue_active\.ratio" "$txt" | grep -v "not_issued" \
          | awk '{print $NF, $1}' | sort -g -r | head -16 >> "$S"
      fi
      python3 - "$csv" >> "$S" 2>&1 <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if not rows:
    print("ncu: no rows"); sys.exit()
h = rows[0]
ki, mi, vi, ii = h.index("Kernel Name"), h.index("Metric Name"), h.index("Metric Value"), h.index("ID")
per = collections.defaultdict(dict)
names = {}
for r in rows[1:]:
    names[r[ii]] = r[ki].split("(")[0].split("<")[0]
    try:
        per[r[ii]][r[mi]] = float(r[vi].replace(",", "") or 0)
    except ValueError:
        pass
agg = collections.defaultdict(lambda: collections.defaultdict(float)); n = collections.Counter()
for i, m in per.items():
    k = names[i]; n[k] += 1
    for a, b in m.items():
        agg[k][a] += b
tot = sum(a["gpu__time_duration.sum"] for a in agg.values())
print(f"launches profiled: {sum(n.values())}, kernel time {tot/1e3:.1f} us")
print(f"{'kernel':34} {'n':>4} {'us tot':>7} {'share':>6} {'us/call':>7} {'dram%':>6} {'DRAM KB':>8} {'L2 KB':>8} {'regs':>5} {'lcl ld':>7} {'occ%':>5} {'grid':>6}")
for k, a in sorted(agg.items(), key=lambda x: -x[1]["gpu__time_duration.sum"])[:24]:
    c = n[k]; t = a["gpu__time_duration.sum"]
    print(f"{k[:34]:34} {c:>4} {t/1e3:>7.1f} {t/tot:>6.1%} {t/c/1e3:>7.2f} {a['dram__throughput.avg.pct_of_peak_sustained_elapsed']/c:>6.1f} "
          f"{a['dram__bytes_read.sum']/c/1e3:>8.0f} {a['lts__t_bytes.sum']/c/1e3:>8.0f} {a['launch__registers_per_thread']/c:>5.0f} "
          f"{a['smsp__sass_inst_executed_op_local_ld.sum']/c:>7.0f} {a['sm__warps_active.avg.pct_of_peak_sustained_active']/c:>5.1f} {a['launch__grid_size']/c:>6.0f}")
PY
    done
  done
  done
fi

if [[ " $stages " == *" sanitize "* ]]; then
  for spec in ${KILN_SANITIZE:-}; do
    t=${spec%%:*} filt=""
    [[ "$spec" == *:* ]] && filt=${spec#*:}
    [[ -x "$B/$t" ]] || { echo "sanitize $t: binary missing" >> "$S"; continue; }
    for tool in ${KILN_SANITIZE_TOOLS:-memcheck}; do
      start=$(date +%s)
      log="$OUT/logs/sanitize-$tool-$t${filt:+-$(printf '%s' "$filt" | tr -c 'A-Za-z0-9_' '_' | cut -c1-48)}.txt"
      KILN_REQUIRE_CUDA=1 KILN_GEMM_AUTOTUNE=0 KILN_CUBIN_DIR="$cubins" timeout "${KILN_SANITIZE_TIMEOUT:-200}" \
        compute-sanitizer --tool "$tool" --error-exitcode 9 "$B/$t" $filt --test-threads=1 \
        > "$log" 2>&1
      echo "sanitize $tool $t${filt:+ ($filt)}: rc=$? ($(( $(date +%s) - start )) s)" >> "$S"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^test result|Invalid|out of bounds|hazard" "$log" | head -10 >> "$S"
    done
  done
fi

if [[ " $stages " == *" tp "* ]]; then
  # NCCL with NVLink multicast off (the device documentation's variables).
  export NCCL_NVLS_ENABLE=0 NCCL_CUMEM_ENABLE=0 NCCL_RUNTIME_CONNECT=0
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  if (( gpus < 2 )); then
    echo "tp: skipped, $gpus GPU(s) visible (needs 2)" >> "$S"
  else
    K="$B/kiln-${last:-}"; [[ -x "$K" ]] || K="$B/kiln"
    sm=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
    python3 "$root/scripts/make-shaped-model.py" llama-3-8b /tmp/shapes/llama-3-8b >> "$S" 2>&1
    python3 "$root/scripts/make-shaped-model.py" llama-3-8b /tmp/shapes/llama-3-8b-l4 --layers 4 >> "$S" 2>&1
    for tp in 1 2; do
      name=llama-3-8b; (( tp > 1 )) && name=llama-3-8b-tp$tp
      plan=/tmp/plans-${last:-none}/$name.kiln
      if [[ ! -f "$plan" ]]; then
        plan=/tmp/tp-$name.kiln
        timeout 300 "$K" compile /tmp/shapes/llama-3-8b --target "cuda:sm_$sm" --keys b1q1s0 --tp "$tp" \
          -o "$plan" > "$OUT/logs/tp-compile-$name.txt" 2>&1
        echo "tp compile $name: rc=$?" >> "$S"
      fi
      timeout 300 "$K" bench "$plan" --device cuda --keys b1q1s0 --steps 200 --context 512 --tp "$tp" \
        --json "$OUT/logs/tp-bench-$name.json" > "$OUT/logs/tp-bench-$name.txt" 2>&1
      echo "tp bench $name: rc=$?" >> "$S"
      cat "$OUT/logs/tp-bench-$name.txt" >> "$S"
    done
    python3 - "$OUT/logs" >> "$S" 2>&1 <<'PY'
import json, os, sys
d = sys.argv[1]
r = {}
for n in ("llama-3-8b", "llama-3-8b-tp2"):
    try:
        r[n] = json.load(open(os.path.join(d, f"tp-bench-{n}.json")))["keys"][0]
    except Exception as e:
        print(f"tp: no result for {n} ({e})")
if len(r) == 2:
    a, b = r["llama-3-8b"]["replay_ms"], r["llama-3-8b-tp2"]["replay_ms"]
    c = r["llama-3-8b-tp2"].get("collective_ms")
    print(f"tp: llama-3-8b b1 step tp1 {a:.3f} ms, tp2 {b:.3f} ms, ratio {b / a:.3f} (target <= 0.6); "
          f"all-reduce per step {'%.3f ms' % c if c is not None else 'not measured'}")
PY
    if [[ -x "$B/cuda_tp" ]]; then
      KILN_REQUIRE_CUDA=1 KILN_CUBIN_DIR="$cubins" KILN_TP_SHAPED_DIR=/tmp/shapes/llama-3-8b-l4 \
        timeout "${KILN_TEST_TIMEOUT:-400}" "$B/cuda_tp" --test-threads=1 > "$OUT/logs/test-cuda_tp.txt" 2>&1
      echo "test cuda_tp: rc=$? $(grep -E '^test result' "$OUT/logs/test-cuda_tp.txt" | tail -1)" >> "$S"
      grep -E "FAILED|panicked|near-tie|tokens equal" "$OUT/logs/test-cuda_tp.txt" | head -20 >> "$S"
    else
      echo "tp: cuda_tp test binary not carried (.device-carry/bin/cuda_tp.xz)" >> "$S"
    fi
  fi
fi

tar czf "$OUT/00-all.tgz" -C "$OUT" logs
cat "$S"
