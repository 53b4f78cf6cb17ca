"""One short GPU run that checks and times everything (for a session that is lent a GPU).

Run: python benchmarks/gpu.py [--device cuda] [--small]   (--small --device cpu smoke-tests it)

Checks first (CUDA answers against the CPU's), then times, each side by side in one run:
- match: 160x160x64, 80x80x384 and 800x800x64 (cosine) against the blockwise loop; peak memory
  under memory="1GiB" from torch.cuda.max_memory_allocated;
- pairwise_distance l2 / l1, forward and forward+backward, against torch.cdist;
- align: one 100x100-into-125x125 pair (target < 5 ms) and a batch of 256 (target > 2000 pairs/s).
Writes benchmarks/results/gpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import densematch
from _common import machine, save, table, timeit
from densematch.demo import blockwise_argmax
from densematch.synthetic import alignment_cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    rows: list[dict] = []
    checks: dict[str, bool] = {}
    g = torch.Generator().manual_seed(0)

    # correctness on the device against the CPU
    a, b = torch.randn(40, 50, 32, generator=g), torch.randn(45, 41, 32, generator=g)
    for metric in ("cosine", "l2", "l1"):
        ref = densematch.match(a, b, metric=metric, k=3)
        got = densematch.match(a.to(dev), b.to(dev), metric=metric, k=3, memory="2MiB")
        checks[f"match {metric}"] = bool(torch.allclose(got.score.cpu(), ref.score, atol=1e-4))
    x, p = torch.randn(2, 16, 20, 20, generator=g), torch.randn(30, 16, generator=g)
    for metric in ("l2", "l1", "cosine"):
        ref = densematch.pairwise_distance(x, p, metric)
        got = densematch.pairwise_distance(x.to(dev), p.to(dev), metric)
        checks[f"distance {metric}"] = bool(torch.allclose(got.cpu(), ref, atol=1e-4))
    case = next(alignment_cases(1, seed=0, sizes=(((100, 100), (125, 125)),)))
    al = densematch.align(case.template.to(dev), case.image.to(dev))
    checks["align"] = abs(al.scale_h - case.scale_h) < 0.005 and abs(al.shift_x - case.shift_x) < 0.5
    print("checks:", checks, flush=True)

    sizes = [(64, 64, 64)] if args.small else [(160, 160, 64), (80, 80, 384), (800, 800, 64)]
    for h, w, c in sizes:
        fa = torch.randn(h, w, c, device=dev)
        fb = torch.randn(h, w, c, device=dev)
        flops = 2 * (h * w) ** 2 * c
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t = timeit(lambda fa=fa, fb=fb: densematch.match(fa, fb, memory="1GiB"), repeats=3)
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
        rows.append(
            {
                "job": f"match {h}x{w}x{c}",
                "method": "densematch",
                "median_s": round(t["median"], 4),
                "tflops": round(flops / t["median"] / 1e12, 2),
                "peak_mib": round(peak, 1),
            }
        )
        if h * w <= 160 * 160:
            t2 = timeit(lambda fa=fa, fb=fb: blockwise_argmax(fa, fb), repeats=3)
            rows.append(
                {
                    "job": f"match {h}x{w}x{c}",
                    "method": "blockwise",
                    "median_s": round(t2["median"], 4),
                    "tflops": round(flops / t2["median"] / 1e12, 2),
                }
            )
        print(rows[-1], flush=True)

    n, d, hw, f = (2, 32, 32, 64) if args.small else (8, 128, 96, 512)
    xd = torch.randn(n, d, hw, hw, device=dev, requires_grad=True)
    pd = torch.randn(f, d, device=dev, requires_grad=True)
    for metric, order in (("l2", 2.0), ("l1", 1.0)):
        for name, fn in (
            ("densematch", lambda m=metric: densematch.pairwise_distance(xd, pd, m, check_finite=False)),
            ("torch.cdist", lambda o=order: torch.cdist(xd.flatten(2).transpose(1, 2), pd, p=o)),
        ):
            fwd = timeit(lambda fn=fn: fn().detach(), repeats=5)
            both = timeit(lambda fn=fn: fn().sum().backward(), repeats=3)
            rows.append(
                {
                    "job": f"distance {metric} N={n} D={d} {hw}x{hw} F={f}",
                    "method": name,
                    "median_s": round(fwd["median"], 4),
                    "fwd+bwd_s": round(both["median"], 4),
                }
            )
            print(rows[-1], flush=True)

    t = timeit(lambda: densematch.align(case.template.to(dev), case.image.to(dev)), repeats=10)
    rows.append({"job": "align 1 pair 100/125", "method": "densematch", "median_s": round(t["median"], 5)})
    nb = 16 if args.small else 256
    bc = list(alignment_cases(nb, seed=1, sizes=(((100, 100), (125, 125)),)))
    tb = torch.stack([c.template for c in bc]).to(dev)
    xb = torch.stack([c.image for c in bc]).to(dev)
    t = timeit(lambda: densematch.align(tb, xb), repeats=3)
    rows.append(
        {
            "job": f"align batch of {nb}",
            "method": "densematch",
            "median_s": round(t["median"], 4),
            "pairs_per_s": round(nb / t["median"], 1),
        }
    )
    print(rows[-1], flush=True)

    info = machine()
    path = save(
        "gpu" if cuda else "gpu-smoke-cpu",
        {"machine": info, "command": " ".join(sys.argv), "checks": checks, "rows": rows},
    )
    print(f"\nmachine: {info}\nchecks: {checks}\n")
    print(table(rows, ["job", "method", "median_s", "fwd+bwd_s", "tflops", "peak_mib", "pairs_per_s"]))
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
