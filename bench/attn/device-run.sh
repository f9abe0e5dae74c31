#!/usr/bin/env bash
# One device call: the attention harness tables (context 512, and 4096 at
# batch 1 and 8) and Nsight Compute on b1 shapes. Expects the harness
# binary at .device-carry/attn/attn_bench (see attn_bench.cu's header).
set -uo pipefail
B=.device-carry/attn/${ATTN_BIN:-attn_bench}
OUT=${OUT:-/tmp/attn-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/table.txt"
timeout 200 "$B" >> "$OUT/table.txt" 2>&1
echo "rc=$?" >> "$OUT/table.txt"
ATTN_CTX=4096 ATTN_BATCHES=1,8 timeout 150 "$B" >> "$OUT/table.txt" 2>&1
echo "rc=$?" >> "$OUT/table.txt"
for mb in ${ATTN_NCU:-"qwen3-0.6b:1:0" "qwen3-0.6b:1:1"}; do
  IFS=: read -r m b c <<< "$mb"
  timeout 120 ncu --set full -k regex:paged_attn --launch-skip 2 --launch-count 1 \
    "$B" once "$m" "$b" 256 "$c" > "$OUT/ncu-$m-b$b-c$c.txt" 2>&1
done
