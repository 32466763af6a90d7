"""Benchmark subfigure extraction: throughput and accuracy of ``paco.data.subfigures.split_grid``.

    python benchmarks/bench_subfigures.py [--prompts 8] [--repeats 3] [--size 1024]

Prints, for both methods (``refine``, ``equal``):

* throughput in panels/second on ``size`` x ``size`` 2x2 grids rendered by the ``photos``
  source, pinned to one CPU core where the OS allows it: box finding + cropping on decoded
  images, and the same including the PNG decode of the composite cell;
* mean IoU of the found boxes against the true ones recorded by the renderer, on 2x2 grids at
  ``size`` and on mixed layouts (2x2, 1x3, 3x1, 2x3, 3x3) at 256 px, plus after a JPEG
  round-trip (quality 85) of the mixed set.

Figures only: nothing here asserts on speed.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stages  # noqa: E402,F401  a stage process's set-up before numpy loads: fixed numerics env, hub offline
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from PIL import Image  # noqa: E402

from paco.core.io import decode_image  # noqa: E402
from paco.core.params import PhotosParams  # noqa: E402
from paco.data.photos import SUBJECTS, load_subject, render_composites  # noqa: E402
from paco.data.subfigures import box_iou, crop_panels, split_grid  # noqa: E402

METHODS = ("refine", "equal")
MIXED = [(2, 2), (1, 3), (3, 1), (2, 3), (3, 3)]


def _prompts(n: int, layouts: list[tuple[int, int]], prefix: str) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "prompt_id": [f"{prefix}{i:03d}" for i in range(n)],
            "rows": [layouts[i % len(layouts)][0] for i in range(n)],
            "cols": [layouts[i % len(layouts)][1] for i in range(n)],
        }
    )


def _pin_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to CPU {cpu}"
    return "not pinned (no sched_setaffinity)"


def _throughput(cells: list[dict], rows: int, cols: int, method: str, repeats: int) -> tuple[float, float]:
    images = [decode_image(c) for c in cells]
    n_panels = 0
    start = time.perf_counter()
    for _ in range(repeats):
        for image in images:
            n_panels += len(crop_panels(image, split_grid(image, rows, cols, method=method)))
    split_rate = n_panels / (time.perf_counter() - start)
    n_panels = 0
    start = time.perf_counter()
    for _ in range(repeats):
        for cell in cells:
            image = decode_image(cell)
            n_panels += len(crop_panels(image, split_grid(image, rows, cols, method=method)))
    full_rate = n_panels / (time.perf_counter() - start)
    return split_rate, full_rate


def _iou(df: pd.DataFrame, prompts: pd.DataFrame, method: str, jpeg: int | None = None
         ) -> tuple[float, float, float]:
    layout = prompts.set_index("prompt_id")
    ious = []
    for row in df.itertuples():
        rows, cols = (int(v) for v in layout.loc[row.prompt_id, ["rows", "cols"]])
        image = decode_image(row.image)
        if jpeg is not None:
            buf = io.BytesIO()
            image.save(buf, format="JPEG", quality=jpeg)
            image = Image.open(buf).convert("RGB")
        found = split_grid(image, rows, cols, method=method)
        ious += [box_iou(a, b) for a, b in zip(found, row.panel_bboxes, strict=True)]
    arr = np.array(ious)
    return float(arr.mean()), float(arr.min()), float((arr >= 0.95).mean())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per set (4 composites each)")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the throughput set")
    ap.add_argument("--size", type=int, default=1024, help="composite size for the 2x2 set (px)")
    args = ap.parse_args(argv)

    pinned = _pin_one_core()
    for name in SUBJECTS:
        load_subject(name)

    t0 = time.perf_counter()
    big_prompts = _prompts(args.prompts, [(2, 2)], "big")
    big = render_composites(big_prompts, PhotosParams(size=args.size), 4, seed=0)
    mixed_prompts = _prompts(max(args.prompts, 10) * 2, MIXED, "mix")
    mixed = render_composites(mixed_prompts, PhotosParams(size=256), 4, seed=0)
    print(f"rendered {len(big)} {args.size}px 2x2 + {len(mixed)} 256px mixed composites "
          f"in {time.perf_counter() - t0:.1f} s; timing {pinned}")

    cells = list(big["image"])
    print(f"\nthroughput on {len(cells)} {args.size}x{args.size} 2x2 grids x {args.repeats} passes "
          "(panels/second):")
    print(f"  {'method':<8} {'split+crop':>12} {'decode+split+crop':>19}")
    for method in METHODS:
        split_rate, full_rate = _throughput(cells, 2, 2, method, args.repeats)
        print(f"  {method:<8} {split_rate:>12.0f} {full_rate:>19.0f}")

    print("\nIoU against the true panel boxes (mean / min / share >= 0.95):")
    sets = [
        (f"{args.size}px 2x2", big, big_prompts, None),
        ("256px mixed layouts", mixed, mixed_prompts, None),
        ("256px mixed, JPEG q85", mixed, mixed_prompts, 85),
    ]
    for label, df, prompts, jpeg in sets:
        parts = []
        for method in METHODS:
            mean, lo, share = _iou(df, prompts, method, jpeg)
            parts.append(f"{method} {mean:.4f} / {lo:.3f} / {share:.1%}")
        print(f"  {label:<24} " + "   ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
