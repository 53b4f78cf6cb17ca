"""Pixel-to-prototype distances: densematch against the usual recipes, time and peak memory.

Run: python benchmarks/suites/bench_distance.py [--repeats 5] [--rounds 2] [--quick]
         [--loads quiet torch] [--methods densematch cdist ...]

Each (size, metric, method, pass) runs in its own subprocess, so its peak memory is its own:
the high-water mark of one call after a warm-up call (VmHWM reset through /proc/self/clear_refs),
above the RSS before it. The cases alternate, round after round, and each figure is the median
over rounds of the median of ``--repeats`` calls. Loads (benchmarks/_common.py): "quiet", or
"torch" (another PyTorch program and a busy loop running beside it). Passes: "fwd" (no grad)
and "fwd+bwd" (the gradient of the sum with respect to x and the prototypes). Recipes:
- densematch.pairwise_distance (and, for l1, with compile=True: its torch.compile'd kernel)
- cdist: torch.cdist on (N, HW, D) against (F, D), permuted to (N, F, H, W) (l2, l1)
- conv1x1: ||x||^2 - 2 conv1x1(x, P) + ||p||^2, clamped, sqrt (l2, as prototype networks write it)
- broadcast: (N, H, W, 1, D) - (F, D), reduced over D (skipped where it needs over 6 GiB)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import LOADS, machine, save, table, under_load

CHILD = textwrap.dedent(
    """
    import json, statistics, time, torch, densematch
    n, d, h, w, f = {size}
    metric, method, passes, repeats = {metric!r}, {method!r}, {passes!r}, {repeats}
    torch.manual_seed(0)
    x = torch.randn(n, d, h, w, requires_grad=passes == "fwd+bwd")
    p = torch.randn(f, d, requires_grad=passes == "fwd+bwd")

    def recipe(x, p):
        if method.startswith("densematch"):
            return densematch.pairwise_distance(x, p, metric, check_finite=False, compile=method.endswith("compile"))
        if method == "cdist":
            flat = x.flatten(2).transpose(1, 2)
            return torch.cdist(flat, p, p=2.0 if metric == "l2" else 1.0).transpose(1, 2).view(n, f, h, w)
        if method == "conv1x1":
            xp = torch.nn.functional.conv2d(x, p[:, :, None, None])
            sq = x.square().sum(1, keepdim=True) - 2 * xp + p.square().sum(1)[None, :, None, None]
            return sq.clamp_min(0).sqrt()
        diff = x.permute(0, 2, 3, 1)[..., None, :] - p
        out = diff.norm(dim=-1) if metric == "l2" else diff.abs().sum(-1)
        return out.permute(0, 3, 1, 2)

    def once():
        if passes == "fwd":
            with torch.no_grad():
                recipe(x, p)
        else:
            recipe(x, p).sum().backward()

    def status(field):
        with open("/proc/self/status") as fh:
            return next(int(l.split()[1]) * 1024 for l in fh if l.startswith(field))

    once()  # warm-up (and, for compile=True, the compilation)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM, the peak, to the current RSS
    before = status("VmRSS:")
    once()
    peak = status("VmHWM:") - before
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    print(json.dumps({{"median_s": statistics.median(times), "min_s": min(times), "peak_mib": peak / 2**20}}))
    """
)

METHODS = {
    "l2": ["densematch", "cdist", "conv1x1", "broadcast"],
    "l1": ["densematch", "densematch compile", "cdist", "broadcast"],
}


def run_child(size: tuple[int, ...], metric: str, method: str, passes: str, repeats: int) -> dict:
    code = CHILD.format(size=size, metric=metric, method=method, passes=passes, repeats=repeats)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": f"failed: {out.stderr.strip().splitlines()[-1][:60]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the small size only, 3 repeats")
    ap.add_argument("--loads", nargs="+", default=["quiet"], choices=list(LOADS))
    ap.add_argument("--metrics", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--methods", nargs="+", help="only these methods (default: all of each metric)")
    args = ap.parse_args()
    sizes = [(4, 64, 96, 96, 256)] + ([] if args.quick else [(8, 128, 96, 96, 512)])
    repeats = 3 if args.quick else args.repeats
    cases = []
    for size in sizes:
        n, d, h, w, f = size
        for metric in args.metrics:
            for passes in ("fwd", "fwd+bwd"):
                for method in METHODS[metric]:
                    if args.methods and method not in args.methods:
                        continue
                    label = {"size": f"N={n} D={d} {h}x{w} F={f}", "metric": metric, "pass": passes, "method": method}
                    big = n * h * w * f * d * 4 * (3 if passes == "fwd+bwd" else 1) > 6 * 2**30
                    cases.append((label, None if method == "broadcast" and big else size))
    rows = []
    for load in args.loads:
        runs: list[list[dict]] = [[] for _ in cases]
        with under_load(load):
            for _ in range(args.rounds):
                for i, (label, size) in enumerate(cases):
                    if size is not None:
                        runs[i].append(run_child(size, label["metric"], label["method"], label["pass"], repeats))
                        print(load, label, runs[i][-1], flush=True)
        base: dict[tuple, float] = {}  # densematch's median of each (size, metric, pass)
        for (label, size), results in zip(cases, runs, strict=True):
            group = (label["size"], label["metric"], label["pass"])
            row = {**label, "load": load}
            errors = [r["error"] for r in results if "error" in r]
            if size is None or errors:
                rows.append({**row, "median_s": errors[0] if errors else "skipped (>6 GiB)"})
                continue
            median = statistics.median(r["median_s"] for r in results)
            if label["method"] == "densematch":
                base[group] = median
            rows.append(
                {
                    **row,
                    "median_s": round(median, 4),
                    "min_s": round(min(r["min_s"] for r in results), 4),
                    "peak_mib": round(statistics.median(r["peak_mib"] for r in results), 1),
                    "vs_densematch": round(median / base[group], 2) if group in base else None,
                }
            )
    info = machine()
    path = save("distance", {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\n")
    print(table(rows, ["size", "metric", "pass", "load", "method", "median_s", "min_s", "peak_mib", "vs_densematch"]))
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
