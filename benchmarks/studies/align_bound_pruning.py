"""How much of align's search space an interval bound can rule out: the figure behind "no
certificate in milliseconds" (issue 30, part 1).

Run: python benchmarks/studies/align_bound_pruning.py [--cases 12] [--cells 2000] [--threads 1] [--name NAME]

Cases: bench_align_global's construction (100x100 templates in 125x125 photographs, scales over
0.8..1.2, noise 0.01), one per photograph. For each, align's answer and its error E* (the
default l1 objective: the mean absolute difference). A cell of parameters, each scale within
+-ds and each shift within +-dt of its centre, cannot hold a better fit when

    LB = mean over template pixels p of dist(T(p), [min, max] of the image over the pixels
         that a bilinear sample of p can touch from any parameters in the cell)

exceeds E*. The warp is separable and monotone in each parameter, so each pixel's reach is
exact: the box spanned by the cell's corners, widened to whole pixels. Cell centres are drawn
uniformly over the whole search space; the share the bound cannot rule out, times the number of
cells of that size, is how many a branch and bound must still examine at that size, each a pass
over the template's 10^4 pixels. The farthest of those cells from align's answer, per
parameter, says whether they lie in the answer's own basin (the bound is near 0 around the
truth whatever the cell size: the noise's error hides inside each pixel's range) or elsewhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import densematch
from _common import report
from densematch.alignment.certify import bilinear_range, pixel_range, sample_spans
from suites.bench_align_global import cases

SIZES = [(0.04, 4.0), (0.02, 2.0), (0.01, 1.0), (0.005, 0.5), (0.0025, 0.25), (0.00125, 0.125)]
SCALES = (0.8, 1.2)


def cell_count(big: int, small: int, ds: float, dt: float) -> float:
    """Cells of size (2 ds, 2 dt) per axis over scales 0.8..1.2 and shifts 0..big s - small."""
    a, b = SCALES
    span = big * (b * b - a * a) / 2 - small * (b - a)  # integral of (big s - small) over s
    return span / (2 * ds * 2 * dt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--cells", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--exact",
        action="store_true",
        help="the bilinear interpolant's own range over each pixel's sample box, not the range of "
        "every whole pixel a sample can touch (which stays wide however small the cell)",
    )
    ap.add_argument("--finest", type=int, default=len(SIZES), help="only the N finest cell sizes")
    ap.add_argument("--name", default="align-bound-pruning")
    args = ap.parse_args()
    sizes = SIZES[-args.finest :]
    torch.set_num_threads(args.threads)
    cs = cases(1, args.seed)[: args.cases]
    gen = torch.Generator().manual_seed(args.seed)
    left: dict[tuple[float, float], list[float]] = {size: [] for size in sizes}
    far = {size: [0.0] * 4 for size in sizes}  # farthest cell left from the answer, per parameter
    for c in cs:
        tpl, img = c["tpl"].double(), c["img"].double()
        (h, w), (big_h, big_w) = tpl.shape, img.shape
        a = densematch.align(c["tpl"], c["img"])
        answer = float((densematch.warp(img, a.scale_h, a.scale_w, a.shift_y, a.shift_x, (h, w)) - tpl).abs().mean())
        for ds, dt in sizes:
            u = torch.rand(4, args.cells, generator=gen, dtype=torch.float64)
            sh, sw = (SCALES[0] + (SCALES[1] - SCALES[0]) * u[i] for i in (0, 1))
            ty, tx = u[2] * (big_h * sh - h), u[3] * (big_w * sw - w)
            kept = []
            for part in torch.arange(args.cells).split(250 if not args.exact else 50):
                ys = sample_spans(torch.arange(h), big_h, sh[part], ty[part], ds, dt)
                xs = sample_spans(torch.arange(w), big_w, sw[part], tx[part], ds, dt)
                lo, hi = (bilinear_range if args.exact else pixel_range)(img, ys, xs)
                bound = ((lo - tpl).clamp_min(0) + (tpl - hi).clamp_min(0)).mean((1, 2))
                kept.append(part[bound <= answer])
            alive = torch.cat(kept)
            left[(ds, dt)].append(len(alive) / args.cells)
            # how far the cells left lie from the answer: its own basin, or other places
            gap = torch.stack((sh - a.scale_h, sw - a.scale_w, ty - a.shift_y, tx - a.shift_x), 1)[alive].abs()
            for i in range(4):
                far[(ds, dt)][i] = max(far[(ds, dt)][i], float(gap[:, i].max()) if len(alive) else 0.0)
        print(c["photo"], f"E*={answer:.4f}", [round(left[s][-1], 3) for s in sizes], flush=True)
    out = []
    for ds, dt in sizes:
        share = statistics.mean(left[(ds, dt)])
        n = cell_count(big_h, h, ds, dt) ** 2
        out.append(
            {
                "cell (scale +-, shift +- px)": f"{ds:g}, {dt:g}",
                "cells in the space": f"{n:.3g}",
                "share the bound cannot rule out": f"{share:.3f} ({min(left[(ds, dt)]):.3f}-{max(left[(ds, dt)]):.3f})",
                "cells left to examine": f"{share * n:.3g}",
                "pixel visits (x 10^4 each)": f"{share * n * h * w:.3g}",
                "farthest left from the answer (scale_h, scale_w, shift_y, shift_x)": ", ".join(
                    f"{v:.3g}" for v in far[(ds, dt)]
                ),
            }
        )
    report(args.name, out, per_case={f"{ds:g},{dt:g}": v for (ds, dt), v in left.items()})


if __name__ == "__main__":
    main()
