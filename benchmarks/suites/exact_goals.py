"""The default exact search against everything a user would try instead, side by side in one run:
issue 39's goals table on the machine at hand.

Run: python benchmarks/suites/exact_goals.py [--threads 1 2] [--cases 96x96x64 ...] [--ks 1 8]
       [--metrics cosine dot l2] [--features same-scene random] [--rounds 3] [--big 320x320x64]
       [--name NAME]

Per thread count, case (HxWxC), features, metric and k, one process times, in turns round by round
(a busy spell hits them alike), each the median of ``--rounds`` calls after a warm-up:
- ``densematch.match`` with precision "exact" (the default: the certified bfloat16 search on CPUs
  with AMX or AVX-512 BF16, plain float32 elsewhere; the "path" column says which), "float32" and
  "fast";
- FAISS's exact flat index (IndexFlatIP, on normalised rows for cosine; IndexFlatL2), where
  faiss-cpu is installed;
- the blockwise loop a user writes first: 1024 query rows at a time, one float32 product with
  every reference, ``torch.topk``;
- bare ``torch.mm`` in float32 and in bfloat16 (inputs cast beforehand) over the tiles
  densematch's float32 search plans, into one reused block: the products alone, what no search
  can undercut without a faster product.
Features: :func:`densematch.app.synthetic.same_scene_pair` (raw colour patches of two overlapping
crops of one photograph: smooth regions full of near-ties, the hard case for bfloat16's bound) and
Gaussian noise. "agrees" is the share of pixels whose index equals float32's (the default must
give 1.0). The goals, counted under the table: the default at most float32's time everywhere, at
most 0.6 of it from C=256, and "fast" at most float32's time. ``--big`` adds one large same-scene
case (cosine, k=1; the issue's 320x320x64) at the largest thread count, with the densematch
methods, FAISS and the blockwise loop only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import densematch
from densematch.app.synthetic import same_scene_pair
from densematch.precision import Precision, resolve_precision

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import report

CASES = ["96x96x64", "96x96x128", "80x80x256", "72x72x384", "56x56x768", "48x48x1536"]
BLOCK = 1024  # query rows per block of the blockwise loop and the bare products


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def path_of(p: Precision) -> str:
    """What a resolved precision="exact" runs."""
    return f"certified {str(p.half).removeprefix('torch.')}" if p.half is not None and p.certify else "float32"


def rows_for(metric: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat rows as the loop and FAISS take them: normalised for cosine."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    if metric == "cosine":
        a, b = torch.nn.functional.normalize(a, dim=1), torch.nn.functional.normalize(b, dim=1)
    return a.contiguous(), b.contiguous()


def blockwise(a: torch.Tensor, b: torch.Tensor, metric: str, k: int) -> torch.Tensor:
    """The top ``k`` references of each query row, ``BLOCK`` rows at a time (l2 ranked by
    2 a.b - |b|^2, the same order as the distance)."""
    bias = -(b * b).sum(1) if metric == "l2" else None
    out = []
    for i in range(0, a.shape[0], BLOCK):
        s = a[i : i + BLOCK] @ b.T
        if bias is not None:
            s = s.mul_(2).add_(bias)
        out.append(s.topk(k, dim=1).indices)
    return torch.cat(out)


def bare_products(a: torch.Tensor, b: torch.Tensor, tiles: tuple[int, int]) -> None:
    ta, tb = tiles
    out = torch.empty(ta, tb, dtype=a.dtype)
    for i in range(0, a.shape[0], ta):
        for j in range(0, b.shape[0], tb):
            qi, rj = a[i : i + ta], b[j : j + tb]
            torch.mm(qi, rj.T, out=out[: qi.shape[0], : rj.shape[0]])


def faiss_search(faiss: Any, a: torch.Tensor, b: torch.Tensor, metric: str, k: int) -> torch.Tensor:
    index = faiss.IndexFlatL2(b.shape[1]) if metric == "l2" else faiss.IndexFlatIP(b.shape[1])
    index.add(b.numpy())
    return torch.from_numpy(index.search(a.numpy(), k)[1])


def methods(
    fa: torch.Tensor, fb: torch.Tensor, metric: str, k: int, faiss: Any, products: list[str]
) -> dict[str, Callable[[], torch.Tensor | None]]:
    a, b = rows_for(metric, fa, fb)
    run: dict[str, Callable[[], torch.Tensor | None]] = {
        f"{name} s": (lambda p=name: densematch.match(fa, fb, metric=metric, k=k, precision=p).index)
        for name in ("exact", "float32", "fast")
    }
    if faiss is not None:
        run["faiss s"] = lambda: faiss_search(faiss, a, b, metric, k)
    run["blockwise s"] = lambda: blockwise(a, b, metric, k)
    if products:
        cpu = torch.device("cpu")
        f32 = resolve_precision("float32", cpu, metric)
        plan = densematch.engine.plan_tiles(
            a.shape[0], b.shape[0], a.shape[1], k, 2**28, metric=metric, device=cpu, precision=f32
        )
        tiles = (plan.tile_a, plan.tile_b)
        for dtype in products:
            ah, bh = a.to(getattr(torch, dtype)), b.to(getattr(torch, dtype))
            run[f"mm {dtype} s"] = lambda ah=ah, bh=bh: bare_products(ah, bh, tiles)
    return run


def timed(run: dict[str, Callable[[], Any]], rounds: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Each method's median over ``rounds`` calls, the methods in turns, after one warm-up each
    (whose answers are returned beside the medians)."""
    answers = {name: fn() for name, fn in run.items()}
    times: dict[str, list[float]] = {name: [] for name in run}
    for _ in range(rounds):
        for name, fn in run.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, answers


