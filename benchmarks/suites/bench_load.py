"""Dense matching on a quiet machine and on a busy one, side by side: densematch.match against
FAISS, the blockwise loop and torch.cdist, every method in its own process.

Run: python benchmarks/suites/bench_load.py [--sizes 160x160x64 80x80x384] [--metrics cosine l2 l1]
     [--ks 1 8] [--features noise photo] [--loads quiet torch busy] [--rounds 3] [--repeats 3]

Features: Gaussian noise, or real ones ("photo": grey patches of scikit-image's astronaut against
a shifted noisy crop, projected to C channels; benchmarks/_common.photo_features).

Loads, started before the timings of their block and stopped after:
- quiet: nothing else runs;
- torch: another PyTorch program (a loop of 384x384 float32 matmuls, its OpenMP pool at the
  default thread count) plus a Python busy loop: what a training job's neighbour looks like;
- busy: two Python busy loops (plain CPU load, no second OpenMP pool).
"densematch, one OpenMP pool" is the engine with its query tiles on the caller's thread (every
operator parallel over torch's pool), as before worker threads. Every (method, case) is timed
in a fresh process (so no thread pool of one method spins while
another runs: FAISS and torch each bring their own), ``--repeats`` calls after one warm-up,
median; processes alternate over methods, and the table gives the median over ``--rounds``.
A last column counts the aten operators one densematch call runs (torch.profiler, quiet), the
synchronisation points a busy machine makes expensive. align (one 100x100 template in a
125x125 image) is timed the same way.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import LOADS, machine, save, under_load

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/

CHILD = textwrap.dedent(
    """
    import json, statistics, sys, time
    import torch
    import torch.nn.functional as F
    import densematch

    spec = json.loads({spec!r})
    method, metric, k = spec["method"], spec["metric"], spec["k"]

    def inputs():
        h, w, c = spec["size"]
        if spec["features"] == "photo":
            sys.path.insert(0, spec["bench_dir"])
            from _common import photo_features
            return tuple(x.reshape(h * w, c).contiguous() for x in photo_features(h, w, c))
        g = torch.Generator().manual_seed(0)
        return torch.randn(h * w, c, generator=g), torch.randn(h * w, c, generator=g)

    def prepared(x):
        return F.normalize(x, dim=1) if metric == "cosine" else x

    def ours(a, b):
        return densematch.match(a, b, metric=metric, k=k, layout="flat").index

    if method == "densematch, one OpenMP pool":
        # the engine as it ran before query tiles went to worker threads
        from densematch import threads
        threads.THREADED = False
        method = "densematch"

    order = 1.0 if metric == "l1" else 2.0

    def faiss_flat(a, b):
        import faiss
        xa, xb = prepared(a).numpy(), prepared(b).numpy()
        kind = {{"cosine": faiss.METRIC_INNER_PRODUCT, "l2": faiss.METRIC_L2, "l1": faiss.METRIC_L1}}[metric]
        index = faiss.IndexFlat(xb.shape[1], kind)
        index.add(xb)
        return index.search(xa, k)[1]

    def blockwise(a, b, block=1024):
        a, b = prepared(a), prepared(b)
        out = torch.empty(a.shape[0], k, dtype=torch.int64)
        for i in range(0, a.shape[0], block):
            s = a[i : i + block] @ b.T if metric == "cosine" else -torch.cdist(a[i : i + block], b, p=order)
            out[i : i + block] = s.topk(k, 1).indices if k > 1 else s.argmax(1, keepdim=True)
        return out

    def cdist(a, b):
        d = torch.cdist(prepared(a), prepared(b), p=order)
        return d.topk(k, 1, largest=False).indices if k > 1 else d.argmin(1)

    def align(a, b):
        return densematch.align(a, b)

    if method == "align":
        from densematch.app.synthetic import alignment_cases
        case = next(alignment_cases(1, seed=0, sizes=(((100, 100), (125, 125)),)))
        a, b = case.template, case.image
    else:
        a, b = inputs()
    fn = {{"densematch": ours, "FAISS": faiss_flat, "blockwise loop": blockwise, "torch.cdist": cdist,
           "align": align}}[method]
    fn(a, b)
    times = []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        fn(a, b)
        times.append(time.perf_counter() - t0)
    ops = None
    if spec["count_ops"]:
        from torch.profiler import profile
        with profile() as prof:
            fn(a, b)
        ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    print(json.dumps({{"seconds": statistics.median(times), "ops": ops}}))
    """
)

METHODS = ["densematch", "densematch, one OpenMP pool", "FAISS", "blockwise loop", "torch.cdist"]


def run_child(spec: dict) -> dict:
    code = CHILD.format(spec=json.dumps(spec))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def cdist_fits(size: tuple[int, int, int]) -> bool:
    n = size[0] * size[1]
    return n * n * 4 <= 3 * 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["160x160x64", "80x80x384"])
    p.add_argument("--metrics", nargs="+", default=["cosine", "l2"])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 8])
    p.add_argument("--features", nargs="+", default=["noise"], choices=["noise", "photo"])
    p.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    p.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    p.add_argument("--no-align", action="store_true")
    p.add_argument("--align-only", action="store_true", help="time align alone")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="load")
    args = p.parse_args()
    cases = []
    for size in [] if args.align_only else args.sizes:
        dims = tuple(int(v) for v in size.split("x"))
        for features, metric, k, method in itertools.product(args.features, args.metrics, args.ks, args.methods):
            if method != "torch.cdist" or cdist_fits(dims):
                cases.append({"size": dims, "features": features, "metric": metric, "k": k, "method": method})
    if not args.no_align:
        cases.append({"size": (100, 100, 1), "features": "-", "metric": "-", "k": 1, "method": "align"})
    rows = []
    for load in args.loads:
        results: dict[int, list[dict]] = {i: [] for i in range(len(cases))}
        with under_load(load):
            for r in range(args.rounds):
                for i, case in enumerate(cases):
                    count = load == "quiet" and r == 0 and case["method"].startswith(("densematch", "align"))
                    spec = {**case, "repeats": args.repeats, "count_ops": count, "bench_dir": HERE}
                    results[i].append(run_child(spec))
                    print(load, r, case, results[i][-1], flush=True)
        for i, case in enumerate(cases):
            runs = results[i]
            errors = [x["error"] for x in runs if "error" in x]
            ops = next((x["ops"] for x in runs if x.get("ops") is not None), None)
            rows.append(
                {
                    **case,
                    "size": "x".join(map(str, case["size"])),
                    "load": load,
                    "median_s": None if errors else statistics.median(x["seconds"] for x in runs),
                    "runs_s": [x.get("seconds") for x in runs],
                    "ops": ops,
                    "error": errors[0] if errors else None,
                }
            )
    info = machine()
    saved = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\nsaved {saved}\n")
    print_table(rows, args.loads)


def print_table(rows: list[dict], loads: list[str]) -> None:
    """One line per case: each method's median under each load, and densematch's ratio to FAISS."""
    cases = sorted({(r["size"], r["features"], r["metric"], r["k"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    head = ["size", "features", "metric", "k", "method", *[f"{ld} s" for ld in loads], "ops/call"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for case in cases:
        for method in methods:
            mine = [r for r in rows if (r["size"], r["features"], r["metric"], r["k"], r["method"]) == (*case, method)]
            if not mine:
                continue
            cells = []
            for load in loads:
                r = next((x for x in mine if x["load"] == load), None)
                cells.append("" if r is None or r["median_s"] is None else f"{r['median_s']:.3f}")
            ops = next((x["ops"] for x in mine if x["ops"] is not None), None)
            print(f"| {' | '.join(map(str, case))} | {method} | " + " | ".join(cells) + f" | {ops or ''} |")


if __name__ == "__main__":
    main()
