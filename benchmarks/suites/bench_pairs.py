"""The engine's last step: the values of each query row's k chosen pairs, through the C kernel
(``native.pair_values``, rows read in place) against torch's kernels on gathered copies (what
every search ran before, and still runs where the C kernels do not: ``kernel="torch"``).

Run: python benchmarks/suites/bench_pairs.py [--rows 6400] [--k 8] [--channels 384] [--repeats 15]

One process, the two paths alternating call by call, median of ``--repeats``; the C kernel runs
on the calling thread alone, torch's operators on its intra-op pool (as on the caller's thread).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, save, table
from densematch.kernels.c_ops import C_OPS
from densematch.metrics import get_metric
from densematch.ops import TORCH_OPS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=6400)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--channels", type=int, default=384)
    p.add_argument("--metrics", nargs="+", default=["cosine", "l2", "l1"])
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(args.rows, args.channels, generator=g)
    r = torch.randn(args.rows, args.channels, generator=g)
    idx = torch.randint(0, args.rows, (args.rows, args.k), generator=g)
    rows = []
    for name in args.metrics:
        metric = get_metric(name)
        times: dict[str, list[float]] = {"C kernel": [], "torch, gathered": []}
        for _ in range(args.repeats + 1):  # the first round warms up
            for path, ops in (("C kernel", C_OPS), ("torch, gathered", TORCH_OPS)):
                t0 = time.perf_counter()
                metric.pair_values(q, r, idx, ops=ops)
                times[path].append(time.perf_counter() - t0)
        ms = {path: statistics.median(t[1:]) * 1e3 for path, t in times.items()}
        for path, value in ms.items():
            ratio = value / ms["C kernel"]
            rows.append({"metric": name, "path": path, "median_ms": round(value, 2), "ratio": round(ratio, 2)})
    info = machine()
    command = " ".join(sys.argv)
    save("pairs", {"machine": info, "command": command, "args": vars(args), "rows": rows})
    print(f"machine: {info}\n{args.rows} rows x {args.k} pairs, C={args.channels}\n")
    print(table(rows, ["metric", "path", "median_ms", "ratio"]))


if __name__ == "__main__":
    main()
