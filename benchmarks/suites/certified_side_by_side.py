"""The certified bfloat16 search (forced) and float32's of several densematch source trees, side
by side on same-scene and random features: each tree in its own process, the trees alternated
round by round, so that a busy spell hits them alike.

Run: python benchmarks/suites/certified_side_by_side.py SRC [SRC ...] [--labels A,B] [--rounds 3]
       [--cases 96x96x64 ...] [--ks 1 8] [--metrics cosine] [--threads 1] [--name NAME]

SRC is a src/ folder: this checkout's, or an earlier revision's (``git worktree add DIR REV``, then
DIR/src). Features: :func:`densematch.app.synthetic.same_scene_pair` (raw colour patches of two
overlapping crops of the astronaut, the hard case for bfloat16's bound) and Gaussian noise, both
made by this checkout's own code so every tree searches the same rows. Per round, tree and case,
after a warm-up, three calls of ``engine.topk`` with ``Precision(half=torch.bfloat16)`` (the
default path on CPUs with AMX or AVX-512 BF16, forced) and three of float32's default, interleaved;
each is the median of its three. On a CPU that emulates bfloat16 the products themselves are slower
than float32's, so the totals compare the trees, not the precisions: benchmarks/studies/bench_certify.py
separates the certificate's own cost."""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
OWN_SRC = os.path.join(os.path.dirname(HERE), "src")


def features(case: str, kind: str):  # type: ignore[no-untyped-def]
    """(a, b) flat rows of one case, from this checkout's recipe (imported before any tree)."""
    import torch

    h, w, c = map(int, case.split("x"))
    if kind == "same-scene":
        sys.path.insert(0, OWN_SRC)
        from densematch.app.synthetic import same_scene_pair

        fa, fb = same_scene_pair(h, w, c)
        for name in [m for m in sys.modules if m == "densematch" or m.startswith("densematch.")]:
            del sys.modules[name]  # the tree measured is imported afresh
        sys.path.remove(OWN_SRC)
    else:
        g = torch.Generator().manual_seed(0)
        fa, fb = torch.randn(h, w, c, generator=g), torch.randn(h, w, c, generator=g)
    return fa.reshape(-1, c).contiguous(), fb.reshape(-1, c).contiguous()


def measure(src: str, cases: list[str], ks: list[int], metrics: list[str], threads: int) -> list[dict]:
    """One round in this process, for the tree at ``src``."""
    inputs = {(case, kind): features(case, kind) for case in cases for kind in ("same-scene", "noise")}
    sys.path.insert(0, src)
    import torch

    from densematch import engine
    from densematch.precision import Precision

    torch.set_num_threads(threads)
    out = []
    for (case, kind), (a, b) in inputs.items():
        for metric in metrics:
            for k in ks:
                kw = dict(metric=metric, k=k, budget=2**28)
                bf16 = Precision(half=torch.bfloat16)
                runs = {
                    "certified bf16 s": functools.partial(engine.topk, a, b, **kw, precision=bf16),
                    "float32 s": functools.partial(engine.topk, a, b, **kw),
                }
                times: dict[str, list[float]] = {name: [] for name in runs}
                for repeat in range(4):
                    for name, run in runs.items():
                        t0 = time.perf_counter()
                        run()
                        if repeat:  # the first is a warm-up
                            times[name].append(time.perf_counter() - t0)
                stats: dict[str, int] = {}
                engine.topk(a, b, **kw, precision=Precision(half=torch.bfloat16), stats=stats)
                row = {"case": case, "features": kind, "metric": metric, "k": k}
                row.update({name: statistics.median(t) for name, t in times.items()})
                row["over %"] = 100 * stats["fallback"] / stats["rows"]
                out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", nargs="+")
    ap.add_argument("--labels", help="comma-separated names of the trees, for the table (default: tree 1, ...)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=["96x96x64", "80x80x256", "56x56x768", "48x48x1536"])
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--metrics", nargs="+", default=["cosine"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="certified-side-by-side")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.src[0], args.cases, args.ks, args.metrics, args.threads)))
        return
    sys.path.insert(0, HERE)
    from _common import alternate_trees, report

    child = ["--cases", *args.cases, "--ks", *map(str, args.ks), "--metrics", *args.metrics]
    child += ["--threads", str(args.threads)]
    rounds = alternate_trees(__file__, args.src, args.labels, args.rounds, child)
    labels = list(rounds)
    rows = []
    for i, first in enumerate(rounds[labels[0]][0]):
        row = {key: first[key] for key in ("case", "features", "metric", "k")}
        for label in labels:
            got = [rnd[i] for rnd in rounds[label]]
            bf16 = statistics.median(x["certified bf16 s"] for x in got)
            f32 = statistics.median(x["float32 s"] for x in got)
            row[f"{label}: certified s"] = f"{bf16:.3f}"
            row[f"{label}: float32 s"] = f"{f32:.3f}"
            row[f"{label}: over %"] = f"{got[0]['over %']:.1f}"
        rows.append(row)
    command = " ".join(
        ["python benchmarks/suites/certified_side_by_side.py", "SRC ...", *sys.argv[1 + len(args.src) :]]
    )
    report(args.name, rows, command, rounds=rounds)


if __name__ == "__main__":
    main()
