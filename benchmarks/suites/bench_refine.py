"""Sub-pixel refinement of matches: the median position error of every ``refine=`` mode on real
photographs shifted by known fractions of a pixel.

Run: python benchmarks/suites/bench_refine.py [--repeats 3]

Each case: a 100x100 crop of scikit-image's camera, blurred (Gaussian, sigma 1.5), against its
copy shifted by a fraction of a pixel with SciPy's cubic spline (another library's resampling);
7x7 patch features (C=49), cosine, k=1. Error: the Euclidean distance between the returned
position in b's grid and the truth, median over the pixels 8 or more from the border; time: the
median of the whole match call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, save

SHIFTS = ((0.3, -0.4), (-0.25, 0.15), (0.45, 0.45), (0.1, -0.05))
MODES = (None, "parabola", "soft", "features")


def main() -> None:
    import numpy as np
    from scipy.ndimage import gaussian_filter
    from scipy.ndimage import shift as spline_shift
    from skimage import data

    import densematch
    from densematch.app.features import dense_features

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="refine")
    args = p.parse_args()
    img = gaussian_filter(data.camera().astype(np.float64) / 255, 1.5)[150:250, 150:250]
    rows_, cols_ = np.meshgrid(np.arange(100), np.arange(100), indexing="ij")
    keep = np.zeros((100, 100), bool)
    keep[8:-8, 8:-8] = True
    fa = dense_features(img.astype(np.float32), "patch")
    rows = []
    for shift in SHIFTS:
        moved = spline_shift(img, shift, order=3, mode="reflect")
        fb = dense_features(moved.astype(np.float32), "patch")
        truth = np.stack([rows_ + shift[0], cols_ + shift[1]], -1)
        for mode in MODES:
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                m = densematch.match(fa, fb, refine=mode)
                times.append(time.perf_counter() - t0)
            err = np.linalg.norm(m.coords.double().numpy() - truth, axis=-1)[keep]
            rows.append(
                {
                    "shift": shift,
                    "refine": mode or "none (integer)",
                    "median_px": float(np.median(err)),
                    "p90_px": float(np.percentile(err, 90)),
                    "median_s": statistics.median(times),
                }
            )
            print(rows[-1], flush=True)
    info = machine()
    saved = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\nsaved {saved}\n")
    print("| shift (rows, cols) | refine | median error px | 90th percentile px | median s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shift']} | {r['refine']} | {r['median_px']:.3f} | {r['p90_px']:.3f} | {r['median_s']:.3f} |")


if __name__ == "__main__":
    main()
