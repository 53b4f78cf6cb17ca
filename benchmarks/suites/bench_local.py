"""local_match against the recipes users write today: the cost volume against the unfold/pad
recipe and against the full correlation that RAFT-style code samples windows from, forward and
forward+backward; the top-k output against the global `match` and the unfold recipe's argmax.

Run: python benchmarks/suites/bench_local.py [--rounds 3] [--side 96 128] [--channels 64] [--radius 4] [--threads 1]
[--only METHOD ...]

Features: 7x7 patch descriptors of astronaut projected to C channels, and of a shifted, noisy
crop (benchmarks/_common.photo_features), in (1, C, H, W). Each method runs in its own process
(so no thread pool or allocator state carries over), the methods alternating. Per method and
round, one process warms up on a 16x16 map and records its peak memory above the warm state
(VmHWM - VmRSS) over the first full-size call, with glibc's mmap threshold fixed so that freed
memory leaves at once; a second, plain process times ``--repeats`` calls after one full-size
call. The table gives the median over rounds.

spatial-correlation-sampler (0.5.0) is a peer where it is installed: on CPU-only torch,
scripts/build-correlation-sampler.sh builds it. Where it is not, its rows say so.
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
    sys.path.insert(0, {here!r})
    from _common import measure_in_child, photo_features
    import densematch

    H, W, C, R, BACKWARD = {h}, {w}, {c}, {r}, {backward}
    P = 2 * R + 1

    def unfold_volume(a, b):
        n, c, h, w = a.shape
        patches = F.unfold(F.pad(b, (R, R, R, R)), P).view(n, c, P, P, h, w)
        return (a[:, :, None, None] * patches).sum(1)

    def shifted_volume(a, b):
        # PWC-Net's and RAFT's Python fall-back: b padded by the radius, a times each shifted b,
        # reduced over C: (2R+1)^2 products
        n, c, h, w = a.shape
        bp = F.pad(b, (R, R, R, R))
        out = [(a * bp[:, :, i : i + h, j : j + w]).sum(1) for i in range(P) for j in range(P)]
        return torch.stack(out, 1).view(n, P, P, h, w)

    def shifted_topk(a, b):
        return shifted_volume(F.normalize(a, dim=1), F.normalize(b, dim=1)).flatten(1, 2).argmax(1)

    def full_volume(a, b):
        # RAFT's recipe: every pair's product, then each pixel's window read out of it
        n, c, h, w = a.shape
        corr = torch.einsum("nchw,ncyx->nhwyx", a, b)
        corr = F.pad(corr, (R, R, R, R))
        ys = torch.arange(h)[:, None, None, None] + torch.arange(P)[None, None, :, None]
        xs = torch.arange(w)[None, :, None, None] + torch.arange(P)[None, None, None, :]
        hh = torch.arange(h)[:, None, None, None]
        ww = torch.arange(w)[None, :, None, None]
        return corr[:, hh, ww, ys, xs].permute(0, 3, 4, 1, 2)

    def ours_volume(a, b):
        return densematch.local_cost_volume(a, b, R, metric="dot", layout="chw")

    def ours_cosine(a, b):
        return densematch.local_cost_volume(a, b, R, metric="cosine", layout="chw")

    def ours_flow(a, b):
        flow = torch.randn(1, a.shape[2], a.shape[3], 2, generator=torch.Generator().manual_seed(0)) * 2
        kw = dict(metric="dot", layout="chw", flow=flow, sampling="bilinear")
        return densematch.local_cost_volume(a, b, R, **kw)

    def ours_topk(a, b):
        return densematch.local_match(a, b, R, layout="chw").index

    def unfold_topk(a, b):
        a = F.normalize(a, dim=1)
        b = F.normalize(b, dim=1)
        return unfold_volume(a, b).flatten(1, 2).argmax(1)

    def sampler_volume(a, b):
        from spatial_correlation_sampler import spatial_correlation_sample

        return spatial_correlation_sample(a, b, kernel_size=1, patch_size=P)

    def sampler_topk(a, b):
        a = F.normalize(a, dim=1)
        b = F.normalize(b, dim=1)
        return sampler_volume(a, b).flatten(1, 2).argmax(1)

    def global_match(a, b):
        return densematch.match(a, b, layout="chw").index

    fn = {{
        "local_match volume, dot": ours_volume,
        "local_match volume, cosine": ours_cosine,
        "local_match volume, dot, bilinear flow": ours_flow,
        "unfold/pad recipe": unfold_volume,
        "shifted-products recipe": shifted_volume,
        "shifted-products recipe + argmax": shifted_topk,
        "full correlation, windows read out": full_volume,
        "spatial-correlation-sampler": sampler_volume,
        "spatial-correlation-sampler + argmax": sampler_topk,
        "local_match topk, cosine": ours_topk,
        "unfold recipe + argmax": unfold_topk,
        "match (global), cosine": global_match,
    }}[{method!r}]

    def inputs(small):
        a, b = photo_features(16, 16, C) if small else photo_features(H, W, C)
        return [x.permute(2, 0, 1)[None].contiguous().requires_grad_(BACKWARD) for x in (a, b)]

    measure_in_child(fn, inputs, backward=BACKWARD, repeats={repeats}, threads={threads})
    """
)

