#!/usr/bin/env bash
# A wheel directory ("wheelhouse") of this project's dependencies, built on a host with internet
# (a cluster's login node) for compute nodes that have none.
#
# On the login node, from the repository root, with the cluster's CUDA torch importable by
# $PYTHON (after `module load ...`, in a conda env or a venv): the wheelhouse leaves torch out,
# and every node uses that torch.
#
#   bash scripts/wheelhouse.sh                         # -> wheels/
#   WHEELHOUSE_DRY_RUN=1 bash scripts/wheelhouse.sh    # print the commands, run nothing
#
# On a compute node (no internet), in the environment that has that torch (or a venv made from
# its python with --system-site-packages):
#
#   pip install --no-index --find-links wheels -c wheels/constraints.txt -e .
#
# Steps:
#   1. wheels/constraints.txt pins the torch found (`torch==<torch.__version__>`): an install that
#      would replace the node's torch fails instead;
#   2. in a throw-away venv, pip resolves the project (`-e ".[test]"`) against that torch version
#      without installing anything (`pip install --dry-run --report`: metadata only, so no torch
#      or CUDA wheel is downloaded where the index serves metadata files, as PyPI does);
#   3. wheels/requirements.txt: every package of that resolution but the project and torch's
#      stack (torch, torchvision, torchaudio, triton, nvidia-*), at its resolved version;
#   4. `pip wheel --no-deps` downloads or builds one wheel per line (sdists are built here, where
#      compilers and headers are), plus the build backend (pyproject.toml [build-system]: an
#      offline `pip install -e .` needs setuptools);
#   5. any torch-stack wheel left is removed (several GB; the node's own CUDA build is used);
#   6. a fresh venv that sees $PYTHON's packages (as the node's environment does) installs from
#      the wheel directory alone (--no-index) and imports the project and its main dependencies.
#
# Variables:
#   PYTHON              the interpreter with the cluster's torch (default: python3)
#   WHEEL_DIR           output directory (default: wheels; its *.whl are removed first)
#   PACO_EXTRAS         the project's extras to include (default: test; "" for none)
#   PACO_TORCH_RESOLVE  the torch version the others are resolved against (default: the found one
#                       without its local label, 2.5.1+cu121 -> 2.5.1); set it when that version is
#                       on no index (a vendor build such as 2.6.0a0+ecf3bae)
#   WHEELHOUSE_TMP      where the throw-away venvs go (default: a new directory under $TMPDIR)
#   WHEELHOUSE_DRY_RUN  1: print each command (prefixed "+ "), run nothing
#
# vLLM (the `gpu` extra) is not included: it pins an exact torch of its own, so it gets an
# environment of its own on a shared filesystem, named by judge_endpoint.server.python.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
WHEEL_DIR="${WHEEL_DIR:-wheels}"
PACO_EXTRAS="${PACO_EXTRAS-test}"
DRY="${WHEELHOUSE_DRY_RUN:-0}"
# torch's stack, by normalised project name: never in the wheel directory
TORCH_STACK='torch torchvision torchaudio triton pytorch-triton nvidia-*'

show() {  # the command line, each word quoted where the shell needs it
    local out="+" word
    for word in "$@"; do
        if [[ "$word" =~ ^[][A-Za-z0-9_./=:,+@%\$\<\>*-]+$ ]]; then out+=" $word"; else out+=" '${word//\'/\'\\\'\'}'"; fi
    done
    echo "$out"
}

run() {  # a command, printed; run unless dry
    show "$@"
    if [ "$DRY" != 1 ]; then "$@"; fi
}

run_sh() {  # a shell line (redirections), printed; run unless dry
    echo "+ $1"
    if [ "$DRY" != 1 ]; then bash -c "$1"; fi
}

target="."
if [ -n "$PACO_EXTRAS" ]; then target=".[$PACO_EXTRAS]"; fi

if [ "$DRY" = 1 ]; then
    TMP="${WHEELHOUSE_TMP:-\$TMPDIR/wheelhouse.XXXXXX}"
    TORCH_VERSION='$TORCH_VERSION'
    TORCH_RESOLVE="${PACO_TORCH_RESOLVE:-\$TORCH_VERSION_WITHOUT_LOCAL_LABEL}"
    echo "+ TORCH_VERSION=\$($PYTHON -c 'import torch; print(torch.__version__)')"
else
    if ! TORCH_VERSION="$("$PYTHON" -c 'import torch; print(torch.__version__)')"; then
        echo "wheelhouse: $PYTHON cannot import torch. Load the cluster's CUDA torch first (module load ..., a" \
             "conda env, a venv) or set PYTHON to an interpreter that has it: the wheelhouse leaves torch out." >&2
        exit 2
    fi
    TORCH_RESOLVE="${PACO_TORCH_RESOLVE:-${TORCH_VERSION%%+*}}"
    TMP="${WHEELHOUSE_TMP:-$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse.XXXXXX")}"
    mkdir -p "$TMP"
