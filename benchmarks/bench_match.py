"""Dense matching: densematch.match against the usual recipes, side by side on the same inputs.

Run: python benchmarks/bench_match.py [--sizes 160x160x64 80x80x384] [--repeats 5] [--device cpu]

Methods (cosine similarity, k=1):
- densematch.match
- blockwise: L2-normalise, (1024 x N) block matmul, argmax per block (the usual fix)
- faiss: IndexFlatIP on normalised features (faiss-cpu; skipped with a note if missing)
- cdist: torch.cdist + argmin on normalised features, where its N x N matrix fits in 4 GiB
Each method's answer is checked against densematch's (agreement of the chosen index).
"""

from __future__ import annotations

import argparse
import sys

import torch

import densematch
from densematch.demo import blockwise_argmax

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _common import machine, matmul_gflops, save, table, timeit


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
    from densematch import engine

    rows = []
    for size in args.sizes:
        h, w, c = map(int, size.split("x"))
        a = torch.randn(h * w, c, device=args.device)
        b = torch.randn(h * w, c, device=args.device)
        for tiles in [(1024, 2048), (2048, 2048), (4096, 1024), (4096, 512), (8192, 512), (4096, 256)]:
            t = timeit(
                lambda a=a, b=b, tiles=tiles: engine.topk(a, b, metric="cosine", k=1, budget=2**31, tiles=tiles),
                repeats=args.repeats,
            )
            rows.append({"size": size, "tile_a": tiles[0], "tile_b": tiles[1], "median_s": round(t["median"], 4)})
            print(rows[-1], flush=True)
    print(table(rows, ["size", "tile_a", "tile_b", "median_s"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["160x160x64", "80x80x384"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--name", default="match")
    p.add_argument("--sweep-tiles", action="store_true", help="time the engine over tile shapes instead")
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
    rows = []
    for size in args.sizes:
        h, w, c = map(int, size.split("x"))
        g = torch.Generator().manual_seed(0)
        a = torch.randn(h, w, c, generator=g).to(args.device)
        b = torch.randn(h, w, c, generator=g).to(args.device)
        n = h * w
        flops = 2 * n * n * c
        ref = densematch.match(a, b).index.reshape(-1)
        methods = {
            "densematch": lambda a=a, b=b: densematch.match(a, b).index,
            "blockwise": lambda a=a, b=b: blockwise_argmax(a, b),
        }
        if faiss is not None and args.device == "cpu":
            methods["faiss"] = lambda a=a, b=b: faiss_flat_ip(a, b)
        if n * n * 4 <= 4 * 2**30:
            methods["cdist"] = lambda a=a, b=b: cdist(a, b)
        base = None
        for name, fn in methods.items():
            t = timeit(fn, repeats=args.repeats)
            agree = (fn().reshape(-1).cpu() == ref.cpu()).float().mean().item()
            base = base or t["median"]
            rows.append(
                {
                    "size": size,
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
    path = save(args.name, {"machine": info, "command": " ".join(sys.argv), "rows": rows})
    print(f"\nmachine: {info}\nfloat32 matmul: {info['matmul_gflops']} GFLOP/s\n")
    print(table(rows, ["size", "method", "median_s", "min_s", "max_s", "gflops", "vs_densematch", "agree"]))
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