VOLUMES = [
    "local_match volume, dot",
    "local_match volume, cosine",
    "local_match volume, dot, bilinear flow",
    "shifted-products recipe",
    "unfold/pad recipe",
    "full correlation, windows read out",
    "spatial-correlation-sampler",
]
TOPK = [
    "local_match topk, cosine",
    "shifted-products recipe + argmax",
    "unfold recipe + argmax",
    "spatial-correlation-sampler + argmax",
    "match (global), cosine",
]


def child(method: str, backward: bool, args: argparse.Namespace) -> dict[str, float]:
    code = CHILD.format(
        here=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # benchmarks/: _common
        h=args.side[0],
        w=args.side[1],
        c=args.channels,
        r=args.radius,
        backward=backward,
        method=method,
        threads=args.threads,
        repeats=args.repeats,
    )
    return peak_and_time(code)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--side", type=int, nargs=2, default=[96, 128])
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--radius", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--name", default="local")
    p.add_argument("--only", nargs="+", help="run only these methods (names as in the table)")
    args = p.parse_args()
    cases = [(m, bw) for m in VOLUMES for bw in (False, True)] + [(m, False) for m in TOPK]
    if args.only:
        cases = [c for c in cases if c[0] in args.only]
    results: dict[tuple[str, bool], list[dict[str, float]]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for case in cases:
            results[case].append(child(*case, args))
            print(r, case, results[case][-1], flush=True)
    rows = []
    for (method, backward), runs in results.items():
        ok = [x for x in runs if "error" in x] == []
        rows.append(
            {
                "method": method,
                "backward": backward,
                "median_s": statistics.median(x["seconds"] for x in runs) if ok else None,
                "peak_mib": statistics.median(x["peak"] for x in runs) / 2**20 if ok else None,
                "error": None if ok else runs[0]["error"],
            }
        )
    info = machine()
    saved = save(args.name, {"machine": info, "command": " ".join(sys.argv), "args": vars(args), "rows": rows})
    print(f"\nmachine: {info}\nsaved {saved}\n")
    h, w = args.side
    print(f"{h}x{w}, C={args.channels}, radius {args.radius}, {args.threads} threads\n")
    print("| method | pass | median s | peak MiB |\n|---|---|---|---|")
    for row in rows:
        what = "forward + backward" if row["backward"] else "forward"
        if row["median_s"] is None:
            print(f"| {row['method']} | {what} | failed: {row['error']} | |")
        else:
            print(f"| {row['method']} | {what} | {row['median_s']:.4f} | {row['peak_mib']:.1f} |")


if __name__ == "__main__":
    main()
