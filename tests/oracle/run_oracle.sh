#!/usr/bin/env bash
# kiln vs Hugging Face transformers: the whole oracle in one command.
#
#   tests/oracle/run_oracle.sh [--cpu-only] [--models "name ..."] [--runs "b1 b8 spec"]
#                              [--prompts N] [--new-tokens N]
#
# --prompts N keeps each model's first N prompts and --new-tokens N decodes N
# tokens instead of 32: a shorter run for a slow or busy machine (the report
# records the command line).
#
# Builds the random-weight battery (tests/oracle/models.py) and, when a
# SmolLM2 GGUF is at hand, imports it with `kiln import`; runs HF greedy
# decoding (f32 oracle, bf16, bf16 with an f32 head); compiles each model with
# `kiln compile` for cpu (and cuda:sm_90 unless --cpu-only); runs oracle_run
# on each backend at batch 1 and batch 8 and in speculative mode (b1q3s2)
# with the oracle's drafts and with wrong ones; and writes the report.
#
# Environment:
#   OUT           where the report goes (default $ORACLE_WORK/out):
#                 oracle-report.md, oracle-report.json, oracle-log.txt
#   ORACLE_WORK   scratch: models, plans, runs (default /tmp/kiln-oracle)
#   KILN_BIN_DIR  directory holding `kiln` and `oracle_run` (default target/release)
#   PYTHON        python with torch + transformers (default python3)
#   SMOLLM2_GGUF  SmolLM2 GGUF to import and include (default: kiln's cache, if there)
#   SMOLLM2_NAME  its model name in the report (default smollm2-135m)
#   GEMMA3_GGUF   Gemma-3-270M GGUF to import and include (default: kiln's cache,
#                 where scripts/fetch-gemma3.sh puts it, if there); its prompts
#                 are real text, tokenized by the imported tokenizer.json
#   GEMMA3_NAME   its model name in the report (default gemma-3-270m)
#   ORACLE_THREADS  torch CPU threads (default: torch's choice)
#   ORACLE_TARGET   CUDA target for kiln compile (default cuda:sm_90)
#   ORACLE_DEVICES  kiln backends on a GPU machine (default "cpu cuda")
#
# Needs no network. Exit status: 0 when the report says PASS, 1 when it says
# FAIL, 2 when something could not run (the log says what).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
cmdline="tests/oracle/run_oracle.sh${*:+ $*}"
cpu_only=0
models=""
runs="b1 b8 spec"
nprompts=0
new_tokens=32
while [[ $# -gt 0 ]]; do
    case $1 in
        --cpu-only) cpu_only=1 ;;
        --models) models=$2; shift ;;
        --runs) runs=$2; shift ;;
        --prompts) nprompts=$2; shift ;;
        --new-tokens) new_tokens=$2; shift ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "run_oracle.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

WORK=${ORACLE_WORK:-/tmp/kiln-oracle}
OUT=${OUT:-$WORK/out}
BIN=${KILN_BIN_DIR:-$repo/target/release}
PY=${PYTHON:-python3}
TARGET=${ORACLE_TARGET:-cuda:sm_90}
KILN=$BIN/kiln
ORUN=$BIN/oracle_run
mkdir -p "$WORK" "$OUT"
rm -f "$OUT/oracle-report.md" "$OUT/oracle-report.json"
LOG=$OUT/oracle-log.txt
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
export KILN_COMMIT=${KILN_COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}

say() { echo "[run_oracle $(date +%H:%M:%S)] $*"; }
die() { say "error: $*"; exit 2; }

for tool in "$KILN" "$ORUN"; do
    [[ -x $tool ]] || die "$tool not found or not executable; build it (cargo build --release -p kiln-compiler -p kiln-examples --bin kiln --bin oracle_run, with --features cuda for GPU runs) or set KILN_BIN_DIR"
done
"$PY" -c "import torch, transformers, safetensors" \
    || die "$PY cannot import torch, transformers and safetensors; set PYTHON to one that can"
threads=()
[[ -n ${ORACLE_THREADS:-} ]] && threads=(--threads "$ORACLE_THREADS")

hf_device=cpu
devices=(cpu)
if (( ! cpu_only )); then
    "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        || die "torch sees no CUDA device; run with --cpu-only to test the CPU backend alone"
    hf_device=cuda
    read -r -a devices <<< "${ORACLE_DEVICES:-cpu cuda}"
    # cuBLASLt and NVRTC for kiln's CUDA backend and `kiln compile --target
    # cuda:*`: the toolkit's and the pip wheels' library folders.
    libdirs=""
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
             $("$PY" -c 'import nvidia,os;[print(os.path.join(p,"cu13","lib")) for p in nvidia.__path__]' 2>/dev/null); do
        if [[ -d $d ]]; then libdirs="$libdirs:$d"; fi
    done
    export LD_LIBRARY_PATH="${libdirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
fi
say "work $WORK, out $OUT, kiln $KILN, HF on $hf_device, backends: ${devices[*]}"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
"$KILN" --version || true

# 1. Models.
model_args=()
if [[ -n $models ]]; then
    read -r -a model_args <<< "$models"
fi
battery=()
smol=${SMOLLM2_NAME:-smollm2-135m}
gemma=${GEMMA3_NAME:-gemma-3-270m}
for m in ${model_args[@]+"${model_args[@]}"}; do
    if [[ $m != "$smol" && $m != "$gemma" ]]; then battery+=("$m"); fi
