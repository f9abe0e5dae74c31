#!/usr/bin/env bash
# One device call: the attention harness (bench/attn/attn_bench.cu) built
# twice, from the working tree and from an older copy of attention.cu,
# kiln_port.h and attn_bench.cu in $AB_OLD (e.g. `git show REV:path` of
# each), timed in the same call. Usage (device):
#   AB_OLD=.device-carry/attn-old OUT=$OUT bash bench/attn/ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/attn-ab}
OLD=${AB_OLD:-.device-carry/attn-old}
mkdir -p "$OUT" /tmp/ab/old /tmp/ab/new
cp "$OLD/attention.cu" "$OLD/kiln_port.h" "$OLD/attn_bench.cu" /tmp/ab/old/
cp kernels/gpu/attention.cu kernels/gpu/kiln_port.h bench/attn/attn_bench.cu /tmp/ab/new/
for v in old new; do
  ( nvcc -O3 -arch=sm_90 -lineinfo -I /tmp/ab/$v /tmp/ab/$v/attn_bench.cu -o /tmp/ab/$v/attn_bench \
      > /tmp/ab/$v/build.txt 2>&1; echo $? > /tmp/ab/$v/build.rc ) &
done
wait
T="$OUT/attn-ab.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$T"
for ctx in ${AB_CTX:-512 4096}; do
  for v in old new; do
    echo "== $v ctx $ctx (build rc=$(cat /tmp/ab/$v/build.rc))" >> "$T"
    [[ "$(cat /tmp/ab/$v/build.rc)" == 0 ]] || { tail -20 /tmp/ab/$v/build.txt >> "$T"; continue; }
    b=${AB_BATCHES:-1,8,32}
    [[ $ctx -gt 512 ]] && b=${AB_LONG_BATCHES:-1,8}
    ATTN_CTX=$ctx ATTN_BATCHES=$b timeout 200 /tmp/ab/$v/attn_bench >> "$T" 2>&1
    echo "rc=$?" >> "$T"
  done
done
