#!/usr/bin/env bash
# Fills .device-carry/ for scripts/gpu-final.sh (see its header) from builds
# made here, so one device call runs everything.
#
#   scripts/pack-device-carry.sh VARIANT KILN_BINARY "COMPILE FLAGS" [MODEL...]
#       compiles plans of the shaped models (scripts/make-shaped-model.py) with
#       KILN_BINARY and the flags, into .device-carry/bench/VARIANT/, with
#       KILN_BINARY itself (kiln.xz). Deleting a variant's kiln.xz to save
#       carry (gpu-final.sh then runs bin/kiln) is safe only where bin/kiln
#       was built from the same kernel sources: a plan embeds its kernel
#       images and the loader refuses one compiled from other sources as
#       stale (session 38 lost a variant that way)
#   scripts/pack-device-carry.sh --test BINARY...
#       adds test executables (stripped, xz'd) to bin/ and tests.txt
#   scripts/pack-device-carry.sh --bin BINARY...
#       adds tools (kiln, oracle_run) to bin/
#   scripts/pack-device-carry.sh --kernel-cache KILN_BINARY [MODEL...]
#       compiles the shaped models (default qwen3-0.6b and gemma3-270m: every
#       module the oracle's families use) for cuda:sm_90 with KILN_BINARY into
#       an empty kernel cache and packs it as kernel-cache.tar.xz, which
#       gpu-final.sh unpacks into $KILN_CACHE: a `kiln compile` on the device
#       (the oracle stage) then finds its images instead of running NVRTC
#       (entries are keyed by source, options, NVRTC version and arch, so a
#       stale or foreign entry is never used, only missed)
# Keys come from KILN_PACK_KEYS (default b1q1s0,b8q1s0,b32q1s0). Plans are
# compiled from /tmp/shapes/MODEL$KILN_PACK_SHAPE_SUFFIX (e.g. "-q4k" for
# shapes made with make-shaped-model.py --quant q4_k) but named MODEL.kiln,
# so gpu-final.sh compares variants model by model.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
C="$root/.device-carry"
mkdir -p "$C/bin" "$C/bench"
touch "$C/tests.txt"
pack_bin() {
  local src=$1 name=$2
  strip -o "/tmp/pack-$name" "$src"
  xz -T2 -6 -c "/tmp/pack-$name" > "$C/bin/$name.xz"
  rm -f "/tmp/pack-$name"
}
case "${1:-}" in
  --test)
    shift
    for t in "$@"; do
      name=$(basename "$t" | sed 's/-[0-9a-f]\{16\}$//')
      pack_bin "$t" "$name"
      grep -qx "$name" "$C/tests.txt" || echo "$name" >> "$C/tests.txt"
    done ;;
  --bin)
    shift
    for t in "$@"; do pack_bin "$t" "$(basename "$t")"; done ;;
  --kernel-cache)
    kiln=$2
    shift 2
    models=("$@")
    [[ ${#models[@]} -gt 0 ]] || models=(qwen3-0.6b gemma3-270m)
    kc=/tmp/pack-kernel-cache
    rm -rf "$kc" && mkdir -p "$kc"
    for m in "${models[@]}"; do
      src="/tmp/shapes/$m"
      [[ -f "$src/config.json" ]] || python3 "$root/scripts/make-shaped-model.py" "$m" "$src"
      KILN_CACHE="$kc" "$kiln" compile "$src" --target cuda:sm_90 --keys b1q1s0 -o "$kc/plan.kiln" > /dev/null
      rm -f "$kc/plan.kiln"
    done
    tar cf - -C "$kc" kernels | xz -T2 -6 > "$C/kernel-cache.tar.xz"
    rm -rf "$kc"
    ;;
  *)
    v=$1 kiln=$2 flags=$3
    shift 3
    models=("$@")
    [[ ${#models[@]} -gt 0 ]] || models=(smollm2-135m qwen3-0.6b llama-3.2-1b)
    d="/tmp/pack-plans-$v"
    rm -rf "$d" && mkdir -p "$d" "$C/bench/$v"
    for m in "${models[@]}"; do
      src="/tmp/shapes/$m${KILN_PACK_SHAPE_SUFFIX:-}"
      [[ -f "$src/config.json" ]] || python3 "$root/scripts/make-shaped-model.py" "$m" "$src"
      # shellcheck disable=SC2086
      "$kiln" compile "$src" --target cuda:sm_90 --keys "${KILN_PACK_KEYS:-b1q1s0,b8q1s0,b32q1s0}" \
        $flags -o "$d/$m.kiln" > /dev/null
    done
    rm -f "$C/bench/$v/plans.tgz"
    tar cf - -C "$d" . | xz -T2 -6 > "$C/bench/$v/plans.txz"
    strip -o "/tmp/pack-kiln-$v" "$kiln"
    xz -T2 -6 -c "/tmp/pack-kiln-$v" > "$C/bench/$v/kiln.xz"
    rm -f "/tmp/pack-kiln-$v"
    ;;
esac
du -sh "$C"
