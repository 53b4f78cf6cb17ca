"""An offline certificate for align's answers: a branch and bound over the whole search space
that shows no fit better than align's lies outside the answer's own neighbourhood.

Run: python benchmarks/align_certify.py [--cases 12] [--budget 300] [--threads 1] [--name NAME]

Cases: bench_align_global's (100x100 templates in 125x125 photographs, scales over 0.8..1.2, noise
0.01), one per photograph. For each, align's answer a and its l1 error E* (the default objective,
in float64). The space is every (scale_h, scale_w) in 0.8..1.2 and every shift that keeps the
template inside the stretched image. Cells of scale +-ds and shift +-dt start at 0.02 and 2 px;
a cell is

- ruled out when its lower bound on the l1 error exceeds E*: the mean over template pixels of
  the distance from T(p) to the range of the image's bilinear interpolant over the box of
  positions p samples from the cell (the range of every whole pixel it can touch while the cell
  spans more than a pixel, cheaper and wider; the interpolant's exact range once it spans less:
  see align_bound_pruning.py). A sum over some of the rows is already a lower bound, so every
  fourth row is summed first and most cells stop there;
- accepted when it lies inside the answer's neighbourhood: each scale within 0.015 of a's, each
  shift within 1.5 px (bench_align's "loose" tolerance; with the strict one, 0.005 and 0.5 px,
  cells on the rim of the answer's own basin, where the error rises only as fast as the noise
  lets it, stay: 401 of them, all within 0.0072 and 0.54 px, for the astronaut);
- otherwise split in 16 (both scales and both shifts halved), down to +-0.0003 and +-0.03 px.

Certified: no cell is left, so no fit better than align's lies farther than the neighbourhood
from it (within it, the refinement's own convergence speaks). Otherwise the cells left (fits
the bound cannot rule out, so possibly better than a, at most that far from it), or the time
budget ran out. The cost is the point: a
certificate is an offline check, not part of a call (BENCHMARKS.md, "Could align certify its
answer?").
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import densematch
from _common import machine, save, table
from align_bound_pruning import bilinear_range, box_range
from bench_align_global import cases

SCALES = (0.8, 1.2)
ROOT = (0.02, 2.0)  # the first cells' half sizes: scale, shift (px)
FINEST = (0.0003, 0.03)
NEAR = (0.015, 1.5)  # the answer's neighbourhood: bench_align's loose tolerance
Span = tuple[torch.Tensor, torch.Tensor]


def spans(idx: torch.Tensor, n_in: int, s: torch.Tensor, t: torch.Tensor, ds: float, dt: float) -> Span:
    """Per cell (M,) and output pixel c in ``idx``: the interval of input coordinates its sample
    takes over the cell (monotone in scale and shift, so two corners give it), clamped."""
    c = idx.to(torch.float64)
    lo = ((c + (t - dt)[:, None] + 0.5) / (s + ds)[:, None] - 0.5).clamp(0, n_in - 1)
    hi = ((c + (t + dt)[:, None] + 0.5) / (s - ds)[:, None] - 0.5).clamp(0, n_in - 1)
    return lo, hi


def whole_pixels(span: Span, n_in: int) -> Span:
    """The first whole input pixel a span's samples touch and how many (box_range's form)."""
    lo, hi = span
    first = lo.floor()
    last = hi.ceil().clamp(max=n_in - 1)
    return first.long(), (last - first).long() + 1


def bound_sum(
    tpl: torch.Tensor, img: torch.Tensor, cells: torch.Tensor, size: tuple[float, float], rows: torch.Tensor
) -> torch.Tensor:
    """(M,) sums over the template's ``rows`` (all columns) of each pixel's distance to its
    range over the cell: divided by h w, a lower bound on the cell's l1 error."""
    w, (big_h, big_w) = tpl.shape[1], img.shape
    ds, dt = size
    sh, sw, ty, tx = cells.unbind(1)
    ys = spans(rows, big_h, sh, ty, ds, dt)
    xs = spans(torch.arange(w), big_w, sw, tx, ds, dt)
    if dt > 0.5:  # the sample boxes span a few pixels: whole pixels' ranges
        lo, hi = box_range(img, whole_pixels(ys, big_h), whole_pixels(xs, big_w))
    else:
        lo, hi = bilinear_range(img, ys, xs)
    t = tpl[rows]
    return ((lo - t).clamp_min(0) + (t - hi).clamp_min(0)).sum((1, 2))


