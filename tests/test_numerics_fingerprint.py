"""``benchmarks/numerics_fingerprint.py``: its kernel hashes are the same run to run in a stage
process's numerics, and ``--compare`` names what differs from another record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "numerics_fingerprint.py"


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_kernel_hashes_repeat_and_compare_names_a_difference(tmp_path: Path) -> None:
    first = tmp_path / "first.json"
    _run("--out", str(first))
    record = json.loads(first.read_text())
    kernels = record["kernels"]
    # every kind of library the stages compute with has entries
    for prefix in ("mkl.", "onednn.", "torch.", "numpy.", "openblas.", "scipy.", "pillow.", "skimage."):
        assert any(k.startswith(prefix) for k in kernels), prefix
    assert record["host"]["versions"]["torch"] and record["host"]["env"]["MKL_CBWR"] == "COMPATIBLE"
    # another host's record, made up: one kernel's bytes differ
    planted = "onednn.conv3d_patch[64x3x2x14x14]"
    other = json.loads(first.read_text())
    other["kernels"][planted] = "0" * 16
    other["host"]["versions"]["numpy"] = "0.0"
    (tmp_path / "other.json").write_text(json.dumps(other))
    second = tmp_path / "second.json"
    out = _run("--out", str(second), "--compare", str(tmp_path / "other.json"))
    assert json.loads(second.read_text())["kernels"] == kernels  # the same bytes run to run
    n = len(kernels)
    assert f"kernels: {n - 1} of {n} shared entries match" in out
    assert f"differs: {planted}" in out
    assert "'numpy': (" in out and "'0.0')" in out
