"""Dense matching: densematch.match against the usual recipes, side by side on the same inputs.

Run: python benchmarks/suites/bench_match.py [--sizes 160x160x64 80x80x384] [--repeats 5] [--device cpu]
     python benchmarks/suites/bench_match.py --sweep-tiles [--rounds 5]   (the engine over tile shapes)

Methods (cosine similarity, k=1):
- densematch.match, precision "exact" (the default), "float32", "fast", and "exact" with the
  certified bfloat16 search forced (config_context(half="bfloat16"); "exact" chooses it only where
  half precision multiplies faster: GPUs, CPUs with AMX or AVX-512 BF16)
- blockwise: L2-normalise, (1024 x N) block matmul, argmax per block (the usual fix)
- faiss: IndexFlatIP on normalised features (faiss-cpu; skipped with a note if missing)
- cdist: torch.cdist + argmin on normalised features, where its N x N matrix fits in 4 GiB
Each method's answer is checked against densematch's (agreement of the chosen index).
Inputs (--features): Gaussian noise; real features of a photo against a shifted noisy crop, each
patch normalised ("photo"); and raw colour patches of two overlapping crops ("same-scene",
:func:`densematch.app.synthetic.same_scene_pair`: smooth regions with dozens of near-ties per
row, the hard case for half precision's bound).
For each input, the certified search's candidate counts and fallback rate (bfloat16 and
float16), and the disagreement of "fast" with "float32".
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import densematch
from densematch.app.recipes import blockwise_argmax
from densematch.app.synthetic import same_scene_pair

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, matmul_gflops, photo_features, save, table, timeit


def cdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = torch.nn.functional.normalize(a.reshape(-1, a.shape[-1]), dim=1)
    b = torch.nn.functional.normalize(b.reshape(-1, b.shape[-1]), dim=1)
    return torch.cdist(a, b).argmin(1)


def faiss_flat_ip(a: torch.Tensor, b: torch.Tensor):
    import faiss

    fa = torch.nn.functional.normalize(a.reshape(-1, a.shape[-1]), dim=1).numpy()
    fb = torch.nn.functional.normalize(b.reshape(-1, b.shape[-1]), dim=1).numpy()
    index = faiss.IndexFlatIP(fb.shape[1])
    index.add(fb)
    _, i = index.search(fa, 1)
    return torch.from_numpy(i[:, 0])


def sweep_tiles(args: argparse.Namespace) -> None:
    """The engine alone over tile shapes, cosine k=1 and l2 k=8: ``--rounds`` rounds alternating
    over shapes, each a mean of two calls after a warm-up, and the median over rounds. The query
    tile that runs is also capped by each worker thread's share (``threads.share_size``)."""
    import statistics

    from densematch import engine
    from densematch.engine.driver import tile_workers
    from densematch.precision import resolve_precision
    from densematch.threads import share_size

    shapes = [(1024, 512), (2048, 256), (2048, 512), (4096, 256), (4096, 512), (2048, 1024), (1024, 2048)]
    rows = []
    for size in args.sizes:
        h, w, c = map(int, size.split("x"))
        g = torch.Generator().manual_seed(0)
        a = torch.randn(h * w, c, generator=g).to(args.device)
        b = torch.randn(h * w, c, generator=g).to(args.device)
        share = share_size(h * w, tile_workers(a.device, h * w))
        for metric, k in [("cosine", 1), ("l2", 8)]:
            precision = resolve_precision("exact", a.device, metric)
            times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
            for _ in range(args.rounds):
                for tiles in shapes:

                    def run(a=a, b=b, tiles=tiles, metric=metric, k=k, precision=precision):
                        engine.topk(a, b, metric=metric, k=k, budget=2**31, tiles=tiles, precision=precision)

                    times[tiles].append(timeit(run, repeats=2)["median"])
            for (ta, tb), t in times.items():
                rows.append(
                    {
                        "size": size,
                        "metric": metric,
                        "k": k,
                        "tiles": f"{ta}x{tb}",
                        "ran": f"{min(ta, share, h * w)}x{tb}",
                        "median_s": round(statistics.median(t), 4),
                    }
                )
                print(rows[-1], flush=True)
    print(table(rows, ["size", "metric", "k", "tiles", "ran", "median_s"]))
    save(args.name + "-tiles", {"machine": machine(), "rows": rows})