done
if [[ -z $models || ${#battery[@]} -gt 0 ]]; then
    rm -rf "$WORK/models"
    "$PY" "$here/oracle.py" models --work "$WORK" ${battery[@]+--models "${battery[@]}"}
fi
gguf=${SMOLLM2_GGUF:-${KILN_CACHE:-$HOME/.cache/kiln}/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
if [[ -z $models || " $models " == *" $smol "* ]]; then
    if [[ -f $gguf ]]; then
        rm -rf "$WORK/models/$smol"
        "$KILN" import "$gguf" -o "$WORK/models/$smol" --force
    elif [[ " $models " == *" $smol "* ]]; then
        die "$smol asked for but no GGUF at $gguf; set SMOLLM2_GGUF"
    else
        say "no SmolLM2 GGUF at $gguf: SmolLM2 is left out of this run"
    fi
fi
ggguf=${GEMMA3_GGUF:-${KILN_CACHE:-$HOME/.cache/kiln}/gemma3/gemma-3-270m-q4_k_m.gguf}
if [[ -z $models || " $models " == *" $gemma "* ]]; then
    if [[ -f $ggguf ]]; then
        rm -rf "$WORK/models/$gemma"
        "$KILN" import "$ggguf" -o "$WORK/models/$gemma" --force
        # Real weights get real text: eight prompts as token ids (BOS first).
        "$PY" - "$WORK/models/$gemma" <<'PY'
import json, os, sys
from tokenizers import Tokenizer
d = sys.argv[1]
tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
texts = [
    "The capital of France is",
    "Q: What is the capital of France?\nA:",
    "def fibonacci(n):",
    "The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Water boils at a temperature of",
    "The three primary colors are",
]
prompts = [tok.encode(t).ids for t in texts]
with open(os.path.join(d, "oracle-prompts.json"), "w") as f:
    json.dump({"texts": texts, "prompts": prompts}, f, indent=1)
print("gemma prompts:", [len(p) for p in prompts])
PY
    elif [[ " $models " == *" $gemma "* ]]; then
        die "$gemma asked for but no GGUF at $ggguf; set GEMMA3_GGUF (scripts/fetch-gemma3.sh fetches it)"
    else
        say "no Gemma-3 GGUF at $ggguf: Gemma-3-270M is left out of this run"
    fi
fi
names=()
if [[ -n $models ]]; then
    # Only the models asked for (others may be left in $WORK from earlier runs).
    names=("${model_args[@]}")
else
    for d in "$WORK"/models/*/; do names+=("$(basename "$d")"); done
fi
say "models: ${names[*]}"

# 2. HF reference.
"$PY" "$here/oracle.py" reference --work "$WORK" --device "$hf_device" ${threads[@]+"${threads[@]}"} \
    --prompts "$nprompts" --new-tokens "$new_tokens" --models "${names[@]}"

# 3. kiln: compile and run.
keys=b1q1s0,b8q1s0,b1q8s0,b8q8s0,b1q3s2
for name in "${names[@]}"; do
    wd=$WORK/$name
    rm -f "$wd"/kiln-*.json "$wd"/kiln-*.f32 "$wd"/plan-*.kiln
    for dev in "${devices[@]}"; do
        if [[ $dev == cpu ]]; then target=cpu; else target=$TARGET; fi
        plan=$wd/plan-$dev.kiln
        say "$name: kiln compile --target $target"
        "$KILN" compile "$WORK/models/$name" --keys "$keys" --target "$target" --logits \
            --max-context 128 --kv-blocks 64 --quiet -o "$plan"
        common=(--plan "$plan" --weights "$WORK/models/$name" --device "$dev"
                --prompts "$wd/prompts.json" --new-tokens "$new_tokens")
        for r in $runs; do
            case $r in
                b1) "$ORUN" "${common[@]}" --batch 1 --out "$wd/kiln-$dev-b1.json" ;;
                b8) "$ORUN" "${common[@]}" --batch 8 --out "$wd/kiln-$dev-b8.json" ;;
                spec)
                    # Right drafts: HF f32's continuation (oracle) and kiln's own
                    # plain greedy output (self). Wrong drafts: kiln's own output
                    # plus one, so each first draft is certainly not the argmax
                    # (HF's tokens plus one can be right where kiln left HF's path).
                    [[ -f $wd/kiln-$dev-b1.json ]] || die "the spec runs need the b1 run (--runs \"b1 ... spec\")"
                    "$PY" "$here/oracle.py" self-drafts --run "$wd/kiln-$dev-b1.json" \
                        --out "$wd/self-drafts-$dev.json"
                    "$ORUN" "${common[@]}" --batch 1 --drafts "$wd/drafts.json" \
                        --out "$wd/kiln-$dev-spec-oracle.json"
                    "$ORUN" "${common[@]}" --batch 1 --drafts "$wd/self-drafts-$dev.json" \
                        --out "$wd/kiln-$dev-spec-self.json"
                    "$ORUN" "${common[@]}" --batch 1 --drafts "$wd/self-drafts-$dev.json" --wrong-drafts \
                        --out "$wd/kiln-$dev-spec-wrong.json" ;;
                *) die "unknown run $r (expected b1, b8, spec)" ;;
            esac
        done
    done
done

# 4. Judge.
set +e
"$PY" "$here/oracle.py" compare --work "$WORK" --device "$hf_device" "${threads[@]}" \
    --models "${names[@]}" --out "$OUT" --command "$cmdline"
status=$?
set -e
[[ -f $OUT/oracle-report.md ]] || die "compare wrote no report"
grep -q 'verdict: \*\*PASS\*\*' "$OUT/oracle-report.md" && exit 0
(( status == 0 || status == 1 )) && exit 1
exit 2