def certify(tpl: torch.Tensor, img: torch.Tensor, answer: tuple[float, ...], budget: float) -> dict:
    (h, w), (big_h, big_w) = tpl.shape, img.shape
    t0 = time.perf_counter()
    err = float((densematch.warp(img, *answer, (h, w)) - tpl).abs().mean())
    line = err * (1 + 1e-9)  # a bound must clear E* by more than float64 rounding to rule a cell out
    a = torch.tensor(answer, dtype=torch.float64)
    ds, dt = ROOT
    n_s = round((SCALES[1] - SCALES[0]) / (2 * ds))
    scales = SCALES[0] + ds * (2 * torch.arange(n_s, dtype=torch.float64) + 1)
    shifts_y = dt * (2 * torch.arange(int((big_h * SCALES[1] - h) / (2 * dt)) + 1, dtype=torch.float64) + 1)
    shifts_x = dt * (2 * torch.arange(int((big_w * SCALES[1] - w) / (2 * dt)) + 1, dtype=torch.float64) + 1)
    cells = torch.cartesian_prod(scales, scales, shifts_y, shifts_x)
    sparse, dense = torch.arange(0, h, 4), torch.tensor([r for r in range(h) if r % 4])
    examined, level_counts = 0, []

    def done(verdict: str) -> dict:
        seconds = time.perf_counter() - t0
        return {"certified": verdict, "cells examined": examined, "levels": level_counts, "seconds": seconds}

    while True:
        sh, sw, ty, tx = cells.unbind(1)
        valid = (ty - dt <= big_h * (sh + ds) - h) & (tx - dt <= big_w * (sw + ds) - w)
        gap = (cells - a).abs() + torch.tensor([ds, ds, dt, dt], dtype=torch.float64)
        inside = (gap[:, :2] <= NEAR[0]).all(1) & (gap[:, 2:] <= NEAR[1]).all(1)
        cells = cells[valid & ~inside]
        kept = []
        step = 40 if dt <= 0.5 else 200
        for part in cells.split(step):
            low = bound_sum(tpl, img, part, (ds, dt), sparse) / (h * w)
            maybe = part[low <= line]
            if len(maybe):  # the rest of the rows for the cells every fourth one did not rule out
                low = low[low <= line] + bound_sum(tpl, img, maybe, (ds, dt), dense) / (h * w)
                kept.append(maybe[low <= line])
            if time.perf_counter() - t0 > budget:
                return done("no: out of time")
        examined += len(cells)
        cells = torch.cat(kept) if kept else cells[:0]
        level_counts.append(len(cells))
        if not len(cells):
            return done("yes")
        if ds / 2 < FINEST[0]:
            far = ", ".join(f"{v:.4g}" for v in (cells - a).abs().amax(0).tolist())
            return done(f"no: {len(cells)} cells left, up to ({far}) away")
        ds, dt = ds / 2, dt / 2
        offsets = torch.cartesian_prod(*[torch.tensor([-1.0, 1.0], dtype=torch.float64)] * 4)
        cells = (cells[:, None, :] + offsets * torch.tensor([ds, ds, dt, dt], dtype=torch.float64)).reshape(-1, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=12)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds per case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="align-certify")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for c in cases(1, args.seed)[: args.cases]:
        a = densematch.align(c["tpl"], c["img"])
        answer = (a.scale_h, a.scale_w, a.shift_y, a.shift_x)
        got = certify(c["tpl"].double(), c["img"].double(), answer, args.budget)
        rows.append({"photo": c["photo"], **got, "seconds": f"{got['seconds']:.0f}", "levels": str(got["levels"])})
        print(rows[-1], flush=True)
    info = machine()
    path = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"machine: {info}\n")
    print(table(rows, list(rows[0])))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
