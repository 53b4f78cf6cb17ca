"""Would int8 products make the certified search faster on a CPU without AMX? Two measurements.

Run: python benchmarks/studies/bench_int8.py [--rounds 7] [--rows 2000]

1. Products: one engine tile (query rows x 512 references x C) as torch's float32 ``mm`` against
   oneDNN's int8 product (``torch.ops.onednn.qlinear_pointwise``: 7-bit unsigned queries, since
   AVX2's ``vpmaddubsw`` saturates 16-bit pair sums at full 8 bits, and 8-bit signed references
   with a scale per row; float32 out), one thread, alternating, median over ``--rounds``. The
   time to quantize the query tile is given apart.
2. Candidates: an int8 score is within ``e = |dq| |r| + |q'| |dr|`` of the exact one (q' and r'
   the quantized rows, dq and dr what rounding left; Cauchy-Schwarz, the bound a certificate can
   use). Every pair scoring at least a row's k-th best minus ``2 e`` has to be re-scored. Counted
   for ``--rows`` query rows of noise and of real features (benchmarks/_common.photo_features),
   cosine, with queries scaled per row (each row's ranking does not change) and per tile; "over"
   is the share of rows with more candidates than the engine keeps (max(32, 4 k)).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import machine, photo_features, save, table


def product_times(tiles: list[tuple[int, int, int]], rounds: int) -> list[dict]:
    rows = []
    with torch.inference_mode():
        for m, n, c in tiles:
            g = torch.Generator().manual_seed(0)
            a = torch.randn(m, c, generator=g)
            b = torch.randn(n, c, generator=g)
            out = torch.empty(m, n)
            step = float(a.abs().max()) / 63
            qa = (a / step).round_().add_(64).to(torch.uint8)
            qb = torch.randint(-127, 128, (n, c), dtype=torch.int8, generator=g)
            packed = torch.ops.onednn.qlinear_prepack(qb, [m, c])
            scales, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)

            def int8(qa=qa, packed=packed, scales=scales, zeros=zeros, step=step):
                return torch.ops.onednn.qlinear_pointwise(
                    qa, step, 64, packed, scales, zeros, None, 1.0, 0, torch.float32, "none", [], ""
                )

            def quantize(a=a, step=step):
                return (a / step).round_().add_(64).to(torch.uint8)

            methods = {"float32 mm": lambda a=a, b=b, out=out: torch.mm(a, b.T, out=out), "int8": int8}
            methods["quantize queries"] = quantize
            times: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(rounds):
                for name, fn in methods.items():
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(5):
                        fn()
                    times[name].append((time.perf_counter() - t0) / 5)
            exact = (qa.double() - 64) @ qb.double().T * step
            error = float((int8().double() - exact).abs().max() / exact.abs().max())
            base = statistics.median(times["float32 mm"])
            for name, t in times.items():
                ms = statistics.median(t) * 1e3
                row = {
                    "tile": f"{m}x{n}x{c}",
                    "method": name,
                    "ms": round(ms, 3),
                    "x float32": round(ms / 1e3 / base, 3),
                }
                # the int8 product's largest error against the exact integer sums, relative to
                # the largest sum: float32's rounding of the result (about 6e-8), no saturation
                row["int8 error"] = f"{error:.1e}" if name == "int8" else ""
                rows.append(row)
                print(rows[-1], flush=True)
    return rows


def candidates(a: torch.Tensor, b: torch.Tensor, k: int, per_row: bool) -> torch.Tensor:
    """Candidates per query row of the certified int8 search of unit rows (float64 arithmetic)."""
    a = torch.nn.functional.normalize(a.double(), dim=1)
    b = torch.nn.functional.normalize(b.double(), dim=1)
    step_b = b.abs().amax(1, keepdim=True) / 127
    rb = (b / step_b).round() * step_b
    dr = torch.linalg.vector_norm(b - rb, dim=1)
    step_a = a.abs().amax(1, keepdim=True) / 63 if per_row else a.abs().amax() / 63
    ra = (a / step_a).round() * step_a
    dq = torch.linalg.vector_norm(a - ra, dim=1)
    s = ra @ rb.T
    e = dq[:, None] * torch.linalg.vector_norm(b, dim=1).max() + torch.linalg.vector_norm(ra, dim=1)[:, None] * dr.max()
    floor = s.topk(k, dim=1).values[:, -1:] - 2 * e
    return (s >= floor).sum(1).double()


def candidate_counts(rows: int) -> list[dict]:
    out = []
    for h, w, c in [(160, 160, 64), (80, 80, 384)]:
        g = torch.Generator().manual_seed(0)
        inputs = {
            "noise": (torch.randn(h * w, c, generator=g), torch.randn(h * w, c, generator=g)),
            "photo": tuple(x.reshape(h * w, c) for x in photo_features(h, w, c)),
        }
        for features, (a, b) in inputs.items():
            a = a[:: max(1, a.shape[0] // rows)][:rows]
            for k in (1, 8):
                for per_row in (False, True):
                    n = candidates(a, b, k, per_row)
                    cap = max(32, 4 * k)
                    out.append(
                        {
                            "size": f"{h}x{w}x{c}",
                            "features": features,
                            "k": k,
                            "query scale": "per row" if per_row else "per tile",
                            "mean": round(float(n.mean()), 1),
                            "p99": round(float(n.quantile(0.99)), 1),
                            "over": round(float((n > cap).double().mean()), 3),
                        }
                    )
                    print(out[-1], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--rows", type=int, default=2000, help="query rows whose candidates are counted")
    p.add_argument("--name", default="int8")
    args = p.parse_args()
    torch.set_num_threads(1)
    info = machine()
    products = product_times([(1024, 512, 64), (800, 512, 384), (1024, 512, 384)], args.rounds)
    print(table(products, ["tile", "method", "ms", "x float32", "int8 error"]))
    counts = candidate_counts(args.rows)
    print(table(counts, ["size", "features", "k", "query scale", "mean", "p99", "over"]))
    save(args.name, {"machine": info, "products": products, "candidates": counts})


if __name__ == "__main__":
    main()
