"""What one cell of certify_alignment's branch and bound costs, per path: torch's ranges
(sample_spans, pixel_range or bilinear_range, summed), certify.c's bound over every row, the
same with siblings in a row (cells sharing scale_w and shift_x share their columns' work, as
certify_alignment orders them) and the same stopped at the answer's error (its real use).

Run: python benchmarks/suites/certify_bound_parts.py [--photo rocket] [--parents 64] [--rounds 3] [--name NAME]

Cells: the 16 children of random parents over the default search space (bench_align_global's
case for ``--photo``), at three sizes: +-0.02 / +-2 px (whole pixels' range), +-0.005 / +-0.5 px
and +-0.00125 / +-0.125 px (the interpolant's exact range). One thread; microseconds per cell,
medians of ``--rounds``, the paths alternated inside each round.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import densematch
from _common import report
from densematch.alignment.certify import _row_order, bilinear_range, pixel_range, sample_spans
from densematch.kernels import native
from suites.bench_align_global import cases

SIZES = ((0.02, 2.0), (0.005, 0.5), (0.00125, 0.125))


def torch_sum(x: torch.Tensor, t: torch.Tensor, cells: torch.Tensor, half: tuple[float, ...], exact: bool) -> None:
    h, w = t.shape[-2:]
    step = 40 if exact else 200  # certify_alignment's chunks on this path
    for start in range(0, len(cells), step):
        part = cells[start : start + step]
        ys = sample_spans(torch.arange(h), x.shape[1], part[:, 0], part[:, 2], half[0], half[2])
        xs = sample_spans(torch.arange(w), x.shape[2], part[:, 1], part[:, 3], half[1], half[3])
        lo, hi = (bilinear_range if exact else pixel_range)(x[0], ys, xs)
        ((lo - t[0]).clamp_min(0) + (t[0] - hi).clamp_min(0)).sum((1, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--photo", default="rocket")
    ap.add_argument("--parents", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="certify-bound-parts")
    args = ap.parse_args()
    torch.set_num_threads(1)
    case = next(c for c in cases(1, 0) if c["photo"] == args.photo)
    t = torch.as_tensor(case["tpl"]).double()[None].contiguous()
    x = torch.as_tensor(case["img"]).double()[None].contiguous()
    a = densematch.align(case["tpl"], case["img"])
    answer = (a.scale_h, a.scale_w, a.shift_y, a.shift_x)
    error = float((densematch.warp(x[0], *answer, t.shape[-2:]) - t[0]).abs().mean())
    stop = error * t.numel()
    g = torch.Generator().manual_seed(0)
    n = args.parents
    parents = torch.cat([0.82 + 0.36 * torch.rand(n, 2, generator=g), 45 * torch.rand(n, 2, generator=g)], 1).double()
    rows = torch.arange(t.shape[-2])
    rows_varied = _row_order(t)
    rows_out = []
    for ds, dt in SIZES:
        half = (ds, ds, dt, dt)
        signs = torch.tensor([-1.0, 1.0], dtype=torch.float64)
        corners = torch.cartesian_prod(signs, signs, signs, signs)[:, [2, 0, 3, 1]]  # certify's order
        cells = (parents[:, None, :] + corners * torch.tensor(half, dtype=torch.float64)).reshape(-1, 4)
        mixed = cells[torch.randperm(len(cells), generator=g)]
        exact = dt <= 0.5

        def c_path(cells: torch.Tensor, rows: torch.Tensor, stop: float, half: tuple, exact: bool) -> None:
            native.certify_bound(x, t, cells, half, rows, exact=exact, squared=False, stop=stop)

        paths = {  # name: (function, its arguments)
            "torch, every row": (torch_sum, (x, t, cells, half, exact)),
            "C, every row, cells shuffled": (c_path, (mixed, rows, math.inf, half, exact)),
            "C, every row, siblings in a row": (c_path, (cells, rows, math.inf, half, exact)),
            "C, stopped at the answer's error": (c_path, (cells, rows_varied, stop, half, exact)),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, (fn, fn_args) in paths.items():
                t0 = time.perf_counter()
                fn(*fn_args)
                times[name].append((time.perf_counter() - t0) / len(cells) * 1e6)
        row = {"cell": f"+-{ds:g} / +-{dt:g} px", "range": "exact" if exact else "whole pixels"}
        row |= {f"{name} (us)": f"{statistics.median(v):.0f}" for name, v in times.items()}
        rows_out.append(row)
        print(row, flush=True)
    report(args.name, rows_out)


if __name__ == "__main__":
    main()
