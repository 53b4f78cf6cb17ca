"""How many rows a tighter rounding bound would keep under the certificate's cap (issue 39).

Run: python benchmarks/studies/cap_bounds.py [--sizes 96x96x64 ...] [--metrics cosine l2] [--ks 1 8]

The certified bfloat16 search lists, per query row, every reference whose half score raised by
its bound reaches the row's k-th best lower bound; a row with more candidates than the cap is
searched again in float32. On same-scene features (:func:`densematch.app.synthetic.same_scene_pair`)
the listing is long wherever a smooth region leaves dozens of references within bfloat16's
resolution of the best. This script counts, for the same rows, the candidates under each bound
below, in float64 and without timing anything, so it measures the same on every CPU:

- ``one bf16``: today's bound: one bfloat16 product per pair, its sum rounded to bfloat16 (as
  torch's CPU products store it);
- ``one bf16, f32 sum``: the same product with its float32 sum kept (a kernel that writes float32:
  CUDA's ``out_dtype``, the fused Triton kernel, oneDNN with a float32 destination);
- ``hi/lo, bf16 sums``: each row split into a bfloat16 high part and a bfloat16 low part, three
  products (high.high + high.low + low.high), each sum rounded to bfloat16;
- ``hi/lo, f32 sums``: the same three products with float32 sums.

The rows are prepared as the certified search prepares them (docs/precision.md): the query tile
centred on its mean, the references on their group of 32's mean, the rest added in float32, so
the half product multiplies only what tells near-identical patches apart. Each bound is the
rigorous one of its products (Cauchy-Schwarz on the measured residual norms, float32's
accumulation ``gamma``, one bfloat16 rounding of each stored sum). "over %" counts the rows over
the cap against each row's final floor: the search's running floor lists at least as many, so the
search's own share (``engine``, from its statistics) is the comparison for the first column. The
cap column repeats today's bound with 2x and 4x the cap (a larger pool kept in C).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import report
from densematch import engine
from densematch.app.synthetic import same_scene_pair
from densematch.metrics import get_metric
from densematch.precision import Precision

GROUP = 32
U = 2.0**-8  # bfloat16's unit roundoff
U32 = 2.0**-24


def bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 values rounded to bfloat16, back in float64."""
    return x.to(torch.bfloat16).to(torch.float64)


