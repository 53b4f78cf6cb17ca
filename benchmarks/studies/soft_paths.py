"""The plain softmax's forward + backward on a CPU: the tiles' forward with torch's flash
backward ("flash") against the tiles' own backward ("tiles"; ``densematch.matching.soft._SDPA``
switched) and the dense recipe, in one process, alternating: the figures behind
``soft._FUSED_WIDTH``.

Run: python benchmarks/studies/soft_paths.py [--sides 64 96] [--channels 64 128 256] [--rounds 3]

Random features, temperature 0.1, one thread; prints the median ms of each path after a warm-up
round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import densematch
import densematch.matching.soft as soft


def run(path: str, a: torch.Tensor, b: torch.Tensor, positions: torch.Tensor) -> None:
    """One forward + backward of ``path``: "flash", "tiles" or "dense"."""
    x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
    if path == "dense":
        c = a.shape[-1]
        q, k = F.normalize(x.reshape(-1, c), dim=1), F.normalize(y.reshape(-1, c), dim=1)
        ((q @ k.T / 0.1).softmax(1) @ positions).sum().backward()
        return
    soft._SDPA = path == "flash"
    densematch.soft_match(x, y, temperature=0.1).coords.sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sides", type=int, nargs="+", default=[64, 96])
    ap.add_argument("--channels", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    for side in args.sides:
        grid = torch.meshgrid(torch.arange(side * 1.0), torch.arange(side * 1.0), indexing="ij")
        positions = torch.stack(grid, -1).reshape(-1, 2)
        for c in args.channels:
            a, b = (torch.randn(side, side, c, generator=g) for _ in range(2))

            times: dict[str, list[float]] = {}
            for r in range(args.rounds + 1):
                for path in ("flash", "tiles", "dense"):
                    t0 = time.perf_counter()
                    run(path, a, b, positions)
                    if r:  # the first round warms up
                        times.setdefault(path, []).append(time.perf_counter() - t0)
            soft._SDPA = True
            print(side, c, {k: round(statistics.median(v) * 1e3) for k, v in times.items()}, flush=True)


if __name__ == "__main__":
    main()
