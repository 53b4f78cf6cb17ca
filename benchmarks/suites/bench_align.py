"""Stretch-and-shift alignment: recovery rate and speed of densematch.align against the usual recipe.

Run: python benchmarks/suites/bench_align.py [--cases 300] [--baseline-cases 60] [--batch 32] [--seed 0]

Cases (densematch.app.synthetic.alignment_cases): crops of scikit-image's bundled photographs and
unions of random ellipses (binary masks), sizes 100/125, 64x80/80x100 and 90x120/120x150,
scales uniform in [0.82, 1.18] per axis, fractional shifts anywhere the template fits, half
with Gaussian noise of sigma 0.02. Recovered: every scale within 0.005 and every shift within
0.5 px ("strict"); the brief's looser bar for the baseline is 0.015 and 1.5 px ("loose").
A failure is "unidentifiable" when the template fits the answer found at least as well as the
truth (by L1): no search could tell them apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import densematch
from _common import machine, save, table
from densematch.alignment.warp import warp_batch as _warp
from densematch.app.recipes import coarse_to_fine_align
from densematch.app.synthetic import alignment_cases


def errors(found: tuple[float, ...], case) -> tuple[float, ...]:
    truth = (case.scale_h, case.scale_w, case.shift_y, case.shift_x)
    return tuple(abs(a - b) for a, b in zip(found, truth, strict=True))


def recovered(e: tuple[float, ...], scale_tol: float, shift_tol: float) -> bool:
    return e[0] <= scale_tol and e[1] <= scale_tol and e[2] <= shift_tol and e[3] <= shift_tol


def l1_at(case, params: tuple[float, ...]) -> float:
    t, x = case.template[None, None], case.image[None, None]
    w = _warp(x, *(torch.tensor([float(v)]) for v in params), t.shape[-2:])
    return (w - t).abs().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--baseline-cases", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows, fails = [], []

    cases = list(alignment_cases(args.cases, seed=args.seed))
    strict = loose = unidentifiable = 0
    times: dict[str, list[float]] = {}
    for i, c in enumerate(cases):
        t, x = c.template.to(dev), c.image.to(dev)
        if i == 0:
            densematch.align(t, x)  # warm-up
        t0 = time.perf_counter()
        a = densematch.align(t, x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        size = "x".join(map(str, c.template.shape)) + "/" + "x".join(map(str, c.image.shape))
        times.setdefault(size, []).append(time.perf_counter() - t0)
        found = (a.scale_h, a.scale_w, a.shift_y, a.shift_x)
        e = errors(found, c)
        strict += recovered(e, 0.005, 0.5)
        loose += recovered(e, 0.015, 1.5)
        if not recovered(e, 0.005, 0.5):
            truth_err = l1_at(c, (c.scale_h, c.scale_w, c.shift_y, c.shift_x))
            unident = a.error <= truth_err + 1e-6
            unidentifiable += unident
            fails.append(
                {
                    "case": i,
                    "source": c.source,
                    "noise": c.noise,
                    "size": size,
                    "errors": [round(v, 4) for v in e],
                    "found_l1": round(a.error, 5),
                    "truth_l1": round(truth_err, 5),
                    "unidentifiable": unident,
                }
            )
    n = len(cases)
    rows.append(
        {
            "method": "densematch.align",
            "cases": n,
            "strict": f"{strict}/{n} ({100 * strict / n:.1f}%)",
            "loose": f"{loose}/{n} ({100 * loose / n:.1f}%)",
            **{f"median_ms {k}": round(1e3 * statistics.median(v), 1) for k, v in times.items()},
        }
    )
    print(rows[-1], flush=True)

    bcases = cases[: args.baseline_cases]
    strict_b = loose_b = 0
    times_b: dict[str, list[float]] = {}
    for c in bcases:
        t0 = time.perf_counter()
        found = coarse_to_fine_align(c.template, c.image)
        size = "x".join(map(str, c.template.shape)) + "/" + "x".join(map(str, c.image.shape))
        times_b.setdefault(size, []).append(time.perf_counter() - t0)
        e = errors(found, c)
        strict_b += recovered(e, 0.005, 0.5)
        loose_b += recovered(e, 0.015, 1.5)
    nb = len(bcases)
    rows.append(
        {
            "method": "baseline recipe",
            "cases": nb,
            "strict": f"{strict_b}/{nb} ({100 * strict_b / nb:.1f}%)",
            "loose": f"{loose_b}/{nb} ({100 * loose_b / nb:.1f}%)",
            **{f"median_ms {k}": round(1e3 * statistics.median(v), 1) for k, v in times_b.items()},
        }
    )
    print(rows[-1], flush=True)

    # batched against separate calls, 100x100 into 125x125
    bc = list(alignment_cases(args.batch, seed=args.seed + 1, sizes=(((100, 100), (125, 125)),)))
    tb = torch.stack([c.template for c in bc]).to(dev)
    xb = torch.stack([c.image for c in bc]).to(dev)
    densematch.align(tb[:2], xb[:2])
    batch_t, sep_t = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        a = densematch.align(tb, xb)
        batch_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(len(bc)):
            densematch.align(tb[i], xb[i])
        sep_t.append(time.perf_counter() - t0)
    ok = sum(
        recovered(
            errors((a.scale_h[i].item(), a.scale_w[i].item(), a.shift_y[i].item(), a.shift_x[i].item()), c), 0.005, 0.5
        )
        for i, c in enumerate(bc)
    )
    batch = {
        "pairs": len(bc),
        "batched_pairs_per_s": round(len(bc) / statistics.median(batch_t), 1),
        "separate_pairs_per_s": round(len(bc) / statistics.median(sep_t), 1),
        "batched_recovered": ok,
    }
    print(batch, flush=True)

    info = machine()
    path = save(
        f"align-{args.device}",
        {
            "machine": info,
            "command": " ".join(sys.argv),
            "rows": rows,
            "batch": batch,
            "failures": fails,
            "unidentifiable": unidentifiable,
        },
    )
    print(f"\nmachine: {info}\n")
    cols = sorted({k for r in rows for k in r}, key=lambda k: (not k.startswith("method"), k))
    print(table(rows, cols))
    print(f"\nbatched: {batch}")
    print(f"failures ({len(fails)}, of which {unidentifiable} unidentifiable):")
    for f in fails:
        print(f"  {f}")
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
