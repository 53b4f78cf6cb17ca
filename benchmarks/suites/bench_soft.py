"""soft_match against the dense recipe (softmax of the full similarity matrix, then the weighted
positions) and against torch's fused attention called directly, forward and forward+backward,
time and peak memory; and soft_match's two paths (fused attention and tiles).

Run: python benchmarks/suites/bench_soft.py [--rounds 3] [--sides 64 128] [--channels 64] [--mode dual_softmax]
[--threads 1] [--only METHOD ...]

Random features, temperature 0.1, square maps against maps of the same size. Each method runs
in its own processes (benchmarks/_common.peak_and_time: the peak above the warm state over the
first full-size call with freed memory returned at once; the median of ``--repeats`` calls in a
plain process), the methods alternating, median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, peak_and_time, save

CHILD = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn.functional as F
    import densematch
    from densematch.matching import soft as _soft
    sys.path.insert(0, {here!r})
    from _common import measure_in_child

    SIDE, C, BACKWARD, T, MODE = {side}, {c}, {backward}, 0.1, {mode!r}

    def positions(side):
        return torch.stack(torch.meshgrid(torch.arange(side * 1.0), torch.arange(side * 1.0), indexing="ij"), -1)

    def dense(a, b):
        q = F.normalize(a.reshape(-1, C), dim=1)
        k = F.normalize(b.reshape(-1, C), dim=1)
        s = q @ k.T / T
        if MODE == "softmax":
            return s.softmax(1) @ positions(a.shape[0]).reshape(-1, 2)
        # LoFTR's dual softmax, then each row's weights renormalised
        p = s.softmax(1) * s.softmax(0)
        return (p / p.sum(1, keepdim=True)) @ positions(a.shape[0]).reshape(-1, 2)

    def sdpa(a, b):
        # torch's fused attention called directly: the positions padded to C (the CPU flash
        # kernel wants one width), the largest weight and the spread left out
        q = F.normalize(a.reshape(-1, C), dim=1)
        k = F.normalize(b.reshape(-1, C), dim=1)
        v = F.pad(positions(a.shape[0]).reshape(-1, 2), (0, C - 2))
        out = F.scaled_dot_product_attention(q[None, None], k[None, None], v[None, None], scale=1 / T)
        return out[0, 0, :, :2]

    def ours(fused):
        def run(a, b):
            _soft._SDPA = fused
            return densematch.soft_match(a, b, temperature=T, mode=MODE).coords
        return run

    fn = {{
        "soft_match (fused attention)": ours(True),
        "soft_match (tiles)": ours(False),
        "dense": dense,
        "scaled_dot_product_attention alone": sdpa,
    }}[{method!r}]

    def inputs(small):
        side = 16 if small else SIDE
        g = torch.Generator().manual_seed(0)
        return [torch.randn(side, side, C, generator=g).requires_grad_(BACKWARD) for _ in range(2)]

    measure_in_child(fn, inputs, backward=BACKWARD, repeats={repeats}, threads={threads})
    """
)

METHODS = ["soft_match (fused attention)", "soft_match (tiles)", "dense", "scaled_dot_product_attention alone"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sides", type=int, nargs="+", default=[64, 128])
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--name", default="soft")
    p.add_argument("--mode", default="softmax", choices=("softmax", "dual_softmax"))
    p.add_argument("--only", nargs="+", choices=METHODS, help="run only these methods")
    args = p.parse_args()
    methods = args.only or (METHODS if args.mode == "softmax" else ["soft_match (tiles)", "dense"])
    cases = [(side, m, bw) for side in args.sides for m in methods for bw in (False, True)]
    results: dict[tuple[int, str, bool], list[dict[str, float]]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for side, method, backward in cases:
            code = CHILD.format(
                here=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # benchmarks/: _common
                side=side,
                c=args.channels,
                backward=backward,
                method=method,
                threads=args.threads,
                repeats=args.repeats,
                mode=args.mode,
            )
            results[(side, method, backward)].append(peak_and_time(code))
            print(r, side, method, backward, results[(side, method, backward)][-1], flush=True)
    rows = []
    for (side, method, backward), runs in results.items():
        errors = [x["error"] for x in runs if "error" in x]
        rows.append(
            {
                "side": side,
                "method": method,
                "backward": backward,
                "median_s": None if errors else statistics.median(x["seconds"] for x in runs),
                "peak_mib": None if errors else statistics.median(x["peak"] for x in runs) / 2**20,
                "error": errors[0] if errors else None,
            }
        )
    info = machine()
    saved = save(args.name, {"machine": info, "command": " ".join(sys.argv), "args": vars(args), "rows": rows})
    print(f"\nmachine: {info}\nsaved {saved}\n")
    print(f"C={args.channels}, {args.threads} threads\n")
    print("| maps | method | forward s | peak MiB | forward + backward s | peak MiB |\n|---|---|---|---|---|---|")
    for side in args.sides:
        for method in methods:
            cells = []
            for backward in (False, True):
                row = next(r for r in rows if (r["side"], r["method"], r["backward"]) == (side, method, backward))
                ok = row["median_s"] is not None
                cells += [f"{row['median_s']:.3f}", f"{row['peak_mib']:.1f}"] if ok else [f"failed: {row['error']}", ""]
            print(f"| {side}x{side} against {side}x{side} | {method} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
