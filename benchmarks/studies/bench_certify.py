"""What the certified half-precision search costs apart from its products, on any CPU.

Run: python benchmarks/studies/bench_certify.py [--sizes 96x96x64 ...] [--repeats 3] [--threads 1]

The device picks the certified bfloat16 search where it multiplies bfloat16 fast (AMX, AVX-512
BF16); this script forces it with ``config_context(half="bfloat16")`` on whatever CPU runs it and
measures what does not depend on the product's speed: candidates listed per row, the rows whose
candidates outgrew the cap (resolved without one), and the search's time beside the time of its
bfloat16 products alone (``torch.mm`` of the prepared rows over the same tiles), so that "certified
- products" is the certificate's own cost (bounds, merge, pool, re-scoring). On a CPU that emulates
bfloat16 (no AMX, no AVX-512 BF16) the products themselves are slower than float32's: compare the
overhead, not the totals. float32's own search is timed beside them, and so are the rows over the
cap: the time spent searching them again in float32, per row, against one query row's float32
product with every reference ("row again / f32 product row"). ``--features same-scene`` is the hard
case (:func:`densematch.app.synthetic.same_scene_pair`: raw colour patches of two overlapping
crops, not normalised), where bfloat16's bound leaves dozens of near-ties in every smooth region.
On such a CPU the difference also carries what the slow, emulated products do to the rest (they
leave its data out of the caches: at 96x96x64 l2, k=1, the rest read 94-99 ms beside float32
products of the same tiles in their place, 132-137 ms beside the emulated ones). So the products
are also recorded once and replayed (each tile copied into place, at memory speed, as a fast
product writes it): "overhead, replayed" is the search's time less the time inside its product
calls, with every other step as it runs (and the answer checked against the recorded search's),
and "replayed / float32" the median of its ratios to float32's search, the two run in turns. With
``--threads`` above 1 the replayed time keeps the tiles' copies (the threads' times inside them
overlap); "replayed less copies / float32" takes out their summed time over the thread count.
``--kernels auto torch`` times the certified step both ways in one run: one C call per tile
("auto", on a CPU with the C kernels) and torch's operators (``config_context(kernel="torch")``,
which keeps the C kernels out of both searches)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
import threading
import time

import densematch
from _common import photo_features, report, timeit
from densematch import engine
from densematch.app.synthetic import same_scene_pair
from densematch.engine.half import HalfSearch
from densematch.metrics import get_metric
from densematch.precision import Precision

# seconds spent searching rows over the cap again in float32 (one thread: summed)
AGAIN = {"seconds": 0.0}
_search_again = HalfSearch._search_again


def _timed_search_again(self, q, redo, start, best_v, best_i):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    _search_again(self, q, redo, start, best_v, best_i)
    AGAIN["seconds"] += time.perf_counter() - t0


HalfSearch._search_again = _timed_search_again  # type: ignore[method-assign]

# seconds inside the search's own half-precision products (HalfSearch._block), summed over
# the threads that make them
PRODUCTS = {"seconds": 0.0}
_PRODUCTS_LOCK = threading.Lock()
_block = HalfSearch._block
# the product tiles of one search, in the order it made them, while "record" is set; replayed in
# that order while "replay" is (one thread: the order is the search's own). With several threads
# the tiles come in any order, so each is kept under its reference block, its row count and a sum
# of the query block's first and last rows ("keyed")
TILES: dict = {"record": False, "replay": False, "made": [], "at": 0, "keyed": False, "by": {}}


def _tile_key(qh: torch.Tensor, j: int, n: int) -> tuple:
    return (j, n, qh.shape[0], float(qh[0].float().sum()), float(qh[-1].float().sum()))


def _timed_block(self, qh, j, n, out=None, **kw):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    if TILES["replay"]:  # _block's own steps, the product's tile copied in place of the product
        _, terms, bias = kw["sides"](j, j + n)
        if TILES["keyed"]:
            made = TILES["by"][_tile_key(qh, j, n)]
        else:
            made = TILES["made"][TILES["at"]]
            TILES["at"] += 1
        got = (out.copy_(made), terms, bias)
    else:
        got = _block(self, qh, j, n, out=out, **kw)
        if TILES["record"]:
            if TILES["keyed"]:
                TILES["by"][_tile_key(qh, j, n)] = got[0].clone()
            else:
                TILES["made"].append(got[0].clone())
    with _PRODUCTS_LOCK:
        PRODUCTS["seconds"] += time.perf_counter() - t0
    return got


HalfSearch._block = _timed_block  # type: ignore[method-assign]


def certified_parts(fn, repeats: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """Median (whole search, its own products, its rows searched again) over ``repeats`` calls
    after a warm-up, each part timed inside the same call: the overhead is read within one run,
    not as the difference of two noisy medians."""
    fn()
    runs = []
    for _ in range(repeats):
        PRODUCTS["seconds"] = AGAIN["seconds"] = 0.0
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0, PRODUCTS["seconds"], AGAIN["seconds"]))
    runs.sort(key=lambda r: r[0] - r[1])
    return runs[len(runs) // 2]


def replayed_rest(fn, plain, repeats: int) -> tuple[float, float, float] | None:  # type: ignore[no-untyped-def]
    """``fn``'s time less the time inside its product calls, its products recorded in a first
    call and replayed (see the module), and that time over ``plain``'s (float32's search), the
    two called in turns: the medians over ``repeats`` turns of the time and of each turn's ratio
    (this VM's speed drifts between the turns, less within one), and third, with several threads
    (where the time is the whole replayed search's, the tiles' copies in it), the ratio with the
    copies' time taken out as the threads share it (their sum over the thread count: exact for
    workers kept equally busy). None where the recorded tiles would pass :data:`REPLAY_BYTES`."""
    TILES.update(record=True, made=[], by={}, keyed=torch.get_num_threads() > 1)
    try:
        want = fn()
    finally:
        TILES["record"] = False
    if sum(t.numel() * t.element_size() for t in [*TILES["made"], *TILES["by"].values()]) > REPLAY_BYTES:
        TILES.update(made=[], by={})
        return None
    rests, ratios, less_copies = [], [], []
    threads = torch.get_num_threads()
    try:
        for turn in range(repeats + 1):  # (the first, a warm-up)
            TILES.update(replay=True, at=0)
            PRODUCTS["seconds"] = 0.0
            t0 = time.perf_counter()
            got = fn()
            # (with several threads the copies' times overlap: the whole replayed search is kept)
            rest = time.perf_counter() - t0 - (PRODUCTS["seconds"] if not TILES["keyed"] else 0.0)
            TILES["replay"] = False
            if not torch.equal(got[1], want[1]):
                raise AssertionError("the replayed search found other matches than the recorded one")
            t0 = time.perf_counter()
            plain()
            if turn:
                took = time.perf_counter() - t0
                rests.append(rest)
                ratios.append(rest / took)
                copies = PRODUCTS["seconds"] / threads if TILES["keyed"] else 0.0
                less_copies.append((rest - copies) / took)
    finally:
        TILES.update(replay=False, made=[], by={})
    return sorted(rests)[repeats // 2], sorted(ratios)[repeats // 2], sorted(less_copies)[repeats // 2]


# the most bytes of product tiles kept for a replay (96x96 against 96x96: 170 MB)
REPLAY_BYTES = 2**30


def median_time(fn, repeats: int) -> float:
    return timeit(fn, repeats=repeats)["median"]


def products_only(
    a: torch.Tensor, b: torch.Tensor, metric: str, tiles: tuple[int, int], dtype: torch.dtype = torch.bfloat16
) -> None:
    """The products of a search over tiles of ``tiles`` rows in ``dtype``, nothing else."""
    m = get_metric(metric)
    q = m.prepare(a, "query", torch.float32).to(dtype)
    r = m.prepare(b, "ref", torch.float32).to(dtype)
    ta, tb = tiles
    out = torch.empty(ta, tb, dtype=dtype)
    for i in range(0, q.shape[0], ta):
        for j in range(0, r.shape[0], tb):
            qi, rj = q[i : i + ta], r[j : j + tb]
            torch.mm(qi, rj.T, out=out[: qi.shape[0], : rj.shape[0]])


def measure(
    a: torch.Tensor,
    b: torch.Tensor,
    metric: str,
    k: int,
    repeats: int,
    candidates: int | None = None,
    fast: bool = True,
) -> dict[str, float]:
    """One case: the certified search's counts and times beside its products' and float32's
    (``candidates``: the certificate's cap per row, None for the default), and without ``fast``,
    the bfloat16 ranking alone left out."""
    kw = dict(metric=metric, k=k, budget=2**28)
    bf16 = Precision(half=torch.bfloat16, candidates=candidates)
    plan = engine.plan_tiles(
        a.shape[0], b.shape[0], a.shape[1], k, 2**28, metric=metric, device=a.device, precision=bf16
    )
    stats: dict[str, int] = {}
    engine.topk(a, b, **kw, precision=bf16, stats=stats)
    certified, products, again = certified_parts(lambda: engine.topk(a, b, **kw, precision=bf16), repeats)
    replayed = replayed_rest(lambda: engine.topk(a, b, **kw, precision=bf16), lambda: engine.topk(a, b, **kw), repeats)
    tiles = (plan.tile_a, plan.tile_b)
    plain = median_time(lambda: engine.topk(a, b, **kw), repeats)
    f32_products = median_time(lambda: products_only(a, b, metric, tiles, torch.float32), repeats)
    row = f32_products / a.shape[0]  # one query row's float32 product against every reference
    alone = torch.get_num_threads() == 1  # (else the parts' times, summed over threads, overlap)
    over = stats["fallback"]
    got = {
        "cap": bf16.cap(k, b.shape[0], b.shape[1]),
        "candidates/row": round(stats["candidates"] / stats["rows"], 2),
        "most": stats["most"],
        "over %": round(100 * over / stats["rows"], 2),
        "certified ms": round(1e3 * certified, 1),
        "its bf16 products ms": round(1e3 * products, 1),
        "overhead ms": round(1e3 * (certified - products), 1) if alone else None,
        "float32 ms": round(1e3 * plain, 1),
        "overhead / float32": round((certified - products) / plain, 3) if alone else None,
        "overhead, replayed ms": None if replayed is None else round(1e3 * replayed[0], 1),
        "replayed / float32": None if replayed is None else round(replayed[1], 3),
        "replayed less copies / float32": None if replayed is None or alone else round(replayed[2], 3),
        "row again / f32 product row": round(again / over / row, 2) if over and alone else None,
    }
    if fast:  # the bfloat16 ranking alone, beside the bare bfloat16 products of its tiles
        fast_p = Precision("fast", half=torch.bfloat16, certify=False)
        took = median_time(lambda: engine.topk(a, b, **kw, precision=fast_p), repeats)
        bare = median_time(lambda: products_only(a, b, metric, tiles), repeats)
        _, fast_i = engine.topk(a, b, **kw, precision=fast_p)
        _, f32_i = engine.topk(a, b, **kw)
        got["fast ms"] = round(1e3 * took, 1)
        got["fast - bf16 products ms"] = round(1e3 * (took - bare), 1)
        got["fast: other top-1 %"] = round(100 * float((fast_i[:, 0] != f32_i[:, 0]).float().mean()), 1)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["96x96x64", "96x96x128", "64x64x256", "48x48x384", "40x40x768"])
    p.add_argument("--metrics", nargs="+", default=["cosine", "dot", "l2"])
    p.add_argument("--ks", nargs="+", type=int, default=[1, 8])
    p.add_argument("--features", nargs="+", default=["noise", "photo", "same-scene"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "torch"])
    p.add_argument(
        "--candidates", nargs="+", type=int, default=[0], help="the cap per row to try (0: the default rule)"
    )
    p.add_argument("--no-fast", action="store_true", help='leave "fast" (the bfloat16 ranking alone) out')
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (the search's workers); above 1 the times inside the products overlap, so "
        '"overhead" is left out, "overhead, replayed" keeps the tiles\' copies and "replayed less copies" '
        "takes their summed time over the threads out",
    )
    p.add_argument("--name", default="certify")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for size in args.sizes:
        h, w, c = map(int, size.split("x"))
        for features in args.features:
            if features == "photo":
                fa, fb = photo_features(h, w, c)
            elif features == "same-scene":
                fa, fb = same_scene_pair(h, w, c)
            else:
                g = torch.Generator().manual_seed(0)
                fa, fb = torch.randn(h, w, c, generator=g), torch.randn(h, w, c, generator=g)
            a, b = fa.reshape(-1, c).contiguous(), fb.reshape(-1, c).contiguous()
            for metric in args.metrics:
                for k in args.ks:
                    for kernel in args.kernels:
                        for cap in args.candidates:
                            row = {"size": size, "features": features, "metric": metric, "k": k, "step": kernel}
                            with densematch.config_context(kernel=kernel):
                                row.update(measure(a, b, metric, k, args.repeats, cap or None, not args.no_fast))
                            rows.append(row)
                            print(row, flush=True)
    report(args.name, rows)


if __name__ == "__main__":
    main()
