"""align's batch ratio of several densematch source trees, side by side: each tree in its own
process, the trees alternated round by round, so that a busy spell hits them alike.

Run: python benchmarks/studies/align_batch_side_by_side.py SRC [SRC ...] [--labels A,B] [--rounds 3] [--name NAME]

SRC is a src/ folder: this checkout's, or an earlier revision's from
``git archive REV src | tar -x -C DIR``. The pairs are bench_align_global's (100x100 templates in
125x125 photographs, 4 per photograph: the first 32), one thread. Per round and tree, five times
over after a warm-up, interleaved: the time per pair of one call per pair (a sweep over the 32),
of one batched call of 16 pairs (the batch runner's chunk) and of one of 32. Each is the median
of the five; each ratio is the median of the five sweeps' time over the batch's beside it. The
trees' C kernels are built on first use, each from its own source.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/


def measure(src: str) -> dict[str, float]:
    """One round in this process, for the tree at ``src`` (first on sys.path)."""
    sys.path.insert(0, src)
    sys.path.insert(1, HERE)
    import torch

    import densematch
    from suites.bench_align_global import cases

    torch.set_num_threads(1)
    pairs = cases(4, 0)[:32]
    tpl = torch.stack([c["tpl"] for c in pairs])
    img = torch.stack([c["img"] for c in pairs])

    def batch(n: int) -> None:
        densematch.align(tpl[:n], img[:n])

    def each() -> None:
        for c in pairs:
            densematch.align(c["tpl"], c["img"])

    runs = {"single": (each, len(pairs)), "batch 16": (lambda: batch(16), 16), "batch 32": (lambda: batch(32), 32)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(6):  # interleaved, so that a slow spell slows all three alike
        for name, (run, n) in runs.items():
            t0 = time.perf_counter()
            run()
            if repeat:  # the first is a warm-up
                times[name].append((time.perf_counter() - t0) * 1e3 / n)
    out = {f"{name} ms": statistics.median(t) for name, t in times.items()}
    for n in (16, 32):  # each repeat's own ratio, then their median
        out[f"ratio {n}"] = statistics.median(a / b for a, b in zip(times["single"], times[f"batch {n}"], strict=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", nargs="+")
    ap.add_argument("--labels", help="comma-separated names of the trees, for the table (default: tree 1, ...)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="align-batch-side-by-side")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.src[0])))
        return
    sys.path.insert(0, HERE)
    from _common import alternate_trees, report

    rounds = alternate_trees(__file__, args.src, args.labels, args.rounds)
    rows = [
        {"tree": label, **{k: f"{statistics.median(x[k] for x in got):.3f}" for k in got[0]}}
        for label, got in rounds.items()
    ]
    command = " ".join(
        ["python benchmarks/studies/align_batch_side_by_side.py", "SRC ...", *sys.argv[1 + len(args.src) :]]
    )
    report(args.name, rows, command, rounds=rounds)


if __name__ == "__main__":
    main()
