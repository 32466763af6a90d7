"""Benchmark: what the reward-hacking monitors (paco.grpo.monitors) cost per panel, by panel size.

    python benchmarks/bench_monitors.py [--sizes 128 512 1024] [--repeats 5]

Prints, per square panel side, the median and min/max milliseconds of the grid artifact score at
16 px and at 2 px, the high-frequency share, and a 2x2 composite's panel similarity and an edit's
input SSIM, on a photograph shipped with scikit-image (no network).
"""

from __future__ import annotations

import argparse
import statistics
import time

import stages  # noqa: F401  (the numerics environment, before numpy)

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from skimage import data as skdata  # noqa: E402

from paco.grpo.monitors import grid_artifact_score, high_frequency_share, input_ssim, panel_similarity  # noqa: E402


def timed_ms(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - t0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    photo = Image.fromarray(skdata.astronaut())
    for side in args.sizes:
        panel = photo.resize((side, side), Image.Resampling.BICUBIC)
        grey = np.asarray(panel.convert("L"), dtype=np.float64) / 255
        other = panel.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        cases = {
            "grid_artifact (16 px)": lambda: grid_artifact_score(grey, 16),
            "grid_artifact_2px": lambda: grid_artifact_score(grey, 2),
            "high_frequency": lambda: high_frequency_share(grey),
            "panel_similarity (2x2)": lambda: panel_similarity([panel, other, panel, other]),
            "input_ssim": lambda: input_ssim(panel, other),
        }
        for name, fn in cases.items():
            ms = timed_ms(fn, args.repeats)
            print(f"{side:5d} px  {name:24s} median {statistics.median(ms):8.2f} ms  (min {min(ms):.2f}, "
                  f"max {max(ms):.2f}, n={len(ms)})")


if __name__ == "__main__":
    main()