def time_methods(a: torch.Tensor, b: torch.Tensor, size: str, features: str, args, faiss) -> list[dict]:
    """Every method on (a, b), side by side; the first (precision="exact") is the baseline."""
    n = a.shape[0] * a.shape[1]
    flops = 2 * n * n * a.shape[2]
    ref = densematch.match(a, b, precision="float32").index.reshape(-1)

    def forced(a=a, b=b):
        with densematch.config_context(half="bfloat16"):
            return densematch.match(a, b).index

    methods = {
        "densematch exact": lambda a=a, b=b: densematch.match(a, b).index,
        "densematch float32": lambda a=a, b=b: densematch.match(a, b, precision="float32").index,
        "densematch fast": lambda a=a, b=b: densematch.match(a, b, precision="fast").index,
        "densematch exact, bf16 forced": forced,
        "blockwise": lambda a=a, b=b: blockwise_argmax(a, b),
    }
    if faiss is not None and args.device == "cpu":
        methods["faiss"] = lambda a=a, b=b: faiss_flat_ip(a, b)
    if n * n * 4 <= 4 * 2**30:
        methods["cdist"] = lambda a=a, b=b: cdist(a, b)
    rows, base = [], None
    for name, fn in methods.items():
        t = timeit(fn, repeats=args.repeats)
        agree = (fn().reshape(-1).cpu() == ref.cpu()).float().mean().item()
        base = base or t["median"]
        rows.append(
            {
                "size": size,
                "features": features,
                "method": name,
                "median_s": round(t["median"], 4),
                "min_s": round(t["min"], 4),
                "max_s": round(t["max"], 4),
                "gflops": round(flops / t["median"] / 1e9, 1),
                "vs_densematch": round(t["median"] / base, 2),
                "agree": round(agree, 5),
            }
        )
        print(rows[-1], flush=True)
    return rows


def certificate_rows(a: torch.Tensor, b: torch.Tensor, size: str, features: str) -> list[dict]:
    """The certified search's counts per half dtype, and how often plain half ranking errs."""
    from densematch import engine
    from densematch.precision import Precision

    c = a.shape[-1]
    qa, rb = a.reshape(-1, c), b.reshape(-1, c)
    _, want = engine.topk(qa, rb, metric="cosine", k=1, budget=2**30)
    rows = []
    for half in (torch.bfloat16, torch.float16):
        stats: dict[str, int] = {}
        engine.topk(qa, rb, metric="cosine", k=1, budget=2**30, precision=Precision(half=half), stats=stats)
        _, fast = engine.topk(qa, rb, metric="cosine", k=1, budget=2**30, precision=Precision(half=half, certify=False))
        rows.append(
            {
                "size": size,
                "features": features,
                "half": str(half).removeprefix("torch."),
                "candidates_per_row": round(stats["candidates"] / stats["rows"], 2),
                "most": stats["most"],
                "fallback_rate": round(stats["fallback"] / stats["rows"], 5),
                "fast_disagree": round((fast != want).float().mean().item(), 5),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["160x160x64", "80x80x384"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--name", default="match")
    p.add_argument(
        "--features", nargs="+", default=["noise", "photo", "same-scene"], choices=["noise", "photo", "same-scene"]
    )
    p.add_argument("--sweep-tiles", action="store_true", help="time the engine over tile shapes instead")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the tile sweep, alternating shapes")
    args = p.parse_args()
    if args.sweep_tiles:
        sweep_tiles(args)
        return

    try:
        import faiss

        faiss.omp_set_num_threads(torch.get_num_threads())
    except ImportError:
        faiss = None
        print("faiss-cpu not installed: pip install 'densematch[bench]'", file=sys.stderr)
    info = machine()
    info["matmul_gflops"] = round(matmul_gflops(args.device), 1)
    rows, certs = [], []
    for size in args.sizes:
        h, w, c = map(int, size.split("x"))
        for features in args.features:
            if features == "noise":
                g = torch.Generator().manual_seed(0)
                a = torch.randn(h, w, c, generator=g).to(args.device)
                b = torch.randn(h, w, c, generator=g).to(args.device)
            elif features == "same-scene":
                a, b = (x.to(args.device) for x in same_scene_pair(h, w, c))
            else:
                a, b = (x.to(args.device) for x in photo_features(h, w, c))
            rows += time_methods(a, b, size, features, args, faiss)
            certs += certificate_rows(a, b, size, features)
    info["precision_choice"] = {
        size: str(densematch.precision.resolve_precision("exact", torch.device(args.device), "cosine").half)
        for size in args.sizes
    }
    path = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows, "certificate": certs})
    print(f"\nmachine: {info}\nfloat32 matmul: {info['matmul_gflops']} GFLOP/s\n")
    print(table(rows, ["size", "features", "method", "median_s", "min_s", "max_s", "gflops", "vs_densematch", "agree"]))
    print()
    print(table(certs, ["size", "features", "half", "candidates_per_row", "most", "fallback_rate", "fast_disagree"]))
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
