#!/usr/bin/env bash
# One device call: the quantized harness builds (.device-carry/gemv/qgemv_*.xz,
# one per -DKILN_QUNROLL/-DKILN_QMINBLOCKS build) and ncu on Q4_K 14336x4096 T=1.
set -uo pipefail
OUT=${OUT:-/tmp/qgemv-out}
mkdir -p "$OUT" /tmp/qb
for f in .device-carry/gemv/qgemv_*.xz; do xz -dc "$f" > /tmp/qb/$(basename "$f" .xz); chmod +x /tmp/qb/$(basename "$f" .xz); done
for b in /tmp/qb/${Q_BINS:-qgemv_*}; do
  n=$(basename "$b")
  if [[ "${Q_TYPE:-q4k}" == all ]]; then unset Q_TYPE; else export Q_TYPE=${Q_TYPE:-q4k}; fi
  timeout "${Q_TIMEOUT:-100}" "$b" > "$OUT/$n.txt" 2>&1; echo "rc=$?" >> "$OUT/$n.txt"
done
for kn in ${Q_NCU:-qgemv:q4k:14336:4096:1 qskinny_r1:q4k:14336:4096:1}; do
  IFS=: read -r k t n kk T <<< "$kn"
  timeout 90 ncu --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --launch-skip 1 --launch-count 1 -k "regex:^q" /tmp/qb/${Q_NCU_BIN:-qgemv_new} once "$k" "$t" "$n" "$kk" "$T" > "$OUT/ncu-$k-$t-$T.txt" 2>&1
done