fi
BUILD="$TMP/build-venv"
CHECK="$TMP/check-venv"
echo "wheelhouse: torch $TORCH_VERSION from $PYTHON (resolved as $TORCH_RESOLVE); wheels into $WHEEL_DIR; venvs in $TMP"

# 1. the torch every node must already have
run mkdir -p "$WHEEL_DIR"
run_sh "rm -f '$WHEEL_DIR'/*.whl '$WHEEL_DIR'/resolution.json"
run_sh "printf '%s\\n' '# the torch of the environment this wheelhouse was built for (scripts/wheelhouse.sh)' 'torch==$TORCH_VERSION' > '$WHEEL_DIR/constraints.txt'"
run_sh "echo 'torch==$TORCH_RESOLVE' > '$TMP/resolve-constraints.txt'"

# 2. the resolution, nothing installed
run rm -rf "$BUILD"
run "$PYTHON" -m venv "$BUILD"
run "$BUILD/bin/python" -m pip install --quiet --upgrade pip
run "$BUILD/bin/python" -m pip install --dry-run --quiet --ignore-installed --report "$WHEEL_DIR/resolution.json" \
    -c "$TMP/resolve-constraints.txt" -e "$target"

# 3. what it holds, without the project and torch's stack
run "$BUILD/bin/python" - "$WHEEL_DIR/resolution.json" "$WHEEL_DIR/requirements.txt" "$TORCH_STACK" <<'PY'
import fnmatch, json, re, sys
report, out, stack = sys.argv[1], sys.argv[2], sys.argv[3].split()
lines = []
for item in json.load(open(report))["install"]:
    meta = item["metadata"]
    name = re.sub(r"[-_.]+", "-", meta["name"]).lower()
    if item.get("is_direct") and (item.get("download_info") or {}).get("dir_info") is not None:
        continue  # the project itself (-e .)
    if not any(fnmatch.fnmatch(name, pattern) for pattern in stack):
        lines.append(f"{name}=={meta['version']}")
open(out, "w").write("\n".join(sorted(lines)) + "\n")
print(f"wheelhouse: {len(lines)} requirements in {out}")
PY
run_sh "'$PYTHON' -c 'import tomllib; print(*tomllib.load(open(\"pyproject.toml\", \"rb\"))[\"build-system\"][\"requires\"], sep=chr(10))' > '$WHEEL_DIR/build-requirements.txt'"

# 4. one wheel per requirement
run "$BUILD/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$WHEEL_DIR" -r "$WHEEL_DIR/requirements.txt"
run "$BUILD/bin/python" -m pip wheel --quiet --wheel-dir "$WHEEL_DIR" -r "$WHEEL_DIR/build-requirements.txt"

# 5. never torch's stack (a build requirement's dependencies could still have pulled one in)
run_sh "find '$WHEEL_DIR' -maxdepth 1 -type f \\( -iname 'torch-*.whl' -o -iname 'torchvision-*.whl' -o -iname 'torchaudio-*.whl' -o -iname 'triton-*.whl' -o -iname 'pytorch_triton-*.whl' -o -iname 'nvidia_*.whl' \\) -print -delete"

# 6. what a compute node does: a fresh venv seeing $PYTHON's packages (a .pth file of its
#    site-packages directories: works whether $PYTHON is a module's, a conda env's or a venv's)
run rm -rf "$CHECK"
run "$PYTHON" -m venv "$CHECK"
run_sh "'$PYTHON' -c 'import site, sys; print(*[p for p in sys.path if p.endswith((\"site-packages\", \"dist-packages\"))], sep=chr(10))' > \"\$('$CHECK/bin/python' -c 'import sysconfig; print(sysconfig.get_path(\"purelib\"))')/_wheelhouse_base.pth\""
run "$CHECK/bin/python" -m pip install --quiet --no-index --find-links "$WHEEL_DIR" -c "$WHEEL_DIR/constraints.txt" -e "$target"
run "$CHECK/bin/python" -c "import stages, paco, workflow, torch, diffusers, transformers, peft, accelerate, fastapi, uvicorn, openai, dvc, snakemake; assert torch.__version__ == '$TORCH_VERSION', torch.__version__; print('wheelhouse: offline install OK')"
# the check venv registered this checkout as an editable install of its own: gone with the venv
run rm -rf "$BUILD" "$CHECK"
if [ -z "${WHEELHOUSE_TMP:-}" ]; then run rm -rf "$TMP"; fi
echo "wheelhouse: done. On a compute node: pip install --no-index --find-links $WHEEL_DIR -c $WHEEL_DIR/constraints.txt -e ."
