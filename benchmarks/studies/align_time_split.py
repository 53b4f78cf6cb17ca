"""Where one align call's time goes: the C search (native.align_search, from the pyramid to the
warp) against the Python around it (checks, the level rule, the plan, the result), per pair.

Run: python benchmarks/studies/align_time_split.py [SRC ...] [--labels A,B] [--rounds 3] [--seed 0] [--name NAME]

bench_align_global's photographs (100x100 templates in 125x125, one thread), each align call
timed whole and its call of C timed inside it (the binding wrapped for the run); medians over the
cases of each case's median over the rounds, in ms. With several source trees (``OLD/src NEW/src``)
each runs in its own process, in turn, ``--rounds`` times over: the same cases, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import alternate_trees, machine, save, table


def child(src: str, seed: int, rounds: int) -> dict[str, float]:
    sys.path.insert(0, os.path.abspath(src))
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "suites"))
    from bench_align_global import cases

    import densematch
    from densematch.kernels import native

    if native.library() is None:
        sys.exit("the C kernels are not available here: align's search runs in torch")
    inner: list[float] = []
    search = native.align_search

    def timed(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        out = search(*args, **kwargs)
        inner.append(time.perf_counter() - t0)
        return out

    native.align_search = timed
    cs = cases(4, seed)
    densematch.align(cs[0]["tpl"], cs[0]["img"])  # warm-up
    whole: list[list[float]] = [[] for _ in cs]
    in_c: list[list[float]] = [[] for _ in cs]
    for _ in range(rounds):
        for i, c in enumerate(cs):
            t0 = time.perf_counter()
            densematch.align(c["tpl"], c["img"])
            whole[i].append(time.perf_counter() - t0)
            in_c[i].append(inner[-1])
    total = statistics.median(statistics.median(v) for v in whole)
    c_part = statistics.median(statistics.median(v) for v in in_c)
    return {
        "align ms": round(1e3 * total, 3),
        "C search ms": round(1e3 * c_part, 3),
        "rest ms": round(1e3 * (total - c_part), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("srcs", nargs="*", default=["src"])
    ap.add_argument("--labels")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="align-time-split")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.srcs[0], args.seed, 3)))
        return
    runs = alternate_trees(__file__, args.srcs, args.labels, args.rounds, ["--seed", str(args.seed)])
    rows = [{"tree": tree, "turn": turn + 1, **got} for tree, each in runs.items() for turn, got in enumerate(each)]
    info = machine()
    path = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"machine: {info}\n")
    print(table(rows, ["tree", "turn", "align ms", "C search ms", "rest ms"]))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
