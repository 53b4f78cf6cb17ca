"""What a fresh process pays for each public function's first call, against its second, for one
or more densematch source trees side by side (each call in its own process, the trees alternated
round by round).

Run: python benchmarks/suites/first_call.py SRC [SRC ...] [--labels A,B] [--rounds 5]

SRC is a src/ folder: this checkout's, or an earlier revision's (``git worktree add DIR REV``,
then DIR/src). Each process imports torch, then densematch (timed), then calls one function twice
on small inputs (timed each), and reports whether torch._dynamo was imported on the way.
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

CALLS = {
    "match": "densematch.match(a, b, mutual=True)",
    "pairwise_distance + backward": "densematch.pairwise_distance(a, p).sum().backward()",
    "nearest_prototype": "densematch.nearest_prototype(a, p)",
    "soft_match": "densematch.soft_match(a, b, mode='dual_softmax')",
    "local_cost_volume": "densematch.local_cost_volume(a, b, 3)",
}


def child(src: str, function: str) -> None:
    sys.path.insert(0, src)
    import torch

    started = time.perf_counter()
    import densematch

    imported = time.perf_counter() - started
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1, 32, 48, 48, generator=g), torch.randn(1, 32, 48, 48, generator=g)
    p = torch.randn(16, 32, generator=g, requires_grad=True)
    scope = {"densematch": densematch, "a": a, "b": b, "p": p}
    times = []
    for _ in range(2):
        started = time.perf_counter()
        exec(CALLS[function], scope)
        times.append(time.perf_counter() - started)
    dynamo = "torch._dynamo" in sys.modules
    print(json.dumps({"import_s": imported, "first_s": times[0], "second_s": times[1], "dynamo": dynamo}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("srcs", nargs="+")
    p.add_argument("--labels")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--function", choices=sorted(CALLS), help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.srcs[0], args.function)
        return
    rows = []
    for name in CALLS:
        runs = alternate_trees(__file__, args.srcs, args.labels, args.rounds, ["--function", name])
        for tree, got in runs.items():
            med = {key: statistics.median(r[key] for r in got) for key in ("import_s", "first_s", "second_s")}
            rows.append({
                "tree": tree,
                "function": name,
                **{key: round(value, 3) for key, value in med.items()},
                "first_minus_second_s": round(statistics.median(r["first_s"] - r["second_s"] for r in got), 3),
                "dynamo": all(r["dynamo"] for r in got),
            })  # fmt: skip
    report("first-call", rows)


if __name__ == "__main__":
    main()
