#!/usr/bin/env bash
# One device call for the integer-dot GEMV's geometries (session 23):
#  1. bench/gemv/qdevice-run.sh: the harness built there with nvcc, every
#     geometry variant on Q4_K and Q6_K at Llama-3-8B / Qwen3-4B / Qwen3-0.6B
#     shapes, and ncu on the Llama-3-8B down projection (QDOT_NCU);
#  2. scripts/gpu-final.sh "tests bench": cuda_quant (every geometry against
#     the decoded weight, under capture and replay) and `kiln bench` of the
#     Q4_K plans compiled with each KILN_QDOT_GEOM (.device-carry/bench/<geom>/).
# Output: $OUT/summary.txt (both), $OUT/harness.tgz, gpu-final's tarball.
set -uo pipefail
OUT=${OUT:-/tmp/qdot-out}
mkdir -p "$OUT"
H=/tmp/qdot-harness
rm -rf "$H" && mkdir -p "$H"
if [[ "${QDOT_HARNESS:-1}" == 1 ]]; then
  Q_TYPE="${QDOT_TYPES:-q4k q6k}" Q_NCU="${QDOT_NCU:-qgemv_i8:q4k:4096:14336:1 i8_r2u2k2p:q4k:4096:14336:1}" \
    OUT=$H timeout "${QDOT_HARNESS_TIMEOUT:-240}" bash bench/gemv/qdevice-run.sh
  tar czf "$OUT/harness.tgz" -C "$H" .
fi
KILN_FINAL_STAGES="${QDOT_STAGES:-tests bench}" KILN_BENCH_MODELS="${QDOT_MODELS:-qwen3-0.6b llama-3-8b}" \
  KILN_BENCH_KEYS="${QDOT_KEYS:-b1q1s0}" OUT="$OUT/final" bash scripts/gpu-final.sh
cp "$OUT/final/summary.txt" "$OUT/summary.txt" 2>/dev/null
{ echo; echo "== harness"; cat "$H/build.txt" 2>/dev/null; for f in "$H"/qgemv_new-*.txt; do echo "== $f"; grep -v " 8 qgemv" "$f"; done; } >> "$OUT/summary.txt"
# At most 8 files come back from a call: keep the two summaries and two tarballs.
rm -rf "$OUT/final/logs"
