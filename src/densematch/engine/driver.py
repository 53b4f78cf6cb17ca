"""The driver: :func:`topk` chooses the strategy once, plans its tiles with that strategy's own
memory model, and runs the tile loop with its out-of-memory retry."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable

import torch

from .. import kernels
from ..metrics import Metric, get_metric
from ..precision import FLOAT32, Precision
from ..threads import own_thread, share_out, share_size, workers_for
from .fused import KernelSearch
from .half import HalfSearch
from .plain import PlainSearch
from .plan import Dims, TilePlan, fit_tiles
from .products import strict_products
from .strategy import Inputs, Prepared, Strategy, rows_of

__all__ = ["choose", "plan_tiles", "prepare", "topk"]


def choose(precision: Precision, metric: Metric, k: int, device: torch.device) -> type[Strategy]:
    """The strategy that runs a top-``k`` search of ``metric`` on ``device``: the fused kernel
    where ``precision.backend`` wants it (:func:`densematch.kernels.wanted`), else the certified
    half-precision search where ``precision.half`` is set, else the plain one."""
    precision.check(metric)
    if kernels.wanted(precision.backend, device, metric, k):
        return KernelSearch
    return PlainSearch if precision.half is None else HalfSearch


def _item(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


# The grown candidate cap is taken where it costs at most this many times the tile pairs of the
# base cap: a row over the cap is searched again at the price of about two float32 product rows,
# a tile pair costs its step's overhead. At two threads under the default memory, k=8, same-scene
# features: 128x128x384 cosine / l2 the default search 0.84 / 0.65 of the base cap's time, 80x80x768
# 0.87 (10-20% more tiles), random features 1.00-1.02 (BENCHMARKS.md, issue 39)
_GROWN_CAP_TILES = 2.0


def _plan(
    strategy: type[Strategy],
    na: int,
    nb: int,
    c: int,
    k: int,
    budget: int,
    *,
    metric: Metric,
    device: torch.device,
    precision: Precision,
    in_dtype: torch.dtype,
    tiles: tuple[int | None, int | None] | None,
    reserved: int,
    share: int | None = None,
    workers: int = 1,
) -> tuple[Dims, TilePlan]:
    """The dims and tile plan of a search on ``workers`` threads, with the grown candidate cap
    where it costs at most :data:`_GROWN_CAP_TILES` times the tiles (query tiles of at most
    ``share`` rows where workers take shares of them)."""
    grown, base = strategy.cap(precision, metric, k, nb, c), strategy.cap(precision, metric, k, 0, c)

    def planned(cap: int, caps: tuple[int, int]) -> tuple[Dims, TilePlan]:
        dims = Dims(
            na=na,
            nb=nb,
            c=c,
            cp=c + metric.extra_columns,
            k=k,
            item=_item(precision.dtype),
            in_item=_item(in_dtype),
            half_item=0 if precision.half is None else _item(precision.half),
            cdist=not metric.matrix,
            cap=cap,
        )
        plan = fit_tiles(
            dims,
            budget,
            strategy.working_set,
            caps=caps,
            narrowest_b=strategy.narrowest_b,
            tiles=tiles,
            reserved=reserved,
            workers=workers,
        )
        return dims, plan

    # (its ValueError, where even one tile does not fit, is the call's)
    chosen = planned(base, strategy.tile_caps(device, na, nb))
    if grown > base:
        # a cap grown with the references saves searching rows again, but not at the price of
        # many more tiles or the references prepared per tile: where the budget binds hard, the
        # base cap. Planned at the strategy's caps and, where it has them, at narrower ones (a
        # wider reference tile holds more per query row); the fewer tiles of the two
        limit = _GROWN_CAP_TILES * _tiles(na, nb, chosen[1], share)
        options = [strategy.tile_caps(device, na, nb), strategy.narrower_caps(device, na, nb)]
        for caps in options if tiles is None else options[:1]:
            if caps is None:
                continue
            with contextlib.suppress(ValueError):
                wide = planned(grown, caps)
                count = _tiles(na, nb, wide[1], share)
                if count <= limit and wide[1].whole_b >= chosen[1].whole_b:
                    chosen, limit = wide, count - 1  # (the narrower caps only with fewer tiles)
    return chosen


def _tiles(na: int, nb: int, plan: TilePlan, share: int | None = None) -> int:
    """How many (query tile, reference tile) pairs ``plan`` searches ``na`` x ``nb`` rows in,
    its query tiles cut to ``share`` rows where workers take shares."""
    ta = plan.tile_a if share is None else min(plan.tile_a, share)
    return -(-na // ta) * -(-nb // plan.tile_b)


def plan_tiles(
    na: int,
    nb: int,
    c: int,
    k: int,
    budget: int,
    *,
    metric: str | Metric,
    device: torch.device,
    precision: Precision = FLOAT32,
    in_dtype: torch.dtype = torch.float32,
    tiles: tuple[int | None, int | None] | None = None,
    reserved: int = 0,
) -> TilePlan:
    """The tiles :func:`topk` would use for these sizes: the strategy it would choose, planned
    with that strategy's memory model (:func:`densematch.engine.plan.fit_tiles`).

    Raises
    ------
    ValueError
        When even tiles of one row do not fit, naming the minimum budget.
    """
    m = get_metric(metric)
    strategy = choose(precision, m, k, device)
    _, plan = _plan(
        strategy,
        na,
        nb,
        c,
        k,
        budget,
        metric=m,
        device=device,
        precision=precision,
        in_dtype=in_dtype,
        tiles=tiles,
        reserved=reserved,
    )
    return plan


def peak(x: torch.Tensor, rows: torch.Tensor | None, step: int, workers: int = 1) -> float:
    """The largest magnitude of the rows searched, read at most ``step`` rows at a time, shared
    out over ``workers`` threads."""
    n = x.shape[0] if rows is None else rows.numel()
    if workers > 1:  # one worker reads whole tiles (on a GPU, each tile's read is a sync)
        step = min(step, share_size(n, workers))
    step = max(1, step)
    tops = [0.0]

    def tile(start: int) -> None:
        low, high = torch.aminmax(rows_of(x, rows, start, start + step))
        tops.append(max(-float(low), float(high)))

    share_out(range(0, n, step), tile, workers, name="densematch-peak")
    return max(tops)


def common_scale(top: float) -> float:
    """A power of two that brings ``top``, the largest magnitude of the rows searched, into
    [1, 2) when it lies outside [2^-32, 2^32], else 1. Rankings do not change under a common
    positive scale, and without it the l2 expansion's squared norms (and float32 copies of
    float64 features) overflow from about 1e19 (3.4e38 for float64 inputs) and underflow below
    about 1e-19."""
    if top == 0.0 or 2.0**-32 <= top <= 2.0**32:
        return 1.0
    return 2.0 ** -math.floor(math.log2(top))


def prepare(
    b: torch.Tensor,
    *,
    metric: str | Metric,
    k: int,
    precision: Precision = FLOAT32,
    rows_b: torch.Tensor | None = None,
) -> Prepared:
    """Prepare the references ``b`` (N, C) once, for :func:`topk` calls with other queries and
    the same ``metric``, ``k`` and ``precision`` (``topk(..., prepared=...)``): normalised,
    centred, with their norms, as the chosen strategy needs them. The prepared rows, about the
    size of ``b`` in the compute dtype, belong to the caller, as ``b`` does: outside the budget
    of every search."""
    metric = get_metric(metric)
    strategy = choose(precision, metric, k, b.device)
    nb = b.shape[0] if rows_b is None else rows_b.numel()
    tile_b = min(nb, strategy.tile_caps(b.device, 1, nb)[1])
    plan = TilePlan(1, max(1, tile_b), True, 0)
    with torch.inference_mode():
        top = peak(b, rows_b, plan.tile_b)
        inputs = Inputs(
            b[:0],
            b,
            None,
            rows_b,
            metric,
            precision,
            k,
            common_scale(top),
            strategy.cap(precision, metric, k, nb, b.shape[1]),
            ops=kernels.ops_for(precision.c_kernels, b.device, precision.dtype),
        )
        return strategy(inputs, plan).prepared(top)


def topk(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    metric: str | Metric,
    k: int,
    budget: int,
    precision: Precision = FLOAT32,
    rows_a: torch.Tensor | None = None,
    rows_b: torch.Tensor | None = None,
    tiles: tuple[int | None, int | None] | None = None,
    on_tile: Callable[[int], None] | None = None,
    reserved: int = 0,
    stats: dict[str, int] | None = None,
    prepared: Prepared | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of every query row over the reference rows, tiled within ``budget`` bytes.

    Parameters
    ----------
    a : Tensor of shape (Na, C)
        Query rows, any float dtype, any strides (a transposed view costs no copy).
    b : Tensor of shape (Nb, C)
        Reference rows, on the same device.
    metric : str or Metric
        One of :data:`densematch.metrics.METRICS`.
    k : int
        How many best rows to keep; slots beyond the references available get index -1.
    budget : int
        Hard cap, in bytes, on the working memory of the call (see :func:`plan_tiles`).
    precision : Precision, default=FLOAT32
        How to rank (:class:`densematch.precision.Precision`: compute dtype, half-precision
        operands, certification, backend), as :func:`densematch.precision.resolve_precision`
        made it from ``precision=`` and the config. The default: plain float32, near-ties
        settled by the direct form, the fused kernel on CUDA devices with Triton.
    rows_a : Tensor of shape (na,), int64, optional
        Only these query rows are ranked (the rows of the result follow this order).
    rows_b : Tensor of shape (nb,), int64, increasing, optional
        Only these reference rows can be chosen.
    tiles : (int or None, int or None), optional
        Force the tile sizes (tests use tiny tiles to force many merges).
    on_tile : callable, optional
        Called with the number of query rows finished after each query tile (progress bars).
    reserved : int, default=0
        Bytes of ``budget`` the caller already holds (they shrink the tiles).
    stats : dict, optional
        Filled with counts of the searches that list candidates (certified half precision, and
        float32's near-tie settling): ``rows``, ``candidates`` (listed in all, rows over the cap
        aside), ``most`` (the most for one row) and ``fallback`` (rows whose candidates outgrew
        the cap, resolved without one).
    prepared : Prepared, optional
        ``b`` as :func:`prepare` made it ready (same ``b``, ``rows_b``, metric, k and
        precision): used when this search runs the same strategy at the same scale, else ignored.

    Returns
    -------
    value : Tensor of shape (na, k), ``precision.dtype``
        The metric's value of each chosen pair, recomputed directly from the two rows:
        similarity for cosine and dot, distance otherwise; NaN in empty slots.
    index : Tensor of shape (na, k), int64
        Row of ``b`` chosen, best first; equal scores go to the lower row; -1 in empty slots.
    """
    metric = get_metric(metric)
    na = a.shape[0] if rows_a is None else rows_a.numel()
    nb = b.shape[0] if rows_b is None else rows_b.numel()
    device = a.device
    strategy = choose(precision, metric, k, device)
    workers = tile_workers(device, na)
    # with workers, the caller's own operators run on itself alone: its OpenMP threads, once
    # woken, spin on the cores the workers take (9% of a two-thread search's CPU at 96x96x64)
    alone = own_thread if workers > 1 else contextlib.nullcontext
    with alone():
        value = torch.full((na, k), math.nan, dtype=precision.dtype, device=device)
        index = torch.full((na, k), -1, dtype=torch.int64, device=device)
    if stats is not None:
        stats.update(rows=na, candidates=0, most=0, fallback=0)
    if na == 0 or nb == 0:
        return value, index
    dims, plan = _plan(
        strategy,
        na,
        nb,
        a.shape[1],
        k,
        budget,
        metric=metric,
        device=device,
        precision=precision,
        in_dtype=a.dtype,
        tiles=tiles,
        reserved=reserved,
        share=share_size(na, workers, strategy.items_per_worker) if workers > 1 else None,
        workers=workers,
    )
    with torch.inference_mode(), strict_products(device), alone():
        top_a = peak(a, rows_a, plan.tile_a, workers)
        if prepared is not None:
            scale = common_scale(max(top_a, prepared.peak))
            if prepared.strategy is not strategy or scale != prepared.scale:
                prepared = None
        if prepared is None:
            scale = common_scale(max(top_a, peak(b, rows_b, plan.tile_a, workers)))
        ops = kernels.ops_for(precision.c_kernels, device, precision.dtype)
        inputs = Inputs(a, b, rows_a, rows_b, metric, precision, k, scale, dims.cap, stats, prepared, workers, ops)
        search = strategy(inputs, plan)
        if workers > 1:
            # tiles small enough that a worker slowed by other processes leaves little behind
            ta = even_tiles(na, min(plan.tile_a, share_size(na, workers, strategy.items_per_worker)), workers)
            _threaded(search, value, index, ta, workers, on_tile)
            return value, index
        ta = plan.tile_a
        buf = None
        start = 0
        while start < na:
            stop = min(start + ta, na)
            try:
                if buf is None:  # one block, reused by every tile pair
                    buf = search.block(ta)
                search.rank(value[start:stop], index[start:stop], start, buf)
            except torch.cuda.OutOfMemoryError:
                # another process took memory since the plan: halve the query tile and retry
                if ta == 1:
                    raise
                ta, buf = max(1, ta // 2), None
                torch.cuda.empty_cache()
                continue
            search.finalise(value[start:stop], index[start:stop], start)
            if on_tile is not None:
                on_tile(stop - start)
            start = stop
    return value, index


def even_tiles(n: int, most: int, workers: int) -> int:
    """Rows of each tile where ``n`` rows are cut into tiles of at most ``most`` for ``workers``
    threads: as many tiles as a multiple of the workers, all of one size but the last, so that
    none waits on a worker's last tile (72x72 rows in tiles of 1024 left five and a sixth of 64:
    one worker had a whole tile more)."""
    count = -(-n // max(1, most))
    count = -(-count // workers) * workers
    return max(1, -(-n // count))


# Below this many query rows a search is too short to share out
_MIN_THREADED_ROWS = 2048


def tile_workers(device: torch.device, na: int) -> int:
    """How many threads run query tiles at once (:mod:`densematch.threads`): on a CPU, one per
    intra-op thread of the caller, so that a search holds no OpenMP barrier per operator and a
    worker slowed by other processes takes fewer tiles; one on GPUs and for short searches."""
    return 1 if na < _MIN_THREADED_ROWS else workers_for(device)


def _threaded(
    search: Strategy,
    value: torch.Tensor,
    index: torch.Tensor,
    ta: int,
    workers: int,
    on_tile: Callable[[int], None] | None,
) -> None:
    """Rank and finalise the query tiles of ``ta`` rows on ``workers`` threads, each with its
    own score block."""
    na = value.shape[0]
    local = threading.local()
    lock = threading.Lock()

    def tile(start: int) -> None:
        if getattr(local, "buf", None) is None:
            local.buf = search.block(ta)
        stop = min(start + ta, na)
        search.rank(value[start:stop], index[start:stop], start, local.buf)
        search.finalise(value[start:stop], index[start:stop], start)
        if on_tile is not None:
            with lock:
                on_tile(stop - start)

    share_out(range(0, na, ta), tile, workers, name="densematch-tiles")
