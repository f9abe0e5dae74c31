#!/usr/bin/env bash
# CI for kiln's HIP backend (kiln-runtime feature `rocm`) on a machine without
# an AMD GPU: installs Debian's HIP runtime headers and library (which also
# bring hiprtc), builds the feature, lints it, and runs the HIP tests. Tests
# that need a device print "skipped: no HIP device (...)" and pass; nothing
# here claims to have run on AMD hardware.
#
# Needs: Debian 12 (bookworm) or a derivative with libamdhip64-dev, root or
# sudo for apt-get. HIP_PATH defaults to /usr through .cargo/config.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! dpkg-query -W -f='${Status}' libamdhip64-dev 2>/dev/null | grep -q "install ok installed"; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends libamdhip64-dev >/dev/null
fi

cargo build -p kiln-runtime --features rocm
cargo clippy -p kiln-runtime --features rocm --all-targets -- -D warnings
# Unit tests of the HIP modules (the pure ones also run in the default build),
# then the integration tests: the catalog compiled by hiprtc for gfx90a, and
# the backend contract (skipped without a device).
cargo test -p kiln-runtime --features rocm --lib hip::
cargo test -p kiln-runtime --features rocm --test 'hip*'
