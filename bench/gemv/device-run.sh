#!/usr/bin/env bash
# One device call: the GEMV harness table and Nsight Compute on a few
# shapes. Expects the harness binary at .device-carry/gemv/gemv_bench (see
# gemv_bench.cu's header). GEMV_NCU: "entry:n:k" triples.
set -uo pipefail
B=.device-carry/gemv/${GEMV_BIN:-gemv_bench}
OUT=${OUT:-/tmp/gemv-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/table.txt"
timeout "${GEMV_TIMEOUT:-240}" "$B" >> "$OUT/table.txt" 2>&1
echo "rc=$?" >> "$OUT/table.txt"
for e in ${GEMV_NCU:-}; do
  IFS=: read -r entry n k <<< "$e"
  timeout 90 ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --launch-skip 1 --launch-count 1 -k "regex:^$entry\$" \
    "$B" once "$entry" "$n" "$k" > "$OUT/ncu-$entry-$n-$k.txt" 2>&1
done
