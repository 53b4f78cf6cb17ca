"""Dense matching: for every pixel of one feature map, its best pixels in another."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import engine
from ..checks import (
    check_batch_mask,
    check_features,
    check_finite,
    check_int,
    check_pair,
    compute_dtype,
)
from ..choices import LayoutName, MetricName, PrecisionName, RefineName
from ..config import resolve_memory
from ..metrics import Metric, get_metric
from ..precision import Precision, resolve_precision
from ..progress import progress_bar
from ..threads import own_thread
from .options import MatchOptions
from .subpixel import refine_positions

__all__ = ["DenseMatcher", "MatchOptions", "Matches", "match"]

_OPTION_NAMES = frozenset(f.name for f in fields(MatchOptions))


class Matches:
    """The result of :func:`match`.

    Attributes
    ----------
    index : Tensor of int64, shape (*batch, *grid_a[, k])
        Flat index of the match in b's grid; -1 where there is none (a masked-out pixel of a,
        or fewer allowed pixels in b than k).
    coords : Tensor of int64, shape (*batch, *grid_a[, k], 2)
        (row, col) of the match in b's grid, derived with b's own width; -1 where there is none.
        For layout="flat" (rows, no grid) reading it raises an AttributeError that says so:
        ``getattr(m, "coords", None)`` is None there.
    score : Tensor of float32 (float64 with precision="float64"), shape (*batch, *grid_a[, k])
        Similarity (cosine, dot) or distance (l2, sqeuclidean, l1, linf); NaN where there is none.
    valid : Tensor of bool, shape (*batch, *grid_a[, k])
        True where a match exists and every requested filter (mutual, ratio) passes.
    """

    __slots__ = ("_coords", "index", "score", "valid")

    def __init__(
        self, index: torch.Tensor, coords: torch.Tensor | None, score: torch.Tensor, valid: torch.Tensor
    ) -> None:
        self.index, self._coords, self.score, self.valid = index, coords, score, valid

    @property
    def coords(self) -> torch.Tensor:
        if self._coords is None:
            raise AttributeError(
                "Matches.coords: these matches come from layout='flat' (rows, no grid), so they have no (row, col); "
                "use .index, the row of b"
            )
        return self._coords

    def _fields(self) -> dict[str, torch.Tensor]:
        found = {"index": self.index, "coords": self._coords, "score": self.score, "valid": self.valid}
        return {name: value for name, value in found.items() if value is not None}

    def numpy(self) -> dict[str, np.ndarray]:
        """The fields as numpy arrays (``coords`` left out for layout="flat")."""
        return {name: value.detach().cpu().numpy() for name, value in self._fields().items()}

    def __repr__(self) -> str:
        shapes = ", ".join(f"{name}={tuple(value.shape)}" for name, value in self._fields().items())
        return f"Matches({shapes})"


def match(
    a: Any,
    b: Any,
    *,
    metric: MetricName = "cosine",
    k: int = 1,
    mutual: bool = False,
    ratio: float | None = None,
    layout: LayoutName = "hwc",
    mask_a: Any = None,
    mask_b: Any = None,
    memory: int | str | None = None,
    progress: bool = False,
    precision: PrecisionName = "exact",
    refine: RefineName | None = None,
    stride: float | tuple[float, float] | None = None,
    offset: float | tuple[float, float] | None = None,
    exclude_radius: float | None = None,
) -> Matches:
    """Find, for every pixel of `a`, its `k` best pixels in `b`, exactly, within a memory budget.

    Exact for any `memory`: equal to brute force under `precision` accumulation. The N x N
    similarity matrix is never built; `a` and `b` are tiled and a running top-k is merged.

    Which options fit which job, and what each costs: docs/choosing.md.

    Parameters
    ----------
    a, b : Tensor or ndarray
        Query and reference features, float16, bfloat16, float32 or float64, of shape
        (H, W, C) or (B, H, W, C) for layout="hwc"; (C, H, W) or (B, C, H, W) for "chw";
        (N, C) or (B, N, C) for "flat". Grids may differ; C and B must agree. On one device.
    metric : {"cosine", "dot", "l2", "sqeuclidean", "l1", "linf"}, default="cosine"
        Cosine and dot are similarities (higher is better), the rest distances.
    k : int, default=1
        How many matches per pixel, best first; 1 <= k <= pixels of b.
    mutual : bool, default=False
        Valid only where a's pixel is also the best match in a of its match in b (mutual
        nearest neighbours). Costs a second bounded pass, b against a.
    ratio : float in (0, 1], optional
        Lowe's ratio test: valid where d1 / d2 <= ratio for the best and second-best distances
        (inclusive). For cosine, d is the chord distance sqrt(2 - 2 cos) of unit features; for
        sqeuclidean, the Euclidean distance. A pixel whose second distance is 0 fails; one with
        no second candidate passes. Not defined for "dot".
    exclude_radius : float, optional
        With ``ratio``: the second-best is the best candidate farther than this many pixels
        (Euclidean, in b's grid) from the best, not its neighbour, which on dense maps scores
        almost as well and makes the test meaningless. Keeps (2r+1)^2 + 1 candidates a pixel.
    layout : {"hwc", "chw", "flat"}, default="hwc"
        How `a` and `b` are laid out; sizes are never guessed from.
    mask_a, mask_b : bool Tensor or ndarray, optional
        Pixels to use, of shape (*batch, *grid), or (*grid) to apply to every batch item.
        Masked-out pixels of a are not matched (valid False, index -1, coords -1, score NaN);
        masked-out pixels of b are never chosen. Masked pixels cost no work.
    memory : int or str, optional
        Hard cap on the extra working memory of the call, inputs and outputs aside: bytes or a
        string such as "256MiB" or "2GB". None: :func:`densematch.config_context`, else
        ``DENSEMATCH_MEMORY``, else half the device's free memory (CUDA's ``mem_get_info``, a
        CPU's available RAM), capped at 512 MiB on a CPU and 8 GiB on a GPU. A budget too small
        for one tile is a ValueError naming the least that works.
    progress : bool, default=False
        Show a tqdm bar over the query pixels (needs tqdm).
    precision : {"exact", "float32", "fast", "float64"}, default="exact"
        "exact": the same matches as "float32" (ties aside), using a certified half-precision
        search where the device multiplies half precision faster (GPUs; CPUs with AMX; AMD CPUs with AVX-512 BF16), else
        float32. "float32" / "float64": plain accumulation in that dtype. "fast": ranks by
        half-precision scores where that is faster, without re-scoring: approximate. Measured
        (benchmarks/suites/bench_match.py): 1.9-2.1% of pixels get another match than "float32" on
        noise and 5.3-9.2% on photo patch features in bfloat16; 0.3-1.0% in float16 (see
        docs/precision.md). Scores are always recomputed in float32 (float64).
    refine : {"parabola", "soft", "features"}, optional
        Sub-pixel positions of the matches in b's grid, each refined around its integer position
        with a few feature reads (never another search): "parabola", per axis the vertex of the
        parabola through the best score and its neighbours'; "soft", the soft-argmax of the
        3x3 window; "features", Gauss-Newton in feature space (the offset whose bilinearly
        interpolated feature of b best fits a's; unit features for cosine), the most precise
        (docs/match.md). ``coords`` become float. Grid layouts with 2-D grids only.
    stride, offset : float or (float, float), optional
        Map b's grid positions to image pixels: ``coords * stride + offset`` per (row, col),
        e.g. stride=14, offset=6.5 for a ViT with 14-pixel patches. ``coords`` become float.

    Returns
    -------
    Matches
        `index` (int64), `score` (float32; float64 for precision="float64") and `valid` (bool)
        of shape (*batch, *grid_a), plus a trailing k axis when k > 1; `coords` (int64) with a
        further trailing axis of 2 (float32, NaN where there is no match, with `refine`,
        `stride` or `offset`; float64 for float64 inputs).

    Raises
    ------
    ValueError
        Wrong rank for the layout, a C or batch mismatch, empty maps, NaN or Inf, an unknown
        metric, layout or precision, k out of range, ratio outside (0, 1] or with "dot", masks
        of the wrong shape, or a memory budget smaller than one tile.
    TypeError
        Integer or boolean features, non-boolean masks, or inputs of another type.

    Notes
    -----
    Convention: ties go to the lower flat index of b. Zero vectors under cosine score 0. For
    l2 and sqeuclidean, candidates are ranked through the expansion ||a||^2 - 2 a.b + ||b||^2
    of features centred on b's mean, and each reported score is recomputed directly from the
    two features.

    References
    ----------
    - D. G. Lowe, "Distinctive image features from scale-invariant keypoints", International
      Journal of Computer Vision 60(2), 91-110, 2004: the ratio test (``ratio``).
    - N. J. Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., SIAM, 2002,
      chapter 3: the bounds on rounded inner products that certify the half-precision search
      (``precision="exact"``, docs/precision.md).

    Examples
    --------
    >>> f = torch.randn(24, 32, 16)
    >>> match(f, f, k=2, metric="l2").coords.shape
    torch.Size([24, 32, 2, 2])
    >>> bool((match(f, f).coords[..., 1] == torch.arange(32)).all())
    True
    """
    options = MatchOptions(
        metric=metric,
        k=k,
        mutual=mutual,
        ratio=ratio,
        layout=layout,
        memory=memory,
        progress=progress,
        precision=precision,
        refine=refine,
        stride=stride,
        offset=offset,
        exclude_radius=exclude_radius,
    )
    return run(a, b, options, mask_a=mask_a, mask_b=mask_b)


def run(a: Any, b: Any, options: MatchOptions, *, mask_a: Any = None, mask_b: Any = None) -> Matches:
    """:func:`match` with its settings already checked: what every match-like caller runs."""
    task = validate(a, b, options, mask_a, mask_b)
    with progress_bar(options.progress, total=task.pixels_searched(), unit="px", desc="match") as bar:
        # what both passes (a against b, and the mutual check's b against a) search with
        search = task.search(bar.update if options.progress else None)

        def forward(i: int, rows_a: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            rows_b = task.rows(1, i)
            return search(task.ra[i], task.rb[i], k=k, rows_a=rows_a, rows_b=rows_b, reserved=task.reserved)

        def backward(i: int, rows_a: torch.Tensor | None) -> torch.Tensor:
            rows_b = task.rows(1, i)
            reserved = task.reserved + 8 * task.nb
            _, back = search(task.rb[i], task.ra[i], k=1, rows_a=rows_b, rows_b=rows_a, reserved=reserved)
            return owners(back[:, 0], rows_b, task.nb)

        return placed(task, solve(task, forward, backward))


def placed(task: Task, found: Matches) -> Matches:
    """``found`` with float coords where the options ask for them: refined, then mapped by
    stride and offset (per (row, col): ``coords * stride + offset``)."""
    options = task.options
    if not options.places:
        return found
    dtype = torch.float64 if task.precision.dtype == torch.float64 else compute_dtype(task.ra)
    k = task.k
    index = found.index.reshape(task.nbatch, task.na, k)
    if options.refine is None:
        coords = found.coords.to(dtype).reshape(task.nbatch, task.na, k, 2)
        coords = torch.where(index[..., None] >= 0, coords, float("nan"))
    else:
        with torch.inference_mode():
            coords = torch.stack(
                [
                    refine_positions(
                        task.ra[i],
                        task.rb[i],
                        (task.grid_b[0], task.grid_b[1]),
                        index[i],
                        task.metric,
                        options.refine,
                        task.budget,
                        None if task.masks[1] is None else task.masks[1][i].reshape(-1),
                    ).to(dtype)
                    for i in range(task.nbatch)
                ]
            )
    scale = torch.tensor(options.stride or (1.0, 1.0), dtype=dtype, device=coords.device)
    shift = torch.tensor(options.offset or (0.0, 0.0), dtype=dtype, device=coords.device)
    coords = (coords * scale + shift).reshape(found.coords.shape)
    return Matches(index=found.index, coords=coords, score=found.score, valid=found.valid)


@dataclass
class Task:
    """A validated :func:`match` call: flat rows, grids, batch masks, the options and what they
    resolve to on these inputs (the metric, k, the precision and the budget).

    ``nb`` and ``grid_b`` describe the whole of b (for a sharded search, every band together),
    ``rb`` and the b mask only the rows this process holds.
    """

    ra: torch.Tensor
    rb: torch.Tensor
    grid_a: tuple[int, ...]
    grid_b: tuple[int, ...]
    batched: bool
    masks: tuple[torch.Tensor | None, torch.Tensor | None]
    options: MatchOptions
    metric: Metric
    k: int
    precision: Precision
    budget: int
    nb: int

    @property
    def mutual(self) -> bool:
        return self.options.mutual

    @property
    def ratio(self) -> float | None:
        return self.options.ratio

    @property
    def layout(self) -> str:
        return self.options.layout

    @property
    def exclude_radius(self) -> float | None:
        return self.options.exclude_radius

    @property
    def nbatch(self) -> int:
        return self.ra.shape[0]

    @property
    def na(self) -> int:
        return self.ra.shape[1]

    @property
    def k_rank(self) -> int:
        """How many best rows the search keeps: two at least for the ratio test; with
        ``exclude_radius``, one more than the pixels within that radius of the best, so that a
        runner-up beyond it is among them wherever b has one."""
        if self.ratio is None:
            return self.k
        if self.exclude_radius is None:
            return max(self.k, 2)
        side = 2 * math.floor(self.radius) + 1
        return min(max(self.k, side * side + 1), self.nb)

    @property
    def radius(self) -> float:
        """``exclude_radius`` clamped to b's diagonal: beyond it, every pixel of b lies within."""
        return min(self.exclude_radius or 0.0, math.hypot(*self.grid_b[-2:]))

    def pixels_searched(self, share: Callable[[int], int] | None = None) -> int:
        """The rows the search ranks, for a progress bar: a's allowed rows, and with ``mutual``
        the mutual check's allowed rows of b too (``share(n)``: this process's share of n)."""
        total = 0
        for i in range(self.nbatch):
            for side, (held, wanted) in enumerate(((self.na, True), (self.rb.shape[1], self.mutual))):
                rows = self.rows(side, i)
                n = held if rows is None else rows.numel()
                total += (n if share is None else share(n)) if wanted else 0
        return total

    @property
    def reserved(self) -> int:
        """Bytes of the budget the mask row lists take."""
        return 8 * (self.na + self.nb)

    def search(self, on_tile: Callable[[int], None] | None = None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """:func:`densematch.engine.topk` with this call's metric, budget and precision bound:
        what both passes search with, in one process or in each shard."""
        if on_tile is None:  # the densematch::topk operator: one node for compile, export and trace
            return functools.partial(engine.search, metric=self.metric, budget=self.budget, precision=self.precision)
        return functools.partial(
            engine.topk, metric=self.metric, budget=self.budget, precision=self.precision, on_tile=on_tile
        )

    def rows(self, side: int, i: int) -> torch.Tensor | None:
        """The allowed rows of a (``side`` 0) or of the held rows of b (1) in batch item ``i``."""
        mask = self.masks[side]
        return None if mask is None else mask[i].reshape(-1).nonzero().squeeze(1)


def validate(
    a: Any,
    b: Any,
    options: MatchOptions,
    mask_a: Any = None,
    mask_b: Any = None,
    *,
    nb: int | None = None,
    grid_b: tuple[int, ...] | None = None,
    empty_b: bool = False,
) -> Task:
    """The :func:`match` call of ``options`` on these inputs: what depends on the data is
    checked here (shapes, k against b's pixels, masks, finite values, 2-D grids where the
    options place or exclude). ``nb`` and ``grid_b`` give the whole of b where this process
    holds only a band of it (``empty_b``: a band may have no rows)."""
    layout = options.layout
    ra, grid_a, batched_a = check_features(a, "a", layout, finite=False)
    rb, band_grid, batched_b = check_features(b, "b", layout, finite=False, empty=empty_b)
    check_pair(ra, rb, batched_a, batched_b)
    whole_grid = band_grid if grid_b is None else grid_b
    total = rb.shape[1] if nb is None else nb
    k = check_int(options.k, "k", 1, total)
    if (options.places or options.exclude_radius is not None) and (layout == "flat" or len(whole_grid) != 2):
        raise ValueError(
            f"refine, stride, offset and exclude_radius need 2-D grids (layout 'hwc' or 'chw'), got layout "
            f"{layout!r} with b's grid {whole_grid}"
        )
    nbatch = ra.shape[0]
    masks = (
        check_batch_mask(mask_a, "mask_a", nbatch, grid_a, batched_a, ra.device),
        check_batch_mask(mask_b, "mask_b", nbatch, band_grid, batched_a, ra.device),
    )
    # masked-out pixels are never read, so they may hold anything (NaN padding of ragged batches)
    for rows, mask, name in ((ra, masks[0], "a"), (rb, masks[1], "b")):
        check_finite(rows, name, mask=None if mask is None else mask.reshape(nbatch, -1))
    m = get_metric(options.metric)
    return Task(
        ra=ra,
        rb=rb,
        grid_a=grid_a,
        grid_b=whole_grid,
        batched=batched_a,
        masks=masks,
        options=options,
        metric=m,
        k=k,
        precision=resolve_precision(options.precision, ra.device, m),
        budget=resolve_memory(options.memory, ra.device),
        nb=total,
    )


Forward = Callable[[int, "torch.Tensor | None", int], tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[[int, "torch.Tensor | None"], torch.Tensor]


def solve(task: Task, forward: Forward, backward: Backward) -> Matches:
    """The matches of ``task``, from ``forward(i, rows_a, k)``: the (value, index) top-k over
    the whole of b of the allowed rows of a in batch item ``i``, indices in the whole of b, and
    ``backward(i, rows_a)``: for every row of the whole of b, its best allowed row of a (-1 for
    a row that may not be chosen). The filters and the packing are the same however those two
    are computed (one process, or shards of a sharded search)."""
    nbatch, na, k = task.nbatch, task.na, task.k
    # the results' own passes over (na, k) run on this thread alone, so that they wake no OpenMP
    # team to spin on the cores a threaded search takes (threads.own_thread)
    with own_thread():
        index = torch.full((nbatch, na, k), -1, dtype=torch.int64, device=task.ra.device)
        score = torch.full((nbatch, na, k), float("nan"), dtype=task.precision.dtype, device=task.ra.device)
        valid = torch.zeros((nbatch, na, k), dtype=torch.bool, device=task.ra.device)
    for i in range(nbatch):
        rows_a = task.rows(0, i)
        v, idx = forward(i, rows_a, task.k_rank)
        owner = backward(i, rows_a) if task.mutual else None
        with own_thread():
            ok = idx >= 0
            if task.ratio is not None:
                pair_v, pair_i = (v[:, :2], idx[:, :2]) if task.exclude_radius is None else _runner_up(v, idx, task)
                ok &= _passes_ratio(task.metric.ratio_distance(pair_v), pair_i, task.ratio)[:, None]
            v, idx, ok = v[:, :k], idx[:, :k], ok[:, :k]
            if owner is not None:
                me = torch.arange(na, device=idx.device) if rows_a is None else rows_a
                ok &= owner[idx.clamp_min(0)] == me[:, None]
            target = slice(None) if rows_a is None else rows_a
            index[i, target] = idx
            score[i, target] = v
            valid[i, target] = ok
    shape = (*((nbatch,) if task.batched else ()), *task.grid_a, *((k,) if k > 1 else ()))
    index, score, valid = (t.reshape(shape) for t in (index, score, valid))
    coords = None
    if task.layout != "flat":
        width = task.grid_b[1]
        with own_thread():
            coords = torch.stack((index.div(width, rounding_mode="floor"), index.remainder(width)), dim=-1)
            coords = torch.where(index[..., None] >= 0, coords, -1)
    return Matches(index=index, coords=coords, score=score, valid=valid)


def owners(back: torch.Tensor, rows_b: torch.Tensor | None, nb: int) -> torch.Tensor:
    """(nb,) the best row of a of every row of b, from ``back``, that of the allowed rows
    ``rows_b`` (all rows when None); -1 for the others."""
    owner = torch.full((nb,), -1, dtype=torch.int64, device=back.device)
    owner[rows_b if rows_b is not None else slice(None)] = back
    return owner


def _runner_up(v: torch.Tensor, idx: torch.Tensor, task: Task) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 2) values and indices of the best and of the best candidate farther than
    ``task.exclude_radius`` pixels (Euclidean, in b's grid) from it; index -1 where none is."""
    width, radius = task.grid_b[1], task.radius
    rows, cols = idx.div(width, rounding_mode="floor"), idx.remainder(width)
    far = (rows - rows[:, :1]).square() + (cols - cols[:, :1]).square() > radius**2
    far &= idx >= 0
    far[:, 0] = False
    second = far.to(torch.uint8).argmax(1, keepdim=True)  # the first far candidate, best first
    has = far.any(1, keepdim=True)
    pair_v = torch.cat([v[:, :1], v.gather(1, second)], 1)
    pair_i = torch.cat([idx[:, :1], torch.where(has, idx.gather(1, second), -1)], 1)
    return pair_v, pair_i


def _passes_ratio(d: torch.Tensor, idx: torch.Tensor, ratio: float) -> torch.Tensor:
    """Lowe's test on the best two distances d (n, 2): d1 <= ratio * d2, and d2 > 0 (a second
    candidate at distance 0 makes the match ambiguous); a pixel with no second candidate passes."""
    return (idx[:, 1] < 0) | ((d[:, 1] > 0) & (d[:, 0] <= ratio * d[:, 1]))


class DenseMatcher(nn.Module):
    """:func:`match` as a module: the settings are checked and stored, ``forward(a, b)`` matches.

    Parameters
    ----------
    options : MatchOptions, optional
        The settings, already built; or give them as keywords instead:
    **settings
        metric, k, mutual, ratio, layout, memory, progress, precision, refine, stride, offset
        and exclude_radius, as in :func:`match`, checked here (``k`` against b's pixels at each
        call). Each is readable as an attribute (``matcher.k``).

    Examples
    --------
    >>> m = DenseMatcher(metric="l2", k=3)
    >>> m
    DenseMatcher(metric='l2', k=3, layout='hwc', precision='exact')
    >>> m(torch.randn(8, 8, 4), torch.randn(6, 9, 4)).index.shape
    torch.Size([8, 8, 3])
    """

    def __init__(self, options: MatchOptions | None = None, /, **settings: Any) -> None:
        super().__init__()
        if options is not None and settings:
            raise TypeError(f"DenseMatcher takes a MatchOptions or keywords, not both; got both and {sorted(settings)}")
        if options is not None and not isinstance(options, MatchOptions):
            raise TypeError(
                f"options must be a MatchOptions, got {type(options).__name__}; give the settings as keywords "
                "(DenseMatcher(**settings)) or build MatchOptions(**settings)"
            )
        self.options = MatchOptions(**settings) if options is None else options

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options")
        if name in _OPTION_NAMES and options is not None:
            return getattr(options, name)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        """A setting assigned (``matcher.k = 5``) is checked and applies from the next call: the
        options are rebuilt with it, never shadowed by an attribute that matching would not read."""
        if name in _OPTION_NAMES and "options" in self.__dict__:
            self.options = replace(self.options, **{name: value})
            return
        super().__setattr__(name, value)

    def forward(self, a: Any, b: Any, *, mask_a: Any = None, mask_b: Any = None) -> Matches:
        return run(a, b, self.options, mask_a=mask_a, mask_b=mask_b)

    def extra_repr(self) -> str:
        return self.options.shown()
