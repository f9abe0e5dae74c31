#!/usr/bin/env bash
# One device call: the quantized harness (bench/gemv/qgemv_bench.cu) built
# there with nvcc (Q_BUILD=1, the default; or prebuilt binaries from
# .device-carry/gemv/qgemv_*.xz with Q_BUILD=0), run over the types
# (Q_TYPE: q4k, q6k, q8_0, fp8 or all), then ncu on the launches Q_NCU
# lists (kernel:type:n:k:T).
set -uo pipefail
OUT=${OUT:-/tmp/qgemv-out}
mkdir -p "$OUT" /tmp/qb
if [[ "${Q_BUILD:-1}" == 1 ]]; then
  ( time nvcc -O3 -arch=sm_90 -lineinfo --split-compile 0 ${Q_NVCC_FLAGS:--DQB_NO_SKINNY} -I kernels/gpu \
      bench/gemv/qgemv_bench.cu -o /tmp/qb/qgemv_new ) > "$OUT/build.txt" 2>&1
  echo "build rc=$?" >> "$OUT/build.txt"
else
  for f in .device-carry/gemv/qgemv_*.xz; do xz -dc "$f" > /tmp/qb/$(basename "$f" .xz); chmod +x /tmp/qb/$(basename "$f" .xz); done
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >> "$OUT/build.txt" 2>&1
for b in /tmp/qb/${Q_BINS:-qgemv_*}; do
  n=$(basename "$b")
  for t in ${Q_TYPE:-q4k}; do
    if [[ "$t" == all ]]; then unset Q_TYPE; else export Q_TYPE=$t; fi
    timeout "${Q_TIMEOUT:-100}" "$b" > "$OUT/$n-$t.txt" 2>&1; echo "rc=$?" >> "$OUT/$n-$t.txt"
  done
done
for kn in ${Q_NCU:-qgemv_i8:q4k:4096:14336:1}; do
  IFS=: read -r k t n kk T <<< "$kn"
  timeout 90 ncu --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --launch-skip 1 --launch-count 1 -k "regex:^(q|i8)" /tmp/qb/${Q_NCU_BIN:-qgemv_new} once "$k" "$t" "$n" "$kk" "$T" >> "$OUT/ncu.txt" 2>&1
done
