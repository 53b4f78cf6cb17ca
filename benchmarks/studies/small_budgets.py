"""match under small memory budgets, for one or more densematch source trees side by side: each
tree in its own process, the trees alternated round by round, the median of the rounds.

Run: python benchmarks/studies/small_budgets.py SRC [SRC ...] [--labels A,B] [--rounds 3]

SRC is a src/ folder (``git worktree add DIR REV``, then DIR/src for an earlier revision). Cases:
Gaussian features of (side, side, C) against their flip, l2, k=3 (the shape of
tests/matching/test_match.py's tiny-budget test), under each memory setting; one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import alternate_trees, report

CASES = [(40, 25, "300KiB"), (40, 25, "1MiB"), (40, 25, "16MiB"), (96, 64, "1MiB"), (96, 64, "4MiB"), (96, 64, "64MiB")]


def child(src: str) -> None:
    sys.path.insert(0, src)
    import torch

    import densematch

    torch.set_num_threads(1)
    out = []
    for side, c, memory in CASES:
        f = torch.randn(side, side, c, generator=torch.Generator().manual_seed(0))
        densematch.match(f[:8, :8], f[:8, :8], metric="l2", k=3, memory=memory)  # warm-up
        started = time.perf_counter()
        densematch.match(f, f.flip(0), metric="l2", k=3, memory=memory)
        out.append(time.perf_counter() - started)
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("srcs", nargs="+")
    p.add_argument("--labels")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.srcs[0])
        return
    runs = alternate_trees(__file__, args.srcs, args.labels, args.rounds)
    rows = [
        {"case": f"{side}x{side}x{c}", "memory": memory}
        | {f"{tree} s": round(statistics.median(r[n] for r in got), 3) for tree, got in runs.items()}
        for n, (side, c, memory) in enumerate(CASES)
    ]
    report("small-budgets", rows)


if __name__ == "__main__":
    main()
