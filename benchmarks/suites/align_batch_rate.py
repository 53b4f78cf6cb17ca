"""align's throughput on one large batch: pairs per second of one ``densematch.align`` call.

Run: python benchmarks/suites/align_batch_rate.py [--pairs 256] [--threads 2] [--repeats 3]

Cases: densematch.app.synthetic.alignment_cases, 100x100 templates in 125x125 images (photos and
masks, half with noise), seed 1. The median over the repeats of one call on all pairs; "strict":
every scale within 0.005 and every shift within 0.5 px of the truth (issue 41, goal 4: at least
1,000 pairs/s at 2 threads).
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
from _common import machine, save
from densematch.app.synthetic import alignment_cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="align-batch-rate")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = list(alignment_cases(args.pairs, seed=1, sizes=(((100, 100), (125, 125)),)))
    t = torch.stack([torch.as_tensor(c.template) for c in cases])
    x = torch.stack([torch.as_tensor(c.image) for c in cases])
    densematch.align(t[:4], x[:4])  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        a = densematch.align(t, x)
        times.append(time.perf_counter() - t0)
    strict = sum(
        abs(float(a.scale_h[i]) - c.scale_h) <= 0.005
        and abs(float(a.scale_w[i]) - c.scale_w) <= 0.005
        and abs(float(a.shift_y[i]) - c.shift_y) <= 0.5
        and abs(float(a.shift_x[i]) - c.shift_x) <= 0.5
        for i, c in enumerate(cases)
    )
    row = {
        "pairs": args.pairs,
        "threads": args.threads,
        "pairs_per_s": round(args.pairs / statistics.median(times), 1),
        "seconds": [round(s, 3) for s in times],
        "strict": f"{strict}/{args.pairs}",
    }
    print(row)
    save(args.name, {"machine": machine(), "row": row})


if __name__ == "__main__":
    main()
