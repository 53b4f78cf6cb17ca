"""soft_match against the dense recipe (softmax of the full similarity matrix, then the weighted
positions), forward and forward+backward, and its two paths: torch's fused attention and tiles.

Run: python benchmarks/bench_soft.py [--repeats 3]

Random unit features, C=32, temperature 0.1, square maps of side 64, 96 and 128 against the same
size; median of ``repeats`` after a warm-up, all in this process (the methods alternate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine, save


def main() -> None:
    import torch

    import densematch
    from densematch import _soft

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sides", type=int, nargs="+", default=[64, 96, 128])
    p.add_argument("--name", default="soft")
    args = p.parse_args()
    rows = []
    for side in args.sides:
        g = torch.Generator().manual_seed(0)
        a0, b0 = (torch.randn(side, side, 32, generator=g) for _ in range(2))
        pos = torch.stack(torch.meshgrid(torch.arange(side * 1.0), torch.arange(side * 1.0), indexing="ij"), -1)

        def dense(a, b, pos=pos):
            q = torch.nn.functional.normalize(a.reshape(-1, 32), dim=1)
            k = torch.nn.functional.normalize(b.reshape(-1, 32), dim=1)
            return (q @ k.T / 0.1).softmax(1) @ pos.reshape(-1, 2)

        def ours(fused):
            def run(a, b):
                _soft._SDPA = fused
                return densematch.soft_match(a, b, temperature=0.1).coords

            return run

        methods = {"soft_match (fused attention)": ours(True), "soft_match (tiles)": ours(False), "dense": dense}
        times: dict[tuple[str, bool], list[float]] = {}
        for _ in range(args.repeats + 1):
            for name, fn in methods.items():
                for backward in (False, True):
                    x, y = (t.clone().requires_grad_(backward) for t in (a0, b0))
                    t0 = time.perf_counter()
                    out = fn(x, y)
                    if backward:
                        out.sum().backward()
                    times.setdefault((name, backward), []).append(time.perf_counter() - t0)
        _soft._SDPA = True
        for (name, backward), t in times.items():
            rows.append({"side": side, "method": name, "backward": backward, "median_s": statistics.median(t[1:])})
            print(rows[-1], flush=True)
    info = machine()
    saved = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\nsaved {saved}\n")
    print("| maps | method | forward s | forward + backward s |\n|---|---|---|---|")
    for side in args.sides:
        for name in ("soft_match (fused attention)", "soft_match (tiles)", "dense"):
            f, fb = (
                next(r["median_s"] for r in rows if (r["side"], r["method"], r["backward"]) == (side, name, bw))
                for bw in (False, True)
            )
            print(f"| {side}x{side} against {side}x{side} | {name} | {f:.3f} | {fb:.3f} |")


if __name__ == "__main__":
    main()
