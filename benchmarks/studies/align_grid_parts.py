"""align's grid search, part by part: the C kernels against the torch code they replace, per pair.

Run: python benchmarks/studies/align_grid_parts.py [--pairs 16] [--rounds 5] [--name NAME]

The coarse level of a 100x100 template in a 125x125 image (25x25 in 31x31, 9 x 9 scale pairs, the
default range), random values, one thread, one call for all the pairs as align makes it: the cross
term (``_cross_by_products`` against ``native.align_cross``), the window moments in torch, the whole
score in torch (``_shift_scores`` without taps: the products, the moments and the arithmetic) against
C's one pass (``native.align_scores``, the cross term included), and the best shifts per scale pair
(``_best_shifts`` in torch and in C). Alternated, medians of the rounds, in ms per pair.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import report
from densematch.alignment.search import _best_shifts, _cross_by_products, _shift_scores, _window_moments, scale_grid
from densematch.alignment.warp import bilinear_taps, sampling_matrix
from densematch.kernels import native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="align-grid-parts")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if native.library() is None:
        sys.exit("the C kernels are not available here: nothing to compare")
    b, (h, w), (big_h, big_w) = args.pairs, (25, 25), (31, 31)
    gen = torch.Generator().manual_seed(0)
    t, x = torch.rand(b, 1, h, w, generator=gen), torch.rand(b, 1, big_h, big_w, generator=gen)
    grid = scale_grid(0.8, 1.2, h, x.device, x.dtype)
    rows, cols = math.floor(big_h * 1.2), math.floor(big_w * 1.2)
    zeros = torch.zeros_like(grid)
    ry, rx = sampling_matrix(rows, big_h, grid, zeros), sampling_matrix(cols, big_w, grid, zeros)
    taps = bilinear_taps(cols, big_w, grid, zeros)
    shifts = (rows - h + 1, cols - w + 1)
    along_y = torch.einsum("hrH,bcHW->bchrW", ry, x).contiguous()
    ones = torch.ones(b, 1, h, w)
    score = torch.rand(b, grid.numel(), grid.numel(), *shifts, generator=gen)
    runs: dict[str, Callable[[], object]] = {
        "cross term, torch": lambda: _cross_by_products(t, along_y, rx, shifts),
        "cross term, C": lambda: native.align_cross(along_y, t, taps, shifts),
        "window moments, torch": lambda: _window_moments(along_y, rx, (h, w), shifts, False),
        "scores, torch": lambda: _shift_scores(t, x, ones, ry, rx, (0, 0), shifts, False, True, True),
        "scores, C": lambda: native.align_scores(along_y, t, taps, shifts, False),
        "best shifts, torch": lambda: _best_shifts(score),
        "best shifts, C": lambda: _best_shifts(score, True),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run()
    for _ in range(args.rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            for _ in range(5):
                run()
            times[name].append((time.perf_counter() - t0) / 5 * 1e3 / b)
    rows_out = [{"part": name, "ms per pair": f"{statistics.median(v):.3f}"} for name, v in times.items()]
    report(args.name, rows_out, times=times)


if __name__ == "__main__":
    main()