def one_case(
    case: str, features: str, metric: str, k: int, threads: int, rounds: int, faiss: Any, products: list[str]
) -> dict[str, Any]:
    h, w, c = map(int, case.split("x"))
    if features == "same-scene":
        fa, fb = same_scene_pair(h, w, c)
    else:
        g = torch.Generator().manual_seed(0)
        fa, fb = torch.randn(h, w, c, generator=g), torch.randn(h, w, c, generator=g)
    torch.set_num_threads(threads)
    if faiss is not None:
        faiss.omp_set_num_threads(threads)
    run = methods(fa, fb, metric, k, faiss, products)
    got, answers = timed(run, rounds)
    row: dict[str, Any] = {"threads": threads, "case": case, "features": features, "metric": metric, "k": k}
    p = resolve_precision("exact", torch.device("cpu"), metric)
    row["path"] = path_of(p)
    stats: dict[str, int] = {}
    if p.certify and p.half is not None:
        a, b = fa.reshape(-1, c), fb.reshape(-1, c)
        densematch.engine.topk(a, b, metric=metric, k=k, budget=2**28, precision=p, stats=stats)
    row["over %"] = round(100 * stats["fallback"] / stats["rows"], 1) if stats else "-"
    row.update({name: round(t, 4) for name, t in got.items()})
    row["exact / float32"] = round(got["exact s"] / got["float32 s"], 2)
    row["fast / float32"] = round(got["fast s"] / got["float32 s"], 2)
    for name in ("exact", "fast"):
        row[f"{name} agrees"] = round(float((answers[f"{name} s"] == answers["float32 s"]).float().mean()), 4)
    print(row, flush=True)
    return row


def goals(rows: list[dict[str, Any]]) -> dict[str, str]:
    """How many cases meet each of issue 39's goals."""
    wide = [r for r in rows if int(r["case"].split("x")[2]) >= 256]

    def count(rs: list[dict[str, Any]], key: str, limit: float) -> str:
        return f"{sum(r[key] <= limit for r in rs)} of {len(rs)}"

    return {
        "exact at most float32": count(rows, "exact / float32", 1.0),
        "exact at most 1.05 float32 (one path on both: the noise)": count(rows, "exact / float32", 1.05),
        "exact at most 0.6 float32 from C=256": count(wide, "exact / float32", 0.6),
        "fast at most float32": count(rows, "fast / float32", 1.0),
        "exact agrees with float32": f"{sum(r['exact agrees'] == 1.0 for r in rows)} of {len(rows)}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--cases", nargs="+", default=CASES)
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--metrics", nargs="+", default=["cosine", "dot", "l2"], choices=["cosine", "dot", "l2"])
    ap.add_argument("--features", nargs="+", default=["same-scene", "random"], choices=["same-scene", "random"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--products",
        nargs="*",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16"],
        help="the bare products timed (bfloat16's take 15-20x float32's where the CPU emulates them)",
    )
    ap.add_argument("--big", nargs="*", default=[], help="large same-scene cases, cosine k=1 (e.g. 320x320x64)")
    ap.add_argument("--name", default="exact-goals")
    args = ap.parse_args()
    try:
        import faiss
    except ImportError:
        faiss = None
        print("faiss-cpu not installed (pip install 'densematch[bench]'): no FAISS column", file=sys.stderr)
    flags = cpu_flags()
    rows = [
        one_case(case, features, metric, k, threads, args.rounds, faiss, args.products)
        for threads in args.threads
        for case in args.cases
        for features in args.features
        for metric in args.metrics
        for k in args.ks
    ]
    big = [one_case(case, "same-scene", "cosine", 1, max(args.threads), 1, faiss, []) for case in args.big]
    report(
        args.name,
        rows + big,
        amx=bool({"amx_bf16", "amx_tile"} & flags),
        avx512_bf16="avx512_bf16" in flags,
        goals=goals(rows),
    )
    print(goals(rows))


if __name__ == "__main__":
    main()
