"""The tiled top-k engine: for every query row, the k best reference rows under a metric.

Queries are cut into tiles of ``tile_a`` rows and references into tiles of ``tile_b`` rows. One
(tile_a, tile_b) block of scores lives at a time, in a buffer reused for every block, and a
running top-k per query row is merged block by block, so memory is bounded by the plan and never
by Na * Nb. The merge is cheap: a block's row maxima (a fast vectorised reduction) say which rows
can improve at all, and only those rows pay for an argmax or a top-k. After the first few blocks
most rows cannot, so the block is read once more in cache rather than written and re-read from
main memory.

Everything here works on flat (N, C) rows. Layouts, batches, masks and filters live in
:mod:`densematch.match`; this module only ranks.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from . import kernels
from .budget import chunk_rows
from .metrics import Metric, get_metric
from .precision import product_slack, query_terms, ref_terms, unit_roundoff

__all__ = ["TilePlan", "plan_tiles", "topk"]

# Tile caps (query rows, reference rows). On a CPU, tall and narrow blocks won: 4096 x 512 ran
# 1.3x faster than 1024 x 2048 at C=64 (benchmarks/bench_match.py --sweep-tiles, BENCHMARKS.md).
MAX_TILES = {"cpu": (4096, 512), "cuda": (8192, 16384)}
# Candidates kept per row by the certified half-precision search (at least 4 k): enough for the
# near-ties of real features; a row with more is searched again in float32 (docs/precision.md).
CANDIDATES = 32


@dataclass(frozen=True)
class TilePlan:
    """Tile sizes, and whether the prepared references are kept whole, with its byte count."""

    tile_a: int
    tile_b: int
    whole_b: bool
    bytes: int


def _rescore_bytes(c: int) -> int:
    """Bytes to re-score one candidate by the direct form: its raw query and reference rows
    gathered, their copies in the compute dtype, and their difference or unit copies (8-byte
    items at most), and its indices and score."""
    return 6 * 8 * c + 64


def _working_set(
    ta: int,
    tb: int,
    *,
    na: int,
    nb: int,
    c: int,
    cp: int,
    k: int,
    item: int,
    in_item: int,
    whole_b: bool,
    cdist: bool,
    half_item: int = 0,
    cap: int = 0,
    ties: int = 0,
    kernel: bool = False,
) -> int:
    """Bytes one call of :func:`topk` holds at once for tiles of (ta, tb). Each term is named.
    ``half_item`` is the byte size of half-precision operands (0: none), ``cap`` the candidates
    kept per row by the certified search, ``ties`` those kept by the plain search's near-tie
    pool, and ``kernel`` says the fused kernel ranks (its score
    tiles never leave the chip)."""
    row_prep = cp * (item + half_item) + c * in_item  # a gathered raw row, its prepared copies
    refs = (nb if whole_b else tb) * row_prep  # prepared references: all, or one tile
    queries = ta * row_prep  # one prepared tile of queries
    block_item = half_item or item
    state = na * k * (item + 8)  # running top-k: value + int64 index
    merge = ta * 2 * k * (item + 8) * 3  # candidates of a merge, and their sorts
    final = ta * k * c * (in_item + 4 * item)  # chosen rows regathered, repeated, differenced
    rescore = ta * _rescore_bytes(c)  # certified: one chunk of candidates re-scored
    if kernel:
        # the kernel's running top-k (value + int32 index, k slots rounded up), and the
        # certificate's candidate slots, counters and bound terms
        state += ta * 2 * max(2, k) * 8
        pool = ta * cap * 28 + rescore + (nb if whole_b else tb) * 3 * item if cap else 0
        return refs + queries + state + merge + final + pool
    scores = ta * tb * block_item * (2 if cdist else 1)  # the reused block; cdist also makes its own
    reduce = ta * tb * (block_item if k == 1 else 2 * block_item + 1)  # rows that improve, ties check
    # certified search: candidate pool (row, column, score: 20 bytes, up to twice cap per row
    # while pruning, and the sorts that pick the best), the bound and lower-bound blocks and the
    # references' bound terms; the re-scoring chunk reuses the score block
    pool = 0
    if cap:
        # per pair: the bound and lower-bound blocks, |h| and the hot rows' half scores, and the
        # pool's gathered upper bounds with their pass mask; per row: the candidate pool and
        # the bound terms' float32 copy of the half rows (query tile and references)
        pool = (
            ta * cap * 20 * 4
            + ta * tb * (3 * item + 2 * block_item + 1)
            + (nb if whole_b else tb) * (3 * item + cp * item)
            + ta * cp * item
        )
    if ties:
        # the near-tie pool (row, column, score, up to twice ties per row while pruning, and its
        # sorts), each tile's row maxima, the gathered query rows and the pass mask of a
        # recomputed block, and the re-scoring chunk
        tiles = -(-nb // max(tb, 1))
        pool += ta * ties * 20 * 4 + ta * tiles * (item + 1) + ta * (cp * item + tb + 8) + ta * _rescore_bytes(c)
    return refs + queries + scores + reduce + state + merge + final + pool


def plan_tiles(
    na: int,
    nb: int,
    c: int,
    k: int,
    budget: int,
    *,
    metric: Metric,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    in_dtype: torch.dtype = torch.float32,
    tiles: tuple[int | None, int | None] | None = None,
    reserved: int = 0,
    half: torch.dtype | None = None,
    cap: int = 0,
    ties: int = 0,
    kernel: bool = False,
) -> TilePlan:
    """Choose tile sizes whose whole working set fits in ``budget`` bytes.

    References are tiled first at the device's preferred size, query tiles take what is left,
    and the reference tile halves while query tiles would drop below 64 rows. References are
    prepared once, whole, when they take at most half the budget. For the fused kernel, which
    holds no score block, both tiles may span everything.

    Raises
    ------
    ValueError
        When even tiles of one row do not fit, naming the minimum budget. ``reserved`` bytes
        of the budget are already taken by the caller and count towards that minimum.
    """
    cap_a, cap_b = (na, nb) if kernel else MAX_TILES.get(device.type, MAX_TILES["cuda"])
    fixed_a, fixed_b = tiles if tiles is not None else (None, None)
    cap_a = min(fixed_a or cap_a, na)
    cap_b = min(fixed_b or cap_b, nb)
    kw = dict(
        na=na,
        nb=nb,
        c=c,
        cp=c + metric.extra_columns,
        k=k,
        item=torch.finfo(dtype).bits // 8,
        in_item=torch.finfo(in_dtype).bits // 8,
        cdist=metric.p is not None,
        half_item=0 if half is None else torch.finfo(half).bits // 8,
        cap=cap,
        ties=ties,
        kernel=kernel,
    )
    minimum = _working_set(1, 1, whole_b=False, **kw) + reserved
    chunk_rows(budget, minimum, "one tile", fix=f"raise memory (C={c}, k={k}, {na} query rows)")

    total, budget = budget, budget - reserved

    def fit(tb: int, whole_b: bool) -> int:
        spare = budget - _working_set(0, tb, whole_b=whole_b, **kw)
        per_row = _working_set(1, tb, whole_b=whole_b, **kw) - _working_set(0, tb, whole_b=whole_b, **kw)
        return min(cap_a, spare // per_row) if spare > 0 else 0

    whole_b = _working_set(0, 0, whole_b=True, **kw) <= budget // 2 and fit(cap_b, True) >= min(na, 64)
    tb = cap_b
    while True:
        ta = fit(tb, whole_b)
        # the kernel holds no score block: narrower reference tiles only cost it more launches
        if fixed_b or tb == 1 or ta >= min(cap_a, 64) or (kernel and tb <= 1024):
            break
        tb = max(1, tb // 2)
    if ta < 1:  # raises: not even one query row fits beside this reference tile
        chunk_rows(total, _working_set(1, tb, whole_b=whole_b, **kw) + reserved, f"one tile of tile_b={tb}")
    return TilePlan(int(ta), int(tb), whole_b, _working_set(int(ta), tb, whole_b=whole_b, **kw))


def _rows(x: torch.Tensor, rows: torch.Tensor | None, start: int, stop: int) -> torch.Tensor:
    return x[start:stop] if rows is None else x.index_select(0, rows[start:stop])


def _merge_best(s: torch.Tensor, offset: int, best_v: torch.Tensor, best_i: torch.Tensor) -> torch.Tensor:
    """k = 1: keep each row's maximum; an equal score from a later tile never wins. Returns the
    block's row maxima. (Row maxima, then the argmax of the rows that improve, ran faster here
    than one ``max`` with indices, which also finds the column of rows that do not improve.)"""
    rowmax = s.amax(1)
    need = rowmax > best_v[:, 0]
    rows = need.nonzero().squeeze(1)
    n = rows.numel()
    if n == 0:
        return rowmax
    if 4 * n >= s.shape[0]:
        arg = s.argmax(1)
        best_v[:, 0] = torch.where(need, rowmax, best_v[:, 0])
        best_i[:, 0] = torch.where(need, arg + offset, best_i[:, 0])
    else:
        best_v[rows, 0] = rowmax[rows].to(best_v.dtype)
        best_i[rows, 0] = s.index_select(0, rows).argmax(1) + offset
    return rowmax


def _topk_lowest_index(sub: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise top-k where equal scores go to the lowest column, best first."""
    v, i = sub.topk(k, dim=1)
    # topk breaks ties arbitrarily: rows with more candidates >= the k-th value than k have a
    # tie at the boundary, and only those rows pay for a stable sort (in chunks of one tile).
    crowded = ((sub >= v[:, -1:]).sum(1) > k).nonzero().squeeze(1)
    item = sub.element_size()
    step = max(1, sub.shape[0] * item // (item + 8))
    for start in range(0, crowded.numel(), step):
        rows = crowded[start : start + step]
        sv, si = sub.index_select(0, rows).sort(dim=1, descending=True, stable=True)
        v[rows], i[rows] = sv[:, :k], si[:, :k]
    return _order(v, i)


def _order(v: torch.Tensor, i: torch.Tensor, descending: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort each row by value, equal values by index; index -1 (an empty slot) goes last."""
    key = torch.where(i < 0, torch.iinfo(torch.int64).max, i)
    by_index = key.argsort(dim=1, stable=True)
    v, i = v.gather(1, by_index), i.gather(1, by_index)
    by_value = v.argsort(dim=1, descending=descending, stable=True)
    return v.gather(1, by_value), i.gather(1, by_value)


def _merge_topk(s: torch.Tensor, offset: int, best_v: torch.Tensor, best_i: torch.Tensor) -> torch.Tensor:
    """k > 1: merge a block's top-k into the running top-k of the rows that can improve.
    Returns the block's row maxima."""
    k = best_v.shape[1]
    rowmax = s.amax(1)
    rows = (rowmax > best_v[:, -1]).nonzero().squeeze(1)
    if rows.numel() == 0:
        return rowmax
    sub = s if rows.numel() == s.shape[0] else s.index_select(0, rows)
    v, i = _topk_lowest_index(sub, min(k, s.shape[1]))
    cand_v = torch.cat([best_v[rows], v.to(best_v.dtype)], dim=1)
    cand_i = torch.cat([best_i[rows], i + offset], dim=1)
    cand_v, cand_i = _order(cand_v, cand_i)
    best_v[rows], best_i[rows] = cand_v[:, :k], cand_i[:, :k]
    return rowmax


_STRICT_LOCK = threading.Lock()
_strict_users = 0
_strict_saved: tuple[str, bool, bool] | None = None
_STRICT = ("highest", False, False)


def _product_settings() -> tuple[str, bool, bool]:
    cuda = torch.backends.cuda.matmul
    return (
        torch.get_float32_matmul_precision(),
        cuda.allow_fp16_reduced_precision_reduction,
        cuda.allow_bf16_reduced_precision_reduction,
    )


def _apply_product_settings(settings: tuple[str, bool, bool]) -> None:
    cuda = torch.backends.cuda.matmul
    if torch.get_float32_matmul_precision() != settings[0]:
        torch.set_float32_matmul_precision(settings[0])
    cuda.allow_fp16_reduced_precision_reduction, cuda.allow_bf16_reduced_precision_reduction = settings[1:]


def _is_strict(settings: tuple[str, bool, bool], device: torch.device) -> bool:
    # the reduced-precision sums are cuBLAS's: on a CPU only the float32 precision matters
    return settings == _STRICT if device.type == "cuda" else settings[0] == _STRICT[0]


@contextlib.contextmanager
def _strict_products(device: torch.device) -> Iterator[None]:
    """IEEE float32 products, and float32 sums inside half-precision ones, for this search:
    the results (and the rounding bound) assume them, whatever the process set (TF32 or
    bfloat16 through ``torch.set_float32_matmul_precision``, cuBLAS's reduced-precision half
    reductions).

    Where the settings already are strict for ``device`` (torch's defaults on a CPU), nothing
    global is touched. Otherwise they are switched while any search runs and restored when the
    last one ends: overlapping searches in threads share one switch, so none restores settings
    under another, and the caller's own settings come back exactly."""
    global _strict_users, _strict_saved
    with _STRICT_LOCK:
        if _strict_users == 0 and not _is_strict(_product_settings(), device):
            _strict_saved = _product_settings()
            _apply_product_settings(_STRICT)
        _strict_users += 1
    try:
        yield
    finally:
        with _STRICT_LOCK:
            _strict_users -= 1
            if _strict_users == 0 and _strict_saved is not None:
                _apply_product_settings(_strict_saved)
                _strict_saved = None


def topk(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    metric: str | Metric,
    k: int,
    budget: int,
    rows_a: torch.Tensor | None = None,
    rows_b: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    half: torch.dtype | None = None,
    certify: bool = True,
    tiles: tuple[int | None, int | None] | None = None,
    on_tile: Callable[[int], None] | None = None,
    reserved: int = 0,
    stats: dict[str, int] | None = None,
    backend: str = "auto",
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
    rows_a : Tensor of shape (na,), int64, optional
        Only these query rows are ranked (the rows of the result follow this order).
    rows_b : Tensor of shape (nb,), int64, increasing, optional
        Only these reference rows can be chosen.
    dtype : torch.dtype, default=torch.float32
        The compute dtype: scores accumulate in it, values are reported in it.
    half : torch.dtype, optional
        Search candidates with operands of this dtype (bfloat16 or float16) instead; matrix
        metrics only, with ``dtype`` float32.
    certify : bool, default=True
        With ``half``: keep every candidate that the per-pair rounding bound cannot rule out
        (:mod:`densematch.precision`), re-score them by the direct form, and search rows with
        more than ``max(32, 4 k)`` candidates again in float32, so the result equals the float32
        one (ties aside). False: rank by the half-precision scores (approximate). Without
        ``half``, for matrix metrics: settle each row's near-ties by the direct form, so exact
        ties go to the lowest index (False: the products' ranking alone).
    tiles : (int or None, int or None), optional
        Force the tile sizes (tests use tiny tiles to force many merges).
    on_tile : callable, optional
        Called with the number of query rows finished after each query tile (progress bars).
    reserved : int, default=0
        Bytes of ``budget`` the caller already holds (they shrink the tiles).
    stats : dict, optional
        Filled with counts of the certified search: ``rows``, ``candidates`` (kept in all),
        ``most`` (the most for one row) and ``fallback`` (rows searched again in float32).
    backend : {"auto", "torch", "triton"}, default="auto"
        "triton" runs the fused kernel of :mod:`densematch.kernels` (on a CPU only under
        TRITON_INTERPRET=1); "auto" chooses it on CUDA devices when Triton is installed.

    Returns
    -------
    value : Tensor of shape (na, k), ``dtype``
        The metric's value of each chosen pair, recomputed directly from the two rows:
        similarity for cosine and dot, distance otherwise; NaN in empty slots.
    index : Tensor of shape (na, k), int64
        Row of ``b`` chosen, best first; equal scores go to the lower row; -1 in empty slots.
    """
    metric = get_metric(metric)
    na = a.shape[0] if rows_a is None else rows_a.numel()
    nb = b.shape[0] if rows_b is None else rows_b.numel()
    c = a.shape[1]
    device = a.device
    value = torch.full((na, k), math.nan, dtype=dtype, device=device)
    index = torch.full((na, k), -1, dtype=torch.int64, device=device)
    if half is not None and (metric.p is not None or dtype != torch.float32):
        raise ValueError(f"half={half} needs a matrix metric and float32, got {metric.name!r} and {dtype}")
    use_kernel = kernels.wanted(backend, device, metric, k)
    if stats is not None:
        stats.update(rows=na, candidates=0, most=0, fallback=0)
    if na == 0 or nb == 0:
        return value, index
    # half precision is certified (candidates within its bound, re-scored); a plain search of a
    # matrix metric settles its near-ties by the direct form (ties: an expansion rounds equal
    # distances unequally, and exact ties must go to the lowest index)
    cap = max(CANDIDATES, 4 * k)
    half_cap = cap if half is not None and certify else 0
    ties = half is None and not use_kernel and metric.p is None and certify
    plan = plan_tiles(
        na,
        nb,
        c,
        k,
        budget,
        metric=metric,
        device=device,
        dtype=dtype,
        in_dtype=a.dtype,
        tiles=tiles,
        reserved=reserved,
        half=half,
        cap=half_cap,
        ties=cap if ties else 0,
        kernel=use_kernel,
    )
    with torch.inference_mode(), _strict_products(device):
        scale = _common_scale(a, b, rows_a, rows_b, plan.tile_a)
        inputs = (a, b, rows_a, rows_b, metric, dtype, plan, k, scale)
        if use_kernel:
            # without half, the kernel multiplies float32 operands and its top-k is final
            search: _Search = _KernelSearch(*inputs, half or dtype, half_cap, stats)
        elif half is not None:
            search = _HalfSearch(*inputs, half, half_cap, stats)
        else:
            search = _Search(*inputs, ties=cap if ties else 0)
        ta, tb = plan.tile_a, plan.tile_b
        buf = None
        start = 0
        while start < na:
            stop = min(start + ta, na)
            try:
                if buf is None:  # one block of scores, reused by every tile pair
                    size = ta * _rescore_bytes(c) if use_kernel else ta * tb
                    buf = torch.empty(size, dtype=torch.uint8 if use_kernel else half or dtype, device=device)
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


class _Search:
    """One call's inputs and prepared references; ranks and finalises one query tile at a time."""

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        rows_a: torch.Tensor | None,
        rows_b: torch.Tensor | None,
        metric: Metric,
        dtype: torch.dtype,
        plan: TilePlan,
        k: int,
        scale: float = 1.0,
        *,
        ties: int = 0,
    ) -> None:
        self.a, self.b, self.rows_a, self.rows_b = a, b, rows_a, rows_b
        self.metric, self.dtype, self.tile_b, self.scale = metric, dtype, plan.tile_b, scale
        self.ties = ties
        self.nb = b.shape[0] if rows_b is None else rows_b.numel()
        self.merge = _merge_best if k == 1 else _merge_topk
        self.centre = self._reference_mean() if metric.centred else None
        # references prepared once when the plan allows, else tile by tile
        self.whole: torch.Tensor | None = None
        if plan.whole_b:
            self.whole = self._prepare_refs(0, self.nb)
        if ties:
            # the largest prepared reference norm: with a query's own norm, it bounds how far
            # the compute dtype's product can be from the exact one for every pair of the row
            self.ref_norm = max(
                float(torch.linalg.vector_norm(self._prepare_refs(j, j + self.tile_b), dim=1).amax())
                for j in range(0, self.nb, self.tile_b)
            )

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """Raw rows times the common scale (a power of two: exact), in their own dtype."""
        return x if self.scale == 1.0 else x * self.scale

    def _reference_mean(self) -> torch.Tensor:
        total = torch.zeros(self.b.shape[1], dtype=self.dtype, device=self.b.device)
        for j in range(0, self.nb, self.tile_b):
            total += self._scaled(_rows(self.b, self.rows_b, j, j + self.tile_b)).sum(0, dtype=self.dtype)
        return total / self.nb

    def _prepare_refs(self, start: int, stop: int) -> torch.Tensor:
        if self.whole is not None:
            return self.whole[start:stop]
        rows = self._scaled(_rows(self.b, self.rows_b, start, stop))
        return self.metric.prepare(rows, "ref", self.dtype, self.centre)

    def _prepare_queries(self, start: int, m: int) -> torch.Tensor:
        rows = self._scaled(_rows(self.a, self.rows_a, start, start + m))
        return self.metric.prepare(rows, "query", self.dtype, self.centre)

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        """Merge every reference tile into the running top-k of the query tile at ``start``."""
        q = self._prepare_queries(start, best_v.shape[0])
        if not self.ties:
            self._scan(q, best_v, best_i, buf)
            return
        # each product is within `slack` of the exact one, so the exact top k all score at
        # least the k-th best minus twice that: the candidates. The scan keeps each tile's row
        # maxima; afterwards only the tiles whose maximum reaches a row's floor (for k=1 mostly
        # its best's own tile) are multiplied again for that row, to list its candidates. Rows
        # with more than k are settled by the direct form (more than `ties`: kept as ranked).
        m, k = best_v.shape
        slack = product_slack(q, self.ref_norm)
        maxima = torch.empty(m, -(-self.nb // self.tile_b), dtype=self.dtype, device=q.device)
        self._scan(q, best_v, best_i, buf, maxima=maxima)
        floor = best_v[:, -1] - 2 * slack
        near = maxima >= floor[:, None]
        pool = _Pool(m, self.ties, q.device, self.dtype, lazy=True)
        for t in (near.sum(0) > 0).nonzero().squeeze(1).tolist():
            j = t * self.tile_b
            n = min(self.tile_b, self.nb - j)
            rows = near[:, t].nonzero().squeeze(1)
            block = self.metric.score_tile(
                q.index_select(0, rows), self._prepare_refs(j, j + n), out=buf[: rows.numel() * n].view(-1, n)
            )
            pool.add(block, j, floor, rows)
        rows, cols = pool.finish(floor)
        crowded = torch.bincount(rows, minlength=m) > k
        keep = crowded[rows]
        if bool(keep.any()):
            rows, cols = rows[keep], cols[keep]
            score = self._direct_scores(start, rows, cols, buf)
            v, i = best_v[crowded], best_i[crowded]
            local = torch.cumsum(crowded, 0)[rows] - 1  # rows renumbered among the crowded
            _best_of_candidates(local, cols, score, v.fill_(-math.inf), i.fill_(-1))
            best_v[crowded], best_i[crowded] = v, i

    def _direct_scores(self, start: int, rows: torch.Tensor, cols: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """The metric's direct scores of candidates (rows of the query tile at ``start``, reference
        positions ``cols``) in the compute dtype, in chunks within the bytes of ``buf``."""
        score = torch.empty(rows.numel(), dtype=self.dtype, device=rows.device)
        step = max(1, buf.numel() * buf.element_size() // _rescore_bytes(self.a.shape[1]))
        queries = start + rows if self.rows_a is None else self.rows_a[start + rows]
        for s in range(0, rows.numel(), step):
            a = self._scaled(self.a.index_select(0, queries[s : s + step]))
            r = self._scaled(self._gather_refs(cols[s : s + step]))
            score[s : s + step] = self.metric.direct_score(a.to(self.dtype), r.to(self.dtype))
        return score

    def _gather_refs(self, cols: torch.Tensor) -> torch.Tensor:
        """Raw rows of b at reference positions ``cols`` (positions among the allowed rows)."""
        return self.b.index_select(0, cols if self.rows_b is None else self.rows_b[cols])

    def _scan(
        self,
        q: torch.Tensor,
        best_v: torch.Tensor,
        best_i: torch.Tensor,
        buf: torch.Tensor,
        refs: Callable[[int, int], torch.Tensor] | None = None,
        maxima: torch.Tensor | None = None,
    ) -> None:
        """The plain search of prepared query rows ``q`` over every reference tile that
        ``refs(start, stop)`` gives (default: the prepared references), scores in ``buf``;
        each tile's row maxima go into column ``start // tile_b`` of ``maxima`` when given."""
        refs = refs or self._prepare_refs
        m = q.shape[0]
        best_v.fill_(-math.inf)
        best_i.fill_(-1)
        for j in range(0, self.nb, self.tile_b):
            n = min(self.tile_b, self.nb - j)
            s = self.metric.score_tile(q, refs(j, j + n), out=buf[: m * n].view(m, n))
            rowmax = self.merge(s, j, best_v, best_i)
            if maxima is not None:
                maxima[:, j // self.tile_b] = rowmax

    def finalise(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int) -> None:
        """Map tile positions to rows of b, recompute each chosen pair's value, and reorder."""
        k = best_i.shape[1]
        found = best_i >= 0
        local = best_i.clamp_min(0)
        if self.rows_b is not None:
            best_i.copy_(torch.where(found, self.rows_b[local], best_i))
            local = best_i.clamp_min(0)
        q = self._scaled(_rows(self.a, self.rows_a, start, start + best_i.shape[0])).to(self.dtype)
        r = self._scaled(self.b.index_select(0, local.reshape(-1))).to(self.dtype)
        v = self.metric.pair_value(q[:, None, :], r.view(-1, k, r.shape[-1]))
        missing = math.inf if self.metric.higher_is_better else -math.inf
        v, i = _order(torch.where(found, v, -missing), best_i, descending=self.metric.higher_is_better)
        if self.scale != 1.0 and self.metric.degree:
            # ordered at the search's scale, then back to the caller's units: a value past the
            # dtype's range (only where the inputs had to be rescaled) becomes inf, never NaN
            v = v / self.scale**self.metric.degree
        best_v.copy_(torch.where(i >= 0, v, math.nan))
        best_i.copy_(i)


class _HalfSearch(_Search):
    """Candidates from half-precision products, made exact by the rounding certificate.

    For each reference tile, ``e`` (the per-pair bound of :mod:`densematch.precision`, one small
    product) turns half scores ``h`` into lower bounds ``h - e``, whose running k-th best ``t``
    the usual merge keeps; every pair with ``h + e >= t`` joins a pool of (row, column, h + e),
    pruned as ``t`` rises. A row whose pool outgrows ``cap`` stops collecting and is searched
    again in float32 at the end; the others' candidates are re-scored in float32.
    """

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        rows_a: torch.Tensor | None,
        rows_b: torch.Tensor | None,
        metric: Metric,
        dtype: torch.dtype,
        plan: TilePlan,
        k: int,
        scale: float,
        half: torch.dtype,
        cap: int,
        stats: dict[str, int] | None,
    ) -> None:
        self.shift: torch.Tensor | None = None  # set below, once the references' mean is known
        super().__init__(a, b, rows_a, rows_b, metric, dtype, plan, k, scale)
        self.half, self.cap, self.stats = half, cap, stats
        # cosine and dot: references shifted by their mean change every score of a query row by
        # the same amount, so no ranking; features that all look alike (raw patches: cosines
        # near 0.9999) keep only their differences, which half precision then resolves
        if metric.name in ("cosine", "dot") and half != dtype:
            total = torch.zeros(b.shape[1], dtype=dtype, device=b.device)
            for j in range(0, self.nb, self.tile_b):
                total += self._prepare_refs(j, j + self.tile_b).sum(0)
            shift = total / self.nb
            if self.whole is not None:
                self.whole -= shift
            self.shift = shift
        self.whole_h = None if self.whole is None else self.whole.to(half)
        self.whole_t = None
        if cap and self.whole is not None:
            self.whole_t = ref_terms(self.whole, self.whole_h)

    def _prepare_refs(self, start: int, stop: int) -> torch.Tensor:
        refs = super()._prepare_refs(start, stop)
        return refs if self.whole is not None or self.shift is None else refs.sub_(self.shift)

    def _half_refs(self, start: int, stop: int) -> torch.Tensor:
        if self.whole_h is not None:
            return self.whole_h[start:stop]
        return self._prepare_refs(start, stop).to(self.half)

    def _ref_terms(self, start: int, stop: int, half_refs: torch.Tensor) -> torch.Tensor:
        if self.whole_t is not None:
            return self.whole_t[start:stop]
        return ref_terms(self._prepare_refs(start, stop), half_refs)

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        m = best_v.shape[0]
        q = self._prepare_queries(start, m)
        qh = q.to(self.half)
        if not self.cap:  # "fast": rank by the half scores
            self._scan(qh, best_v, best_i, buf, refs=self._half_refs)
            return
        best_v.fill_(-math.inf)
        best_i.fill_(-1)
        qt = query_terms(q, qh)
        # torch's half products round their float32 sums to half: |stored - sum| <= u |stored| / (1 - u)
        u = unit_roundoff(self.half)
        rounding = u / (1.0 - u) * (1.0 + 2.0**-12)
        reach_rows = (qt[:, 0] + qt[:, 1]) * (1.0 + 2.0**-10) * rounding  # >= |a'| u/(1-u)
        pool = _Pool(m, self.cap, q.device, self.dtype)
        bounds = torch.empty(2, m * min(self.tile_b, self.nb), dtype=self.dtype, device=q.device)
        for j in range(0, self.nb, self.tile_b):
            n = min(self.tile_b, self.nb - j)
            rh = self._half_refs(j, j + n)
            s = torch.mm(qh, rh.T, out=buf[: m * n].view(m, n))
            terms = self._ref_terms(j, j + n, rh)
            # only rows whose best score, raised by the largest bound it can have in this tile,
            # reaches the floor can gain a candidate or a better floor: after the first tiles,
            # few do, and the others cost one row maximum, as in the float32 search
            top = terms.amax(0)
            reach = s.amax(1).to(self.dtype) + qt @ top + reach_rows * top[1]
            hot = (reach >= best_v[:, -1]).nonzero().squeeze(1)
            h = hot.numel()
            if h == 0:
                continue
            every = h == m
            sub = s if every else s.index_select(0, hot)
            e = torch.mm(qt if every else qt.index_select(0, hot), terms.T, out=bounds[0, : h * n].view(h, n))
            low = torch.sub(sub, e.add_(sub.abs(), alpha=rounding), out=bounds[1, : h * n].view(h, n))
            if every:
                self.merge(low, j, best_v, best_i)
            else:
                v, i = best_v[hot], best_i[hot]
                self.merge(low, j, v, i)
                best_v[hot], best_i[hot] = v, i
            pool.add(e.add_(sub), j, best_v[:, -1], hot)
        rows, cols = pool.finish(best_v[:, -1])
        self._settle(q, start, rows, cols, pool.over, best_v, best_i, buf)

    def _settle(
        self,
        q: torch.Tensor,
        start: int,
        rows: torch.Tensor,
        cols: torch.Tensor,
        over: torch.Tensor,
        best_v: torch.Tensor,
        best_i: torch.Tensor,
        buf: torch.Tensor,
    ) -> None:
        """Re-score the candidates (rows, cols) of the query tile at ``start`` by the metric's
        direct form in the compute dtype into the running top-k, and search the ``over`` rows
        (prepared rows of ``q``) again in the compute dtype, in the bytes of ``buf``."""
        m, k = best_v.shape
        best_v.fill_(-math.inf)
        best_i.fill_(-1)
        score = self._direct_scores(start, rows, cols, buf)
        _best_of_candidates(rows, cols, score, best_v, best_i)
        redo = over.nonzero().squeeze(1)
        if redo.numel():
            v, i = self._search_float32(q.index_select(0, redo), k, buf)
            best_v[redo], best_i[redo] = v, i
        if self.stats is not None:
            counts = torch.bincount(rows, minlength=m)
            self.stats["candidates"] += int(rows.numel())
            self.stats["most"] = max(self.stats["most"], int(counts.max()) if m else 0)
            self.stats["fallback"] += int(redo.numel())

    def _search_float32(self, q: torch.Tensor, k: int, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain float32 search of prepared rows ``q`` (the rows that overflowed), its score
        blocks in the bytes of the half block ``buf``: half as many rows at a time."""
        v = torch.empty(q.shape[0], k, dtype=self.dtype, device=q.device)
        i = torch.empty(q.shape[0], k, dtype=torch.int64, device=q.device)
        flat = buf[: buf.numel() // 2 * 2].view(self.dtype) if buf.dtype != self.dtype else buf
        if flat.numel() < self.tile_b:
            flat = torch.empty(self.tile_b, dtype=self.dtype, device=q.device)
        step = flat.numel() // self.tile_b
        for s in range(0, q.shape[0], step):
            self._scan(q[s : s + step], v[s : s + step], i[s : s + step], flat)
        return v, i


class _KernelSearch(_HalfSearch):
    """The fused Triton kernel's search: the kernel ranks (and, certified, lists candidates), the
    re-scoring and the float32 fallback are :class:`_HalfSearch`'s. With float32 operands the
    kernel multiplies in IEEE arithmetic and its top-k is final."""

    def _run(
        self, q: torch.Tensor, refs: Callable[[int, int], torch.Tensor], k: int, cert: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel over every reference tile: (m, slots) running scores and int32 indices."""
        m = q.shape[0]
        slots = max(2, 1 << (k - 1).bit_length())
        val = torch.full((m, slots), -math.inf, dtype=torch.float32, device=q.device)
        idx = torch.full((m, slots), -1, dtype=torch.int32, device=q.device)
        from .kernels.topk import topk_launch

        for j in range(0, self.nb, self.tile_b):
            stop = min(j + self.tile_b, self.nb)
            r = refs(j, stop)
            terms = self._ref_terms(j, stop, r) if cert else None
            topk_launch(q, r, val, idx, k=k, offset=j, bias=self.metric.extra_columns == 1, ref_terms=terms, **cert)
        return val, idx

    def rank(self, best_v: torch.Tensor, best_i: torch.Tensor, start: int, buf: torch.Tensor) -> None:
        m, k = best_v.shape
        q = self._prepare_queries(start, m)
        qh = q.to(self.half)
        cert: dict[str, torch.Tensor] = {}
        if self.cap:
            cert = {
                "query_terms": query_terms(q, qh),
                "count": torch.zeros(m, dtype=torch.int32, device=q.device),
                "cand": torch.full((m, self.cap), -1, dtype=torch.int32, device=q.device),
            }
        val, idx = self._run(qh, self._half_refs, k, cert)
        if not self.cap:
            best_v.copy_(val[:, :k])
            best_i.copy_(idx[:, :k])
            return
        over = cert["count"] > self.cap
        listed = (cert["cand"] >= 0) & ~over[:, None]
        rows, slot = listed.nonzero().unbind(1)
        self._settle(q, start, rows, cert["cand"][rows, slot].long(), over, best_v, best_i, buf)

    def _search_float32(self, q: torch.Tensor, k: int, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The overflowing rows again, through the kernel in IEEE float32 (their order within
        the k is settled by :meth:`finalise`)."""
        val, idx = self._run(q, self._prepare_refs, k, {})
        return val[:, :k], idx[:, :k].long()


class _Pool:
    """Candidates of one query tile: every (row, column) whose upper bound reaches the row's
    floor (the running k-th best lower bound). Rows that collect more than ``cap`` are marked
    ``over`` and collect no more. With ``lazy``, new candidates wait in a list and the pool is
    pruned only when it holds more than ``cap`` per row on average (for floors that rarely
    change, this saves a pass over the pool for every tile)."""

    def __init__(self, m: int, cap: int, device: torch.device, dtype: torch.dtype, lazy: bool = False) -> None:
        self.m, self.cap, self.lazy = m, cap, lazy
        self.rows = torch.empty(0, dtype=torch.int64, device=device)
        self.cols = torch.empty(0, dtype=torch.int64, device=device)
        self.vals = torch.empty(0, dtype=dtype, device=device)
        self.over = torch.zeros(m, dtype=torch.bool, device=device)
        self.overflowed = False
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.held = 0

    def add(self, upper: torch.Tensor, offset: int, floor: torch.Tensor, rows: torch.Tensor) -> None:
        """Collect from the block of upper bounds ``upper`` (len(rows), n) of the pool's ``rows``
        against reference tile ``offset``; ``floor`` has one value per row of the pool. The
        caller may pass only rows whose best bound reaches the floor (the lazy pool's caller
        does; the check is repeated otherwise)."""
        if self.lazy and not self.overflowed:
            local = None
        else:
            reach = ~self.over[rows] if self.lazy else (upper.amax(1) >= floor[rows]) & ~self.over[rows]
            local = reach.nonzero().squeeze(1)
            if local.numel() == 0:
                return
        every = local is None or local.numel() == rows.numel()
        hot = rows if every else rows[local]
        sub = upper if every else upper.index_select(0, local)
        passing = sub >= floor[hot, None]
        # a row with more than cap new candidates overflows at once, before any are listed
        # (counted per row only when the block holds that many in all, from the listed pairs
        # when they are few enough to list)
        count = int(torch.count_nonzero(passing))
        listed = None
        if count > self.cap:
            if count <= hot.numel() * self.cap:
                listed = passing.nonzero()
                per_row = torch.bincount(listed[:, 0], minlength=hot.numel())
            else:
                per_row = passing.sum(1)
            burst = per_row > self.cap
            if bool(burst.any()):
                self.over[hot[burst]] = True
                self.overflowed = True
                passing[burst] = False
                listed = None
        r, col = (passing.nonzero() if listed is None else listed).unbind(1)
        self.pending.append((hot[r], col + offset, sub[r, col].to(self.vals.dtype)))
        self.held += r.numel()
        if not self.lazy or self.held > self.m * self.cap:
            self._prune(floor)

    def _prune(self, floor: torch.Tensor) -> None:
        if self.pending:
            parts = [(self.rows, self.cols, self.vals), *self.pending]
            self.rows, self.cols, self.vals = (torch.cat(p) for p in zip(*parts, strict=True))
            self.pending = []
        keep = self.vals >= floor[self.rows]
        counts = torch.bincount(self.rows[keep], minlength=self.m)
        self.over |= counts > self.cap
        self.overflowed = bool(self.over.any())
        keep &= ~self.over[self.rows]
        self.rows, self.cols, self.vals = self.rows[keep], self.cols[keep], self.vals[keep]
        self.held = self.rows.numel()

    def finish(self, floor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final candidates (rows, columns), pruned with the final floor."""
        self._prune(floor)
        return self.rows, self.cols


def _common_scale(
    a: torch.Tensor, b: torch.Tensor, rows_a: torch.Tensor | None, rows_b: torch.Tensor | None, step: int
) -> float:
    """A power of two that brings the largest magnitude of the rows searched into [1, 2) when it
    lies outside [2^-32, 2^32], else 1. Rankings do not change under a common positive scale,
    and without it the l2 expansion's squared norms (and float32 copies of float64 features)
    overflow from about 1e19 (3.4e38 for float64 inputs) and underflow below about 1e-19."""
    peak = 0.0
    for x, rows in ((a, rows_a), (b, rows_b)):
        n = x.shape[0] if rows is None else rows.numel()
        for start in range(0, n, max(1, step)):
            low, high = torch.aminmax(_rows(x, rows, start, start + step))
            peak = max(peak, -float(low), float(high))
    if peak == 0.0 or 2.0**-32 <= peak <= 2.0**32:
        return 1.0
    return 2.0 ** -math.floor(math.log2(peak))


def _best_of_candidates(
    rows: torch.Tensor, cols: torch.Tensor, score: torch.Tensor, best_v: torch.Tensor, best_i: torch.Tensor
) -> None:
    """Per row, the k best (score, column) of the candidate list, equal scores to the lower
    column, written into best_v / best_i (rows without candidates are left as they are)."""
    if rows.numel() == 0:
        return
    k = best_v.shape[1]
    order = cols.argsort(stable=True)
    order = order[score[order].argsort(descending=True, stable=True)]
    order = order[rows[order].argsort(stable=True)]
    rows, cols, score = rows[order], cols[order], score[order]
    counts = torch.bincount(rows, minlength=best_v.shape[0])
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(rows.numel(), device=rows.device) - first[rows]
    keep = rank < k
    best_v[rows[keep], rank[keep]] = score[keep].to(best_v.dtype)
    best_i[rows[keep], rank[keep]] = cols[keep]