def prepared(a: torch.Tensor, b: torch.Tensor, metric: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query rows, reference rows (float64, prepared as the search prepares them) and a
    per-reference bias (l2's column kept out of the half product) such that the ranking score
    is ``q . r + bias``."""
    m = get_metric(metric)
    q, r = m.prepare(a, "query", torch.float64), m.prepare(b, "ref", torch.float64)
    bias = torch.zeros(r.shape[0], dtype=torch.float64)
    if m.extra_columns:
        bias, q, r = r[:, -1].clone(), q[:, :-1], r[:, :-1]
    if m.shiftable:  # the references' mean moves a row's scores all alike
        r = r - r.mean(0)
    return q, r, bias


def grouped(r: torch.Tensor) -> torch.Tensor:
    """References less their group of ``GROUP`` consecutive rows' mean."""
    out = r.clone()
    for g in range(0, r.shape[0], GROUP):
        out[g : g + GROUP] -= r[g : g + GROUP].mean(0)
    return out


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows as bfloat16 high and low parts and the residual left: ``x = hi + lo + rest``."""
    hi = bf16(x)
    lo = bf16(x - hi)
    return hi, lo, x - hi - lo


def half_scores(q: torch.Tensor, d: torch.Tensor, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(half scores, their bound) of the centred query rows ``q`` against the grouped
    references ``d`` under ``variant``."""
    c = q.shape[1]
    gamma = 2 * (c + 2) * U32 / (1 - (c + 2) * U32)
    nq, nd = q.norm(dim=1)[:, None], d.norm(dim=1)[None, :]
    if variant.startswith("one"):
        qh, dh = bf16(q), bf16(d)
        s = qh @ dh.T
        e = nq * (d - dh).norm(dim=1)[None, :] + (q - qh).norm(dim=1)[:, None] * dh.norm(dim=1)[None, :]
        e = e + gamma * qh.norm(dim=1)[:, None] * dh.norm(dim=1)[None, :]
        if variant.endswith("bf16"):
            s = bf16(s)
            e = e + U / (1 - U) * s.abs()
        return s, e
    (qh, ql, qr), (dh, dl, dr) = split(q), split(d)
    parts = [qh @ dh.T, qh @ dl.T, ql @ dh.T]
    n = lambda x: x.norm(dim=1)  # noqa: E731
    # a.d less the three products: ql.dl + (qh + ql).dr + qr.d
    e = n(ql)[:, None] * n(dl)[None, :] + n(qh + ql)[:, None] * n(dr)[None, :] + n(qr)[:, None] * nd
    e = e + gamma * (n(qh)[:, None] * (n(dh) + n(dl))[None, :] + n(ql)[:, None] * n(dh)[None, :])
    if variant.endswith("bf16 sums"):
        parts = [bf16(p) for p in parts]
        e = e + U / (1 - U) * sum(p.abs() for p in parts)
    s = parts[0] + parts[1] + parts[2]
    return s, e + 2 * U32 * s.abs()  # the two float32 additions of the parts


VARIANTS = ("one bf16", "one bf16, f32 sum", "hi/lo, bf16 sums", "hi/lo, f32 sums")


def count(a: torch.Tensor, b: torch.Tensor, metric: str, k: int, cap: int, tile: int) -> dict[str, object]:
    """Candidates per row and rows over the cap (and over 2x, 4x it) for every variant."""
    q, r, bias = prepared(a, b, metric)
    d = grouped(r)
    rest = r - d  # each reference's group centre, multiplied in float32
    cands = {v: [] for v in VARIANTS}
    for i in range(0, q.shape[0], tile):
        qt = q[i : i + tile]
        qc = qt - qt.mean(0)
        add = qc @ rest.T + (qt.mean(0) @ r.T + bias)[None, :]  # the float32 parts, exact here
        for v in VARIANTS:
            s, e = half_scores(qc, d, v)
            low, high = s + add - e, s + add + e
            floor = low.topk(k, dim=1).values[:, -1:]
            cands[v].append((high >= floor).sum(1))
    out: dict[str, object] = {}
    for v in VARIANTS:
        n = torch.cat(cands[v]).double()
        out[f"{v}: cand/row"] = round(float(n[n <= cap].mean()), 1)  # of the rows the cap keeps
        out[f"{v}: over %"] = round(100 * float((n > cap).double().mean()), 2)
        if v == "one bf16":
            out["one bf16: over 2x cap %"] = round(100 * float((n > 2 * cap).double().mean()), 2)
            out["one bf16: over 4x cap %"] = round(100 * float((n > 4 * cap).double().mean()), 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["96x96x64", "80x80x256", "56x56x768", "48x48x1536"])
    p.add_argument("--metrics", nargs="+", default=["cosine", "l2", "dot"])
    p.add_argument("--ks", nargs="+", type=int, default=[1, 8])
    p.add_argument("--name", default="cap-bounds")
    args = p.parse_args()
    rows = []
    for size in args.sizes:
        h, w, c = map(int, size.split("x"))
        fa, fb = same_scene_pair(h, w, c)
        a, b = fa.reshape(-1, c).contiguous(), fb.reshape(-1, c).contiguous()
        for metric in args.metrics:
            for k in args.ks:
                bf = Precision(half=torch.bfloat16)
                plan = engine.plan_tiles(
                    a.shape[0], b.shape[0], c, k, 2**28, metric=metric, device=a.device, precision=bf
                )
                cap = bf.cap(k, b.shape[0], b.shape[1])
                stats: dict[str, int] = {}
                engine.topk(a, b, metric=metric, k=k, budget=2**28, precision=bf, stats=stats)
                row: dict[str, object] = {"size": size, "metric": metric, "k": k, "cap": cap}
                row["engine: cand/row"] = round(stats["candidates"] / stats["rows"], 1)
                row["engine: over %"] = round(100 * stats["fallback"] / stats["rows"], 2)
                row.update(count(a, b, metric, k, cap, plan.tile_a))
                rows.append(row)
                print(row, flush=True)
    report(args.name, rows)


if __name__ == "__main__":
    main()
